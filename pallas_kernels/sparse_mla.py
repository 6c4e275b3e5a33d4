"""Sparse MLA decode attention over selected tokens of a paged latent cache (weight absorption).

For each query (b, t, h): logits_j = (q_latent . latent[j] + q_rope . k_rope[j]) * softmax_scale
over the selected tokens j = indices[b, t, :] (-1: empty slot), softmax in fp32, output
sum_j p_j * latent[j] (the values are the latent itself; the engine applies kv_b_proj's value
half and o_proj afterwards).

Layout of the work: one program per (query token, split of its selection, sequence). It gathers
each selected token's 512 + 64 values once and uses them for all H heads (the "one KV head"
of MLA), with a flash-decoding online softmax over its split; a small XLA reduction then merges
the splits' (max, sum, acc). Splitting the selection fills the GPU at batch 1 (5 query tokens x
32 splits = 160 programs for k=2048). The query token is the fastest grid axis, so the programs
of a step's T query tokens run together: where their selections coincide (the dense short-context
case, or heavily overlapping top-k sets, which topk.py lists largely in index order), HBM serves
a row once and L2 the rest.
(One program per query token rather than one per step: T [16, 512] fp32 accumulators would not
fit in one program's registers.)

FP8 latents attend in their 128-wide scale groups: each group's dots take its e4m3 codes times
one scale per token row, so no [bn, G] -> [bn, R] scale broadcast is built (32 against 37 us for
fp32 queries at 80K, T=5, BENCHMARKS.md run 10). Under bf16 queries the codes enter both dots
as they are (e4m3 -> bf16 is exact) and the scales, powers of two, multiply the dots' columns
instead (the logits', and the softmax weights' before the value dot): no scaled fp32 copy of
each [bn, 128] tile, so a program's 64 rows fit one 64-row block (SparseMLAConfig.resolved: 13.0
against 15.1 us at a rank's case, BENCHMARKS.md run 43). Under fp32 queries each group's
weights are three bf16 terms, which the columns' scales would multiply per group: there the
rows are scaled (19.5 against 25.3 us).

Numerics follow the queries' dtype. The cached rows are exact in bf16 (bf16 pages, or e4m3
codes times a power-of-two scale per 128 values, dequantised in-kernel), so every dot has an
exact bf16 right-hand side and only the left one can lose bits:
- fp32 queries (the engine's): q and the softmax weights p enter the MMAs as three bf16 terms
  each (`checks.bf16_parts`), so q.k and p.v are fp32 dots up to summation order, as the jnp
  path's HIGHEST-precision einsums; greedy decoding then picks the tokens `--attention=sparse`
  picks. A plain fp32 Triton dot would not do: at default precision it rounds to tf32 (10
  bits), and IEEE fp32 runs on the CUDA cores. The cost is 3x the MMAs of bf16: at Hp = 16
  rows, (512 + 64 + 512) x 3 MACs per row and token is about 160 flops per byte of FP8 row
  (90 for bf16 rows), near or past the ridge of Hopper's mma.sync (about 100), so the kernel
  may turn compute bound where bf16 is memory bound (estimate; bench_dsa measures it).
- bf16 queries: one bf16 MMA per dot and p rounded to bf16, as in FlashMLA: the faster choice
  where matching the jnp path's tokens matters less than speed.
Softmax statistics are fp32 either way. On the GPU the tensor cores' fp32 accumulation rounds
differently from the CPU's fp32 adds (and the splits merge in another order than one softmax),
so the kernel matches the reference to fp32 rounding, not bit for bit.

Lowering: Triton. Each tile is a pointer-tensor gather of block_n scattered token rows through
the page table, vectorised along the contiguous latent row and pipelined (num_stages), feeding
M = 16 dots. Mosaic GPU's path is TMA + wgmma: Hopper's TMA copies boxes rather than gathering
rows (one copy per 1 KB row), and wgmma wants M >= 64 per warpgroup where H is 8 per rank.

Einsum letters: b batch, t query token, h head, k selected slot, r latent (R), d rope (dr).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.cache.kv_fp8 import dequantize_fp8, fp8_block_size
from glmjax.cache.paged import token_slots
from pallas_kernels.checks import (bf16_parts, check_at_least, check_choice, check_launch, check_page_table,
                                   check_paged, check_tile, is_pow2, parts_dot, resolve_interpret)
from pallas_kernels.l2_prefetch import prefetch_share

_MIN_MMA = 16  # smallest M/N/K of a Triton tensor-core dot
_TARGET_PROGRAMS = 2 * 132  # two programs per H200 SM
COMBINES = ("xla", "pallas")
# Where the FP8 latent scales go (Runtime.attention_scales) -> SparseMLAConfig.scale_rows.
SCALE_PLACES = {"auto": None, "rows": True, "columns": False}
_COMBINE_BLOCK = 64  # latent columns per program of the Pallas combine
_MERGE_BLOCK_V, _MERGE_BLOCK_R = 64, 128  # value columns per program, latent columns per step of the merge


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig:
  """Tuning of the sparse MLA kernel.

  block_n: selected tokens per loop step (power of two >= 16).
  num_splits: programs per query token; None picks about two programs per SM.
  num_warps / num_stages: Triton launch parameters (stages pipeline the row gathers). 4 warps
    (8 until run 26): with fp32 queries a program holds q as three bf16 terms (48 KB at Hp=16,
    R=512) next to its [Hp, R] fp32 accumulator and a [block_n, R] row tile, yet 4 warps beat 8
    at every case timed (BENCHMARKS.md run 26, FP8 pages, the merge with the value product):
    80K, 5 tokens, bf16 queries 17.4 against 24.3 us (8K and 128K alike), fp32 queries 22.4
    against 37.2; one token 12.4 against 12.2 (bf16), 23.8 against 27.0 (fp32).
  combine: how the splits' partial softmax states merge: "xla" (jnp reductions, which XLA runs
    as two fusions: 3.2 us at 80K, T=5, run 10) or "pallas" (one launch, `_combine_kernel`:
    14 us there, its 40 programs each walking every split; kept as the ablation's other arm).
  scale_rows: FP8 latents only: multiply each row group by its scale before the dots (True: a
    scaled bf16 copy of the rows, which both dots then read) or the dots' columns after them
    (False). The scales are powers of two, so both compute the same products; the sums may round
    apart (on an H100: equal bits under fp32 queries, within bf16 rounding under bf16 ones, run
    43). None: the columns under bf16 queries, the rows under fp32 ones (`resolved`).
  block_n None: 64 where the scales go on the columns under bf16 queries, else 32 (`resolved`).
  num_stages None: 3 where FP8 rows are scaled, else 2 (`resolved`).
  """
  block_n: int | None = None
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int | None = None
  combine: str = "xla"
  scale_rows: bool | None = None

  def __post_init__(self):
    if self.block_n is not None:
      check_tile("SparseMLAConfig", "block_n", self.block_n, _MIN_MMA)
    if self.num_splits is not None:
      check_at_least("SparseMLAConfig", "num_splits", self.num_splits)
    check_launch("SparseMLAConfig", self.num_warps, 1 if self.num_stages is None else self.num_stages)
    check_choice("SparseMLAConfig", "combine", self.combine, COMBINES)

  def resolved(self, exact: bool, fp8: bool) -> "SparseMLAConfig":
    """This config with block_n, scale_rows and num_stages chosen for a call (fp32 queries:
    `exact`; FP8 latents: `fp8`). Measured at a TEP=8 rank's case (80K, 5 tokens, k = 2048, FP8
    latents; own us of the attention launch, BENCHMARKS.md run 43, H100s): bf16 queries, the
    columns in 64-row blocks 13.0 against the rows' 15.1 in 32-row blocks at 2 stages and 13.9
    at 3 (the rows in 64: 20.1; the columns in 32: 15.8, in 128: 190; 2 or 8 warps: 33.6, 16.7);
    fp32 queries, the rows in 32-row blocks at 3 stages 18.6, at 2 19.8, against the columns'
    25.3 (64-row blocks spill: 352-553). bf16 pages keep the earlier defaults, 32-row blocks at
    2 stages (not measured in run 43)."""
    columns = fp8 and (not exact if self.scale_rows is None else not self.scale_rows)
    rows = fp8 and not columns
    return dataclasses.replace(self, block_n=self.block_n or (64 if columns and not exact else 32), scale_rows=rows,
                               num_stages=self.num_stages or (3 if rows else 2))


def _first_rows(x: jax.Array, rows: int) -> jax.Array:
  """x[:rows] for a power-of-two ratio (Triton has split, not slice)."""
  return x if x.shape[0] == rows else jnp.split(x, x.shape[0] // rows, axis=0)[0]


def _sparse_mla_kernel(ql_ref, qr_ref, pt_ref, idx_ref, lat_ref, *refs, k: int, chunk: int,
                       block_n: int, page_size: int, softmax_scale: float, fp8: bool, heads: int,
                       heads_out: int, scale_rows: bool, warm: int, grid: tuple[int, int, int], num_warps: int):
  """Partial attention of one query token over one split of its selected tokens (first, its
  share of the `warm` arrays into L2)."""
  # ql_ref [Hp, R] bf16|f32 ; qr_ref [Hp, dr] bf16|f32: blocks of [H, ...] queries, rows past
  # H masked to zero (no padded copy of the queries in HBM)
  # pt_ref [max_pages] i32 ; idx_ref [k] i32
  # lat_ref [P, page_size, R] bf16|e4m3 ; scale_ref [P, page_size, R // blk] f32 (FP8 only)
  # rope_ref [P, page_size, dr] bf16 ; warm refs (whole arrays) ; acc_ref [Hs, R] f32 ; m_ref, l_ref [Hs] f32
  scale_ref, refs = (refs[0], refs[1:]) if fp8 else (None, refs)
  rope_ref, warm_refs, (acc_ref, m_ref, l_ref) = refs[0], refs[1:1 + warm], refs[1 + warm:]
  program = (pl.program_id(2) * grid[1] + pl.program_id(1)) * grid[0] + pl.program_id(0)
  for ref in warm_refs:
    prefetch_share(ref, program=program, programs=grid[0] * grid[1] * grid[2], num_warps=num_warps)
  max_pages = pt_ref.shape[0]
  hp, rank = ql_ref.shape
  rope_dim = qr_ref.shape[1]
  start = pl.program_id(1) * chunk
  exact = ql_ref.dtype == jnp.float32  # fp32 queries: fp32-faithful dots (module docstring)
  # The latent in column groups (FP8: one per scale, so a group's scale is one per token row and
  # no [bn, G] -> [bn, R] broadcast is needed; bf16: one group), each with its own dots.
  groups = scale_ref.shape[-1] if fp8 else 1
  width = rank // groups
  heads_ok = (jnp.arange(hp) < heads)[:, None]
  load_q = lambda view: view[...] if heads == hp else pltriton.load(view, mask=heads_ok, other=0.0)
  ql = [bf16_parts(load_q(ql_ref.at[:, pl.ds(g * width, width)])) for g in range(groups)]
  qr = bf16_parts(load_q(qr_ref))
  cols = jnp.arange(width, dtype=jnp.int32)
  rope_cols = jnp.arange(rope_dim, dtype=jnp.int32)
  contract_last = (((1,), (1,)), ((), ()))

  def body(i, carry):
    m, l, accs = carry
    j = start + i * block_n + jnp.arange(block_n, dtype=jnp.int32)
    idx = pltriton.load(idx_ref.at[pl.ds(start + i * block_n, block_n)], mask=j < k, other=-1)
    valid = idx >= 0
    tok = jnp.maximum(idx, 0)
    row_page = jnp.where(valid, pt_ref[jnp.minimum(tok // page_size, max_pages - 1)], 0)
    row_slot = tok % page_size
    page, slot = row_page[:, None], row_slot[:, None]
    # Unless scale_rows, the group's codes enter both dots as they are (e4m3 -> bf16 is exact)
    # and its scales, powers of two, multiply the dots' columns instead: the same products,
    # without a scaled fp32 copy of the rows (module docstring).
    lats, scales = [], []
    for g in range(groups):
      lat = lat_ref[page, slot, g * width + cols[None, :]]  # [bn, width]
      scale = scale_ref[row_page, row_slot, jnp.full_like(row_slot, g)] if fp8 else None  # [bn]
      if scale_rows:  # resolved: FP8 latents only
        lat, scale = lat.astype(jnp.float32) * scale[:, None], None
      lats.append(lat.astype(jnp.bfloat16))
      scales.append(scale)
    by_column = lambda x, scale: x if scale is None else x * scale[None, :]
    rope = rope_ref[page, slot, rope_cols[None, :]]  # [bn, dr]
    logits = parts_dot(qr, rope, contract_last)
    for q_g, lat, scale in zip(ql, lats, scales):
      logits += by_column(parts_dot(q_g, lat, contract_last), scale)
    logits = jnp.where(valid[None, :], logits * softmax_scale, -jnp.inf)  # [Hp, bn]
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid token yet: keep zeros
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(logits - m_safe[:, None])
    p_terms = lambda x: bf16_parts(x) if exact else [x.astype(jnp.bfloat16)]
    accs = tuple(acc * alpha[:, None] + parts_dot(p_terms(by_column(p, scale)), lat, (((1,), (0,)), ((), ())))
                 for acc, lat, scale in zip(accs, lats, scales))
    return m_new, l * alpha + jnp.sum(p, axis=1), accs

  init = (jnp.full((hp,), -jnp.inf, jnp.float32), jnp.zeros((hp,), jnp.float32),
          (jnp.zeros((hp, width), jnp.float32),) * groups)
  m, l, accs = lax.fori_loop(0, chunk // block_n, body, init)
  for g, acc in enumerate(accs):
    acc_ref[:, pl.ds(g * width, width)] = _first_rows(acc, heads_out)
  m_ref[...] = _first_rows(m, heads_out)
  l_ref[...] = _first_rows(l, heads_out)


def _split_weights(m: jax.Array, l: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """The splits' merge weights along `axis`, w_s = exp(m_s - max_s m_s) (a maximum of -inf, no
  valid token in any split, counts as 0), and the softmax sum sum_s w_s l_s."""
  m_max = jnp.max(m, axis=axis, keepdims=True)
  w = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))
  return w, jnp.sum(w * l, axis=axis)


def _normalised(num: jax.Array, den: jax.Array) -> jax.Array:
  """num / den (den broadcast against num), zeros where den is 0: no split saw a valid token."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref, *, splits: int):
  """Merge one query token's split states over a block of latent columns:
  out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s); zeros where no split
  saw a valid token."""
  # acc_ref [S, Hs, cb] f32 ; m_ref, l_ref [S, Hs] f32 ; o_ref [Hs, cb] f32
  w, den = _split_weights(m_ref[...], l_ref[...], axis=0)  # [S, Hs], [Hs]

  def body(s, num):
    pick = jnp.arange(splits, dtype=jnp.int32) == s
    w_s = jnp.sum(jnp.where(pick[:, None], w, 0.0), axis=0)  # row s of w (Triton: no dynamic row slice)
    return num + w_s[:, None] * acc_ref[s]

  num = lax.fori_loop(0, splits, body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = _normalised(num, den[:, None])


def _combine(acc: jax.Array, m: jax.Array, l: jax.Array, config: SparseMLAConfig,
             interpret: bool) -> jax.Array:
  """[B, T, S, Hs, R] partial outputs and [B, T, S, Hs] maxima and sums -> [B, T, Hs, R]."""
  b, t, splits, hs, rank = acc.shape
  if config.combine == "xla":
    w, den = _split_weights(m, l, axis=2)  # [B, T, S, Hs], [B, T, Hs]
    return _normalised(jnp.sum(w[..., None] * acc, axis=2), den[..., None])
  cb = min(_COMBINE_BLOCK, rank)
  state = pl.BlockSpec((None, None, splits, hs), lambda i, j, c: (i, j, 0, 0))
  return pl.pallas_call(
      functools.partial(_combine_kernel, splits=splits),
      grid=(b, t, rank // cb),
      in_specs=[pl.BlockSpec((None, None, splits, hs, cb), lambda i, j, c: (i, j, 0, 0, c)), state, state],
      out_specs=pl.BlockSpec((None, None, hs, cb), lambda i, j, c: (i, j, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, t, hs, rank), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="sparse_mla_combine",
  )(acc, m, l)


def _merge_values_kernel(acc_ref, m_ref, l_ref, kv_b_ref, o_ref, *, tokens: int, nope: int, block_v: int,
                         block_r: int):
  """One (query token, head, block of value columns): the splits' merge and kv_b's value rows,
  out = (sum_s w_s acc_s) . W_UV[h, vblock]^T / sum_s w_s l_s with w_s = exp(m_s - max_s m_s)
  (sparse_mla_decode_values' docstring); zeros where no split saw a valid token."""
  # acc_ref [B, T, S, Hs, R] f32 ; m_ref, l_ref [B, T, S, Hs] f32 ; kv_b_ref [H, nope + V, R]
  # bf16|f32 ; o_ref [B, T, H, V] f32: all whole, this program reads and writes its slices.
  bt, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  b, t = bt // tokens, bt % tokens
  splits, rank = acc_ref.shape[2], acc_ref.shape[-1]
  values = o_ref.shape[-1]
  sp = pl.next_power_of_2(splits)
  split_ok = jnp.arange(sp) < splits
  w, den = _split_weights(pltriton.load(m_ref.at[b, t, pl.ds(0, sp), h], mask=split_ok, other=-jnp.inf),
                          pltriton.load(l_ref.at[b, t, pl.ds(0, sp), h], mask=split_ok, other=0.0),
                          axis=0)  # w [Sp]: 0 past the splits

  rows = j * block_v + jnp.arange(block_v)
  rows_ok = rows < values
  out = jnp.zeros((block_v,), jnp.float32)
  for c in range(rank // block_r):  # independent column blocks: their loads can all be in flight
    part = pltriton.load(acc_ref.at[b, t, pl.ds(0, sp), h, pl.ds(c * block_r, block_r)],
                         mask=split_ok[:, None], other=0.0)                       # [Sp, br]
    merged = jnp.sum(w[:, None] * part, axis=0)                                   # [br]
    w_uv = pltriton.load(kv_b_ref.at[h, pl.ds(nope + j * block_v, block_v), pl.ds(c * block_r, block_r)],
                         mask=rows_ok[:, None], other=0.0).astype(jnp.float32)   # [bv, br]
    out += jnp.sum(w_uv * merged[None, :], axis=1)
  pltriton.store(o_ref.at[b, t, h, pl.ds(j * block_v, block_v)], _normalised(out, den).astype(o_ref.dtype),
                 mask=rows_ok)


def _merge_values(acc: jax.Array, m: jax.Array, l: jax.Array, kv_b: jax.Array, nope: int, out_dtype,
                  interpret: bool) -> jax.Array:
  """[B, T, S, Hs, R] partial outputs, [B, T, S, Hs] maxima and sums, kv_b [H, nope + V, R]
  -> [B, T, H, V] in out_dtype in one launch: a program per (query token, head, 64 value columns)."""
  b, t, _, _, rank = acc.shape
  heads, values = kv_b.shape[0], kv_b.shape[1] - nope
  block_v = min(_MERGE_BLOCK_V, pl.next_power_of_2(values))
  whole = lambda shape: pl.BlockSpec(shape, lambda i, h, j: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_merge_values_kernel, tokens=t, nope=nope, block_v=block_v,
                        block_r=min(_MERGE_BLOCK_R, rank)),
      grid=(b * t, heads, pl.cdiv(values, block_v)),
      in_specs=[whole(acc.shape), whole(m.shape), whole(l.shape), whole(kv_b.shape)],
      out_specs=whole((b, t, heads, values)),
      out_shape=jax.ShapeDtypeStruct((b, t, heads, values), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="sparse_mla_merge_values",
  )(acc, m, l, kv_b)


def check_sparse_mla_args(q_latent, q_rope, latent, latent_scale, k_rope, page_table,
                          indices) -> None:
  """ValueError unless the arguments form a valid sparse MLA call (shared with the reference)."""
  if q_latent.ndim != 4 or q_latent.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"q_latent must be bf16/f32 [B, T, H, R], got "
                     f"{q_latent.dtype}{list(q_latent.shape)}")
  b, t, h, rank = q_latent.shape
  if q_rope.ndim != 4 or q_rope.shape[:3] != (b, t, h) or q_rope.dtype != q_latent.dtype:
    raise ValueError(f"q_rope must be {q_latent.dtype}[{b}, {t}, {h}, dr] like q_latent, got "
                     f"{q_rope.dtype}{list(q_rope.shape)}")
  check_paged("latent", latent, "latent_scale", latent_scale, rank, rank // fp8_block_size(rank))
  if k_rope.shape != (*latent.shape[:2], q_rope.shape[-1]) or k_rope.dtype != jnp.bfloat16:
    raise ValueError(f"k_rope must be bf16 {[*latent.shape[:2], q_rope.shape[-1]]}, got "
                     f"{k_rope.dtype}{list(k_rope.shape)}")
  check_page_table(page_table, b)
  if indices.ndim != 3 or indices.shape[:2] != (b, t) or indices.dtype != jnp.int32:
    raise ValueError(f"indices must be int32 [{b}, {t}, k], got "
                     f"{indices.dtype}{list(indices.shape)}")


def _num_splits(queries: int, k: int, block_n: int) -> int:
  """Splits per query token: about _TARGET_PROGRAMS programs, >= block_n tokens each."""
  return max(1, min(_TARGET_PROGRAMS // queries, pl.cdiv(k, block_n)))


def _split_states(q_latent, q_rope, latent, latent_scale, k_rope, page_table, indices, *, softmax_scale: float,
                  config: SparseMLAConfig, interpret: bool, warm: tuple[jax.Array, ...] = ()) -> list[jax.Array]:
  """The main launch: each (sequence, query token, split)'s partial state, [acc [B, T, S, Hs, R],
  m [B, T, S, Hs], l [B, T, S, Hs]] f32 (Hs: H rounded up to a power of two); its programs also
  prefetch the `warm` arrays into L2 (sparse_mla_decode's docstring)."""
  b, t, h, rank = q_latent.shape
  rope_dim = q_rope.shape[-1]
  k = indices.shape[-1]
  for name, dim in (("R", rank), ("dr", rope_dim)):
    if dim < _MIN_MMA or not is_pow2(dim):
      raise ValueError(f"the kernel needs a power-of-two {name} >= 16, got {dim}")
  heads_out = pl.next_power_of_2(h)
  hp = max(_MIN_MMA, heads_out)  # MMA rows; the kernel reads heads past H as zero queries
  config = config.resolved(exact=q_latent.dtype == jnp.float32, fp8=latent_scale is not None)
  splits = config.num_splits or _num_splits(b * t, k, config.block_n)
  chunk = pl.cdiv(k, splits * config.block_n) * config.block_n
  splits = pl.cdiv(k, chunk)  # no empty splits
  fp8 = latent_scale is not None
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, s, j: (0,) * x.ndim)
  caches = [latent, latent_scale, k_rope] if fp8 else [latent, k_rope]
  part_spec = pl.BlockSpec((None, None, None, heads_out), lambda i, s, j: (j, i, s, 0))
  grid = (t, splits, b)  # query token fastest: its programs share the selected rows
  return pl.pallas_call(
      functools.partial(_sparse_mla_kernel, k=k, chunk=chunk, block_n=config.block_n,
                        page_size=latent.shape[1], softmax_scale=softmax_scale, fp8=fp8, heads=h,
                        heads_out=heads_out, scale_rows=config.scale_rows, warm=len(warm), grid=grid,
                        num_warps=config.num_warps),
      grid=grid,
      in_specs=[pl.BlockSpec((None, None, hp, rank), lambda i, s, j: (j, i, 0, 0)),
                pl.BlockSpec((None, None, hp, rope_dim), lambda i, s, j: (j, i, 0, 0)),
                pl.BlockSpec((None, page_table.shape[1]), lambda i, s, j: (j, 0)),
                pl.BlockSpec((None, None, k), lambda i, s, j: (j, i, 0)),
                *map(whole, caches), *map(whole, warm)],
      out_specs=[pl.BlockSpec((None, None, None, heads_out, rank),
                              lambda i, s, j: (j, i, s, 0, 0)), part_spec, part_spec],
      out_shape=[jax.ShapeDtypeStruct((b, t, splits, heads_out, rank), jnp.float32),
                 jax.ShapeDtypeStruct((b, t, splits, heads_out), jnp.float32),
                 jax.ShapeDtypeStruct((b, t, splits, heads_out), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="sparse_mla_decode",
  )(q_latent, q_rope, page_table, indices, *caches, *warm)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "config", "interpret"))
def sparse_mla_decode(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array,
                      latent_scale: jax.Array | None, k_rope: jax.Array, page_table: jax.Array,
                      indices: jax.Array, *, softmax_scale: float,
                      config: SparseMLAConfig | None = None,
                      interpret: bool | None = None, warm: tuple[jax.Array, ...] = ()) -> jax.Array:
  """Attention of T query tokens per sequence over their selected cached tokens.

  Args:
    q_latent: [B, T, H, R] bf16 or f32 absorbed queries; f32 gives fp32-faithful numerics,
      bf16 FlashMLA's (module docstring).
    q_rope: [B, T, H, dr] roped queries, of q_latent's dtype.
    latent: [P, page_size, R] bf16 or float8_e4m3fn latent pages (page 0: null page).
    latent_scale: [P, page_size, R // min(128, R)] f32 power-of-two scales for FP8, else None.
    k_rope: [P, page_size, dr] bf16 roped keys.
    page_table: [B, max_pages] int32 physical page of each logical page.
    indices: [B, T, k] int32 selected token positions, -1 for empty slots (any order).
    softmax_scale: logit scale.
    config: tuning; None for the defaults.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
    warm: arrays a later launch reads (the layer's o_proj weight: Runtime.warm_o_proj), which the
      main launch's programs prefetch into L2 in equal shares (l2_prefetch.prefetch_share) before
      their own loads: the launch is latency-bound and leaves DRAM mostly idle (STUDY.md). No
      value changes.
  Returns:
    [B, T, H, R] f32 attention outputs in latent space (zeros where no slot is valid).
  """
  check_sparse_mla_args(q_latent, q_rope, latent, latent_scale, k_rope, page_table, indices)
  config = config or SparseMLAConfig()
  interpret = resolve_interpret(interpret)
  acc, m, l = _split_states(q_latent, q_rope, latent, latent_scale, k_rope, page_table, indices,
                            softmax_scale=softmax_scale, config=config, interpret=interpret, warm=warm)
  return _combine(acc, m, l, config, interpret)[:, :, :q_latent.shape[2]]


def check_value_weights(kv_b: jax.Array, nope: int, heads: int, rank: int) -> None:
  """ValueError unless kv_b is kv_b_proj's weight as bf16/f32 [H, nope + V, R] with V >= 1."""
  if (kv_b.ndim != 3 or kv_b.shape[0] != heads or kv_b.shape[2] != rank or not 0 <= nope < kv_b.shape[1]
      or kv_b.dtype not in (jnp.bfloat16, jnp.float32)):
    raise ValueError(f"kv_b must be bf16/f32 [{heads}, nope={nope} + V, {rank}] with V >= 1, got "
                     f"{kv_b.dtype}{list(kv_b.shape)}")


@functools.partial(jax.jit, static_argnames=("nope", "softmax_scale", "out_dtype", "config", "interpret"))
def sparse_mla_decode_values(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array,
                             latent_scale: jax.Array | None, k_rope: jax.Array, page_table: jax.Array,
                             indices: jax.Array, kv_b: jax.Array, *, nope: int, softmax_scale: float,
                             out_dtype=jnp.float32, config: SparseMLAConfig | None = None,
                             interpret: bool | None = None, warm: tuple[jax.Array, ...] = ()) -> jax.Array:
  """sparse_mla_decode's output through kv_b_proj's value half, per head: [B, T, H, V].

  The splits' merge and the value product run in one launch (`_merge_values`), where
  sparse_mla_decode then an einsum are, on the H200 in a TEP=8 rank's layer, six XLA kernels
  (the merge's four, W_UV's slice to fp32, the dot: about 13 us; BENCHMARKS.md run 21). The
  product is fp32 on the CUDA cores ([V, R] per head and token: 0.1 MFLOP), dividing by the
  softmax sum after it rather than before: equal to the two-step result to fp32 rounding; it is
  rounded once to out_dtype (bf16: what o_proj reads, so no XLA convert sits between).
  Switch: `Runtime.value_merge` ("xla" | "pallas"). On the H200 (BENCHMARKS.md run 22) the
  merge-values kernel takes 7.9 us of a TEP=8 rank's layer where XLA's six took about 13.

  Args: as sparse_mla_decode, and
    kv_b: kv_b_proj's weight [H, nope + V, R], bf16 or f32: rows nope.. of each head are W_UV
      (read in place: no sliced copy).
    nope: the key half's rows per head (qk_nope_head_dim).
    out_dtype: the result's dtype, f32 or bf16.
    warm: as sparse_mla_decode's.
  """
  check_sparse_mla_args(q_latent, q_rope, latent, latent_scale, k_rope, page_table, indices)
  check_value_weights(kv_b, nope, *q_latent.shape[2:])
  if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"out_dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype)}")
  config = config or SparseMLAConfig()
  interpret = resolve_interpret(interpret)
  acc, m, l = _split_states(q_latent, q_rope, latent, latent_scale, k_rope, page_table, indices,
                            softmax_scale=softmax_scale, config=config, interpret=interpret, warm=warm)
  return _merge_values(acc, m, l, kv_b, nope, jnp.dtype(out_dtype), interpret)


@functools.partial(jax.jit, static_argnames=("softmax_scale",))
def sparse_mla_decode_reference(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array,
                                latent_scale: jax.Array | None, k_rope: jax.Array,
                                page_table: jax.Array, indices: jax.Array, *,
                                softmax_scale: float) -> jax.Array:
  """Plain-jnp sparse MLA (gather + fp32 einsum + softmax): same arguments and result (bf16
  queries: the softmax weights are rounded to bf16 before the value product, as the kernel
  does, though relative to the row's maximum where the kernel uses its running one)."""
  check_sparse_mla_args(q_latent, q_rope, latent, latent_scale, k_rope, page_table, indices)
  valid = indices >= 0
  page, slot = (a.reshape(indices.shape) for a in
                token_slots(page_table, indices.reshape(indices.shape[0], -1), latent.shape[1]))
  values = latent[page, slot]  # [B, T, k, R]
  if latent_scale is not None:
    values = dequantize_fp8(values, latent_scale[page, slot])
  values = values.astype(jnp.float32)
  hi = lax.Precision.HIGHEST
  logits = (jnp.einsum("bthr,btkr->bthk", q_latent.astype(jnp.float32), values, precision=hi)
            + jnp.einsum("bthd,btkd->bthk", q_rope.astype(jnp.float32),
                         k_rope[page, slot].astype(jnp.float32), precision=hi))
  logits = jnp.where(valid[:, :, None, :], logits * softmax_scale, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m))
  den = jnp.sum(p, axis=-1, keepdims=True)
  if q_latent.dtype == jnp.bfloat16:  # the kernel's bf16 numerics (FlashMLA's): p enters p.v in bf16
    p = p.astype(jnp.bfloat16).astype(jnp.float32)
  out = jnp.einsum("bthk,btkr->bthr", p, values, precision=hi)
  return out / jnp.where(den > 0, den, 1.0)
