"""Weight-only NVFP4 matmul for decode: y [M, N] = x [M, K] @ dequant(w [N, K]).T, M <= 16.

Why this shape of kernel: a decode GEMV reads every weight once and does 2 FLOPs per weight, so
it is bound by HBM bytes. XLA's bf16 GEMV already runs at the H200's copy speed (4.22 TB/s,
NOTES.md); NVFP4 moves 4.5 bits per weight instead of 16, so the ceiling is 3.56x bf16 and the
target (80% of copy bandwidth on weights + scales) 2.8x. Dequantizing in XLA first would write
and re-read a bf16 copy of the weight; here the packed bytes go straight to registers.

Lowering: Triton (`pl.pallas_call` + `CompilerParams(num_warps, num_stages)`), not Mosaic GPU.
- A GEMV needs neither TMA nor wgmma: Triton's vectorised loads of contiguous uint8 (16 bytes per
  thread = 32 weights), its software pipelining of the `fori_loop` (num_stages) and mma.sync on a
  16-row tile are enough; a plain Triton GEMV read bf16 weights at 95% of XLA's here (NOTES.md).
  wgmma would want 64-row tiles of the 1-16 token rows, or the operands swapped.
- The decode is elementwise bit work on register tiles (shift, mask, join, bitcast), which Triton
  lowers from jnp as written; Mosaic GPU constrains register layouts around wgmma operands.
- The Pallas interpreter runs it on the CPU, so the tests check this kernel, not a twin. Mosaic
  GPU kernels (barriers, TMA) do not interpret. (Pallas marks its Triton backend deprecated in
  jax 0.11.2; the kernel is plain load / dot / store and ports to jax_triton unchanged.)

Grid: (N / block_n, split_k). Program (j, s) streams rows [j*bn, (j+1)*bn) of the packed weight
over its share of K in block_k steps: per step a [bn, bk/2] uint8 tile (bk/2 contiguous bytes per
row) and its [bn, bk/16] e4m3 scales. split_k > 1 (small N, e.g. one expert's gate/up) gives
enough programs for 132 SMs; the fp32 partials [split_k, M, N] are summed by XLA (a few KB).

Decode, exact in bf16: a nibble s|eem becomes the fp16 bit pattern s<<15 | eem<<9, which is
E2M1(code) * 2^-14 (code 1 = 0.5 lands on an fp16 subnormal, which the GPU keeps). Times the e4m3
scale in fp16 is exact (<= 6 significant bits, >= 2^-24), and so is the cast to bf16. The dot runs
on the tensor cores with M padded to 16 rows (bf16 x bf16 -> fp32); 2^14 and the per-tensor
scale multiply the fp32 accumulator once at the end. About 3 integer ops per weight remain (two
shifts and a merged and/or per nibble): at 4.5 bits per weight that, not HBM, is the likely
limit on the H200 (64 integer lanes per SM per clock), see experiments/bench_quant.py.

decode="ptx" (MatmulConfig) attacks that limit: inline PTX (`pltriton.elementwise_inline_asm`,
four packed bytes a 32-bit register) decodes two fp16 codes per instruction sequence on packed
registers, into the even columns' and the odd columns' tiles separately, and the dot takes x's
even and odd columns (split apart outside the kernel) against them: no interleave in registers.
The interpreter cannot run PTX, so there the same halves come from `decode_halves`; the PTX
program's bit logic is checked on the CPU by an emulator (tests/test_quant_kernels.py), its
speed and its result on the GPU by kernels_bench (`pallas_ptx` rows). Measured (BENCHMARKS.md
run 10, [1, 8192] x [8192, 28672]): 97.4 us against 124 us for the jnp decode and 120 us for
XLA's bf16 GEMV, the same output. Nsight Compute puts the rest of the gap to the 2.8x target in
the tile's trip to the MMA operand layout through shared memory (L1/TEX at 81% of peak, 7.3
instructions a weight of which the decode is 2.5) and in occupancy (5 programs per SM at 92
registers a thread): a decode straight into the operand layout is the next step.

operands="float16" (MatmulConfig) keeps the decoded fp16 tile as the MMA operand instead of
converting it to bf16 (1.56 of the grouped MoE's 6.61 instructions a weight, Nsight Compute,
BENCHMARKS.md run 12), against activations scaled per row into fp16 (`f16_rows`; the kernel
undoes the scale on its fp32 result). Measured (run 15): the GEMV above 83.3 us against 87.1
with bf16 operands (XLA's bf16: 117.4).

dot="hfma2" (MatmulConfig) leaves the tensor cores for one row (HFMA2_MAX_ROWS): each thread
decodes its weights in registers and multiplies them in place with fp16x2 FMAs, so nothing
passes through shared memory (pallas_kernels/nvfp4_hfma2.py, measured there).

pallas_kernels/nvfp4_fragments.py keeps the tensor cores without the trip through shared memory,
for up to 8 rows, from a weight rearranged once into mma.sync's fragment order (M = 8: 51.1 us
against this kernel's 85.6, BENCHMARKS.md run 28).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.quant.nvfp4 import BLOCK, NVFP4Weight
from pallas_kernels.checks import check_at_least, check_choice, check_launch, check_tile, resolve_interpret

NUM_SMS = 132         # H200; the default configs aim for >= 2 programs per SM
MAX_ROWS = 16         # M of one tensor-core tile; larger M is compute-bound: dequantize once
HFMA2_MAX_ROWS = 1    # rows up to which dot="hfma2" beats the tensor cores (BENCHMARKS.md run 19)
DECODE_SCALE = 2.0 ** 14  # undoes the 2^-14 of the fp16 bit-pattern decode
DECODES = ("jnp", "ptx")
OPERANDS = ("bfloat16", "float16")  # the tensor cores' operand dtype (MatmulConfig.operands)
DOTS = ("mma", "hfma2")  # tensor cores, or fp16x2 FMAs on the CUDA cores (MatmulConfig.dot)
# The fields every dot="hfma2" default config shares: the decode and operands it implies, and no
# pipelining of its loop's loads (loop_stages.py gained nothing, BENCHMARKS.md run 20).
HFMA2_FIELDS = dict(decode="ptx", operands="float16", dot="hfma2", num_stages=1)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  """Tiling of the weight-only skinny matmuls (NVFP4 here, block FP8 in fp8_matmul.py).

  block_n: weight rows per program; block_k: logical inputs per loop step (NVFP4 reads block_k/2
  bytes per row per step); split_k: programs sharing one row block along K; num_warps,
  num_stages: Triton's warps per program and software-pipeline depth of the K loop (dot="hfma2":
  of all its loads, through loop_stages.py, since they feed no dot; 1: none); decode: how
  NVFP4 tiles decode (module docstring); operands: the tensor cores' operand dtype, "bfloat16"
  or "float16" (`f16_rows`: the decoded weights skip their conversion to bf16, the activations
  are scaled per row into fp16 by a power of two, undone on the fp32 result); dot: "mma" (the
  tensor cores, M padded to 16 rows) or "hfma2" (NVFP4 only: fp16x2 FMAs on the CUDA cores, one
  PTX program per 16-weight scale block, nvfp4_hfma2.py; it needs decode="ptx" and
  operands="float16", which name what it does).
  """
  block_n: int = 64
  block_k: int = 256
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3
  decode: str = "jnp"
  operands: str = "bfloat16"
  dot: str = "mma"

  def __post_init__(self):
    check_tile("MatmulConfig", "block_n", self.block_n)
    check_tile("MatmulConfig", "block_k", self.block_k)
    check_at_least("MatmulConfig", "split_k", self.split_k)
    check_launch("MatmulConfig", self.num_warps, self.num_stages)
    check_choice("MatmulConfig", "decode", self.decode, DECODES)
    check_choice("MatmulConfig", "operands", self.operands, OPERANDS)
    check_choice("MatmulConfig", "dot", self.dot, DOTS)
    if self.dot == "hfma2" and (self.decode, self.operands) != ("ptx", "float16"):
      raise ValueError(f"MatmulConfig(dot='hfma2') decodes by PTX into fp16 operands: it needs "
                       f"decode='ptx' and operands='float16', got {self.decode!r}, {self.operands!r}")


def default_config(m: int, n: int, k: int, *, max_block_k: int = 256, decode: str = "jnp",
                   operands: str = "bfloat16", dot: str = "mma") -> MatmulConfig:
  """Tiles for [M, K] x [N, K] on the H200. Up to 4 rows: 64 x max_block_k weight tiles (decode
  "ptx": 32 x 512, the best of an 8-config sweep at [1, 8192] x [8192, 28672], 97.8 us against
  107.8 us for 64 x 256, BENCHMARKS.md run 10). More rows: 128 x 128, so the x tile (re-read
  from L2 by every program) stays small next to the weight tile. Then split K until there are
  >= 2 programs per SM (or K runs out). dot="hfma2" (it implies decode="ptx" and fp16 operands):
  16 x 512 tiles, 8 warps, K split until each program keeps 2 steps, the best of 45 configs at
  [1, 8192] x [8192, 28672] (BENCHMARKS.md run 27: 47.3-47.5 us at 8 splits in three calls,
  against 53.7 for run 19's 32 x 512, 4 warps, split to 16 programs per SM; an expert's gate/up
  [6144] -> 2048 7.1-7.5 against 7.7-7.9, its down [2048] -> 6144 6.8-7.0 against 7.4-7.6)."""
  hfma2 = dot == "hfma2"
  if m <= 4 or hfma2:
    block_n, block_k = (16, 512) if hfma2 else (32, 512) if decode == "ptx" else (64, max_block_k)
  else:
    block_n, block_k = 128, min(128, max_block_k)
  block_n = min(block_n, max(16, pl.next_power_of_2(n)))
  block_k = min(block_k, max(16, pl.next_power_of_2(k)))
  blocks, steps = pl.cdiv(n, block_n), pl.cdiv(k, block_k)
  split = 1  # each split keeps >= 2 steps; the tensor cores' also stop at 2 programs per SM
  while steps >= 4 * split and (hfma2 or blocks * split < 2 * NUM_SMS):
    split *= 2
  fields = dict(HFMA2_FIELDS, num_warps=8) if hfma2 else dict(decode=decode, operands=operands, dot=dot)
  return MatmulConfig(block_n=block_n, block_k=block_k, split_k=split, **fields)


def f16_rows(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """a [..., K] bf16 -> (fp16 a * 2^s, fp32 [...] largest magnitude per row): s = row_shift
  puts each row's largest in [2^14, 2^15); the kernels undo 2^s on their fp32 results from the
  largest (row_inverse_scale), so no XLA op computes the scales.

  Why: fp16 operands spare the weight decode its fp16 -> bf16 conversion (1.5 instructions of
  6.6 a weight in the NVFP4 MoE, Nsight Compute, BENCHMARKS.md run 12; the e4m3 -> fp16 cvt is
  native), but activations can exceed fp16's range. The scale is exact, and so is the cast of
  every entry within 2^-31 of its row's largest (fp16 keeps bf16's 8 significant bits down to
  2^-17); smaller ones round in fp16's subnormals by at most 2^-39 of the row's largest, far
  under the fp32 accumulation's error. Non-finite values propagate."""
  amax = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=-1)
  return (a.astype(jnp.float32) * row_scale(amax)[..., None]).astype(jnp.float16), amax


