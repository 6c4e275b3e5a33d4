"""Exact top-k indices of fp32 score rows: a radix select on the order-preserving bit pattern.

Why: `lax.top_k` sorts; on the H200 it takes 132 us for k=2048 of 131,072 scores (one row) and
1.03 ms for 64 rows. Selection needs no sort, only the k-th largest key and a compaction.

Keys: each score maps to a uint32 that orders like the float (the total order `lax.top_k` uses:
-0.0 below +0.0); -inf maps to 0 and is never selected. Four passes resolve the k-th largest key
8 bits at a time (digit p = bits 31-8p .. 24-8p). Pass p runs a grid of (rows, splits): program
(r, s) reduces its chunk of row r into a 256-bin histogram of digit p over the keys that share the
prefix chosen so far, and publishes it twice: its own suffix counts (`ge[r, s, d]` = keys with
digit >= d) and an atomic add of them into the row total. The next pass starts by reading the
1 KB row total to choose its digit, so combining the splits costs no launch of its own. A fifth
call compacts: every key above the threshold, plus the first ties by index, goes to the slot given
by the counts of the splits before it (read back from the suffix counts, O(splits) per program).

Histogram: 256 bins = 16 x 16 (high nibble, low nibble), counted as onehot(hi)^T @ onehot(lo) on
the tensor cores (exact in fp32 below 2^24). Pallas-Triton exposes no shared-memory atomics, and
global atomics per element would serialise on the few bins that hold most of a score row.

Cost: each pass streams the row (from L2 after the first) and spends about 80 instructions per
score building the one-hot operands. One row of 131,072 is launch-bound (a memset and five calls,
about 12 us expected on the H200); 64 rows are issue-bound (about 20 us a pass, 0.1 ms). The next
step for many rows: after digit 1, compact the keys sharing the 16-bit prefix (about 1% of a row
of real scores) so that digits 2-3 and the ties touch only those.

Output order: ascending index (valid slots first, then -1). That is the order the compaction
produces for free; sorting 2048 entries by score would cost a bitonic network (about 10 us on one
SM) that no consumer needs: the sparse attention treats the selection as a set and gathers pages
in ascending order. `topk_indices_reference` returns `lax.top_k`'s order (descending score, then
ascending index); compare the two as sets.

Lowering: Triton (`pl.pallas_call` + `CompilerParams`). The kernels are per-element bit work,
reductions, scans, a data-dependent scatter store and atomics on pointer tensors: Triton's
model. Mosaic GPU programs warpgroup tiles moved by TMA into shared memory and fed to wgmma,
which buys nothing here (one small dot per block) and has no per-lane scatter for the compaction.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax import dsa
from pallas_kernels.checks import check_launch, check_splits, check_tile

DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS
PASSES = 32 // DIGIT_BITS
_NIBBLE = 16
# Two programs per H200 SM (132 SMs).
TARGET_PROGRAMS = 2 * 132
# The compaction gathers O(splits) counts per program, i.e. O(rows * splits^2) in all.
MAX_SPLITS = 128


@dataclasses.dataclass(frozen=True)
class TopKConfig:
  """Tuning of the radix select.

  block: scores per loop step (power of two >= 16: the K of the histogram matmul).
  num_splits: programs per row (power of two <= 128); None picks about two programs per SM.
  num_warps: Triton warps per program.
  """
  block: int = 512
  num_splits: int | None = None
  num_warps: int = 4

  def __post_init__(self):
    check_tile("TopKConfig", "block", self.block)
    check_splits("TopKConfig", self.num_splits, MAX_SPLITS)
    check_launch("TopKConfig", self.num_warps)


def row_splits(rows: int, n: int, granule: int) -> int:
  """Power-of-two splits per row: about TARGET_PROGRAMS programs in all, >= granule scores each."""
  splits = 1
  while (rows * splits < TARGET_PROGRAMS and splits < MAX_SPLITS
         and 2 * splits * granule <= n):
    splits *= 2
  return splits


def split_chunk(n: int, splits: int, granule: int) -> int:
  """Scores per split: a multiple of `granule` such that splits * chunk >= n."""
  return pl.cdiv(n, splits * granule) * granule


def loop_block(chunk: int, block: int) -> int:
  """Largest power of two <= block that divides chunk (the per-step tile of a split)."""
  while chunk % block:
    block //= 2
  return block


def order_key(x: jax.Array) -> jax.Array:
  """fp32 -> uint32 with the same (total) order; -inf -> 0, below every selectable key."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  key = jnp.where(bits >= jnp.uint32(0x80000000), ~bits, bits | jnp.uint32(0x80000000))
  return jnp.where(x == -jnp.inf, jnp.uint32(0), key)


