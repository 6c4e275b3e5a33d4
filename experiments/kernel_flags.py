"""Kernel switches as absl flags, shared by the experiments that build a Runtime (replay,
tep_project, multigpu_run, quant_eval): --matmul (`define_matmul`, each experiment with its own
default), and --dense_matmul, --moe_routing, the fold switches (glmjax.runtime.FOLD_SWITCHES:
--cache_write, --router, --router_group, --value_merge, --query_absorb, --indexer_keys,
--mla_epilogue, --index_epilogue, --epilogue_write, --index_query, --residual_norm,
--route_planes, --shared_swiglu, --shared_down, --next_norm, --swiglu, --moe_sum) with the DSA kernels'
--topk_method, --topk_trials, --topk_sample, --topk_one_launch, --pairs_wide_words, --warm_o_proj,
--indexer_orientation, --indexer_splits, --indexer_block_k, --indexer_warps, --indexer_stages,
--indexer_prefetch, --attention_warps, --attention_scales, --attention_block_n, the folds'
--fold_splits, --indexer_queries, --attention_queries, --tensor_parallel, --fragment_operands and
--expert_operands (`define`); glmjax.runtime.Runtime's fields of those names. `define` also
defines --preset (configs/runs.py), which the experiment's main applies first (`apply_preset`)."""

from typing import Callable

from absl import flags

from configs.runs import RUN_PRESETS, get_run_preset
from glmjax.quant import DENSE_IMPLS, FRAGMENT_OPERAND_CHOICES, FRAGMENT_OPERANDS
from glmjax.runtime import (FOLD_SWITCHES, FOLDS, INDEXER_QUERY_DTYPES, MATMUL_IMPLS, MOE_ROUTINGS, QUERY_DTYPES,
                            TENSOR_PARALLEL)
from pallas_kernels.indexer_scores import ORIENTATIONS
from pallas_kernels.sparse_mla import SCALE_PLACES
from pallas_kernels.topk import METHODS, SAMPLE_SOURCES


def define_matmul(default: str) -> flags.FlagHolder[str]:
  """--matmul: the weight-only quantized matmuls' implementation."""
  return flags.DEFINE_enum("matmul", default, list(MATMUL_IMPLS),
                           "quantized matmuls: xla (dequantize, einsum), pallas (the weight-only kernels; "
                           "the grouped MoE reads only the chosen experts), pallas_ptx (pallas with the "
                           "inline-PTX NVFP4 decode), pallas_ptx_f16 (pallas_ptx with fp16 tensor-core "
                           "operands: no bf16 conversion of the decoded weights), pallas_hfma2 "
                           "(pallas_ptx_f16 with one-row NVFP4 linears on the CUDA cores' fp16x2 FMAs), "
                           "pallas_fragments (pallas_hfma2 with 2-D NVFP4 weights in mma.sync fragment order, "
                           "arranged once at load, up to 8 rows a launch)")


