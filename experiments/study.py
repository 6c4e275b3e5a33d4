"""The optimization-chain study: one measuring function behind `ablate`, `sweep` and `decode_bench`.

A row of the study is a set of `Switches` (every optimization glmjax can turn on or off) and a
`Workload` (conversations of `rounds` rounds on the Engine: a first prompt of `context` tokens,
then `append` new tokens a round, `new_tokens` decoded each, greedy). `measure` builds the Engine
from the switches, runs the rounds and reports the last one, when every program is compiled:
decode tokens/s and step time, time to first token (from the prefix cache when it is on),
acceptance length, weight and KV bytes per step (glmjax.footprint) with the bandwidth floor they
set and the fraction of it reached, kernels per decoder layer (glmjax.hlo_stats: from the
compiled decode program's HLO, and optionally from a profile trace), the decode program's
memory and the device's peak memory.

  CHAIN: baseline (bf16 weights, dense attention, no prefix cache, no speculation, XLA only, a
  host-driven decode loop) -> +prefix cache -> +MTP (k = 4) -> +sparse DSA -> +Pallas kernels
  (attention and matmul) -> +IndexShare -> +FP8 KV -> +NVFP4 experts -> +device loop; each row
  keeps the switches of the rows before it.

IndexShare here keeps every N-th of the indexers the checkpoint has (`index_share=N`; 1 = all
of them): layers that ship no indexer weights (the config's "shared" layers, such as mini's
layers 2 and 4) can never run one, so "off" is the checkpoint's own pattern.
`Results` keeps a study's rows in one JSON file, so that a rerun skips the finished ones.
"""

import csv
import dataclasses
import fcntl
import functools
import json
import os
import pathlib
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from tqdm import tqdm
# Before anything is traced: the first interpret-mode pallas_call lowering imports the Pallas fuser,
# whose tracing-context flag changes every jit cache key (programs compiled before would recompile).
from jax.experimental.pallas import fuser  # noqa: F401

import glmjax
from configs import get_model_config
from glmjax import footprint, hlo_stats
from glmjax.config import ModelConfig
from glmjax.data import load_corpus
from glmjax.engine.engine import Engine
from glmjax.engine.speculative import SpecConfig
from glmjax.model import init_params
from glmjax.quant import quantize_params
from glmjax.runtime import ATTENTION_IMPLS, MATMUL_IMPLS, Runtime


@dataclasses.dataclass(frozen=True)
class Switches:
  """One row's optimizations. The defaults are the chain's baseline."""
  prefix_cache: bool = False
  num_draft: int = 0           # MTP draft tokens k per step (0: no speculation)
  draft_branch: int = 1        # candidates per branching draft position (1: a chain)
  draft_threshold: float = 0.0  # drafting continues while the draft's top probability reaches this
  attention: str = "dense"
  matmul: str = "xla"
  index_share: int = 1         # keep every N-th of the checkpoint's indexers
  kv_dtype: str = "bf16"
  weights: str = "bf16"        # a glmjax.quant policy, or bf16 (the params as loaded)
  device_loop: bool = False
  index_topk: int | None = None  # override of ModelConfig.index_topk (DSA tokens selected per query)

  def __post_init__(self):
    if self.attention not in ATTENTION_IMPLS or self.matmul not in MATMUL_IMPLS:
      raise ValueError(f"attention must be one of {ATTENTION_IMPLS} and matmul one of {MATMUL_IMPLS}, "
                       f"got {self.attention!r} and {self.matmul!r}")
    if self.index_share < 1 or (self.index_topk is not None and self.index_topk < 1):
      raise ValueError(f"index_share and index_topk must be >= 1, got {self.index_share} and {self.index_topk}")
    if self.weights not in footprint.POLICIES or self.kv_dtype not in footprint.KV_DTYPES + ("fp32",):
      raise ValueError(f"weights must be one of {footprint.POLICIES} and kv_dtype one of "
                       f"{footprint.KV_DTYPES + ('fp32',)}, got {self.weights!r} and {self.kv_dtype!r}")
    self.spec  # validates the draft settings

  @property
  def spec(self) -> SpecConfig | None:
    if self.num_draft == 0:
      return None
    return SpecConfig(num_draft=self.num_draft, branch=self.draft_branch, threshold=self.draft_threshold)


