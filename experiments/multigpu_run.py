"""TEP=N decode of GLM-5 on a real N-GPU machine, against the one-rank projection (issue 9).

  python -m experiments.multigpu_run --tep=8 --layers=0 --output=multigpu.json      # 8xH200
  python -m experiments.multigpu_run --tep=2 --layers=12                           # 2 GPUs: 12 layers fit
  python -m experiments.multigpu_run --config=tiny --tep=8 --cpu_devices=8 --context=256 --quick  # dry run

Random weights in the `--weights` layout (default NVFP4 routed experts), sharded over the mesh as
they are made (each device creates only its shards); a random cache of `--context` tokens; the
speculative decode step (k = `--draft_steps` MTP drafts, k+1 verified) timed as
experiments.tep_project times one rank (experiments/step_timing.py), by the difference of two
loop lengths. `--layers`: the first N decoder layers (0: all), for machines the whole model does
not fit (GLM-5 in NVFP4 experts is ~420 GB: 8 H200s; fewer GPUs take fewer layers, and the JSON
says how many).
A profile of one call of the longer loop gives the device time spent in collectives per step,
compared with glmjax.parallel.comm_model's prediction for the same step; tokens/s is at the
stated `--accept_length`. A collective's kernel in that profile also waits for the slower GPU;
experiments.collective_bench times each collective alone.
"""

from typing import Any

import jax
from absl import app, flags

from configs import get_model_config
from experiments import kernel_flags, write_json
from experiments.step_timing import time_decode_step, with_layers
from glmjax import parallel
from glmjax.bench import device_kernel_times
from glmjax.parallel import comm_model

_CONFIG = flags.DEFINE_string("config", "glm5", "model preset")
_LAYERS = flags.DEFINE_integer("layers", 0, "decoder layers to build (0: all of them)")
_TEP = flags.DEFINE_integer("tep", 0, "TEP degree (0: every visible device)")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (dry runs)")
_CONTEXT = flags.DEFINE_integer("context", 80_000, "cached tokens")
_DRAFT = flags.DEFINE_integer("draft_steps", 4, "MTP drafts per step (k)")
_ACCEPT = flags.DEFINE_float("accept_length", 3.5, "tokens emitted per step (GLM-5 MTP on SGLang: 3.48)")
_WEIGHTS = flags.DEFINE_enum("weights", "nvfp4_experts", ["bf16", "fp8", "nvfp4_experts", "nvfp4"], "weight layout")
_MATMUL = kernel_flags.define_matmul("pallas")
_ATTENTION = flags.DEFINE_enum("attention", "sparse", ["dense", "sparse", "pallas"], "DSA attention")
_KERNEL_SWITCHES = kernel_flags.define()
_KV = flags.DEFINE_enum("kv_dtype", "fp8", ["bf16", "fp8"], "KV page storage")
_STEPS = flags.DEFINE_integer("decode_steps", 16, "extra tokens of the longer timed loop")
_LATENCY = flags.DEFINE_float("latency_us", 10.0, "per-collective latency of the prediction")
_QUICK = flags.DEFINE_bool("quick", False, "one repeat per length (dry runs)")
_TRACE = flags.DEFINE_string("trace_dir", "/tmp/multigpu_trace", "where the profile of one call goes")
_OUTPUT = flags.DEFINE_string("output", "multigpu.json", "JSON output path ('' for none)")

COLLECTIVE_NAMES = ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "all_gather", "allgather",
                    "reduce-scatter", "all-to-all", "alltoall", "collective-permute")


def collective_us(times: dict[str, tuple[int, float, float]]) -> float:
  """Device microseconds of the collective kernels among `times` (glmjax.bench.device_kernel_times)."""
  return sum(us for name, (_, us, _) in times.items() if any(c in name.lower() for c in COLLECTIVE_NAMES))


def main(argv: list[str]) -> None:
  del argv
  kernel_flags.apply_preset()
  if _CPU_DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  full = get_model_config(_CONFIG.value)
  config = with_layers(full, _LAYERS.value, mtp=_DRAFT.value > 0) if _LAYERS.value else full
  tep = _TEP.value or jax.device_count()
  mesh = parallel.make_mesh(tep)
  parallel.check_config(config, mesh)
  timed = time_decode_step(config, context=_CONTEXT.value, attention=_ATTENTION.value, matmul=_MATMUL.value,
                           kv_dtype=_KV.value, dtype="bfloat16", steps_apart=_STEPS.value, quick=_QUICK.value,
                           draft_steps=_DRAFT.value, weights=_WEIGHTS.value, mesh=mesh, trace_dir=_TRACE.value,
                           kernel_switches=_KERNEL_SWITCHES())
  step_s = timed.seconds
  times = device_kernel_times(_TRACE.value)
  link = comm_model.Link(bandwidth=comm_model.NVLINK4_BANDWIDTH, latency=_LATENCY.value * 1e-6)
  predicted = comm_model.project(config, rank_step_s=step_s, tep=tep, link=link, accept_length=_ACCEPT.value,
                                 draft_steps=_DRAFT.value, act_bytes=2)
  report: dict[str, Any] = dict(
      config=_CONFIG.value, layers=config.num_hidden_layers, of_layers=full.num_hidden_layers, tep=tep,
      devices=[d.device_kind for d in mesh.devices.flat], context=_CONTEXT.value, draft_steps=_DRAFT.value,
      accept_length=_ACCEPT.value, weights=_WEIGHTS.value, matmul=_MATMUL.value, kv_dtype=_KV.value,
      **_KERNEL_SWITCHES(), step_s=step_s, tokens_per_s=_ACCEPT.value / step_s,
      # The trace holds one call of the longer loop.
      collective_s_per_step=collective_us(times) * 1e-6 / timed.long_loop_steps if times else None,
      predicted_comm_s_per_step=predicted["comm_ms"] * 1e-3, predicted_collectives=predicted["collectives"],
      kernel_times_us={name: us for name, (_, us, _) in sorted(times.items(), key=lambda kv: -kv[1][1])[:40]})
  collectives = ("not in the trace" if report["collective_s_per_step"] is None
                 else f"{report['collective_s_per_step'] * 1e3:.3f} ms")
  print(f"{config.num_hidden_layers}/{full.num_hidden_layers} layers of {_CONFIG.value}, TEP={tep} "
        f"({report['devices'][0]}), {_CONTEXT.value} context, k={_DRAFT.value}: step {step_s * 1e3:.3f} ms, "
        f"{report['tokens_per_s']:.1f} tok/s at acceptance {_ACCEPT.value}; collectives {collectives} per step "
        f"(model: {report['predicted_comm_s_per_step'] * 1e3:.3f} ms, {predicted['collectives']} collectives)")
  write_json(_OUTPUT.value, report)


if __name__ == "__main__":
  app.run(main)
