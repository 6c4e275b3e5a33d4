"""The CUDA-core NVFP4 kernels' fp16 activation planes, a row's in one program.

nvfp4_hfma2's kernels read activations as `activation_planes` of `f16_rows` (the fp16 pairs its
decoded weight registers multiply, each row scaled by a power of two into fp16's range). In
XLA that is two kernels per activation, the row maxima and then the scaled, transposed planes,
and for moe_hfma2's h, before them, the gate/up K-split sums with silu masked to the local
pairs and their count: in a TEP=8 rank's layer five launches, about 10 us (BENCHMARKS.md run
21). Here one launch per activation writes its planes and row maxima (the same bits on the CPU;
on the H200 silu's exp is Triton's, so h may round differently to bf16): a program
per row loads it as lines of one 16-column block, takes the maximum, scales and rounds to
fp16, and packs each plane's pair of columns (picked per lane as integers, so the sign of a zero
survives).

`rows_planes(a)`: bf16 [M, K] -> (u32 [M * 8, K/16], f32 [M]): f16_rows, then activation_planes.
`swiglu_planes(g, u, ids, experts)`: the gate and up K-split partials f32 [S, P, I] of P pair
rows -> the planes and maxima of h = silu(sum g) * sum u, rounded to bf16, zero on the rows from
the count of local pairs (ids in [0, experts)) on: moe_hfma2's XLA glue.
Switch: `PairsConfig.fused_planes` (moe_hfma2).

Lowering: Triton: a few KB a row, lane selections and integer packing in registers. Warps: the
rows kernel takes 4.66 us at 1-16 warps, the swiglu kernel 3.40 at 4 and 2.71 at 8 (one TEP=8
rank's 5 x 6144 rows and 2 x 40 x 2048 partials on an H100, BENCHMARKS.md run 34): 4 and 8.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.checks import resolve_interpret
from pallas_kernels.nvfp4_hfma2 import PLANES, plane_pairs
from pallas_kernels.nvfp4_matmul import BLOCK, load_tile, row_scale
from pallas_kernels.partials import split_tile_sum


@functools.cache
def _plane_columns() -> tuple[tuple[int, int], ...]:
  """(low, high) half's column within a 16-column block, per plane: read off plane_pairs itself
  (in numpy, on the block's column numbers: no jax op, so no trace or mesh context reaches it)."""
  return tuple((int(low), int(high)) for low, high in plane_pairs(np.arange(BLOCK)[None])[0, :, 0])


def _real_lines(planes_ref, blocks: int) -> jax.Array:
  """bool [Bp]: the tile's lines that exist. The Triton lowering does not clip a block to its
  array, so every load and store past `blocks` (the power-of-two tile's padding) is masked."""
  return jnp.arange(planes_ref.shape[1]) < blocks


def _store_planes(a: jax.Array, lines_ok: jax.Array, planes_ref, amax_ref, row) -> None:
  """a f32 [Bp, 16] (line b: columns 16b..16b+15; zeros where not lines_ok) -> f16_rows' scaling
  of the row, packed into planes_ref [8, Bp] (its real lines), and its maximum to amax_ref[row]."""
  amax = jnp.max(jnp.max(jnp.abs(a), axis=1))  # one axis at a time: what the Triton lowering reduces
  bits = lax.bitcast_convert_type((a * row_scale(amax)).astype(jnp.float16), jnp.uint16).astype(jnp.int32)
  lane = jnp.arange(BLOCK)[None, :]
  column = lambda c: jnp.max(jnp.where(lane == c, bits, 0), axis=1)  # the bits are >= 0: the lane's own
  for plane, (low, high) in enumerate(_plane_columns()):
    words = lax.bitcast_convert_type(column(low) | (column(high) << 16), jnp.uint32)
    pltriton.store(planes_ref.at[jnp.int32(plane)], words, mask=lines_ok)
  pltriton.store(amax_ref.at[pl.ds(row, 1)], jnp.full((1,), amax), mask=jnp.full((1,), True))


def _rows_kernel(a_ref, planes_ref, amax_ref, *, blocks: int):
  # a_ref [Bp, 16] bf16 of the [M, K/16, 16] rows; planes_ref u32 [8, Bp] of [M * 8, K/16];
  # amax_ref f32 [M], whole.
  lines_ok = _real_lines(planes_ref, blocks)
  _store_planes(load_tile(a_ref, lines_ok, None).astype(jnp.float32), lines_ok, planes_ref, amax_ref, pl.program_id(0))


def _swiglu_kernel(ids_ref, g_ref, u_ref, planes_ref, amax_ref, *, blocks: int, slots: int, experts: int):
  # ids_ref i32 [Sp] of the [P] ids, whole; g_ref, u_ref f32 [S, Bp, 16] of [S, P, I/16, 16].
  row = pl.program_id(0)
  ids = pltriton.load(ids_ref.at[pl.ds(0, ids_ref.shape[0])], mask=jnp.arange(ids_ref.shape[0]) < slots, other=-1)
  local = jnp.sum(((ids >= 0) & (ids < experts)).astype(jnp.int32))
  lines_ok = _real_lines(planes_ref, blocks)
  g, u = (split_tile_sum(ref, lines_ok, None) for ref in (g_ref, u_ref))
  h = (jax.nn.silu(g) * u).astype(jnp.bfloat16).astype(jnp.float32)
  _store_planes(jnp.where(row < local, h, 0.0), lines_ok, planes_ref, amax_ref, row)


def _launch(kernel, inputs, in_specs, rows: int, lines: tuple[int, int], num_warps: int, interpret: bool | None,
            name: str):
  """One program per row; lines: `_lines` of the rows' K."""
  blocks, padded = lines
  return pl.pallas_call(
      functools.partial(kernel, blocks=blocks),
      grid=(rows,),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((PLANES, padded), lambda r: (r, 0)),
                 pl.BlockSpec((pl.next_power_of_2(rows),), lambda r: (0,))],
      out_shape=[jax.ShapeDtypeStruct((rows * PLANES, blocks), jnp.uint32),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(*inputs)


def _lines(k: int) -> tuple[int, int]:
  """(K/16, its power-of-two padding): a row's lines of one block and the tile that holds them."""
  if k % BLOCK:
    raise ValueError(f"the planes need K divisible by {BLOCK}, got {k}")
  return k // BLOCK, pl.next_power_of_2(k // BLOCK)


@functools.partial(jax.jit, static_argnames=("interpret",))
def rows_planes(a: jax.Array, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """activation_planes(f16_rows(a)[0]) flattened to [M * 8, K/16] u32, and f16_rows(a)[1]
  (the row maxima, f32 [M]), in one launch. a: bf16 [M, K], K divisible by 16."""
  if a.ndim != 2 or a.dtype != jnp.bfloat16:
    raise ValueError(f"rows_planes: a must be bf16 [M, K], got {a.dtype}{list(a.shape)}")
  m, lines = a.shape[0], _lines(a.shape[1])
  return _launch(_rows_kernel, [a.reshape(m, lines[0], BLOCK)],
                 [pl.BlockSpec((None, lines[1], BLOCK), lambda r: (r, 0, 0))], m, lines, 4, interpret,
                 "hfma2_rows_planes")


@functools.partial(jax.jit, static_argnames=("experts", "interpret"))
def swiglu_planes(g: jax.Array, u: jax.Array, ids: jax.Array, *, experts: int,
                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """rows_planes of h = where(row < local pairs, silu(g.sum(0)) * u.sum(0), 0) in bf16, in one
  launch. g, u: f32 [S, P, I] K-split partials of P pair rows; ids: int32 [P] (the pairs are
  counted as ids in [0, experts))."""
  if g.shape != u.shape or g.ndim != 3 or g.dtype != jnp.float32 or u.dtype != jnp.float32:
    raise ValueError(f"swiglu_planes: g and u must be f32 [S, P, I] alike, got {g.dtype}{list(g.shape)} "
                     f"and {u.dtype}{list(u.shape)}")
  if ids.shape != g.shape[1:2] or ids.dtype != jnp.int32:
    raise ValueError(f"swiglu_planes: ids must be int32 [{g.shape[1]}], got {ids.dtype}{list(ids.shape)}")
  (splits, slots, _), lines = g.shape, _lines(g.shape[2])
  part = pl.BlockSpec((splits, None, lines[1], BLOCK), lambda r: (0, r, 0, 0))
  as_lines = lambda x: x.reshape(splits, slots, lines[0], BLOCK)
  return _launch(functools.partial(_swiglu_kernel, slots=slots, experts=experts),
                 [ids, as_lines(g), as_lines(u)],
                 [pl.BlockSpec((pl.next_power_of_2(slots),), lambda r: (0,)), part, part],
                 slots, lines, 8, interpret, "hfma2_swiglu_planes")