def row_shift(amax: jax.Array) -> jax.Array:
  """int32 s with amax * 2^s in [2^14, 2^15), from amax's exponent bits (integer ops only, so
  XLA and the kernels compute the same s); clipped to [-126, 126] (rows whose largest is under
  2^-111, zeros among them, take 2^126)."""
  biased = (lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF
  return jnp.clip(141 - biased, -126, 126)


def _pow2(e: jax.Array) -> jax.Array:
  """Exactly 2^e in fp32 for int32 e in [-126, 127], from its bits (exp2 is not exact)."""
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def row_scale(amax: jax.Array) -> jax.Array:
  """2^s (f16_rows' scale) for rows of these largest magnitudes."""
  return _pow2(row_shift(amax))


def row_inverse_scale(amax: jax.Array) -> jax.Array:
  """2^-s for f16_rows' rows of these largest magnitudes."""
  return _pow2(-row_shift(amax))


# Tile helpers shared by the weight-only kernels (fp8_matmul.py, moe_grouped_matmul.py).

def range_mask(start, size: int, limit: int) -> jax.Array | None:
  """[size] bool `start + i < limit` for a tile starting at a multiple of `size`; None when
  every such tile is in range (statically), so aligned shapes pay for no mask."""
  if limit % size == 0:
    return None
  return start + jnp.arange(size) < limit


def _mask2(rows_ok: jax.Array | None, cols_ok: jax.Array | None) -> jax.Array | None:
  if rows_ok is None and cols_ok is None:
    return None
  if rows_ok is None:
    return cols_ok[None, :]
  if cols_ok is None:
    return rows_ok[:, None]
  return rows_ok[:, None] & cols_ok[None, :]


def load_tile(ref, rows_ok: jax.Array | None, cols_ok: jax.Array | None) -> jax.Array:
  """Load a 2-D ref view; masked-off entries read as 0."""
  mask = _mask2(rows_ok, cols_ok)
  return pltriton.load(ref, mask=mask, other=None if mask is None else jnp.zeros((), ref.dtype))


def store_tile(ref, value: jax.Array, rows_ok: jax.Array | None, cols_ok: jax.Array | None) -> None:
  pltriton.store(ref, value, mask=_mask2(rows_ok, cols_ok))


def dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [m, k] . w [n, k]^T -> fp32 [m, n] on the tensor cores."""
  return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def split_k_loop(body, *, k: int, block_m: int, config: MatmulConfig, split=None, init=None):
  """body(step, acc) folded over this program's share of the K steps from `init` (default fp32
  zeros [block_m, block_n]); `split`: its index along K, default program axis 1 (read it outside
  a `pl.when` branch, where the interpreter cannot)."""
  steps = pl.cdiv(k, config.block_k)
  per_split = pl.cdiv(steps, config.split_k)
  first = (pl.program_id(1) if split is None else split) * per_split
  init = jnp.zeros((block_m, config.block_n), jnp.float32) if init is None else init
  return lax.fori_loop(first, jnp.minimum(first + per_split, steps), body, init)


def skinny_rows(m: int) -> int:
  """Rows of the x tile: M padded to the tensor cores' 16."""
  return max(16, pl.next_power_of_2(m))