CHAIN: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("baseline", "baseline", {}),
    ("prefix_cache", "+prefix cache", dict(prefix_cache=True)),
    ("mtp", "+MTP (k={num_draft})", dict(num_draft=4)),
    ("sparse", "+sparse DSA", dict(attention="sparse")),
    ("pallas", "+Pallas kernels", dict(attention="pallas", matmul="pallas")),
    ("index_share", "+IndexShare (1 in {index_share})", dict(index_share=2)),
    ("fp8_kv", "+FP8 KV", dict(kv_dtype="fp8")),
    ("nvfp4", "+NVFP4 experts", dict(weights="nvfp4_experts")),
    ("device_loop", "+device loop", dict(device_loop=True)),
)
ROW_NAMES = tuple(name for name, _, _ in CHAIN)


def chain_switches(upto: str, **overrides) -> Switches:
  """The cumulative switches of CHAIN row `upto` (its own and every earlier row's). An override
  of a switch some row turns on (num_draft, index_share, ...) sets the value that row turns on,
  from that row on; others (draft_threshold, index_topk, ...) hold for every row."""
  if upto not in ROW_NAMES:
    raise ValueError(f"unknown chain row {upto!r}; rows are {ROW_NAMES}")
  merged: dict[str, Any] = {}
  for _, _, changes in CHAIN[:ROW_NAMES.index(upto) + 1]:
    merged.update(changes)
  turned_on = {k for _, _, changes in CHAIN for k in changes}
  merged.update({k: v for k, v in overrides.items() if k not in turned_on or k in merged})
  return Switches(**merged)


@dataclasses.dataclass(frozen=True)
class Workload:
  """Rounds of `concurrency` conversations: the first prompt has `context` tokens, later rounds
  append `append` each; every round decodes `new_tokens`. text: held-out text (glmjax.data)
  instead of random ids."""
  context: int = 384
  new_tokens: int = 64
  append: int = 16
  rounds: int = 2
  concurrency: int = 1
  text: bool = False
  seed: int = 0
  page_size: int = 64
  prefill_chunk: int = 512

  def __post_init__(self):
    for name in ("context", "new_tokens", "append", "concurrency", "page_size", "prefill_chunk"):
      if getattr(self, name) < 1:
        raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")
    if self.rounds < 2:
      raise ValueError(f"Workload.rounds must be >= 2 (the last round is measured, warm), got {self.rounds}")

  @property
  def longest(self) -> int:
    """Tokens of the last round's context plus its output."""
    return self.context + (self.rounds - 1) * (self.append + self.new_tokens) + self.new_tokens


@dataclasses.dataclass
class Model:
  """A config and its unquantized params; quantized variants are made once per policy."""
  config: ModelConfig
  params: dict
  name: str
  _quantized: dict[str, dict] = dataclasses.field(default_factory=dict, repr=False)

  def weights(self, policy: str) -> dict:
    if policy == "bf16":
      return self.params
    if policy not in self._quantized:
      self._quantized[policy] = quantize_params(self.params, policy)
    return self._quantized[policy]


def load_params(config_name: str, checkpoint: str, *, dtype=jnp.bfloat16, policy: str | None = None,
                seed: int = 0) -> tuple[ModelConfig, dict]:
  """A checkpoint's config and params (quantized on load under `policy`), or the preset with
  random params (quantized likewise) when checkpoint is empty."""
  if checkpoint:
    return glmjax.load_pretrained(checkpoint, dtype=dtype, quantize=policy)
  config = get_model_config(config_name)
  # One jitted init: one compile instead of one per weight initializer.
  params = jax.jit(lambda key: init_params(config, key, param_dtype=dtype))(jax.random.key(seed))
  return config, quantize_params(params, policy) if policy else params


def load_model(config_name: str, checkpoint: str, *, dtype: str = "bfloat16", seed: int = 0) -> Model:
  config, params = load_params(config_name, checkpoint, dtype=jnp.dtype(dtype), seed=seed)
  return Model(config, params, checkpoint or f"{config_name} (random init, seed {seed})")


def uses_text(text: str, checkpoint: str) -> bool:
  """text flag "validation" / "random" / "auto" (held-out text when the checkpoint has a tokenizer)."""
  if text not in ("auto", "random", "validation"):
    raise ValueError(f"text must be auto, random or validation, got {text!r}")
  return text == "validation" or (text == "auto" and bool(checkpoint)
                                  and os.path.exists(os.path.join(checkpoint, "tokenizer.json")))


@functools.lru_cache(maxsize=1)
def _corpus():
  return load_corpus()


