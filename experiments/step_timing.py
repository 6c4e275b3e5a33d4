"""Timing one decode step of a model on the default device or a mesh, without dispatch in the
number: random params (in any weight layout, made in place on a mesh) and a random cache of the
context, two loop lengths of the engine's decode program (plain, or speculative with k drafts),
the difference of their times over the difference of their steps. Several programs (the layer
counts of `measure_rank_step`) are timed in turn, round after round (`_step_times`). Used by
experiments.tep_project (one TEP rank) and experiments.multigpu_run (TEP over N GPUs).
`measure_rank_step(kernels=True)` also profiles both layer counts and differences their device
kernels into what one decoder layer launches (`layer_kernels`: launches, own time and the idle
time before them, so kernels and launch gaps are told apart).
"""

import collections
import contextlib
import dataclasses
import functools
import math
import re
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glmjax import parallel
from glmjax.bench import device_kernel_times
from glmjax.cache.paged import KVCache, init_cache
from glmjax.config import ModelConfig
from glmjax.engine import speculative, steps
from glmjax.engine.sampling import Sampling
from glmjax.model import abstract_params, init_params
from glmjax.quant import quantize_params
from glmjax.runtime import make_runtime

PAGE_SIZE = 64


def with_layers(config: ModelConfig, layers: int, *, mtp: bool = False) -> ModelConfig:
  """The first `layers` decoder layers of config, without MTP layers unless `mtp` (plain decode
  does not run them; speculative decode runs the first)."""
  return dataclasses.replace(config, num_hidden_layers=layers,
                             num_nextn_predict_layers=config.num_nextn_predict_layers if mtp else 0,
                             mlp_layer_types=config.mlp_layer_types[:layers],
                             indexer_types=config.indexer_types[:layers])


def _fill_random(tree, key: jax.Array):
  """Every non-f32 leaf standard normal; the only f32 leaves, the scales of fp8 pages, stay 1."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  fill = lambda a, k: a if a.dtype == jnp.float32 else jax.random.normal(k, a.shape).astype(a.dtype)
  return jax.tree.unflatten(treedef, [fill(a, k) for a, k in zip(leaves, keys)])


def _random_cache(config: ModelConfig, context: int, extra: int, kv_dtype: str, key: jax.Array) -> KVCache:
  """One sequence of `context` cached tokens with random values, room for `extra` more."""
  pages = math.ceil((context + extra) / PAGE_SIZE)
  cache = init_cache(config, num_pages=pages + 1, page_size=PAGE_SIZE, batch=1, max_pages=pages,
                     kv_dtype=kv_dtype)
  return cache.replace(layers=_fill_random(cache.layers, key),
                       page_table=1 + jnp.arange(pages, dtype=jnp.int32)[None],
                       lengths=jnp.full((1,), context, jnp.int32))


def _decode_program(config: ModelConfig, spec: steps.StepSpec, draft_steps: int, num_pages: int,
                    kv_dtype: str, key: jax.Array):
  """(max_new_tokens -> fn(params, cache, mtp_pages) -> (tokens, counts, loop steps), MTP pages):
  the plain decode loop, or with draft_steps the speculative loop drafting that many each step."""
  first, active, eos = jnp.zeros(1, jnp.int32), jnp.ones(1, bool), jnp.asarray([], jnp.int32)
  budget = lambda n: jnp.full((1,), n, jnp.int32)
  if not draft_steps:
    return (lambda n: lambda params, cache, mtp: steps.decode_loop(
        params, cache, first, active, key, eos, budget(n), spec=spec, sampling=Sampling(),
        max_new_tokens=n)[:3]), None
  # Threshold 0: every step drafts all k tokens, whatever the draft's confidence.
  draft_config = speculative.SpecConfig(num_draft=draft_steps, threshold=0.0)
  draft = draft_config.shape
  mtp = _fill_random(speculative.init_mtp_layer(config, num_pages=num_pages, page_size=PAGE_SIZE,
                                                kv_dtype=kv_dtype), key)
  hidden = jax.random.normal(key, (1, config.hidden_size), jnp.dtype(spec.dtype))
  scratch = jnp.zeros((1, draft.paths - 1, draft.span_pages(PAGE_SIZE)), jnp.int32)
  return (lambda n: lambda params, cache, mtp: speculative.spec_decode_loop(
      params, cache, mtp, first, hidden, active, key, eos, budget(n), scratch, draft_config.knobs(),
      spec=spec, sampling=Sampling(), max_new_tokens=n, draft=draft)[:3]), mtp


def random_params(config: ModelConfig, dtype: str, *, weights: str = "bf16", mesh=None):
  """Random params of `config`, quantized by the `weights` policy ("bf16": none); with a mesh,
  created directly in its TEP layout (each device makes only its shards)."""
  init = functools.partial(init_params, config, param_dtype=jnp.dtype(dtype))
  shardings = None if mesh is None else parallel.param_shardings(abstract_params(config), mesh)
  params = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  return params if weights == "bf16" else jax.jit(functools.partial(quantize_params, policy=weights))(params)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A timed decode step: `seconds` per loop step; `long_loop_steps`, the steps of the longer
  loop (the one a trace_dir profile holds one call of)."""
  seconds: float
  long_loop_steps: int


