"""MTP speculative decoding as one device program: draft with the MTP layer, verify the last token
and k drafts in one main-model pass, accept on device, all inside one `lax.while_loop` (or, with
device_loop=False, the same step as one host-driven jitted call each: `steps.LoopCall`).

Notation, per sequence and step: the main cache holds positions [0, L); x, the last emitted token
(position L), is the next input; h_p is the main model's final normed hidden state at p.

MTP cache. The MTP layer has its own single-layer `LayerCache` under the main cache's page table
and lengths (`mtp_view`): slot p holds the MTP layer's KV for MTP(h_p, embed(t_{p+1})), the input
it was trained with at position p, so slot p can be written once t_{p+1} is accepted. A step:

1. catch-up (draft step 0): one MTP pass over the *pending* positions, those the previous step
   accepted (up to k+1 of them, always ending at L-1), with their verified h and next tokens:
   it writes their slots and, at L-1 (h_{L-1}, x), gives the first draft d_1;
2. draft steps j = 1..k-1 feed the MTP block's own output back: MTP(h'_{j-1}, d_j) at position
   L-1+j gives d_{j+1}. Their slots hold draft-time values; step 1 rewrites the accepted ones;
3. verify: the main model on [x, d_1..d_k] at positions L..L+k, one pass through the cache;
4. accept n drafts plus one token (bonus or correction): the lengths advance by n+1 and the
   pending positions become L..L+n with hidden h_L..h_{L+n} and tokens [d_1..d_n, next].
Rollback costs nothing: positions written past the new length are never read as valid (a query
sees only positions <= its own) and the next step overwrites them. After the loop a last catch-up
leaves an MTP slot for every position below the main length. `prefill_chunk_mtp` writes the
prompt's slots, all but the last (whose next token is the first output, pending at decode start).
Prefix reuse: a shared page's last slot holds the next token of the sequence that wrote it; a
sequence diverging exactly at that page boundary drafts from one stale slot (outputs are exact
anyway: every emitted token is the main model's).

Drafting options: `mtp_index_share` runs the MTP indexer at step 0 only; later steps reuse its
top-k plus the positions drafted since (which step 0 could not see). A draft confidence below
`threshold` ends drafting (later drafts are masked: not verified as candidates, and the draft
loop exits early when no sequence drafts on); when a sequence's acceptance EMA falls below
`acceptance_floor` it takes single-token steps for `probe_interval` steps, then probes again.

Trees (branch b > 1): the first `depth` draft positions branch into the MTP's top-b candidates,
giving P = b^depth root-to-leaf paths. Each path is verified as its own batch row: its page
table is the sequence's, with the pages of positions L..L+k replaced by per-path scratch pages
(the first one copied from the real page, for the positions below L it holds); the accepted
path's pages are copied back. No attention change is needed; a flat tree in one row would need an
explicit query-query mask in glmjax/dsa.py instead. Acceptance walks the tree with recursive
rejection over siblings (tree drafts are deterministic, so q is one-hot), which keeps the target
distribution exactly, as the chain's standard speculative sampling does.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from glmjax.cache.paged import KVCache, LayerCache, init_cache
from glmjax.cache.prefix_cache import NULL_PAGE
from glmjax.config import ModelConfig
from glmjax.engine.sampling import Sampling, processed_logits, sample, top_k
from glmjax.engine.steps import LoopCall, LoopProgram, StepSpec
from glmjax.model import CausalLM
from glmjax.parallel.mesh import active_mesh

MAX_DRAFT = 7  # k + 1 <= 8 verified tokens: the sparse attention path's query limit


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """num_draft k (0..7; 0 = single-token steps); branch b (1 = chain) with at most max_paths
  root-to-leaf paths; threshold: drafting continues past a draft only while its top probability
  is >= threshold; acceptance_floor / probe_interval / ema_decay: the single-token fallback
  (floor 0 never falls back); mtp_index_share: later draft steps reuse step 0's MTP top-k."""
  num_draft: int = 4
  branch: int = 1
  threshold: float = 0.95
  mtp_index_share: bool = True
  max_paths: int = 8
  acceptance_floor: float = 0.0
  probe_interval: int = 16
  ema_decay: float = 0.8

  def __post_init__(self):
    if not 0 <= self.num_draft <= MAX_DRAFT:
      raise ValueError(f"num_draft must be in [0, {MAX_DRAFT}], got {self.num_draft}")
    if self.branch < 1 or self.max_paths < 1:
      raise ValueError(f"branch and max_paths must be >= 1, got {self.branch} and {self.max_paths}")
    if not 0 <= self.threshold <= 1 or not 0 <= self.acceptance_floor <= 1:
      raise ValueError(f"threshold and acceptance_floor must be in [0, 1], got {self.threshold} "
                       f"and {self.acceptance_floor}")
    if self.probe_interval < 1 or not 0 <= self.ema_decay < 1:
      raise ValueError(f"probe_interval must be >= 1 and ema_decay in [0, 1), got "
                       f"{self.probe_interval} and {self.ema_decay}")
    if self.branch > 1 and self.num_draft == 0:
      raise ValueError("a draft tree (branch > 1) needs num_draft >= 1")

  @property
  def shape(self) -> "DraftShape":
    depth = 0
    while self.branch > 1 and depth < self.num_draft and self.branch ** (depth + 1) <= self.max_paths:
      depth += 1
    return DraftShape(self.num_draft, self.branch if depth else 1, depth, self.mtp_index_share,
                      self.acceptance_floor > 0)

  def knobs(self) -> dict[str, jax.Array]:
    """The settings that change no shape: traced arguments, so changing them does not recompile."""
    return dict(threshold=jnp.float32(self.threshold), floor=jnp.float32(self.acceptance_floor),
                decay=jnp.float32(self.ema_decay), probe=jnp.int32(self.probe_interval))


