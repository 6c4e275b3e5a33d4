"""DSA indexer scores over a paged key cache.

score[b, t, s] = sum_h relu(q[b, t, h] . k[b, s] * Di^-0.5) * w[b, t, h] for s <= q_positions[b, t],
-inf otherwise (and for every position past the cache). One key head serves all H query heads
and all T query tokens, so each program gathers a tile of keys once and scores it against
T x H queries on the tensor cores; the kernel reads each cached key once (memory bound: GLM-5's
80K-token context is 21 MB of bf16 keys, 10.8 MB of FP8).

Numerics: products are exact in bf16 x bf16 (and in bf16 x e4m3 codes, whose per-token
power-of-two scale is applied after the dot, exactly); sums are fp32. An fp32 q is split into
three bf16 parts (`checks.bf16_parts`: 24 mantissa bits) because a plain fp32 Triton dot would
round it to tf32. The head weights stay fp32: bf16 rounding flips near-tied selections. So the
scores equal the jnp path's (fp32 HIGHEST einsums) up to the order of the fp32 sums: a selection
differs from `--attention=sparse` only where two keys straddling the k-th score are within that
rounding (about 1e-7 relative), as they would between any two fp32 implementations.

Lowering: Triton. Keys arrive through the page table, one row per token: a pointer-tensor gather
that Triton vectorises along the contiguous Di axis and pipelines (num_stages). Mosaic GPU moves
tiles with TMA, which on Hopper copies boxes, not gathers: one copy per page, a tile tied to the
page size; and the fused top-k histogram needs Triton's per-element ops anyway (see topk.py).

Einsum letters: b batch, t query token, h head, d head dim (Di), s key position.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax import dsa
from glmjax.cache.paged import gather_pages
from pallas_kernels import topk
from pallas_kernels.checks import (bf16_parts, check_choice, check_launch, check_page_table, check_paged, check_splits,
                                   check_tile, is_pow2, parts_dot, resolve_interpret)

# Query tokens per program (the kernel unrolls them); more tokens (prefill) form more groups.
QUERY_GROUP = 8
# Programs per sequence of the scores alone. The time of a decode step's scores follows the key
# blocks each program walks and the warps on each SM (BENCHMARKS.md run 26, 80K FP8 keys, 5
# tokens: 4-warp programs of 64-key blocks, 256 of them walking 5 blocks each, 19.9 us; 128
# programs of 8 warps over 128-key blocks, 22.8; 64 programs, 48-57). Fused with the radix
# select's first pass (indexer_topk), the top-k's topk.MAX_SPLITS bounds them.
MAX_SPLITS = 1024
TARGET_PROGRAMS = 256  # the default splits' aim: about two 4-warp programs per SM
_MIN_MMA = 16  # smallest M/N/K of a Triton tensor-core dot
ORIENTATIONS = ("heads", "keys")  # IndexerScoresConfig.orientation
MAX_PREFETCH = 16  # key blocks a program may load ahead (IndexerScoresConfig.prefetch)


@dataclasses.dataclass(frozen=True)
class IndexerScoresConfig:
  """Tuning of the scores kernel.

  block_k: keys per loop step (power of two >= 16).
  num_splits: programs per sequence (power of two <= MAX_SPLITS; <= topk.MAX_SPLITS fused with
    the top-k's first pass); None picks about TARGET_PROGRAMS in all, a key block at least each
    (fused: about two per SM, at most topk.MAX_SPLITS).
  num_warps / num_stages: Triton launch parameters (stages pipeline the key gathers; the warps
    keep T x H x Di bf16 queries, 40 KB at T=5, in registers across the key loop). The defaults
    (64-key blocks, 4 warps, TARGET_PROGRAMS) beat run 17's (128, 8, at most 128 programs) at
    every context and key type timed in run 26: 80K FP8 keys 19.9 against 22.8 us for 5 tokens,
    8.6 against 10.2 for 1; 128K 30.0 against 35.9; 32K 10.2 against 10.7; 8K 4.1 against 5.0;
    80K bf16 keys 14.6 against 16.0. One stage, not two (run 36, H100, keys cold in L2 as in the
    step: 20.7 against 24.3 us at 80K FP8 keys, 5 tokens; 2 and 3 stages slower at every block
    size and split count timed; run 34's hot-L2 sweep, whose "default" was in fact 1 stage, agreed).
  orientation: which operand is the MMA's rows. "heads": logits [H, block_k] per query token,
    the head sum a reduction over rows, which the program's warps share (through shared
    memory, once per token and block). "keys" (default): logits [block_k, H], the keys as
    rows, so each warp owns whole rows and sums its heads in registers and a few lane
    shuffles; the key tile is the shared left operand of every token's dot. Measured
    (BENCHMARKS.md run 17, 80K keys, 5 tokens, bf16 queries, run 17's default tiles): 16.2 us
    against 18.5 over bf16 keys, 23.0 against 29.5 over FP8 keys.
  prefetch: a program issues the loads of all its key blocks (at most MAX_PREFETCH; longer
    chunks keep the loop) before its first dot, so it waits for memory once, not once a block
    (at one stage, the default, Triton does not pipeline the loop's gathers). Off: on an H100
    (BENCHMARKS.md run 38, 80K FP8 keys, cold L2) it is slower for 5 query tokens (26.1 against
    18.9 us; 128 programs 69.6, 32-key blocks 345, 8 warps 40.2; in the rank's step 24.6 against
    18.6 a layer), faster for 1 (10.4 against 11.5).
  """
  block_k: int = 64
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 1
  orientation: str = "keys"
  prefetch: bool = False

  def __post_init__(self):
    check_tile("IndexerScoresConfig", "block_k", self.block_k, _MIN_MMA)
    check_splits("IndexerScoresConfig", self.num_splits, MAX_SPLITS)
    check_launch("IndexerScoresConfig", self.num_warps, self.num_stages)
    check_choice("IndexerScoresConfig", "orientation", self.orientation, ORIENTATIONS)


def _scores_kernel(q_ref, w_ref, pos_ref, pt_ref, k_ref, *refs, num_t: int, heads: int, n: int, chunk: int,
                   block_k: int, page_size: int, fp8: bool, histogram: bool, keys_major: bool,
                   sample_stride: int, prefetch: bool):
  """Scores of one sequence's key chunk for a group of Tg query tokens (+ the top-k's strided
  sample of them, + digit-0 histograms)."""
  # q_ref [Tg, Hp, Di] bf16|f32 ; w_ref [Tg, Hp] f32: blocks of H heads, those past H read as 0
  # pos_ref [Tg] i32 ; pt_ref [max_pages] i32
  # k_ref [P, page_size, Di] bf16|e4m3 ; scale_ref [P, page_size, 1] f32 (FP8 only)
  # o_ref [Tg, chunk] f32 ; sample_ref [Tg, sample] f32 (the whole group's rows; sample_stride
  # only) ; ge_ref [Tg, 256] f32 ; tot_ref [2, Tg, 256] f32 (histogram only; its input twin is
  # the same buffer and goes unread)
  refs = list(refs)
  scale_ref = refs.pop(0) if fp8 else None
  if histogram:
    refs.pop(0)
  o_ref = refs.pop(0)
  sample_ref = refs.pop(0) if sample_stride else None
  hist_refs = refs
  max_pages = pt_ref.shape[0]
  head_dim = k_ref.shape[-1]
  start = pl.program_id(2) * chunk
  hp = q_ref.shape[1]
  heads_ok = jnp.arange(hp) < heads
  masked = lambda view, ok: view[...] if heads == hp else pltriton.load(view, mask=ok, other=0.0)
  queries = [query_terms(masked(q_ref.at[jnp.int32(t)], heads_ok[:, None]), fp8) for t in range(num_t)]
  head_axis = 1 if keys_major else 0  # logits [bk, Hp] or [Hp, bk]
  weights = [jnp.expand_dims(masked(w_ref.at[jnp.int32(t)], heads_ok), 1 - head_axis) for t in range(num_t)]
  positions = [pos_ref[t] for t in range(num_t)]
  dims = jnp.arange(head_dim, dtype=jnp.int32)

  def load(i):  # key block i of the chunk: positions, codes [bk, Di] as stored, scales [bk] (FP8)
    tok = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)
    page = pt_ref[jnp.minimum(tok // page_size, max_pages - 1)]
    slot = tok % page_size
    codes = k_ref[page[:, None], slot[:, None], dims[None, :]]
    return tok, codes, scale_ref[page, slot, jnp.zeros_like(slot)] if fp8 else None

  def body(i, hists, block):
    tok, codes, stored_scale = block
    inside = tok < n
    keys = codes.astype(queries[0][0].dtype)  # [bk, Di] in the query terms' dtype: e4m3 x e4m3, or bf16
    scale = head_dim ** -0.5
    if fp8:
      scale = stored_scale * scale  # [bk] power of two * Di^-0.5
    new_hists = []
    key_scale = jnp.expand_dims(scale, head_axis) if fp8 else scale  # broadcast over the heads
    for t in range(num_t):
      logits = parts_dot(queries[t], keys, (((1,), (1,)), ((), ())), parts_on_right=keys_major)
      score = jnp.sum(jnp.maximum(logits * key_scale, 0.0) * weights[t], axis=head_axis)
      score = jnp.where(inside & (tok <= positions[t]), score, -jnp.inf)
      pltriton.store(o_ref.at[jnp.int32(t), pl.ds(i * block_k, block_k)], score, mask=inside)
      if sample_ref is not None:  # every sample_stride-th score, to its slot of the row's sample
        sampled = inside & (tok % sample_stride == 0) & (tok // sample_stride < sample_ref.shape[1])
        slot = jnp.where(sampled, tok // sample_stride, sample_ref.shape[1])  # masked lanes: past the row
        pltriton.store(sample_ref.at[jnp.full_like(slot, t), slot], score, mask=sampled)
      if histogram:
        new_hists.append(hists[t] + topk.block_histogram(
            topk.order_key(score) >> (32 - topk.DIGIT_BITS), inside))
    return tuple(new_hists)

  init = tuple(topk.empty_histogram() for _ in range(num_t)) if histogram else ()
  blocks = chunk // block_k
  if prefetch and blocks <= MAX_PREFETCH:  # every block's loads in flight before the first dot
    loaded = [load(i) for i in range(blocks)]
    hists = functools.reduce(lambda h, i: body(i, h, loaded[i]), range(blocks), init)
  else:
    hists = lax.fori_loop(0, blocks, lambda i, h: body(i, h, load(i)), init)
  if histogram:
    ge_ref, tot_ref = hist_refs
    for t in range(num_t):
      topk.publish_histogram(hists[t], ge_ref, (t,), tot_ref, (0, t))


def query_terms(q: jax.Array, fp8_keys: bool) -> list[jax.Array]:
  """The query operand of the scores dot as terms that sum to it exactly: e4m3 codes as they are
  against e4m3 keys (the tensor cores' FP8 MMA), else as bf16 (exact); else `bf16_parts`."""
  if q.dtype == jnp.float8_e4m3fn:
    return [q if fp8_keys else q.astype(jnp.bfloat16)]
  return bf16_parts(q)


def check_indexer_args(q, weights, index_k, index_scale, page_table, q_positions,
                       num_keys: int) -> None:
  """ValueError unless the arguments form a valid indexer call (shared with the reference)."""
  if q.ndim != 4 or q.dtype not in (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn):
    raise ValueError(f"q must be bf16/f32/float8_e4m3fn [B, T, H, Di], got {q.dtype}{list(q.shape)}")
  b, t, h, di = q.shape
  if weights.shape != (b, t, h) or weights.dtype != jnp.float32:
    raise ValueError(f"weights must be f32 {[b, t, h]}, got {weights.dtype}{list(weights.shape)}")
  check_paged("index_k", index_k, "index_scale", index_scale, di, 1)
  check_page_table(page_table, b)
  if q_positions.shape != (b, t) or q_positions.dtype != jnp.int32:
    raise ValueError(f"q_positions must be int32 {[b, t]}, got "
                     f"{q_positions.dtype}{list(q_positions.shape)}")
  if num_keys != page_table.shape[1] * index_k.shape[1]:
    raise ValueError(f"num_keys must be max_pages * page_size = "
                     f"{page_table.shape[1] * index_k.shape[1]}, got {num_keys}")


def pad_queries(q: jax.Array, weights: jax.Array, q_positions: jax.Array):
  """Pads query tokens to whole groups of QUERY_GROUP (position -1: scores -inf); a decode
  step's few tokens form one group and need none. Returns (q, w, pos). (Heads need no padding
  to the MMA's 16 rows: the kernel reads heads past H as zero queries of zero weight.)"""
  t = q.shape[1]
  tp = t if t <= QUERY_GROUP else pl.cdiv(t, QUERY_GROUP) * QUERY_GROUP
  if tp != t:
    q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    weights = jnp.pad(weights, ((0, 0), (0, tp - t), (0, 0)))
    q_positions = jnp.pad(q_positions, ((0, 0), (0, tp - t)), constant_values=-1)
  return q, weights, q_positions


def scores_call(q, weights, index_k, index_scale, page_table, q_positions, *, num_keys: int,
                splits: int, chunk: int, block_k: int, config: IndexerScoresConfig,
                interpret: bool, tot: jax.Array | None = None, sample: tuple[int, int] | None = None):
  """The scores pallas_call on `pad_queries` output; with `tot` also digit-0 top-k histograms;
  with `sample` = (stride, count) also every stride-th score, count of them a row (the sampled
  top-k's sample: topk.strided_sample).

  Returns [scores [B, Tp, N] f32, then the sample [B, Tp, count] f32 with `sample`, then ge0
  [B, Tp, splits, 256] and tot with `tot`]; scores alone when neither is given.
  """
  b, tp, h, di = q.shape
  hp = max(_MIN_MMA, pl.next_power_of_2(h))  # the MMA's rows: heads past h are masked reads
  if di < _MIN_MMA or not is_pow2(di):
    raise ValueError(f"the kernel needs a power-of-two head dim >= 16, got {di}")
  tg = min(tp, QUERY_GROUP)
  fp8 = index_scale is not None
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, g, j: (0,) * x.ndim)
  in_specs = [pl.BlockSpec((None, tg, hp, di), lambda i, g, j: (i, g, 0, 0)),
              pl.BlockSpec((None, tg, hp), lambda i, g, j: (i, g, 0)),
              pl.BlockSpec((None, tg), lambda i, g, j: (i, g)),
              pl.BlockSpec((None, page_table.shape[1]), lambda i, g, j: (i, 0)),
              whole(index_k)]
  args = [q, weights, q_positions, page_table, index_k]
  if fp8:
    in_specs.append(whole(index_scale))
    args.append(index_scale)
  out_specs = [pl.BlockSpec((None, tg, chunk), lambda i, g, j: (i, g, j))]
  out_shape = [jax.ShapeDtypeStruct((b, tp, num_keys), jnp.float32)]
  if sample is not None:  # every split writes its own slots of its group's sample rows
    out_specs.append(pl.BlockSpec((None, tg, sample[1]), lambda i, g, j: (i, g, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, tp, sample[1]), jnp.float32))
  aliases = {}
  if tot is not None:
    tot_spec = pl.BlockSpec((topk.PREFIX_DIGITS, None, tg, topk.BINS), lambda i, g, j: (0, i, g, 0))
    in_specs.append(tot_spec)
    args.append(tot)
    aliases = {len(args) - 1: len(out_shape) + 1}
    out_specs += [pl.BlockSpec((None, tg, None, topk.BINS), lambda i, g, j: (i, g, j, 0)),
                  tot_spec]
    out_shape += [jax.ShapeDtypeStruct((b, tp, splits, topk.BINS), jnp.float32),
                  jax.ShapeDtypeStruct(tot.shape, jnp.float32)]
  kernel = functools.partial(_scores_kernel, num_t=tg, heads=h, n=num_keys, chunk=chunk, block_k=block_k,
                             page_size=index_k.shape[1], fp8=fp8, histogram=tot is not None,
                             keys_major=config.orientation == "keys", sample_stride=sample[0] if sample else 0,
                             prefetch=config.prefetch)
  out = pl.pallas_call(
      kernel,
      grid=(b, tp // tg, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="indexer_scores",
  )(*args)
  return out if len(out) > 1 else out[0]


@functools.partial(jax.jit, static_argnames=("num_keys", "config", "interpret", "sample"))
def indexer_scores(q: jax.Array, weights: jax.Array, index_k: jax.Array,
                   index_scale: jax.Array | None, page_table: jax.Array, q_positions: jax.Array,
                   *, num_keys: int, config: IndexerScoresConfig | None = None,
                   interpret: bool | None = None, sample: tuple[int, int] | None = None):
  """DSA indexer scores of T query tokens per sequence against its paged key cache.

  Args:
    q: [B, T, H, Di] bf16 or f32, roped indexer queries (Di a power of two >= 16), or their
      float8_e4m3fn codes, whose per-(token, head) scales the caller has folded into `weights`
      (relu(c * x) = c * relu(x) for c > 0): against FP8 keys the dot is then FP8 x FP8.
    weights: [B, T, H] f32 head weights (weights_proj(x) * H^-0.5).
    index_k: [P, page_size, Di] bf16 or float8_e4m3fn key pages (page 0: null page).
    index_scale: [P, page_size, 1] f32 power-of-two scales for FP8 keys, else None.
    page_table: [B, max_pages] int32 physical page of each logical page.
    q_positions: [B, T] int32 absolute position of each query token.
    num_keys: max_pages * page_size.
    config: tuning; None for the defaults.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
    sample: (stride, count): also return every stride-th score of each row, count of them
      (stride * count <= num_keys), written by the same launch: the sampled top-k's sample.
  Returns:
    [B, T, num_keys] f32 scores, -inf where s > q_positions[b, t]; with `sample`, (scores,
    sample [B, T, count] f32).
  """
  check_indexer_args(q, weights, index_k, index_scale, page_table, q_positions, num_keys)
  config = config or IndexerScoresConfig()
  interpret = resolve_interpret(interpret)
  t = q.shape[1]
  q, weights, q_positions = pad_queries(q, weights, q_positions)
  groups = q.shape[0] * pl.cdiv(q.shape[1], QUERY_GROUP)
  splits = config.num_splits or topk.row_splits(groups, num_keys, config.block_k, TARGET_PROGRAMS, MAX_SPLITS)
  chunk = topk.split_chunk(num_keys, splits, config.block_k)
  if sample is not None and (min(sample) < 1 or sample[0] * sample[1] > num_keys):
    raise ValueError(f"sample must be (stride, count) with 1 <= stride * count <= num_keys ({num_keys}), got {sample}")
  out = scores_call(q, weights, index_k, index_scale, page_table, q_positions,
                    num_keys=num_keys, splits=splits, chunk=chunk, block_k=config.block_k,
                    config=config, interpret=interpret, sample=sample)
  return out[:, :t] if sample is None else tuple(x[:, :t] for x in out)


@functools.partial(jax.jit, static_argnames=("num_keys",))
def indexer_scores_reference(q: jax.Array, weights: jax.Array, index_k: jax.Array,
                             index_scale: jax.Array | None, page_table: jax.Array,
                             q_positions: jax.Array, *, num_keys: int) -> jax.Array:
  """Plain-jnp indexer scores (gather + fp32 einsum): same arguments and result as the kernel."""
  check_indexer_args(q, weights, index_k, index_scale, page_table, q_positions, num_keys)
  keys = gather_pages(index_k, index_scale, page_table)  # [B, N, Di] fp32
  return dsa.index_scores(q, weights, keys, dsa.causal_valid(q_positions, num_keys))
