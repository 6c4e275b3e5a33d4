"""MTP speculative decoding: greedy outputs equal plain decoding, acceptance keeps the target
distribution, rollback leaves both caches as if no draft had been written.

One geometry for the whole file (page size 4, chunks of 16, NEW tokens per round) and the tiny
config (which is the fixture's plus an MTP layer), so the compiled programs are shared. A random
MTP accepts almost nothing, so `draftable` also builds a model whose MTP can predict the main
model: a mostly-bigram main model (attention and MLP outputs scaled down) and an MTP layer that
passes its token's embedding through, with noise so that some drafts are rejected.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from configs import get_model_config
from glmjax.cache import paged
from glmjax.engine import speculative
from glmjax.engine.engine import Engine
from glmjax.engine.sampling import Sampling, processed_logits
from glmjax.engine.speculative import SpecConfig
from glmjax.engine.steps import StepSpec
from glmjax.model import init_params
from glmjax.runtime import Runtime

NEW = 10
PAGE, CHUNK, MAX_SEQ, PAGES = 4, 16, 128, 64
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def tiny():
  config = get_model_config("tiny")
  return config, jax.jit(lambda k: init_params(config, k, param_dtype=jnp.float32))(jax.random.key(3))


@pytest.fixture(scope="module")
def fixture_with_mtp(fixture_fp32):
  """The transformers fixture with a random MTP layer (the fixture has none)."""
  config, params = fixture_fp32
  config = dataclasses.replace(config, num_nextn_predict_layers=1)
  mtp = jax.jit(lambda k: init_params(config, k, param_dtype=jnp.float32)["mtp"])(jax.random.key(3))
  return config, {**params, "mtp": mtp}


@pytest.fixture(scope="module")
def draftable(tiny):
  config, params = tiny

  def edit(path, x):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith("o_proj/weight") or "down_proj" in name:
      return 0.1 * x                                   # context still matters, a little
    if name == "mtp/eh_proj/weight":                   # [enorm(embed(next)) | hnorm(h)] -> embed part
      d = x.shape[0]
      return jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=1) + 0.5 * x
    if name == "mtp/enorm/weight":
      return jnp.ones_like(x)
    return x

  edited = jax.tree_util.tree_map_with_path(edit, params)
  edited["mtp"]["shared_head_norm"]["weight"] = params["norm"]["weight"]
  return config, edited


def make_engine(model, **kw):
  config, params = model
  return Engine(config, params, page_size=PAGE, max_seq_len=MAX_SEQ, prefill_chunk=CHUNK, num_pages=PAGES,
                kv_dtype="fp32", **kw)


def run_rounds(engine, rounds, **kw):
  session = engine.open_session()
  return session, [engine.run_round([session], [r], NEW, ignore_eos=True, **kw)[0] for r in rounds]


def random_rounds(seed, sizes=(13, 5)):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, 512, n).tolist() for n in sizes]


CHAIN = SpecConfig(num_draft=4, threshold=0.0)
# One compiled tree program covers branching, the single-token fallback and index sharing off.
TREE = SpecConfig(num_draft=3, branch=2, threshold=0.0, mtp_index_share=False, acceptance_floor=1.0,
                  probe_interval=2)


@pytest.mark.parametrize("model", ["fixture", "draftable"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_greedy_chain_equals_plain_decoding(model, prefix_cache, request):
  model = request.getfixturevalue({"fixture": "fixture_with_mtp", "draftable": "draftable"}[model])
  rounds = random_rounds(0)
  _, plain = run_rounds(make_engine(model, prefix_cache=prefix_cache), rounds)
  _, spec = run_rounds(make_engine(model, prefix_cache=prefix_cache, mtp_cache=True), rounds, spec=CHAIN)
  assert [r.output for r in spec] == [r.output for r in plain]
  assert [r.cached_tokens for r in spec] == [r.cached_tokens for r in plain]
  for r in spec:
    assert 1 <= r.acceptance_length <= CHAIN.num_draft + 1
    assert r.verify_steps == r.decode_steps and r.drafts_per_position == [r.verify_steps] * CHAIN.num_draft
    # Every step emits its accepted drafts and one more token, cut only at the budget.
    assert r.acceptance_length * r.verify_steps >= r.decode_tokens


def test_draftable_model_accepts_drafts(draftable):
  """The acceptance paths are exercised for real: several drafts accepted, not all."""
  _, spec = run_rounds(make_engine(draftable, mtp_cache=True), random_rounds(1), spec=CHAIN)
  lengths = [r.acceptance_length for r in spec]
  assert all(1.5 < a < CHAIN.num_draft + 1 for a in lengths), lengths
  rates = np.mean([r.acceptance_rate_per_position for r in spec], axis=0)
  assert rates[0] > 0.2 and np.all(np.diff(rates) <= 0), rates   # accepting j needs j - 1 accepted


def test_greedy_tree_with_fallback_equals_plain_decoding(draftable):
  rounds = random_rounds(2)
  _, plain = run_rounds(make_engine(draftable), rounds)
  _, tree = run_rounds(make_engine(draftable, mtp_cache=True), rounds, spec=TREE)
  assert [r.output for r in tree] == [r.output for r in plain]
  assert TREE.shape.paths == 8
  for r in tree:
    # Floor 1.0: every verify step that rejects a draft is followed by probe_interval single steps.
    assert r.verify_steps + r.plain_steps == r.decode_steps
    if min(r.acceptance_rate_per_position) < 1.0:
      assert r.plain_steps > 0
    assert r.plain_steps <= TREE.probe_interval * r.verify_steps
    assert 1 <= r.acceptance_length <= TREE.num_draft + 1
  assert sum(r.plain_steps for r in tree) > 0


def test_zero_drafts_equal_plain_decoding(draftable):
  """num_draft 0 (single-token steps that keep the MTP pages current) samples exactly the tokens
  plain decoding does, random draws included."""
  sampling = Sampling(temperature=0.8, top_p=0.9)
  rounds = random_rounds(3)
  _, plain = run_rounds(make_engine(draftable), rounds, sampling=sampling, seed=5)
  _, zero = run_rounds(make_engine(draftable, mtp_cache=True), rounds, sampling=sampling, seed=5,
                       spec=SpecConfig(num_draft=0))
  assert [r.output for r in zero] == [r.output for r in plain]
  assert all(r.verify_steps == 0 and r.plain_steps == NEW - 1 for r in zero)


def prefill_reference(model, tokens):
  """Main and MTP pages of `tokens` written by chunked prefill alone (nothing ever drafted)."""
  config, params = model
  cache = paged.init_cache(config, num_pages=PAGES, page_size=PAGE, batch=1, max_pages=MAX_SEQ // PAGE,
                           kv_dtype="fp32")
  cache = cache.replace(page_table=1 + jnp.arange(MAX_SEQ // PAGE, dtype=jnp.int32)[None])
  mtp = speculative.init_mtp_layer(config, num_pages=PAGES, page_size=PAGE, kv_dtype="fp32")
  spec = StepSpec(config, Runtime(), "float32")
  toks = np.asarray(tokens, np.int32)
  for start in range(0, len(toks), CHUNK):
    chunk, positions, following = (np.full((1, CHUNK), v, np.int32) for v in (0, -1, -1))
    piece, nxt = toks[start:start + CHUNK], toks[start + 1:start + CHUNK + 1]
    (chunk[0, :len(piece)], positions[0, :len(piece)],
     following[0, :len(nxt)]) = piece, np.arange(start, start + len(piece)), nxt
    _, _, cache, mtp = speculative.prefill_chunk_mtp(params, cache, mtp, jnp.asarray(chunk), jnp.asarray(positions),
                                                     jnp.asarray(following), spec=spec)
  return cache, mtp


def layer_contents(layer, table, length):
  latent, rope = paged.gather_latent(layer, table)
  index = paged.gather_index_keys(layer, table) if layer.index_k is not None else latent[..., :0]
  return [np.asarray(a[0, :length]) for a in (latent, rope, index)]


def test_rollback_leaves_caches_as_if_drafts_were_never_written(draftable):
  """After two speculative rounds (drafts accepted and rejected), main and MTP pages at every
  valid position equal what prefilling the final sequence writes, and so do the lengths."""
  engine = make_engine(draftable, mtp_cache=True)
  session, spec = run_rounds(engine, random_rounds(4), spec=CHAIN)
  assert any(1 < r.acceptance_length < CHAIN.num_draft + 1 for r in spec)
  length = len(session.history) - 1            # the last output is the next input: not in the cache
  assert int(engine.cache.lengths[0]) == length
  ref_cache, ref_mtp = prefill_reference(draftable, session.history)
  pairs = [(a, b) for ours, ref in zip(engine.cache.layers, ref_cache.layers) for a, b in
           zip(layer_contents(ours, engine.cache.page_table[:1], length),
               layer_contents(ref, ref_cache.page_table, length))]
  pairs += zip(layer_contents(engine.mtp, engine.cache.page_table[:1], length),
               layer_contents(ref_mtp, ref_cache.page_table, length))
  for ours, ref in pairs:
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threshold, expect", [(1.0, [1, 0, 0, 0]), (0.0, [1, 1, 1, 1])])
def test_confidence_threshold_masks_later_drafts(draftable, threshold, expect):
  """Threshold 1.0: no draft is confident, so only the first is proposed; 0.0: all are."""
  rounds = random_rounds(5)
  _, plain = run_rounds(make_engine(draftable), rounds)
  _, spec = run_rounds(make_engine(draftable, mtp_cache=True), rounds,
                       spec=dataclasses.replace(CHAIN, threshold=threshold))
  assert [r.output for r in spec] == [r.output for r in plain]
  for r in spec:
    assert r.drafts_per_position == [r.verify_steps * e for e in expect]
    assert r.acceptance_length <= 1 + sum(expect)


def empirical(tokens, vocab):
  return np.bincount(np.asarray(tokens), minlength=vocab)


def assert_distributed(observed, probs):
  probs = np.asarray(probs, np.float64)
  assert observed[probs == 0].sum() == 0, "a token of probability 0 was emitted"
  keep = probs > 0
  expected = probs[keep] / probs[keep].sum() * observed.sum()
  p_value = stats.chisquare(observed[keep], expected).pvalue
  assert p_value > SIGNIFICANCE, (observed, expected, p_value)


@pytest.mark.parametrize("branch, depth, num_draft, sampling", [
    (1, 0, 1, Sampling(temperature=1.0)),
    (1, 0, 3, Sampling(temperature=0.7, top_p=0.9)),
    (3, 1, 2, Sampling(temperature=1.0)),
    (2, 2, 3, Sampling(temperature=1.3, top_p=0.95)),
])
def test_acceptance_keeps_the_target_distribution(branch, depth, num_draft, sampling):
  """Emitted tokens are distributed as the target: the first one as p_0, and the second, given
  the first draft was accepted, as p_1 (the synthetic targets do not depend on earlier tokens).
  Chains sample their drafts from q; trees take the top-b of q (one-hot q), some masked."""
  n, vocab, paths = 20_000, 5, branch ** depth
  keys = jax.random.split(jax.random.key(branch * 10 + num_draft), 5)
  target = 1.5 * jax.random.normal(keys[0], (num_draft + 1, vocab))
  draft_logits = target[:num_draft] + jax.random.normal(keys[1], (num_draft, vocab))  # a draft that is close
  if branch == 1:
    drafts = jax.random.categorical(keys[2], processed_logits(draft_logits, sampling), shape=(n, 1, num_draft))
    q = jnp.broadcast_to(draft_logits, (n, 1, num_draft, vocab))
    proposed = jnp.ones((n, 1, num_draft), bool)
  else:  # path r takes candidate digit_j(r) of the top-b at depth j < depth
    top = jax.lax.top_k(processed_logits(draft_logits, sampling), branch)[1]          # [k, b]
    digits = [(np.arange(paths) // branch ** (depth - 1 - j)) % branch if j < depth else np.zeros(paths, int)
              for j in range(num_draft)]
    drafts = jnp.broadcast_to(jnp.stack([top[j, digits[j]] for j in range(num_draft)], axis=1), (n, paths, num_draft))
    q = None
    # Masked at random, alike for paths that share the drafts before (as drafting makes them).
    subtree = np.stack([np.arange(paths) - np.arange(paths) % branch ** (depth - j) if j < depth else np.arange(paths)
                        for j in range(num_draft)], axis=1)
    proposed = jax.random.bernoulli(keys[2], 0.8, (n, paths, num_draft))[:, subtree, np.arange(num_draft)]
  accept = jax.jit(speculative.accept, static_argnames=("sampling", "branch", "depth"))
  path, accepted, nxt = accept(drafts.astype(jnp.int32), proposed,
                               jnp.broadcast_to(target, (n, paths, num_draft + 1, vocab)),
                               q, keys[3], sampling, branch=branch, depth=depth)
  path, accepted, nxt = map(np.asarray, (path, accepted, nxt))
  chosen = np.asarray(drafts)[np.arange(n), path]                                     # [n, k]
  emitted = np.concatenate([chosen, np.zeros((n, 1), int)], axis=1)
  emitted[np.arange(n), accepted] = nxt
  assert np.all(np.asarray(proposed)[np.arange(n), path][np.arange(num_draft) < accepted[:, None]])
  p = np.asarray(jax.nn.softmax(processed_logits(target, sampling), axis=-1))
  assert_distributed(empirical(emitted[:, 0], vocab), p[0])
  first_accepted = accepted >= 1
  assert first_accepted.mean() > 0.1
  assert_distributed(empirical(emitted[first_accepted, 1], vocab), p[1])


def test_greedy_acceptance_walks_the_tree_to_the_longest_match():
  """Two levels of two candidates (4 paths): the root's argmax is candidate 1, then below it
  candidate 1 again; the token after the path is that path's argmax."""
  argmax = np.asarray([[1, 3, 0], [1, 4, 0], [1, 2, 0], [1, 2, 4]])    # per path, depths 0..2
  target = jnp.asarray(np.eye(5)[argmax][None] * 9, jnp.float32)        # [1, 4, 3, 5]
  drafts = jnp.asarray([[[0, 3], [0, 1], [1, 3], [1, 2]]], jnp.int32)   # candidates (c0, c1) per path
  path, accepted, nxt = speculative.accept(drafts, jnp.ones((1, 4, 2), bool), target, None, jax.random.key(0),
                                           Sampling(), branch=2, depth=2)
  assert (int(path[0]), int(accepted[0]), int(nxt[0])) == (3, 2, 4)
  masked = jnp.ones((1, 4, 2), bool).at[0, 3, 1].set(False)            # the matching leaf not proposed
  path, accepted, nxt = speculative.accept(drafts, masked, target, None, jax.random.key(0), Sampling(),
                                           branch=2, depth=2)
  assert (int(path[0]), int(accepted[0]), int(nxt[0])) == (2, 1, 2)