def time_decode_step(config: ModelConfig, *, quick: bool, mesh=None, trace_dir: str = "", **kw) -> StepTime:
  """Time per decode step of `config` at `context` (batch 1), on the default device or under
  `mesh`; with draft_steps, per speculative step (k drafts + a (k+1)-token verify). trace_dir:
  also write a jax.profiler trace (perfetto) of one call of the longer loop there. The other
  arguments: `_prepare`'s."""
  with _on(mesh):
    return _step_times([_prepare(config, mesh=mesh, **kw)], 1 if quick else 5, [trace_dir])[0]


def _on(mesh):
  return contextlib.nullcontext() if mesh is None else parallel.use_mesh(mesh)


@dataclasses.dataclass(frozen=True)
class _Program:
  """A decode program ready to time: once(n, trace_dir) runs its n-token loop on a fresh copy of
  the cache (the loops donate theirs) and returns (seconds, loop steps); with a trace_dir, a
  jax.profiler trace of the loop's call alone, not of the copy (whose one memcpy a cache array
  the profile would count as a kernel of every layer: 0.29 launches and 2.9 us a layer in run
  36's 17-step loops); `lengths`, the two loop lengths whose difference is the measurement."""
  once: Callable[[int, str], tuple[float, int]]
  lengths: tuple[int, int]


def _prepare(config: ModelConfig, *, context: int, attention: str, matmul: str, kv_dtype: str, dtype: str,
             steps_apart: int, draft_steps: int = 0, weights: str = "bf16", mesh=None,
             kernel_switches: dict | None = None) -> _Program:
  """Random params (the `weights` layout) and a random cache of `context` tokens for config's
  decode program, the plain loop or with draft_steps the speculative one. kernel_switches: more
  `make_runtime` arguments (experiments/kernel_flags.py). A call's copy, dispatch and sync are the
  same for both lengths and drop out of their difference, so no timing loop is needed."""
  runtime = make_runtime(config, attention=attention, matmul=matmul, **(kernel_switches or {}))
  params = runtime.arrange(random_params(config, dtype, weights=weights, mesh=mesh))
  spec = steps.StepSpec(config, runtime, dtype)
  lengths = (2, 2 + steps_apart)
  cache = _random_cache(config, context, lengths[-1] + draft_steps, kv_dtype, jax.random.key(1))
  program, mtp = _decode_program(config, spec, draft_steps, cache.page_table.shape[1] + 1, kv_dtype,
                                 jax.random.key(2))
  if mesh is not None:
    cache, mtp = parallel.shard_cache(cache, mesh), jax.device_put(mtp, NamedSharding(mesh, P()))

  def once(n: int, trace_dir: str = "") -> tuple[float, int]:
    inputs = jax.block_until_ready(jax.tree.map(jnp.copy, (cache, mtp)))
    traced = jax.profiler.trace(trace_dir, create_perfetto_trace=True) if trace_dir else contextlib.nullcontext()
    with traced:
      start = time.perf_counter()
      out = jax.block_until_ready(program(n)(params, *inputs))
      seconds = time.perf_counter() - start
    return seconds, int(out[2])

  return _Program(once, lengths)


