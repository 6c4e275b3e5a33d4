"""Multi-round serving over the paged cache: host prefix index + jitted device steps.

A `Session` is one conversation. Each round appends its new tokens to the conversation, asks the
prefix cache which pages already hold its KV (this session's own pages, the trailing partial page
included, or full pages shared with other sessions), prefills only the rest in chunks, then
decodes on device (one `lax.while_loop`, or with device_loop=False one host-driven jitted step
per token: the baseline). Sessions of one round run as one decode batch (concurrency = batch).
With `mtp_cache=True` the engine also keeps the MTP layer's pages (same page ids) so that rounds
can decode speculatively (`run_round(..., spec=SpecConfig(...))`, glmjax.engine.speculative).
"""

import dataclasses
import functools
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.api import check_tokens, params_dtype
from glmjax.cache.paged import KVCache, LayerCache, check_geometry, init_cache
from glmjax.cache.prefix_cache import NULL_PAGE, PrefixCache, SequenceAlloc
from glmjax.config import ModelConfig
from glmjax.engine import steps
from glmjax.engine.sampling import Sampling, sample
from glmjax.engine.speculative import SpecConfig, copy_pages, init_mtp_layer, prefill_chunk_mtp, spec_decode_call
from glmjax.runtime import Runtime


@dataclasses.dataclass
class RoundStats:
  prompt_tokens: int          # the whole context of this round
  cached_tokens: int          # served from the cache
  prefilled_tokens: int
  ttft_s: float               # round start -> first output token on the host
  decode_tokens: int
  decode_s: float
  output: list[int]
  first_logits: np.ndarray    # [V] fp32: the distribution the first output token was drawn from
  decode_steps: int = 0       # device loop iterations (shared by the batch)
  dispatch_s: float = 0.0     # host time to submit the decode program (until the call returns; a first call compiles)
  verify_steps: int = 0       # speculative steps of this sequence (drafts verified)
  plain_steps: int = 0        # single-token steps (fallback, or num_draft 0)
  acceptance_length: float = 0.0            # tokens per verify step: accepted drafts + 1, <= k + 1
  acceptance_rate_per_position: list[float] = dataclasses.field(default_factory=list)
  drafts_per_position: list[int] = dataclasses.field(default_factory=list)  # verify steps drafting there

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

  @property
  def step_s(self) -> float:
    """Average device step: total decode time / loop steps (steps are not timed one by one)."""
    return self.decode_s / self.decode_steps if self.decode_steps else 0.0


@dataclasses.dataclass
class Session:
  """One conversation: its token history (inputs and outputs) and its prefix-cache identity."""
  id: str
  history: list[int] = dataclasses.field(default_factory=list)


@functools.partial(jax.jit, donate_argnames=("cache", "mtp"))
def _copy_pages(cache: KVCache, mtp: LayerCache | None, src: jax.Array, dst: jax.Array):
  """Copy whole pages src[i] -> dst[i] in every layer, the MTP layer's included."""
  layers = tuple(copy_pages(layer, src, dst) for layer in cache.layers)
  return cache.replace(layers=layers), None if mtp is None else copy_pages(mtp, src, dst)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _set_slot(cache: KVCache, slot: jax.Array, table: jax.Array, length: jax.Array) -> KVCache:
  return cache.replace(page_table=cache.page_table.at[slot].set(table), lengths=cache.lengths.at[slot].set(length))


