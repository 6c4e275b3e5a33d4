"""Projected TEP=8 decode speed: one rank's measured step time plus the step's collectives.

  python -m experiments.tep_project --rank_step_ms=MS --draft_steps=3 --accept_length=3.48
  python -m experiments.tep_project --config=tep8_shard --context=80000 --measure_layers=4,8  # on a GPU
  python -m experiments.tep_project --config=tep8_shard --context=80000 --measure_layers=4,8 \
      --draft_steps=4 --accept_length=3.5                      # the speculative step, k = 4
  python -m experiments.tep_project --config=tep8_shard --indexer_types_of=glm5_2 ...  # with IndexShare
  python -m experiments.tep_project --config=tiny --full_config=tiny --tep=2 --context=256 --quick

`--config` is the model one rank runs (tep8_shard: 8 of 64 heads, 32 of 256 experts, 1/8 of the
vocabulary and of the MLPs' intermediates; the router still scores all 256 experts and ids of
other ranks' experts add nothing locally). Without --rank_step_ms, its decode step is timed on
the current device: the engine's
decode program (steps.decode_loop, batch 1; with --draft_steps=k the speculative program
speculative.spec_decode_loop, every step drafting k tokens with the MTP layer and verifying k+1)
over a cache of `--context` random tokens, as the difference of two loop lengths divided by the
difference of their step counts, so dispatch drops out. (On random weights the drafts are
rejected, so a speculative step emits ~1 token here; its time does not depend on acceptance,
which --accept_length supplies.) tep8_shard does not fit one H200 in bf16
(~197 GB): --measure_layers=a,b[,c...] times models of those layer counts and extends a least-squares
line through them to every layer (three or more counts also give the slope's standard error;
with --indexer_types_of, IndexShare's full and shared layers each get their own line:
step_timing.measure_rank_step).
--layer_kernels also profiles each program once after timing it and prints what one decoder
layer launches (kernel families by device time: the fewest and most layers' difference over
their layer counts, experiments.step_timing.layer_difference; under a mixed IndexShare
schedule, each kind's averaged by the schedule). The collectives come from
glmjax.parallel.comm_model (its docstring states the link and latency assumptions); the table
shows several latencies. The printout also compares the weights the rank config holds with what
one device holds in the rules' layout (glmjax.parallel.rules).
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import app, flags

from configs import get_model_config, with_indexer_types_of
from experiments import kernel_flags, write_json
from experiments.step_timing import measure_rank_step
from glmjax import parallel
from glmjax.config import ModelConfig
from glmjax.footprint import H200_BANDWIDTH
from glmjax.model import abstract_params
from glmjax.parallel import comm_model
from glmjax.runtime import ATTENTION_IMPLS

_CONFIG = flags.DEFINE_string("config", "tep8_shard", "the model one rank runs (timed here)")
_FULL = flags.DEFINE_string("full_config", "glm5", "the whole model, for the layout comparison")
_TEP = flags.DEFINE_integer("tep", 8, "TEP degree (GPUs)")
_INDEXERS_OF = flags.DEFINE_string("indexer_types_of", "", "a config whose IndexShare schedule the rank takes "
                                   "(glm5_2: 21 of 78 layers run their indexer); '' keeps --config's")
_RANK_STEP = flags.DEFINE_float("rank_step_ms", 0.0, "measured per-rank step; 0: time it here")
_CONTEXT = flags.DEFINE_integer("context", 80_000, "cached tokens of the timed decode")
_LAYERS = flags.DEFINE_list("measure_layers", [], "a,b[,c...]: time models of these layer counts, fit a line, "
                            "extend it to every layer")
_ATTENTION = flags.DEFINE_enum("attention", "sparse", list(ATTENTION_IMPLS), "DSA attention")
_WEIGHTS = flags.DEFINE_enum("weights", "bf16", ["bf16", "fp8", "nvfp4_experts", "nvfp4"],
                             "weight format of the random params (glmjax.quant policies)")
_MATMUL = kernel_flags.define_matmul("xla")
_KV = flags.DEFINE_enum("kv_dtype", "bf16", ["bf16", "fp8"], "KV page storage")
_KERNEL_SWITCHES = kernel_flags.define()
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "params and compute dtype")
_STEPS = flags.DEFINE_integer("decode_steps", 16, "extra decode steps of the longer timed loop")
_QUICK = flags.DEFINE_bool("quick", False, "few timing iterations (CPU smoke runs)")
_DRAFT = flags.DEFINE_integer("draft_steps", 0, "MTP draft passes per step (verify draft_steps+1)")
_ACCEPT = flags.DEFINE_float("accept_length", 1.0, "tokens emitted per step (<= draft_steps + 1)")
_LATENCY = flags.DEFINE_list("latency_us", ["5", "10", "15"], "per-collective latencies to show")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gbs", comm_model.NVLINK4_BANDWIDTH / 1e9,
                                "link bandwidth per direction per GPU, GB/s")
_LAYER_KERNELS = flags.DEFINE_bool("layer_kernels", False, "also profile the timed programs: one layer's kernels")
_OUTPUT = flags.DEFINE_string("output", "tep_project.json", "JSON output path ('' for none)")

def device_weight_bytes(config: ModelConfig, tep: int, dtype: str) -> int:
  """Param bytes one device holds in the rules' TEP layout."""
  abstract = abstract_params(config, param_dtype=jnp.dtype(dtype))
  shardings = jax.tree.leaves(parallel.param_shardings(abstract, parallel.abstract_mesh(tep)))
  return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
             for a, s in zip(jax.tree.leaves(nn.unbox(abstract)), shardings))