def test_emitted_tokens_stop_after_eos_and_at_the_budget():
  tokens = jnp.asarray([[5, 1, 7, -1], [5, 6, 7, 8], [3, 4, -1, -1], [9, 9, -1, -1]], jnp.int32)
  out = jnp.full((4, 10), -1, jnp.int32)
  out, counts, stopped, kept = speculative._emit(
      out, jnp.asarray([2, 4, 9, 3]), jnp.asarray([False, False, False, True]), tokens,
      jnp.asarray([3, 4, 2, 2]), jnp.asarray([1], jnp.int32), jnp.asarray([10, 6, 10, 10]))
  assert kept.tolist() == [2, 2, 1, 0] and counts.tolist() == [4, 6, 10, 3]
  assert stopped.tolist() == [True, True, True, True]
  assert np.asarray(out)[:, :10].tolist() == [[-1, -1, 5, 1] + [-1] * 6, [-1] * 4 + [5, 6] + [-1] * 4,
                                               [-1] * 9 + [3], [-1] * 10]


def test_bad_settings_are_refused(fixture_fp32, tiny):
  for bad, match in [(dict(num_draft=8), "num_draft"), (dict(branch=0), "branch"), (dict(threshold=1.5), "threshold"),
                     (dict(probe_interval=0), "probe_interval"), (dict(num_draft=0, branch=2), "num_draft >= 1")]:
    with pytest.raises(ValueError, match=match):
      SpecConfig(**bad)
  with pytest.raises(ValueError, match="MTP layer"):
    make_engine(fixture_fp32, mtp_cache=True)
  plain = make_engine(tiny)
  with pytest.raises(ValueError, match="mtp_cache=True"):
    plain.run_round([plain.open_session()], [[5, 6]], NEW, spec=CHAIN)
  engine = make_engine(tiny, mtp_cache=True)
  with pytest.raises(ValueError, match="drafts exceeds"):   # fits without drafts, not with them
    engine.run_round([engine.open_session()], [[5] * (MAX_SEQ - NEW - 2)], NEW, spec=CHAIN)