class Engine:
  """Owns the device cache and the host prefix cache for up to `max_batch` concurrent sequences."""

  def __init__(self, config: ModelConfig, params, *, runtime: Runtime = Runtime(), num_pages: int = 1024,
               page_size: int = 16, max_batch: int = 1, max_seq_len: int | None = None,
               kv_dtype: str = "bf16", prefix_cache: bool = True, prefill_chunk: int = 512,
               mtp_cache: bool = False, mesh: jax.sharding.Mesh | None = None, device_loop: bool = True):
    """mesh: run TEP-sharded over it (glmjax.parallel): params in the rules table's layout, the
    page pool replicated, every step traced under the mesh. device_loop: decode as one on-device
    loop, or (False) as one jitted step per token driven by the host (`steps.LoopCall.run`)."""
    max_seq_len = check_geometry(config, page_size, max_seq_len)
    if prefill_chunk <= 0:
      raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    self.config, self.params = config, params
    self.page_size, self.max_batch, self.prefill_chunk = page_size, max_batch, prefill_chunk
    self.max_pages = math.ceil(max_seq_len / page_size)
    self.prefix_cache_enabled = prefix_cache
    self.prefix = PrefixCache(num_pages, page_size)
    self.cache = init_cache(config, num_pages=num_pages, page_size=page_size, batch=max_batch,
                            max_pages=self.max_pages, kv_dtype=kv_dtype)
    if mtp_cache and not config.num_nextn_predict_layers:
      raise ValueError("mtp_cache=True needs a model with an MTP layer (num_nextn_predict_layers >= 1)")
    # Every round keeps the MTP pages current when they exist, so cached pages serve later drafts.
    self.mtp = (init_mtp_layer(config, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype) if mtp_cache
                else None)
    self.spec = steps.StepSpec(config, runtime, jnp.dtype(params_dtype(params)).name)
    self.mesh, self.device_loop = mesh, device_loop
    self._last_decode: steps.LoopCall | None = None  # the last round's decode (carry as shapes)
    if mesh is not None:
      from glmjax import parallel  # imports the model: kept out of the engine's import time
      self.params = parallel.shard_params(config, params, mesh)
      self.cache = parallel.shard_cache(self.cache, mesh)
      self.mtp = jax.device_put(self.mtp, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    self.params = runtime.arrange(self.params)  # after sharding: the rules table knows ModelOpt's layout
    self._ids = itertools.count()

  def open_session(self) -> Session:
    return Session(id=f"s{next(self._ids)}")

  def _namespace(self) -> str:
    # Without prefix caching every request gets a namespace of its own, so nothing is shared.
    return "" if self.prefix_cache_enabled else f"request-{next(self._ids)}"

  def _prefill(self, slot: int, seq: SequenceAlloc) -> tuple[jax.Array, jax.Array]:
    """Apply page copies, point the slot at the sequence's pages, prefill the uncached suffix."""
    if seq.copies:
      src, dst = map(jnp.asarray, zip(*seq.copies))
      self.cache, self.mtp = _copy_pages(self.cache, self.mtp, src, dst)
    table, _ = self.prefix.page_table(seq, self.max_pages)
    self.cache = _set_slot(self.cache, jnp.int32(slot), jnp.asarray(table), jnp.int32(seq.num_cached))
    tokens = np.asarray(seq.tokens, np.int32)
    for start in range(seq.num_cached, len(tokens), self.prefill_chunk):
      chunk = np.full((self.max_batch, self.prefill_chunk), 0, np.int32)
      positions = np.full((self.max_batch, self.prefill_chunk), -1, np.int32)
      piece = tokens[start:start + self.prefill_chunk]
      chunk[slot, :len(piece)] = piece
      positions[slot, :len(piece)] = np.arange(start, start + len(piece))
      if self.mtp is None:
        logits, hidden, self.cache = steps.prefill_chunk(self.params, self.cache, jnp.asarray(chunk),
                                                         jnp.asarray(positions), spec=self.spec)
        continue
      # MTP slot p needs the token after p: known for all but the prompt's last position.
      following = np.full_like(chunk, -1)
      nxt = tokens[start + 1:start + self.prefill_chunk + 1]
      following[slot, :len(nxt)] = nxt
      logits, hidden, self.cache, self.mtp = prefill_chunk_mtp(
          self.params, self.cache, self.mtp, jnp.asarray(chunk), jnp.asarray(positions),
          jnp.asarray(following), spec=self.spec)
    return logits[slot], hidden[slot]

  def run_round(self, sessions: list[Session], new_tokens: list[list[int]], max_new_tokens: int, **kw
                ) -> list[RoundStats]:
    """See `_run_round`; under the engine's mesh when it has one."""
    if self.mesh is None:
      return self._run_round(sessions, new_tokens, max_new_tokens, **kw)
    from glmjax import parallel
    with parallel.use_mesh(self.mesh):
      return self._run_round(sessions, new_tokens, max_new_tokens, **kw)

  def compiled_decode(self) -> jax.stages.Compiled:
    """The program the last round's decode ran per call (the whole device loop, or with
    device_loop=False the one-step body), from jit's cache: its HLO (`as_text()`, see
    glmjax.hlo_stats) and `memory_analysis()`."""
    if self._last_decode is None:
      raise ValueError("no round has been decoded yet: call run_round first")
    if self.mesh is None:
      return self._last_decode.compile(self.device_loop)
    from glmjax import parallel
    with parallel.use_mesh(self.mesh):
      return self._last_decode.compile(self.device_loop)

  def _run_round(self, sessions: list[Session], new_tokens: list[list[int]], max_new_tokens: int, *,
                 sampling: Sampling = Sampling(), seed: int = 0, ignore_eos: bool = False,
                 spec: SpecConfig | None = None) -> list[RoundStats]:
    """Append each session's new tokens, prefill what is not cached, decode up to max_new_tokens
    (speculatively with `spec`: needs mtp_cache=True)."""
    if not 1 <= len(sessions) <= self.max_batch or len(sessions) != len(new_tokens):
      raise ValueError(f"need 1..{self.max_batch} sessions with one token list each, "
                       f"got {len(sessions)} sessions and {len(new_tokens)} lists")
    if spec is not None and self.mtp is None:
      raise ValueError("speculative decoding needs the MTP layer's pages: build the Engine with mtp_cache=True")
    # With MTP pages and no spec, single-token steps that still keep the MTP pages current.
    draft = (spec or SpecConfig(num_draft=0)).shape
    ahead = draft.num_draft  # drafted positions are written past the accepted length
    contexts = [s.history + list(t) for s, t in zip(sessions, new_tokens)]
    for ctx in contexts:
      check_tokens(self.config, np.asarray([ctx]), extra_positions=max_new_tokens + ahead)
      if len(ctx) + max_new_tokens + ahead > self.max_pages * self.page_size:
        raise ValueError(f"context {len(ctx)} + {max_new_tokens} new tokens + {ahead} drafts exceeds the "
                         f"engine's max_seq_len {self.max_pages * self.page_size}")
    seqs: list[SequenceAlloc] = []
    scratch: list[int] = []
    nspan = draft.span_pages(self.page_size)
    try:
      for s, ctx in zip(sessions, contexts):
        seq = self.prefix.open_sequence(ctx, namespace=self._namespace(),
                                        session=s.id if self.prefix_cache_enabled else None)
        seqs.append(seq)
        # Reserve the decode budget now, so decoding can never run out of pages.
        self.prefix.reserve(seq, max_new_tokens - 1 + ahead)
      scratch = self.prefix.pool.allocate(len(seqs) * (draft.paths - 1) * nspan)
    except Exception:
      for seq in seqs:  # undo this round's admissions: keep only pages that already held KV
        self.prefix.truncate(seq, seq.write_floor)
        self.prefix.release(seq)
      raise

    key = jax.random.key(seed)
    start = time.perf_counter()
    firsts, ttfts, hiddens = [], [], []
    for slot, seq in enumerate(seqs):
      logits, hidden = self._prefill(slot, seq)
      key, sub = jax.random.split(key)
      firsts.append((int(sample(logits[None], sub, sampling)[0]), np.asarray(logits)))
      hiddens.append(hidden)
      ttfts.append(time.perf_counter() - start)
    b = self.max_batch
    first = np.zeros(b, np.int32)
    first[:len(seqs)] = [f for f, _ in firsts]
    active = np.arange(b) < len(seqs)
    self.cache = self.cache.replace(lengths=jnp.asarray(
        [len(c) for c in contexts] + [0] * (b - len(seqs)), jnp.int32))
    eos = jnp.asarray([] if ignore_eos else self.config.eos_token_ids, jnp.int32)
    budget = jnp.full((b,), max_new_tokens, jnp.int32)
    static = dict(spec=self.spec, sampling=sampling, max_new_tokens=max_new_tokens)
    if self.mtp is None:
      call = steps.decode_call(self.params, self.cache, jnp.asarray(first), jnp.asarray(active), key, eos, budget,
                               **static)
    else:
      table = np.full((b, draft.paths - 1, nspan), NULL_PAGE, np.int32)
      table[:len(seqs)] = np.asarray(scratch, np.int32).reshape(len(seqs), draft.paths - 1, nspan)
      last_hidden = jnp.zeros((b, hiddens[0].shape[-1]), hiddens[0].dtype).at[:len(seqs)].set(jnp.stack(hiddens))
      call = spec_decode_call(self.params, self.cache, self.mtp, jnp.asarray(first), last_hidden, jnp.asarray(active),
                              key, eos, budget, jnp.asarray(table), (spec or SpecConfig(num_draft=0)).knobs(),
                              **static, draft=draft)
    self._last_decode = call.abstract()
    decode_start = time.perf_counter()
    outputs = call.run(self.device_loop)
    if self.mtp is None:
      (out, counts, steps_run, self.cache), stats = outputs, None
      steps_run = steps_run - 1  # decode counts from 1 (the first token's column)
    else:
      out, counts, steps_run, self.cache, self.mtp, stats = outputs
    dispatch_s = time.perf_counter() - decode_start
    out, counts, steps_run = np.asarray(out), np.asarray(counts), int(steps_run)
    decode_s = time.perf_counter() - decode_start
    stats = None if stats is None else jax.tree.map(np.asarray, stats)
    for page in scratch:
      self.prefix.pool.decref(page)

    results = []
    for slot, (s, seq, ctx) in enumerate(zip(sessions, seqs, contexts)):
      emitted = out[slot, :counts[slot]].tolist()
      # The cache holds the context and every emitted token but the last (the next input).
      self.prefix.extend(seq, emitted[:-1])
      self.prefix.release(seq)
      s.history = ctx + emitted
      st = RoundStats(prompt_tokens=len(ctx), cached_tokens=seq.num_cached,
                      prefilled_tokens=len(ctx) - seq.num_cached, ttft_s=ttfts[slot],
                      decode_tokens=len(emitted) - 1, decode_s=decode_s, output=emitted,
                      first_logits=firsts[slot][1], decode_steps=steps_run, dispatch_s=dispatch_s)
      if stats is not None:
        verify = int(stats["verify_steps"][slot])
        drafted, accepted = stats["proposed"][slot], stats["accepted"][slot]
        st = dataclasses.replace(
            st, verify_steps=verify, plain_steps=int(stats["plain_steps"][slot]),
            acceptance_length=float(stats["verified_tokens"][slot]) / verify if verify else 0.0,
            acceptance_rate_per_position=[float(a / d) if d else 0.0 for a, d in zip(accepted, drafted)],
            drafts_per_position=drafted.tolist())
      results.append(st)
    return results
