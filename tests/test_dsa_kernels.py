"""DSA kernels (indexer scores, top-k, fused selection, sparse MLA) against their references.

The kernels run in Pallas interpret mode here (small shapes: Di=32, H=4, R=64, dr=16, k <= 64,
lengths up to ~300); `test_lowers_for_h200` also lowers each one to Triton IR for an H200.
Tolerances: scores fp32 (rtol 1e-5); top-k exact sets; attention max error relative to the
reference's largest magnitude: 1e-5 for fp32 queries (the kernel splits q and p into exact bf16
terms: fp32 up to summation order), 1e-2 for bf16 queries (p rounded to bf16, as FlashMLA).
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.cache.kv_fp8 import fp8_block_size, quantize_fp8
from pallas_kernels.checks import bf16_parts
from pallas_kernels.indexer_scores import (MAX_PREFETCH, ORIENTATIONS, IndexerScoresConfig, indexer_scores,
                                           indexer_scores_reference)
from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference
from pallas_kernels.sparse_mla import (SparseMLAConfig, sparse_mla_decode, sparse_mla_decode_values,
                                       sparse_mla_decode_reference)
from pallas_kernels import topk
from pallas_kernels.topk import TopKConfig, topk_indices, topk_indices_reference
from tests.test_quant_model import kernel_launches, pallas_eqns

PAGE = 16
MAX_PAGES = 12  # num_keys = 192
NUM_KEYS = PAGE * MAX_PAGES
LENGTHS = (190, 41, 7)  # per sequence: not multiples of the page size or of any block
SMALL_SCORES = IndexerScoresConfig(block_k=32, num_splits=2)
SMALL_TOPK = TopKConfig(block=32, method="radix")


def _rng(seed: int) -> np.random.Generator:
  return np.random.default_rng(seed)


def _page_table(rng, lengths, num_pages: int, max_pages: int = MAX_PAGES) -> jax.Array:
  """Shuffled, non-contiguous physical pages per sequence; unused slots -> null page 0."""
  free = rng.permutation(np.arange(1, num_pages))
  table = np.zeros((len(lengths), max_pages), np.int32)
  used = 0
  for b, length in enumerate(lengths):
    count = -(-length // PAGE)
    table[b, :count] = free[used:used + count]
    used += count
  return jnp.asarray(table)


def _positions(lengths, t: int) -> jax.Array:
  """The last t positions of each sequence (decode / speculative verification)."""
  return jnp.asarray([[length - t + i for i in range(t)] for length in lengths], jnp.int32)


def _cache(rng, shape, fp8: bool):
  """Random page contents (null page included: never zeros), as bf16 or FP8 + scales."""
  x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.5, 4.0, shape[:-1] + (1,))
  if fp8:
    return quantize_fp8(jnp.asarray(x))
  return jnp.asarray(x, jnp.bfloat16), None


def _assert_same_sets(got: np.ndarray, ref: np.ndarray) -> None:
  """Same index set per row; the kernel lists valid slots first (two ascending runs), then -1."""
  got = got.reshape(-1, got.shape[-1])
  ref = ref.reshape(-1, ref.shape[-1])
  for g, r in zip(got, ref):
    np.testing.assert_array_equal(np.sort(g), np.sort(r))
    valid = g[g >= 0]
    assert np.sum(np.diff(valid) < 0) <= 1 and np.all(g[len(valid):] == -1)


# --- exact bf16 split -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_parts_sum_to_the_fp32_value(seed):
  """Three bf16 terms hold every bit of an fp32 value, so bf16 MMAs of them are exact."""
  rng = _rng(seed)
  x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-30, 30, 4096)).astype(np.float32)
  parts = bf16_parts(jnp.asarray(x))
  assert len(parts) == 3 and all(p.dtype == jnp.bfloat16 for p in parts)
  total = parts[2].astype(jnp.float32) + parts[1].astype(jnp.float32) + parts[0].astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(total), x)
  assert len(bf16_parts(parts[0])) == 1  # a bf16 operand stays one term


# --- top-k -----------------------------------------------------------------------------------

def _score_rows(rng, valid_counts, n: int, kind: str) -> jax.Array:
  """kind: "normal"; "ties" (few distinct values, signed zeros among them); "close" (all in
  [1, 1 + 2^-7): one 16-bit key prefix, so the last two digits decide, with some ties)."""
  x = rng.standard_normal((len(valid_counts), n)).astype(np.float32)
  if kind == "ties":
    x = np.round(x * 2) / 2
    x[x == 0] = np.where(rng.random((x == 0).sum()) < 0.5, -0.0, 0.0)
  elif kind == "close":
    x = (1 + rng.integers(0, n, x.shape) * 2.0 ** -23).astype(np.float32)
  for row, count in enumerate(valid_counts):
    x[row, rng.permutation(n)[count:]] = -np.inf
  return jnp.asarray(x)


@pytest.mark.parametrize("kind", ["normal", "ties", "close"])
@pytest.mark.parametrize("seed", [0, 1])
def test_topk_matches_reference(kind, seed):
  # Valid entries: all, above k, exactly k, below k.
  scores = _score_rows(_rng(seed), (300, 200, 64, 30), 300, kind)
  got = topk_indices(scores, 64, config=TopKConfig(block=64, num_splits=4, method="radix"))
  _assert_same_sets(np.asarray(got), np.asarray(topk_indices_reference(scores, 64)))


def test_topk_k_th_score_tied_many_times():
  """ReLU-summed indexer scores: fewer positive scores than k, the rest of the top-k from a mass
  of exact zeros (the select's one-key path: every candidate is +0.0, the first by index win),
  beside a row of distinct scores (its digit passes)."""
  rng = _rng(5)
  relu = np.zeros(300, np.float32)
  relu[rng.permutation(300)[:40]] = rng.uniform(0.1, 2.0, 40)
  relu[rng.permutation(300)[:50]] = -rng.uniform(0.1, 2.0, 50)
  scores = jnp.asarray(np.stack([relu, rng.standard_normal(300).astype(np.float32)]))
  got = np.asarray(topk_indices(scores, 64, config=TopKConfig(block=64, num_splits=4, method="radix")))
  _assert_same_sets(got, np.asarray(topk_indices_reference(scores, 64)))
  zeros = np.flatnonzero(relu == 0)
  assert set(got[0]) == set(np.flatnonzero(relu > 0)) | set(zeros[:64 - (relu > 0).sum()])


def test_topk_batched_default_config():
  scores = _score_rows(_rng(2), (257, 100, 17, 3, 0, 250), 257, "ties").reshape(2, 3, 257)
  got = topk_indices(scores, 17)
  assert got.shape == (2, 3, 17) and got.dtype == jnp.int32
  _assert_same_sets(np.asarray(got), np.asarray(topk_indices_reference(scores, 17)))


def test_topk_k_equals_n():
  scores = _score_rows(_rng(3), (48, 20), 48, "ties")
  got = topk_indices(scores, 48, config=TopKConfig(block=16, method="radix"))
  _assert_same_sets(np.asarray(got), np.asarray(topk_indices_reference(scores, 48)))


@pytest.mark.parametrize("seed,trials", [(0, 1), (1, 1), (0, 8), (1, 4), (2, 32)])
def test_count_search_brackets_the_rank(seed, trials):
  """The in-register count search (plain jnp here) against a sort, over distinct, tied and
  clustered keys with invalid (zero) slots, from the bracket the kernels start from (every
  valid key at or above lo; none at or above hi): when found, rank to rank + slack keys lie at
  or above lo; otherwise lo is the rank-th key, its ties straddle the window, and hi = lo + 1;
  the returned counts are the true ones either way; with one trial a step or several."""
  rng = _rng(seed)
  m = 512
  search = jax.jit(functools.partial(topk.count_search, trials=trials), static_argnames="slack")
  for keys in (rng.integers(1, 2 ** 32 - 1, m, dtype=np.uint64), rng.integers(1, 6, m),
               0x80000000 + rng.integers(0, 2 ** 12, m)):
    valid = rng.random(m) < 0.7
    keys = np.where(valid, keys, 0).astype(np.uint32)
    ranked = np.sort(keys[valid])[::-1]
    at_or_above = lambda t: int(np.sum(ranked >= t))
    for rank in (1, 7, len(ranked) // 2, len(ranked)):
      for slack in (0, 3, 40):
        lo, hi, c_lo, c_hi, found = (int(v) for v in search(
            jnp.asarray(keys), jnp.int32(rank), jnp.uint32(1), jnp.int32(len(ranked)),
            jnp.uint32(ranked[0]) + 1, slack=slack))
        assert (c_lo, c_hi) == (at_or_above(lo), at_or_above(hi))
        if found:
          assert rank <= c_lo <= rank + slack
        else:
          assert hi == lo + 1 and lo == ranked[rank - 1] and c_lo > rank + slack
  # No candidates (the select's rows with none above the threshold): found at once.
  assert bool(search(jnp.zeros(8, jnp.uint32), jnp.int32(0), jnp.uint32(1), jnp.int32(0), jnp.uint32(1))[-1])


SAMPLED = TopKConfig(block=64, method="sampled", sample=256, scan_block=64)


# One program for the three launches and their glue, cached by config: the cases differing only
# in their scores share it (called eagerly, each launch compiled again for every call).
_sampled_select = jax.jit(topk.sampled_select, static_argnames=("k", "plan", "config", "interpret"))


def _sampled(scores, k, lanes=None, keys=True, trials=(4, 1), one_launch=False):
  config = dataclasses.replace(SAMPLED, scan_lanes=lanes, candidate_keys=keys, threshold_trials=trials[0],
                               select_trials=trials[1], one_launch=one_launch)
  plan = topk.sample_plan(scores.shape[-1], k, config.sample)
  assert plan is not None
  got, fallback = _sampled_select(scores, k, plan, config=config, interpret=True)
  return np.asarray(got), np.asarray(fallback)


@pytest.mark.parametrize("kind,lanes,keys,trials,one_launch", [
    ("normal", 1, True, (4, 1), False), ("normal", 4, True, (4, 1), False), ("ties", 4, True, (4, 1), False),
    ("close", 1, True, (4, 1), False), ("normal", 4, False, (4, 1), False), ("ties", 1, False, (4, 1), False),
    ("normal", 4, True, (1, 8), False), ("ties", 4, True, (1, 8), False),
    ("normal", 4, True, (4, 1), True), ("ties", 1, False, (4, 1), True), ("close", 4, True, (1, 8), True)])
def test_sampled_topk_matches_reference(kind, lanes, keys, trials, one_launch):
  """The sampled method at awkward sizes (n not a multiple of the block or the sample), rows
  with every entry valid, many, exactly k, fewer than k (the threshold is then 0: every valid
  score is a candidate) and none. "close" rows share one 16-bit key prefix: the full-key
  threshold still separates them, so no row falls back. Count and compaction scan their chunks
  as one block a step (lanes=1) or as 4 segments (positions in index order either way); the
  select reads the candidates' stored keys or gathers them from the row by position; the
  threshold's and the select's searches count at one key a step or several. With one_launch the
  three launches are one: offsets from the lower splits' published counts, the last program
  selecting."""
  n, k = 4099, 61
  scores = _score_rows(_rng(4), (n, 3000, k, 40, 0), n, kind)
  got, fallback = _sampled(scores, k, lanes, keys, trials, one_launch)
  _assert_same_sets(got, np.asarray(topk_indices_reference(scores, k)))
  np.testing.assert_array_equal(fallback, 0)


@pytest.mark.parametrize("lanes,keys,one_launch", [(1, True, False), (4, True, False), (4, False, False),
                                                   (4, True, True)])
def test_sampled_topk_threshold_on_a_mass_of_ties(lanes, keys, one_launch):
  """ReLU-summed indexer scores: fewer positive scores than k and a mass of exact zeros, so the
  threshold lands on +0.0. The candidates (the positives) and the first zeros by position form
  the answer without the fallback; a row whose threshold falls among distinct negatives (zeros
  too few to reach k) takes the candidates' own select."""
  n, k = 4099, 61
  rng = _rng(7)
  rows = np.zeros((2, n), np.float32)
  rows[0, rng.permutation(n)[:30]] = rng.uniform(0.1, 2.0, 30)
  rows[0, rng.permutation(n)[:900]] = -rng.uniform(0.1, 2.0, 900)
  rows[1] = -rng.uniform(0.1, 2.0, n)
  rows[1, rng.permutation(n)[:20]] = 0.0
  got, fallback = _sampled(jnp.asarray(rows), k, lanes, keys, one_launch=one_launch)
  np.testing.assert_array_equal(fallback, 0)
  _assert_same_sets(got, np.asarray(topk_indices_reference(jnp.asarray(rows), k)))
  positives, zeros = np.flatnonzero(rows[0] > 0), np.flatnonzero(rows[0] == 0)
  assert set(got[0]) == set(positives) | set(zeros[:k - len(positives)])


@pytest.mark.parametrize("one_launch", [False, True])
def test_sampled_topk_falls_back_when_the_sample_misleads(one_launch):
  """Every sampled position (a multiple of the stride) holds a large score, every other one a
  small score: the threshold lands above the k-th score, the candidates are too few, and the
  select over the whole row still returns the exact set (lowest positions first on ties)."""
  n, k = 2 ** 14 + 5, 300
  plan = topk.sample_plan(n, k, SAMPLED.sample)
  x = np.full((2, n), 1.0, np.float32)
  x[:, ::plan.stride] = 50.0 + _rng(5).random((2, len(range(0, n, plan.stride))))
  x[1, 7] = 0.5   # a row whose ties at 1.0 are broken by position
  got, fallback = _sampled(jnp.asarray(x), k, one_launch=one_launch)
  assert fallback.all()
  ref = np.asarray(topk_indices_reference(jnp.asarray(x), k))
  np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(ref, axis=1))


