"""Runtime switches: which implementation each part of the model uses.

Architecture lives in `ModelConfig`; these are the knobs an ablation flips. A `Runtime` is frozen
and hashable, so it is a static argument of the jitted steps: each setting compiles its own program.
"""

import dataclasses
from typing import Literal

from glmjax.config import ModelConfig, derive_indexer_types
from glmjax.quant import (DENSE_IMPLS, FRAGMENT_IMPL, FRAGMENT_OPERAND_CHOICES, FRAGMENT_OPERANDS, FRAGMENT_ROUTING,
                          HFMA2_IMPLS, IMPLS, PAIR_ROUTINGS, arrange_params)

Attention = Literal["dense", "sparse", "pallas"]
ATTENTION_IMPLS = ("dense", "sparse", "pallas")
MATMUL_IMPLS = IMPLS  # xla, pallas, pallas_ptx, pallas_ptx_f16, pallas_hfma2, pallas_fragments (glmjax.quant)
QUERY_DTYPES = ("float32", "bfloat16")  # precision of the queries entering the DSA kernels
INDEXER_QUERY_DTYPES = (*QUERY_DTYPES, "float8_e4m3fn")  # ... and the indexer's e4m3 codes (dsa.index_query_operands)
TENSOR_PARALLEL = ("shard_map", "gspmd")  # how a TEP mesh splits a layer's attention and dense MLP
# How the MoE kernels find the chosen experts (quant.moe_experts).
MOE_ROUTINGS = ("table", "scan", *PAIR_ROUTINGS, FRAGMENT_ROUTING)
FOLDS = ("xla", "pallas")  # a fold's choices: XLA's kernels, or the one Pallas launch that replaces them
# The switches that fold a step's XLA kernels into one Pallas launch (Runtime's docstring says what each folds).
FOLD_SWITCHES = ("cache_write", "router", "router_group", "value_merge", "query_absorb", "indexer_keys", "mla_epilogue",
                 "index_epilogue", "epilogue_write", "index_query", "residual_norm", "route_planes", "shared_swiglu",
                 "shared_down", "next_norm", "swiglu", "moe_sum")
_CHOICES = {"attention": ATTENTION_IMPLS, "topk_ties": ("index", "torch_cpu"), "matmul": MATMUL_IMPLS,
            "dense_matmul": DENSE_IMPLS, "moe_routing": MOE_ROUTINGS, **dict.fromkeys(FOLD_SWITCHES, FOLDS),
            "indexer_queries": INDEXER_QUERY_DTYPES, "attention_queries": QUERY_DTYPES,
            "tensor_parallel": TENSOR_PARALLEL, "fragment_operands": FRAGMENT_OPERAND_CHOICES,
            "expert_operands": FRAGMENT_OPERANDS}


