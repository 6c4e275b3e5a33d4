"""NVFP4 skinny matmul on mma.sync, the weight stored in the MMA's fragment order: y [M, N] =
x [M, K] @ dequant(w [N, K]).T for M <= 8.

Why a third NVFP4 kernel: the other two each pay for something this one does not.
- nvfp4_matmul (tensor cores) leaves the decoded tile's register layout to Triton, which moves
  it into the MMA operand layout through shared memory: 2 bytes a weight past L1 against the
  0.56 read from HBM (Nsight Compute, BENCHMARKS.md run 10): 86 us at M = 5 to 8 for [M, 8192] x
  [8192, 28672] (run 27), 1.36x XLA's bf16 where 2.8x is asked.
- nvfp4_hfma2 (CUDA cores) multiplies each thread's weights in place, but every further row
  repeats its FMAs: M = 2 took 86.5 us.
Here the weight is rearranged once, when loaded (glmjax.quant.fragments: `to_fragments`,
`arrange_params`; the idea of Marlin's int4 layout), so that the 16 bytes a thread loads are
exactly its mma.sync A fragments of four k-steps: each thread decodes its own codes into its own
operand registers, one PTX program (`FRAGMENT_PTX`) scales them and issues the MMAs, and nothing
moves between threads. The tokens are the MMA's N (8), so a weight costs the same from M = 1 to 8.

Layout. Rows in tiles of 16 (m16n8k16's M), inputs in chunks of 128 (8 k-steps of 16), N and K
zero-padded to them (zero codes and scales add nothing). For tile T, chunk c and lane l = 4g + t
of a warp:
- words [Kc, 2, Nt * 128] u32, at [c, h, 128 T + 4 l + j]: the A fragment of k-step i = 4h + j,
  8 codes: byte b = 2 rh + cb holds row g + 8 rh's columns 2t + cb (low nibble) and 2t + 8 + cb
  (high nibble) of the step's 16, so `decode_word` yields mma's registers a0..a3 in order. A
  lane's four words of one h are one 16-byte load; a warp's, 512 contiguous bytes.
- scales [Kc, Nt * 32] u32, at [c, 32 T + 4 g + j]: the e4m3 scales of rows g and g + 8 at
  k-steps 2j and 2j + 1, bytes (s[g, 2j], s[g+8, 2j], s[g, 2j+1], s[g+8, 2j+1]). The four lanes
  of a row group load the same word (a broadcast; nothing is stored twice), so the weight stays
  at 4.5 bits.
- the activations, a few KB a call (`activations_kernel`, one launch; or XLA's f16_rows and
  `fragment_activations`, FragmentConfig.fused_activations): f16_rows' fp16 x padded to 8 rows,
  as [Kc, 4, 128] u32: at [c, a, 4 l + j] the B fragment word of k-step 2a + j // 2 (j % 2: its
  first or second register), the fp16 pair x[g, 16 i + 2t (+ 8) + (0, 1)].
The accumulator is mma's C fragment, 4 fp32 a lane: rows g, g + 8 by tokens 2t, 2t + 1; XLA
sums the K splits and puts them in [M, N] order (`fragment_rows`; or the program stores them
in that order, FragmentConfig.rows_out), then scales (2^14, the per-tensor scale, f16_rows'
inverse).

Numerics: the decode is exact (E2M1 * 2^-14 in fp16, nvfp4_matmul), and so is its product with
the e4m3 scale in fp16 (at most 6 significant bits, at least 2^-24); the MMA multiplies fp16 by
fp16 exactly and accumulates in fp32.

bf16 operands (FragmentWeight.operands="bfloat16", to_fragments(w, "bfloat16"); Runtime's
fragment_operands): the fp16 MMA needs x scaled into fp16's range by its row maximum, which spans
the row, so a launch before the GEMV builds the activation words. On bf16 operands x needs no
scaling and the program reads its rows itself: K is permuted inside each 64-column half-chunk
(lane t's k-steps j take columns 16t + 4j .. + 3, and the codes follow; the MMA's sum does not
care about the order), so a lane's eight activation words of a half are 32 contiguous bytes of
x's row, and all its codes of the half fall in one NVFP4 block: one scale word a lane a chunk,
bytes (s[g, t], s[g+8, t], s[g, 4+t], s[g+8, 4+t]). The decode builds bf16 halves (2^-126 times
the code, 0.5 a bf16 subnormal), times the scale in bf16 carrying 2^118: the product is 2^-8
times the weight, exact (at most 6 significant bits, at least 2^-18), undone in the epilogue.
One launch fewer a call. The codes' bits are moved too (glmjax.quant.fragments.bf16_word_bits),
so that the decode takes 11 PTX instructions a word where fp16's order would take 16 (fp16's own:
9): a call's four k-steps assemble to 88 SASS instructions where fp16's bit order gave 104, and
fp16 operands 80 (ptxas 13.0, sm_90; the cubin's text size in a loads-and-stores kernel, less the
kernel without the call, in steps of 8).

Program: a grid of (tile groups, K splits); each program keeps `tiles` tiles (a multiple of
num_warps, so a warp owns whole tiles) as 1-D [tiles * 128] arrays, whose Triton layout gives
lane l the elements 4l..4l+3 of each 128 (what the PTX, four elements a call, relies on), and
per chunk issues two PTX calls of four k-steps. That layout is Triton's choice, not stated here,
and the CPU interpreter cannot see it: the same program loading the words by computed indices
instead of contiguous `pl.ds` slices, or keeping 2-D [tiles, 128] arrays, came out wrong on the
H200 at most tilings (BENCHMARKS.md run 28, call 9). Check any change to the loads on the GPU
(kernels_bench's max_rel_err column).

Measured (H200, own time, BENCHMARKS.md run 28; XLA's bf16 GEMV 108-114 us in the same run):
[M, 8192] x [8192, 28672] 47.4 us at M = 1 (hfma2: 47.2), 50.2 at M = 5, 51.1 at M = 8 (the
tensor-core kernel: 85.6), 2.24-2.27x bf16; the kernel alone 41.3-42.9 us (76% of copy), the rest
the activations' launch and XLA's epilogue. The gathers' offsets use truncating lax.div / lax.rem:
with jnp's floor // and % Triton could not see their alignment and loaded the activation and scale
words 4 bytes at a time (44.6 us). Latency-bound (Nsight Compute: 70 registers, 28 warps an SM,
most stalls on the loads); tried without gain: registers prefetching the next chunk, two MMA
chains, Triton's pipelining (2x slower), cache hints, bulk prefetches into L2
(FragmentConfig.l2_ahead, run 52). An expert's [6144] -> 2048 and [2048] -> 6144 take 6.4-8.6 us,
as slow as XLA's bf16 or slower: launches, not bytes. Run 30 kept the loads one by one (MMAs
replaced by xors): the weights and scales alone take 34.6 us, the read ceiling (3.82 TB/s); the
activation words, twice a tile's weight bytes and re-read by every tile group, cost 5.5-6.3 us
more. Run 31 shared them between a warp's two tiles (FragmentConfig.tile_groups) and stored the
sums by row (.rows_out), now the default: 46.3-48.4 us own (the launch alone 41.7-42.5),
2.34-2.40x XLA's bf16 in the same call (run 28's default there: 53.2-56.2). What is left is one
launch for the call (the activations launch and the split sum, 4.6-5.9 us) and a faster program.
bf16 operands remove the first; at one K split, FragmentConfig.final_out the second (the program
scales its sums and stores the bf16 result): one launch a call, if one split keeps enough loads in
flight. Not yet timed. Where an epilogue kernel sums the splits itself (the model's folds),
`fragment_matmul_partials` hands it the splits, each scaled by its program, so no XLA epilogue
runs between the two; given weights that share x, it runs them in one launch.

Lowering: Triton (`pltriton.elementwise_inline_asm`): the kernel is loads, two PTX calls and a
store; Mosaic GPU's wgmma wants 64-row operands from shared memory (nvfp4_matmul_mgpu, slower).
The interpreter cannot run PTX: there `fragment_mma_twin` computes the same MMAs in jnp from the
same registers.
"""

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.quant.fragments import CHUNK, LANES, OPERANDS, TILE, WORDS, FragmentWeight, plain_word_bits
from pallas_kernels import loop_stages
from pallas_kernels.checks import check_at_least, check_launch, is_pow2, resolve_interpret
from pallas_kernels.l2_prefetch import prefetch_l2
from pallas_kernels.nvfp4_hfma2 import decode_ptx, decode_word, f16_pairs
from pallas_kernels.nvfp4_matmul import DECODE_SCALE, f16_rows, row_inverse_scale, row_scale

