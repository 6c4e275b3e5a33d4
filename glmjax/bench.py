"""Device timing as the device tool's METHOD.md asks: warm up, dispatch many calls, sync once.

A sync per call measures the host round trip (about 58 us on the H200), not the device work, so
`time_device` enqueues `iters` calls back to back and blocks on the last result only, repeats
that `repeats` times, and reports the median per-call time.
"""

import statistics
import time
from typing import Any, Callable

import jax


def time_device(fn: Callable[..., Any], *args: Any, iters: int = 50, repeats: int = 5,
                warmup: int = 3) -> float:
  """Median seconds per call of `fn(*args)` (fn should be jitted)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / iters)
  return statistics.median(per_call)


def bandwidth_tbs(num_bytes: float, seconds: float) -> float:
  """Achieved bandwidth in TB/s for `num_bytes` moved in `seconds`."""
  return num_bytes / seconds / 1e12
