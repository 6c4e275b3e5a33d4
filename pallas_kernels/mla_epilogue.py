"""MLA's projection epilogue in one launch: q_a's and kv_a's GEMV partials -> q_resid, latent, k_pe.

glmjax.attention.MLAttention projects x through q_a_proj and kv_a_proj_with_mqa in one split-K
launch, then normalises q_a (q_a_layernorm) and kv_a's latent part (kv_a_layernorm), both
RMSNorms, and rotates kv_a's rope part (apply_rope): on the H200 three XLA kernels of a TEP=8
rank's layer (BENCHMARKS.md run 23's map). Here one launch: a program per (token, output): the
first sums q_a's partials and normalises them, the second kv_a's latent part, and rotates its
rope part as pairs (a [rope / 2, 2] tile of a free reshape). In that layer 3.6-3.7 us: -2
launches and -4.6 us of kernel time against the XLA path (BENCHMARKS.md run 24, same call).
With Runtime.index_epilogue, the indexer's wk and weights_proj share that GEMV launch (they read
the same x) and a third program per token does indexer_keys' work (its keys_row): one launch
for both epilogues (with index_query, -3 launches and -5.6 us a layer, run 24). Each program
reads every K split of its token's partials, so the GEMV takes 4 splits, not its rule's 8
(`Runtime.fold_splits`; run 36, H100: this launch 3.6 -> 2.8 us, with the GEMV 17.6 -> 17.1).

With Runtime.epilogue_write, the launch also does the decode step's cache write (paged_write's
stores, the same helpers): program (token, 1) writes its latent (FP8-quantised per 128-block
where the cache is FP8) and k_pe rows into the layer's pages, program (token, 2) the indexer's
key; the pages are aliased outputs. One launch a layer fewer, the rows never read back.

Numerics: as the model computes them: the sums rounded to the activations' dtype, RMSNorm's
statistics in fp32, its scale and the rotation in that dtype. Equal to the XLA path wherever the
summed partials round alike (split order here, XLA's there) and the fp32 statistics do (their
sums' order differs too). Switch: `Runtime.mla_epilogue` ("xla" | "pallas").

Lowering: Triton: a row of a few thousand values, one reduction, elementwise work in registers.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.cache.paged import LayerCache
from glmjax.layers import apply_rope, rms_norm
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.indexer_keys import (check_keys_args, indexer_keys_reference, keys_operands, keys_out_shapes,
                                         keys_row)
from pallas_kernels.paged_write import check_write_args, layer_pages, page_slot, row_tile, store_row, with_pages
from pallas_kernels.partials import check_angles, check_partials, rms_normed, rotate_pairs, split_sum


def _normalised(ref, row, weight_ref, out_ref, *, width: int, eps: float) -> jax.Array:
  """RMSNorm of the first `width` summed partials of ref's row into out_ref[row] (rms_norm's
  steps); the stored tile."""
  pad = pl.next_power_of_2(width)
  ok = jnp.arange(pad) < width
  x = split_sum(ref, row, 0, pad, ok).astype(out_ref.dtype).astype(jnp.float32)
  normed = rms_normed(x, weight_ref, ok, width, eps, out_ref.dtype)
  pltriton.store(out_ref.at[row, pl.ds(0, pad)], normed, mask=ok)
  return normed


def _epilogue_kernel(q_ref, kv_ref, kv_pairs_ref, q_w_ref, kv_w_ref, cos_ref, sin_ref, *refs, rank: int, rope: int,
                     eps: float, keys: dict | None, write: dict | None):
  # q_ref f32 [S, n, Q] ; kv_ref f32 [S, n, R + P] and kv_pairs_ref, the same as [S, n, (R + P) / 2, 2] ;
  # q_w_ref [Q] ; kv_w_ref [R] ; cos_ref, sin_ref f32 [n, P / 2] ; with keys, the indexer's four
  # inputs (indexer_keys.keys_operands) ; with write, positions [n] i32, the page table [B, max_pages]
  # and the layer's pages (_cache_pages) ; then the outputs: q_out_ref [n, Q] ; latent_ref [n, R] ;
  # pe_ref [n, P / 2, 2] ; with keys, the indexer's two (keys_out_shapes) ; with write, the pages
  # again, aliased (written in place). All whole, each program its row.
  row, part = pl.program_id(0), pl.program_id(1)
  index_refs, refs = refs[:4 * bool(keys)], refs[4 * bool(keys):]
  if write:
    (pos_ref, pt_ref), refs = refs[:2], refs[2 + write["pages"]:]  # the pages' inputs: their outputs alias them
    page, slot, keep = page_slot(pos_ref[row], pt_ref, write["page_size"], row // write["tokens"])

    def store(group, tile, fp8=write["fp8"]):  # group: the pages (and FP8 scales) of one row kind
      store_row(group[0], group[1] if fp8 else None, page, slot, tile.reshape(row_tile(tile.size, fp8)), keep)
  (q_out_ref, latent_ref, pe_ref, *index_outs), pages = refs[:3 + 2 * bool(keys)], refs[3 + 2 * bool(keys):]
  plain = 1 + bool(write and write["fp8"])  # refs per quantised row kind

  @pl.when(part == 0)
  def _():
    _normalised(q_ref, row, q_w_ref, q_out_ref, width=q_out_ref.shape[-1], eps=eps)

  @pl.when(part == 1)
  def _():
    latent = _normalised(kv_ref, row, kv_w_ref, latent_ref, width=rank, eps=eps)
    dtype, half = pe_ref.dtype, rope // 2
    pad = pl.next_power_of_2(half)
    ok = jnp.arange(pad) < half
    start = jnp.int32(rank // 2)  # traced: the interpreter's static bound check would refuse the padded tile
    pairs = split_sum(kv_pairs_ref, row, start, pad, ok[:, None]).astype(dtype).astype(jnp.float32)
    rotated = rotate_pairs(pairs, cos_ref, sin_ref, row, ok, dtype)
    pltriton.store(pe_ref.at[row, pl.ds(0, pad)], rotated, mask=ok[:, None])
    if write:
      store(pages[:plain], latent)
      store(pages[plain:plain + 1], rotated, fp8=False)

  if keys:
    @pl.when(part == 2)
    def _():
      k = keys_row(row, *index_refs, cos_ref, sin_ref, *index_outs, **keys)
      if write:
        store(pages[plain + 1:], k)


def check_epilogue_args(q_partials, kv_partials, q_norm, kv_norm, cos, sin) -> int:
  """kv_a's latent width R; ValueError naming the argument whose shape or dtype does not fit."""
  check_partials("mla_epilogue", "q_partials", q_partials, "q_lora")
  splits, n, q_lora = q_partials.shape
  check_partials("mla_epilogue", "kv_partials", kv_partials, "rank + rope", lead=(splits, n))
  if q_norm.shape != (q_lora,):
    raise ValueError(f"mla_epilogue: q_norm must be [{q_lora}], got {list(q_norm.shape)}")
  rank = kv_norm.shape[0] if kv_norm.ndim == 1 else -1
  rope = kv_partials.shape[-1] - rank
  if rank <= 0 or rank % 2 or rope <= 0 or rope % 2:
    raise ValueError(f"mla_epilogue: kv_norm must be [rank] with rank and {kv_partials.shape[-1]} - rank even "
                     f"and positive, got {list(kv_norm.shape)}")
  check_angles("mla_epilogue", cos, sin, n, rope // 2)
  return rank


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "index_eps", "interpret"))
def mla_epilogue(q_partials: jax.Array, kv_partials: jax.Array, q_norm: jax.Array, kv_norm: jax.Array,
                 cos: jax.Array, sin: jax.Array, *, eps: float = 1e-6, dtype=jnp.bfloat16,
                 index_keys: tuple[jax.Array, ...] | None = None, index_eps: float = 1e-6,
                 write: tuple[LayerCache, jax.Array, jax.Array] | None = None,
                 interpret: bool | None = None) -> tuple[jax.Array, ...]:
  """mla_epilogue_reference in one launch (module docstring).

  Args:
    q_partials: f32 [S, n, Q]: q_a_proj's split-K partial outputs (S = 1: the output).
    kv_partials: f32 [S, n, R + P]: kv_a_proj_with_mqa's.
    q_norm, kv_norm: q_a_layernorm's [Q] and kv_a_layernorm's [R] weights.
    cos, sin: f32 [n, P / 2]: the tokens' RoPE angles.
    eps: the RMSNorms' epsilon.
    dtype: the activations' dtype (the model's).
    index_keys: None, or the indexer's (k_partials [S, n, D], w_partials [S, n, H], k_norm's weight
      and bias [D]) from the same GEMV launch (Runtime.index_epilogue): indexer_keys' work (its
      keys_row, rotating by the same angles) in this launch too, a third program per token.
    index_eps: k_norm's epsilon.
    write: None, or (layer, page_table int32 [B, max_pages], positions int32 [B, T]) with B x T = n
      (Runtime.epilogue_write): paged_write's work in this launch too, the new latent, k_pe and
      (with index_keys) indexer key rows into the layer's pages, in place (aliased); positions
      -1 write nothing.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
  Returns:
    (q_resid [n, Q], latent [n, R], k_pe [n, P]), all dtype; with index_keys, then indexer_keys'
    (k f32 [n, D], head weights f32 [n, H]); with write, then the written LayerCache.
  """
  rank = check_epilogue_args(q_partials, kv_partials, q_norm, kv_norm, cos, sin)
  (splits, n, q_lora), rope = q_partials.shape, kv_partials.shape[-1] - rank
  inputs = (q_partials, kv_partials, kv_partials.reshape(splits, n, -1, 2), q_norm, kv_norm, cos, sin)
  shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape in ((n, q_lora), (n, rank), (n, rope // 2, 2))]
  keys = None
  if index_keys is not None:
    check_partials("mla_epilogue", "index_keys' k_partials", index_keys[0], "D", lead=(splits, n))
    check_keys_args(*index_keys, cos, sin)
    dim, heads = index_keys[0].shape[-1], index_keys[1].shape[-1]
    keys = dict(dim=dim, heads=heads, rope=rope, eps=index_eps)
    inputs += keys_operands(*index_keys)
    shapes += keys_out_shapes(n, dim, heads)
  pages, written = (), None
  if write is not None:
    layer, page_table, positions = write
    pages = _cache_pages(layer, index_keys is not None, n, rank, rope, None if keys is None else dim, page_table,
                         positions)
    written = dict(pages=len(pages), tokens=positions.shape[1], page_size=layer.page_size,
                   fp8=layer.latent_scale is not None)
    inputs += (positions.reshape(n), page_table, *pages)
    shapes += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pages]
  whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  out = pl.pallas_call(
      functools.partial(_epilogue_kernel, rank=rank, rope=rope, eps=eps, keys=keys, write=written),
      grid=(n, 3 if keys else 2),
      in_specs=[whole(a.shape) for a in inputs],
      out_specs=[whole(shape.shape) for shape in shapes],
      out_shape=shapes,
      input_output_aliases={len(inputs) - len(pages) + i: len(shapes) - len(pages) + i for i in range(len(pages))},
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="mla_epilogue",
  )(*inputs)
  out, written_pages = out[:len(out) - len(pages)], out[len(out) - len(pages):]
  mla = (out[0], out[1], out[2].reshape(n, rope))
  mla = mla if keys is None else mla + (out[3].reshape(n, dim), out[4])
  return mla if write is None else mla + (with_pages(write[0], keys is not None, written_pages),)


def _cache_pages(layer: LayerCache, has_index: bool, n: int, rank: int, rope: int, dim: int | None, page_table,
                 positions) -> list[jax.Array]:
  """The pages mla_epilogue writes (paged_write.layer_pages), after paged_write's checks of the
  rows they take."""
  b, t = positions.shape
  if b * t != n:
    raise ValueError(f"mla_epilogue: write's positions [{b}, {t}] must hold the {n} tokens' positions")
  rows = lambda width: jax.ShapeDtypeStruct((b, t, width), jnp.float32)
  check_write_args(layer, page_table, positions, rows(rank), rows(rope), rows(dim) if has_index else None)
  return layer_pages(layer, has_index)


def mla_epilogue_reference(q_partials: jax.Array, kv_partials: jax.Array, q_norm: jax.Array, kv_norm: jax.Array,
                           cos: jax.Array, sin: jax.Array, *, eps: float = 1e-6, dtype=jnp.bfloat16,
                           index_keys: tuple[jax.Array, ...] | None = None,
                           index_eps: float = 1e-6) -> tuple[jax.Array, ...]:
  """The XLA path (MLAttention's): the partials summed and rounded to dtype, the two RMSNorms,
  kv_a's rope part rotated; with index_keys, then indexer_keys_reference's outputs."""
  rank = check_epilogue_args(q_partials, kv_partials, q_norm, kv_norm, cos, sin)
  q_a, kv_a = (jnp.sum(p, axis=0).astype(dtype) for p in (q_partials, kv_partials))
  k_pe = apply_rope(kv_a[None, :, rank:], cos[None], sin[None])[0]
  index_out = () if index_keys is None else indexer_keys_reference(*index_keys, cos, sin, eps=index_eps)
  return rms_norm(q_a, q_norm, eps, dtype), rms_norm(kv_a[:, :rank], kv_norm, eps, dtype), k_pe, *index_out