def test_sampled_topk_few_rows_take_one_launch_fewer():
  """Up to FEW_ROWS rows, the splits shrink until the programs fit on the SMs, which then derive
  the threshold themselves: count, compaction and select (3 launches); 64 rows keep the
  threshold's own launch (4); with one_launch, one at any row count. Five rows of 81,920 is a
  speculative decode step at 80K."""
  launches = lambda rows, n: kernel_launches(jax.make_jaxpr(lambda x: topk_indices(x, 2048))(
      jax.ShapeDtypeStruct((rows, n), jnp.float32)).jaxpr)
  assert launches(5, 81920) == launches(1, 131072) == launches(8, 131072) == 3
  assert launches(64, 131072) == 4
  one = lambda rows: kernel_launches(jax.make_jaxpr(lambda x: topk_indices(
      x, 2048, config=TopKConfig(one_launch=True)))(jax.ShapeDtypeStruct((rows, 81920), jnp.float32)).jaxpr)
  assert one(5) == one(64) == 1
  assert topk.few_row_splits(5, 32) == 16 and topk.few_row_splits(64, 8) == 8


def test_sampled_method_through_topk_indices():
  """topk_indices with method="sampled": the sampled path on long rows, the radix select on
  rows too short for a sample to pay; both exact."""
  for n in (3000, 300):
    scores = _score_rows(_rng(6), (n, n // 2, 10), n, "normal").reshape(1, 3, n)
    got = topk_indices(scores, 40, config=SAMPLED)
    assert got.shape == (1, 3, 40)
    _assert_same_sets(np.asarray(got), np.asarray(topk_indices_reference(scores, 40)))
  assert topk.sample_plan(300, 40, SAMPLED.sample) is None
  # A sample too sparse for the row: its candidates would not fit the select's registers.
  assert topk.sample_plan(2 ** 20, 2048, 256) is None


# --- indexer scores --------------------------------------------------------------------------

def _indexer_inputs(seed: int, t: int, fp8: bool, q_dtype=jnp.bfloat16, heads: int = 4,
                    dim: int = 32, lengths=LENGTHS, max_pages: int = MAX_PAGES):
  rng = _rng(seed)
  num_pages = 1 + sum(-(-length // PAGE) for length in lengths) + 3
  q = jnp.asarray(rng.standard_normal((len(lengths), t, heads, dim)), q_dtype)
  weights = jnp.asarray(rng.standard_normal((len(lengths), t, heads)) * heads ** -0.5,
                        jnp.float32)
  index_k, index_scale = _cache(rng, (num_pages, PAGE, dim), fp8)
  return (q, weights, index_k, index_scale, _page_table(rng, lengths, num_pages, max_pages),
          _positions(lengths, t))


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_indexer_scores_matches_reference(t, fp8, orientation):
  args = _indexer_inputs(10 + t, t, fp8)
  config = dataclasses.replace(SMALL_SCORES, orientation=orientation)
  got = indexer_scores(*args, num_keys=NUM_KEYS, config=config)
  ref = indexer_scores_reference(*args, num_keys=NUM_KEYS)
  assert got.shape == (len(LENGTHS), t, NUM_KEYS)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,fp8,orientation", [(5, True, "keys"), (1, False, "heads")])
def test_indexer_scores_of_e4m3_query_codes(t, fp8, orientation):
  """float8_e4m3fn queries (codes whose scales the weights carry): an FP8 x FP8 dot against FP8
  keys, bf16 against bf16 keys; both exact products, so the reference's scores within fp32 sums."""
  args = _indexer_inputs(20 + t, t, fp8, q_dtype=jnp.float8_e4m3fn)
  assert len(np.unique(np.asarray(args[0], np.float32))) > 50  # real codes, not a few values
  config = dataclasses.replace(SMALL_SCORES, orientation=orientation)
  got = indexer_scores(*args, num_keys=NUM_KEYS, config=config)
  ref = indexer_scores_reference(*args, num_keys=NUM_KEYS)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8,splits,block_k,t,max_pages", [(True, 2, 32, 5, MAX_PAGES), (False, 4, 16, 1, MAX_PAGES),
                                                             (True, 1, 16, 11, 2 * MAX_PAGES)])
def test_indexer_scores_prefetch_keeps_the_scores(fp8, splits, block_k, t, max_pages):
  """prefetch: every key block's loads before the first dot, the same scores bit for bit (3
  blocks a program; 24 blocks, past MAX_PREFETCH: the loop kept)."""
  assert 2 * MAX_PAGES * PAGE // 16 > MAX_PREFETCH
  num_keys = max_pages * PAGE
  args = _indexer_inputs(17 + t, t, fp8, max_pages=max_pages)
  config = IndexerScoresConfig(block_k=block_k, num_splits=splits)
  looped = indexer_scores(*args, num_keys=num_keys, config=config)
  prefetched = indexer_scores(*args, num_keys=num_keys, config=dataclasses.replace(config, prefetch=True))
  np.testing.assert_array_equal(np.asarray(prefetched), np.asarray(looped))
  np.testing.assert_allclose(np.asarray(prefetched), np.asarray(indexer_scores_reference(*args, num_keys=num_keys)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits,block_k", [(256, 16), (1024, 16)])
def test_indexer_scores_past_the_topk_splits(splits, block_k):
  """More programs than the top-k's 128 (one key block each here, most of them past the shorter
  sequences' keys or past the cache): the same scores."""
  assert splits > topk.MAX_SPLITS
  args = _indexer_inputs(15, 5, fp8=True)
  config = IndexerScoresConfig(block_k=block_k, num_splits=splits)
  got = indexer_scores(*args, num_keys=NUM_KEYS, config=config)
  ref = indexer_scores_reference(*args, num_keys=NUM_KEYS)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="fuse_first_pass.*num_splits=256"):
    indexer_topk(*args, num_keys=NUM_KEYS, k=64, scores_config=IndexerScoresConfig(num_splits=256),
                 fuse_first_pass=True)


def test_indexer_scores_default_grid():
  """Left to the defaults, a decode step's scores run about TARGET_PROGRAMS 4-warp programs over
  64-key blocks (run 26's tuning at 80K), a block at least each at short contexts; fused with the
  radix select's first pass, at most the top-k's 128 splits."""
  def grid(num_keys: int, t: int = 5, **kwargs) -> tuple[int, ...]:
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((1, t, 32, 128), jnp.bfloat16), ((1, t, 32), jnp.float32),
                                                    ((num_keys // 64 + 1, 64, 128), jnp.float8_e4m3fn),
                                                    ((num_keys // 64 + 1, 64, 1), jnp.float32),
                                                    ((1, num_keys // 64), jnp.int32), ((1, t), jnp.int32))]
    fn = functools.partial(indexer_topk, num_keys=num_keys, k=2048, **kwargs)
    return pallas_eqns(jax.make_jaxpr(fn)(*args).jaxpr)[0].params["grid_mapping"].grid
  assert grid(81920) == grid(81920, t=1) == grid(131072) == (1, 1, 256)
  assert grid(8192) == (1, 1, 128)  # one 64-key block a program
  assert grid(81920, fuse_first_pass=True)[2] == topk.MAX_SPLITS
  assert IndexerScoresConfig().block_k == 64 and IndexerScoresConfig().num_warps == 4


@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_indexer_scores_fp32_queries_default_tiles(orientation):
  # T=10 > the 8-token query group (prefill chunks): two groups, the second padded.
  args = _indexer_inputs(20, 10, fp8=False, q_dtype=jnp.float32)
  got = indexer_scores(*args, num_keys=NUM_KEYS, config=IndexerScoresConfig(orientation=orientation))
  ref = indexer_scores_reference(*args, num_keys=NUM_KEYS)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


# --- selection: scores + top-k, fused or not -------------------------------------------------

@pytest.mark.parametrize("t,fp8,fuse", [(1, True, True), (5, False, True), (5, True, True), (5, True, False)])
def test_indexer_topk_matches_reference(t, fp8, fuse):
  # k=64: sequence lengths 190 (above k), 41 and 7 (below k).
  args = _indexer_inputs(30 + t, t, fp8)
  got = np.asarray(indexer_topk(*args, num_keys=NUM_KEYS, k=64, scores_config=SMALL_SCORES,
                                topk_config=SMALL_TOPK, fuse_first_pass=fuse))
  # Exact against the same scores; the reference scores differ by rounding only.
  scores = indexer_scores(*args, num_keys=NUM_KEYS, config=SMALL_SCORES)
  _assert_same_sets(got, np.asarray(topk_indices_reference(scores, 64)))
  ref = np.asarray(indexer_topk_reference(*args, num_keys=NUM_KEYS, k=64))
  for g, r in zip(got.reshape(-1, 64), ref.reshape(-1, 64)):
    assert (g == -1).sum() == (r == -1).sum()
    assert len(np.intersect1d(g[g >= 0], r[r >= 0])) >= 0.95 * (r >= 0).sum()


@pytest.mark.parametrize("t,orientation", [(11, "keys"), (5, "heads")])
def test_indexer_topk_reads_the_scoring_kernels_sample(t, orientation):
  """The sampled top-k's threshold reads the sample the scoring kernel writes beside the scores
  (sample_source="scores") or gathers it from the score rows ("row"): the kernel's sample is
  topk.strided_sample of its scores, bit for bit (11 tokens: two query groups, padded; either
  orientation of the kernel's MMA), and the two selections, and the one-launch top-k's from the
  kernel's sample, are the same exact top-k. A sample of the wrong shape or one past the row is
  an error."""
  max_pages, k = 256, 64  # 4096 keys: long enough for a 256-score sample
  num_keys = max_pages * PAGE
  args = _indexer_inputs(50 + t, t, fp8=True, lengths=(4000, 2500), max_pages=max_pages)
  config = TopKConfig(sample=256, scan_block=64)
  scores_config = dataclasses.replace(SMALL_SCORES, orientation=orientation)
  plan = topk.sample_plan(num_keys, k, config.sample)
  assert plan is not None
  scores, sample = indexer_scores(*args, num_keys=num_keys, config=scores_config, sample=(plan.stride, config.sample))
  assert sample.shape == (2, t, config.sample)
  np.testing.assert_array_equal(np.asarray(sample), np.asarray(topk.strided_sample(scores, plan, config.sample)))
  got = {source: np.asarray(indexer_topk(*args, num_keys=num_keys, k=k, scores_config=scores_config,
                                         topk_config=dataclasses.replace(config, sample_source=source)))
         for source in topk.SAMPLE_SOURCES}
  one_launch = np.asarray(indexer_topk(*args, num_keys=num_keys, k=k, scores_config=scores_config,
                                      topk_config=dataclasses.replace(config, one_launch=True)))
  np.testing.assert_array_equal(got["scores"], got["row"])
  np.testing.assert_array_equal(one_launch, got["scores"])
  _assert_same_sets(got["scores"], np.asarray(topk_indices_reference(scores, k)))
  with pytest.raises(ValueError, match="sample must be float32"):
    topk_indices(scores, k, config=config, sample=sample[..., :128])
  with pytest.raises(ValueError, match=r"sample must be \(stride, count\) with 1 <= stride \* count <= num_keys"):
    indexer_scores(*args, num_keys=num_keys, config=SMALL_SCORES, sample=(plan.stride + 1, num_keys // plan.stride))


def test_indexer_topk_exactly_k_valid():
  args = _indexer_inputs(40, 1, fp8=True)
  positions = jnp.asarray([[63], [40], [6]], jnp.int32)  # first sequence: exactly k=64 valid
  args = (*args[:5], positions)
  got = np.asarray(indexer_topk(*args, num_keys=NUM_KEYS, k=64, scores_config=SMALL_SCORES,
                                topk_config=SMALL_TOPK))
  np.testing.assert_array_equal(np.sort(got[0, 0]), np.arange(64))
  assert (got[1, 0] == -1).sum() == 64 - 41 and (got[2, 0] == -1).sum() == 64 - 7


def test_indexer_topk_k_above_num_keys():
  """k > num_keys selects min(k, num_keys) = every visible position, as lax.top_k would."""
  args = _indexer_inputs(41, 1, fp8=True)
  got = np.asarray(indexer_topk(*args, num_keys=NUM_KEYS, k=4096, scores_config=SMALL_SCORES,
                                topk_config=SMALL_TOPK))
  ref = np.asarray(indexer_topk_reference(*args, num_keys=NUM_KEYS, k=4096))
  assert got.shape == ref.shape == (len(LENGTHS), 1, NUM_KEYS)
  _assert_same_sets(got, ref)


# --- sparse MLA ------------------------------------------------------------------------------

def _mla_inputs(seed: int, t: int, fp8: bool, k: int = 64, heads: int = 4, rank: int = 64,
                rope: int = 16, q_dtype=jnp.float32):
  rng = _rng(seed)
  b = len(LENGTHS)
  num_pages = 1 + sum(-(-length // PAGE) for length in LENGTHS) + 3
  q_latent = jnp.asarray(rng.standard_normal((b, t, heads, rank)) * 0.3, q_dtype)
  q_rope = jnp.asarray(rng.standard_normal((b, t, heads, rope)) * 0.3, q_dtype)
  latent, latent_scale = _cache(rng, (num_pages, PAGE, rank), fp8)
  k_rope, _ = _cache(rng, (num_pages, PAGE, rope), False)
  positions = np.asarray(_positions(LENGTHS, t))
  indices = np.full((b, t, k), -1, np.int32)
  for bi in range(b):
    for ti in range(t):
      visible = positions[bi, ti] + 1
      if visible <= k:  # dense case: all positions, then -1
        indices[bi, ti, :visible] = np.arange(visible)
      else:  # sparse: a random selection, shuffled, with a few empty slots
        picked = rng.choice(visible, k, replace=False)
        picked[rng.random(k) < 0.1] = -1
        indices[bi, ti] = picked
  return (q_latent, q_rope, latent, latent_scale, k_rope, _page_table(rng, LENGTHS, num_pages),
          jnp.asarray(indices))


def _assert_attention_close(got, ref, rtol: float):
  got, ref = np.asarray(got), np.asarray(ref)
  assert got.shape == ref.shape and got.dtype == np.float32
  assert np.abs(got - ref).max() <= rtol * np.abs(ref).max()


# Every pair of (query tokens, FP8 pages, query dtype) values once: the three are independent in
# the kernel (its rows, its page decode, its query load).
@pytest.mark.parametrize("t,fp8,q_dtype,rtol", [(1, False, jnp.float32, 1e-5), (5, True, jnp.float32, 1e-5),
                                                (1, True, jnp.bfloat16, 1e-2), (5, False, jnp.bfloat16, 1e-2)])
def test_sparse_mla_matches_reference(t, fp8, q_dtype, rtol):
  args = _mla_inputs(50 + t, t, fp8, q_dtype=q_dtype)
  scale = (64 + 16) ** -0.5
  want = sparse_mla_decode_reference(*args, softmax_scale=scale)
  for combine in ("xla", "pallas"):
    got = sparse_mla_decode(*args, softmax_scale=scale, config=SparseMLAConfig(block_n=16, combine=combine))
    _assert_attention_close(got, want, rtol)


def test_sparse_mla_odd_head_count_and_two_scale_groups():
  """3 heads, padded to the MMA's 16 rows; 3 come back. FP8 latent of 256: two 128-wide scale
  groups, each with its own dots."""
  args = _mla_inputs(70, 2, fp8=True, heads=3, rank=256)
  assert args[3].shape[-1] == 2
  want = sparse_mla_decode_reference(*args, softmax_scale=0.1)
  got = sparse_mla_decode(*args, softmax_scale=0.1, config=SparseMLAConfig(block_n=16))
  assert got.shape[2] == 3
  _assert_attention_close(got, want, 1e-5)


@pytest.mark.parametrize("q_dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_sparse_mla_fp8_scales_on_columns_or_rows_alike(q_dtype, rtol):
  """The FP8 scales (powers of two) applied to the dots' columns give the attention of the rows
  scaled before the dots (SparseMLAConfig.scale_rows), for both query precisions, each near the
  reference. (The same bits in the interpreter; on an H100 the bf16 path's differ, since the
  rows' dot accumulates straight into the logits: BENCHMARKS.md run 43.)"""
  args = _mla_inputs(90, 3, fp8=True, q_dtype=q_dtype, rank=256)  # two scale groups
  assert len(np.unique(np.asarray(args[3]))) > 4  # scales that differ by row and group
  want = sparse_mla_decode_reference(*args, softmax_scale=0.1)
  columns, rows = (sparse_mla_decode(*args, softmax_scale=0.1, config=SparseMLAConfig(block_n=16, scale_rows=on))
                   for on in (False, True))
  _assert_attention_close(columns, rows, rtol)
  _assert_attention_close(columns, want, rtol)


def test_sparse_mla_default_config_follows_the_query_precision():
  """None fields resolve per call: FP8 latents under bf16 queries take the scales on the dots'
  columns in 64-row blocks, under fp32 queries the rows in 32-row blocks at 3 stages; bf16
  latents 32-row blocks at 2; a field given stays. The bf16 default attends as the reference
  does."""
  pick = lambda config, exact, fp8: (lambda c: (c.scale_rows, c.block_n, c.num_stages))(
      config.resolved(exact=exact, fp8=fp8))
  default = SparseMLAConfig()
  assert pick(default, False, True) == (False, 64, 2) and pick(default, True, True) == (True, 32, 3)
  assert pick(default, False, False) == pick(default, True, False) == (False, 32, 2)
  assert pick(SparseMLAConfig(scale_rows=False), True, True) == (False, 32, 2)
  assert pick(SparseMLAConfig(block_n=16, num_stages=1), False, True) == (False, 16, 1)
  args = _mla_inputs(91, 5, fp8=True, q_dtype=jnp.bfloat16, rank=256, k=160)  # 64-row blocks, a part one
  _assert_attention_close(sparse_mla_decode(*args, softmax_scale=0.1),
                          sparse_mla_decode_reference(*args, softmax_scale=0.1), 1e-2)


def test_sparse_mla_empty_selection_and_default_config():
  args = list(_mla_inputs(60, 2, fp8=False))
  args[-1] = args[-1].at[1].set(-1)  # the second sequence selects nothing
  want = sparse_mla_decode_reference(*args, softmax_scale=0.1)
  for config in (None, SparseMLAConfig(combine="pallas")):
    got = sparse_mla_decode(*args, softmax_scale=0.1, config=config)
    _assert_attention_close(got, want, 1e-5)
    assert np.all(np.asarray(got)[1] == 0)


def _value_weights(seed: int, heads: int, nope: int, values: int, rank: int, dtype) -> jax.Array:
  return jnp.asarray(_rng(seed).standard_normal((heads, nope + values, rank)) * 0.05, dtype)


@pytest.mark.parametrize("t,fp8,heads,nope,values,rank,dtype", [
    (5, True, 8, 192, 256, 512, jnp.bfloat16),   # a TEP=8 rank of GLM-5
    (1, False, 4, 16, 32, 64, jnp.float32),
    (2, True, 3, 24, 40, 256, jnp.bfloat16),     # odd heads, V not a multiple of the value block
    (3, False, 5, 0, 72, 128, jnp.bfloat16)])
def test_sparse_mla_values_match_the_two_steps(t, fp8, heads, nope, values, rank, dtype):
  """The splits' merge and kv_b's value half in one launch: sparse_mla_decode, then W_UV per head."""
  args = _mla_inputs(80 + t, t, fp8, heads=heads, rank=rank, k=96)
  kv_b = _value_weights(81 + t, heads, nope, values, rank, dtype)
  scale = 0.1
  latent = sparse_mla_decode(*args, softmax_scale=scale, config=SparseMLAConfig(block_n=16))
  want = jnp.einsum("bthr,hvr->bthv", latent, kv_b[:, nope:].astype(jnp.float32), precision="highest")
  got = sparse_mla_decode_values(*args, kv_b, nope=nope, softmax_scale=scale, config=SparseMLAConfig(block_n=16))
  assert got.shape == (*latent.shape[:3], values)
  _assert_attention_close(got, want, 1e-5)
  # and against the plain-jnp attention, through the same weights
  ref = jnp.einsum("bthr,hvr->bthv", sparse_mla_decode_reference(*args, softmax_scale=scale),
                   kv_b[:, nope:].astype(jnp.float32), precision="highest")
  _assert_attention_close(got, ref, 1e-5)
  # bf16 out (what o_proj reads): the same fp32 result, rounded once
  in_bf16 = sparse_mla_decode_values(*args, kv_b, nope=nope, softmax_scale=scale, out_dtype=jnp.bfloat16,
                                     config=SparseMLAConfig(block_n=16))
  assert in_bf16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(in_bf16, np.float32), np.asarray(got.astype(jnp.bfloat16), np.float32))


def test_sparse_mla_values_empty_selection_and_bad_weights():
  args = list(_mla_inputs(61, 2, fp8=False))
  args[-1] = args[-1].at[1].set(-1)  # the second sequence selects nothing
  kv_b = _value_weights(62, 4, 16, 32, 64, jnp.bfloat16)
  got = sparse_mla_decode_values(*args, kv_b, nope=16, softmax_scale=0.1)
  assert np.all(np.asarray(got)[1] == 0) and np.any(np.asarray(got)[0] != 0)
  for bad, nope in ((kv_b[:3], 16), (kv_b[..., :32], 16), (kv_b, 48), (kv_b.astype(jnp.float16), 16)):
    with pytest.raises(ValueError, match="kv_b must be"):
      sparse_mla_decode_values(*args, bad, nope=nope, softmax_scale=0.1)
  with pytest.raises(ValueError, match="out_dtype must be"):
    sparse_mla_decode_values(*args, kv_b, nope=16, softmax_scale=0.1, out_dtype=jnp.float16)


# --- validation ------------------------------------------------------------------------------

def test_invalid_inputs_raise():
  with pytest.raises(ValueError, match="fuse_first_pass"):
    indexer_topk(*_indexer_inputs(0, 1, False), num_keys=NUM_KEYS, k=8, fuse_first_pass=True,
                 topk_config=TopKConfig(method="sampled"))
  scores = jnp.zeros((2, 100), jnp.float32)
  with pytest.raises(ValueError, match="k"):
    topk_indices(scores, 101)
  with pytest.raises(ValueError, match="float32"):
    topk_indices(scores.astype(jnp.bfloat16), 8)
  q, weights, index_k, index_scale, page_table, positions = _indexer_inputs(70, 1, fp8=True)
  for fn in (indexer_scores, indexer_scores_reference):
    with pytest.raises(ValueError, match="num_keys"):
      fn(q, weights, index_k, index_scale, page_table, positions, num_keys=NUM_KEYS + 1)
    with pytest.raises(ValueError, match="index_scale"):
      fn(q, weights, index_k, None, page_table, positions, num_keys=NUM_KEYS)
    with pytest.raises(ValueError, match="weights"):
      fn(q, weights.astype(jnp.bfloat16), index_k, index_scale, page_table, positions,
         num_keys=NUM_KEYS)
  with pytest.raises(ValueError, match="k"):
    indexer_topk(q, weights, index_k, index_scale, page_table, positions, num_keys=NUM_KEYS,
                 k=0)
  args = list(_mla_inputs(71, 1, fp8=True))
  for fn in (sparse_mla_decode, sparse_mla_decode_reference):
    with pytest.raises(ValueError, match="latent_scale"):
      fn(*args[:3], None, *args[4:], softmax_scale=0.1)
    with pytest.raises(ValueError, match="indices"):
      fn(*args[:6], args[6].astype(jnp.int16), softmax_scale=0.1)
    with pytest.raises(ValueError, match="q_rope"):
      fn(args[0], args[1].astype(jnp.bfloat16), *args[2:], softmax_scale=0.1)
  with pytest.raises(ValueError, match="power-of-two R"):
    bad = _mla_inputs(72, 1, fp8=False, rank=48)
    sparse_mla_decode(*bad, softmax_scale=0.1)


@pytest.mark.parametrize("make", [
    lambda: TopKConfig(block=24), lambda: TopKConfig(num_splits=3),
    lambda: TopKConfig(num_splits=256), lambda: TopKConfig(method="sort"), lambda: TopKConfig(sample=100),
    lambda: TopKConfig(scan_block=24), lambda: TopKConfig(select_warps=3), lambda: TopKConfig(scan_lanes=3),
    lambda: TopKConfig(threshold_trials=6), lambda: TopKConfig(select_trials=64),
    lambda: TopKConfig(sample_source="sorted"),
    lambda: IndexerScoresConfig(block_k=8),
    lambda: IndexerScoresConfig(num_warps=3), lambda: IndexerScoresConfig(orientation="rows"),
    lambda: IndexerScoresConfig(num_splits=2048), lambda: IndexerScoresConfig(num_splits=384),
    lambda: SparseMLAConfig(block_n=48),
    lambda: SparseMLAConfig(num_splits=0), lambda: SparseMLAConfig(combine="atomic")])
def test_invalid_configs_raise(make):
  with pytest.raises(ValueError):
    make()


# --- lowering for the GPU --------------------------------------------------------------------

def test_lowers_for_h200():
  """Each kernel lowers to Triton IR for an H200 (no GPU needed: export for `cuda`), with the
  engine's fp32 queries (split into bf16 MMA terms in-kernel)."""
  s = jax.ShapeDtypeStruct
  bf16, fp8, f32, i32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32, jnp.int32
  pages, page, max_pages, num_keys = 65, 64, 64, 4096
  idx_args = (s((1, 5, 32, 128), f32), s((1, 5, 32), f32), s((pages, page, 128), fp8),
              s((pages, page, 1), f32), s((1, max_pages), i32), s((1, 5), i32))
  rank = 512
  mla_args = (s((1, 5, 8, rank), f32), s((1, 5, 8, 64), f32), s((pages, page, rank), fp8),
              s((pages, page, rank // fp8_block_size(rank)), f32), s((pages, page, 64), bf16),
              s((1, max_pages), i32), s((1, 5, 2048), i32))
  cases = [
      (lambda x: topk_indices(x, 2048, interpret=False), (s((64, 131072), f32),)),
      (lambda x: topk_indices(x, 2048, config=TopKConfig(method="sampled"), interpret=False),
       (s((64, 131072), f32),)),
      # One row: its programs derive the threshold themselves (no launch of its own).
      (lambda x: topk_indices(x, 2048, config=TopKConfig(method="sampled"), interpret=False),
       (s((1, 131072), f32),)),
      # The sampled method in one launch (tickets, look-back, the last program selects).
      (lambda x: topk_indices(x, 2048, config=TopKConfig(one_launch=True), interpret=False),
       (s((5, 81920), f32),)),
      # The select gathering the candidates' keys from the row.
      (lambda x: topk_indices(x, 2048, config=TopKConfig(candidate_keys=False), interpret=False),
       (s((64, 131072), f32),)),
      (lambda *a: indexer_scores(*a, num_keys=num_keys, interpret=False), idx_args),
      # A TEP=8 rank's 4 indexer heads: the kernel masks the MMA rows past them.
      (lambda *a: indexer_scores(*a, num_keys=num_keys, interpret=False),
       (s((1, 5, 4, 128), bf16), s((1, 5, 4), f32), *idx_args[2:])),
      (lambda *a: indexer_topk(*a, num_keys=num_keys, k=2048, interpret=False), idx_args),
      *[(functools.partial(indexer_scores, num_keys=num_keys, config=IndexerScoresConfig(orientation=o),
                           interpret=False), idx_args) for o in ORIENTATIONS],
      # Past the top-k's 128 splits: 512 programs (of 128 keys each: most past these 4096).
      (functools.partial(indexer_scores, num_keys=num_keys, config=IndexerScoresConfig(num_splits=512),
                         interpret=False), idx_args),
      (lambda *a: sparse_mla_decode(*a, softmax_scale=0.0625, interpret=False), mla_args),
      (lambda *a: sparse_mla_decode(*a, softmax_scale=0.0625, config=SparseMLAConfig(combine="pallas"),
                                    interpret=False), mla_args),
      (lambda *a: sparse_mla_decode_values(*a, nope=192, softmax_scale=0.0625, interpret=False),
       (*mla_args, s((8, 192 + 256, rank), bf16)))]
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas-Triton deprecation notice
    for fn, args in cases:
      exported = jax.export.export(jax.jit(fn), platforms=("cuda",),
                                   disabled_checks=[triton_call])(*args)
      assert "__gpu$xla.gpu.triton" in exported.mlir_module()