def empty_histogram() -> jax.Array:
  """A zero [16, 16] f32 histogram (the accumulator of `block_histogram`)."""
  return jnp.zeros((_NIBBLE, _NIBBLE), jnp.float32)


def block_histogram(digits: jax.Array, counted: jax.Array) -> jax.Array:
  """Counts of 8-bit digits [n] where `counted`: f32 [16, 16], bin = 16 * row + column."""
  digits = digits.astype(jnp.int32)
  hi = jnp.where(counted, digits >> 4, _NIBBLE)  # 16 matches no row: not counted
  lo = digits & (_NIBBLE - 1)
  nibbles = jnp.arange(_NIBBLE, dtype=jnp.int32)
  rows = (hi[None, :] == nibbles[:, None]).astype(jnp.bfloat16)  # [16, n]
  cols = (lo[:, None] == nibbles[None, :]).astype(jnp.bfloat16)  # [n, 16]
  return lax.dot(rows, cols, preferred_element_type=jnp.float32)


def publish_histogram(hist: jax.Array, ge_ref, ge_index: tuple, tot_ref, tot_index: tuple):
  """Stores a split's suffix counts at ge_ref[*ge_index] and adds them into tot_ref[*tot_index].

  Counts are integers below 2^24, so the fp32 atomic adds are exact in any order.
  """
  # ge_ref [..., 256] f32 ; tot_ref [..., 256] f32 (row totals, zero before the pass)
  counts = hist.reshape(BINS)
  ge = jnp.sum(counts) - jnp.cumsum(counts) + counts  # keys with digit >= d
  ge_ref[(*ge_index, slice(None))] = ge
  pltriton.atomic_add(tot_ref, (*map(jnp.int32, tot_index), pl.ds(0, BINS)), ge)


def _choose_digit(prefix: jax.Array, k_rem: jax.Array, row_ge: jax.Array):
  """Next digit from the row's suffix counts: (prefix with it appended, ranks still to fill)."""
  ge = row_ge.astype(jnp.int32)
  digit = jnp.sum((ge >= k_rem).astype(jnp.int32)) - 1  # largest d with ge[d] >= k_rem
  above = jnp.sum(jnp.where(jnp.arange(BINS, dtype=jnp.int32) == digit + 1, ge, 0))
  return (prefix << DIGIT_BITS) | digit.astype(jnp.uint32), k_rem - above


def _load_state(state_ref):
  # state_ref [2] int32: (prefix bits, ranks still to fill)
  return lax.bitcast_convert_type(state_ref[0], jnp.uint32), state_ref[1]