# The help of each fold switch (glmjax.runtime.FOLD_SWITCHES): what XLA does, what one launch does.
_FOLD_HELP = {
    "cache_write": "the decode step's cache write: xla (scatters) or pallas (one launch a layer)",
    "router": "the MoE router's expert choice: xla (sum, sort, gather: about five kernels) or pallas (one launch "
              "from the router GEMV's partials)",
    "router_group": "with --router=pallas --dense_matmul=pallas_grouped: the router's GEMV in its own launch (xla) "
                    "or pallas (in the shared expert's gate/up launch)",
    "value_merge": "sparse MLA's split merge and value product (--attention=pallas): xla (about six kernels) or "
                   "pallas (one launch)",
    "query_absorb": "MLA's absorbed decode query from q_b's output: xla (sum, RoPE, W_UK copy and dot: about four "
                    "kernels) or pallas (one launch from q_b's partials)",
    "indexer_keys": "the indexer's new key and head weights from their GEMV: xla (k_norm, RoPE, scale: about four "
                    "kernels) or pallas (one launch from the GEMV's partials)",
    "mla_epilogue": "MLA's q_a and kv_a RMSNorms and k_pe RoPE after their GEMV: xla (three kernels) or pallas "
                    "(one launch from the GEMV's partials)",
    "index_epilogue": "with --mla_epilogue=pallas --indexer_keys=pallas: xla (each its GEMV and epilogue launches) "
                      "or pallas (the indexer's wk and weights_proj in q_a/kv_a's GEMV, its key epilogue in MLA's)",
    "epilogue_write": "with --cache_write, --mla_epilogue and --index_epilogue pallas: the cache write in its own "
                      "launch (xla: paged_write's) or pallas (in MLA's epilogue launch)",
    "index_query": "with --query_absorb=pallas: the indexer's query from its wq_b partials (sum, RoPE): xla (one "
                   "kernel) or pallas (in the absorbed-query launch)",
    "residual_norm": "the residual add after attention and post_attention_layernorm: xla (two kernels) or pallas "
                     "(one launch from o_proj's partials)",
    "route_planes": "with --router=pallas --moe_routing=pairs_fused: the experts' x planes in their own launch "
                    "(xla) or as more programs of the router's launch (pallas)",
    "shared_swiglu": "with --route_planes=pallas --router_group=pallas: the shared expert's silu(gate) * up in "
                     "XLA (xla) or as more programs of the router's launch (pallas)",
    "shared_down": "with --shared_swiglu=pallas: the shared expert's down GEMV in its own launch (xla) or as more "
                   "programs of the routed experts' gate/up launch (pallas)",
    "next_norm": "a layer's closing residual add and the next layer's input_layernorm (the final norm after the "
                 "last): xla (two kernels) or pallas (one launch from the MLP's down partials)",
    "swiglu": "an MLP's silu(gate) * up between its GEMVs (dense layers, shared expert): xla (one kernel) or pallas "
              "(in the down GEMV's launch from the gate/up partials)",
    "moe_sum": "with --swiglu=pallas: an MoE layer's residual + routed + shared sum: xla (one kernel) or pallas (in "
               "the shared expert's down GEMV launch)",
}


class _SplitsParser(flags.ArgumentParser):
  """--fold_splits: a count as an int, a rule's name as given (Runtime checks either)."""

  def parse(self, argument):
    return int(argument) if str(argument).isdigit() else argument

  def flag_type(self) -> str:
    return "string"