loop_stages.install()

TOKENS = 8         # mma m16n8k16's N: the most activation rows
MMA = {"float16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
       "bfloat16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}
_NEG_ZERO, _TWO_127, _TWO_103 = 0x80008000, 0x7F007F00, 0x73007300  # bf16x2 -0, 2^127, 2^103
# Packed-half instructions take registers, not immediates: the bf16 program first moves these in.
_BF16_CONSTANTS = [".reg .b32 z, k127, k103;", f"mov.b32 z, {_NEG_ZERO:#x}; mov.b32 k127, {_TWO_127:#x}; "
                   f"mov.b32 k103, {_TWO_103:#x};"]
BF16_SCALE = 2.0 ** 8  # undoes the 2^-126 of the decode times the scales' 2^118


def _to_bf16_ptx(r: str) -> str:
  """PTX moving register r's fp16 pair (normal or zero: the scales') to bf16, 2^-112 times the
  values: sign kept, exponent and mantissa moved down 3 bits (e4m3's low 7 mantissa bits in fp16
  are zero)."""
  return f"shr.b32 t, {r}, 3; and.b32 t, t, 0x0FFF0FFF; and.b32 {r}, {r}, {_NEG_ZERO:#x}; or.b32 {r}, {r}, t;"


def _bf16_decode_ptx(word: str, regs: list[str]) -> list[str]:
  """PTX decoding code word `word` (bfloat16's bit order, glmjax.quant.fragments.bf16_word_bits)
  into four bf16x2 registers, decode_word's order, 2^-126 times the codes: a code s e1 e0 m's half
  is s<<15 | e1 e0 m<<6 (exponent e1 e0, mantissa m; e = 0 a subnormal), a high byte s<<7 | e1
  and a low byte e0<<7 | m<<6. Codes 0-3's high bytes are the word's bits 0x81818181 (t), their
  low bytes its bits rotated left by 1 (u); codes 4-7's the word rotated right by 4, and left by 5;
  prmt pairs them: 11 instructions for 8 codes where the plain bit order took 16."""
  rotated = lambda reg, direction, n: f"shf.{direction}.wrap.b32 {reg}, {word}, {word}, {n};"
  high = [f"and.b32 t, {word}, 0x81818181;", f"{rotated('t', 'r', 4)} and.b32 t, t, 0x81818181;"]
  low = [rotated("u", "l", 1), rotated("u", "l", 5)]
  return [line for h, l, (d_lo, d_hi) in zip(high, low, (regs[:2], regs[2:])) for line in (
      h, f"{l} and.b32 u, u, 0xC0C0C0C0;", f"prmt.b32 {d_lo}, t, u, 0x1504; prmt.b32 {d_hi}, t, u, 0x3726;")]


def _scale_ptx(q: int, operands: str) -> list[str]:
  """Byte pair q of s0/s1 (rows g, g + 8's e4m3 scales) into sg, sh, each broadcast: fp16, or
  bf16 times 2^118 (2^-112 from the move, times 2^127 and 2^103: exact powers of two)."""
  to_bf16 = [_to_bf16_ptx("p"), "fma.rn.bf16x2 p, p, k127, z; fma.rn.bf16x2 p, p, k103, z;"
             ] if operands == "bfloat16" else []
  return [f"cvt.rn.f16x2.e4m3x2 p, s{q};", *to_bf16, "mov.b32 {fg, fh}, p; mov.b32 sg, {fg, fg}; mov.b32 sh, {fh, fh};"]


def _step_ptx(i: int, half: int, operands: str) -> list[str]:
  """k-step i (of the chunk's 8) in call `half`: decode its word into the A fragment, scale rows
  g and g + 8 by their e4m3 scales, multiply into the accumulators a0..a3. float16: the decode's
  fp16 (2^-14 times the code) times the step's scale pair (its byte pair of the chunk's words)
  in fp16. bfloat16 (the K-permuted order: one scale pair a half, byte pair `half` of the lane's
  word): the decode's bf16 (2^-126 times the code; 0.5 a subnormal) times the scale's bf16
  (2^118 times it): the product is 2^-8 times the exact weight, at most 6 significant bits."""
  word, j, regs = f"${8 + i % 4}", i % 4, ["d0", "d1", "d2", "d3"]
  b = 16 + 4 * (j // 2) + 2 * (j % 2)
  c = "$4, $5, $6, $7" if j == 0 else "a0, a1, a2, a3"
  if operands == "float16":
    scale = [f"mov.b32 {{s0, s1}}, ${12 + i // 2};"] * (i % 2 == 0) + _scale_ptx(i % 2, operands)
    decode, product = decode_ptx(word, regs), "mul.rn.f16x2 {d}, {d}, {s};"
  else:
    scale = ["mov.b32 {s0, s1}, $12;", *_scale_ptx(half, operands)] if j == 0 else []
    decode, product = _bf16_decode_ptx(word, regs), "fma.rn.bf16x2 {d}, {d}, {s}, z;"
  return [*decode, *scale, *(product.format(d=d, s=s) for d, s in zip(regs, ("sg", "sh") * 2)),
          f"{MMA[operands]} {{a0, a1, a2, a3}}, {{d0, d1, d2, d3}}, {{${b}, ${b + 1}}}, {{{c}}};"]


def fragment_ptx(half: int, operands: str = "float16") -> str:
  """The PTX of one call: k-steps 4 half .. 4 half + 3 of a chunk. Operands (four of each
  array, a lane's): $0-3 the accumulators out (f32), $4-7 in; $8-11 the words of this half;
  $12-15 the chunk's scale words (bfloat16: the lane's one word, four times); $16-19, $20-23 the
  activation words of steps 4 half, +1 and 4 half + 2, +3. The results go to $0-3 last, so no
  input register is overwritten early."""
  return "\n".join([
      "{", ".reg .b32 t, u, v, p, d0, d1, d2, d3, sg, sh;", ".reg .b16 s0, s1, fg, fh;", ".reg .f32 a0, a1, a2, a3;",
      *(_BF16_CONSTANTS if operands == "bfloat16" else []),
      *(line for i in range(4 * half, 4 * half + 4) for line in _step_ptx(i, half, operands)),
      "mov.f32 $0, a0; mov.f32 $1, a1; mov.f32 $2, a2; mov.f32 $3, a3;", "}"])


FRAGMENT_PTX = {operands: tuple(fragment_ptx(half, operands) for half in range(2)) for operands in OPERANDS}
FRAGMENT_CONSTRAINTS = ",".join(["=f"] * 4 + ["f"] * 4 + ["r"] * 16)


def bf16_pairs(words: jax.Array) -> jax.Array:
  """u32 [...] -> f32 [..., 2]: the bf16 pair in each word (low half first)."""
  return lax.bitcast_convert_type(words, jnp.bfloat16).astype(jnp.float32)


PAIRS = {"float16": f16_pairs, "bfloat16": bf16_pairs}


def mma_m16n8k16(a: list[jax.Array], b: list[jax.Array], c: list[jax.Array], operands: str = "float16"
                 ) -> list[jax.Array]:
  """mma.sync m16n8k16 (f16 x f16 + f32, or bf16 operands) on register arrays [..., 32] (a warp's
  lanes last): A's four fp16x2 (bf16x2) registers, B's two, C's four f32 -> D's four f32, in the
  PTX ISA's fragment layouts (lane = 4 g + t; a_r: row g + 8 (r % 2), columns 2t + 8 (r // 2) +
  (0, 1); b_r: k 2t + 8r + (0, 1) of column g; c_r: row g + 8 (r // 2), column 2t + r % 2).
  Products exact, sums in fp32."""
  return mma_chain([r[..., None, :] for r in a], [r[..., None, :] for r in b], c, operands)


def mma_chain(a: list[jax.Array], b: list[jax.Array], c: list[jax.Array], operands: str = "float16"
              ) -> list[jax.Array]:
  """S mma_m16n8k16 in a row on one accumulator, as one product over K = 16 S: a and b's
  registers [..., S, 32] (k-step s's at s), c's [..., 32]. Products exact; the fp32 sums in
  another order than S MMAs in a row (the order inside an MMA is the hardware's anyway)."""
  lead, steps = c[0].shape[:-1], a[0].shape[-2]
  # A [..., s, ch, rh, g, t, p] -> [..., 16, 16 S]; B [..., s, kh, g, t, p] -> [..., 16 S, 8]; C [..., rh, cb, g, t].
  a_mat = jnp.stack([PAIRS[operands](r) for r in a], -3).reshape(*lead, steps, 2, 2, 8, 4, 2)
  a_mat = jnp.moveaxis(a_mat, (-6, -5), (-4, -3)).reshape(*lead, 16, 16 * steps)
  b_mat = jnp.stack([PAIRS[operands](r) for r in b], -3).reshape(*lead, steps, 2, 8, 4, 2)
  b_mat = jnp.moveaxis(b_mat, -3, -1).reshape(*lead, 16 * steps, 8)
  c_mat = jnp.stack(c, -2).reshape(*lead, 2, 2, 8, 4)
  c_mat = jnp.moveaxis(c_mat, -3, -1).reshape(*lead, 16, 8)
  d = jnp.matmul(a_mat, b_mat, precision=lax.Precision.HIGHEST) + c_mat
  d = jnp.moveaxis(d.reshape(*lead, 2, 8, 4, 2), -1, -3).reshape(*lead, 4, 32)
  return [d[..., r, :] for r in range(4)]


def fragment_mma_twin(acc, words, scales, xa, xb, *, half: int, operands: str = "float16") -> jax.Array:
  """FRAGMENT_PTX[operands][half] in jnp, on the kernel's 1-D [tiles * 128] arrays (lane l:
  elements 4l .. 4l + 3 of each 128), its four k-steps at once (mma_chain): the interpreter's
  stand-in. Scaled weights are exact in fp32 as in fp16 or bf16 (bfloat16: 2^-8 times the
  weight, as the PTX's)."""
  lanes = lambda x: jnp.swapaxes(x.reshape(-1, LANES, 4), -1, -2)  # [..., step j, lane]
  acc, words, scales, xa, xb = map(lanes, (acc, words, scales, xa, xb))
  dtype, factor = (jnp.float16, 1.0) if operands == "float16" else (jnp.bfloat16, 2.0 ** 6)  # 2^-14 -> 2^-8
  words = words if operands == "float16" else plain_word_bits(words)
  # Step j's scale pair: float16, byte pair j % 2 of word 2 half + j // 2; bfloat16, pair `half` of word 0.
  word, pair = ((jnp.repeat(scales[..., 2 * half:2 * half + 2, :], 2, axis=-2),
                 lax.broadcasted_iota(jnp.uint32, (4, 1), 0) % 2) if operands == "float16"
                else (scales[..., :1, :], jnp.uint32(half)))
  byte = lambda i: lax.bitcast_convert_type(((word >> (8 * i)) & 0xFF).astype(jnp.uint8),
                                             jnp.float8_e4m3fn).astype(jnp.float32) * factor
  s_g, s_g8 = byte(2 * pair), byte(2 * pair + 1)
  a = [lax.bitcast_convert_type((f16_pairs(d) * s[..., None]).astype(dtype), jnp.uint32)
       for d, s in zip(decode_word(words), (s_g, s_g8, s_g, s_g8))]
  # Step j's B registers: activation array j // 2 (xa, xb), its words 2 (j % 2) and 2 (j % 2) + 1.
  b = [jnp.concatenate([x[..., r::2, :] for x in (xa, xb)], -2) for r in range(2)]
  c = [acc[..., r, :] for r in range(4)]
  return jnp.swapaxes(jnp.stack(mma_chain(a, b, c, operands), -2), -1, -2).reshape(-1)


def fragment_mma(acc, words, scales, xa, xb, *, half: int, ptx: bool, operands: str = "float16") -> jax.Array:
  """acc after the four k-steps of call `half` (fragment_ptx), elementwise over lanes' words."""
  if not ptx:
    return fragment_mma_twin(acc, words, scales, xa, xb, half=half, operands=operands)
  [out] = pltriton.elementwise_inline_asm(
      FRAGMENT_PTX[operands][half], args=[acc, words, scales, xa, xb], constraints=FRAGMENT_CONSTRAINTS, pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, jnp.float32)])
  return out