@dataclasses.dataclass(frozen=True)
class Runtime:
  """attention: dense (masked attention over every cached token, the reference), sparse (jnp
  gather of the selected tokens and lax.top_k), pallas (the kernels in pallas_kernels/).
  indexer_pattern: per decoder layer, whether it runs its own indexer (else it reuses the
  nearest preceding layer's top-k). matmul: weight-only quantized matmuls through XLA or Pallas
  (pallas_ptx: Pallas with the inline-PTX NVFP4 decode; pallas_ptx_f16: that with fp16
  tensor-core operands; pallas_hfma2: that with one-row NVFP4 linears on the CUDA cores;
  pallas_fragments: that with the 2-D NVFP4 linears of up to 8 rows on mma.sync from fragment
  order, which `arrange` puts the params in).
  dense_matmul: the model's plain bf16 linears at decode, XLA's einsum or the split-K Pallas
  GEMV (pallas_kernels/bf16_matmul.py), or that with the projections sharing their input in one
  launch ("pallas_grouped": q_a with kv_a, the indexer's wk with weights_proj, an MLP's gate
  with up).
  cache_write: the new tokens' write into a layer's pages, XLA's scatters (paged.write_layer,
  about eight kernels) or one Pallas launch (pallas_kernels/paged_write.py; same pages).
  moe_routing: under a Pallas matmul, how the MoE kernels find the chosen experts: "table"
  (built by XLA) or "scan" (each program scans the step's ids; no XLA kernels) for the grouped
  tensor-core kernels, or "pairs": each (token, local expert) pair a one-row product on the CUDA
  cores (pallas_kernels/moe_hfma2.py; NVFP4 experts under matmul="pallas_hfma2" or
  "pallas_fragments" only), or "pairs_fused": that with the activations' fp16 planes built in one
  launch each, or "fragments": each chosen expert read once for all tokens on the fragment GEMV
  (pallas_kernels/moe_fragments.py; matmul="pallas_fragments" only: `arrange` moves the NVFP4
  experts into fragment order too).
  router: the MoE router's choice of experts from its logits, XLA's kernels (glmjax.moe.route:
  the split-K sum, a sort, the weights' gather and normalisation) or one Pallas launch from the
  GEMV's partials (pallas_kernels/moe_route.py; the same choices wherever the summed logits agree).
  router_group: with router="pallas" and dense_matmul="pallas_grouped", "pallas" runs the MoE
  router's GEMV in the shared expert's gate/up launch (all three read the normed x, all plain
  bf16: glmjax.moe.shared_route; under a TEP mesh inside each device's shard_map, the router
  replicated), one launch a MoE layer fewer; the same partials, so the same choice and outputs.
  value_merge: under attention="pallas", the sparse MLA kernel's split merge and kv_b_proj's value
  half: XLA's kernels (the merge's reductions, W_UV's fp32 copy, the dot) or one Pallas launch
  (pallas_kernels/sparse_mla.sparse_mla_decode_values; equal to fp32 rounding).
  query_absorb: the cached path's decode query, q_b_proj's output per head rotated (rope part)
  and moved into the latent space through kv_b_proj's key half (nope part): XLA's kernels (the
  split-K sum, the RoPE stack, W_UK's copy, the dot) or one Pallas launch from q_b's partials
  (pallas_kernels/mla_query.py; equal to fp32 rounding); under dense_matmul="pallas_grouped"
  the indexer's wq_b, which reads q_resid too, joins q_b's GEMV launch.
  mla_epilogue: MLA's projection epilogue, q_a's and kv_a's RMSNorms and k_pe's RoPE after
  their grouped GEMV: XLA's kernels or one Pallas launch from its partials at decode
  (pallas_kernels/mla_epilogue.py; equal up to the fp32 statistics' order).
  index_epilogue: with mla_epilogue and indexer_keys both "pallas", "pallas" joins the indexer's
  to MLA's: its wk and weights_proj in q_a's and kv_a's GEMV launch (all read the normed x) and
  indexer_keys' work in mla_epilogue's launch (the same outputs, bit for bit); "xla": each its own.
  epilogue_write: with cache_write, mla_epilogue and index_epilogue all "pallas", "pallas" moves
  the decode step's cache write into MLA's epilogue launch: its programs write the latent, k_pe
  and indexer key rows they compute into the layer's pages (paged_write's stores, the same bytes),
  one launch a layer fewer; "xla": paged_write's own launch.
  index_query: with query_absorb="pallas", the indexer's query from its wq_b partials (summed,
  the rope columns rotated, cast to indexer_queries): XLA's kernel, or "pallas", in the
  absorbed-query launch (pallas_kernels/mla_query.py; equal to fp32 rounding).
  residual_norm: a decoder layer's residual add after attention and its post_attention_layernorm,
  XLA's two kernels or one Pallas launch from o_proj's partials at decode (under a TEP mesh, from
  the all-reduced output, in the activations' dtype as without it) (pallas_kernels/residual_norm.py;
  equal up to the fp32 statistics' order).
  route_planes: with router="pallas" and moe_routing="pairs_fused", the routed experts' fp16
  activation planes of x in their own launch (hfma2_planes.rows_planes: "xla", as every fold's
  unfolded choice) or "pallas": as more programs of the router's choice launch, side by side
  with it (pallas_kernels/moe_route.route_select_planes; the same bits), at decode on one device
  or one rank's program. Run 40 (H100): one launch and 2.7 us of kernels a layer fewer.
  shared_swiglu: with route_planes and router_group "pallas" (and swiglu "xla"), the shared
  expert's silu(gate) * up from its gate/up partials: XLA's kernel between its two GEMVs, or
  "pallas": as more programs of the router's launch (moe_route.route_select_planes; the MLP's
  bf16 ops rounded one by one, as the swiglu fold does; on a GPU within a bf16 ulp, Triton's
  exp against XLA's). Run 41 (H100): one launch fewer, the step 16.35 -> 16.20 ms; in rank_fastest.
  shared_down: with shared_swiglu "pallas", the shared expert's down GEMV (bf16, its hidden from
  the router's launch): its own split-K launch, or "pallas": as more programs of the routed
  experts' gate/up launch (moe_hfma2's shared_down: neither needs the other's output), the same
  bits; one launch a MoE layer fewer, at decode on one device or one rank's program. Untimed
  (written without a GPU, session 50): the GEMV alone takes 3.35 us for its 3.2 MB on an H100,
  2.3 of them over its bytes (run 55); off until measured.
  next_norm: a decoder layer's closing residual add (its MLP's output) and the next layer's
  input_layernorm (after the last layer the final norm; after the MTP layer's its
  shared_head_norm), XLA's two kernels or one Pallas launch at decode, from the MLP's down
  partials and the routed experts' output (under a TEP mesh, the all-reduced output)
  (pallas_kernels/residual_norm.py; equal up to the fp32 statistics' order). One launch a
  layer fewer, 1.1 us slower in a TEP=8 rank's layer on the H200 (run 40): off by default.
  fold_splits: the K splits of a split-K bf16 GEMV whose partials a fold reads whole (o_proj's
  under residual_norm, q_a's group under mla_epilogue, q_b's under query_absorb; the folds run
  a program per token or head, each reading every split): "fill" (the default: the fewest
  splits whose programs still cover the SMs, pallas_kernels/bf16_matmul.fold_config), "rule"
  (the GEMV's own, about four programs per SM: 8 splits at each of a TEP=8 rank's three, where
  "fill" gives 2, 4 and 2), or a cap >= 1. The router's, the shared expert's and the indexer's
  own key GEMVs keep the rule: their 3-8 column blocks need all 8 splits to cover the SMs. Run
  35/36 (H100, GEMV + fold): o_proj 17.5 -> 13.4 us at 2 splits, the q_a group 17.6 -> 17.1 at
  4, the q_b group 14.8 -> 14.2 at 2.
  swiglu: a SwiGLU MLP's silu(gate) * up (the dense layers' and the shared expert's), XLA's
  kernel (with the gate/up split-K sums) between the two GEMVs, or "pallas": in the down GEMV's
  launch from the gate/up partials at decode, where all three weights take the bf16 GEMV
  (pallas_kernels/bf16_matmul.swiglu_matmul; the same bf16 roundings, sums in split order).
  moe_sum: with swiglu="pallas", an MoE layer's end, residual + routed + shared experts: XLA's
  kernel (with the routed experts' split sums), or "pallas": in the shared expert's down GEMV
  launch, at decode on one device or one rank's program, where that GEMV reads its whole K in one
  program (swiglu_matmul's layer sum; the roundings as written, op by op: on a bf16 residual
  stream XLA's default excess precision may skip one of them, so tokens can differ there).
  indexer_keys: the indexer's new key (k_norm, RoPE) and head weights (the H^-0.5 scale) from
  their grouped GEMV: XLA's kernels or one Pallas launch from its partials at decode
  (pallas_kernels/indexer_keys.py; equal to fp32 rounding).
  topk_ties: "index" (lower position wins among equal indexer scores) or "torch_cpu" (torch's
  CPU choice, emulated on the host: only for bit-exact comparison with transformers).
  topk_method: the Pallas top-k's algorithm under attention="pallas" (pallas_kernels/topk.py:
  "sampled", the default, or "radix"; both exact).
  topk_trials: the keys the sampled top-k's threshold search counts at per step
  (TopKConfig.threshold_trials): 0 for its default (4), 1 for the single-guess search of runs
  17-36; the same selection.
  topk_sample: where the sampled top-k's threshold reads its sample (TopKConfig.sample_source):
  "scores" (the default: the scoring kernel writes it contiguously beside the scores; the count
  launch 2 us faster a layer on an H100, run 38) or "row" (gathered from the score row, runs
  17-37); the same selection.
  topk_one_launch: the sampled top-k's count, compaction and select in one launch
  (TopKConfig.one_launch: look-back offsets, the last program selects) instead of three; the same
  selection. No faster (run 53, H100: 24.6 us and a 1.0 us memset a layer against 23.6-23.9), off.
  pairs_wide_words: under moe_routing "pairs" or "pairs_fused", the routed experts' launches
  with PairsConfig.wide_words: a never-run bf16 store steers Triton into loading the NVFP4 code
  words 32 bytes a thread, so neither K loop moves them through shared memory (ptxas, sm_90:
  gate/up 86 -> 80 registers and 6 programs an SM, down 71 -> 64 and 8; no barrier in either
  K loop). The same values. Untimed (session 50, no GPU), off.
  warm_o_proj: under attention="pallas" at decode, the sparse MLA launch's programs prefetch
  the layer's o_proj weight into L2 (pallas_kernels/sparse_mla.sparse_mla_decode's `warm`), so
  o_proj's GEMV, the launch after the attention's, reads it from L2: the attention is latency-bound
  and leaves DRAM mostly idle. The same values. Moves time rather than saving it (run 53, H100:
  the GEMVs 0.7-1.4 us faster a layer, the attention, whose gathers queue behind the prefetches,
  1.3-1.5 us slower), off.
  indexer_orientation: the Pallas scores kernel's MMA rows (IndexerScoresConfig.orientation):
  "keys" (the default; each warp sums its keys' heads in registers) or "heads" (the head sum
  reduced across warps); the same scores up to the order of fp32 sums.
  indexer_splits, indexer_block_k, indexer_warps, indexer_stages: that kernel's programs per
  sequence, keys per loop step, warps per program and software-pipeline stages
  (IndexerScoresConfig's num_splits, block_k, num_warps, num_stages); 0 for its default (about
  256 programs of 4 warps over 64-key blocks, 1 stage). Any valid choice gives the same scores up
  to the order of the dot's fp32 sums (on an H100, 32-key blocks and 8 warps changed some bits,
  run 36); run 17's defaults were 128 programs, 128 keys, 8 warps, and 2 stages until run 36.
  indexer_prefetch: that kernel's IndexerScoresConfig.prefetch (each program issues all its key
  blocks' loads before its first dot); the same scores bit for bit; off (run 38, H100: slower
  for 5 query tokens, 26.1 against 18.9 us at 80K, faster for 1, 10.4 against 11.5).
  attention_warps: the Pallas sparse MLA kernel's warps per program (SparseMLAConfig.num_warps):
  0 for its default (4; 8 until run 26), the same result.
  attention_scales, attention_block_n: that kernel's FP8 scales ("rows": each latent row tile
  scaled before the dots, the path until session 36; "columns": the dots' columns after them;
  "auto": the columns under bf16 queries, the rows under fp32 ones; SparseMLAConfig.scale_rows)
  and its selected rows a loop step (SparseMLAConfig.block_n; 0: 64 for the columns under bf16
  queries, else 32). Any choice gives the same attention up to the rounding of the dots' sums
  (equal bits under fp32 queries on an H100, within bf16 rounding under bf16 ones: run 43).
  indexer_queries: the indexer queries' precision, "float32" (the Indexer's own; the Pallas
  scores kernel splits them into three bf16 MMA terms to stay exact) or "bfloat16" (rounded
  once, one MMA term: a third of the kernel's tensor-core work; every attention implementation
  rounds the same way, so they still select alike) or "float8_e4m3fn" (e4m3 codes with a
  power-of-two scale per token and head, folded into the head weights: against FP8 key pages
  the scores kernel's dot is e4m3 x e4m3, half the query bytes; every implementation scores the
  same codes: dsa.index_query_operands; run 39, H100: slower for 5 query tokens, 23.9 against
  19.8 us at 80K, and in the step 10 us more kernel time a layer; 1.3 us faster for one).
  attention_queries: the decode attention's absorbed queries, "float32" (the sparse MLA kernel
  splits them, and the softmax weights, into three bf16 MMA terms) or "bfloat16" (FlashMLA's
  numerics: one term, softmax weights in bf16; the jnp sparse path rounds its weights to bf16
  too, but against the row's maximum rather than the kernel's running one, so the two agree to
  bf16 rounding, not bit for bit: greedy tokens may differ at near-ties).
  tensor_parallel: under a TEP mesh, a decoder layer's attention and dense MLP as explicit
  shard_maps (glmjax.parallel.tensor_parallel: each kernel reads its device's slice) or left to
  GSPMD ("gspmd": it partitions XLA's ops, but gathers every sharded weight a Pallas call reads,
  each step); the MoE is expert_parallel's shard_map either way.
  fragment_operands: under matmul="pallas_fragments", the MMA's operand dtype, which `arrange`
  lays the weights out for: "float16" (x scaled into fp16 by its row maximum in a launch before
  each GEMV), "bfloat16" (K permuted in the weights' order, so the GEMV reads x's rows itself:
  one launch fewer; pallas_kernels/nvfp4_fragments.py) or "auto" (the default: each weight's by
  its size, quant.fragments.operands_for). Run 32 (H200): bfloat16 faster on expert-sized
  matrices and in tep8_shard's all-linears NVFP4 step (16.79 -> 15.82 ms), slower at the 117 MB
  GEMV (52.9 against 45.8 us); run 33 put the crossover between 25M and 75M weights.
  expert_operands: under moe_routing="fragments", the routed experts' operand dtype: "bfloat16"
  (x and h read as they are) or "float16" (x scaled into fp16 in a launch before gate/up, h by
  the swiglu launch; fewer instructions a weight; pallas_kernels/moe_fragments.py). On an H100
  fp16 is 6-12% slower at both MoE cases (BENCHMARKS.md run 46).
  """
  attention: Attention = "dense"
  indexer_pattern: tuple[bool, ...] | None = None
  matmul: str = "xla"
  dense_matmul: str = "xla"
  cache_write: str = "xla"
  moe_routing: str = "table"
  router: str = "xla"
  router_group: str = "xla"
  value_merge: str = "xla"
  query_absorb: str = "xla"
  indexer_keys: str = "xla"
  mla_epilogue: str = "xla"
  index_epilogue: str = "xla"
  epilogue_write: str = "xla"
  index_query: str = "xla"
  residual_norm: str = "xla"
  route_planes: str = "xla"
  shared_swiglu: str = "xla"
  shared_down: str = "xla"
  next_norm: str = "xla"
  swiglu: str = "xla"
  moe_sum: str = "xla"
  topk_ties: str = "index"
  topk_method: str = "sampled"
  topk_trials: int = 0
  topk_sample: str = "scores"
  topk_one_launch: bool = False
  pairs_wide_words: bool = False
  warm_o_proj: bool = False
  indexer_orientation: str = "keys"
  indexer_splits: int = 0
  indexer_block_k: int = 0
  indexer_warps: int = 0
  indexer_stages: int = 0
  indexer_prefetch: bool = False
  attention_warps: int = 0
  attention_scales: str = "auto"
  attention_block_n: int = 0
  fold_splits: str | int = "fill"
  indexer_queries: str = "float32"
  attention_queries: str = "float32"
  tensor_parallel: str = "shard_map"
  fragment_operands: str = "auto"
  expert_operands: str = "bfloat16"

  def __post_init__(self):
    from pallas_kernels.indexer_scores import ORIENTATIONS  # the kernels import glmjax: imported when needed
    from pallas_kernels.sparse_mla import SCALE_PLACES
    from pallas_kernels.topk import METHODS, SAMPLE_SOURCES
    from pallas_kernels.checks import check_fold_splits
    for name, choices in {**_CHOICES, "topk_method": METHODS, "topk_sample": SAMPLE_SOURCES,
                          "indexer_orientation": ORIENTATIONS, "attention_scales": tuple(SCALE_PLACES)}.items():
      if getattr(self, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
    self.indexer_scores_config()  # a clear error for a bad indexer_splits, _block_k or _warps
    self.attention_config()  # ... or attention_warps
    self.topk_config()  # ... or topk_trials
    check_fold_splits(self.fold_splits)
    if self.value_merge == "pallas" and self.attention != "pallas":
      raise ValueError(f"value_merge='pallas' is the Pallas sparse MLA kernel's merge: it needs "
                       f"attention='pallas', got {self.attention!r}")
    if self.index_epilogue == "pallas" and (self.mla_epilogue, self.indexer_keys) != ("pallas", "pallas"):
      raise ValueError(f"index_epilogue='pallas' joins the indexer_keys launch to the mla_epilogue one: it needs both "
                       f"'pallas', got mla_epilogue={self.mla_epilogue!r}, indexer_keys={self.indexer_keys!r}")
    if self.router_group == "pallas" and (self.router, self.dense_matmul) != ("pallas", "pallas_grouped"):
      raise ValueError(f"router_group='pallas' runs the router GEMV in the shared expert's grouped launch and "
                       f"chooses from its partials: it needs router='pallas' and dense_matmul='pallas_grouped', got "
                       f"router={self.router!r}, dense_matmul={self.dense_matmul!r}")
    writers = (self.cache_write, self.mla_epilogue, self.index_epilogue)
    if self.epilogue_write == "pallas" and writers != ("pallas",) * 3:
      raise ValueError(f"epilogue_write='pallas' moves paged_write's stores into the joined MLA/indexer epilogue "
                       f"launch: it needs cache_write, mla_epilogue and index_epilogue all 'pallas', got "
                       f"{writers}")
    if self.moe_sum == "pallas" and self.swiglu != "pallas":
      raise ValueError(f"moe_sum='pallas' sums the MoE layer in the shared expert's swiglu launch: it needs "
                       f"swiglu='pallas', got {self.swiglu!r}")
    if self.route_planes == "pallas" and (self.router, self.moe_routing) != ("pallas", "pairs_fused"):
      raise ValueError(f"route_planes='pallas' builds the pairs_fused experts' planes in the router's launch: it "
                       f"needs router='pallas' and moe_routing='pairs_fused', got router={self.router!r}, "
                       f"moe_routing={self.moe_routing!r}")
    if self.shared_swiglu == "pallas" and (self.route_planes, self.router_group, self.swiglu) != (
        "pallas", "pallas", "xla"):
      raise ValueError(f"shared_swiglu='pallas' computes the shared expert's silu(gate) * up in the router's "
                       f"launch from the grouped GEMV's partials: it needs route_planes and router_group 'pallas' "
                       f"and swiglu 'xla', got route_planes={self.route_planes!r}, router_group="
                       f"{self.router_group!r}, swiglu={self.swiglu!r}")
    if self.shared_down == "pallas" and self.shared_swiglu != "pallas":
      raise ValueError(f"shared_down='pallas' runs the shared expert's down GEMV in the routed experts' gate/up "
                       f"launch from the hidden the router's launch builds: it needs shared_swiglu='pallas', got "
                       f"{self.shared_swiglu!r}")
    if self.next_norm == "pallas" and self.moe_sum == "pallas":
      raise ValueError("next_norm='pallas' and moe_sum='pallas' both close an MoE layer in their own launch: "
                       "choose one")
    if self.index_query == "pallas" and self.query_absorb != "pallas":
      raise ValueError(f"index_query='pallas' finishes the indexer's query in the absorbed-query launch: it needs "
                       f"query_absorb='pallas', got {self.query_absorb!r}")
    if self.pairs_wide_words and self.moe_routing not in PAIR_ROUTINGS:
      raise ValueError(f"pairs_wide_words is the pairs kernels' layout hint: it needs moe_routing in {PAIR_ROUTINGS}, "
                       f"got {self.moe_routing!r}")
    if self.moe_routing in PAIR_ROUTINGS and self.matmul not in HFMA2_IMPLS:
      raise ValueError(f"moe_routing={self.moe_routing!r} runs the experts on the CUDA cores' fp16x2 FMAs: it "
                       f"needs matmul in {HFMA2_IMPLS}, got {self.matmul!r}")
    if self.moe_routing == FRAGMENT_ROUTING and self.matmul != FRAGMENT_IMPL:
      raise ValueError(f"moe_routing={FRAGMENT_ROUTING!r} runs the experts on the fragment GEMV: it needs "
                       f"matmul={FRAGMENT_IMPL!r}, got {self.matmul!r}")

  def arrange(self, params):
    """params in the weight layout this runtime's matmul reads: 2-D NVFP4 weights in fragment
    order (for fragment_operands) under matmul="pallas_fragments", and the routed experts too under
    moe_routing="fragments"; in ModelOpt's under the others (quant.arrange_params; params already
    so come back as they are). The entry points taking params and a runtime call it."""
    return arrange_params(params, fragments=self.matmul == FRAGMENT_IMPL, operands=self.fragment_operands,
                          experts=self.moe_routing == FRAGMENT_ROUTING, expert_operands=self.expert_operands)

  @property
  def linear_impls(self) -> dict[str, str]:
    """The keyword arguments of `Linear` / `MLP` calls: quantized and plain-weight matmuls."""
    return dict(matmul=self.matmul, dense=self.dense_matmul)

  @property
  def mlp_impls(self) -> dict[str, str]:
    """The keyword arguments of `MLP` calls: linear_impls and the swiglu fold."""
    return dict(self.linear_impls, swiglu=self.swiglu)

  def indexer_scores_config(self):
    """The Pallas indexer scores kernel's IndexerScoresConfig: its defaults where a field is 0; a
    ValueError naming the field for a bad value."""
    from pallas_kernels.indexer_scores import IndexerScoresConfig  # the kernels import glmjax: imported when needed
    fields = dict(indexer_splits="num_splits", indexer_block_k="block_k", indexer_warps="num_warps",
                  indexer_stages="num_stages")
    return self._kernel_config(IndexerScoresConfig, fields, orientation=self.indexer_orientation,
                               prefetch=self.indexer_prefetch)

  def attention_config(self):
    """The Pallas sparse MLA kernel's SparseMLAConfig, likewise."""
    from pallas_kernels.sparse_mla import SCALE_PLACES, SparseMLAConfig
    return self._kernel_config(SparseMLAConfig, dict(attention_warps="num_warps", attention_block_n="block_n"),
                               scale_rows=SCALE_PLACES[self.attention_scales])

  def topk_config(self):
    """The Pallas top-k's TopKConfig, likewise, with topk_method's algorithm, topk_sample's source and
    topk_one_launch."""
    from pallas_kernels.topk import TopKConfig
    return self._kernel_config(TopKConfig, dict(topk_trials="threshold_trials"), method=self.topk_method,
                               sample_source=self.topk_sample, one_launch=self.topk_one_launch)

  def _kernel_config(self, config_class, fields: dict[str, str], **fixed):
    """config_class(**fixed) with each non-zero Runtime field of `fields` (Runtime name -> config
    name) set; a ValueError naming the Runtime field for a value the config rejects."""
    chosen = {}
    for field, name in fields.items():
      if value := getattr(self, field):
        try:
          config_class(**{name: value})
        except ValueError as e:
          raise ValueError(f"{field} must be 0 (the kernel's default) or a valid {name}: {e}") from e
        chosen[name] = value
    return config_class(**fixed, **chosen)

  def runs_indexer(self, layer_id: int, has_indexer: bool) -> bool:
    """Without a pattern, layers that have indexer weights run them. Layers past the pattern
    (the MTP layer) follow their weights too."""
    if self.indexer_pattern is None or layer_id >= len(self.indexer_pattern):
      return has_indexer
    return self.indexer_pattern[layer_id]


def make_runtime(config: ModelConfig, *, attention: Attention = "sparse", index_share: str | int = "on",
                 **switches) -> Runtime:
  """index_share: "on" honours the config's full/shared pattern, "off" runs every layer's
  indexer, an integer N keeps every N-th indexer (transformers' freq rule, offset 0). switches:
  Runtime's other fields, by name (their defaults where not given)."""
  if index_share == "on":
    types = config.indexer_types
  elif index_share == "off":
    types = ("full",) * config.num_hidden_layers
  else:
    freq = int(index_share)
    if freq <= 0:
      raise ValueError(f"index_share frequency must be positive, got {index_share!r}")
    types = derive_indexer_types(config.num_hidden_layers, freq=freq, offset=1)
  return Runtime(attention=attention, indexer_pattern=tuple(t == "full" for t in types), **switches)