def _step_times(programs: list[_Program], repeats: int, trace_dirs: list[str]) -> list[StepTime]:
  """Each program's step time: the difference of its two loop lengths' median times over that of
  their steps. Every length of every program is compiled first, then all are timed in turn,
  `repeats` rounds, so that a drift of the device's speed during the measurement reaches every
  program alike (timed one program after another, one 8-layer program's step moved 8% between
  two processes while its 3- and 5-layer ones repeated to 1.5%: BENCHMARKS.md run 23). A
  program's trace_dir (or ""): a jax.profiler trace of one more call of its longer loop.

  The warm-up runs every length twice: a program compiled first may compile again once the
  others have (on the CPU, the first Pallas interpret-mode lowering imports pallas.fuser, which
  changes jit's cache key: a tiny program's 6 ms call took 9.9 s, and --quick's single round
  read it as the step)."""
  for _ in range(2):
    for program in programs:
      for n in program.lengths:
        program.once(n)
  runs = collections.defaultdict(list)
  for _ in range(repeats):
    for i, program in enumerate(programs):
      for n in program.lengths:
        runs[i, n].append(program.once(n))
  out = []
  for i, (program, trace_dir) in enumerate(zip(programs, trace_dirs, strict=True)):
    (short, short_steps), (long, long_steps) = ((statistics.median(t for t, _ in runs[i, n]), runs[i, n][0][1])
                                                for n in program.lengths)
    if trace_dir:
      program.once(program.lengths[-1], trace_dir)
    if long <= short or long_steps <= short_steps:
      raise ValueError(f"{program.lengths[1] - program.lengths[0]} more tokens were not slower ({long:.6f} s vs "
                       f"{short:.6f} s, loop steps {short_steps} vs {long_steps}): timing noise; raise "
                       f"--decode_steps or drop --quick")
    out.append(StepTime((long - short) / (long_steps - short_steps), long_steps))
  return out


def kernel_family(name: str) -> str:
  """A device kernel's name less XLA's numeric suffixes (loop_add_fusion_3, fusion.12), so that
  the same operation matches across two programs."""
  return re.sub(r"([._]\d+)+$", "", name)


# A kernel family's (launches, own us, idle us before its launches): glmjax.bench.device_kernel_times.
Kernels = dict[str, tuple[float, float, float]]


def step_kernels(times: Kernels, steps: int) -> Kernels:
  """{kernel family: (launches, us, idle us)} per loop step, from one traced call of `steps`
  steps (glmjax.bench.device_kernel_times)."""
  out = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
  for name, values in times.items():
    family = out[kernel_family(name)]
    for i, value in enumerate(values):
      family[i] += value / steps
  return {name: tuple(values) for name, values in out.items()}


def layer_difference(fewer: Kernels, more: Kernels, layers: int) -> list[tuple[str, float, float, float]]:
  """Per decoder layer: (family, launches, us, idle us) of `more`'s per-step kernels less
  `fewer`'s, over the `layers` they differ by, slowest first (what both programs share cancels)."""
  none = (0.0, 0.0, 0.0)
  return slowest_first({name: tuple((b - a) / layers for a, b in zip(fewer.get(name, none), more.get(name, none)))
                        for name in set(fewer) | set(more)})


def slowest_first(kernels: Kernels) -> list[tuple[str, float, float, float]]:
  """{family: (launches, us, idle us)} as (family, launches, us, idle us) rows, most device time
  (own plus idle before) first."""
  return sorted(((name, *values) for name, values in kernels.items()), key=lambda r: -(r[2] + r[3]))


def _timed_counts(configs: list[ModelConfig], kernels: bool, *, quick: bool, mesh=None,
                  **kw) -> list[tuple[float, Kernels]]:
  """(seconds per step, per-step kernel families or {}) of each config, timed together
  (`_step_times`), so all their params are held at once (tep8_shard's 3, 5 and 8 layers: about
  40 GB in bf16); kernels: each profiled once after the timing."""
  with _on(mesh), contextlib.ExitStack() as stack:
    programs = [_prepare(config, mesh=mesh, **kw) for config in configs]
    trace_dirs = [stack.enter_context(tempfile.TemporaryDirectory()) if kernels else "" for _ in configs]
    timed = _step_times(programs, 1 if quick else 5, trace_dirs)
    return [(t.seconds, step_kernels(device_kernel_times(d), t.long_loop_steps) if d else {})
            for t, d in zip(timed, trace_dirs)]