@dataclasses.dataclass(frozen=True)
class DraftShape:
  """The static part of a SpecConfig: draft positions k, branching b over the first `depth`, and
  whether the single-token fallback step is compiled in."""
  num_draft: int
  branch: int = 1
  depth: int = 0
  index_share: bool = True
  fallback: bool = False

  @property
  def paths(self) -> int:
    return self.branch ** self.depth

  def span_pages(self, page_size: int) -> int:
    """Pages a step can write per path: positions L..L+k."""
    return 1 + -(-self.num_draft // page_size)


def mtp_view(cache: KVCache, layer: LayerCache) -> KVCache:
  """The MTP layer's cache: its own pages under the main cache's page table and lengths."""
  return cache.replace(layers=(layer,))


def init_mtp_layer(config: ModelConfig, *, num_pages: int, page_size: int, kv_dtype: str) -> LayerCache:
  """Empty pages for the MTP layer (one decoder layer with its own indexer)."""
  one = dataclasses.replace(config, num_hidden_layers=1, mlp_layer_types=None, indexer_types=None,
                            num_nextn_predict_layers=0)
  return init_cache(one, num_pages=num_pages, page_size=page_size, batch=1, max_pages=1,
                    kv_dtype=kv_dtype, indexer_layers=(0,)).layers[0]


def copy_pages(layer: LayerCache, src: jax.Array, dst: jax.Array) -> LayerCache:
  """Copy whole pages (values and scales together) src[i] -> dst[i]."""
  return jax.tree.map(lambda a: a.at[dst].set(a[src]), layer)


def _apply_mtp(spec: StepSpec, params, cache: KVCache, layer: LayerCache, tokens, hidden, positions,
               runtime=None, prev_topk=None):
  """mtp_step through the MTP view -> (logits, MTP output hidden, new MTP layer pages, top-k)."""
  logits, h, view, topk = spec.model.apply(
      {"params": params}, tokens, hidden, positions, cache=mtp_view(cache, layer),
      runtime=runtime or spec.runtime, prev_topk=prev_topk, method=CausalLM.mtp_step)
  return logits, h, view.layers[0], topk


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("cache", "mtp_layer"))
def prefill_chunk_mtp(params, cache: KVCache, mtp_layer: LayerCache, tokens: jax.Array, positions: jax.Array,
                      next_tokens: jax.Array, *, spec: StepSpec):
  """`steps.prefill_chunk` that also writes the chunk's MTP slots.

  next_tokens [B, C]: the token after each position (-1 where unknown: the prompt's last token,
  whose slot decoding writes once the first output is known). Returns (logits [B, V], hidden
  [B, D] at each sequence's last real token, new cache, new MTP pages).
  """
  logits, hidden, cache = spec.model.apply({"params": params}, tokens, positions, cache=cache,
                                           runtime=spec.runtime)
  _, _, mtp_layer, _ = _apply_mtp(spec, params, cache, mtp_layer, next_tokens, hidden,
                                  jnp.where(next_tokens >= 0, positions, -1))
  last = jnp.argmax(positions, axis=1)
  pick = lambda a: jnp.take_along_axis(a, last[:, None, None], axis=1)[:, 0]
  lengths = jnp.maximum(cache.lengths, jnp.max(positions, axis=1) + 1)
  return pick(logits), pick(hidden), cache.replace(lengths=lengths), mtp_layer


def _scores(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """What drafts are ranked by: the raw logits when greedy, else the target-style processed ones."""
  return logits if sampling.temperature == 0.0 else processed_logits(logits, sampling)


def accept(drafts: jax.Array, proposed: jax.Array, target_logits: jax.Array, draft_logits: jax.Array | None,
           key: jax.Array, sampling: Sampling, *, branch: int = 1, depth: int = 0):
  """Accept a prefix of the drafts on the best path and pick the token after it.

  drafts [B, P, k] int32 over P = branch^depth paths (path r takes candidate
  (r // branch^(depth-1-j)) % branch at draft position j < depth, the top one below);
  proposed [B, P, k] bool (masked drafts are never accepted); target_logits [B, P, k+1, V]: the
  main model's logits at x, d_1..d_k along each path; draft_logits [B, P, k, V]: the distributions
  the drafts were sampled from, or None when drafts were chosen deterministically (q one-hot).
  Greedy: accept while the draft is the target argmax. Otherwise speculative sampling: accept a
  candidate x with probability min(1, r(x) / q(x)), where r is the target distribution p, after
  a rejected sibling the residual normalize(max(r - q, 0)); at the first node where nothing is
  accepted the next token is drawn from r, after a full path from p. The emitted tokens are
  distributed exactly as sampling from p token by token.
  Returns (path [B] int32, accepted count n [B] int32, next token [B] int32).
  """
  b, p, k = drafts.shape
  greedy = sampling.temperature == 0.0
  seq = jnp.arange(b)
  if greedy:
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)            # [B, P, k+1]
  else:
    target = jax.nn.softmax(processed_logits(target_logits, sampling), axis=-1)
    q_all = (jax.nn.one_hot(drafts, target.shape[-1]) if draft_logits is None
             else jax.nn.softmax(processed_logits(draft_logits, sampling), axis=-1))
    key_u, key_next = jax.random.split(key)
    u = jax.random.uniform(key_u, (b, k, branch))
    dist = jnp.zeros((b, target.shape[-1]), jnp.float32)                  # where the next token comes from
  row = jnp.zeros((b,), jnp.int32)
  n = jnp.zeros((b,), jnp.int32)
  alive = jnp.ones((b,), bool)
  for j in range(k):
    children, stride = (branch, branch ** (depth - 1 - j)) if j < depth else (1, 0)
    parent, took = row, jnp.zeros((b,), bool)
    if not greedy:
      resid = target[seq, parent, j]
    for c in range(children):
      child = parent + c * stride
      tok = drafts[seq, child, j]
      trying = alive & ~took & proposed[seq, child, j]
      if greedy:
        ok = tok == best[seq, parent, j]
      else:
        q = q_all[seq, child, j]
        ok = u[:, j, c] * q[seq, tok] < resid[seq, tok]
        left = jnp.maximum(resid - q, 0.0)
        total = jnp.sum(left, axis=-1, keepdims=True)
        resid = jnp.where((trying & ~ok)[:, None] & (total > 0), left / jnp.where(total > 0, total, 1.0), resid)
      row = jnp.where(trying & ok, child, row)
      took = took | (trying & ok)
    if not greedy:
      dist = jnp.where((alive & ~took)[:, None], resid, dist)
    n = n + took
    alive = alive & took
  if greedy:
    return row, n, best[seq, row, n]
  dist = jnp.where(alive[:, None], target[seq, row, k], dist)
  return row, n, jax.random.categorical(key_next, jnp.log(dist)).astype(jnp.int32)


