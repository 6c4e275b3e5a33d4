"""Each collective of a TEP=N decode step timed alone on a mesh: what `comm_model` assumes (a fixed
latency each, plus bytes at NVLink speed), measured (experiments/collective_bench.py runs it).

Each distinct collective of `comm_model.step_collectives` runs `chain` times back to back in one
program, each on the last one's result, and its time is the difference between that program and a
single-collective one over the difference of their lengths, so the timing loop's own cost cancels
(glmjax.bench.time_device: a loop inside one program, median of repeats).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from glmjax.bench import time_device
from glmjax.config import ModelConfig
from glmjax.parallel import comm_model
from glmjax.parallel.mesh import TEP


def chained(kind: str, nbytes: int, mesh, length: int):
  """(fn, x): `length` collectives of `kind` whose result is `nbytes`, each on the previous one's
  result, inside one shard_map over the mesh's "tep" axis; x, the devices' blocks stacked on axis
  0. All-reduce: bf16 [1, nbytes / 2] a device, summed over the devices (and scaled back, so the
  chain's values stay finite; the time follows the bytes, not the dtype). All-gather: f32
  [tokens, 1] a device, gathered to [tokens, tep] (the draft's and the sampling's best logit a
  device), of which the next takes the maximum."""
  tep = mesh.shape[TEP]
  if kind == "all-reduce":
    x = jnp.ones((tep, max(1, nbytes // 2)), jnp.bfloat16)
    step = lambda v: lax.psum(v, TEP) * (1.0 / tep)
  elif kind == "all-gather":
    x = jnp.ones((nbytes // 4, 1), jnp.float32)  # tep blocks of the result's tokens
    step = lambda v: 0.5 * jnp.max(lax.all_gather(v, TEP, axis=1, tiled=True), axis=1, keepdims=True)
  else:
    raise ValueError(f"unknown collective kind {kind!r}")

  def body(v):
    for _ in range(length):
      v = step(v)
    return v

  fn = jax.shard_map(body, mesh=mesh, in_specs=P(TEP), out_specs=P(TEP), check_vma=False)
  return fn, jax.device_put(x, jax.NamedSharding(mesh, P(TEP)))


def bench_collectives(config: ModelConfig, mesh, *, draft_steps: int, chain: int, latency_us: float,
                      iters: int = 50, repeats: int = 5) -> dict[str, Any]:
  """Rows (one per distinct collective of a decode step) and a summary; see the module docstring."""
  if chain < 2:
    raise ValueError(f"chain must be >= 2 (the time is a difference of two lengths), got {chain}")
  tep = mesh.shape[TEP]
  link = comm_model.Link(latency=latency_us * 1e-6)
  collectives = comm_model.step_collectives(config, tep=tep, draft_steps=draft_steps, act_bytes=2)
  rows, measured = [], {}
  for c in collectives:
    key = (c.kind, c.nbytes)
    if key not in measured:
      times = []
      for length in (1, chain):
        fn, x = chained(c.kind, c.nbytes, mesh, length)
        times.append(time_device(fn, x, iters=iters, repeats=repeats))
      measured[key] = (times[1] - times[0]) / (chain - 1)
    seconds, transfer = measured[key], c.transfer_seconds(tep, link)
    rows.append(dict(kind=c.kind, nbytes=c.nbytes, count=c.count, where=c.where, measured_us=seconds * 1e6,
                     model_us=c.seconds(tep, link) * 1e6, implied_latency_us=(seconds - transfer) * 1e6))
  count = sum(r["count"] for r in rows)
  step_measured = sum(r["count"] * r["measured_us"] for r in rows)
  step_model = sum(r["count"] * r["model_us"] for r in rows)
  transfer_us = sum(c.count * c.transfer_seconds(tep, link) for c in collectives) * 1e6
  summary = dict(tep=tep, devices=[d.device_kind for d in mesh.devices.flat], draft_steps=draft_steps,
                 collectives=count, step_measured_ms=step_measured * 1e-3, step_model_ms=step_model * 1e-3,
                 model_latency_us=latency_us, matching_latency_us=(step_measured - transfer_us) / count)
  return dict(summary=summary, rows=rows)
