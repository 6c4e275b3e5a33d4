"""The decode step's cache write in one launch: a layer's new tokens into its pages.

paged.write_layer (the reference, jnp) scatters each of a layer's up to five page arrays
separately (latent codes and scales, roped key, indexer key codes and scales), each FP8 one after
its own quantisation: about eight XLA kernels a layer and step, every one a launch of a few
hundred bytes. Here one program per new token computes its page slot, quantises its latent and
indexer key per 128-value block (kv_fp8.quantize_block: the same power-of-two scales and e4m3
rounding, bit for bit) and stores every array's row in place (the pages are aliased outputs).
Switch: `Runtime.cache_write` ("xla" | "pallas"; --cache_write on the experiments). What it saves
is launches, a few us each in the decode loop (docs/BENCHMARKS.md run 7); in a TEP=8 rank's
layer it takes 3.2 us (run 22's profile). With Runtime.epilogue_write its stores (`page_slot`,
`store_row`) run in MLA's epilogue launch instead (pallas_kernels/mla_epilogue.py).

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


def page_slot(pos: jax.Array, page_table_ref, page_size: int, *seq) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A new token's (page, slot, keep) from its position (-1: padding, kept out) and the page
  table (its sequence's row, or the whole table and the sequence's index `seq`)."""
  safe = jnp.maximum(pos, 0)
  return page_table_ref[(*seq, safe // page_size)], safe % page_size, pos >= 0


def store_row(pages_ref, scales_ref, page, slot, row: jax.Array, keep: jax.Array) -> None:
  """One token's row, a register tile [G, W] of the page row's D = G x W values in order, ->
  pages[page, slot]; FP8 pages (scales_ref [P, page_size, G]): each of its G rows one block of
  kv_fp8.quantize_block (W the block size), the codes and their scales -> scales[page, slot].
  Nothing where not `keep`. Also mla_epilogue's (Runtime.epilogue_write)."""
  dim = row.size
  if scales_ref is None:
    codes = row.astype(pages_ref.dtype)
  else:
    codes, scale = quantize_block(row)
    pltriton.store(scales_ref.at[page, slot, pl.ds(0, scale.size)], scale, mask=jnp.full(scale.shape, keep))
  pltriton.store(pages_ref.at[page, slot, pl.ds(0, dim)], codes.reshape(dim), mask=jnp.full((dim,), keep))


def row_tile(dim: int, fp8: bool) -> tuple[int, int]:
  """store_row's tile [G, W] for a page row of `dim` values: its FP8 blocks, else one row."""
  block = fp8_block_size(dim) if fp8 else dim
  return dim // block, block


def layer_pages(layer: LayerCache, has_index: bool) -> list[jax.Array]:
  """The page arrays a write stores into, in its launch's order: latent (and its FP8 scales),
  k_rope, and with the indexer's key its pages (and scales)."""
  pages = [layer.latent, *([layer.latent_scale] if layer.latent_scale is not None else []), layer.k_rope]
  if has_index:
    pages += [layer.index_k, *([layer.index_scale] if layer.index_scale is not None else [])]
  return pages


def with_pages(layer: LayerCache, has_index: bool, written) -> LayerCache:
  """`layer` with layer_pages(layer, has_index) replaced by `written`, their outputs in order."""
  written = iter(written)
  take = lambda old, new=True: next(written) if old is not None and new else old
  return LayerCache(take(layer.latent), take(layer.latent_scale), take(layer.k_rope),  # in layer_pages' order
                    take(layer.index_k, has_index), take(layer.index_scale, has_index))


def _write_kernel(pos_ref, pt_ref, *refs, page_size: int, fp8: bool, has_index: bool):
  """One new token's rows into the layer's pages."""
  # pos_ref [] i32 ; pt_ref [max_pages] i32 ; new rows: latent [R], k_rope [dr], index_k [Di]
  # (has_index) ; then the pages as inputs and as the outputs aliased to them (written here):
  # latent [P, page_size, R], latent_scale [P, page_size, R // 128] (fp8), k_rope
  # [P, page_size, dr], index_k, index_scale (has_index).
  num_new = 3 if has_index else 2
  new, pages = refs[:num_new], refs[num_new:]
  outs = list(pages[len(pages) // 2:])
  page, slot, keep = page_slot(pos_ref[...], pt_ref, page_size)
  tile = lambda ref, quantized: ref[...].reshape(row_tile(ref.shape[-1], quantized))
  take = lambda: (outs.pop(0), outs.pop(0) if fp8 else None)
  latent_pages, latent_scales = take()
  store_row(latent_pages, latent_scales, page, slot, tile(new[0], fp8), keep)
  store_row(outs.pop(0), None, page, slot, tile(new[1], False), keep)
  if has_index:
    store_row(*take(), page, slot, tile(new[2], fp8), keep)


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
  pages = layer_pages(layer, has_index)
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
  return with_pages(layer, has_index, written)