def round_inputs(config: ModelConfig, w: Workload) -> list[list[list[int]]]:
  """Per conversation, the new tokens of each round."""
  rng = np.random.default_rng(w.seed)
  sizes = [w.context] + [w.append] * (w.rounds - 1)
  if w.text:
    return [[_corpus().sample_validation_text(rng, n) for n in sizes] for _ in range(w.concurrency)]
  return [[rng.integers(2, config.vocab_size, n).tolist() for n in sizes] for _ in range(w.concurrency)]


def indexer_pattern(config: ModelConfig, keep_every: int) -> tuple[bool, ...]:
  """Per layer whether it runs its indexer: every `keep_every`-th of the layers that have one."""
  kept = set(config.full_indexer_layers[::keep_every])
  return tuple(i in kept for i in range(config.num_hidden_layers))


def row_config(config: ModelConfig, s: Switches) -> ModelConfig:
  return config if s.index_topk is None else dataclasses.replace(config, index_topk=s.index_topk)


def make_engine(model: Model, s: Switches, w: Workload, *, mesh=None) -> Engine:
  """An Engine for the row: pages for every conversation's longest round (twice: a released
  sequence stays cached while the next is admitted) plus a draft tree's scratch pages."""
  config = row_config(model.config, s)
  spec = s.spec or SpecConfig(num_draft=0)
  pages_per_seq = -(-(w.longest + spec.num_draft) // w.page_size) + 1
  scratch = w.concurrency * (spec.shape.paths - 1) * spec.shape.span_pages(w.page_size)
  runtime = Runtime(attention=s.attention, indexer_pattern=indexer_pattern(config, s.index_share), matmul=s.matmul)
  return Engine(config, model.weights(s.weights), runtime=runtime,
                num_pages=1 + 2 * w.concurrency * pages_per_seq + scratch, page_size=w.page_size,
                max_batch=w.concurrency, max_seq_len=pages_per_seq * w.page_size, kv_dtype=s.kv_dtype,
                prefix_cache=s.prefix_cache, prefill_chunk=w.prefill_chunk, mtp_cache=s.spec is not None,
                mesh=mesh, device_loop=s.device_loop)


def step_bytes(config: ModelConfig, s: Switches, context: int, batch: int) -> tuple[float, float]:
  """(weight bytes, KV bytes) one decode step reads at `context` cached tokens (footprint's model).

  A plain step is one main pass over `batch` tokens. A speculative step adds k MTP passes (the
  catch-up over up to k + 1 tokens, then k - 1 single-token drafts) and verifies k + 1 tokens in
  one main pass, one batch row per draft path. Dense attention reads every cached token; layers
  that do not run their indexer read neither its weights nor its keys.
  """
  spec = s.spec
  c = row_config(config, s)
  c = dataclasses.replace(c, indexer_types=tuple("full" if r else "shared" for r in indexer_pattern(c, s.index_share)),
                          index_topk=max(context, 1) if s.attention == "dense" else c.index_topk)
  kv = "bf16" if s.kv_dtype == "fp32" else s.kv_dtype
  k = spec.num_draft if spec else 0
  rows = batch * (spec.shape.paths if spec else 1)
  weights = footprint.weight_bytes_per_step(c, s.weights, rows * (k + 1))
  kv_bytes = rows * footprint.kv_bytes_per_step(c, context, k + 1, kv)
  if k:
    weights += (footprint.weight_bytes_per_step(c, s.weights, batch * (k + 1), mtp=True)
                + (k - 1) * footprint.weight_bytes_per_step(c, s.weights, rows, mtp=True))
    kv_bytes += (batch * footprint.kv_bytes_per_step(c, context, k + 1, kv, mtp=True)
                 + (k - 1) * rows * footprint.kv_bytes_per_step(c, context, 1, kv, mtp=True))
  return weights, kv_bytes


def _run(engine: Engine, s: Switches, w: Workload, inputs, *, trace_dir: str = "",
         perfetto: bool = False) -> tuple[list, list[list[int]]]:
  """All rounds on `engine` (the last under a profiler trace when trace_dir is set) ->
  (per round the RoundStats of every conversation, per conversation its outputs of every round)."""
  sessions = [engine.open_session() for _ in range(w.concurrency)]
  rounds = []
  for r in range(w.rounds):
    last = r == w.rounds - 1
    run = lambda: engine.run_round(sessions, [inp[r] for inp in inputs], w.new_tokens, ignore_eos=True,
                                   spec=s.spec, seed=w.seed + r)
    if last and trace_dir:
      with jax.profiler.trace(trace_dir, create_perfetto_trace=perfetto):
        rounds.append(run())
    else:
      rounds.append(run())
  return rounds, [[rnd[i].output for rnd in rounds] for i in range(w.concurrency)]


def _peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def measure(model: Model, s: Switches, w: Workload, *, bandwidth: float = footprint.H200_BANDWIDTH,
            profile_dir: str = "", profile_kernels: bool = False, warmup: bool = False) -> dict[str, Any]:
  """Run the workload on a fresh Engine built from the switches; metrics of its last round.

  warmup: run everything once on another engine first, so that the first round's TTFT (a cold
  prefill) is compile-free (`cold_ttft_s`; None without). profile_dir: a jax.profiler trace of
  the measured round, taken from a second run of the workload on a fresh engine after the timed
  one (timings under the profiler are inflated: docs/BENCHMARKS.md, run 8). profile_kernels: also
  count the device kernels in that trace (a perfetto trace; under profile_dir or a temporary
  directory) per decode step and layer (None when the trace has no device events: on the CPU).
  ttft_s: mean over the conversations (prefilled one after another). decode_program_bytes: the
  compiled decode program's arguments, outputs and temporaries; peak_bytes_in_use: the device's
  peak since the process started (there is no reset: a running peak over the rows measured so
  far; None on the CPU).
  """
  inputs = round_inputs(model.config, w)
  if warmup:
    _run(make_engine(model, s, w), s, w, inputs)
  engine = make_engine(model, s, w)
  with tempfile.TemporaryDirectory() as tmp:
    trace_dir = profile_dir or (tmp if profile_kernels else "")
    rounds, generated = _run(engine, s, w, inputs)
    compiled = engine.compiled_decode()
    if trace_dir:
      _run(make_engine(model, s, w), s, w, inputs, trace_dir=trace_dir, perfetto=profile_kernels)
    hlo = compiled.as_text()
    trace_kernels = None
    if profile_kernels:
      found = hlo_stats.trace_kernels(trace_dir, module=hlo_stats.module_name(hlo))
      trace_kernels = found and found["kernels"]
  last = rounds[-1]
  config = row_config(model.config, s)
  layers = config.num_hidden_layers
  steps = last[0].decode_steps
  decode_s = last[0].decode_s
  decode_tokens = sum(st.decode_tokens for st in last)
  verify = sum(st.verify_steps for st in last)
  step_s = decode_s / steps if steps else 0.0
  context = last[0].prompt_tokens
  weight_bytes, kv_bytes = step_bytes(config, s, context, w.concurrency)
  floor_s = (weight_bytes + kv_bytes) / bandwidth
  memory = compiled.memory_analysis()
  return dict(
      switches=dataclasses.asdict(s), workload=dataclasses.asdict(w), model=model.name,
      device=jax.devices()[0].device_kind, context=context,
      cached_tokens=last[0].cached_tokens, ttft_s=float(np.mean([st.ttft_s for st in last])),
      cold_ttft_s=float(np.mean([st.ttft_s for st in rounds[0]])) if warmup else None,
      decode_tokens=decode_tokens, decode_s=decode_s, decode_steps=steps, verify_steps=verify,
      decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0, step_s=step_s,
      acceptance_length=sum(st.acceptance_length * st.verify_steps for st in last) / verify if verify else 1.0,
      acceptance_rate_per_position=[float(np.mean(p)) for p in zip(*[st.acceptance_rate_per_position for st in last])],
      weight_bytes_per_step=weight_bytes, kv_bytes_per_step=kv_bytes, bandwidth=bandwidth, floor_s=floor_s,
      floor_fraction=floor_s / step_s if step_s > 0 else 0.0,
      kernels_per_layer_hlo=hlo_stats.kernels_per_layer(hlo, layers, loop=s.device_loop),
      kernels_per_layer_trace=None if trace_kernels is None or not steps else trace_kernels / steps / layers,
      decode_program_bytes=None if memory is None else int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                                           + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
      peak_bytes_in_use=_peak_bytes(), generated=generated, measured_at=time.time())


class Results:
  """A study's measured points in one JSON file, keyed by name, each with the settings it was
  measured under: `done(name, settings)` is true only for the same settings, so a rerun skips
  finished points and remeasures changed ones. `add` saves at once, atomically and under a file
  lock, into what the file holds then: processes measuring different points (rows split across
  machines or processes) can share one file."""

  def __init__(self, path: str | os.PathLike, meta: dict[str, Any], *, resume: bool = True):
    self.path, self.meta = pathlib.Path(path), meta
    self.points: dict[str, dict] = self._read() if resume else {}

  def _read(self) -> dict[str, dict]:
    return json.loads(self.path.read_text()).get("points", {}) if self.path.exists() else {}

  def done(self, name: str, settings: dict) -> bool:
    return name in self.points and self.points[name]["settings"] == _plain(settings)

  def add(self, name: str, settings: dict, metrics: dict) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(self.path.parent, os.O_RDONLY)  # the lock: the folder (the file itself is replaced)
    try:
      fcntl.flock(folder, fcntl.LOCK_EX)
      points = self._read()
      points[name] = dict(metrics, settings=_plain(settings))
      tmp = self.path.with_suffix(".tmp")
      tmp.write_text(json.dumps(dict(meta=self.meta, points=points), indent=1))
      os.replace(tmp, self.path)
    finally:
      os.close(folder)
    self.points = {**self.points, **points}


def _plain(x):
  """JSON's view of x (tuples as lists), so stored and fresh settings compare equal."""
  return json.loads(json.dumps(x))


COLUMNS = (  # (header, key, scale, format)
    ("tok/s", "decode_tokens_per_s", 1, "{:.1f}"), ("step ms", "step_s", 1e3, "{:.3f}"),
    ("floor ms", "floor_s", 1e3, "{:.4f}"), ("of floor", "floor_fraction", 100, "{:.2f}%"),
    ("TTFT ms", "ttft_s", 1e3, "{:.1f}"), ("accept", "acceptance_length", 1, "{:.2f}"),
    ("weights MB/step", "weight_bytes_per_step", 1e-6, "{:.2f}"), ("KV MB/step", "kv_bytes_per_step", 1e-6, "{:.3f}"),
    ("kernels/layer (HLO)", "kernels_per_layer_hlo", 1, "{:.1f}"),
    ("kernels/layer (trace)", "kernels_per_layer_trace", 1, "{:.1f}"),
    ("decode program MB", "decode_program_bytes", 1e-6, "{:.1f}"), ("peak MB", "peak_bytes_in_use", 1e-6, "{:.1f}"))


def markdown(label: str, rows: list[tuple[str, dict]], columns) -> str:
  """(name, metrics) rows as a Markdown table: the name under `label`, then one cell per
  (header, key, scale, format) column, "-" where the metric is missing."""
  cell = lambda m, key, scale, fmt: "-" if m.get(key) is None else fmt.format(m[key] * scale)
  lines = [f"| {label} | " + " | ".join(c[0] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
  lines += [f"| {name} | " + " | ".join(cell(m, *c[1:]) for c in columns) + " |" for name, m in rows]
  return "\n".join(lines)


def markdown_table(rows: list[tuple[str, dict]]) -> str:
  """(label, metrics) rows as a Markdown table of their context and COLUMNS."""
  return markdown("row", rows, (("context", "context", 1, "{}"),) + COLUMNS)


def write_csv(path: str | os.PathLike, rows: list[tuple[str, dict]]) -> None:
  """One line per row: its label, context and every scalar metric (unscaled)."""
  keys = ["context"] + [c[1] for c in COLUMNS] + ["decode_tokens", "decode_steps", "cached_tokens", "model", "device"]
  with open(path, "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["row"] + keys)
    out.writerows([label] + [m.get(k) for k in keys] for label, m in rows)


def define_flags(output_dir: str) -> None:
  """The flags ablate and sweep share: model, workload, the chain's values, outputs."""
  flags.DEFINE_string("config", "mini", "model config preset (configs/); a checkpoint brings its own")
  flags.DEFINE_string("checkpoint", "auto", "HF checkpoint directory; auto = checkpoints/mini for --config=mini, "
                      "else random init; empty = random init")
  flags.DEFINE_string("dtype", "bfloat16", "params and compute dtype")
  flags.DEFINE_integer("seed", 0, "random init and workload seed")
  flags.DEFINE_enum("text", "auto", ["auto", "random", "validation"],
                    "round inputs: random ids or held-out text; auto = text when the checkpoint has a tokenizer")
  flags.DEFINE_integer("context", 384, "first prompt tokens")
  flags.DEFINE_integer("new_tokens", 64, "tokens decoded per round")
  flags.DEFINE_integer("append", 16, "new input tokens of each later round")
  flags.DEFINE_integer("rounds", 2, "rounds per conversation (the last is measured)")
  flags.DEFINE_integer("concurrency", 1, "conversations decoded together")
  flags.DEFINE_integer("page_size", 64, "tokens per KV page")
  flags.DEFINE_integer("prefill_chunk", 512, "prefill chunk length")
  flags.DEFINE_integer("num_draft", 4, "MTP draft length k (from the +MTP row on)")
  flags.DEFINE_float("draft_threshold", 0.0, "drafting continues past a draft only at this top probability")
  flags.DEFINE_integer("index_share", 2, "+IndexShare keeps every N-th of the checkpoint's indexers")
  flags.DEFINE_integer("index_topk", 0, "override of the config's index_topk (0: the config's)")
  flags.DEFINE_string("output_dir", output_dir, "where the JSON, plots and tables go")
  flags.DEFINE_float("bandwidth", footprint.H200_BANDWIDTH, "bytes/s of the bandwidth floor")
  flags.DEFINE_string("profile", "", "write a jax.profiler trace of each measured round under DIR/<point>")
  flags.DEFINE_bool("profile_kernels", False, "count device kernels per decode step from a perfetto trace")
  flags.DEFINE_bool("resume", True, "keep finished points of existing JSON files and skip them")


def from_flags() -> tuple[Model, Workload, dict[str, Any]]:
  """(model, workload, chain overrides for chain_switches) from define_flags' flags."""
  f = flags.FLAGS
  checkpoint = ("checkpoints/mini" if f.config == "mini" else "") if f.checkpoint == "auto" else f.checkpoint
  model = load_model(f.config, checkpoint, dtype=f.dtype, seed=f.seed)
  workload = Workload(context=f.context, new_tokens=f.new_tokens, append=f.append, rounds=f.rounds,
                      concurrency=f.concurrency, text=uses_text(f.text, checkpoint), seed=f.seed,
                      page_size=f.page_size, prefill_chunk=f.prefill_chunk)
  overrides = dict(num_draft=f.num_draft, draft_threshold=f.draft_threshold, index_share=f.index_share,
                   index_topk=f.index_topk or None)
  return model, workload, overrides


def measure_all(results: Results, model: Model, jobs: list[tuple[str, Switches, Workload, dict]],
                bar: tqdm) -> dict[str, str]:
  """Measure each (name, switches, workload, extra metrics) not already in results under the same
  settings (define_flags' bandwidth and profiling flags), advancing the progress bar.

  A point that raises is reported and left out (not stored, so a rerun tries it again) and the
  others still run: on a device lent for minutes, one failing kernel must not cost the rest.
  Returns {name: error} of those points."""
  f = flags.FLAGS
  failed = {}
  for name, switches, w, extra in jobs:
    settings = dict(model=model.name, switches=dataclasses.asdict(switches), workload=dataclasses.asdict(w),
                    bandwidth=f.bandwidth, profile_kernels=f.profile_kernels)
    if results.done(name, settings):
      bar.write(f"{name}: done earlier, skipped")
    else:
      safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
      try:
        m = measure(model, switches, w, bandwidth=f.bandwidth, profile_dir=f.profile and f"{f.profile}/{safe}",
                    profile_kernels=f.profile_kernels)
      except Exception as e:  # noqa: BLE001 (reported, and raised at the end by the caller)
        failed[name] = f"{type(e).__name__}: {e}"
        bar.write(f"{name}: FAILED {failed[name][:2000]}")
      else:
        results.add(name, settings, dict(m, **extra))
        bar.write(f"{name}: {m['decode_tokens_per_s']:.1f} tok/s, step {1e3 * m['step_s']:.3f} ms (floor "
                  f"{1e3 * m['floor_s']:.4f} ms), accept {m['acceptance_length']:.2f}, "
                  f"{m['kernels_per_layer_hlo']:.1f} kernels/layer")
    bar.update()
  return failed


def raise_failures(failed: dict[str, str]) -> None:
  if failed:
    raise RuntimeError(f"{len(failed)} point(s) failed (the others are saved; a rerun retries these): "
                       + "; ".join(f"{name}: {err[:300]}" for name, err in failed.items()))


def pyplot():
  """matplotlib's pyplot on the Agg backend (files only, no display)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt
