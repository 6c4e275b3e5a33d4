"""Continuous batching over the paged cache: many requests, two priority classes, pool admission.

Each `Scheduler.step`:
1. admits waiting requests in order (priority class, then arrival) while a slot is free and the
   page pool can hold the context plus the whole decode budget, reserved now (PrefixCache.reserve)
   so that an admitted request never fails for memory. An interactive request that does not fit
   preempts running batch requests, newest first: their written tokens are released to the prefix
   cache (published, not discarded), and they resume from it when re-admitted. Host-tier pages of
   the prompt come back to the device on admission (TieredPrefixCache.open / apply).
2. gives each running request a row: first one token to every row about to emit (decode, or a
   prompt's last token), then prefill chunks in request order, all under the token budget.
3. runs the rows as one model call (`serve_step`): [b, w] tokens with per-row positions, -1 for
   padding, b the number of rows rounded up to a power of two (the batch follows the load, 1 to
   max_batch) and w 1 when every row takes one token, else prefill_chunk.
4. while the step runs, stages (host-to-device copies) the host pages of the waiting requests at
   the head of the queue, pinned so the host tier keeps them until they are restored.
5. appends the sampled tokens; finished requests release their pages to the prefix cache.

Time comes from a clock: `StepClock` (one unit per step, deterministic) or `WallClock` (seconds).
"""

import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.api import check_tokens, params_dtype
from glmjax.cache.paged import NULL_PAGE, KVCache, check_geometry, init_cache
from glmjax.cache.prefix_cache import PageContent, SequenceAlloc
from glmjax.config import ModelConfig
from glmjax.engine import steps
from glmjax.engine.sampling import Sampling, sample
from glmjax.runtime import Runtime
from glmjax.serve.host_tier import (HostTier, TieredPrefixCache, bucket_pow2, copy_pages, extract_pages,
                                    insert_pages)

PRIORITIES = ("interactive", "batch")  # served in this order


@functools.partial(jax.jit, static_argnames=("spec", "sampling"), donate_argnames=("cache",))
def serve_step(params, cache: KVCache, tokens: jax.Array, positions: jax.Array, key: jax.Array, *,
               spec: steps.StepSpec, sampling: Sampling):
  """One model call for a mixed batch: rows prefilling a chunk and rows decoding one token, each
  at its own positions [B, W] (-1 = padding; a row not taking part is all -1).

  Returns (token sampled at each row's last real position [B] int32, its logits [B, V] fp32, new
  cache). The page table [B, max_pages] is that of the rows, set by the caller.
  """
  logits, _, cache = steps.prefill_chunk(params, cache, tokens, positions, spec=spec)
  return sample(logits, key, sampling), logits, cache


class StepClock:
  """Simulated time: one unit per model step; idle gaps are skipped."""

  def __init__(self):
    self._t = 0.0

  def now(self) -> float:
    return self._t

  def tick(self) -> None:
    self._t += 1.0

  def skip_to(self, t: float) -> None:
    self._t = max(self._t, t)


class WallClock:
  """Seconds since it was first read (so time spent before serving, such as compiling, is not
  counted); idle gaps are skipped rather than slept through."""

  def __init__(self):
    self._start, self._skipped = None, 0.0

  def now(self) -> float:
    if self._start is None:
      self._start = time.perf_counter()
    return time.perf_counter() - self._start + self._skipped

  def tick(self) -> None:
    pass

  def skip_to(self, t: float) -> None:
    self._skipped += max(0.0, t - self.now())


@dataclasses.dataclass(eq=False)
class Request:
  """One generation request; the fields after `session` are filled in while it is served."""
  id: str
  prompt: list[int]
  max_new_tokens: int
  priority: str = "batch"
  arrival: float = 0.0
  session: str | None = None          # conversation id: its trailing partial page is reused
  output: list[int] = dataclasses.field(default_factory=list)
  admitted: float | None = None       # first admission
  first_token: float | None = None
  finished: float | None = None
  preemptions: int = 0
  lookup_tokens: int = 0              # context tokens looked up, summed over admissions
  device_hit_tokens: int = 0          # of those, served by device pages
  host_hit_tokens: int = 0            # ... by pages restored from the host tier
  first_logits: np.ndarray | None = None  # [V] fp32, with record_logits

  def __post_init__(self):
    if self.priority not in PRIORITIES:
      raise ValueError(f"request {self.id}: priority must be one of {PRIORITIES}, got {self.priority!r}")
    if self.max_new_tokens < 1:
      raise ValueError(f"request {self.id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")

  @property
  def ttft(self) -> float:
    return self.first_token - self.arrival

  @property
  def queue_delay(self) -> float:
    return self.admitted - self.arrival

  @property
  def time_per_output_token(self) -> float:
    """(finish - first token) / (tokens - 1); 0 for a single token."""
    return (self.finished - self.first_token) / (len(self.output) - 1) if len(self.output) > 1 else 0.0