def fragment_activations(x16: jax.Array, chunks: int) -> jax.Array:
  """fp16 [M, K] (M <= 8) -> u32 [chunks * 4 * 128]: the B fragment words (module docstring)."""
  m, k = x16.shape
  x16 = jnp.pad(x16, ((0, TOKENS - m), (0, chunks * CHUNK - k)))
  pairs = lax.bitcast_convert_type(x16.reshape(TOKENS, -1, 2), jnp.uint32)
  # [g, c, a, ip, b, t] (column pair 64c + 8i + 4b + t, i = 2a + ip) -> [c, a, g, t, ip, b]
  return pairs.reshape(TOKENS, chunks, 4, 2, 2, 4).transpose(1, 2, 0, 5, 3, 4).reshape(-1)


def activation_words(chunks: int) -> int:
  """u32 words of one x's fp16 B fragments over `chunks` chunks (fragment_activations' [Kc, 4, 128])."""
  return chunks * 4 * WORDS


def store_row_words(words_ref, amax_ref, lo, hi, g, p, *, pairs: int, words_base=0, amax_base=0) -> None:
  """Token g's row as fp16 B fragment words (fragment_activations' order, from words_base): lo
  and hi the fp32 halves of its column pairs p (zero past the row), scaled into fp16 by the row's
  largest (f16_rows' scale), which goes to amax_base + g; pairs: the padded row's pair count."""
  amax = jnp.maximum(jnp.max(jnp.abs(lo)), jnp.max(jnp.abs(hi)))
  bits = lambda v: lax.bitcast_convert_type((v * row_scale(amax)).astype(jnp.float16), jnp.uint16).astype(jnp.uint32)
  i = p % 64 // 8  # pair p = 64 c + 8 i + 4 b + t, i = 2 a + ip -> [c, a, g, t, ip, b]
  index = p // 64 * 512 + i // 2 * 128 + g * 16 + p % 4 * 4 + i % 2 * 2 + p % 8 // 4
  pltriton.store(words_ref.at[words_base + index], bits(lo) | (bits(hi) << 16), mask=p < pairs)
  pltriton.store(amax_ref.at[pl.ds(amax_base + g, 1)], jnp.full((1,), amax), mask=jnp.full((1,), True))


