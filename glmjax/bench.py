"""Device timing as the device tool's METHOD.md asks: a loop inside one program, median of repeats.

Dispatching one jitted call costs the host about 32 us on the H200 (58 us with a sync), more than
many kernels take, so back-to-back dispatches measure the host. `time_device` instead compiles
`iters` calls of `fn` into one `lax.fori_loop` and times that program; an optimization barrier on
the loop-carried inputs keeps XLA from hoisting the loop-invariant call out of the loop; the loop
reads one element of each of fn's outputs, behind another barrier, which keeps XLA computing
them whole. (Before it read one element of the first output alone, and XLA dropped the other
outputs and sliced the first to that element: a two-output XLA reference timed 0.05 us for
1.3 MB, BENCHMARKS.md run 24.)
"""

import collections
import contextlib
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from glmjax import hlo_stats


def _loop_program(fn: Callable[..., Any], iters: int) -> Callable[[tuple], jax.Array]:
  """One jitted program running `fn(*args)` `iters` times (see the module docstring)."""
  def loop(args):
    def body(_, carry):
      args, acc = carry
      args = jax.lax.optimization_barrier(args)
      outs = jax.tree.leaves(jax.lax.optimization_barrier(fn(*args)))
      return args, acc + sum(out.ravel()[0].astype(jnp.float32) for out in outs)
    return jax.lax.fori_loop(0, iters, body, (args, jnp.float32(0)))[1]
  return jax.jit(loop)


def time_device(fn: Callable[..., Any], *args: Any, iters: int = 50, repeats: int = 5,
                warmup: int = 1) -> float:
  """Median seconds per call of `fn(*args)` (a jax-traceable function).

  For kernels of tens of us this includes the gaps between dependent launches (3-4 us each on
  the H200, docs/BENCHMARKS.md run 7; unrolling the loop did not remove them):
  `kernel_breakdown` gives the kernels' own device time.
  """
  program = _loop_program(fn, iters)
  return _median_per_call(program, lambda: args, iters, repeats, warmup)


def time_device_carry(fn: Callable[..., Any], carry: Any, *args: Any, iters: int = 50, repeats: int = 5,
                      warmup: int = 1) -> float:
  """Median seconds per call of `carry = fn(carry, *args)`, the carry threaded through one
  on-device loop (donated: a fresh copy per run, made outside the timing): for functions that
  update a buffer in place, such as a cache write, whose loop-invariant input time_device would
  make XLA copy every call."""
  program = jax.jit(lambda c, a: jax.lax.fori_loop(0, iters, lambda _, c: fn(c, *a), c), donate_argnums=0)
  copies = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, carry))
  return _median_per_call(lambda c: program(c, args), copies, iters, repeats, warmup)


def _median_per_call(run: Callable[[Any], Any], prepare: Callable[[], Any], iters: int, repeats: int,
                     warmup: int) -> float:
  """Median over `repeats` of run(prepare())'s wall time / iters, after `warmup` untimed runs;
  prepare runs outside the timing."""
  for _ in range(warmup):
    jax.block_until_ready(run(prepare()))
  per_call = []
  for _ in range(repeats):
    inputs = prepare()
    start = time.perf_counter()
    jax.block_until_ready(run(inputs))
    per_call.append((time.perf_counter() - start) / iters)
  return statistics.median(per_call)


def agreement(got: Any, want: Any) -> dict[str, Any]:
  """How a timed kernel's output compares with its reference's on the same inputs (a benchmark
  row must not report the speed of a wrong answer). Integer outputs [..., k] (index sets):
  `exact`, whether every row holds the same set. Float outputs: `max_rel_err`, the largest
  difference over the reference's largest magnitude, with `exact` false where the two disagree
  on which entries are infinite."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    return dict(exact=False, max_rel_err=float("inf"))
  if np.issubdtype(got.dtype, np.integer):
    rows = lambda x: np.sort(x.reshape(-1, x.shape[-1]), axis=-1)
    return dict(exact=bool(np.array_equal(rows(got), rows(want))))
  got, want = got.astype(np.float64), want.astype(np.float64)
  finite = np.isfinite(want)
  same_inf = bool(np.array_equal(finite, np.isfinite(got)) and np.array_equal(got[~finite], want[~finite]))
  scale = np.max(np.abs(want[finite]), initial=0.0) or 1.0
  err = np.max(np.abs(got[finite] - want[finite]), initial=0.0) / scale
  return dict(exact=bool(same_inf and err == 0.0), max_rel_err=float(err) if same_inf else float("inf"))


def bandwidth_tbs(num_bytes: float, seconds: float) -> float:
  """Achieved bandwidth in TB/s for `num_bytes` moved in `seconds`."""
  return num_bytes / seconds / 1e12


def read_tbs(nbytes: int = 1 << 30, timer: Callable[..., float] = time_device) -> float:
  """This device's streaming read speed in TB/s: an fp32 sum of `nbytes` of bf16, timed by
  `timer`. The bound of a kernel that streams its weights once, measured in the benchmark's own
  run, not one card's figure (BENCHMARKS.md run 45, H200: 4.57 TB/s, where XLA's bf16 GEMV reads
  at 4.35, and `x + 1`, a read and a write, moves 3.36)."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  return bandwidth_tbs(x.nbytes, timer(lambda a: jnp.sum(a, dtype=jnp.float32), x))


