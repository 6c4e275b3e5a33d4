"""Runtime switches: which implementation each part of the model uses.

Architecture lives in `ModelConfig`; these are the knobs an ablation flips. A `Runtime` is frozen
and hashable, so it is a static argument of the jitted steps: each setting compiles its own program.
"""

import dataclasses
from typing import Literal

from glmjax.config import ModelConfig, derive_indexer_types
from glmjax.quant import DENSE_IMPLS, IMPLS, PAIR_ROUTINGS

Attention = Literal["dense", "sparse", "pallas"]
ATTENTION_IMPLS = ("dense", "sparse", "pallas")
MATMUL_IMPLS = IMPLS  # xla, pallas, pallas_ptx, pallas_ptx_f16, pallas_hfma2 (glmjax.quant)
QUERY_DTYPES = ("float32", "bfloat16")  # precision of the queries entering the DSA kernels
CACHE_WRITES = ("xla", "pallas")  # the decode step's cache write: paged.write_layer or its one-launch kernel
MOE_ROUTINGS = ("table", "scan", *PAIR_ROUTINGS)  # how the MoE kernels find the chosen experts (quant.moe_experts)
ROUTERS = ("xla", "pallas")  # the MoE router's expert choice: glmjax.moe.route or its one-launch kernel
VALUE_MERGES = ("xla", "pallas")  # sparse MLA's split merge and value product: XLA's kernels or one launch
MLA_EPILOGUES = ("xla", "pallas")  # q_a's and kv_a's RMSNorms and k_pe's RoPE: XLA's kernels or one launch
INDEXER_KEYS = ("xla", "pallas")  # the indexer's key and head weights from wk's GEMV: XLA's kernels or one launch
QUERY_ABSORBS = ("xla", "pallas")  # MLA's absorbed decode query from q_b's partials: XLA's kernels or one launch