@dataclasses.dataclass(eq=False)
class _Running:
  request: Request
  seq: SequenceAlloc
  written: int  # leading tokens of seq.tokens whose KV is on the device

  @property
  def pending(self) -> int:
    return self.seq.length - self.written


class Scheduler:
  """Serves submitted requests over one device cache of `num_pages` pages, up to `max_batch` at once.

  prefill_chunk: the widest row of a step; token_budget: real tokens per step, all rows together.
  priority=False serves strictly by arrival and never preempts. host_tier: where evicted pages go
  (None: they are dropped). record_logits keeps each request's first-token logits.
  """

  def __init__(self, config: ModelConfig, params, *, num_pages: int, page_size: int = 16,
               max_batch: int = 8, max_seq_len: int | None = None, kv_dtype: str = "bf16",
               prefill_chunk: int = 256, token_budget: int = 512, priority: bool = True,
               host_tier: HostTier | None = None, runtime: Runtime = Runtime(),
               sampling: Sampling = Sampling(), seed: int = 0, ignore_eos: bool = False,
               record_logits: bool = False, clock: StepClock | WallClock | None = None):
    max_seq_len = check_geometry(config, page_size, max_seq_len)
    if max_batch < 1 or prefill_chunk < 1 or token_budget < 1:
      raise ValueError(f"max_batch ({max_batch}), prefill_chunk ({prefill_chunk}) and token_budget "
                       f"({token_budget}) must be positive")
    self.config, self.params = config, runtime.arrange(params)
    self.page_size, self.max_batch, self.max_pages = page_size, max_batch, max_seq_len // page_size
    self.prefill_chunk, self.token_budget = min(prefill_chunk, token_budget), token_budget
    self.priority, self.sampling, self.ignore_eos = priority, sampling, ignore_eos
    self.record_logits = record_logits
    self.clock = clock or StepClock()
    self.prefix = TieredPrefixCache(num_pages, page_size, host_tier)
    self.cache = init_cache(config, num_pages=num_pages, page_size=page_size, batch=1,
                            max_pages=self.max_pages, kv_dtype=kv_dtype)
    self.spec = steps.StepSpec(config, runtime, jnp.dtype(params_dtype(params)).name)
    self.waiting: list[Request] = []
    self.running: list[_Running] = []
    self.finished: list[Request] = []
    self.timeline: list[dict] = []   # per step: batch, tokens, what admission waited for, occupancy
    self.steps = 0
    self._serial: dict[str, int] = {}
    self._serials = itertools.count()
    self._staged: dict[str, tuple[list[PageContent], list[jax.Array]]] = {}
    self._eos = set(config.eos_token_ids)
    self._key = jax.random.key(seed)

  def compile_programs(self) -> None:
    """Run once every program serving can call (each step shape: batch bucket x {1, prefill_chunk};
    each page-batch bucket of the page copies and host-tier moves), on inputs that change
    nothing: padding rows write only the null page, and the null page is copied onto itself. Then
    no request's TTFT includes an XLA compile, whatever the schedule."""
    for b in sorted({self._batch_bucket(n) for n in range(1, self.max_batch + 1)}):
      for width in sorted({1, self.prefill_chunk}):
        self._call(np.zeros((b, width), np.int32), np.full((b, width), -1, np.int32),
                   np.zeros((b, self.max_pages), np.int32), jax.random.key(0))
    for n in range(bucket_pow2(self.prefix.pool.usable).bit_length()):
      nulls = [NULL_PAGE] * (1 << n)
      self.cache = copy_pages(self.cache, nulls, nulls)
      if self.prefix.host is not None:  # a restore writes host arrays (device_put), not device ones
        data = jax.device_put([np.asarray(a) for a in extract_pages(self.cache.layers, jnp.asarray(nulls))])
        self.cache = self.cache.replace(layers=insert_pages(self.cache.layers, jnp.asarray(nulls), data))
    jax.block_until_ready(self.cache)

  @property
  def idle(self) -> bool:
    return not self.waiting and not self.running

  def submit(self, request: Request) -> None:
    """Queue a request; refuses one that could never be served (vocabulary, context, pool)."""
    check_tokens(self.config, [request.prompt], extra_positions=request.max_new_tokens)
    if request.id in self._serial:
      raise ValueError(f"request id {request.id!r} was submitted before")
    pages = self.prefix.pages_for(len(request.prompt) + request.max_new_tokens - 1)
    if pages > self.max_pages:
      raise ValueError(f"request {request.id}: {len(request.prompt)} prompt + {request.max_new_tokens} "
                       f"new tokens exceed max_seq_len {self.max_pages * self.page_size}")
    if pages + 1 > self.prefix.pool.usable:
      raise ValueError(f"request {request.id} needs up to {pages + 1} pages; the pool has only "
                       f"{self.prefix.pool.usable} usable")
    self._serial[request.id] = next(self._serials)
    self.waiting.append(request)

  def step(self) -> list[Request]:
    """Admit, run one model call over the running requests, return the requests it finished."""
    waits_for = self._admit(self.clock.now())
    rows = self._plan()
    if not rows:
      return []
    sampled, logits, width = self._run(rows)
    self._stage()                      # host-to-device copies overlap the step in flight
    if self.prefix.host is not None:
      self.prefix.host.materialize()   # device-to-host copies of evicted pages
    sampled = np.asarray(sampled)
    self.clock.tick()
    self.steps += 1
    now, done = self.clock.now(), []
    for i, (r, n) in enumerate(rows):
      r.written += n
      if r.pending:
        continue
      req, token = r.request, int(sampled[i])
      req.output.append(token)
      if req.first_token is None:
        req.first_token = now
        if self.record_logits:
          req.first_logits = np.asarray(logits[i])
      if len(req.output) == req.max_new_tokens or (not self.ignore_eos and token in self._eos):
        self._finish(r, now)
        done.append(req)
    self.finished += done
    self._record(now, rows, width, waits_for)
    return done

  def _order(self, request: Request) -> tuple:
    rank = PRIORITIES.index(request.priority) if self.priority else 0
    return rank, request.arrival, self._serial[request.id]

  @staticmethod
  def _session(request: Request) -> str:
    # Every request gets a session, so that a preempted one keeps its trailing partial page too.
    return request.session or f"request-{request.id}"

  def _admit(self, now: float) -> str | None:
    """Admit in order; returns what the first request left waiting lacks ("slot" or "pages")."""
    for req in sorted(self.waiting, key=self._order):
      context = req.prompt + req.output
      budget = req.max_new_tokens - len(req.output) - 1
      while (lack := self._lack(context, budget, req)) is not None:
        victim = self._victim(req)
        if victim is None:
          return lack  # strict order: later requests wait behind this one
        self._preempt(victim)
      self._start(req, context, budget, now)
    return None

  def _lack(self, context: list[int], budget: int, req: Request) -> str | None:
    if len(self.running) == self.max_batch:
      return "slot"
    pool = self.prefix.pool
    need = self.prefix.demand(context, budget, session=self._session(req))
    return "pages" if need > pool.num_free + pool.num_evictable else None

  def _victim(self, req: Request) -> _Running | None:
    """The newest running request of a lower class than `req` (none without priorities)."""
    lower = [r for r in self.running if self.priority and
             PRIORITIES.index(r.request.priority) > PRIORITIES.index(req.priority)]
    return max(lower, key=lambda r: self._order(r.request), default=None)

  def _finish(self, r: _Running, now: float) -> None:
    if r.request.session is None:  # no later round can reuse its partial page: drop it
      self.prefix.truncate(r.seq, r.seq.length // self.page_size * self.page_size)
    self.prefix.release(r.seq)
    self.running.remove(r)
    r.request.finished = now

  def _preempt(self, r: _Running) -> None:
    """Release what the request wrote to the prefix cache; it resumes from there later."""
    self.prefix.truncate(r.seq, r.written)
    self.prefix.release(r.seq)
    self.running.remove(r)
    r.request.preemptions += 1
    self.waiting.append(r.request)

  def _start(self, req: Request, context: list[int], budget: int, now: float) -> None:
    seq, restore = self.prefix.open(context, budget, session=self._session(req))
    items = [item for item, _ in restore.host]
    staged = self._staged.pop(req.id, None)
    data = staged[1] if staged is not None and staged[0] == items else None
    self.cache = self.prefix.apply(self.cache, restore, data)
    if staged is not None:
      self.prefix.host.unpin([item.key for item in staged[0]])
    if seq.copies:
      self.cache = copy_pages(self.cache, *map(list, zip(*seq.copies)))
    host = sum(max(0, min(start + len(item.tokens), seq.num_cached) - start) for item, start in restore.host)
    req.lookup_tokens += len(context)
    req.host_hit_tokens += host
    req.device_hit_tokens += seq.num_cached - host
    if req.admitted is None:
      req.admitted = now
    self.waiting.remove(req)
    self.running.append(_Running(req, seq, written=seq.num_cached))

  def _plan(self) -> list[tuple[_Running, int]]:
    """(request, tokens this step): one-token rows first (each emits a token), then prefill chunks."""
    order = sorted(self.running, key=lambda r: self._order(r.request))
    for r in order:
      if r.pending == 0:  # decoding: its last sampled token is the next input (pages reserved)
        self.prefix.extend(r.seq, r.request.output[-1:])
    rows, budget = [], self.token_budget
    for r in order:
      if r.pending == 1 and budget:
        rows.append((r, 1))
        budget -= 1
    for r in order:
      if r.pending > 1 and budget:
        n = min(r.pending, self.prefill_chunk, budget)
        rows.append((r, n))
        budget -= n
    return rows

  def _run(self, rows: list[tuple[_Running, int]]) -> tuple[jax.Array, jax.Array, int]:
    b = self._batch_bucket(len(rows))
    width = 1 if all(n == 1 for _, n in rows) else self.prefill_chunk
    tokens = np.zeros((b, width), np.int32)
    positions = np.full((b, width), -1, np.int32)
    table = np.zeros((b, self.max_pages), np.int32)
    for i, (r, n) in enumerate(rows):
      tokens[i, :n] = r.seq.tokens[r.written:r.written + n]
      positions[i, :n] = np.arange(r.written, r.written + n)
      table[i] = self.prefix.page_table(r.seq, self.max_pages)[0]
    self._key, key = jax.random.split(self._key)
    sampled, logits = self._call(tokens, positions, table, key)
    return sampled, logits, width

  def _batch_bucket(self, rows: int) -> int:
    """Batch rows of the step program serving `rows` requests: a power of two, at most max_batch."""
    return min(bucket_pow2(rows), self.max_batch)

  def _call(self, tokens: np.ndarray, positions: np.ndarray, table: np.ndarray, key: jax.Array):
    """One serve_step over rows [B, W] with page table [B, max_pages]: (sampled, logits)."""
    cache = self.cache.replace(page_table=jnp.asarray(table), lengths=jnp.zeros((table.shape[0],), jnp.int32))
    sampled, logits, self.cache = serve_step(self.params, cache, jnp.asarray(tokens), jnp.asarray(positions),
                                             key, spec=self.spec, sampling=self.sampling)
    return sampled, logits

  def _stage(self) -> None:
    """Start fetching the host pages of the next requests to be admitted, pinned until then."""
    host = self.prefix.host
    if host is None:
      return
    for req in sorted(self.waiting, key=self._order)[:self.max_batch]:
      if req.id in self._staged:
        continue
      found = self.prefix.locate(req.prompt + req.output, session=self._session(req))
      if found.host:
        host.pin(found.host_keys)
        self._staged[req.id] = ([item for item, _ in found.host], host.fetch(found.host_keys))

  def _record(self, now: float, rows: list[tuple[_Running, int]], width: int, waits_for: str | None) -> None:
    pool, host = self.prefix.pool, self.prefix.host
    self.timeline.append(dict(
        time=now, step=self.steps, batch=len(rows), width=width, tokens=sum(n for _, n in rows),
        running=len(self.running), waiting=len(self.waiting), waits_for=waits_for,
        device_held=pool.usable - pool.num_free - pool.num_evictable, device_cached=pool.num_evictable,
        device_free=pool.num_free, host_pages=len(host) if host else 0, host_bytes=host.nbytes if host else 0))
