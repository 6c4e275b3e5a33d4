"""Device timing as the device tool's METHOD.md asks: a loop inside one program, median of repeats.

Dispatching one jitted call costs the host about 32 us on the H200 (58 us with a sync), more than
many kernels take, so back-to-back dispatches measure the host. `time_device` instead compiles
`iters` calls of `fn` into one `lax.fori_loop` and times that program; an optimization barrier on
the loop-carried inputs keeps XLA from hoisting the loop-invariant call out of the loop.
"""

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp


def time_device(fn: Callable[..., Any], *args: Any, iters: int = 50, repeats: int = 5,
                warmup: int = 1) -> float:
  """Median seconds per call of `fn(*args)` (a jax-traceable function)."""
  def loop(args):
    def body(_, carry):
      args, acc = carry
      args = jax.lax.optimization_barrier(args)
      first = jax.tree.leaves(fn(*args))[0]
      return args, acc + first.ravel()[0].astype(jnp.float32)
    return jax.lax.fori_loop(0, iters, body, (args, jnp.float32(0)))[1]
  program = jax.jit(loop)
  for _ in range(warmup):
    jax.block_until_ready(program(args))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(program(args))
    per_call.append((time.perf_counter() - start) / iters)
  return statistics.median(per_call)


def bandwidth_tbs(num_bytes: float, seconds: float) -> float:
  """Achieved bandwidth in TB/s for `num_bytes` moved in `seconds`."""
  return num_bytes / seconds / 1e12


@contextlib.contextmanager
def maybe_profile(log_dir: str) -> Iterator[None]:
  """A jax.profiler trace (TensorBoard / XProf) of the block into log_dir; nothing when empty."""
  if not log_dir:
    yield
    return
  with jax.profiler.trace(log_dir):
    yield