def measure_rank_step(config: ModelConfig, measure_layers: list[int], *, kernels: bool = False,
                      **kw) -> dict[str, Any]:
  """Time the rank's decode step, whole or extended linearly from two or more layer counts (the
  MTP layer, with draft steps, is in every count's program, hence in the base): a least-squares
  line through (layers, step time), evaluated at the config's layers; with three or more counts
  `per_layer_stderr_s` is its slope's standard error (the difference of two counts' times
  multiplies their noise by the layers it extends to: two calls of run 12 and 13 put one layer
  at 274 and 189 us where the profiled kernels differed by 17 us). kernels: also profile each
  program once after its timing; `layer_kernels` lists one decoder layer's (family, launches,
  us, idle us) from the fewest and most layers' difference, else `step_kernels` the step's.

  Where the layers past the fewest count mix indexer kinds (IndexShare: "full" layers run their
  indexer, "shared" ones reuse its top-k), each kind gets its own line: programs whose layers
  past the fewest count are all of that kind, sharing the fewest count's program. The step is
  that program's time on the lines plus each later layer at its kind's slope; `per_layer_s` and
  `layer_kernels` are the average layer of the config's pattern past the fewest count, and
  `per_layer_by_indexer` gives each kind's slope."""
  if not measure_layers:
    (seconds, per_step), = _timed_counts([config], kernels, **kw)
    out = dict(rank_step_s=seconds, measured_layers=[config.num_hidden_layers])
    return out | (dict(step_kernels=slowest_first(per_step)) if kernels else {})
  counts = sorted(set(measure_layers))
  types = config.mlp_layer_types
  if len(counts) < 2 or not 0 < counts[0] < counts[-1] <= config.num_hidden_layers or len(set(types[counts[0]:])) != 1:
    raise ValueError(f"measure_layers {measure_layers}: need two or more counts in 1..{config.num_hidden_layers}, "
                     f"the layers from the fewest on all of one MLP type (got {sorted(set(types[counts[0]:]))})")
  first, later = counts[0], config.indexer_types[counts[0]:]
  share = {kind: later.count(kind) / len(later) for kind in sorted(set(later))}
  mtp = kw.get("draft_steps", 0) > 0

  def program(n: int, kind: str) -> ModelConfig:
    layers = with_layers(config, n, mtp=mtp)
    return dataclasses.replace(layers, indexer_types=config.indexer_types[:first] + (kind,) * (n - first))

  configs = [with_layers(config, first, mtp=mtp)] + [program(n, kind) for kind in share for n in counts[1:]]
  timed = _timed_counts(configs, kernels, **kw)
  fewest, more = timed[0], iter(timed[1:])
  lines = {kind: [fewest] + [next(more) for _ in counts[1:]] for kind in share}
  fits = {kind: np.polyfit(counts, [t for t, _ in line], 1, full=True)[:2] for kind, line in lines.items()}
  at_first = np.mean([base + first * slope for (slope, base), _ in fits.values()])
  slopes = {kind: float(fit[0][0]) for kind, fit in fits.items()}
  per_layer = sum(share[kind] * slopes[kind] for kind in share)
  out = dict(rank_step_s=float(at_first + len(later) * per_layer), measured_layers=counts,
             measured_s=[t for t, _ in timed], per_layer_s=per_layer)
  if len(share) > 1:
    out |= dict(per_layer_by_indexer=slopes, measured_indexers=[None] + [k for k in share for _ in counts[1:]])
  if len(counts) > 2:
    spread = np.sum(np.subtract(counts, np.mean(counts)) ** 2)
    variance = {kind: np.sum(residuals) / (len(counts) - 2) / spread for kind, (_, residuals) in fits.items()}
    out["per_layer_stderr_s"] = float(np.sqrt(sum(share[kind] ** 2 * variance[kind] for kind in share)))
  if not kernels:
    return out
  average = collections.defaultdict(lambda: np.zeros(3))
  for kind, line in lines.items():
    for name, *values in layer_difference(line[0][1], line[-1][1], counts[-1] - first):
      average[name] += share[kind] * np.asarray(values)
  return out | dict(layer_kernels=slowest_first({name: tuple(map(float, v)) for name, v in average.items()}))
