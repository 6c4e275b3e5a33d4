"""Run presets: named sets of the experiments' implementation flags, so a sweep or a notebook
names a measured stack instead of spelling out twenty switches.

  python -m experiments.tep_project --config=tep8_shard --preset=rank_fastest --measure_layers=3,8
  python -m experiments.replay --config=tiny --preset=kernels_bf16 --kv_dtype=fp8   # a flag overrides

`--preset` is defined by every experiment that builds a Runtime from flags (replay, tep_project,
multigpu_run: experiments.kernel_flags.apply_preset); a flag given on the command line keeps its
value. Keys are those experiments' flag names: `EXPERIMENT_FLAGS` plus glmjax.runtime.Runtime's
fields, whose dependencies (a fold's prerequisites) Runtime checks when the run starts.
"""

from glmjax.runtime import FOLD_SWITCHES

# The flags a preset may set besides Runtime's fields: the experiments' own weight and KV formats.
EXPERIMENT_FLAGS = ("weights", "kv_dtype")

# Every fold measured faster (or no slower) in the rank's step; swiglu, moe_sum and next_norm stay
# off, each measured slower there (docs/STUDY.md, runs 27 and 40), and shared_down until it is timed.
_FASTER_FOLDS = dict.fromkeys(sorted(set(FOLD_SWITCHES) - {"swiglu", "moe_sum", "next_norm", "shared_down"}),
                              "pallas")
# The folds that ride on the NVFP4 experts' planes launch (moe_routing="pairs_fused").
PLANES_FOLDS = ("route_planes", "shared_swiglu")

# The Pallas kernels with the reference's numerics: bf16 weights and KV pages, fp32 queries into
# the DSA kernels; the folds equal XLA's kernels up to the order of fp32 sums (route_planes, the
# NVFP4 experts' own, aside).
KERNELS_BF16 = dict(attention="pallas", dense_matmul="pallas_grouped", weights="bf16", kv_dtype="bf16",
                    indexer_queries="float32", attention_queries="float32",
                    **{name: on for name, on in _FASTER_FOLDS.items() if name not in PLANES_FOLDS})

# The fastest stack timed on a TEP=8 rank (docs/BENCHMARKS.md run 41: 20.0 launches a layer on an
# H100): NVFP4 experts on the CUDA cores from fragment-ordered weights, FP8 KV pages, bf16 queries
# into the DSA kernels (FlashMLA's numerics), every faster fold.
RANK_FASTEST = dict(KERNELS_BF16, weights="nvfp4_experts", kv_dtype="fp8", indexer_queries="bfloat16",
                    attention_queries="bfloat16", matmul="pallas_fragments", moe_routing="pairs_fused",
                    **{name: "pallas" for name in PLANES_FOLDS})

RUN_PRESETS = {"kernels_bf16": KERNELS_BF16, "rank_fastest": RANK_FASTEST}


def get_run_preset(name: str) -> dict[str, str]:
  """The flag values of preset `name` (a copy)."""
  if name not in RUN_PRESETS:
    raise ValueError(f"preset: unknown run preset {name!r}; known: {', '.join(RUN_PRESETS)}")
  return dict(RUN_PRESETS[name])