def _chunk_histogram(scores_ref, *, digit: int, prefix, n: int, chunk: int, block: int):
  """Histogram of digit `digit` over this program's chunk, keys restricted to `prefix`."""
  # scores_ref [chunk] f32
  shift = 32 - DIGIT_BITS * (digit + 1)
  start = pl.program_id(1) * chunk

  def body(i, acc):
    pos = start + i * block + jnp.arange(block, dtype=jnp.int32)
    inside = pos < n
    key = order_key(pltriton.load(scores_ref.at[pl.ds(i * block, block)], mask=inside,
                                  other=-jnp.inf))
    if digit:
      inside &= (key >> (shift + DIGIT_BITS)) == prefix
    return acc + block_histogram((key >> shift) & (BINS - 1), inside)

  return lax.fori_loop(0, chunk // block, body, empty_histogram())


def _first_pass_kernel(scores_ref, _, ge_ref, tot_ref, *, n: int, chunk: int, block: int):
  """Digit 0: histogram of the top 8 key bits of this chunk."""
  # scores_ref [chunk] f32 ; ge_ref [256] f32 ; tot_ref [4, 256] f32 (aliases the unused input)
  hist = _chunk_histogram(scores_ref, digit=0, prefix=None, n=n, chunk=chunk, block=block)
  publish_histogram(hist, ge_ref, (), tot_ref, (0,))


def _pass_kernel(scores_ref, state_ref, tot_in_ref, ge_ref, tot_ref, state_out_ref, *,
                 digit: int, n: int, chunk: int, block: int):
  """Digit >= 1: choose digit-1 from the row total, then histogram digit `digit` under it."""
  # scores_ref [chunk] f32 ; state_ref, state_out_ref [2] i32 ; ge_ref [256] f32
  # tot_in_ref, tot_ref [4, 256] f32: one buffer; row digit-1 is complete, row digit accumulates
  prefix, k_rem = _choose_digit(*_load_state(state_ref), tot_in_ref[digit - 1])
  state_out_ref[0] = lax.bitcast_convert_type(prefix, jnp.int32)  # same value in every split
  state_out_ref[1] = k_rem
  hist = _chunk_histogram(scores_ref, digit=digit, prefix=prefix, n=n, chunk=chunk, block=block)
  publish_histogram(hist, ge_ref, (), tot_ref, (digit,))


def _split_counts(ge_ref, digit_plus_one: jax.Array, splits: int) -> jax.Array:
  """Per-split counts of keys with digit >= digit_plus_one: int32 [splits] (0 past the top)."""
  # ge_ref [splits, 256] f32
  col = jnp.full((splits,), jnp.minimum(digit_plus_one, BINS - 1), jnp.int32)
  counts = ge_ref[jnp.arange(splits, dtype=jnp.int32), col].astype(jnp.int32)
  return jnp.where(digit_plus_one < BINS, counts, 0)


def _compact_kernel(scores_ref, state_ref, tot_ref, ge0_ref, ge1_ref, ge2_ref, ge3_ref, out_ref,
                    *, k: int, n: int, chunk: int, block: int, splits: int):
  """Writes this chunk's selected indices at their ranks among the row's selection."""
  # scores_ref [chunk] f32 ; state_ref [2] i32 ; tot_ref [4, 256] f32 (row totals per digit)
  # ge*_ref [splits, 256] f32 (every split's suffix counts per digit) ; out_ref [k] i32
  s = pl.program_id(1)
  tau, ties = _choose_digit(*_load_state(state_ref), tot_ref[PASSES - 1])  # k-th largest key
  ties = jnp.where(tau == 0, 0, ties)  # the k-th key is -inf: fewer than k valid, take no ties
  greater = jnp.zeros((splits,), jnp.int32)  # per split: keys above tau
  for p, ref in enumerate((ge0_ref, ge1_ref, ge2_ref, ge3_ref)):
    digit = ((tau >> (32 - DIGIT_BITS * (p + 1))) & (BINS - 1)).astype(jnp.int32)
    greater += _split_counts(ref, digit + 1, splits)  # those that beat tau at digit p
  last = (tau & (BINS - 1)).astype(jnp.int32)  # per split: keys equal to tau
  equal = _split_counts(ge3_ref, last, splits) - _split_counts(ge3_ref, last + 1, splits)
  equal_before = jnp.cumsum(equal) - equal
  taken = greater + jnp.clip(ties - equal_before, 0, equal)
  taken_before = jnp.cumsum(taken) - taken
  mine = jnp.arange(splits, dtype=jnp.int32) == s
  start = s * chunk

  def body(i, carry):
    rank, tie_rank = carry
    pos = start + i * block + jnp.arange(block, dtype=jnp.int32)
    inside = pos < n
    key = order_key(pltriton.load(scores_ref.at[pl.ds(i * block, block)], mask=inside,
                                  other=-jnp.inf))
    tie = ((key == tau) & (tau > 0) & inside).astype(jnp.int32)
    take = (key > tau) | ((tie == 1) & (tie_rank + jnp.cumsum(tie) - tie < ties))
    take_i = take.astype(jnp.int32)
    slot = rank + jnp.cumsum(take_i) - take_i
    pltriton.store(out_ref.at[jnp.where(take, slot, k)], pos, mask=take)
    return rank + jnp.sum(take_i), tie_rank + jnp.sum(tie)

  lax.fori_loop(0, chunk // block, body,
                (jnp.sum(jnp.where(mine, taken_before, 0)),
                 jnp.sum(jnp.where(mine, equal_before, 0))))
  # Slots past the selection (rows with fewer than k valid scores) get -1, a share per split.
  share = pl.next_power_of_2(pl.cdiv(k, splits))
  slot = s * share + jnp.arange(share, dtype=jnp.int32)
  empty = (slot >= jnp.sum(taken)) & (slot < k)
  pltriton.store(out_ref.at[jnp.where(empty, slot, k)], jnp.full((share,), -1, jnp.int32),
                 mask=empty)


# Row totals tot [4, rows, 256] f32 (one row per digit): a program sees its row's [4, 256].
_TOT_SPEC = pl.BlockSpec((PASSES, None, BINS), lambda r, s: (0, r, 0))


def _params(config: TopKConfig):
  return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=2)