def _emit(out, counts, stopped, tokens, num, eos_ids, budget):
  """Append each running sequence's first `num` of tokens [B, T], cut after EOS and at its budget.
  Returns (out, counts, stopped, kept [B])."""
  t = tokens.shape[1]
  i = jnp.arange(t)
  is_eos = jnp.isin(tokens, eos_ids) & (i < num[:, None])
  first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), t)
  kept = jnp.where(stopped, 0, jnp.minimum(jnp.minimum(num, first_eos + 1), budget - counts))
  cols = jnp.where(i < kept[:, None], counts[:, None] + i, out.shape[1])   # out of range: dropped
  out = out.at[jnp.arange(out.shape[0])[:, None], cols].set(tokens, mode="drop")
  counts = counts + kept
  return out, counts, stopped | (first_eos < kept) | (counts >= budget), kept


def spec_decode_call(params, cache: KVCache, mtp_layer: LayerCache | None, first_tokens: jax.Array,
                     last_hidden: jax.Array, active: jax.Array, key: jax.Array, eos_ids: jax.Array,
                     budget: jax.Array, scratch: jax.Array, knobs: dict[str, jax.Array], *, spec: StepSpec,
                     sampling: Sampling, max_new_tokens: int, draft: DraftShape) -> LoopCall:
  """Speculative decoding of up to max_new_tokens per sequence, as a loop to `run(device_loop)`
  (one on-device loop, or one host-driven jitted step per iteration) or to compile.

  As `steps.decode` (first_tokens [B], active [B], eos_ids [E], budget [B]), plus:
  mtp_layer: the MTP pages (None only with num_draft 0: plain steps, no MTP);
  last_hidden [B, D]: the main model's hidden at each sequence's last prompt position;
  scratch [B, P-1, span_pages] int32: per-path scratch pages of a tree (P = paths);
  knobs: SpecConfig.knobs().
  `run` returns (tokens [B, max_new_tokens] (-1 after each sequence stops), counts [B], loop steps,
  new cache, new MTP pages, stats: per sequence `proposed` / `accepted` [B, k] (verify steps with
  a draft at each position / with it accepted), `verify_steps`, `verified_tokens` (accepted +
  1 summed over verify steps) and `plain_steps` (single-token steps) [B]).
  """
  if mtp_layer is None and draft.num_draft > 0:
    raise ValueError(f"num_draft {draft.num_draft} needs the MTP layer's pages (mtp_layer is None)")
  program = LoopProgram.of(_spec_parts, _spec_result, spec=spec, sampling=sampling, max_new_tokens=max_new_tokens,
                           draft=draft)
  return LoopCall(program, dict(cache=cache, mtp=mtp_layer),
                  dict(params=params, first_tokens=first_tokens, last_hidden=last_hidden, active=active, key=key,
                       eos_ids=eos_ids, budget=budget, scratch=scratch, knobs=knobs))