def row_blocks(ns: tuple[int, ...], block_n: int) -> list[tuple[int, int]]:
  """(first grid row block, row blocks) of each of several weights of ns rows laid end to end."""
  out, first = [], 0
  for n in ns:
    out.append((first, pl.cdiv(n, block_n)))
    first += out[-1][1]
  return out


def local_block(j, first: int, blocks: int):
  """Grid row block j as a block of the weight whose `blocks` row blocks start at `first`,
  clipped into them: the BlockSpec of a weight a program does not touch must still point inside it."""
  return jnp.clip(j - first, 0, blocks - 1)


def summed_splits(partials: jax.Array, dtype) -> jax.Array:
  """A split-K GEMV's output [M, N] in dtype from its partials [S, M, N], as its launch sums
  them (XLA's sum of the fp32 splits, rounded once); also for partials a caller took unsummed."""
  return partials[0].astype(dtype) if partials.shape[0] == 1 else partials.sum(0).astype(dtype)


def skinny_call(kernel, inputs, in_specs, *, m: int, n: int | tuple[int, ...], dtype, config: MatmulConfig,
                interpret: bool, name: str, keep_splits: bool = False):
  """The (N / block_n, split_k) launch of a skinny-matmul kernel -> [M, N] in dtype. The kernel
  writes its [block_m, block_n] tile of an [split_k, M, N] output (fp32 when split: XLA sums
  the partials; keep_splits returns them unsummed, for a consumer that sums them itself). A
  tuple n (weights sharing x, bf16_matmul_group): the grid spans all their row blocks
  (row_blocks), the kernel gets one output ref per weight, and a tuple comes back."""
  ns = n if isinstance(n, tuple) else (n,)
  split = config.split_k
  blocks = row_blocks(ns, config.block_n)
  spec = lambda first, count: pl.BlockSpec((None, skinny_rows(m), config.block_n),
                                           lambda j, s: (s, 0, local_block(j, first, count)))
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((split, m, w), jnp.float32 if split > 1 else dtype) for w in ns],
      grid=(sum(count for _, count in blocks), split),
      in_specs=in_specs,
      out_specs=[spec(first, count) for first, count in blocks],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(*inputs)
  if not keep_splits:
    outs = [summed_splits(out, dtype) for out in outs]
  return tuple(outs) if isinstance(n, tuple) else outs[0]