@contextlib.contextmanager
def maybe_profile(log_dir: str) -> Iterator[None]:
  """A jax.profiler trace (TensorBoard / XProf) of the block into log_dir; nothing when empty."""
  if not log_dir:
    yield
    return
  with jax.profiler.trace(log_dir):
    yield


def device_kernel_times(trace_dir: str) -> dict[str, tuple[int, float, float]]:
  """{kernel: (launches, total us, idle us before)} of the device events in the newest perfetto
  trace under trace_dir (glmjax.hlo_stats.perfetto_events). Device events are those of
  processes named "/device:..."; the CPU backend has none, so this is {} there.

  Idle: on each device line (its "Stream ..." lines where the trace names them), the time from
  the end of the event before to the start of this one, charged to this kernel: the device
  waiting for its launch (or its inputs' transfer), which a kernel's own duration leaves out."""
  events = hlo_stats.perfetto_events(trace_dir)
  devices = hlo_stats.device_pids(events)
  named = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in devices}
  lines: dict[tuple, list[dict]] = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices:
      lines[(e["pid"], e.get("tid"))].append(e)
  times: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
  for line, line_events in lines.items():
    timed_line = named.get(line, "Stream").startswith("Stream")
    end = None
    for e in sorted(line_events, key=lambda e: float(e.get("ts", 0.0))):
      start, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
      entry = times[e["name"]]
      entry[0] += 1
      entry[1] += dur
      if timed_line and end is not None:
        entry[2] += max(0.0, start - end)
      end = start + dur if end is None else max(end, start + dur)
  return {name: (n, us, idle) for name, (n, us, idle) in times.items()}


def kernel_breakdown(fn: Callable[..., Any], *args: Any, iters: int = 20) -> list[tuple[str, float, float]]:
  """Per-call device kernels of `fn(*args)` from a profile of `iters` calls in one program:
  [(kernel, launches per call, us per call)], slowest first (the fori_loop's own bookkeeping
  kernels included). Empty on backends whose traces have no device events (the CPU)."""
  program = _loop_program(fn, iters)
  jax.block_until_ready(program(args))  # compile and warm up outside the trace
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(program(args))
    times = device_kernel_times(trace_dir)
  return sorted(((name, n / iters, us / iters) for name, (n, us, _) in times.items()), key=lambda r: -r[2])


def loop_breakdown(*args: Any, iters: int = 20) -> list[tuple[str, float, float]]:
  """kernel_breakdown of the timing loop alone, over a call that returns its first argument:
  the loop's own bookkeeping kernels (its counter, the accumulator add), for `own_kernel_us`."""
  return kernel_breakdown(lambda *a: a[0], *args, iters=iters)


def own_kernel_us(kernels: list[tuple[str, float, float]], loop: list[tuple[str, float, float]]) -> float:
  """Per-call device time of a kernel path's own kernels: its kernel_breakdown less the timing
  loop's bookkeeping (`loop_breakdown` on the same arguments), kernel by kernel name. Launch
  gaps are in neither: time_device minus this is what the gaps and the loop cost."""
  bookkeeping = {name: us for name, _, us in loop}
  return sum(max(0.0, us - bookkeeping.get(name, 0.0)) for name, _, us in kernels)


def time_own_kernels(fn: Callable[..., Any], *args: Any) -> float:
  """Seconds per call of fn(*args)'s own device kernels (`own_kernel_us`): no launch gaps, no
  timing-loop bookkeeping. Needs device events in the trace (a GPU): elsewhere a clear error,
  not a zero time."""
  kernels = kernel_breakdown(fn, *args)
  if not kernels:
    raise RuntimeError(f"time_own_kernels: the {jax.default_backend()} backend's profile has no device "
                       "kernel events; time with time_device instead")
  return own_kernel_us(kernels, loop_breakdown(*args)) * 1e-6
