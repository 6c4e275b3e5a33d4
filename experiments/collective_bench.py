"""Each collective of a TEP=N decode step timed alone on the mesh: what glmjax.parallel.comm_model
assumes (a fixed latency each, plus bytes at NVLink speed), measured on the machine at hand.

  python -m experiments.collective_bench --output=collectives.json      # every visible GPU
  python -m experiments.collective_bench --cpu_devices=8 --quick        # dry run

Why alone: inside a decode step a collective's kernel also waits for the slowest device, so a
profile of the step (experiments.multigpu_run) cannot tell link time from imbalance. On two H200s
the step's collective kernels summed 20.9 ms a step where the model predicts 0.35 (BENCHMARKS.md
run 27). Here each distinct collective of `comm_model.step_collectives` (the all-reduces of
[tokens, hidden] activations, the sampling's all-gathers) runs `--chain` times back to back in
one program, each on the last one's result. Its time is the difference between that program and
a single-collective one, over the difference of their lengths, so the timing loop's own cost
cancels (glmjax.bench.time_device: a loop inside one program, median of repeats).

Output: a row per collective with its count in a step, the measured and the modelled time, and
the latency its measurement implies. The summary has the step's collectives measured against
the model, and the one latency that makes the model match. `experiments.tep_project
--latency_us` takes that latency.
"""

import json
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax
from jax.sharding import PartitionSpec as P

from configs import get_model_config
from glmjax import parallel
from glmjax.bench import time_device
from glmjax.config import ModelConfig
from glmjax.parallel import comm_model

_CONFIG = flags.DEFINE_string("config", "glm5", "model preset (its hidden size sets the all-reduces' bytes)")
_TEP = flags.DEFINE_integer("tep", 0, "TEP degree (0: every visible device)")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (dry runs)")
_DRAFT = flags.DEFINE_integer("draft_steps", 4, "MTP drafts per step (k): the verify pass's k + 1 tokens")
_LATENCY = flags.DEFINE_float("latency_us", 5.0, "the model's per-collective latency, for comparison")
_CHAIN = flags.DEFINE_integer("chain", 16, "collectives chained in the longer program")
_QUICK = flags.DEFINE_bool("quick", False, "few iterations (dry runs)")
_OUTPUT = flags.DEFINE_string("output", "collectives.json", "JSON output path ('' for none)")


def _chained(kind: str, nbytes: int, hidden: int, mesh, length: int):
  """(fn, x): `length` collectives of `kind` whose result is `nbytes`, each on the previous one's
  result, inside one shard_map over the mesh's "tep" axis; x, the devices' blocks stacked on axis
  0. All-reduce: bf16 [tokens, hidden] summed over the devices (and scaled back, so the chain's
  values stay finite). All-gather: f32 [tokens, 1] each, gathered to [tokens, tep] (the
  sampling's per-device best logits), of which the next takes the maximum."""
  tep = mesh.shape[parallel.TEP]
  if kind == "all-reduce":
    x = jnp.ones((tep * (nbytes // (2 * hidden)), hidden), jnp.bfloat16)
    step = lambda v: lax.psum(v, parallel.TEP) * (1.0 / tep)
  elif kind == "all-gather":
    x = jnp.ones((nbytes // 4, 1), jnp.float32)  # tep blocks of the result's tokens
    step = lambda v: 0.5 * jnp.max(lax.all_gather(v, parallel.TEP, axis=1, tiled=True), axis=1, keepdims=True)
  else:
    raise ValueError(f"unknown collective kind {kind!r}")

  def body(v):
    for _ in range(length):
      v = step(v)
    return v

  fn = jax.shard_map(body, mesh=mesh, in_specs=P(parallel.TEP), out_specs=P(parallel.TEP), check_vma=False)
  return fn, jax.device_put(x, jax.NamedSharding(mesh, P(parallel.TEP)))


def bench_collectives(config: ModelConfig, mesh, *, draft_steps: int, chain: int, latency_us: float,
                      iters: int = 50, repeats: int = 5) -> dict[str, Any]:
  """Rows (one per distinct collective of a decode step) and a summary; see the module docstring."""
  if chain < 2:
    raise ValueError(f"chain must be >= 2 (the time is a difference of two lengths), got {chain}")
  tep = mesh.shape[parallel.TEP]
  link = comm_model.Link(latency=latency_us * 1e-6)
  collectives = comm_model.step_collectives(config, tep=tep, draft_steps=draft_steps, act_bytes=2)
  rows, measured = [], {}
  for c in collectives:
    key = (c.kind, c.nbytes)
    if key not in measured:
      times = []
      for length in (1, chain):
        fn, x = _chained(c.kind, c.nbytes, config.hidden_size, mesh, length)
        times.append(time_device(fn, x, iters=iters, repeats=repeats))
      measured[key] = (times[1] - times[0]) / (chain - 1)
    seconds = measured[key]
    bandwidth_s = c.seconds(tep, link) - link.latency
    rows.append(dict(kind=c.kind, nbytes=c.nbytes, count=c.count, where=c.where, measured_us=seconds * 1e6,
                     model_us=c.seconds(tep, link) * 1e6, implied_latency_us=(seconds - bandwidth_s) * 1e6))
  count = sum(r["count"] for r in rows)
  step_measured = sum(r["count"] * r["measured_us"] for r in rows)
  step_model = sum(r["count"] * r["model_us"] for r in rows)
  bandwidth_us = step_model - count * latency_us
  summary = dict(tep=tep, devices=[d.device_kind for d in mesh.devices.flat], draft_steps=draft_steps,
                 collectives=count, step_measured_ms=step_measured * 1e-3, step_model_ms=step_model * 1e-3,
                 model_latency_us=latency_us, matching_latency_us=(step_measured - bandwidth_us) / count)
  return dict(summary=summary, rows=rows)


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
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