def layout_comparison(rank: ModelConfig, full: ModelConfig, tep: int, dtype: str) -> dict[str, float]:
  """Weights the rank config holds vs one device of the rules' layout. The tensors that differ
  (indexer heads, dense MLPs, shared expert) are read whole every step, so the difference over
  the H200 bandwidth estimates the layout's rank step minus the timed rank's."""
  held = sum(a.size * a.dtype.itemsize
             for a in jax.tree.leaves(nn.unbox(abstract_params(rank, param_dtype=jnp.dtype(dtype)))))
  layout = device_weight_bytes(full, tep, dtype)
  return dict(rank_config_gb=held / 1e9, layout_gb=layout / 1e9,
              bandwidth_ms=(layout - held) / H200_BANDWIDTH * 1e3)


def format_report(report: dict[str, Any]) -> str:
  rows = report["projection"]
  lines = ["assumptions:"] + [f"  {a}" for a in report["assumptions"]]
  lines += ["", f"{'latency us':>10}{'colls/step':>11}{'comm ms':>9}{'rank ms':>9}{'step ms':>9}"
            f"{'tok/s':>9}{'comm %':>8}"]
  lines += [f"{r['latency_us']:>10.1f}{r['collectives']:>11}{r['comm_ms']:>9.3f}{r['rank_step_ms']:>9.3f}"
            f"{r['step_ms']:>9.3f}{r['tokens_per_s']:>9.1f}{100 * r['comm_share']:>8.1f}" for r in rows]
  lines += ["", "collectives of one step (latency row 1):"]
  lines += [f"  {c['count']:>4} x {c['kind']:<10} {c['nbytes']:>9,} B  {c['us_each']:7.2f} us  {c['where']}"
            for c in rows[0]["detail"]]
  measured = report["measured"]
  if "per_layer_s" in measured:
    stderr = measured.get("per_layer_stderr_s")
    lines += ["", f"one decoder layer: {1e6 * measured['per_layer_s']:.1f} us"
                  + (f" +- {1e6 * stderr:.1f} (slope's standard error)" if stderr is not None else "")
                  + f", fitted to the step times of {measured['measured_layers']} layers: "
                  + ", ".join(f"{1e3 * t:.3f}" for t in measured["measured_s"]) + " ms"]
    if "per_layer_by_indexer" in measured:
      lines[-1] += (" (the fewest, then each count's programs with all later layers of one indexer kind: "
                    + ", ".join(f"{kind} {1e6 * seconds:.1f} us a layer"
                                for kind, seconds in measured["per_layer_by_indexer"].items())
                    + ")")
  kernels = measured.get("layer_kernels")
  if kernels:
    launches, own, idle = (sum(row[i] for row in kernels) for i in (1, 2, 3))
    lines += ["", f"one decoder layer's kernels (profile): {launches:.1f} launches, {own:.1f} us of kernel "
                  f"time, {idle:.1f} us idle before them; the {min(len(kernels), 25)} costliest (own + idle):"]
    lines += [f"  {us:9.2f} us {gap:9.2f} us idle {n:6.2f} x  {name}" for name, n, us, gap in kernels[:25]]
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  kernel_flags.apply_preset()
  rank, full, tep = get_model_config(_CONFIG.value), get_model_config(_FULL.value), _TEP.value
  rank, full = (with_indexer_types_of(c, _INDEXERS_OF.value) for c in (rank, full))
  act_bytes = jnp.dtype(_DTYPE.value).itemsize
  if _RANK_STEP.value > 0:
    measured = dict(rank_step_s=_RANK_STEP.value / 1e3, source="--rank_step_ms")
  else:
    measured = measure_rank_step(rank, [int(n) for n in _LAYERS.value], context=_CONTEXT.value,
                                 attention=_ATTENTION.value, matmul=_MATMUL.value, kv_dtype=_KV.value,
                                 dtype=_DTYPE.value, steps_apart=_STEPS.value, quick=_QUICK.value,
                                 draft_steps=_DRAFT.value, weights=_WEIGHTS.value,
                                 kernel_switches=_KERNEL_SWITCHES(), kernels=_LAYER_KERNELS.value)
    schedule = f" with {_INDEXERS_OF.value}'s IndexShare schedule" if _INDEXERS_OF.value else ""
    measured |= dict(source=f"timed on {jax.devices()[0].device_kind}: {_CONFIG.value}{schedule}, context "
                            f"{_CONTEXT.value}, {_ATTENTION.value} attention, {_WEIGHTS.value} weights, "
                            f"{_MATMUL.value} matmuls, {_KV.value} KV, {_DTYPE.value}, {_DRAFT.value} draft step(s), "
                            + ", ".join(f"{k}={v}" for k, v in _KERNEL_SWITCHES().items()))
  layout = layout_comparison(rank, full, tep, _DTYPE.value)
  rows = [comm_model.project(full, rank_step_s=measured["rank_step_s"], tep=tep, accept_length=_ACCEPT.value,
                             draft_steps=_DRAFT.value, act_bytes=act_bytes,
                             link=comm_model.Link(bandwidth=_BANDWIDTH.value * 1e9, latency=float(us) * 1e-6))
          for us in _LATENCY.value]
  report = dict(
    config=_CONFIG.value, full_config=_FULL.value, indexer_types=list(rank.indexer_types), tep=tep,
    measured=measured, layout=layout,
    draft_steps=_DRAFT.value, accept_length=_ACCEPT.value, projection=rows,
    assumptions=[
      f"per-rank step: {measured['source']}: {measured['rank_step_s'] * 1e3:.3f} ms (collectives excluded)",
      f"link: {_BANDWIDTH.value:.0f} GB/s per direction per GPU (NVLink 4, NVIDIA H200 datasheet: "
      "900 GB/s bidirectional); ring algorithms",
      "latency per collective: assumed (8-15 us small NCCL all-reduce on 8 GPUs, ~5 us one-shot "
      "custom all-reduce); collectives do not overlap compute (each layer waits for its sums)",
      f"step: verify {_DRAFT.value + 1} token(s) through {full.num_hidden_layers} layers + {_DRAFT.value} "
      f"MTP draft pass(es); {_ACCEPT.value} tokens emitted per step",
      f"weights: the rank config holds {layout['rank_config_gb']:.2f} GB, one device of the rules' layout "
      f"{layout['layout_gb']:.2f} GB: the layout's rank would take {layout['bandwidth_ms']:+.3f} ms/step "
      f"at {H200_BANDWIDTH / 1e12:.2f} TB/s (not applied)",
    ])
  print(format_report(report))
  write_json(_OUTPUT.value, report)


if __name__ == "__main__":
  app.run(main)