def spec_decode(params, cache: KVCache, mtp_layer: LayerCache | None, first_tokens: jax.Array,
                last_hidden: jax.Array, active: jax.Array, key: jax.Array, eos_ids: jax.Array,
                budget: jax.Array, scratch: jax.Array, knobs: dict[str, jax.Array], *, spec: StepSpec,
                sampling: Sampling, max_new_tokens: int, draft: DraftShape, device_loop: bool = True):
  """`spec_decode_call(...).run(device_loop)`."""
  return spec_decode_call(params, cache, mtp_layer, first_tokens, last_hidden, active, key, eos_ids, budget,
                          scratch, knobs, spec=spec, sampling=sampling, max_new_tokens=max_new_tokens,
                          draft=draft).run(device_loop)


# The one-program form, for callers that trace, lower or compile it.
spec_decode_loop = jax.jit(functools.partial(spec_decode, device_loop=True),
                           static_argnames=("spec", "sampling", "max_new_tokens", "draft"),
                           donate_argnames=("cache", "mtp_layer"))


def _spec_result(state):
  stats = {name: state[name] for name in ("proposed", "accepted", "verify_steps", "verified_tokens", "plain_steps")}
  # The last emitted token of each sequence is not in the main cache yet (it is the next input).
  return state["out"], state["counts"], state["step"], state["cache"], state["mtp"], stats


