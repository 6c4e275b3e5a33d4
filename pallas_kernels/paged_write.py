"""The decode step's cache write in one launch: a layer's new tokens into its pages.

paged.write_layer (the reference, jnp) scatters each of a layer's up to five page arrays
separately (latent codes and scales, roped key, indexer key codes and scales), each FP8 one after
its own quantisation: about eight XLA kernels a layer and step, every one a launch of a few
hundred bytes. Here one program per new token computes its page slot, quantises its latent and
indexer key per 128-value block (kv_fp8.quantize_block: the same power-of-two scales and e4m3
rounding, bit for bit) and stores every array's row in place (the pages are aliased outputs).
Switch: `Runtime.cache_write` ("xla" | "pallas"; --cache_write on the experiments). What it saves
is launches, a few us each in the decode loop (docs/BENCHMARKS.md run 7); in a TEP=8 rank's
layer it takes 3.2 us (run 22's profile).

Padding tokens (position -1) write nothing, where the reference writes them to the null page;
page 0 is never read as valid, so the caches agree on every page a sequence can read.

Lowering: Triton: per-token row stores at data-dependent page slots (pointer arithmetic), which
Mosaic GPU's TMA boxes do not express.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.cache.kv_fp8 import fp8_block_size, quantize_block
from glmjax.cache.paged import LayerCache
from pallas_kernels.checks import check_page_table, is_pow2, resolve_interpret


def _store_row(pages_ref, scales_ref, page, slot, row_ref, keep: jax.Array) -> None:
  """row_ref [D] -> pages[page, slot] (FP8: e4m3 codes per 128-block and their scales ->
  scales[page, slot]); nothing where not `keep`."""
  dim = row_ref.shape[0]
  if scales_ref is None:
    pltriton.store(pages_ref.at[page, slot, pl.ds(0, dim)], row_ref[...].astype(pages_ref.dtype),
                   mask=jnp.full((dim,), keep))
    return
  block = fp8_block_size(dim)
  for g in range(dim // block):  # Triton slices refs, not register tiles: one load per block
    codes, scale = quantize_block(row_ref[pl.ds(g * block, block)])
    pltriton.store(pages_ref.at[page, slot, pl.ds(g * block, block)], codes, mask=jnp.full((block,), keep))
    pltriton.store(scales_ref.at[page, slot, pl.ds(g, 1)], jnp.broadcast_to(scale, (1,)),
                   mask=jnp.full((1,), keep))


def _write_kernel(pos_ref, pt_ref, *refs, page_size: int, fp8: bool, has_index: bool):
  """One new token's rows into the layer's pages."""
  # pos_ref [] i32 ; pt_ref [max_pages] i32 ; new rows: latent [R], k_rope [dr], index_k [Di]
  # (has_index) ; then the pages as inputs and as the outputs aliased to them (written here):
  # latent [P, page_size, R], latent_scale [P, page_size, R // 128] (fp8), k_rope
  # [P, page_size, dr], index_k, index_scale (has_index).
  num_new = 3 if has_index else 2
  new, pages = refs[:num_new], refs[num_new:]
  outs = list(pages[len(pages) // 2:])
  pos = pos_ref[...]
  keep = pos >= 0
  safe = jnp.maximum(pos, 0)
  page = pt_ref[safe // page_size]
  slot = safe % page_size
  take = lambda: (outs.pop(0), outs.pop(0) if fp8 else None)
  latent_pages, latent_scales = take()
  _store_row(latent_pages, latent_scales, page, slot, new[0], keep)
  _store_row(outs.pop(0), None, page, slot, new[1], keep)
  if has_index:
    _store_row(*take(), page, slot, new[2], keep)


def check_write_args(layer: LayerCache, page_table, positions, latent, k_rope, index_k) -> None:
  """ValueError unless the new rows fit the layer's pages and the page table."""
  b, t = positions.shape
  check_page_table(page_table, b)
  if positions.dtype != jnp.int32:
    raise ValueError(f"positions must be int32 [B, T], got {positions.dtype}")
  for name, rows, pages in (("latent", latent, layer.latent), ("k_rope", k_rope, layer.k_rope),
                            ("index_k", index_k, layer.index_k)):
    if rows is None:
      continue
    if pages is None:
      raise ValueError(f"this layer's cache stores no {name}, but {name} rows were given")
    if rows.shape != (b, t, pages.shape[-1]):
      raise ValueError(f"{name} rows must be [{b}, {t}, {pages.shape[-1]}], got {list(rows.shape)}")
    if not is_pow2(pages.shape[-1]):
      raise ValueError(f"the kernel needs a power-of-two {name} width, got {pages.shape[-1]}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_write(layer: LayerCache, page_table: jax.Array, positions: jax.Array, latent: jax.Array,
                k_rope: jax.Array, index_k: jax.Array | None, *, interpret: bool | None = None) -> LayerCache:
  """`paged.write_layer` in one launch (module docstring).

  Args:
    layer: the layer's pages (written in place where the caller's buffers allow it: aliased).
    page_table: int32 [B, max_pages].
    positions: int32 [B, T] positions of the new tokens, -1 for padding (not written).
    latent: [B, T, R], k_rope: [B, T, dr], index_k: [B, T, Di] or None: the new rows.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
  Returns:
    the LayerCache with the rows written.
  """
  if index_k is not None and layer.index_k is None:
    raise ValueError("this layer's cache stores no indexer keys, but its indexer ran")
  check_write_args(layer, page_table, positions, latent, k_rope, index_k)
  interpret = resolve_interpret(interpret)
  fp8 = layer.latent_scale is not None
  has_index = index_k is not None
  pages = [layer.latent, *([layer.latent_scale] if fp8 else []), layer.k_rope]
  if has_index:
    pages += [layer.index_k, *([layer.index_scale] if fp8 else [])]
  new = [latent, k_rope] + ([index_k] if has_index else [])
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
  row = lambda a: pl.BlockSpec((None, None, a.shape[-1]), lambda i, j: (i, j, 0))
  first_page = 2 + len(new)
  written = pl.pallas_call(
      functools.partial(_write_kernel, page_size=layer.page_size, fp8=fp8, has_index=has_index),
      grid=positions.shape,
      in_specs=[pl.BlockSpec((None, None), lambda i, j: (i, j)),
                pl.BlockSpec((None, page_table.shape[1]), lambda i, j: (i, 0)),
                *map(row, new), *map(whole, pages)],
      out_specs=[whole(a) for a in pages],
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pages],
      input_output_aliases={first_page + i: i for i in range(len(pages))},
      compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="paged_write",
  )(positions, page_table, *new, *pages)
  written = list(written)
  latent_pages, latent_scale = written.pop(0), written.pop(0) if fp8 else None
  rope_pages = written.pop(0)
  index_pages, index_scale = layer.index_k, layer.index_scale
  if has_index:
    index_pages, index_scale = written.pop(0), written.pop(0) if fp8 else None
  return LayerCache(latent_pages, latent_scale, rope_pages, index_pages, index_scale)