def _activations_kernel(x_ref, words_ref, amax_ref, *, m: int, k: int):
  # x_ref bf16 [M * K] (flat, whole); words_ref u32 [Kc * 4 * 128] and amax_ref f32 [8], whole.
  # Program g: token g's row (zeros past M).
  g = pl.program_id(0)
  pairs = words_ref.shape[0] // TOKENS
  p = jnp.arange(pl.next_power_of_2(pairs))
  ok = (p < k // 2) & (g < m)
  lo, hi = (pltriton.load(x_ref.at[g * k + 2 * p + half], mask=ok, other=jnp.bfloat16(0)).astype(jnp.float32)
            for half in range(2))
  store_row_words(words_ref, amax_ref, lo, hi, g, p, pairs=pairs)


def activations_kernel(x: jax.Array, chunks: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """fragment_activations(f16_rows(x)[0], chunks) and the row maxima (f32 [8], zero past M) in
  one launch, a program per token row, instead of XLA's reduce, convert and transpose."""
  m, k = x.shape
  size = activation_words(chunks)
  return pl.pallas_call(
      functools.partial(_activations_kernel, m=m, k=k),
      grid=(TOKENS,),
      in_specs=[pl.BlockSpec((m * k,), lambda g: (0,))],
      out_specs=[pl.BlockSpec((size,), lambda g: (0,)), pl.BlockSpec((TOKENS,), lambda g: (0,))],
      out_shape=[jax.ShapeDtypeStruct((size,), jnp.uint32), jax.ShapeDtypeStruct((TOKENS,), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="nvfp4_fragment_activations",
  )(x.reshape(-1))


def fragment_rows(out: jax.Array, m: int, n: int, splits: int) -> jax.Array:
  """The kernel's fp32 C fragments [splits * 4 * Nt * 32] -> [m, n], the K splits summed. Slab t
  of a split holds lane 4g + t's sums: c_r of tile T at 32 T + 4 g + r is row 16 T + g + 8 (r //
  2), token 2t + r % 2. Only the slabs of the m tokens are read (the kernel writes no others)."""
  slabs = pl.cdiv(m, 2)
  parts = out.reshape(splits, 4, -1, 8, 2, 2)[:, :slabs].sum(0)  # [t, T, g, rh, cb]
  return parts.transpose(0, 4, 1, 3, 2).reshape(2 * slabs, -1)[:m, :n]


@dataclasses.dataclass(frozen=True)
class FragmentConfig:
  """tiles: 16-row tiles a program keeps (a power of two, a multiple of num_warps: each warp
  owns whole tiles); split_k: programs along K; num_warps; num_stages: the K loop's software
  pipelining of its loads (loop_stages.py; 1: none); unroll: chunks whose loads a loop step
  issues before their MMAs (the bytes a warp has in flight); fused_activations: the
  activations' fp16 scaling and fragment order in one launch (activations_kernel), else XLA's
  f16_rows and fragment_activations (three kernels); tile_groups: the program's tiles in this
  many contiguous groups whose MMAs share one load of the activation words (1: a warp loads
  them again for each of its tiles; BENCHMARKS.md run 30 found those loads 5.5-6.3 us of the
  42.8 us kernel, run 31 two tiles a warp sharing them 4.2-4.4 us faster, four or eight
  slower). tiles / tile_groups must be a multiple of num_warps. rows_out: the program stores its
  sums as [split, token, row] (32-byte runs a warp), so XLA's epilogue is a plain sum over the
  splits (run 31: 1.8-2.8 us less a GEMV); else in C fragment order, 16-byte stores, and the
  epilogue also transposes (`fragment_rows`). final_out: the program scales its sums and stores
  the bf16 [M, N] result itself, so the call is one launch with no epilogue after it (bfloat16
  operands, which need no row scale, and split_k = 1 only: a split's sum is not final). Slower
  on the H200 (run 32: one split keeps too few programs in flight; 56.7 against 53.1 us at the
  GEMV, 14.5 against 5.1 at an expert's gate/up), so a switch for ablations, not a default.
  prefetch: the K loop carries the next step's loads, issued before this step's MMAs, so a warp
  keeps its weights in flight while it decodes (without it a step's loads wait for the previous
  step's MMAs); twice the load registers, and the last step's prefetch is discarded: it reads
  chunks of the split that are read anyway (left-over ones, else the last again, clamped), so
  L2 serves one of the two reads. Slower on an H100 (BENCHMARKS.md run 47: 54.4 -> 56.2 us at the
  [1, 8192] x [8192, 28672] GEMV, 215 -> 242 at the MoE): the launches there are bound by the warps
  in flight, and its registers lower the programs an SM holds. A switch for ablations, off.
  wide_x: bfloat16 operands load a lane's runs of 4 words of x's row 16 bytes at a time; off, 4
  bytes at a time. The same values either way, spelt two ways for Triton's alignment analysis,
  which sees the runs only when Lanes.of takes each index from e by one division, then one
  remainder, and the row-end mask compares the column with K / 2 rather than twice the column
  with K. On an H100 (BENCHMARKS.md run 49) wide loads take the GEMV [8, 8192] x [8192, 28672]
  from 60.1 to 53.3-54.6 us and the MoE's gate/up (12 groups) from 150 to 122-124, but M = 1 (whose one
  row few lanes load) from 49.0 to 49.8 and [1, 6144] x [6144, 154880] from 191 to 204, and the
  down launch from 66 to 90; run 50: it wins or ties from 2 rows at six more shapes, but loses at
  [5, 6144] x [6144, 154880] (201 -> 224 us; lm_head, which no policy quantizes). float16
  operands load prepared words, not x's rows, yet their program is faster with Lanes.of's wide
  spelling too (M = 1: 54.2 -> 52.0 us).
  default_fragment_config turns it on from 2 rows and for float16 operands; moe_fragments.DOWN
  keeps it off.
  l2_ahead: chunks ahead of its loads that a program bulk-prefetches into L2 (l2_prefetch.py: each
  loop step the words and scales of the chunks l2_ahead past its own, the first l2_ahead before the
  loop; 0: none), so DRAM has a split's next chunks in flight without registers and the loads wait
  on L2's latency instead. Slower on an H100 at every distance (BENCHMARKS.md run 52: [1, 8192] x
  [8192, 28672] on bf16 operands 50.6 -> 58.4-72.1 us, fp16 53.8 -> 73.9-84.2): 4 ahead, half the
  loads still miss L2 and DRAM reads 14% more bytes at 68% of its peak against 80%; the MoE at
  issue 6's case 205 -> 237-277 us. A switch for the H200, off.
  token_mask: float16 operands: lanes whose token (the MMA's column g) is past M load no
  activation words (a masked load: zeros, as the padding holds), so at M = 1 a program reads an
  eighth of them from L2, 32 more instructions a 4-chunk step (bfloat16 operands mask them
  always). No change on an H100 (BENCHMARKS.md run 52: 53.5 us either way at [1, 8192] x [8192,
  28672]); off."""
  tiles: int = 4
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 1
  unroll: int = 1
  fused_activations: bool = True
  tile_groups: int = 1
  rows_out: bool = False
  final_out: bool = False
  prefetch: bool = False
  wide_x: bool = True
  l2_ahead: int = 0
  token_mask: bool = False

  def __post_init__(self):
    check_at_least("FragmentConfig", "split_k", self.split_k)
    check_at_least("FragmentConfig", "l2_ahead", self.l2_ahead, 0)
    check_at_least("FragmentConfig", "unroll", self.unroll)
    check_at_least("FragmentConfig", "tile_groups", self.tile_groups)
    check_launch("FragmentConfig", self.num_warps, self.num_stages)
    if not is_pow2(self.tiles) or self.tiles % self.num_warps:
      raise ValueError(f"FragmentConfig.tiles must be a power of two and a multiple of num_warps "
                       f"({self.num_warps}), got {self.tiles}")
    if self.tiles % (self.tile_groups * self.num_warps):
      raise ValueError(f"FragmentConfig.tile_groups ({self.tile_groups}) must leave each group a multiple of "
                       f"num_warps ({self.num_warps}) of the {self.tiles} tiles")
    if self.l2_ahead and max(self.l2_ahead, self.unroll) > 16 * self.num_warps:
      raise ValueError(f"FragmentConfig.l2_ahead: a thread prefetches one half-chunk, so {self.num_warps} warps "
                       f"reach {16 * self.num_warps} chunks a call; got l2_ahead={self.l2_ahead}, unroll={self.unroll}")
    if self.final_out and self.split_k != 1:
      raise ValueError(f"FragmentConfig.final_out stores finished sums: it needs split_k=1, got {self.split_k}")


def default_fragment_config(n: int, k: int, m: int = TOKENS, operands: str = "bfloat16") -> FragmentConfig:
  """The tiles measured best on the H200 (BENCHMARKS.md runs 28, 31): 4 tiles a program over 2
  warps for large N (>= 1024 tiles), else 2 over 1, each warp's 2 tiles sharing one load of the
  activations (tile_groups=2); K split in two until there are >= 1024 programs or a split would
  keep < 2 chunks; 2 chunks a loop step where each split keeps >= 4, 4 where 4-tile programs keep
  >= 16 (BENCHMARKS.md run 48, H100: [1, 8192] -> 28672 53.1 -> 50.5 us, at M = 8 67.5 -> 59.7;
  [1, 6144] -> 154880 210.1 -> 192.1; slower at 12 chunks a split, mixed for 2-tile programs);
  sums stored by row; wide_x for m >= 2 rows of x and for float16 operands (run 49)."""
  tiles = pl.cdiv(n, TILE)
  per_program = 4 if tiles >= 1024 else 2
  groups, chunks = pl.cdiv(tiles, per_program), pl.cdiv(k, CHUNK)
  split = 1
  while groups * split < 1024 and chunks // (2 * split) >= 2:
    split *= 2
  per_split = chunks // split
  unroll = 4 if per_program == 4 and per_split >= 16 else 2 if per_split >= 4 else 1
  return FragmentConfig(tiles=per_program, split_k=split, num_warps=per_program // 2, unroll=unroll, tile_groups=2,
                        rows_out=True, wide_x=m > 1 or operands == "float16")


def _kernel(x_ref, *refs, shapes: tuple[tuple[int, int], ...], config: FragmentConfig, scaled: bool, **static):
  # All refs 1-D and whole: x_ref u32 [Kc * 4 * 128] (bfloat16: x's rows as they are, [M * K / 2]
  # bf16 pairs); per weight (shapes: its N and row tiles Nt) words_ref u32 [Kc * 2 * Nt * 128];
  # per weight scales_ref u32 [Kc * Nt * 32]; then o_ref f32 [split_k * 4 * Nt * 32]
  # (fragment_rows), or with rows_out [split_k * 8 * Nt * 16]; or scaled: per weight global_ref
  # f32 [1], (float16) amax_ref f32 [>= M], and per weight o_ref [split_k * M * N] (f32, or bf16
  # with final_out). Several weights (scaled only): grid row block j belongs to one of them.
  w = len(shapes)
  words_refs, scales_refs, refs = refs[:w], refs[w:2 * w], refs[2 * w:]
  global_refs, amax_refs, o_refs = ((refs[:w], refs[w:-w], refs[-w:]) if scaled else ([None], [], refs))
  amax_ref = amax_refs[0] if amax_refs else None
  # Program ids read here, outside pl.when: the interpreter cannot lower them inside one.
  first, row_block, split = 0, pl.program_id(0), pl.program_id(1)
  for (n, tiles), words_ref, scales_ref, global_ref, o_ref in zip(shapes, words_refs, scales_refs, global_refs,
                                                                  o_refs):
    count, block = pl.cdiv(tiles, config.tiles), row_block - first
    program = functools.partial(_program, x_ref, words_ref, scales_ref, global_ref, amax_ref, o_ref, block, split,
                                n=n, tiles=tiles, config=config, scaled=scaled, **static)
    if w == 1:
      program()
    else:
      pl.when((block >= 0) & (block < count))(program)
    first += count


# Truncating integer division (operands >= 0): jnp's floor // and % add sign fix-ups that hide
# from Triton that the lanes' offsets run in aligned groups of 4, and it then loads 4 bytes at a time.
_div, _rem = (functools.partial(lambda op, a, b: op(a, jnp.int32(b)), op) for op in (lax.div, lax.rem))


class Lanes(NamedTuple):
  """Element e of a tile group's [group * 128] arrays: tile e // 128 of the group, lane word e %
  128 (lane 4g + t's register r)."""
  tile: jax.Array
  word: jax.Array
  lane: jax.Array
  g: jax.Array
  t: jax.Array
  r: jax.Array

  @classmethod
  def of(cls, config: "FragmentConfig") -> "Lanes":
    e = jnp.arange(config.tiles // config.tile_groups * WORDS)
    if config.wide_x:  # each index from e by one division, then one remainder (FragmentConfig.wide_x)
      quads = _div(e, 4)
      return cls(_div(e, WORDS), _rem(e, WORDS), _rem(quads, LANES), _rem(_div(e, 16), 8), _rem(quads, 4), _rem(e, 4))
    tile, word = _div(e, WORDS), _rem(e, WORDS)
    lane = _div(word, 4)
    return cls(tile, word, lane, _div(lane, 4), _rem(lane, 4), _rem(e, 4))

  @property
  def token(self) -> jax.Array:  # of the lane's sum r (c_r: row g + 8 (r // 2), token 2t + r % 2)
    return 2 * self.t + _rem(self.r, 2)

  def row(self, start) -> jax.Array:  # of that sum, for the group's first tile `start`
    return (start + self.tile) * TILE + self.g + 8 * _div(self.r, 2)


def group_starts(block, config: "FragmentConfig") -> list:
  """The first tile of each of row block `block`'s tile groups."""
  group = config.tiles // config.tile_groups
  return [block * config.tiles + i * group for i in range(config.tile_groups)]


class FragmentOps(NamedTuple):
  """One program's loads and MMAs over a weight's chunks (fragment_ops): chunk(c, expert, x_base,
  valid) -> chunk c's loads of weight `expert` against x from x_base (valid: a scalar mask, None for
  none: a masked chunk loads zeros, which add nothing); multiply(accs, loads) -> the accs after
  its MMAs; prefetch(first, count, end, expert) -> None, the L2 prefetch of chunks first .. first
  + count - 1 before `end` (FragmentConfig.l2_ahead); the tile groups' first tiles and row masks
  (None: all in range)."""
  chunk: Callable
  multiply: Callable
  prefetch: Callable
  starts: list
  oks: list


def mask_and(a, b):
  """The conjunction of two masks, either None (no mask)."""
  return a if b is None else b if a is None else a & b


def fragment_ops(x_ref, words_ref, scales_ref, block, lanes: Lanes, *, m: int, k: int, tiles: int, chunks: int,
                 config: FragmentConfig, operands: str, interpret: bool) -> FragmentOps:
  """Row block `block`'s loads and MMAs (fragment_sums' refs and tiles; FragmentOps)."""
  group, paired = config.tiles // config.tile_groups, isinstance(words_ref, tuple)
  if paired:
    refs, starts = list(zip(words_ref, scales_ref)), [block * group] * len(words_ref)
  else:
    refs, starts = [(words_ref, scales_ref)] * config.tile_groups, group_starts(block, config)
  size = group * WORDS
  tile, word, lane, g, t, r = lanes
  whole = tiles % (group if paired else config.tiles) == 0
  oks = [None if whole else start + tile < tiles for start in starts]
  # float16: lane 4g + t reads words 4g .. 4g + 3; bfloat16: its own word, four times.
  scale_index = tile * LANES + (g * 4 + r if operands == "float16" else lane)

  def load(ref, index, ok, valid):
    mask = mask_and(ok, None if valid is None else jnp.broadcast_to(valid, tile.shape))
    return pltriton.load(ref.at[index], mask=mask, other=None if mask is None else jnp.uint32(0))

  def activations(c, a, x_base, valid):
    """Activation array a (steps 2a, 2a + 1) of chunk c: prepared words, or (bfloat16) lane 4g +
    t's pairs 8t + 4(a % 2) .. + 3 of token g's half-chunk a // 2 in x's row (zero past M, K)."""
    if operands == "float16":
      return load(x_ref, x_base + (4 * c + a) * WORDS + word, (g < m) if config.token_mask and m < TOKENS else None,
                  valid)
    column = c * (CHUNK // 2) + 32 * (a // 2) + 8 * t + 4 * (a % 2) + r
    # The same row-end test spelt two ways (wide_x), each in the operation order that was timed.
    return load(x_ref, x_base + g * (k // 2) + column,
                (g < m) & ((column < k // 2) if config.wide_x else (2 * column < k)), valid)

  # Where things start, in u32 words (the layout in the module docstring), for the loads and the
  # L2 prefetches alike: weight `expert`'s words and scales (bases), and from those, chunk c's
  # words' half h and its scales at row tile `start`.
  bases = lambda expert: (expert * (chunks * 2 * tiles * WORDS), expert * (chunks * tiles * LANES))
  word_offset = lambda base, c, h, start: base + (2 * c + h) * tiles * WORDS + start * WORDS
  scale_offset = lambda base, c, start: base + c * tiles * LANES + start * LANES

  def chunk(c, expert=0, x_base=0, valid=None) -> tuple:
    """Chunk c's loads: per group the two halves' words and the scale words; the four
    activation arrays, once."""
    words_base, scales_base = bases(expert)
    words = [[load(words, pl.ds(word_offset(words_base, c, h, start), size), ok, valid) for h in range(2)]
             for (words, _), start, ok in zip(refs, starts, oks)]
    scales = [load(scales, scale_offset(scales_base, c, start) + scale_index, ok, valid)
              for (_, scales), start, ok in zip(refs, starts, oks)]
    return words, scales, [activations(c, a, x_base, valid) for a in range(4)]

  def multiply(accs, loads) -> tuple:
    words, scales, xs = loads
    accs = list(accs)
    for i in range(config.tile_groups):
      for h in range(2):
        accs[i] = fragment_mma(accs[i], words[i][h], scales[i], xs[2 * h], xs[2 * h + 1], half=h, ptx=not interpret,
                               operands=operands)
    return tuple(accs)

  # The prefetches' spans: per ref, its first tile and tile count (a program's tiles are contiguous);
  # a u32 word is 4 bytes.
  first_tile = block * (group if paired else config.tiles)
  span = jnp.minimum(group if paired else config.tiles, tiles - first_tile)

  def prefetch(first, count, end, expert=0) -> None:
    words_base, scales_base = bases(expert)

    def words_item(item):  # item 2u + h: half h of chunk first + u
      c = first + item // 2
      return (word_offset(words_base, c, item % 2, first_tile),
              jnp.where((item < 2 * count) & (c < end), span * WORDS * 4, 0))

    def scales_item(item):  # item u: chunk first + u
      c = first + item
      return scale_offset(scales_base, c, first_tile), jnp.where((item < count) & (c < end), span * LANES * 4, 0)

    for words, scales in (refs if paired else refs[:1]):
      prefetch_l2(words, words_item, num_warps=config.num_warps)
      prefetch_l2(scales, scales_item, num_warps=config.num_warps)

  return FragmentOps(chunk, multiply, prefetch, starts, oks)


def split_size(chunks: int, config: FragmentConfig) -> int:
  """Chunks a K split holds (the last ones may hold fewer, or none: split_chunks)."""
  return pl.cdiv(chunks, config.split_k)


def split_chunks(split, chunks: int, config: FragmentConfig) -> tuple:
  """(begin, end): K split `split`'s chunks."""
  begin = split * split_size(chunks, config)
  return begin, jnp.minimum(begin + split_size(chunks, config), chunks)


def zero_sums(config: FragmentConfig) -> tuple:
  """A program's fp32 sums before any chunk: one [group * 128] array a tile group."""
  return (jnp.zeros((config.tiles // config.tile_groups * WORDS,), jnp.float32),) * config.tile_groups


def fragment_sums(x_ref, words_ref, scales_ref, block, split, lanes: Lanes, *, m: int, k: int, tiles: int,
                  chunks: int, config: FragmentConfig, operands: str, interpret: bool, expert=0, x_base=0
                  ) -> tuple[tuple[jax.Array, ...], list, list]:
  """Row block `block` and K split `split` of one weight of `tiles` row tiles: the fp32 sums
  (one [group * 128] array a tile group, mma's C fragments), the groups' first tiles and their
  row masks (None: all in range). The program's tiles in config.tile_groups contiguous groups,
  whose MMAs share one load of the activation words. Given tuples of refs instead, one weight a
  group (each of `tiles` tiles): block `block` of group-sized blocks, the same rows of each.
  words_ref and scales_ref may stack several such weights: `expert` picks one. x_ref's elements
  from `x_base` are x (bfloat16 operands: its rows; float16: its prepared activation words)."""
  ops = fragment_ops(x_ref, words_ref, scales_ref, block, lanes, m=m, k=k, tiles=tiles, chunks=chunks, config=config,
                     operands=operands, interpret=interpret)
  chunk = functools.partial(ops.chunk, expert=expert, x_base=x_base)

  def step_loads(s) -> list:  # step s's config.unroll chunks (past the split: its last chunk again)
    return [chunk(jnp.minimum(begin + s * config.unroll + u, end - 1)) for u in range(config.unroll)]

  def l2_prefetch(first, count):  # FragmentConfig.l2_ahead's prefetches
    if config.l2_ahead:
      ops.prefetch(first, count, end, expert)

  def step(s, accs):  # the step's loads, then their MMAs
    l2_prefetch(begin + s * config.unroll + config.l2_ahead, config.unroll)
    for chunk_loads in step_loads(s):
      accs = ops.multiply(accs, chunk_loads)
    return accs

  def prefetched_step(s, carry):  # the next step's loads, then this step's MMAs
    accs, loads = carry
    l2_prefetch(begin + (s + 1) * config.unroll + config.l2_ahead, config.unroll)
    ahead = step_loads(s + 1)
    for chunk_loads in loads:
      accs = ops.multiply(accs, chunk_loads)
    return accs, ahead

  begin, end = split_chunks(split, chunks, config)
  steps = jnp.maximum(end - begin, 0) // config.unroll
  accs = zero_sums(config)
  l2_prefetch(begin, config.l2_ahead)
  if config.prefetch:
    accs, _ = lax.fori_loop(0, steps, prefetched_step, (accs, step_loads(0)))
  else:
    accs = lax.fori_loop(0, steps, step, accs)
  accs = lax.fori_loop(begin + steps * config.unroll, end, lambda c, accs: ops.multiply(accs, chunk(c)), accs)
  return accs, ops.starts, ops.oks


def operand_scale(amax_ref, lanes: Lanes, *, m: int, operands: str, base=0):
  """Per lane, what undoes the operands' scaling of its sums: bfloat16, the decode's 2^-8
  (BF16_SCALE); float16, the decode's 2^-14 and f16_rows' row scale of the lane's token, whose
  row maximum is at amax_ref[base + token]."""
  if operands == "bfloat16":
    return BF16_SCALE
  amax = pltriton.load(amax_ref.at[base + jnp.minimum(lanes.token, m - 1)])
  return DECODE_SCALE * row_inverse_scale(amax)


def store_rows(o_ref, accs, starts, lanes: Lanes, factor, *, m: int, n: int, base=0) -> None:
  """Each group's sums times `factor` (a scalar or per lane) at [token, row] of the [M, N] slab
  that starts at `base` of o_ref (in o_ref's dtype), tokens < m and rows < n only."""
  for start, acc in zip(starts, accs):
    token, row = lanes.token, lanes.row(start)
    keep = (token < m) & (row < n)
    _masked_store(o_ref, base + token * n + row, (acc * factor).astype(o_ref.dtype), keep)


def _masked_store(o_ref, index, value, keep) -> None:
  # Masked lanes point past the end: their in-range index could be a stored lane's (a row past N
  # is the next token's), and the interpreter's masked store writes back what it read there.
  pltriton.store(o_ref.at[jnp.where(keep, index, o_ref.shape[0])], value, mask=keep)


def _program(x_ref, words_ref, scales_ref, global_ref, amax_ref, o_ref, block, split, *, m: int, n: int, k: int,
             tiles: int, chunks: int, config: FragmentConfig, operands: str, scaled: bool, interpret: bool):
  """Row block `block` and K split `split` of one weight (_kernel's refs, one of each; global_ref
  and amax_ref only when scaled, amax_ref only for float16): fragment_sums, then the stores."""
  lanes = Lanes.of(config)
  accs, starts, oks = fragment_sums(x_ref, words_ref, scales_ref, block, split, lanes, m=m, k=k, tiles=tiles,
                                    chunks=chunks, config=config, operands=operands, interpret=interpret)
  # scaled: times the epilogue's scale, at [split, token, row], rows < N; rows_out: at [split,
  # token, row] of the padded rows; else slab t of this split at 32 T + 4g + r. Padding tokens'
  # sums (token >= m; whole slabs: 2t >= m) are not written.
  if scaled:
    factor = global_ref[0] * operand_scale(amax_ref, lanes, m=m, operands=operands)
    store_rows(o_ref, accs, starts, lanes, factor, m=m, n=n, base=split * m * n)
    return
  if config.rows_out:
    keep = lanes.token < m
    index = lambda start: (split * TOKENS + lanes.token) * (tiles * TILE) + lanes.row(start)
  else:
    keep = lanes.t < pl.cdiv(m, 2)
    index = lambda start: ((split * 4 + lanes.t) * tiles * LANES + (start + lanes.tile) * LANES + lanes.g * 4
                           + lanes.r)
  for start, ok, acc in zip(starts, oks, accs):
    _masked_store(o_ref, index(start), acc, keep if ok is None else keep & ok)


def _check_x(x: jax.Array, w: FragmentWeight, name: str) -> None:
  if w.ndim != 2:
    raise ValueError(f"{name}: one [N, K] weight, got stacked experts {w.shape} (moe_fragments runs those)")
  n, k = w.shape
  if x.ndim != 2 or x.dtype != jnp.bfloat16 or x.shape[1] != k or not 1 <= x.shape[0] <= TOKENS:
    raise ValueError(f"{name}: x must be bf16 [M, {k}] with 1 <= M <= {TOKENS}, got {x.dtype}{list(x.shape)}")


def _launch(x: jax.Array, ws: tuple[FragmentWeight, ...], config: FragmentConfig, interpret: bool, scaled: bool):
  """The GEMV's launch (and the activations' before it, for fp16 operands) for weights sharing x
  (several: scaled only). scaled: the programs apply the epilogue's scale and store [split_k * M
  * N] per weight (bf16 with final_out, else f32): returns those; else (one weight) the kernel's
  fp32 sums and the epilogue's scale [M, 1]."""
  (_, k), m = ws[0].shape, x.shape[0]
  chunks, operands = ws[0].scales.shape[0], ws[0].operands
  if operands == "bfloat16":
    activations, scale = lax.bitcast_convert_type(x.reshape(m, k // 2, 2), jnp.uint32).reshape(-1), BF16_SCALE
    row_maxima = []
  else:
    if config.fused_activations:
      activations, amax = activations_kernel(x, chunks, interpret)
    else:
      x16, amax = f16_rows(x)
      activations = fragment_activations(x16, chunks)
    scale, row_maxima = DECODE_SCALE * row_inverse_scale(amax[:m])[:, None], [amax]
  inputs = [activations, *(w.words.reshape(-1) for w in ws), *(w.scales.reshape(-1) for w in ws)]
  out_shapes = [jax.ShapeDtypeStruct((config.split_k * ws[0].tiles * WORDS,), jnp.float32)]  # 4 slabs of 32 a tile
  if scaled:  # the scalars reshaped, no XLA op: the programs compute their factors themselves
    inputs += [*(w.global_scale.reshape(1) for w in ws), *row_maxima]
    out_shapes = [jax.ShapeDtypeStruct((config.split_k * m * w.shape[0],), x.dtype if config.final_out else jnp.float32)
                  for w in ws]
  whole = lambda shape: pl.BlockSpec(shape, lambda j, s: (0,))
  outs = pl.pallas_call(
      functools.partial(_kernel, shapes=tuple((w.shape[0], w.tiles) for w in ws), m=m, k=k, chunks=chunks,
                        config=config, operands=operands, scaled=scaled, interpret=interpret),
      grid=(sum(pl.cdiv(w.tiles, config.tiles) for w in ws), config.split_k),
      in_specs=[whole(a.shape) for a in inputs],
      out_specs=[whole(o.shape) for o in out_shapes],
      out_shape=out_shapes,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name=loop_stages.staged_name("nvfp4_fragments", config.num_stages if config.num_stages > 1 else None),
  )(*inputs)
  return outs if scaled else (outs[0], scale)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fragment_matmul(x: jax.Array, w: FragmentWeight, *, config: FragmentConfig | None = None,
                    interpret: bool | None = None) -> jax.Array:
  """x bf16 [M, K] (M <= 8) @ dequant(w).T -> bf16 [M, N], w from to_fragments. Its operands
  decide the program: float16 scales x's rows into fp16 (activations_kernel, or XLA's f16_rows
  with config.fused_activations off); bfloat16 reads x's rows itself (no launch before it)."""
  _check_x(x, w, "fragment_matmul")
  (n, k), m = w.shape, x.shape[0]
  config = config or default_fragment_config(n, k, m, w.operands)
  if config.final_out and w.operands != "bfloat16":
    raise ValueError("FragmentConfig.final_out needs bfloat16 operands (to_fragments(w, 'bfloat16')): fp16 "
                     "operands scale each row by its maximum, which the activations' launch finds")
  interpret = resolve_interpret(interpret)
  if config.final_out:
    return _launch(x, (w,), config, interpret, scaled=True)[0].reshape(m, n)
  out, scale = _launch(x, (w,), config, interpret, scaled=False)
  if config.rows_out:
    y = out.reshape(config.split_k, TOKENS, w.tiles * TILE)[:, :m, :n].sum(0)
  else:
    y = fragment_rows(out, m, n, config.split_k)
  return (y * w.global_scale * scale).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("split_k", "config", "interpret"))
def fragment_matmul_partials(x: jax.Array, w: FragmentWeight | tuple[FragmentWeight, ...], *,
                             split_k: int | None = None, config: FragmentConfig | None = None,
                             interpret: bool | None = None) -> jax.Array | tuple[jax.Array, ...]:
  """fragment_matmul's K splits, each scaled by the program, unsummed: fp32 [S, M, N] whose sum
  is x @ dequant(w).T (up to fp32 rounding), for a kernel that sums them in its own launch
  (pallas_kernels/residual_norm.py, mla_epilogue.py, mla_query.py), so no XLA epilogue runs. A
  tuple of weights that share x (one K, one operand dtype): one launch whose row blocks run over
  all of them, a tuple of partials, each as its own launch's.
  split_k: S (default: the config's); config: default `default_fragment_config` of the weights'
  rows together."""
  ws = w if isinstance(w, tuple) else (w,)
  for weight in ws:
    _check_x(x, weight, "fragment_matmul_partials")
  if len({weight.operands for weight in ws}) > 1:
    raise ValueError(f"fragment_matmul_partials: one launch takes one operand dtype, got "
                     f"{[weight.operands for weight in ws]}")
  config = config or default_fragment_config(sum(weight.shape[0] for weight in ws), x.shape[1], x.shape[0],
                                             ws[0].operands)
  config = dataclasses.replace(config, split_k=split_k or config.split_k, rows_out=False, final_out=False)
  outs = _launch(x, ws, config, resolve_interpret(interpret), scaled=True)
  outs = tuple(out.reshape(config.split_k, x.shape[0], weight.shape[0]) for out, weight in zip(outs, ws))
  return outs if isinstance(w, tuple) else outs[0]