def decode_nvfp4(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """uint8 [r, c] (two codes per byte) and e4m3 [r, c/8] -> [r, 2c] = E2M1 * scale * 2^-14 in
  `dtype` (bf16 or fp16).

  Exact: see the module docstring. Masked-off bytes and scales (0) decode to +0.
  """
  r, c = packed.shape
  values = jnp.stack(decode_halves(packed), axis=-1).reshape(r, 2 * c)
  s = jnp.broadcast_to(scale.astype(jnp.float16)[:, :, None], (r, 2 * c // BLOCK, BLOCK))
  return (values * s.reshape(r, 2 * c)).astype(dtype)


def decode_halves(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 [r, c] -> fp16 [r, c] twice: the even columns' codes (low nibbles) and the odd
  columns' (high nibbles), each as E2M1 * 2^-14 (module docstring)."""
  b = packed.astype(jnp.uint16)
  lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
  hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
  return lax.bitcast_convert_type(lo, jnp.float16), lax.bitcast_convert_type(hi, jnp.float16)


# Four packed bytes in $2 -> four fp16 in $0 (from bytes 0, 1) and $1 (bytes 2, 3): the even
# columns' codes (low nibbles; shifts 9 and 12) or the odd columns' (high nibbles; 5 and 8).
# prmt spreads two bytes into the two 16-bit halves of a register; then each half's nibble moves
# into the fp16 pattern s<<15 | eem<<9 by shifts and masks on both halves at once (ptxas merges
# each mask-and-or into one LOP3): about 2.5 instructions a weight, where the jnp decode, one
# 16-bit element per 32-bit register, takes about 10. One program per half: Pallas-Triton lowers
# inline asm with a single result only.
_DECODE_PTX = """{{
.reg .b32 t0, t1, a, b;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shl.b32 a, t0, {mag}; and.b32 a, a, 0x0E000E00; shl.b32 b, t0, {sign}; and.b32 b, b, 0x80008000; or.b32 $0, a, b;
shl.b32 a, t1, {mag}; and.b32 a, a, 0x0E000E00; shl.b32 b, t1, {sign}; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
}}"""
DECODE_PTX_EVEN = _DECODE_PTX.format(mag=9, sign=12)
DECODE_PTX_ODD = _DECODE_PTX.format(mag=5, sign=8)


def decode_halves_ptx(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`decode_halves` in inline PTX (Triton only: the interpreter cannot run it)."""
  half = jax.ShapeDtypeStruct(packed.shape, jnp.float16)
  return tuple(pltriton.elementwise_inline_asm(asm, args=[packed], constraints="=r,=r,r", pack=4,
                                               result_shape_dtypes=[half])[0]
               for asm in (DECODE_PTX_EVEN, DECODE_PTX_ODD))


def _load_packed(packed_ref, scale_ref, lead: tuple, step, *, block_k: int, k: int,
                 rows_ok: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """The uint8 [bn, block_k / 2] codes and e4m3 [bn, block_k / 16] scales of K step `step`
  (`lead` indexes leading dims, an expert id, in the same indexer: Triton takes one per load)."""
  kb, ks = block_k // 2, block_k // BLOCK
  packed = load_tile(packed_ref.at[(*lead, slice(None), pl.ds(step * kb, kb))], rows_ok,
                     range_mask(step * kb, kb, k // 2))
  scale = load_tile(scale_ref.at[(*lead, slice(None), pl.ds(step * ks, ks))], rows_ok,
                    range_mask(step * ks, ks, k // BLOCK))
  return packed, scale


def load_nvfp4_halves(packed_ref, scale_ref, lead: tuple, step, *, block_k: int, k: int,
                      rows_ok: jax.Array | None, ptx: bool, dtype) -> tuple[jax.Array, jax.Array]:
  """Decoded [bn, block_k / 2] even- and odd-column weight tiles of K step `step` in `dtype`
  (times 2^-14): the tiles `dot_t` takes against x's even and odd columns, so no interleave is
  needed. `lead`: see _load_packed."""
  kb, ks = block_k // 2, block_k // BLOCK
  packed, scale = _load_packed(packed_ref, scale_ref, lead, step, block_k=block_k, k=k, rows_ok=rows_ok)
  r = packed.shape[0]
  s = jnp.broadcast_to(scale.astype(jnp.float16)[:, :, None], (r, ks, BLOCK // 2)).reshape(r, kb)
  return tuple((h * s).astype(dtype) for h in (decode_halves_ptx if ptx else decode_halves)(packed))


def column_halves(a: jax.Array) -> list[jax.Array]:
  """a [..., K] as its even and odd columns, apart: the activations that weight tiles decoded
  into halves (decode="ptx") are dotted against. XLA fuses the split into a's producer."""
  return [a[..., 0::2], a[..., 1::2]]


def load_column_halves(refs, lead: tuple, rows_ok: jax.Array | None, step, *, block_k: int,
                       k: int) -> tuple[jax.Array, jax.Array]:
  """The [rows, block_k / 2] tiles of K step `step` from the refs of `column_halves`' arrays
  (K is even: one mask serves both); `lead` indexes leading dims, as in _load_packed."""
  width = block_k // 2
  cols_ok = range_mask(step * width, width, k // 2)
  return tuple(load_tile(ref.at[(*lead, slice(None), pl.ds(step * width, width))], rows_ok, cols_ok)
               for ref in refs)


def dot_halves(x_halves, w_halves) -> jax.Array:
  """x @ w.T in fp32 from both operands' even and odd column halves."""
  return dot_t(x_halves[0], w_halves[0]) + dot_t(x_halves[1], w_halves[1])


def load_nvfp4_tile(packed_ref, scale_ref, lead: tuple, step, *, block_k: int, k: int,
                    rows_ok: jax.Array | None, dtype) -> jax.Array:
  """Decoded [bn, block_k] weight tile of K step `step` in `dtype` (times 2^-14, see decode_nvfp4).

  packed_ref: uint8 [..., bn, Kp/2]; scale_ref: e4m3 [..., bn, Kp/16]; `lead`: see _load_packed.
  """
  return decode_nvfp4(*_load_packed(packed_ref, scale_ref, lead, step, block_k=block_k, k=k, rows_ok=rows_ok),
                      dtype)


def _nvfp4_matmul_kernel(*refs, m: int, n: int, k: int, block_m: int, config: MatmulConfig,
                         interpret: bool):
  # x_ref: [block_m, Kp] of [M, K] (decode="ptx": x_even_ref, x_odd_ref [block_m, Kp/2], x's
  # even and odd columns), bf16 or (operands="float16") f16_rows' fp16, then its rows' largest
  # magnitudes f32 [block_m] of [M]; packed_ref: uint8 [bn, Kp/2]; scale_ref: e4m3 [bn, Kp/16]; global_ref: f32 [1];
  # o_ref: [block_m, bn] of the [split_k, M, N] output (fp32 or bf16).
  *x_refs, packed_ref, scale_ref, global_ref, o_ref = refs
  x_refs, row_amax = operand_refs(x_refs, config.operands == "float16")
  bn, bk = config.block_n, config.block_k
  dtype = x_refs[0].dtype
  rows_ok = range_mask(0, block_m, m)
  n_ok = range_mask(pl.program_id(0) * bn, bn, n)

  def body(step, acc):
    if config.decode == "jnp":
      x = load_tile(x_refs[0].at[:, pl.ds(step * bk, bk)], rows_ok, range_mask(step * bk, bk, k))
      w = load_nvfp4_tile(packed_ref, scale_ref, (), step, block_k=bk, k=k, rows_ok=n_ok, dtype=dtype)
      return acc + dot_t(x, w)
    x = load_column_halves(x_refs, (), rows_ok, step, block_k=bk, k=k)
    w = load_nvfp4_halves(packed_ref, scale_ref, (), step, block_k=bk, k=k, rows_ok=n_ok, ptx=not interpret,
                          dtype=dtype)
    return acc + dot_halves(x, w)

  acc = split_k_loop(body, k=k, block_m=block_m, config=config)
  out = scale_rows(acc * (global_ref[0] * DECODE_SCALE), row_amax, rows_ok)
  store_tile(o_ref, out.astype(o_ref.dtype), rows_ok, n_ok)


def operand_rows(x: jax.Array, f16: bool) -> list[jax.Array]:
  """The activation arrays a weight-only kernel reads: [x], or with fp16 operands f16_rows' fp16
  x and its rows' largest magnitudes."""
  return list(f16_rows(x)) if f16 else [x]


def operand_refs(refs, f16: bool) -> tuple[list, object]:
  """Split a kernel's activation refs (operand_rows' arrays, whole or as column halves) into
  those and the ref of the rows' largest magnitudes (None for bf16 operands)."""
  return (list(refs[:-1]), refs[-1]) if f16 else (list(refs), None)


def scale_rows(acc: jax.Array, amax_ref, rows_ok: jax.Array | None) -> jax.Array:
  """acc [block_m, n] times the inverse f16_rows scale of its rows, from the ref of their largest
  magnitudes (masked by rows_ok; amax_ref None: acc unchanged)."""
  if amax_ref is None:
    return acc
  amax = pltriton.load(amax_ref, mask=rows_ok, other=None if rows_ok is None else 0.0)
  return acc * row_inverse_scale(amax)[:, None]


def _nvfp4_matmul(x: jax.Array, w: NVFP4Weight, config: MatmulConfig, interpret: bool) -> jax.Array:
  if config.dot == "hfma2":
    from pallas_kernels.nvfp4_hfma2 import hfma2_matmul  # it builds on this module's helpers
    return hfma2_matmul(x, w, config, interpret)
  (m, k), n = x.shape, w.shape[0]
  bn, bk = config.block_n, config.block_k
  block_m = skinny_rows(m)
  kp = pl.cdiv(k, bk) * bk  # blocks may overhang the arrays: the overhang is masked
  x_op, *row_amax = operand_rows(x, config.operands == "float16")
  xs, x_specs = [x_op], [pl.BlockSpec((block_m, kp), lambda j, s: (0, 0))]
  if config.decode == "ptx":
    xs = column_halves(x_op)
    x_specs = [pl.BlockSpec((block_m, kp // 2), lambda j, s: (0, 0))] * 2
  x_specs += [pl.BlockSpec((block_m,), lambda j, s: (0,))] * len(row_amax)
  kernel = functools.partial(_nvfp4_matmul_kernel, m=m, n=n, k=k, block_m=block_m, config=config,
                             interpret=interpret)
  specs = [*x_specs, pl.BlockSpec((bn, kp // 2), lambda j, s: (j, 0)),
           pl.BlockSpec((bn, kp // BLOCK), lambda j, s: (j, 0)), pl.BlockSpec((1,), lambda j, s: (0,))]
  return skinny_call(kernel, [*xs, *row_amax, w.packed, w.block_scale, w.global_scale.reshape(1)], specs,
                     m=m, n=n, dtype=x.dtype, config=config, interpret=interpret, name="nvfp4_matmul")


def check_tensor_core_config(config: MatmulConfig, name: str) -> None:
  """The FP8 and bf16 kernels multiply on the tensor cores only: dot="hfma2" is NVFP4's."""
  if config.dot != "mma":
    raise ValueError(f"{name}: MatmulConfig.dot={config.dot!r} is NVFP4 only (nvfp4_matmul); use 'mma'")


def check_skinny_input(x: jax.Array, shape: tuple[int, ...], name: str) -> None:
  """Shared input checks: x bf16 [M, K] with 1 <= M <= MAX_ROWS against a 2-D [N, K] weight."""
  if x.ndim != 2 or x.dtype != jnp.bfloat16:
    raise ValueError(f"{name}: x must be bf16 [M, K], got {x.dtype} {x.shape}")
  if not 1 <= x.shape[0] <= MAX_ROWS:
    raise ValueError(f"{name}: M must be 1..{MAX_ROWS} (decode rows), got {x.shape[0]}")
  if len(shape) != 2 or shape[1] != x.shape[1]:
    raise ValueError(f"{name}: weight must be [N, K={x.shape[1]}], got logical shape {shape}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def nvfp4_matmul(x: jax.Array, w: NVFP4Weight, *, config: MatmulConfig | None = None,
                 interpret: bool | None = None) -> jax.Array:
  """x @ dequant(w).T with NVFP4 weights decoded in registers, fp32 accumulation.

  Args:
    x: bf16 [M, K], 1 <= M <= 16.
    w: NVFP4Weight of logical shape [N, K] (K a multiple of 16).
    config: tiling; default `default_config(M, N, K)`.
    interpret: run the Pallas interpreter; default: on the CPU backend.
  Returns:
    bf16 [M, N].
  """
  if not isinstance(w, NVFP4Weight):
    raise ValueError(f"nvfp4_matmul needs an NVFP4Weight, got {type(w).__name__}")
  check_skinny_input(x, w.shape, "nvfp4_matmul")
  config = default_config(x.shape[0], *w.shape) if config is None else config
  interpret = resolve_interpret(interpret)
  return _nvfp4_matmul(x, w, config, interpret)


def nvfp4_matmul_reference(x: jax.Array, w: NVFP4Weight) -> jax.Array:
  """fp32 reference: dequantize in fp32, matmul in fp32, cast to x.dtype."""
  return jnp.dot(x.astype(jnp.float32), w.dequantize(jnp.float32).T,
                 precision=lax.Precision.HIGHEST).astype(x.dtype)