def _spec_parts(consts, *, spec: StepSpec, sampling: Sampling, max_new_tokens: int, draft: DraftShape):
  """`spec_decode_call`'s loop over a state dict; its carry is the main cache and the MTP pages."""
  params, eos_ids, budget, scratch, knobs = (consts[n] for n in ("params", "eos_ids", "budget", "scratch", "knobs"))
  b = consts["first_tokens"].shape[0]
  k, paths = draft.num_draft, draft.paths
  k1 = k + 1
  model = spec.model
  seq = jnp.arange(b)
  mtp_runtime = spec.runtime
  if draft.index_share:  # mark the MTP layer (index num_hidden_layers) as sharing: it reuses prev_topk
    pattern = tuple(spec.runtime.runs_indexer(i, t == "full") for i, t in enumerate(spec.config.indexer_types))
    mtp_runtime = dataclasses.replace(spec.runtime, indexer_pattern=pattern + (False,))
  rows = lambda a: jnp.repeat(a, paths, axis=0)                          # [B, ...] -> [B * P, ...]
  hidden_dtype = consts["last_hidden"].dtype

  def init(carry):
    first_tokens, last_hidden, active = consts["first_tokens"], consts["last_hidden"], consts["active"]
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(jnp.where(active, first_tokens, -1))
    return dict(
        cache=carry["cache"], mtp=carry["mtp"], out=out, last=first_tokens, step=jnp.int32(0), key=consts["key"],
        counts=jnp.where(active, 1, 0).astype(jnp.int32),
        stopped=~active | (budget <= 1) | jnp.isin(first_tokens, eos_ids),
        pend_hidden=jnp.zeros((b, k1, last_hidden.shape[-1]), hidden_dtype).at[:, 0].set(last_hidden),
        pend_tokens=jnp.zeros((b, k1), jnp.int32).at[:, 0].set(first_tokens),
        pend_count=jnp.zeros((b,), jnp.int32) if carry["mtp"] is None else active.astype(jnp.int32),
        ema=jnp.ones((b,), jnp.float32), fallback=jnp.zeros((b,), jnp.int32),
        proposed=jnp.zeros((b, k), jnp.int32), accepted=jnp.zeros((b, k), jnp.int32),
        verify_steps=jnp.zeros((b,), jnp.int32), verified_tokens=jnp.zeros((b,), jnp.int32),
        plain_steps=jnp.zeros((b,), jnp.int32))

  def catch_up(s):
    """Write the pending positions' MTP slots; -> (state, logits [B, V], hidden [B, D], top-k) at L-1."""
    i = jnp.arange(k1)
    count = s["pend_count"][:, None]
    positions = jnp.where(i < count, s["cache"].lengths[:, None] - count + i, -1)
    logits, h, layer, topk = _apply_mtp(spec, params, s["cache"], s["mtp"], s["pend_tokens"],
                                        s["pend_hidden"], positions)
    last = jnp.maximum(s["pend_count"] - 1, 0)
    pick = lambda a: None if a is None else a[seq, last]
    return dict(s, mtp=layer, pend_count=jnp.zeros_like(s["pend_count"])), pick(logits), pick(h), pick(topk)

  def after_step(s, cache, out, counts, stopped, kept, hidden, tokens, single):
    """Common bookkeeping: lengths, pending MTP positions, the fallback countdown (its last single
    step resets the EMA to the floor: the probe that follows must reach the floor to continue)."""
    single = ~s["stopped"] & single
    counting = single & (s["fallback"] > 0)
    fallback = jnp.where(counting, s["fallback"] - 1, s["fallback"])
    ema = jnp.where(counting & (fallback == 0), knobs["floor"], s["ema"])
    return dict(s, cache=cache.replace(lengths=cache.lengths + kept), out=out, counts=counts,
                stopped=stopped, last=jnp.where(kept > 0, tokens[seq, jnp.maximum(kept - 1, 0)], s["last"]),
                pend_hidden=hidden.astype(hidden_dtype), pend_tokens=tokens, pend_count=kept,
                fallback=fallback, ema=ema, plain_steps=s["plain_steps"] + single)

  def plain_step(s, sub, *_):
    cache = s["cache"]
    positions = jnp.where(s["stopped"], -1, cache.lengths)[:, None]
    logits, hidden, cache = model.apply({"params": params}, s["last"][:, None], positions, cache=cache,
                                        runtime=spec.runtime)
    new = sample(logits[:, 0], sub, sampling)
    tokens = jnp.full((b, k1), -1, jnp.int32).at[:, 0].set(new)
    out, counts, stopped, kept = _emit(s["out"], s["counts"], s["stopped"], tokens, jnp.ones((b,), jnp.int32),
                                       eos_ids, budget)
    hidden = jnp.zeros((b, k1, hidden.shape[-1]), hidden.dtype).at[:, 0].set(hidden[:, 0])
    return after_step(s, cache, out, counts, stopped, kept, hidden, tokens, jnp.ones((b,), bool))

  def spec_step(s, sub, q_logits, h_prev, topk0):
    cache, mtp = s["cache"], s["mtp"]
    length = cache.lengths
    running = ~s["stopped"]
    wants = running & (s["fallback"] == 0)
    key_draft, key_accept = jax.random.split(sub)
    table = cache.page_table
    if paths > 1:
      # Per-path scratch pages for positions L..L+k; the first holds positions below L too.
      ps = cache.page_size
      span = length[:, None] // ps + jnp.arange(draft.span_pages(ps))        # [B, nspan]
      in_table = span < table.shape[1]
      real = jnp.where(in_table & running[:, None],
                       jnp.take_along_axis(table, jnp.minimum(span, table.shape[1] - 1), axis=1), NULL_PAGE)
      src = jnp.broadcast_to(real[:, :1], (b, paths - 1)).reshape(-1)
      dst = jnp.where(running[:, None], scratch[:, :, 0], NULL_PAGE).reshape(-1)
      cache = cache.replace(layers=tuple(copy_pages(layer, src, dst) for layer in cache.layers))
      mtp = copy_pages(mtp, src, dst)
      path_pages = jnp.concatenate([real[:, None], scratch], axis=1)           # [B, P, nspan]
      tables = jnp.broadcast_to(table[:, None], (b, paths, table.shape[1]))
      tables = tables.at[seq[:, None, None], jnp.arange(paths)[None, :, None], span[:, None, :]].set(
          path_pages, mode="drop")
      table = tables.reshape(b * paths, -1)
    view = cache.replace(page_table=table, lengths=rows(length))
    drafts, proposed, draft_logits, mtp = _draft(
        spec, params, view, mtp, rows(q_logits), rows(h_prev), None if topk0 is None else rows(topk0),
        rows(wants), knobs["threshold"], key_draft, sampling, draft, mtp_runtime)
    tokens = jnp.concatenate([rows(s["last"])[:, None], drafts], axis=1)       # [B * P, k + 1]
    positions = jnp.where(rows(running)[:, None], rows(length)[:, None] + jnp.arange(k1), -1)
    logits, hidden, view = model.apply({"params": params}, tokens, positions, cache=view, runtime=spec.runtime)
    cache = cache.replace(layers=view.layers)
    per_seq = lambda a: a.reshape(b, paths, *a.shape[1:])
    path, n, new = accept(per_seq(drafts), per_seq(proposed), per_seq(logits),
                          None if draft_logits is None else per_seq(draft_logits), key_accept, sampling,
                          branch=draft.branch, depth=draft.depth)
    if paths > 1:  # the accepted path's pages back into the sequence's own
      back = jnp.where((path > 0)[:, None], scratch[seq, jnp.maximum(path - 1, 0)], real)
      cache = cache.replace(layers=tuple(copy_pages(layer, back.reshape(-1), real.reshape(-1))
                                         for layer in cache.layers))
    chosen = seq * paths + path
    drafts, proposed, hidden = drafts[chosen], proposed[chosen], hidden[chosen]
    i = jnp.arange(k1)
    emitted = jnp.where(i < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), jnp.where(i == n[:, None], new[:, None], -1))
    out, counts, stopped, kept = _emit(s["out"], s["counts"], s["stopped"], emitted, n + 1, eos_ids, budget)
    s = after_step(dict(s, mtp=mtp), cache, out, counts, stopped, kept, hidden, emitted, ~wants)
    # Acceptance statistics and the fallback EMA, for the sequences that drafted.
    drafted = wants[:, None] & proposed
    num_drafted = jnp.sum(drafted, axis=1)
    ema = jnp.where(num_drafted > 0, knobs["decay"] * s["ema"]
                    + (1 - knobs["decay"]) * n / jnp.maximum(num_drafted, 1), s["ema"])
    enter = wants & (num_drafted > 0) & (ema < knobs["floor"])
    return dict(s, ema=ema, fallback=jnp.where(enter, knobs["probe"], s["fallback"]),
                proposed=s["proposed"] + drafted,
                accepted=s["accepted"] + (wants[:, None] & (jnp.arange(k) < n[:, None])),
                verify_steps=s["verify_steps"] + wants, verified_tokens=s["verified_tokens"] + wants * (n + 1))

  def cond(s):
    # One iteration more once all have stopped: its catch-up writes the last pending MTP slots.
    return (s["step"] < max_new_tokens) & (jnp.any(~s["stopped"]) | jnp.any(s["pend_count"] > 0))

  def body(s):
    key, sub = jax.random.split(s["key"])
    s = dict(s, key=key)
    q_logits = h_prev = topk0 = None
    if s["mtp"] is not None:
      s, q_logits, h_prev, topk0 = catch_up(s)
    running = ~s["stopped"]
    any_running = jnp.any(running).astype(jnp.int32)
    branches = [lambda s, *_: s]  # idle: the final catch-up only
    if k == 0:
      branches.append(plain_step)
      index = any_running
    elif not draft.fallback:
      branches.append(spec_step)
      index = any_running
    else:  # single-token steps when every running sequence is in fallback
      branches += [plain_step, spec_step]
      index = any_running * (1 + jnp.any(running & (s["fallback"] == 0)))
    s = jax.lax.switch(index, branches, s, sub, q_logits, h_prev, topk0)
    return dict(s, step=s["step"] + any_running)

  return init, cond, body


