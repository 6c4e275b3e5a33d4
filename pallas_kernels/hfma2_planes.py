"""The CUDA-core NVFP4 kernels' fp16 activation planes, a row (or a chunk of its lines) a program.

nvfp4_hfma2's kernels read activations as `activation_planes` of `f16_rows` (the fp16 pairs its
decoded weight registers multiply, each row scaled by a power of two into fp16's range). In
XLA that is two kernels per activation, the row maxima and then the scaled, transposed planes,
and for moe_hfma2's h, before them, the gate/up K-split sums with silu masked to the local
pairs and their count: in a TEP=8 rank's layer five launches, about 10 us (BENCHMARKS.md run
21). Here one launch per activation writes its planes and row maxima (the same bits on the CPU;
on the H200 silu's exp is Triton's, so h may round differently to bf16): program (row, chunk)
loads the row as lines of one 16-column block, takes the maximum, scales and rounds its chunk
of lines to fp16, and packs each plane's pair of columns (picked per lane as integers, so the
sign of a zero survives). Chunks spread a few long rows over more SMs at the cost of each
program re-reading its row for the maximum: on an H100 (BENCHMARKS.md run 35) x's planes
[5, 6144] took 2.25 us as 5 whole-row programs and 1.75 in 128-line chunks (15 programs);
h's [40, 2048] (128 lines a row) gain nothing from chunks, and 8 warps beat 4 (2.66 vs 3.38).
h's rows from the count of local pairs on load nothing: inside the rank's MoE (6 of 40 rows
local) 3.85 -> 3.3 us (run 35).

`rows_planes(a)`: bf16 [M, K] -> (u32 [M * 8, K/16], f32 [M]): f16_rows, then activation_planes.
`swiglu_planes(g, u, ids, experts)`: the gate and up K-split partials f32 [S, P, I] of P pair
rows -> the planes and maxima of h = silu(sum g) * sum u, rounded to bf16, zero on the rows from
the count of local pairs (ids in [0, experts)) on: moe_hfma2's XLA glue.
Switch: `PairsConfig.fused_planes` (moe_hfma2). x's planes programs can also run inside another
launch (`rows_launch`, `rows_program`): the router's choice, as more programs of its grid
(moe_route.route_select_planes, `Runtime.route_planes`; run 40: one launch and 1.8 us fewer).

Lowering: Triton: a few KB a row, lane selections and integer packing in registers.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.checks import check_launch, check_tile, resolve_interpret
from pallas_kernels.nvfp4_hfma2 import PLANES, plane_pairs
from pallas_kernels.nvfp4_matmul import BLOCK, load_tile, row_scale
from pallas_kernels.partials import split_tile_sum


@functools.cache
def _plane_columns() -> tuple[tuple[int, int], ...]:
  """(low, high) half's column within a 16-column block, per plane: read off plane_pairs itself
  (in numpy, on the block's column numbers: no jax op, so no trace or mesh context reaches it)."""
  return tuple((int(low), int(high)) for low, high in plane_pairs(np.arange(BLOCK)[None])[0, :, 0])


def _lines_ok(start, count: int, blocks: int) -> jax.Array:
  """bool [count]: which of the lines start..start+count-1 exist. The Triton lowering does not
  clip a block to its array, so every load and store past `blocks` is masked."""
  return start + jnp.arange(count) < blocks


def _amax(a: jax.Array) -> jax.Array:
  """The maximum magnitude of a [lines, 16] tile, one axis at a time (what the Triton lowering reduces)."""
  return jnp.max(jnp.max(jnp.abs(a), axis=1))


def _store_planes(a: jax.Array, amax: jax.Array, lines_ok: jax.Array, planes_ref) -> None:
  """a f32 [Bc, 16] (line b: columns 16b..16b+15; zeros where not lines_ok), a chunk of a row
  whose maximum is amax -> f16_rows' scaling, packed into planes_ref [8, Bc] (its real lines)."""
  bits = lax.bitcast_convert_type((a * row_scale(amax)).astype(jnp.float16), jnp.uint16).astype(jnp.int32)
  lane = jnp.arange(BLOCK)[None, :]
  column = lambda c: jnp.max(jnp.where(lane == c, bits, 0), axis=1)  # the bits are >= 0: the lane's own
  for plane, (low, high) in enumerate(_plane_columns()):
    words = lax.bitcast_convert_type(column(low) | (column(high) << 16), jnp.uint32)
    pltriton.store(planes_ref.at[jnp.int32(plane)], words, mask=lines_ok)


def _row_planes(load, planes_ref, amax_ref, row, c, *, blocks: int, chunk: int) -> None:
  """Program (row, c): the row's maximum from load(0, Bp) (the whole row, f32 [Bp, 16]), and
  its chunk c of `chunk` lines packed from load(c * chunk, chunk); chunk 0 stores the maximum."""
  a = load(0, pl.next_power_of_2(blocks))
  amax = _amax(a)
  if chunk < a.shape[0]:
    a = load(c * chunk, chunk)
  _store_planes(a, amax, _lines_ok(c * chunk, chunk, blocks), planes_ref)
  pltriton.store(amax_ref.at[pl.ds(row, 1)], jnp.full((1,), amax), mask=jnp.full((1,), c == 0))


def rows_program(a_ref, planes_ref, amax_ref, row, c, *, blocks: int, chunk: int):
  """rows_planes' program (row, c) (ids given, for a launch that runs it beside other work:
  pallas_kernels/moe_route.route_select_planes). a_ref [Bp, 16] bf16: the row's block of the
  [M, K/16, 16] rows; planes_ref u32 [8, chunk] of [M * 8, K/16]; amax_ref f32 [M], whole:
  rows_launch's blocks."""
  load = lambda start, count: load_tile(a_ref.at[pl.ds(start, count)], _lines_ok(start, count, blocks),
                                        None).astype(jnp.float32)
  _row_planes(load, planes_ref, amax_ref, row, c, blocks=blocks, chunk=chunk)


def _rows_kernel(a_ref, planes_ref, amax_ref, *, blocks: int, chunk: int):
  rows_program(a_ref, planes_ref, amax_ref, pl.program_id(0), pl.program_id(1), blocks=blocks, chunk=chunk)


def _swiglu_kernel(ids_ref, g_ref, u_ref, planes_ref, amax_ref, *, blocks: int, chunk: int, slots: int,
                   experts: int):
  # ids_ref i32 [Sp] of the [P] ids, whole; g_ref, u_ref f32 [S, Bp, 16] of [S, P, I/16, 16].
  row = pl.program_id(0)
  ids = pltriton.load(ids_ref.at[pl.ds(0, ids_ref.shape[0])], mask=jnp.arange(ids_ref.shape[0]) < slots, other=-1)
  local = jnp.sum(((ids >= 0) & (ids < experts)).astype(jnp.int32))

  def load(start, count):  # rows from the count on load nothing (their partials are unwritten): h = silu(0) * 0
    ok = _lines_ok(start, count, blocks) & (row < local)
    g, u = (split_tile_sum(ref, ok, None, pl.ds(start, count)) for ref in (g_ref, u_ref))
    return (jax.nn.silu(g) * u).astype(jnp.bfloat16).astype(jnp.float32)

  _row_planes(load, planes_ref, amax_ref, row, pl.program_id(1), blocks=blocks, chunk=chunk)


def _chunk(lines: tuple[int, int], chunk_lines: int | None, name: str) -> int:
  """Lines a program packs: chunk_lines (a power of two; None: the whole padded row), at most the row's."""
  if chunk_lines is not None:
    check_tile(name, "chunk_lines", chunk_lines, minimum=1)
  return lines[1] if chunk_lines is None else min(chunk_lines, lines[1])


def _planes_outputs(rows: int, lines: tuple[int, int], chunk: int, row_chunk):
  """(out_specs, out_shape) of the planes u32 [rows * 8, K/16] and maxima f32 [rows];
  row_chunk maps the grid's ids to a program's (row, chunk)."""
  return ([pl.BlockSpec((PLANES, chunk), row_chunk),
           pl.BlockSpec((pl.next_power_of_2(rows),), lambda *ids: (0,))],
          [jax.ShapeDtypeStruct((rows * PLANES, lines[0]), jnp.uint32), jax.ShapeDtypeStruct((rows,), jnp.float32)])


class RowsLaunch(NamedTuple):
  """rows_planes' pieces for a launch that runs its programs (rows_program) among others."""
  lines: jax.Array  # a as [M, K/16, 16]
  in_spec: pl.BlockSpec  # its block: the program's row
  out_specs: list  # the planes' and the maxima's blocks
  out_shape: list
  rows: int
  chunks: int  # programs a row
  blocks: int  # K/16
  chunk: int  # lines a program packs


def rows_launch(a: jax.Array, chunk_lines: int | None, row_chunk) -> RowsLaunch:
  """rows_planes(a)'s RowsLaunch for a grid whose ids map to programs (row, chunk) by row_chunk."""
  if a.ndim != 2 or a.dtype != jnp.bfloat16:
    raise ValueError(f"rows_planes: a must be bf16 [M, K], got {a.dtype}{list(a.shape)}")
  m, lines = a.shape[0], _lines(a.shape[1])
  chunk = _chunk(lines, chunk_lines, "rows_planes")
  in_spec = pl.BlockSpec((None, lines[1], BLOCK), lambda *ids: (row_chunk(*ids)[0], 0, 0))
  out_specs, out_shape = _planes_outputs(m, lines, chunk, row_chunk)
  return RowsLaunch(a.reshape(m, lines[0], BLOCK), in_spec, out_specs, out_shape, m, pl.cdiv(lines[0], chunk),
                    lines[0], chunk)


def _launch(kernel, inputs, in_specs, rows: int, lines: tuple[int, int], chunk_lines: int | None, num_warps: int,
            interpret: bool | None, name: str):
  """Programs (row, chunk of lines); lines: `_lines` of the rows' K."""
  check_launch(name, num_warps)
  chunk = _chunk(lines, chunk_lines, name)
  out_specs, out_shape = _planes_outputs(rows, lines, chunk, lambda r, c: (r, c))
  return pl.pallas_call(
      functools.partial(kernel, blocks=lines[0], chunk=chunk),
      grid=(rows, pl.cdiv(lines[0], chunk)),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(*inputs)


def _lines(k: int) -> tuple[int, int]:
  """(K/16, its power-of-two padding): a row's lines of one block and the tile that holds them."""
  if k % BLOCK:
    raise ValueError(f"the planes need K divisible by {BLOCK}, got {k}")
  return k // BLOCK, pl.next_power_of_2(k // BLOCK)


@functools.partial(jax.jit, static_argnames=("chunk_lines", "num_warps", "interpret"))
def rows_planes(a: jax.Array, *, chunk_lines: int | None = 128, num_warps: int = 4,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """activation_planes(f16_rows(a)[0]) flattened to [M * 8, K/16] u32, and f16_rows(a)[1]
  (the row maxima, f32 [M]), in one launch. a: bf16 [M, K], K divisible by 16. chunk_lines:
  16-column lines a program packs (a power of two; None: the whole row); num_warps: Triton's."""
  rows = rows_launch(a, chunk_lines, lambda r, c: (r, c))
  return _launch(_rows_kernel, [rows.lines], [rows.in_spec], rows.rows, _lines(a.shape[1]),
                 chunk_lines=chunk_lines, num_warps=num_warps, interpret=interpret, name="hfma2_rows_planes")


@functools.partial(jax.jit, static_argnames=("experts", "chunk_lines", "num_warps", "interpret"))
def swiglu_planes(g: jax.Array, u: jax.Array, ids: jax.Array, *, experts: int, chunk_lines: int | None = None,
                  num_warps: int = 8, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """rows_planes of h = where(row < local pairs, silu(g.sum(0)) * u.sum(0), 0) in bf16, in one
  launch. g, u: f32 [S, P, I] K-split partials of P pair rows; ids: int32 [P] (the pairs are
  counted as ids in [0, experts)); chunk_lines, num_warps as rows_planes'."""
  if g.shape != u.shape or g.ndim != 3 or g.dtype != jnp.float32 or u.dtype != jnp.float32:
    raise ValueError(f"swiglu_planes: g and u must be f32 [S, P, I] alike, got {g.dtype}{list(g.shape)} "
                     f"and {u.dtype}{list(u.shape)}")
  if ids.shape != g.shape[1:2] or ids.dtype != jnp.int32:
    raise ValueError(f"swiglu_planes: ids must be int32 [{g.shape[1]}], got {ids.dtype}{list(ids.shape)}")
  (splits, slots, _), lines = g.shape, _lines(g.shape[2])
  part = pl.BlockSpec((splits, None, lines[1], BLOCK), lambda r, c: (0, r, 0, 0))
  as_lines = lambda x: x.reshape(splits, slots, lines[0], BLOCK)
  return _launch(functools.partial(_swiglu_kernel, slots=slots, experts=experts),
                 [ids, as_lines(g), as_lines(u)],
                 [pl.BlockSpec((pl.next_power_of_2(slots),), lambda r, c: (0,)), part, part],
                 slots, lines, chunk_lines=chunk_lines, num_warps=num_warps, interpret=interpret,
                 name="hfma2_swiglu_planes")