def apply_preset(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Sets the flags of --preset (configs/runs.py) that the command line did not give; a preset
  key the experiment does not define is a ValueError naming it. Call first in main."""
  name = flag_values["preset"].value
  if not name:
    return
  preset = get_run_preset(name)
  missing = sorted(set(preset) - set(flag_values))
  if missing:
    raise ValueError(f"preset {name!r} sets --{', --'.join(missing)}, which this experiment does not define")
  for flag, value in preset.items():
    flag_values.set_default(flag, value)


def define() -> Callable[[], dict[str, str | int]]:
  """Defines the flags and --preset; returns a function reading the flags as `make_runtime`
  keyword arguments."""
  flags.DEFINE_enum("preset", "", ["", *RUN_PRESETS], "a run preset of configs/runs.py: its flags' values where "
                    "the command line gives none ('': none)")
  switches = {
      "dense_matmul": flags.DEFINE_enum("dense_matmul", "xla", list(DENSE_IMPLS),
                                        "plain bf16 linears at decode: xla (einsum), pallas (the split-K GEMV) or "
                                        "pallas_grouped (that, with the projections sharing an input in one launch)"),
      "moe_routing": flags.DEFINE_enum("moe_routing", "table", list(MOE_ROUTINGS),
                                       "the MoE kernels' expert lookup: table (XLA) or scan (in-kernel) for the "
                                       "grouped tensor-core kernels, or pairs (each token-expert pair a one-row "
                                       "product on the CUDA cores; NVFP4 experts, --matmul=pallas_hfma2), "
                                       "pairs_fused (that, the activations' fp16 planes in one launch each), or "
                                       "fragments (each chosen expert read once for all tokens on the fragment "
                                       "GEMV; --matmul=pallas_fragments)"),
      **{name: flags.DEFINE_enum(name, "xla", list(FOLDS), _FOLD_HELP[name]) for name in FOLD_SWITCHES},
      "topk_method": flags.DEFINE_enum("topk_method", "sampled", list(METHODS),
                                       "the Pallas top-k's algorithm (--attention=pallas)"),
      "topk_sample": flags.DEFINE_enum("topk_sample", "scores", list(SAMPLE_SOURCES),
                                       "where the sampled top-k's threshold reads its sample: scores (written by "
                                       "the scoring kernel) or row (gathered from the scores)"),
      "topk_one_launch": flags.DEFINE_bool("topk_one_launch", False, "the sampled top-k's count, compaction and "
                                           "select in one launch (look-back offsets; the last program selects)"),
      "pairs_wide_words": flags.DEFINE_bool("pairs_wide_words", False, "--moe_routing=pairs(_fused): the experts' "
                                            "launches load the NVFP4 code words 32 bytes a thread (a layout hint; "
                                            "the same values)"),
      "warm_o_proj": flags.DEFINE_bool("warm_o_proj", False, "the sparse MLA launch prefetches the layer's o_proj "
                                       "weight into L2 for the GEMV after it (the same values)"),
      "topk_trials": flags.DEFINE_integer("topk_trials", 0, "the keys the sampled top-k's threshold search "
                                          "counts at per step: 0 (its default, 4), or a power of two <= 32 (1: one "
                                          "guess a step)"),
      "indexer_orientation": flags.DEFINE_enum("indexer_orientation", "keys", list(ORIENTATIONS),
                                               "the Pallas indexer scores kernel's MMA rows: keys (head sums within "
                                               "a warp) or heads (across warps)"),
      "indexer_splits": flags.DEFINE_integer("indexer_splits", 0, "the Pallas indexer scores kernel's programs per "
                                             "sequence: 0 (its default, about 256) or a power of two <= 1024"),
      "indexer_block_k": flags.DEFINE_integer("indexer_block_k", 0, "that kernel's keys per loop step: 0 (its "
                                              "default, 64) or a power of two >= 16"),
      "indexer_warps": flags.DEFINE_integer("indexer_warps", 0, "that kernel's warps per program: 0 (its default, "
                                            "4), 1, 2, 4, 8 or 16"),
      "indexer_stages": flags.DEFINE_integer("indexer_stages", 0, "that kernel's software-pipeline stages: 0 (its "
                                             "default, 1) or a count >= 1"),
      "indexer_prefetch": flags.DEFINE_bool("indexer_prefetch", False, "that kernel's programs issue all their key "
                                            "blocks' loads before the first dot (the same scores)"),
      "attention_warps": flags.DEFINE_integer("attention_warps", 0, "the Pallas sparse MLA kernel's warps per "
                                              "program: 0 (its default, 4), 1, 2, 4, 8 or 16"),
      "attention_scales": flags.DEFINE_enum("attention_scales", "auto", list(SCALE_PLACES), "where that "
                                            "kernel applies the FP8 latent scales: before its dots on the rows, "
                                            "after them on the columns, or auto (columns under bf16 queries)"),
      "attention_block_n": flags.DEFINE_integer("attention_block_n", 0, "that kernel's selected rows a loop step: "
                                                "0 (its default: 64 for the columns under bf16 queries, else 32) "
                                                "or a power of two >= 16"),
      "fold_splits": flags.DEFINE(_SplitsParser(), "fold_splits", "fill", "the K splits of a bf16 GEMV whose "
                                  "partials a fold reads (o_proj, the q_a and q_b groups): fill (the fewest that "
                                  "cover the SMs), rule (the GEMV's own) or a cap >= 1"),
      "indexer_queries": flags.DEFINE_enum("indexer_queries", "float32", list(INDEXER_QUERY_DTYPES),
                                           "precision of the indexer's queries (float8_e4m3fn: codes, their "
                                           "scales folded into the head weights)"),
      "attention_queries": flags.DEFINE_enum("attention_queries", "float32", list(QUERY_DTYPES),
                                             "precision of the decode attention's queries (bfloat16: FlashMLA's "
                                             "numerics)"),
      "tensor_parallel": flags.DEFINE_enum("tensor_parallel", "shard_map", list(TENSOR_PARALLEL),
                                           "under --tep > 1: each layer's attention and dense MLP as shard_maps "
                                           "(kernels read their slice) or gspmd (which gathers the sharded weights "
                                           "Pallas calls read)"),
      "fragment_operands": flags.DEFINE_enum("fragment_operands", "auto", list(FRAGMENT_OPERAND_CHOICES),
                                             "--matmul=pallas_fragments' MMA operands: float16 (x scaled into fp16 "
                                             "by its row maximum in a launch before the GEMV), bfloat16 (K "
                                             "permuted in the weights' order so the GEMV reads x's rows itself) "
                                             "or auto (bfloat16 up to 2^25 weights, float16 above)"),
      "expert_operands": flags.DEFINE_enum("expert_operands", "bfloat16", list(FRAGMENT_OPERANDS),
                                           "--moe_routing=fragments' MMA operands: bfloat16 (x and h read as "
                                           "they are) or float16 (x and h scaled into fp16 by their row maxima)"),
  }
  return lambda: {name: flag.value for name, flag in switches.items()}
