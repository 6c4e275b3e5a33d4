"""Each collective of a TEP=N decode step timed alone on the mesh: what glmjax.parallel.comm_model
assumes (a fixed latency each, plus bytes at NVLink speed), measured on the machine at hand.

  python -m experiments.collective_bench --output=collectives.json      # every visible GPU
  python -m experiments.collective_bench --cpu_devices=8 --quick        # dry run

Why alone: inside a decode step a collective's kernel also waits for the slowest device, so a
profile of the step (experiments.multigpu_run) cannot tell link time from imbalance. On two H200s
the step's collective kernels summed 20.9 ms a step where the model predicts 0.35 (BENCHMARKS.md
run 27). How each is timed: glmjax/parallel/comm_bench.py.

Output: a row per collective with its count in a step, the measured and the modelled time, and
the latency its measurement implies. The summary has the step's collectives measured against
the model, and the one latency that makes the model match. `experiments.tep_project
--latency_us` takes that latency.
"""


import jax
from absl import app, flags

from configs import get_model_config
from experiments import write_json
from glmjax import parallel
from glmjax.parallel.comm_bench import bench_collectives

_CONFIG = flags.DEFINE_string("config", "glm5", "model preset (its hidden size sets the all-reduces' bytes)")
_TEP = flags.DEFINE_integer("tep", 0, "TEP degree (0: every visible device)")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (dry runs)")
_DRAFT = flags.DEFINE_integer("draft_steps", 4, "MTP drafts per step (k): the verify pass's k + 1 tokens")
_LATENCY = flags.DEFINE_float("latency_us", 5.0, "the model's per-collective latency, for comparison")
_CHAIN = flags.DEFINE_integer("chain", 16, "collectives chained in the longer program")
_QUICK = flags.DEFINE_bool("quick", False, "few iterations (dry runs)")
_OUTPUT = flags.DEFINE_string("output", "collectives.json", "JSON output path ('' for none)")


def main(argv: list[str]) -> None:
  del argv
  if _CPU_DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  mesh = parallel.make_mesh(_TEP.value or jax.device_count())
  result = bench_collectives(get_model_config(_CONFIG.value), mesh, draft_steps=_DRAFT.value, chain=_CHAIN.value,
                             latency_us=_LATENCY.value, **(dict(iters=3, repeats=1) if _QUICK.value else {}))
  s = result["summary"]
  print(f"{'collective':<11} {'bytes':>8} {'a step':>6} {'measured us':>11} {'model us':>8} {'latency us':>10}  where")
  for r in result["rows"]:
    print(f"{r['kind']:<11} {r['nbytes']:>8} {r['count']:>6} {r['measured_us']:>11.2f} {r['model_us']:>8.2f} "
          f"{r['implied_latency_us']:>10.2f}  {r['where']}")
  print(f"TEP={s['tep']} ({s['devices'][0]}): {s['collectives']} collectives a step, {s['step_measured_ms']:.3f} ms "
        f"measured against {s['step_model_ms']:.3f} modelled at {s['model_latency_us']} us each; the model matches "
        f"at {s['matching_latency_us']:.2f} us a collective")
  write_json(_OUTPUT.value, result)


if __name__ == "__main__":
  app.run(main)
