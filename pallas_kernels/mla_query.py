"""MLA's absorbed decode query in one launch: q_b_proj's split-K partials -> (q_latent, q_pe).

The cached attention path (glmjax.attention.MLAttention) takes q_b_proj's output per head,
rotates its rope part (apply_rope) and moves its nope part into the latent space through
kv_b_proj's key half, q_latent = q_nope . W_UK (the absorbed query). On the H200 that is four
XLA kernels of a TEP=8 rank's layer after the q_b GEMV: the GEMV's split-K sum rounded to bf16,
the RoPE stack, W_UK's slice copied out of kv_b, the dot: about 10 us. Here one launch, 4.3 us
there (BENCHMARKS.md run 22): a program per (token, head, block of latent columns) sums the
head's nope partials, rounds them to q_dtype as q_b's output is, and multiplies them into its
columns of W_UK, read in place inside kv_b, in fp32 on the CUDA cores (a head's product is 0.2
MFLOP a token); the first column block's program also rotates the rope part, in q_dtype as
apply_rope computes it. With Runtime.index_query, the indexer's wq_b partials (from the same GEMV
launch) come along: programs past the latent column blocks, an indexer head each, sum them and
rotate the head's leading rope columns in fp32 (apply_rope_leading), one XLA kernel fewer
(BENCHMARKS.md run 24: 3.3-3.4 us alone with it, as without). The GEMV takes 2 K splits here,
not its rule's 8, since each program sums every split (`Runtime.fold_splits`; run 36, H100: this
launch 3.9 -> 3.4 us, with the GEMV 14.8 -> 14.2).

Numerics: the rope part equals the XLA path's wherever the summed partials round alike (the sums'
order differs: split order here, XLA's there); q_latent equals it to fp32 rounding, before the
one rounding to out_dtype. Switch: `Runtime.query_absorb` ("xla" | "pallas").

Lowering: Triton: per program one [nope, 32] weight tile and a few 1 KB rows, products and sums
in registers; nothing here for Mosaic GPU's TMA or wgmma (a GEMV of 5 rows).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax import dsa, layers
from glmjax.layers import apply_rope
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.partials import check_angles, check_partials, rotate_pairs, split_sum

_BLOCK_R = 32  # latent columns a program: a [256, 32] fp32 weight tile is 64 registers a thread


def _absorb_kernel(partials_ref, pairs_ref, kv_b_ref, cos_ref, sin_ref, *refs, nope: int, rope: int, q_dtype,
                   index_heads: int):
  # partials_ref f32 [S, n, H * (nope + rope)] and pairs_ref, the same as [S, n, H * (nope + rope) / 2, 2];
  # kv_b_ref [H, nope + V, R] ; cos_ref, sin_ref f32 [n, rope / 2] ; with index_heads, index_ref f32
  # [S, n, Hi * Di / 2, 2] (the indexer's wq_b partials as pairs) ; then latent_ref [n, H, R] ; pe_ref
  # [n, H, rope / 2, 2] ; with index_heads, index_out_ref [n, Hi, Di / 2, 2]: all whole, each
  # program its slices.
  if index_heads:
    index_ref, latent_ref, pe_ref, index_out_ref = refs
  else:
    latent_ref, pe_ref = refs
  row, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start = h * (nope + rope)
  rank = latent_ref.shape[-1]
  blocks = pl.cdiv(rank, _BLOCK_R)

  @pl.when(c < blocks)
  def _():
    n_pad = pl.next_power_of_2(nope)
    nope_ok = jnp.arange(n_pad) < nope
    q = split_sum(partials_ref, row, start, n_pad, nope_ok).astype(q_dtype).astype(jnp.float32)
    cols = c * _BLOCK_R + jnp.arange(_BLOCK_R)
    cols_ok = cols < rank
    w_uk = pltriton.load(kv_b_ref.at[h, pl.ds(0, n_pad), pl.ds(c * _BLOCK_R, _BLOCK_R)],
                         mask=nope_ok[:, None] & cols_ok[None, :], other=0.0).astype(jnp.float32)
    latent = jnp.sum(w_uk * q[:, None], axis=0)
    pltriton.store(latent_ref.at[row, h, pl.ds(c * _BLOCK_R, _BLOCK_R)], latent.astype(latent_ref.dtype),
                   mask=cols_ok)

  @pl.when(c == 0)
  def _():  # apply_rope's pairs (2i, 2i + 1) as the rows of a [rope / 2, 2] tile
    half = rope // 2
    h_pad = pl.next_power_of_2(half)
    ok = jnp.arange(h_pad) < half
    pairs = split_sum(pairs_ref, row, (start + nope) // 2, h_pad, ok[:, None]).astype(q_dtype).astype(jnp.float32)
    rotated = rotate_pairs(pairs, cos_ref, sin_ref, row, ok, q_dtype)
    pltriton.store(pe_ref.at[row, h, pl.ds(0, h_pad)], rotated.astype(pe_ref.dtype), mask=ok[:, None])

  if index_heads:
    head = (c - blocks) * pl.num_programs(1) + h  # the programs past the latent blocks: an indexer head each

    @pl.when((c >= blocks) & (head < index_heads))
    def _():  # apply_rope_leading in fp32: the head's first rope / 2 pairs rotate, the rest stay
      half_dim = index_out_ref.shape[2]
      pad = pl.next_power_of_2(half_dim)
      pair = jnp.arange(pad)
      ok = pair < half_dim
      q = split_sum(index_ref, row, head * half_dim, pad, ok[:, None])
      roped = pair < rope // 2
      rotated = rotate_pairs(q, cos_ref, sin_ref, row, roped, jnp.float32)
      pltriton.store(index_out_ref.at[row, head, pl.ds(0, pad)],
                     jnp.where(roped[:, None], rotated, q).astype(index_out_ref.dtype), mask=ok[:, None])


def check_absorb_args(partials: jax.Array, kv_b: jax.Array, cos: jax.Array, sin: jax.Array, nope: int) -> int:
  """The rope width per head; ValueError naming the argument whose shape or dtype does not fit."""
  if kv_b.ndim != 3 or kv_b.dtype not in (jnp.bfloat16, jnp.float32) or not 0 < nope < kv_b.shape[1]:
    raise ValueError(f"absorbed_query: kv_b must be bf16 or f32 [heads, nope + values, rank] with nope={nope} "
                     f"rows of keys, got {kv_b.dtype}{list(kv_b.shape)}")
  heads = kv_b.shape[0]
  check_partials("absorbed_query", "partials", partials, f"{heads} * (nope + rope)", multiple=heads)
  rope = partials.shape[-1] // heads - nope
  if rope <= 0 or rope % 2 or nope % 2:
    raise ValueError(f"absorbed_query: each head's {partials.shape[-1] // heads} columns split into nope={nope} "
                     f"and {rope} rope columns: both must be positive and even")
  check_angles("absorbed_query", cos, sin, partials.shape[1], rope // 2)
  return rope


@functools.partial(jax.jit, static_argnames=("nope", "q_dtype", "out_dtype", "index_heads", "index_dtype",
                                             "interpret"))
def absorbed_query(partials: jax.Array, kv_b: jax.Array, cos: jax.Array, sin: jax.Array, *, nope: int,
                   q_dtype=jnp.bfloat16, out_dtype=jnp.float32, index_partials: jax.Array | None = None,
                   index_heads: int = 0, index_dtype=jnp.float32,
                   interpret: bool | None = None) -> tuple[jax.Array, ...]:
  """absorbed_query_reference in one launch (module docstring).

  Args:
    partials: f32 [S, n, H * (nope + rope)]: q_b_proj's split-K partial outputs (S = 1: the output).
    kv_b: kv_b_proj's weight [H, nope + V, R], bf16 or f32: each head's first nope rows are W_UK.
    cos, sin: f32 [n, rope / 2]: the tokens' RoPE angles.
    nope: the key half's columns per head (qk_nope_head_dim).
    q_dtype: what q_b_proj's output is rounded to (the model's dtype).
    out_dtype: the queries' dtype (Runtime.attention_queries).
    index_partials: None, or the indexer's wq_b partials f32 [S, n, Hi * Di] from the same GEMV
      launch (Runtime.index_query): its query too, summed and its first rope columns rotated in
      fp32 (apply_rope_leading), in programs past the latent column blocks.
    index_heads: Hi, the indexer's heads (with index_partials).
    index_dtype: the indexer query's dtype (Runtime.indexer_queries).
    interpret: run the Pallas interpreter; None: only on a CPU backend.
  Returns:
    (q_latent [n, H, R], q_pe [n, H, rope]), both out_dtype; with index_partials, then the
    indexer's query [n, Hi, Di] in index_dtype.
  """
  rope = check_absorb_args(partials, kv_b, cos, sin, nope)
  (splits, n, width), (heads, _, rank) = partials.shape, kv_b.shape
  inputs = [partials, partials.reshape(splits, n, width // 2, 2), kv_b, cos, sin]
  shapes = [jax.ShapeDtypeStruct(shape, out_dtype) for shape in ((n, heads, rank), (n, heads, rope // 2, 2))]
  blocks, extra = pl.cdiv(rank, _BLOCK_R), 0
  if index_partials is not None:
    check_partials("absorbed_query", "index_partials", index_partials, f"{index_heads} * D (D even, >= {rope})",
                   lead=(splits, n), multiple=2 * max(index_heads, 1))
    dim = index_partials.shape[-1] // max(index_heads, 1)
    if index_heads <= 0 or dim < rope:
      raise ValueError(f"absorbed_query: index_heads must be positive with heads of at least {rope} columns, "
                       f"got {index_heads} heads of {index_partials.shape[-1]} columns")
    inputs.append(index_partials.reshape(splits, n, -1, 2))
    shapes.append(jax.ShapeDtypeStruct((n, index_heads, dim // 2, 2), index_dtype))
    extra = pl.cdiv(index_heads, heads)
  whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  out = pl.pallas_call(
      functools.partial(_absorb_kernel, nope=nope, rope=rope, q_dtype=jnp.dtype(q_dtype),
                        index_heads=index_heads if index_partials is not None else 0),
      grid=(n, heads, blocks + extra),
      in_specs=[whole(a.shape) for a in inputs],
      out_specs=[whole(shape.shape) for shape in shapes],
      out_shape=shapes,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="mla_absorbed_query",
  )(*inputs)
  mla = (out[0], out[1].reshape(n, heads, rope))
  return mla if index_partials is None else mla + (out[2].reshape(n, index_heads, -1),)


def absorbed_query_reference(partials: jax.Array, kv_b: jax.Array, cos: jax.Array, sin: jax.Array, *, nope: int,
                             q_dtype=jnp.bfloat16, out_dtype=jnp.float32, index_partials: jax.Array | None = None,
                             index_heads: int = 0, index_dtype=jnp.float32) -> tuple[jax.Array, ...]:
  """The XLA path: q = partials summed and rounded to q_dtype, per head [nope | rope]; q_pe =
  apply_rope(rope part); q_latent = q_nope . W_UK in fp32 (MLAttention's cached path); with
  index_partials, the indexer's query as glmjax.attention.Indexer makes it from them."""
  check_absorb_args(partials, kv_b, cos, sin, nope)
  q = jnp.sum(partials, axis=0).astype(q_dtype).reshape(partials.shape[1], kv_b.shape[0], -1)
  q_pe = apply_rope(q[None, :, :, nope:], cos[None], sin[None])[0]
  mla = dsa.query_absorption(q[..., :nope], kv_b, nope).astype(out_dtype), q_pe.astype(out_dtype)
  if index_partials is None:
    return mla
  index_q = jnp.sum(index_partials, axis=0).reshape(partials.shape[1], index_heads, -1)
  return mla + (layers.apply_rope_leading(index_q[None], cos[None], sin[None])[0].astype(index_dtype),)