def _draft(spec: StepSpec, params, view: KVCache, mtp: LayerCache, q_logits, h_prev, topk0, wants, threshold,
           key, sampling: Sampling, draft: DraftShape, runtime):
  """Chained MTP drafting for every path row R (q_logits [R, V] and h_prev [R, D] from the catch-up
  at L-1). Returns (drafts [R, k], proposed [R, k] bool, the drafts' logits [R, k, V] when they were
  sampled (a stochastic chain) else None, new MTP pages)."""
  r = q_logits.shape[0]
  k = draft.num_draft
  length = view.lengths
  sampled = draft.paths == 1 and sampling.temperature > 0
  # Path row -> its candidate index at each branching position (lexicographic: the first varies
  # slowest), and the row that stands for its subtree at each depth: paths sharing drafts before j
  # take draft j from that row's distribution, so they agree exactly, whatever the rounding.
  path = jnp.arange(r) % draft.paths
  strides = [draft.branch ** (draft.depth - 1 - j) for j in range(draft.depth)]
  digits = jnp.stack([(path // st) % draft.branch for st in strides] + [jnp.zeros_like(path)] * (k - draft.depth),
                     axis=1)                                                  # [R, k]
  subtree = jnp.stack([jnp.arange(r) - path % (st * draft.branch) for st in strides]
                      + [jnp.arange(r)] * (k - draft.depth), axis=1)          # [R, k]

  def choose(logits, j, key):
    scores = _scores(logits, sampling)
    if sampled:
      tok = sample(logits, key, sampling)
    else:
      top = top_k(scores, draft.branch, active_mesh())[1]
      tok = jnp.take_along_axis(top, digits[:, j][:, None], axis=1)[:, 0].astype(jnp.int32)
    return tok, jnp.max(jax.nn.softmax(scores, axis=-1), axis=-1)

  def record(d, j, logits, key, going):
    if draft.depth:
      logits, going = logits[subtree[:, j]], going[subtree[:, j]]
    tok, conf = choose(logits, j, key)
    d = dict(d, drafts=d["drafts"].at[:, j].set(tok), proposed=d["proposed"].at[:, j].set(going))
    if sampled:
      d["logits"] = d["logits"].at[:, j].set(logits)
    return d, tok, going & (conf >= threshold)

  keys = jax.random.split(key, k)
  d = dict(drafts=jnp.zeros((r, k), jnp.int32), proposed=jnp.zeros((r, k), bool), mtp=mtp)
  if sampled:
    d["logits"] = jnp.zeros((r, k, q_logits.shape[-1]), jnp.float32)
  d, tok, going = record(d, 0, q_logits, keys[0], wants)

  def cond(c):
    j, _, _, going, _ = c
    return (j < k) & jnp.any(going)

  def body(c):
    j, tok, h, going, d = c
    positions = jnp.where(going, length - 1 + j, -1)[:, None]
    prev = None
    if topk0 is not None and draft.index_share:
      drafted = jnp.where(jnp.arange(k - 1) < j, length[:, None] + jnp.arange(k - 1), -1)
      prev = jnp.concatenate([topk0, drafted.astype(topk0.dtype)], axis=1)[:, None]
    logits, h, layer, _ = _apply_mtp(spec, params, view, d["mtp"], tok[:, None], h[:, None], positions,
                                     runtime=runtime, prev_topk=prev)
    d, tok, going = record(dict(d, mtp=layer), j, logits[:, 0], keys[j], going)
    return j + 1, tok, h[:, 0], going, d

  _, _, _, _, d = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, h_prev, going, d))
  return d["drafts"], d["proposed"], d.get("logits"), d["mtp"]