@dataclasses.dataclass(frozen=True)
class Runtime:
  """attention: dense (masked attention over every cached token, the reference), sparse (jnp
  gather of the selected tokens and lax.top_k), pallas (the kernels in pallas_kernels/).
  indexer_pattern: per decoder layer, whether it runs its own indexer (else it reuses the
  nearest preceding layer's top-k). matmul: weight-only quantized matmuls through XLA or Pallas
  (pallas_ptx: Pallas with the inline-PTX NVFP4 decode; pallas_ptx_f16: that with fp16
  tensor-core operands; pallas_hfma2: that with one-row NVFP4 linears on the CUDA cores).
  dense_matmul: the model's plain bf16 linears at decode, XLA's einsum or the split-K Pallas
  GEMV (pallas_kernels/bf16_matmul.py), or that with the projections sharing their input in one
  launch ("pallas_grouped": q_a with kv_a, the indexer's wk with weights_proj, an MLP's gate
  with up).
  cache_write: the new tokens' write into a layer's pages, XLA's scatters (paged.write_layer,
  about eight kernels) or one Pallas launch (pallas_kernels/paged_write.py; same pages).
  moe_routing: under a Pallas matmul, how the MoE kernels find the chosen experts: "table"
  (built by XLA) or "scan" (each program scans the step's ids; no XLA kernels) for the grouped
  tensor-core kernels, or "pairs": each (token, local expert) pair a one-row product on the CUDA
  cores (pallas_kernels/moe_hfma2.py; NVFP4 experts under matmul="pallas_hfma2" only), or
  "pairs_fused": that with the activations' fp16 planes built in one launch each.
  router: the MoE router's choice of experts from its logits, XLA's kernels (glmjax.moe.route:
  the split-K sum, a sort, the weights' gather and normalisation) or one Pallas launch from the
  GEMV's partials (pallas_kernels/moe_route.py; the same choices wherever the summed logits agree).
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
  indexer_keys: the indexer's new key (k_norm, RoPE) and head weights (the H^-0.5 scale) from
  their grouped GEMV: XLA's kernels or one Pallas launch from its partials at decode
  (pallas_kernels/indexer_keys.py; equal to fp32 rounding).
  topk_ties: "index" (lower position wins among equal indexer scores) or "torch_cpu" (torch's
  CPU choice, emulated on the host: only for bit-exact comparison with transformers).
  topk_method: the Pallas top-k's algorithm under attention="pallas" (pallas_kernels/topk.py:
  "sampled", the default, or "radix"; both exact).
  indexer_orientation: the Pallas scores kernel's MMA rows (IndexerScoresConfig.orientation):
  "keys" (the default; each warp sums its keys' heads in registers) or "heads" (the head sum
  reduced across warps); the same scores up to the order of fp32 sums.
  indexer_queries: the indexer queries' precision, "float32" (the Indexer's own; the Pallas
  scores kernel splits them into three bf16 MMA terms to stay exact) or "bfloat16" (rounded
  once, one MMA term: a third of the kernel's tensor-core work; every attention implementation
  rounds the same way, so they still select alike).
  attention_queries: the decode attention's absorbed queries, "float32" (the sparse MLA kernel
  splits them, and the softmax weights, into three bf16 MMA terms) or "bfloat16" (FlashMLA's
  numerics: one term, softmax weights in bf16; the jnp sparse path rounds its weights to bf16
  too, but against the row's maximum rather than the kernel's running one, so the two agree to
  bf16 rounding, not bit for bit: greedy tokens may differ at near-ties).
  """
  attention: Attention = "dense"
  indexer_pattern: tuple[bool, ...] | None = None
  matmul: str = "xla"
  dense_matmul: str = "xla"
  cache_write: str = "xla"
  moe_routing: str = "table"
  router: str = "xla"
  value_merge: str = "xla"
  query_absorb: str = "xla"
  indexer_keys: str = "xla"
  mla_epilogue: str = "xla"
  topk_ties: str = "index"
  topk_method: str = "sampled"
  indexer_orientation: str = "keys"
  indexer_queries: str = "float32"
  attention_queries: str = "float32"

  def __post_init__(self):
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
    if self.topk_ties not in ("index", "torch_cpu"):
      raise ValueError(f"topk_ties must be 'index' or 'torch_cpu', got {self.topk_ties!r}")
    if self.matmul not in MATMUL_IMPLS:
      raise ValueError(f"matmul must be one of {MATMUL_IMPLS}, got {self.matmul!r}")
    if self.dense_matmul not in DENSE_IMPLS:
      raise ValueError(f"dense_matmul must be one of {DENSE_IMPLS}, got {self.dense_matmul!r}")
    if self.cache_write not in CACHE_WRITES:
      raise ValueError(f"cache_write must be one of {CACHE_WRITES}, got {self.cache_write!r}")
    if self.moe_routing not in MOE_ROUTINGS:
      raise ValueError(f"moe_routing must be one of {MOE_ROUTINGS}, got {self.moe_routing!r}")
    if self.router not in ROUTERS:
      raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
    if self.value_merge not in VALUE_MERGES:
      raise ValueError(f"value_merge must be one of {VALUE_MERGES}, got {self.value_merge!r}")
    if self.query_absorb not in QUERY_ABSORBS:
      raise ValueError(f"query_absorb must be one of {QUERY_ABSORBS}, got {self.query_absorb!r}")
    if self.indexer_keys not in INDEXER_KEYS:
      raise ValueError(f"indexer_keys must be one of {INDEXER_KEYS}, got {self.indexer_keys!r}")
    if self.mla_epilogue not in MLA_EPILOGUES:
      raise ValueError(f"mla_epilogue must be one of {MLA_EPILOGUES}, got {self.mla_epilogue!r}")
    if self.value_merge == "pallas" and self.attention != "pallas":
      raise ValueError(f"value_merge='pallas' is the Pallas sparse MLA kernel's merge: it needs "
                       f"attention='pallas', got {self.attention!r}")
    if self.moe_routing in PAIR_ROUTINGS and self.matmul != "pallas_hfma2":
      raise ValueError(f"moe_routing={self.moe_routing!r} runs the experts on the CUDA cores' fp16x2 FMAs: it "
                       f"needs matmul='pallas_hfma2', got {self.matmul!r}")
    for name in ("indexer_queries", "attention_queries"):
      if getattr(self, name) not in QUERY_DTYPES:
        raise ValueError(f"{name} must be one of {QUERY_DTYPES}, got {getattr(self, name)!r}")
    from pallas_kernels.indexer_scores import ORIENTATIONS  # the kernels import glmjax: imported when needed
    from pallas_kernels.topk import METHODS
    if self.topk_method not in METHODS:
      raise ValueError(f"topk_method must be one of {METHODS}, got {self.topk_method!r}")
    if self.indexer_orientation not in ORIENTATIONS:
      raise ValueError(f"indexer_orientation must be one of {ORIENTATIONS}, got {self.indexer_orientation!r}")

  @property
  def linear_impls(self) -> dict[str, str]:
    """The keyword arguments of `Linear` / `MLP` calls: quantized and plain-weight matmuls."""
    return dict(matmul=self.matmul, dense=self.dense_matmul)

  def runs_indexer(self, layer_id: int, has_indexer: bool) -> bool:
    """Without a pattern, layers that have indexer weights run them. Layers past the pattern
    (the MTP layer) follow their weights too."""
    if self.indexer_pattern is None or layer_id >= len(self.indexer_pattern):
      return has_indexer
    return self.indexer_pattern[layer_id]


def make_runtime(config: ModelConfig, *, attention: Attention = "sparse", index_share: str | int = "on",
                 matmul: str = "xla", dense_matmul: str = "xla", cache_write: str = "xla",
                 moe_routing: str = "table", router: str = "xla", value_merge: str = "xla",
                 query_absorb: str = "xla", indexer_keys: str = "xla", mla_epilogue: str = "xla",
                 topk_method: str = "sampled",
                 indexer_orientation: str = "keys", indexer_queries: str = "float32",
                 attention_queries: str = "float32") -> Runtime:
  """index_share: "on" honours the config's full/shared pattern, "off" runs every layer's
  indexer, an integer N keeps every N-th indexer (transformers' freq rule, offset 0)."""
  if index_share == "on":
    types = config.indexer_types
  elif index_share == "off":
    types = ("full",) * config.num_hidden_layers
  else:
    freq = int(index_share)
    if freq <= 0:
      raise ValueError(f"index_share frequency must be positive, got {index_share!r}")
    types = derive_indexer_types(config.num_hidden_layers, freq=freq, offset=1)
  return Runtime(attention=attention, indexer_pattern=tuple(t == "full" for t in types), matmul=matmul,
                 dense_matmul=dense_matmul, cache_write=cache_write, moe_routing=moe_routing, router=router,
                 value_merge=value_merge, query_absorb=query_absorb, indexer_keys=indexer_keys,
                 mla_epilogue=mla_epilogue,
                 topk_method=topk_method, indexer_orientation=indexer_orientation, indexer_queries=indexer_queries,
                 attention_queries=attention_queries)