def first_pass(scores: jax.Array, tot: jax.Array, *, splits: int, chunk: int, block: int,
               config: TopKConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Digit-0 histograms: (ge0 [rows, splits, 256] f32, tot with tot[0] filled)."""
  rows, n = scores.shape
  return pl.pallas_call(
      functools.partial(_first_pass_kernel, n=n, chunk=chunk, block=block),
      grid=(rows, splits),
      in_specs=[pl.BlockSpec((None, chunk), lambda r, s: (r, s)), _TOT_SPEC],
      out_specs=[pl.BlockSpec((None, None, BINS), lambda r, s: (r, s, 0)), _TOT_SPEC],
      out_shape=[jax.ShapeDtypeStruct((rows, splits, BINS), jnp.float32),
                 jax.ShapeDtypeStruct(tot.shape, jnp.float32)],
      input_output_aliases={1: 1},
      compiler_params=_params(config),
      interpret=interpret,
      name="topk_digit0",
  )(scores, tot)


def select_from_first_pass(scores: jax.Array, ge0: jax.Array, tot: jax.Array, *, k: int,
                           splits: int, chunk: int, block: int, config: TopKConfig,
                           interpret: bool) -> jax.Array:
  """Digits 1-3 and the compaction, given digit 0's histograms: int32 [rows, k]."""
  rows, n = scores.shape
  score_spec = pl.BlockSpec((None, chunk), lambda r, s: (r, s))
  state_spec = pl.BlockSpec((None, 2), lambda r, s: (r, 0))
  ge_spec = pl.BlockSpec((None, None, BINS), lambda r, s: (r, s, 0))
  # State before digit 0: empty prefix, all k ranks to fill (a constant, no launch).
  state = jnp.asarray(np.tile(np.array([0, k], np.int32), (rows, 1)))
  ges = [ge0]
  for digit in range(1, PASSES):
    ge, tot, state = pl.pallas_call(
        functools.partial(_pass_kernel, digit=digit, n=n, chunk=chunk, block=block),
        grid=(rows, splits),
        in_specs=[score_spec, state_spec, _TOT_SPEC],
        out_specs=[ge_spec, _TOT_SPEC, state_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, splits, BINS), jnp.float32),
                   jax.ShapeDtypeStruct(tot.shape, jnp.float32),
                   jax.ShapeDtypeStruct((rows, 2), jnp.int32)],
        input_output_aliases={2: 1},
        compiler_params=_params(config),
        interpret=interpret,
        name=f"topk_digit{digit}",
    )(scores, state, tot)
    ges.append(ge)
  all_ge_spec = pl.BlockSpec((None, splits, BINS), lambda r, s: (r, 0, 0))
  return pl.pallas_call(
      functools.partial(_compact_kernel, k=k, n=n, chunk=chunk, block=block, splits=splits),
      grid=(rows, splits),
      in_specs=[score_spec, state_spec, _TOT_SPEC, *[all_ge_spec] * PASSES],
      out_specs=pl.BlockSpec((None, k), lambda r, s: (r, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, k), jnp.int32),
      compiler_params=_params(config),
      interpret=interpret,
      name="topk_compact",
  )(scores, state, tot, *ges)


def check_topk_args(n: int, k: int) -> None:
  """ValueError unless 1 <= k <= n < 2^24 (the fp32 histogram counts stay exact)."""
  if n >= 1 << 24:
    raise ValueError(f"top-k supports rows of fewer than 2^24 scores, got {n}")
  if not 1 <= k <= n:
    raise ValueError(f"top-k needs 1 <= k <= number of scores ({n}), got k={k}")


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def topk_indices(scores: jax.Array, k: int, *, config: TopKConfig | None = None,
                 interpret: bool | None = None) -> jax.Array:
  """Indices of the k largest scores of each row (ties: lower index first).

  Args:
    scores: float32 [..., N]; -inf marks invalid entries (never selected). No NaNs.
    k: 1 <= k <= N.
    config: tuning; None for the defaults.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
  Returns:
    int32 [..., k]: the exact top-k set of each row in ascending index order, then -1 for slots
    beyond the row's valid entries.
  """
  config = config or TopKConfig()
  interpret = jax.default_backend() == "cpu" if interpret is None else interpret
  if scores.ndim < 1 or scores.dtype != jnp.float32:
    raise ValueError(f"scores must be float32 [..., N], got {scores.dtype}{list(scores.shape)}")
  n = scores.shape[-1]
  check_topk_args(n, k)
  lead = scores.shape[:-1]
  rows = int(np.prod(lead))
  x = scores.reshape(rows, n)
  splits = config.num_splits or row_splits(rows, n, config.block)
  chunk = split_chunk(n, splits, config.block)
  tot = jnp.zeros((PASSES, rows, BINS), jnp.float32)
  ge0, tot = first_pass(x, tot, splits=splits, chunk=chunk, block=config.block, config=config,
                        interpret=interpret)
  out = select_from_first_pass(x, ge0, tot, k=k, splits=splits, chunk=chunk, block=config.block,
                               config=config, interpret=interpret)
  return out.reshape(*lead, k)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_indices_reference(scores: jax.Array, k: int) -> jax.Array:
  """`lax.top_k` with -1 for -inf picks: int32 [..., k], descending score then ascending index."""
  if scores.ndim < 1 or scores.dtype != jnp.float32:
    raise ValueError(f"scores must be float32 [..., N], got {scores.dtype}{list(scores.shape)}")
  check_topk_args(scores.shape[-1], k)
  return dsa.select_topk(scores, k)
