"""Exact top-k indices of fp32 score rows: a radix select on the order-preserving bit pattern.

Why: `lax.top_k` sorts; on the H200 it takes 132 us for k=2048 of 131,072 scores (one row) and
1.03 ms for 64 rows. Selection needs no sort, only the k-th largest key and a compaction.

Keys: each score maps to a uint32 that orders like the float (the total order `lax.top_k` uses:
-0.0 below +0.0); -inf maps to 0 and is never selected. The k-th largest key is resolved 8 bits
at a time (digit p = bits 31-8p .. 24-8p), in four launches:
1-2. digits 0 and 1, over whole rows: a grid of (rows, splits) where program (r, s) reduces
   its chunk of row r into a 256-bin histogram of the digit over the keys that share the prefix
   chosen so far, and publishes it twice: its own suffix counts (`ge[r, s, d]` = keys with digit
   >= d) and an atomic add of them into the row total. A launch starts by reading the 1 KB row
   totals to choose the digits before its own, so combining the splits costs no launch.
3. gather, same grid: with the 16-bit prefix P of the k-th key known, every key above P is
   selected: it goes straight to the output, at the slot that the counts of the splits before it
   give (read back from the suffix counts, O(splits) per program). The keys sharing P are the
   only candidates left; they are compacted, in index order, into per-row buffers (score and
   position; as large as the scores, since a whole row can share P, but written only there).
4. select, one program per row: digits 2 and 3 from histograms of the candidates, then the
   candidates above the k-th key and the first ties by index fill the remaining slots.
(`indexer_topk` fuses launch 1 into the scoring kernel.)

Histogram: 256 bins = 16 x 16 (high nibble, low nibble), counted as onehot(hi)^T @ onehot(lo) on
the tensor cores (exact in fp32 below 2^24). Pallas-Triton exposes no shared-memory atomics, and
global atomics per element would serialise on the few bins that hold most of a score row.

Cost (estimates for the H200, not yet measured): a histogram pass spends about 80 instructions
per score building the one-hot operands, so 64 rows of 131,072 are issue-bound at about 20 us a
pass; the gather pass costs a compare, a scan and a masked store per score (about 8 us). Two
full-row histograms instead of four plus a compaction: about 50 us for 64 rows (0.1 ms with
four), launch-bound for one row (a memset and four calls). Candidates: P fixes the sign, exponent
and 7 mantissa bits, a bucket 2^-7 wide around the k-th score: about 0.1% of a row of normal
scores at k = n / 64 (the scores' distribution near the k-th sets the share). A row
whose k-th key shares P with most of the row (many equal scores) is still exact, but its one
select program then walks that many candidates three times.

method="sampled" (the default) replaces the two full-row histogram passes, measured at about 145
us each for 64 rows of 131,072 (run 7: the one-hot operands cost about 80 instructions a score),
by a threshold from a sample, and every histogram by counts (`count_search`: a search that
counts the keys at or above a trial, all held in registers), in three or four launches:
1. threshold: the row's strided sample (every n / `sample`-th score; 4096 by default) gives a
   key T with r_lo to r_lo + slack sample keys above it (r_lo: the sample rank of the
   row's k-th score plus 4 sigma, `sample_plan`). Where the row's programs fit on the SMs at
   once (up to FEW_ROWS rows their splits shrink until they do) each count program derives T
   itself; otherwise one program per row does, in a launch of its own.
2. count, grid (rows, splits): every program counts the keys of its chunk above T and equal to
   T, per segment of the chunk (`scan_lanes`: 16 of a 2048-score step, one warp's loads each),
   in registers, reduced once at the end: two compares and adds a score.
3. compaction, same grid: the keys above T, in index order (offsets from the segments' counts,
   each segment scanned inside its warp; with `candidate_keys=False` positions only),
   go to a per-row buffer of about twice their expected number (8K keys at k=2048 of 131,072);
   when the keys above T number fewer than k, the first (k - that many) keys equal to T by
   position go to a tie buffer (ReLU-summed indexer scores: T is often their exact zero).
4. select, one program per row: if the buffer did not overflow and it with T's ties holds k
   keys (or T = 0: every valid key is a candidate), `count_search` over the buffer in
   registers finds a bound with exactly k candidates at or above it (or the k-th key, whose
   first ties by position then complete the set), and they and T's ties fill the slots;
   otherwise (a sample more than 4 sigma off, or a row of many equal keys above its k-th) the
   radix select's histograms over the whole row. Exact either way.
With TopKConfig.one_launch, 2-4 are one launch: each program takes its split by an atomic ticket,
counts it, publishes the counts, waits only for the lower splits' (decoupled look-back: offsets
without a grid-wide sync, and no deadlock, since a lower ticket's program has already started),
compacts, and the last program to finish selects. Its state is a zeroed int32 row a row.
Measured on the H200 (kernels' own time from a profile): one row 17.5-19.7 us (the search's
steps vary with the row), 64 rows 54.5-57.7 (the chunk scanned whole every step: 61.3-61.7 in
the same call), rows whose k-th score is a ReLU zero 16.0 (one) and 61.6-63.0 (64), with
launch gaps 41.6 and 68.0 (BENCHMARKS.md run 18); the radix select took 28, 362 and, on the
ReLU rows, whose candidates are then most of the row, 187-265 us (run 16).

Output order: the set, as two ascending runs (radix: the keys above P, then the chosen candidates;
sampled: the chosen candidates, then T's ties), then -1 for slots beyond the row's valid entries. Sorting
2048 entries would cost a bitonic network (about 10 us on one SM) that no consumer needs: the
sparse attention treats the selection as a set. `topk_indices_reference` returns `lax.top_k`'s
order (descending score, then ascending index); compare the two as sets.

Lowering: Triton (`pl.pallas_call` + `CompilerParams`). The kernels are per-element bit work,
reductions, scans, a data-dependent scatter store and atomics on pointer tensors: Triton's
model. Mosaic GPU programs warpgroup tiles moved by TMA into shared memory and fed to wgmma,
which buys nothing here (one small dot per block) and has no per-lane scatter for the compaction.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax import dsa
from pallas_kernels.checks import check_choice, check_launch, check_splits, check_tile, resolve_interpret

DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS
PREFIX_DIGITS = 2  # digits resolved over whole rows; the other two over the candidates
_PREFIX_SHIFT = 32 - PREFIX_DIGITS * DIGIT_BITS
_NIBBLE = 16
SMS = 132  # the H200's streaming multiprocessors
TARGET_PROGRAMS = 2 * SMS  # two programs per SM
# The gather pass reads O(splits) counts per program, i.e. O(rows * splits^2) in all.
MAX_SPLITS = 128
METHODS = ("sampled", "radix")
SAMPLE_SOURCES = ("scores", "row")  # TopKConfig.sample_source
SAMPLE = 4096  # scores per row in the sampled method's sample
FEW_ROWS = 8  # rows up to which the sampled select takes 8 warps and the counts fit on the SMs
KEYS_PER_THREAD = 32  # ... where its candidates come to at most this many a thread
MAX_CANDIDATES = 16384  # the sampled select's buffer, held in registers: 32 keys a thread at 16 warps
LANE_WIDTH = 128  # scores a warp loads in one 128-bit load a thread
_NO_KEY = 0xFFFFFFFF  # above every key (order_key(+inf) is 0xFF800000)
_LARGEST_BELOW_2_32 = 4294967040.0  # the largest float32 under 2^32: a float stride that fits uint32
SEARCH_SPREAD = 0.5  # count_search's multiples of its guess span 2^-0.5 .. 2^0.5 (simulated: 0.3-2 alike)


@dataclasses.dataclass(frozen=True)
class TopKConfig:
  """Tuning of the radix select.

  block: scores per loop step (power of two >= 16: the K of the histogram matmul).
  num_splits: programs per row (power of two <= 128); None picks about two programs per SM.
  num_warps: Triton warps per program.
  method: "sampled" (a threshold from a strided sample of `sample` scores per row, then one
    count, one compaction and a select over the candidates; rows too short for it to pay take
    the radix select) or "radix" (four digit passes); module docstring.
  scan_block: scores per loop step of the sampled method's count and compaction passes (power of
    two >= 16): a compare a score, so large tiles keep enough loads in flight.
  scan_lanes: segments a program's chunk is cut into for the sampled method's count and
    compaction, each read scan_block / scan_lanes scores a step and scanned on its own. None:
    segments of LANE_WIDTH scores a step (16 of a 2048 block), whose scans stay inside a warp;
    1 scans the whole block across the program's warps every step (64 rows of 131,072: count
    9.6 us against 11.5, compaction 23.7 against 25.7, BENCHMARKS.md run 18).
  candidate_keys: the sampled compaction stores each candidate's key beside its position
    (True), or only the position, the select then gathering the keys from the row (False: one
    scattered store a candidate fewer; with the stores timed alone, 64 rows' compaction 17.3 us
    against 23.8, BENCHMARKS.md run 18; the select's gather not yet timed).
  threshold_trials, select_trials: keys the sampled method's two searches (`count_search`: the
    threshold's over the sample, the select's over the candidates) count at in each step (a
    power of two <= 32): one reduction of more compares, in fewer steps. 1 is the single-guess
    search of runs 17-36. Measured (BENCHMARKS.md run 37, H100, 5 rows of 81,920 indexer scores,
    k = 2048, threshold / select trials): 1/1 31.3 us (count 16.6, select 9.2), 4/4 24.8 (8.4,
    11.1), 8/8 29.1 (9.5, 14.2), 16/16 39.2, 4/1 22.6; threshold 2 is slower than 1 (36.5):
    the threshold's kernel gains most at 4, the select's loses with every trial it adds.
  sample_source: where the sampled method's threshold reads its sample: "scores" (the default:
    a contiguous [rows, sample] array that the indexer's scoring kernel writes beside the
    scores, indexer_topk; `topk_indices(sample=)`; rows given without it are gathered from) or
    "row" (a strided gather from the score row). The same keys either way. On an H100
    (BENCHMARKS.md run 38; 5 rows of 81,920 indexer scores, k = 2048, cold L2) the count launch,
    which derives the threshold, went 8.68 -> 6.64 us with the scoring kernel unchanged (20.3
    -> 20.2); in the rank's step 8.14 -> 6.25 us a layer.
  one_launch: the sampled method's count, compaction and select in one launch
    (`_one_launch_kernel`: each program derives the threshold, takes the offsets of its chunk
    from the lower splits' published counts, and the last program to finish selects), where
    three launches wait for each other's whole grid; its state is a zeroed int32 row a row. Exact
    on an H100 but no faster (BENCHMARKS.md run 53: 5 rows of 81,920 indexer scores, scores +
    top-k 37.8 against 36.1 us; in the rank's layer 24.6 us and a 1.0 us memset of the state
    against 23.6 for three launches; 64 rows 126.4 against 61.1, their programs more than the SMs
    hold at once). Off.
  select_warps: warps of the sampled method's threshold and select programs, which hold the
    sample or the candidates in registers: more warps, fewer keys a thread per count, but a
    slower reduction across them. None: 8 for up to 8 rows of at most 32 candidates a thread,
    else 16 (BENCHMARKS.md run 17: one row 19.3 us against 20.3 with 16, five rows of 81,920
    41.7 against 42.8; 64 rows 58.2 with 16 against 63.5 with 8).
  """
  block: int = 512
  num_splits: int | None = None
  num_warps: int = 4
  method: str = "sampled"
  sample: int = SAMPLE
  scan_block: int = 2048
  select_warps: int | None = None
  scan_lanes: int | None = None
  candidate_keys: bool = True
  threshold_trials: int = 4
  select_trials: int = 1
  sample_source: str = "scores"
  one_launch: bool = False

  def __post_init__(self):
    check_tile("TopKConfig", "block", self.block)
    check_tile("TopKConfig", "scan_block", self.scan_block)
    check_splits("TopKConfig", self.num_splits, MAX_SPLITS)
    check_launch("TopKConfig", self.num_warps)
    if self.select_warps is not None:
      check_launch("TopKConfig", self.select_warps)
    check_choice("TopKConfig", "method", self.method, METHODS)
    check_choice("TopKConfig", "sample_source", self.sample_source, SAMPLE_SOURCES)
    check_tile("TopKConfig", "sample", self.sample)
    for name in ("threshold_trials", "select_trials"):
      check_tile("TopKConfig", name, getattr(self, name), minimum=1)
      if getattr(self, name) > 32:
        raise ValueError(f"TopKConfig.{name} must be a power of two <= 32, got {getattr(self, name)}")
    if self.scan_lanes is not None and (self.scan_lanes < 1 or self.scan_block % self.scan_lanes
                                        or self.scan_lanes & (self.scan_lanes - 1)):
      raise ValueError(f"TopKConfig.scan_lanes must be a power of two dividing scan_block "
                       f"({self.scan_block}), got {self.scan_lanes}")

  @property
  def lanes(self) -> int:
    """scan_lanes, by default segments of one warp's 128-bit loads (LANE_WIDTH scores)."""
    return self.scan_lanes or max(1, self.scan_block // LANE_WIDTH)


def row_splits(rows: int, n: int, granule: int, target: int = TARGET_PROGRAMS, max_splits: int = MAX_SPLITS) -> int:
  """Power-of-two splits per row: about `target` programs in all, >= granule scores each, at most
  `max_splits`."""
  splits = 1
  while (rows * splits < target and splits < max_splits
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


def _suffix_counts(hist: jax.Array) -> jax.Array:
  """[16, 16] histogram -> [256] counts of keys with digit >= d."""
  counts = hist.reshape(BINS)
  return jnp.sum(counts) - jnp.cumsum(counts) + counts


def publish_histogram(hist: jax.Array, ge_ref, ge_index: tuple, tot_ref, tot_index: tuple):
  """Stores a split's suffix counts at ge_ref[*ge_index] and adds them into tot_ref[*tot_index].

  Counts are integers below 2^24, so the fp32 atomic adds are exact in any order.
  """
  # ge_ref [..., 256] f32 ; tot_ref [..., 256] f32 (row totals, zero before the pass)
  ge = _suffix_counts(hist)
  ge_ref[(*ge_index, slice(None))] = ge
  pltriton.atomic_add(tot_ref, (*map(jnp.int32, tot_index), pl.ds(0, BINS)), ge)


def _count_at(ge: jax.Array, digit: jax.Array) -> jax.Array:
  """ge[digit] of int32 suffix counts [256]; 0 for digit 256 (past the top)."""
  return jnp.sum(jnp.where(jnp.arange(BINS, dtype=jnp.int32) == digit, ge, 0))


def _choose_digit(prefix: jax.Array, k_rem: jax.Array, row_ge: jax.Array):
  """Next digit from the row's suffix counts: (prefix with it appended, ranks still to fill)."""
  ge = row_ge.astype(jnp.int32)
  digit = jnp.sum((ge >= k_rem).astype(jnp.int32)) - 1  # largest d with ge[d] >= k_rem
  return (prefix << DIGIT_BITS) | digit.astype(jnp.uint32), k_rem - _count_at(ge, digit + 1)


def _row_prefix(tot_ref, k: int, digits: int = PREFIX_DIGITS):
  """The top `digits` digits of the row's k-th largest key and the ranks left to fill under
  them (the keys above fill k minus that many). The 16-bit prefix P is 0 iff fewer than k keys
  are valid (only -inf has it)."""
  # tot_ref [2, 256] f32: the row's suffix counts of digits 0 and 1
  prefix, k_rem = jnp.uint32(0), jnp.int32(k)
  for digit in range(digits):
    prefix, k_rem = _choose_digit(prefix, k_rem, tot_ref[digit])
  return prefix, k_rem


def _chunk_scores(scores_ref, i, *, start, n: int, block: int):
  """Block i of a program's chunk (starting at row position `start`): (positions, in-row mask,
  scores, -inf past the row)."""
  pos = start + i * block + jnp.arange(block, dtype=jnp.int32)
  inside = pos < n
  return pos, inside, pltriton.load(scores_ref.at[pl.ds(i * block, block)], mask=inside, other=-jnp.inf)


def _chunk_histogram(scores_ref, *, digit: int, prefix, n: int, chunk: int, block: int):
  """Histogram of digit `digit` over this program's chunk, keys restricted to `prefix`."""
  # scores_ref [chunk] f32
  shift = 32 - DIGIT_BITS * (digit + 1)
  start = pl.program_id(1) * chunk

  def body(i, acc):
    _, inside, score = _chunk_scores(scores_ref, i, start=start, n=n, block=block)
    key = order_key(score)
    if digit:
      inside &= (key >> (shift + DIGIT_BITS)) == prefix
    return acc + block_histogram((key >> shift) & (BINS - 1), inside)

  return lax.fori_loop(0, chunk // block, body, empty_histogram())


def _first_pass_kernel(scores_ref, _, ge_ref, tot_ref, *, n: int, chunk: int, block: int):
  """Digit 0: histogram of the top 8 key bits of this chunk."""
  # scores_ref [chunk] f32 ; ge_ref [256] f32 ; tot_ref [2, 256] f32 (aliases the unused input)
  hist = _chunk_histogram(scores_ref, digit=0, prefix=None, n=n, chunk=chunk, block=block)
  publish_histogram(hist, ge_ref, (), tot_ref, (0,))


def _second_pass_kernel(scores_ref, tot_in_ref, ge_ref, tot_ref, *, k: int, n: int, chunk: int,
                        block: int):
  """Digit 1: choose digit 0 from the row total, then histogram digit 1 under it."""
  # scores_ref [chunk] f32 ; ge_ref [256] f32
  # tot_in_ref, tot_ref [2, 256] f32: one buffer; row 0 is complete, row 1 accumulates
  prefix, _ = _row_prefix(tot_in_ref, k, digits=1)
  hist = _chunk_histogram(scores_ref, digit=1, prefix=prefix, n=n, chunk=chunk, block=block)
  publish_histogram(hist, ge_ref, (), tot_ref, (1,))


def _split_counts(ge_ref, digit: jax.Array, splits: int) -> jax.Array:
  """Per-split counts of keys with digit >= `digit`: int32 [splits] (0 past the top)."""
  # ge_ref [splits, 256] f32
  col = jnp.full((splits,), jnp.minimum(digit, BINS - 1), jnp.int32)
  counts = ge_ref[jnp.arange(splits, dtype=jnp.int32), col].astype(jnp.int32)
  return jnp.where(digit < BINS, counts, 0)


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _gather_kernel(scores_ref, tot_ref, ge0_ref, ge1_ref, out_ref, cand_ref, cand_pos_ref, lo_ref,
                   hi_ref, *, k: int, n: int, chunk: int, block: int, splits: int):
  """Keys above the row's prefix P -> their output slots; keys sharing P -> the candidates, and
  the smallest and largest of this chunk's (the select skips its digit passes when they agree)."""
  # scores_ref [chunk] f32 ; tot_ref [2, 256] f32 ; ge*_ref [splits, 256] f32 (every split's
  # suffix counts of digits 0 and 1) ; out_ref [k] i32 ; cand_ref [n] f32 ; cand_pos_ref [n] i32
  # lo_ref, hi_ref [] u32 (this program's; no candidate: 2^32 - 1 and 0)
  s = pl.program_id(1)
  prefix, _ = _row_prefix(tot_ref, k)
  top = (prefix >> DIGIT_BITS).astype(jnp.int32)
  low = (prefix & (BINS - 1)).astype(jnp.int32)
  # Per split: keys above P (a higher digit 0, or digit 0 = top and a higher digit 1), keys on P.
  above = _split_counts(ge0_ref, top + 1, splits) + _split_counts(ge1_ref, low + 1, splits)
  on_prefix = _split_counts(ge1_ref, low, splits) - _split_counts(ge1_ref, low + 1, splits)
  on_prefix = jnp.where(prefix > 0, on_prefix, 0)  # P = 0: the -inf keys, never selected
  mine = jnp.arange(splits, dtype=jnp.int32) == s
  start = s * chunk

  def body(i, carry):
    rank, cand, lo, hi = carry
    pos, inside, score = _chunk_scores(scores_ref, i, start=start, n=n, block=block)
    key = order_key(score)
    key_prefix = key >> _PREFIX_SHIFT
    take = inside & (key_prefix > prefix)
    keep = inside & (key_prefix == prefix) & (prefix > 0)
    take_i, keep_i = take.astype(jnp.int32), keep.astype(jnp.int32)
    pltriton.store(out_ref.at[jnp.where(take, rank + _exclusive_cumsum(take_i), k)], pos,
                   mask=take)
    slot = jnp.where(keep, cand + _exclusive_cumsum(keep_i), n)
    pltriton.store(cand_ref.at[slot], score, mask=keep)
    pltriton.store(cand_pos_ref.at[slot], pos, mask=keep)
    lo = jnp.minimum(lo, jnp.min(jnp.where(keep, key, jnp.uint32(_NO_KEY))))
    hi = jnp.maximum(hi, jnp.max(jnp.where(keep, key, jnp.uint32(0))))
    return rank + jnp.sum(take_i), cand + jnp.sum(keep_i), lo, hi

  first_rank = jnp.sum(jnp.where(mine, _exclusive_cumsum(above), 0))
  first_cand = jnp.sum(jnp.where(mine, _exclusive_cumsum(on_prefix), 0))
  _, _, lo, hi = lax.fori_loop(0, chunk // block, body,
                               (first_rank, first_cand, jnp.uint32(_NO_KEY), jnp.uint32(0)))
  lo_ref[...] = lo
  hi_ref[...] = hi


def _select_into(out_ref, keys, positions, count, prefix, k_rem, *, first_digit: int, filled,
                 k: int, block: int, one_key=None) -> None:
  """The k_rem largest of `count` candidates -> out_ref[filled:], then -1 up to slot k.

  keys(i) -> (uint32 keys, valid mask) and positions(i) -> int32 of the candidates' block i, in
  index order (ties go to the first); every candidate's key starts with `prefix`, its top
  `first_digit` digits. The remaining digits are resolved from histograms of the candidates,
  unless `one_key` = (flag, key) says every candidate is that key (a row whose k-th score is
  tied many times over, such as the exact zeros of ReLU-summed indexer scores): then the first
  k_rem of them by index are the answer, with no histogram pass. Fewer valid candidates than
  k_rem: all of them are taken.
  """
  steps = (count + block - 1) // block

  def resolve(digit: int, prefix, k_rem):
    shift = 32 - DIGIT_BITS * (digit + 1)

    def body(i, acc):
      key, inside = keys(i)
      counted = inside if digit == 0 else inside & ((key >> (shift + DIGIT_BITS)) == prefix)
      return acc + block_histogram((key >> shift) & (BINS - 1), counted)

    hist = lax.fori_loop(0, steps, body, empty_histogram())
    return (*_choose_digit(prefix, k_rem, _suffix_counts(hist)), jnp.sum(hist.reshape(BINS)))

  def resolved():
    tau, ties = prefix, k_rem  # the k-th largest key; its ties to take
    enough = None
    for digit in range(first_digit, 2 * PREFIX_DIGITS):
      tau, ties, counted = resolve(digit, tau, ties)
      enough = counted >= k_rem if enough is None else enough
    # too few: every valid key (> 0) is taken
    return jnp.where(enough, tau, jnp.uint32(0)), jnp.where(enough, ties, 0)

  if one_key is None:
    tau, ties = resolved()
    pick_steps = steps
  else:
    same, key = one_key
    tau, ties = lax.cond(same, lambda: (key, jnp.minimum(k_rem, count)), resolved)
    # One key: no candidate lies above it, so the answer is the first `ties` of them by index
    # and the blocks past those need no walk (a ReLU row's zeros can be most of the row).
    pick_steps = jnp.where(same, (ties + block - 1) // block, steps)

  def pick(i, carry):
    rank, tie_rank = carry
    key, inside = keys(i)
    tie = (inside & (key == tau)).astype(jnp.int32)
    take = (inside & (key > tau)) | ((tie == 1) & (tie_rank + _exclusive_cumsum(tie) < ties))
    take_i = take.astype(jnp.int32)
    pltriton.store(out_ref.at[jnp.where(take, rank + _exclusive_cumsum(take_i), k)], positions(i),
                   mask=take)
    return rank + jnp.sum(take_i), tie_rank + jnp.sum(tie)

  total, _ = lax.fori_loop(0, pick_steps, pick, (filled, jnp.int32(0)))

  def pad(i, carry):  # slots past the selection (rows with fewer than k valid scores)
    slot = i * block + jnp.arange(block, dtype=jnp.int32)
    empty = (slot >= total) & (slot < k)
    pltriton.store(out_ref.at[jnp.where(empty, slot, k)], jnp.full((block,), -1, jnp.int32),
                   mask=empty)
    return carry

  lax.fori_loop(0, pl.cdiv(k, block), pad, 0)


def _block_loader(score_ref, pos_ref, count, block: int):
  """(keys(i), positions(i)) over the first `count` entries of a score buffer, with their
  positions from pos_ref (None: the entry's own index)."""
  def index(i):
    j = i * block + jnp.arange(block, dtype=jnp.int32)
    return j, j < count

  def keys(i):
    j, inside = index(i)
    key = order_key(pltriton.load(score_ref.at[pl.ds(i * block, block)], mask=inside, other=-jnp.inf))
    return key, inside & (key > 0)  # -inf (key 0) is never a candidate

  def positions(i):
    j, inside = index(i)
    return j if pos_ref is None else pltriton.load(pos_ref.at[pl.ds(i * block, block)], mask=inside, other=0)

  return keys, positions


def _select_kernel(cand_ref, cand_pos_ref, tot_ref, lo_ref, hi_ref, _, out_ref, *, k: int, block: int):
  """Digits 2 and 3 over the row's candidates (none when they are all one key), then the chosen
  ones and the -1 padding."""
  # cand_ref [n] f32 ; cand_pos_ref [n] i32 ; tot_ref [2, 256] f32 ; lo_ref, hi_ref [splits] u32
  # (each chunk's smallest and largest candidate key) ; out_ref [k] i32 (aliases the unused
  # input; the gather pass filled the keys above P)
  prefix, k_rem = _row_prefix(tot_ref, k)
  low = (prefix & (BINS - 1)).astype(jnp.int32)
  ge1 = tot_ref[1].astype(jnp.int32)
  count = jnp.where(prefix > 0, _count_at(ge1, low) - _count_at(ge1, low + 1), 0)
  lo, hi = jnp.min(lo_ref[...]), jnp.max(hi_ref[...])
  keys, positions = _block_loader(cand_ref, cand_pos_ref, count, block)
  _select_into(out_ref, keys, positions, count, prefix, k_rem, first_digit=PREFIX_DIGITS,
               filled=k - k_rem, k=k, block=block, one_key=((count > 0) & (lo == hi), lo))


def _params(config: TopKConfig, num_warps: int | None = None):
  return pltriton.CompilerParams(num_warps=num_warps or config.num_warps, num_stages=2)


# Row totals tot [2, rows, 256] f32 (one row per prefix digit): a program sees its row's [2, 256].
_TOT_SPEC = pl.BlockSpec((PREFIX_DIGITS, None, BINS), lambda r, s: (0, r, 0))


def _histogram_pass(kernel, scores: jax.Array, tot: jax.Array, *, splits: int, chunk: int,
                    config: TopKConfig, interpret: bool, name: str) -> tuple[jax.Array, jax.Array]:
  """One digit's histogram launch over (rows, splits) chunks: (ge [rows, splits, 256] f32, tot
  with that digit's row totals added in place)."""
  rows = scores.shape[0]
  return pl.pallas_call(
      kernel,
      grid=(rows, splits),
      in_specs=[pl.BlockSpec((None, chunk), lambda r, s: (r, s)), _TOT_SPEC],
      out_specs=[pl.BlockSpec((None, None, BINS), lambda r, s: (r, s, 0)), _TOT_SPEC],
      out_shape=[jax.ShapeDtypeStruct((rows, splits, BINS), jnp.float32),
                 jax.ShapeDtypeStruct(tot.shape, jnp.float32)],
      input_output_aliases={1: 1},
      compiler_params=_params(config),
      interpret=interpret,
      name=name,
  )(scores, tot)


def first_pass(scores: jax.Array, tot: jax.Array, *, splits: int, chunk: int, block: int,
               config: TopKConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Digit-0 histograms: (ge0 [rows, splits, 256] f32, tot with tot[0] filled)."""
  kernel = functools.partial(_first_pass_kernel, n=scores.shape[1], chunk=chunk, block=block)
  return _histogram_pass(kernel, scores, tot, splits=splits, chunk=chunk, config=config,
                         interpret=interpret, name="topk_digit0")


def select_from_first_pass(scores: jax.Array, ge0: jax.Array, tot: jax.Array, *, k: int,
                           splits: int, chunk: int, block: int, config: TopKConfig,
                           interpret: bool) -> jax.Array:
  """Digit 1, the gather and the selection, given digit 0's histograms: int32 [rows, k]."""
  rows, n = scores.shape
  score_spec = pl.BlockSpec((None, chunk), lambda r, s: (r, s))
  ge1, tot = _histogram_pass(
      functools.partial(_second_pass_kernel, k=k, n=n, chunk=chunk, block=block), scores, tot,
      splits=splits, chunk=chunk, config=config, interpret=interpret, name="topk_digit1")
  all_ge_spec = pl.BlockSpec((None, splits, BINS), lambda r, s: (r, 0, 0))
  row_spec = lambda width: pl.BlockSpec((None, width), lambda r, s: (r, 0))
  per_program = pl.BlockSpec((None, None), lambda r, s: (r, s))
  out, cand, cand_pos, lo, hi = pl.pallas_call(
      functools.partial(_gather_kernel, k=k, n=n, chunk=chunk, block=block, splits=splits),
      grid=(rows, splits),
      in_specs=[score_spec, _TOT_SPEC, all_ge_spec, all_ge_spec],
      out_specs=[row_spec(k), row_spec(n), row_spec(n), per_program, per_program],
      out_shape=[jax.ShapeDtypeStruct((rows, k), jnp.int32),
                 jax.ShapeDtypeStruct((rows, n), jnp.float32),
                 jax.ShapeDtypeStruct((rows, n), jnp.int32),
                 *[jax.ShapeDtypeStruct((rows, splits), jnp.uint32)] * 2],
      compiler_params=_params(config),
      interpret=interpret,
      name="topk_gather",
  )(scores, tot, ge0, ge1)
  row = lambda width: pl.BlockSpec((None, width), lambda r: (r, 0))
  return pl.pallas_call(
      functools.partial(_select_kernel, k=k, block=block),
      grid=(rows,),
      in_specs=[row(n), row(n), pl.BlockSpec((PREFIX_DIGITS, None, BINS), lambda r: (0, r, 0)),
                row(splits), row(splits), row(k)],
      out_specs=row(k),
      out_shape=jax.ShapeDtypeStruct((rows, k), jnp.int32),
      input_output_aliases={5: 0},
      compiler_params=_params(config),
      interpret=interpret,
      name="topk_select",
  )(cand, cand_pos, tot, lo, hi, out)


# --- method="sampled" ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplePlan:
  """The sampled select's static shape for rows of n scores: every stride-th score forms the
  sample; the threshold is a sample key with r_lo to r_lo + slack sample keys at or above it;
  the candidate buffer holds `capacity` keys per row (a power of two: the select holds them all
  in registers)."""
  stride: int
  r_lo: int
  slack: int
  capacity: int


def sample_plan(n: int, k: int, sample: int) -> SamplePlan | None:
  """The plan, or None where the radix select is the better choice (rows under 8 samples'
  worth, or candidates that would not be a small share of the row or not fit the select's
  registers: more than MAX_CANDIDATES).

  The sample's rank of the row's k-th score is about r = k * sample / n, with a standard
  deviation below sqrt(r); r_lo = r + 4 sqrt(r) + 8 puts the threshold under the k-th score
  unless the sample is off by more than 4 sigma (then the select falls back, exactly). The
  slack (a quarter of r_lo) lets the threshold's search stop early; about
  (r_lo + slack) * stride keys lie above the threshold, and the capacity is the power of two at
  or above twice r_lo * stride.
  """
  if n < 8 * sample:
    return None
  stride = n // sample
  r = k * sample / n
  r_lo = min(sample, math.ceil(r + 4 * math.sqrt(r) + 8))
  capacity = pl.next_power_of_2(2 * r_lo * stride)
  fits = capacity <= min(n // 4, MAX_CANDIDATES)
  return SamplePlan(stride, r_lo, r_lo // 4, capacity) if fits else None


def strided_sample(scores: jax.Array, plan: SamplePlan, sample: int) -> jax.Array:
  """The sampled method's sample of [..., N] rows: every plan.stride-th score, `sample` of them."""
  return scores[..., :sample * plan.stride:plan.stride]


def count_search(keys: jax.Array, rank, lo, c_lo, hi, slack: int = 0, trials: int = 1):
  """A key bracket around the rank-th largest of uint32 keys [m] held in registers, by counts
  alone (no histogram, no sort). Starts from lo (c_lo = count of keys >= lo, at least rank) and
  hi (no key at or above it); each step counts the keys at or above `trials` keys between them
  and moves each end to the closest trial it beats. Stops when some lo has rank to rank + slack
  keys at or above it (`found`), or when hi = lo + 1 (lo is then a key whose ties straddle the
  window). Returns (lo, hi, c_lo, c_hi, found), c_hi the count at or above hi.

  The guess is the regula falsi point (where the count would reach rank + slack / 2 were the
  keys between lo and hi evenly spread; order keys of nearby floats nearly are) with the
  Illinois rule: an end that has stayed put twice weighs half in the guess, so one-sided
  convergence speeds up. trials = 1 counts at the guess alone; after three steps that all moved
  one end it tries the other end's neighbour (a mass of ties at lo, such as ReLU's zeros, ends
  there at once). trials > 1 (a power of two) counts, in the same reduction over the program's
  threads, at lo + 1 (the ties' exit, every step) and at trials - 1 multiples of the guess
  spread geometrically over a factor of 2 around it (SEARCH_SPREAD).

  Steps of this code on 10 rows of indexer scores (80K keys, k = 2048; run step by step on the
  CPU): the threshold's search over 4096 samples 4.1 on average with one trial, 4.2 with 4, 3.3
  with 8; the select's over its candidates 7.7, 4.7 and 3.9. On an H100 (BENCHMARKS.md run 37)
  the threshold's kernel nonetheless halved at 4 trials (16.6 -> 8.4 us): the gain is in a
  step's cost, not the count of steps, and its cause is not established. The select's search,
  32 candidates a thread, is slower with every trial its compares add.
  """
  target = jnp.asarray(rank, jnp.float32) + slack / 2

  def searching(carry):
    lo, hi, *_, found = carry
    return (hi - lo > 1) & ~found

  def guess(lo, hi, c_lo, c_hi, w_lo, w_hi):  # the regula falsi stride from lo, a float
    above_target = (c_lo.astype(jnp.float32) - target) * w_lo  # > 0 while searching
    below_target = (target - c_hi.astype(jnp.float32)) * w_hi   # > 0: c_hi < rank
    return (hi - lo).astype(jnp.float32) * above_target / (above_target + below_target)

  def inside(lo, hi, stride):  # lo + stride, kept strictly between lo and hi
    stride = jnp.minimum(stride, _LARGEST_BELOW_2_32).astype(jnp.uint32)
    return lo + jnp.clip(stride, 1, hi - lo - 1)

  halve = lambda w, stale: jnp.where(stale, w * 0.5, 1.0)  # Illinois: an end's weight in the guess

  def step(carry):
    lo, hi, c_lo, c_hi, w_lo, w_hi, moves, _ = carry  # moves: > 0 hi moved that often in a row, < 0 lo
    span = hi - lo
    stride = jnp.where(moves >= 3, 1.0, jnp.where(moves <= -3, (span - 1).astype(jnp.float32),
                                                     guess(lo, hi, c_lo, c_hi, w_lo, w_hi)))
    trial = inside(lo, hi, stride)
    count = jnp.sum((keys >= trial).astype(jnp.int32))
    enough = count >= rank
    return (jnp.where(enough, trial, lo), jnp.where(enough, hi, trial), jnp.where(enough, count, c_lo),
            jnp.where(enough, c_hi, count),
            halve(w_lo, ~enough & (moves > 0)), halve(w_hi, enough & (moves < 0)),
            jnp.where(enough, jnp.minimum(moves, 0) - 1, jnp.maximum(moves, 0) + 1),
            enough & (count <= rank + slack))

  def multi_step(carry):
    lo, hi, c_lo, c_hi, w_lo, w_hi, moves, _ = carry  # moves: as step's, for the Illinois rule
    j = jnp.arange(trials, dtype=jnp.int32)
    half = (trials - 2) / 2  # multiples j = 1 .. trials - 1 of the guess: 2^(spread (j - 1 - half) / half)
    spread = SEARCH_SPREAD * (j - 1 - half).astype(jnp.float32) / max(half, 1)
    stride = jnp.where(j == 0, 1.0, guess(lo, hi, c_lo, c_hi, w_lo, w_hi) * jnp.exp2(spread))
    points = inside(lo, hi, stride)  # ascending: counts descend, those >= rank a prefix
    counts = jnp.sum((keys[None, :] >= points[:, None]).astype(jnp.int32), axis=1)
    enough = counts >= rank
    some, all_ = jnp.max(counts) >= rank, jnp.min(counts) >= rank  # (Triton lowers no boolean reductions)
    new_lo = jnp.max(jnp.where(enough, points, lo))
    new_c_lo = jnp.min(jnp.where(enough, counts, c_lo))
    return (new_lo, jnp.min(jnp.where(enough, hi, points)), new_c_lo, jnp.max(jnp.where(enough, c_hi, counts)),
            halve(w_lo, ~some & (moves > 0)), halve(w_hi, all_ & (moves < 0)),
            jnp.where(all_, jnp.minimum(moves, 0) - 1, jnp.where(some, 0, jnp.maximum(moves, 0) + 1)),
            some & (new_c_lo <= rank + slack))

  one = jnp.float32(1.0)
  lo, hi, c_lo, c_hi, *_, found = lax.while_loop(
      searching, step if trials == 1 else multi_step,
      (lo, hi, c_lo, jnp.int32(0), one, one, jnp.int32(0), c_lo <= rank + slack))
  return lo, hi, c_lo, c_hi, found


def _against(key: jax.Array, inside: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
  """(valid keys above the threshold, valid keys equal to it); -inf (key 0) is neither."""
  valid = inside & (key > 0)
  return valid & (key > threshold), valid & (key == threshold)


def _sample_threshold(row_ref, *, sample: int, plan: SamplePlan, trials: int):
  """A key T with r_lo to r_lo + slack of the row's sample keys above it (or, where the ties of
  one sample key straddle that window, that key: its ties are then T's ties)."""
  # row_ref [n] f32 (the whole row: its sample gathered) or [sample] f32 (the sample itself)
  strided = row_ref.shape[0] != sample  # (a row holds at least 8 samples' worth: sample_plan)
  keys = order_key(row_ref[jnp.arange(sample, dtype=jnp.int32) * plan.stride] if strided else row_ref[...])
  lo, _, _, _, found = count_search(keys, plan.r_lo, jnp.min(keys), jnp.int32(sample), jnp.max(keys) + 1,
                                    slack=plan.slack, trials=trials)
  return lo - (found & (lo > 0)).astype(jnp.uint32)  # found: the keys above lo - 1 are those at or above lo


def _sample_threshold_kernel(row_ref, threshold_ref, *, sample: int, plan: SamplePlan, trials: int):
  # row_ref [n] f32 ; threshold_ref [] u32 (the row's)
  threshold_ref[...] = _sample_threshold(row_ref, sample=sample, plan=plan, trials=trials)


def _lane_tile(ref, i, *, start, chunk: int, n: int, lanes: int, width: int, whole_row: bool):
  """Step i of the chunk at row position `start` cut into `lanes` contiguous segments, each read
  `width` scores a step: (positions, in-row mask, scores -inf past the row), each [lanes, width].
  ref holds the chunk (whole_row False) or the whole row."""
  offsets = (jnp.arange(lanes, dtype=jnp.int32)[:, None] * (chunk // lanes) + i * width
             + jnp.arange(width, dtype=jnp.int32)[None, :])
  pos = start + offsets
  inside = pos < n
  return pos, inside, pltriton.load(ref.at[pos if whole_row else offsets], mask=inside, other=-jnp.inf)


def _chunk_counts(ref, threshold, *, start, chunk: int, tile: dict, whole_row: bool):
  """Per segment of the chunk (`_lane_tile`; tile: its n, lanes and width), the numbers of keys
  above the threshold and equal to it: [lanes] each, summed in registers, reduced once."""
  lanes, width = tile["lanes"], tile["width"]

  def body(i, counts):
    _, inside, score = _lane_tile(ref, i, start=start, chunk=chunk, **tile, whole_row=whole_row)
    above, tied = _against(order_key(score), inside, threshold)
    return counts[0] + above.astype(jnp.int32), counts[1] + tied.astype(jnp.int32)

  zeros = jnp.zeros((lanes, width), jnp.int32)
  above, tied = lax.fori_loop(0, chunk // (lanes * width), body, (zeros, zeros))
  return jnp.sum(above, axis=1), jnp.sum(tied, axis=1)


def _compact_chunk(ref, threshold, buffers, slot0, tie0, *, tie_limit, scan_ties, start, chunk: int, tile: dict,
                   whole_row: bool, capacity: int):
  """The chunk's keys above the threshold -> the candidate buffers, from slot0 [lanes] on (one
  offset a segment), and its keys equal to it whose rank among the row's ties, from tie0 [lanes]
  on, is below tie_limit -> the tie buffer; both in index order. Candidates past `capacity` are
  dropped (the select then falls back). The ties' scan runs only where scan_ties (a scalar)."""
  # buffers: cand_ref [capacity] u32 (or None: positions only), cand_pos_ref [capacity] i32, tie_pos_ref [k_pow2] i32
  cand_ref, cand_pos_ref, tie_pos_ref = buffers
  lanes, width = tile["lanes"], tile["width"]

  def body(i, carry):
    slot0, tie0 = carry
    pos, inside, score = _lane_tile(ref, i, start=start, chunk=chunk, **tile, whole_row=whole_row)
    key = order_key(score)
    above, tied = _against(key, inside, threshold)
    above_i, tied_i = above.astype(jnp.int32), tied.astype(jnp.int32)
    slot = slot0[:, None] + _exclusive_cumsum(above_i, axis=1)
    fits = above & (slot < capacity)
    if cand_ref is not None:
      pltriton.store(cand_ref.at[jnp.where(fits, slot, capacity)], key, mask=fits)
    pltriton.store(cand_pos_ref.at[jnp.where(fits, slot, capacity)], pos, mask=fits)

    def store_ties():
      tie_rank = tie0[:, None] + _exclusive_cumsum(tied_i, axis=1)
      first = tied & (tie_rank < tie_limit)
      pltriton.store(tie_pos_ref.at[jnp.where(first, tie_rank, tie_pos_ref.shape[0])], pos, mask=first)
      return tie0 + jnp.sum(tied_i, axis=1)

    # Usually the keys above fill k and no tie is wanted: skip the second scan.
    return slot0 + jnp.sum(above_i, axis=1), lax.cond(scan_ties, store_ties, lambda: tie0)

  lax.fori_loop(0, chunk // (lanes * width), body, (slot0, tie0))


def _sample_count_kernel(chunk_ref, source_ref, threshold_ref, above_ref, tied_ref, *, tile: dict, sample: int,
                         plan: SamplePlan, trials: int, own_threshold: bool):
  """Per segment of this chunk (`_chunk_counts`), the numbers of keys above the row's threshold
  and equal to it; the row's first program also writes the threshold for the later launches.
  own_threshold: the program derives the threshold from the row's sample itself (every program
  of the row the same one), which saves a launch where the row's programs fit on the SMs at once."""
  # chunk_ref [chunk] f32 ; source_ref [n] f32 (the whole row) or [sample] f32 if own_threshold else [] u32 (the
  # row's threshold) ; threshold_ref [] u32 (the row's) ; above_ref, tied_ref [lanes] i32 (this program's)
  threshold = (_sample_threshold(source_ref, sample=sample, plan=plan, trials=trials) if own_threshold
               else source_ref[...])
  s = pl.program_id(1)

  @pl.when(s == 0)
  def _():
    threshold_ref[...] = threshold

  chunk = chunk_ref.shape[0]
  above_ref[...], tied_ref[...] = _chunk_counts(chunk_ref, threshold, start=s * chunk, chunk=chunk, tile=tile,
                                                whole_row=False)


def _compact_kernel(chunk_ref, threshold_ref, above_ref, tied_ref, *outs, k: int, tile: dict, capacity: int,
                    candidate_keys: bool):
  """This chunk's keys above the threshold -> the row's candidate buffer, and its keys equal to
  the threshold that are among the row's first (k - keys above) of them -> the tie buffer
  (`_compact_chunk`). Each segment of the chunk starts at the offset that the counts of the
  segments before it give and scans its own scores: with lanes of one warp's width, the scans
  need no exchange between warps. The row's first program also writes the row's totals, so the
  select starts from scalars, not reductions."""
  # chunk_ref [chunk] f32 ; threshold_ref [] u32 (the row's) ; above_ref, tied_ref [segments] i32
  # (the row's, segment = program * lanes + lane) ; outs: cand_ref [capacity] u32 keys (where
  # candidate_keys), cand_pos_ref [capacity] i32, tie_pos_ref [k_pow2] i32 (the row's),
  # row_above_ref, row_tied_ref [] i32
  cand_ref, (cand_pos_ref, tie_pos_ref, row_above_ref, row_tied_ref) = (
      (outs[0], outs[1:]) if candidate_keys else (None, outs))
  s = pl.program_id(1)
  lanes = tile["lanes"]
  above_counts, tied_counts = above_ref[...], tied_ref[...]
  above_total = jnp.sum(above_counts)
  ties_wanted = k - above_total  # <= 0 when the keys above fill k

  @pl.when(s == 0)
  def _():
    row_above_ref[...] = above_total
    row_tied_ref[...] = jnp.sum(tied_counts)

  def offsets(counts_ref, counts):  # [lanes]: the counts of every segment before each of mine
    earlier = jnp.sum(jnp.where(jnp.arange(counts.shape[0], dtype=jnp.int32) < s * lanes, counts, 0))
    return earlier + _exclusive_cumsum(counts_ref[pl.ds(s * lanes, lanes)])

  chunk = chunk_ref.shape[0]
  _compact_chunk(chunk_ref, threshold_ref[...], (cand_ref, cand_pos_ref, tie_pos_ref),
                 offsets(above_ref, above_counts), offsets(tied_ref, tied_counts), tie_limit=ties_wanted,
                 scan_ties=ties_wanted > 0, start=s * chunk, chunk=chunk, tile=tile, whole_row=False,
                 capacity=capacity)


def _select_candidates(out_ref, candidate_keys, cand_pos_ref, tie_pos_ref, threshold, above, tied, *, k: int,
                       trials: int):
  """The k largest of the row from its buffers, all in registers: `count_search` over the
  candidates (every one above the threshold) for a bound with exactly k keys at or above it,
  or for the k-th key when its ties straddle k (then its first ties by position), then (when
  the candidates number fewer than k) the threshold's first ties, then -1 up to slot k."""
  # candidate_keys(inside) -> u32 [capacity] ; cand_pos_ref [capacity] i32 ; tie_pos_ref [k_pow2] i32 ;
  # out_ref [k] i32
  capacity, k_pow2 = cand_pos_ref.shape[0], tie_pos_ref.shape[0]
  inside = jnp.arange(capacity, dtype=jnp.int32) < above
  keys = jnp.where(inside, candidate_keys(inside), jnp.uint32(0))
  taken = jnp.minimum(above, k)
  lo, hi, _, c_hi, found = count_search(keys, taken, threshold + 1, above, jnp.max(keys) + 1, trials=trials)

  def straddling_ties():  # lo is the k-th key: the keys above it, then its first ties
    at = keys == lo
    return (keys >= hi) | (at & (_exclusive_cumsum(at.astype(jnp.int32)) < taken - c_hi))

  take = lax.cond(found, lambda: keys >= lo, straddling_ties)
  slot = _exclusive_cumsum(take.astype(jnp.int32))
  pltriton.store(out_ref.at[jnp.where(take, slot, k)], cand_pos_ref[...], mask=take)
  j = jnp.arange(k_pow2, dtype=jnp.int32)
  ties = jnp.clip(k - above, 0, tied)
  is_tie = j < ties
  pltriton.store(out_ref.at[jnp.where(is_tie, taken + j, k)], tie_pos_ref[...], mask=is_tie)
  empty = (j >= taken + ties) & (j < k)
  pltriton.store(out_ref.at[jnp.where(empty, j, k)], jnp.full((k_pow2,), -1, jnp.int32), mask=empty)


def _select_row(buffers, row_ref, out_ref, fallback_ref, threshold, above, tied, *, k: int, n: int, block: int,
                trials: int):
  """Top k from the buffers when they hold it: the candidates fit, and they with the threshold's
  ties reach k (or the threshold is 0: every valid key is a candidate). Otherwise (a sample
  more than 4 sigma off, or a row of many equal scores above the k-th) the histogram select
  over the whole row: exact either way. above, tied: the row's totals."""
  # buffers: cand_ref [capacity] u32 (or None) ; cand_pos_ref [capacity] i32 ; tie_pos_ref [k_pow2] i32 ;
  # row_ref [n] f32 ; out_ref [k] i32 ; fallback_ref [] i32
  cand_ref, cand_pos_ref, tie_pos_ref = buffers
  fast = (above <= cand_pos_ref.shape[0]) & ((above + tied >= k) | (threshold == 0))

  def whole_row():
    keys, positions = _block_loader(row_ref, None, n, block)
    _select_into(out_ref, keys, positions, n, jnp.uint32(0), jnp.int32(k), first_digit=0,
                 filled=jnp.int32(0), k=k, block=block)

  def keys(inside):  # the candidates' keys: stored, or gathered from the row by position
    if cand_ref is not None:
      return cand_ref[...]
    return order_key(pltriton.load(row_ref.at[cand_pos_ref[...]], mask=inside, other=-jnp.inf))

  candidates = functools.partial(_select_candidates, out_ref, keys, cand_pos_ref, tie_pos_ref, threshold,
                                 above, tied, k=k, trials=trials)
  lax.cond(fast, candidates, whole_row)
  fallback_ref[...] = 1 - fast.astype(jnp.int32)


def _sampled_select_kernel(*refs, candidate_keys: bool, **select):
  """The select launch: `_select_row` from the compaction's buffers and row totals."""
  # refs: cand_ref [capacity] u32 (where candidate_keys) ; cand_pos_ref [capacity] i32 ; tie_pos_ref
  # [k_pow2] i32 ; row_ref [n] f32 ; threshold_ref [] u32, above_ref, tied_ref [] i32 (the row's) ;
  # out_ref [k] i32 ; fallback_ref [] i32
  cand_ref, (cand_pos_ref, tie_pos_ref, row_ref, threshold_ref, above_ref, tied_ref, out_ref, fallback_ref) = (
      (refs[0], refs[1:]) if candidate_keys else (None, refs))
  _select_row((cand_ref, cand_pos_ref, tie_pos_ref), row_ref, out_ref, fallback_ref, threshold_ref[...],
              above_ref[...], tied_ref[...], **select)


# The one-launch select's row state (int32, zero before the launch): the programs' tickets, their
# finished count, then each split's (keys above, keys tied) + 1, 0 until it publishes them.
_TICKET, _DONE, _PUBLISHED = 0, 1, 2


def _published(state_ref, splits: int) -> jax.Array:
  """The row's published counts [2 * splits] (above of split j at j, tied at splits + j; each + 1,
  0 while unpublished), by volatile loads: L2's values, never a copy cached before they landed.
  (Not atomics: Pallas lowers an atomic add of an int32 vector as a float add, jax 0.11.2.)"""
  return pltriton.load(state_ref.at[pl.ds(_PUBLISHED, 2 * splits)], volatile=True)


def _cta_barrier(interpret: bool) -> None:
  """All of the program's threads here before any goes on (the interpreter runs one thread)."""
  if not interpret:
    pltriton.debug_barrier()


def _one_launch_kernel(row_ref, source_ref, _, *outs, k: int, splits: int, chunk: int, tile: dict, sample: int,
                       plan: SamplePlan, threshold_trials: int, select: dict, candidate_keys: bool, interpret: bool):
  """The sampled method's threshold, count, compaction and select in one launch. A program takes
  the next split of its row by ticket (an atomic counter: every lower ticket's program has
  started, so waiting on them cannot deadlock), derives the threshold from the sample, counts
  its chunk, publishes its counts, waits for the lower splits' (decoupled look-back), and
  compacts its chunk from their sum on; the program that finishes last selects the row's top k.
  Ties are kept up to k (the row's count above is unknown until every split publishes); the
  select takes the first (k - above) of them."""
  # row_ref [n] f32 ; source_ref [sample] or [n] f32 (the threshold's sample, or the row) ; outs: cand_ref
  # [capacity] u32 (where candidate_keys), cand_pos_ref [capacity] i32, tie_pos_ref [k_pow2] i32, out_ref [k]
  # i32, fallback_ref [] i32, state_ref [2 + 2 * splits] i32 (the row's; its input twin goes unread)
  cand_ref, outs = (outs[0], outs[1:]) if candidate_keys else (None, outs)
  cand_pos_ref, tie_pos_ref, out_ref, fallback_ref, state_ref = outs
  buffers = (cand_ref, cand_pos_ref, tie_pos_ref)
  s = pltriton.atomic_add(state_ref, (jnp.int32(_TICKET),), jnp.int32(1))
  threshold = _sample_threshold(source_ref, sample=sample, plan=plan, trials=threshold_trials)
  start = s * chunk
  above, tied = _chunk_counts(row_ref, threshold, start=start, chunk=chunk, tile=tile, whole_row=True)
  own_tied = jnp.sum(tied)
  pltriton.atomic_add(state_ref, (_PUBLISHED + s,), jnp.sum(above) + 1)
  pltriton.atomic_add(state_ref, (_PUBLISHED + splits + s,), own_tied + 1)
  slot = jnp.arange(2 * splits, dtype=jnp.int32)  # of _published's counts
  split, is_above = slot % splits, slot < splits
  earlier = split < s
  counts = lax.while_loop(lambda c: jnp.min(jnp.where(earlier, c, 1)) == 0, lambda c: _published(state_ref, splits),
                          _published(state_ref, splits))
  before = lambda mine: jnp.sum(jnp.where(earlier & mine, counts - 1, 0))
  earlier_above, earlier_tied = before(is_above), before(~is_above)
  _compact_chunk(row_ref, threshold, buffers, earlier_above + _exclusive_cumsum(above),
                 earlier_tied + _exclusive_cumsum(tied), tie_limit=k, scan_ties=(own_tied > 0) & (earlier_tied < k),
                 start=start, chunk=chunk, tile=tile, whole_row=True, capacity=cand_pos_ref.shape[0])
  _cta_barrier(interpret)  # every thread's stores before the release of the count below
  done = pltriton.atomic_add(state_ref, (jnp.int32(_DONE),), jnp.int32(1))

  @pl.when(done == splits - 1)  # the last to finish: every split's buffers are written
  def _():
    totals = _published(state_ref, splits) - 1
    row_total = lambda mine: jnp.sum(jnp.where(mine, totals, 0))
    _select_row(buffers, row_ref, out_ref, fallback_ref, threshold, row_total(is_above), row_total(~is_above),
                **select)


def few_row_splits(rows: int, splits: int) -> int:
  """Up to FEW_ROWS rows, the splits halved until the rows' programs fit on the SMs at once, so
  that they derive the threshold themselves: one launch fewer (5 rows of 81,920: 32 splits and a
  threshold launch 41.7 us, 16 splits without it 41.3, BENCHMARKS.md run 17)."""
  while rows <= FEW_ROWS and rows * splits > SMS and splits > 1:
    splits //= 2
  return splits


def sampled_select(scores: jax.Array, k: int, plan: SamplePlan, *, config: TopKConfig,
                   interpret: bool, sample: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The sampled method on [rows, n] scores: (int32 [rows, k] top-k set as two ascending runs of
  positions, then -1; int32 [rows] 1 where the row fell back to the select over the whole row).
  sample: the rows' `strided_sample` [rows, config.sample], or None to gather it from the rows."""
  rows, n = scores.shape
  block = config.scan_block
  splits = config.num_splits or few_row_splits(rows, row_splits(rows, n, block))
  chunk = split_chunk(n, splits, block)
  k_pow2 = pl.next_power_of_2(k)
  chunk_spec = pl.BlockSpec((None, chunk), lambda r, s: (r, s))
  row_spec = lambda width: pl.BlockSpec((None, width), lambda r, *_: (r, 0))
  per_row = pl.BlockSpec((None,), lambda r, *_: (r,))
  own_threshold = rows * splits <= SMS  # else one program per row derives it first
  few = rows <= FEW_ROWS and plan.capacity <= 8 * 32 * KEYS_PER_THREAD
  select_warps = config.select_warps or (8 if few else 16)
  sampled, sampled_spec = (scores, row_spec(n)) if sample is None else (sample, row_spec(config.sample))
  lanes = config.lanes
  tile = dict(n=n, lanes=lanes, width=block // lanes)
  stored = config.candidate_keys  # the candidates' keys (u32), in a buffer of their own
  buffer_specs = [row_spec(plan.capacity)] * (1 + stored) + [row_spec(k_pow2)]
  buffer_shapes = [*[jax.ShapeDtypeStruct((rows, plan.capacity), jnp.uint32)] * stored,
                   jax.ShapeDtypeStruct((rows, plan.capacity), jnp.int32),
                   jax.ShapeDtypeStruct((rows, k_pow2), jnp.int32)]
  result_specs = [row_spec(k), per_row]
  result_shapes = [jax.ShapeDtypeStruct((rows, k), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32)]
  select = dict(k=k, n=n, block=config.block, trials=config.select_trials)
  if config.one_launch:
    state = jnp.zeros((rows, _PUBLISHED + 2 * splits), jnp.int32)
    state_spec = row_spec(_PUBLISHED + 2 * splits)
    return pl.pallas_call(
        functools.partial(_one_launch_kernel, k=k, splits=splits, chunk=chunk, tile=tile, sample=config.sample,
                          plan=plan, threshold_trials=config.threshold_trials, select=select, candidate_keys=stored,
                          interpret=interpret),
        grid=(rows, splits),
        in_specs=[row_spec(n), sampled_spec, state_spec],
        out_specs=[*buffer_specs, *result_specs, state_spec],
        out_shape=[*buffer_shapes, *result_shapes, jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={2: len(buffer_shapes) + 2},
        compiler_params=_params(config, select_warps),
        interpret=interpret,
        name="topk_one_launch",
    )(scores, sampled, state)[-3:-1]
  if own_threshold:
    source, source_spec = sampled, sampled_spec
  else:
    source, source_spec = pl.pallas_call(
        functools.partial(_sample_threshold_kernel, sample=config.sample, plan=plan, trials=config.threshold_trials),
        grid=(rows,),
        in_specs=[sampled_spec],
        out_specs=per_row,
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.uint32),
        compiler_params=_params(config, select_warps),
        interpret=interpret,
        name="topk_sample_threshold",
    )(sampled), per_row
  segments = splits * lanes  # of a row: a program's lanes, program by program
  per_program = pl.BlockSpec((None, lanes), lambda r, s: (r, s))
  threshold, above, tied = pl.pallas_call(
      functools.partial(_sample_count_kernel, tile=tile, sample=config.sample, plan=plan,
                        trials=config.threshold_trials, own_threshold=own_threshold),
      grid=(rows, splits),
      in_specs=[chunk_spec, source_spec],
      out_specs=[per_row, per_program, per_program],
      out_shape=[jax.ShapeDtypeStruct((rows,), jnp.uint32),
                 *[jax.ShapeDtypeStruct((rows, segments), jnp.int32)] * 2],
      compiler_params=_params(config, select_warps if own_threshold else None),
      interpret=interpret,
      name="topk_sample_count",
  )(scores, source)
  buffers = pl.pallas_call(
      functools.partial(_compact_kernel, tile=tile, k=k, capacity=plan.capacity, candidate_keys=stored),
      grid=(rows, splits),
      in_specs=[chunk_spec, per_row, row_spec(segments), row_spec(segments)],
      out_specs=[*buffer_specs, per_row, per_row],
      out_shape=[*buffer_shapes, *[jax.ShapeDtypeStruct((rows,), jnp.int32)] * 2],
      compiler_params=_params(config),
      interpret=interpret,
      name="topk_compact",
  )(scores, threshold, above, tied)
  return pl.pallas_call(
      functools.partial(_sampled_select_kernel, candidate_keys=stored, **select),
      grid=(rows,),
      in_specs=[*buffer_specs, row_spec(n), *[per_row] * 3],
      out_specs=result_specs,
      out_shape=result_shapes,
      compiler_params=_params(config, select_warps),
      interpret=interpret,
      name="topk_sampled_select",
  )(*buffers[:-2], scores, threshold, *buffers[-2:])


def check_topk_args(n: int, k: int) -> None:
  """ValueError unless 1 <= k <= n < 2^24 (the fp32 histogram counts stay exact)."""
  if n >= 1 << 24:
    raise ValueError(f"top-k supports rows of fewer than 2^24 scores, got {n}")
  if not 1 <= k <= n:
    raise ValueError(f"top-k needs 1 <= k <= number of scores ({n}), got k={k}")


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def topk_indices(scores: jax.Array, k: int, *, config: TopKConfig | None = None,
                 interpret: bool | None = None, sample: jax.Array | None = None) -> jax.Array:
  """Indices of the k largest scores of each row (ties: lower index first).

  Args:
    scores: float32 [..., N]; -inf marks invalid entries (never selected). No NaNs.
    k: 1 <= k <= N.
    config: tuning; None for the defaults.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
    sample: the rows' `strided_sample` [..., config.sample] (the sampled method then reads it
      rather than gathering it from the rows; ignored by the radix select), or None.
  Returns:
    int32 [..., k]: the exact top-k set of each row (two ascending runs: module docstring),
    then -1 for slots beyond the row's valid entries.
  """
  config = config or TopKConfig()
  interpret = resolve_interpret(interpret)
  if scores.ndim < 1 or scores.dtype != jnp.float32:
    raise ValueError(f"scores must be float32 [..., N], got {scores.dtype}{list(scores.shape)}")
  n = scores.shape[-1]
  check_topk_args(n, k)
  lead = scores.shape[:-1]
  rows = int(np.prod(lead))
  x = scores.reshape(rows, n)
  splits = config.num_splits or row_splits(rows, n, config.block)
  chunk = split_chunk(n, splits, config.block)
  plan = sample_plan(n, k, config.sample) if config.method == "sampled" else None
  if plan is not None:
    if sample is not None and (sample.shape != (*lead, config.sample) or sample.dtype != jnp.float32):
      raise ValueError(f"sample must be float32 {[*lead, config.sample]} (the rows' strided sample), got "
                       f"{sample.dtype}{list(sample.shape)}")
    sample = None if sample is None else sample.reshape(rows, config.sample)
    return sampled_select(x, k, plan, config=config, interpret=interpret, sample=sample)[0].reshape(*lead, k)
  tot = jnp.zeros((PREFIX_DIGITS, rows, BINS), jnp.float32)
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
