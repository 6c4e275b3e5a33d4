"""NVFP4 decode GEMV on the CUDA cores: MatmulConfig(dot="hfma2") of nvfp4_matmul.

Why: the tensor-core kernel (dot="mma") must move every decoded fp16 weight through shared
memory into the MMA operand layout, 2 bytes a weight against the 0.56 it read from HBM: Nsight
Compute put L1 at 81% of peak and 7.3 instructions a weight there (BENCHMARKS.md run 10). At
M = 1 a tensor core has nothing to share a weight across, so here each thread decodes its own
weights in registers and multiplies them in place with packed fp16 arithmetic: no layout
change, no shared memory, 2.75 instructions a weight (Nsight Compute, run 19).

One PTX program (`BLOCK_FMA_PTX`) per 16-weight scale block: its two 32-bit words of packed
codes become eight fp16x2 registers holding E2M1 * 2^-14 (the fp16 pattern s<<15 | eem<<9 of
nvfp4_matmul, built a byte at a time and spread by prmt: 11 integer instructions a word, against
15 for shifting each pair of nibbles into place), eight HFMA2 take them against the matching
activation pairs and sum the block's 16 products in two fp16 lanes, and the lanes' sum, in
fp32, times the block's e4m3 scale is added to an fp32 accumulator. Numerics: x comes scaled by
f16_rows (largest |x| of the row in [2^14, 2^15)), so a product is at most 12 and exact in fp16
(a 2-bit weight times an 8-bit activation) unless it falls under fp16's normal range (2^-28 of
the row's largest product); each of a lane's seven additions rounds by at most 2^-11 of its
running sum, and everything after the block is fp32. The tests bound the program's result
against exact arithmetic on an emulator of its instructions.

Activations as planes: `decode_word` fixes which two columns of a word each fp16x2 register
holds; `activation_planes` lays x out to match (XLA, outside the kernel: u32 [M, 8, K/16], plane
4h + p of block b the fp16 pair that register p of the block's word h meets), so a program loads
its planes as contiguous rows and broadcasts them down its weight rows. The weight words are the
packed bytes as they are (a u32 view of NVFP4Weight.packed), a block's two words one contiguous
load split in registers (two stride-2 loads took twice as long).

Measured (H200, [1, 8192] x [8192, 28672], own kernel time): 47.1 us at its default tiles (16
x 512, 8 splits, 8 warps; BENCHMARKS.md run 27) against 72 for the tensor-core kernel and 110.5
for XLA's bf16 GEMV, 2.81 TB/s on the bytes read: 2.35x bf16, short of the 2.8x asked (run 19's
tiles, 32 x 512 at 4 splits and 4 warps: 51.5-53.7 us). It is latency-bound,
not instruction-bound: the prmt decode cut instructions by 15% (23.8M -> 20.2M) at the same
time; DRAM runs at 52-56% of peak, warps wait on their loads 55% of the time, and Triton
pipelines only loads that feed a dot. Making it pipeline these (num_stages > 1, loop_stages.py)
gained nothing: 52.0-55.0 us at 2-4 stages against 51.3 bare (run 20).
Tried and dropped (slower, same run): tiles loaded a step ahead in registers (72 -> 140
registers a thread), programs streaming row blocks over one K chunk with the activations loaded
once, other tile shapes. Rows: each row repeats the whole program (M = 2: 86.5 us, slower than
the tensor cores' 71.4), so nvfp4_matmul.HFMA2_MAX_ROWS is 1.

Lowering: Triton (`pltriton.elementwise_inline_asm`), for the same reasons as nvfp4_matmul; the
interpreter cannot run PTX, so there `block_fma_twin` computes the same block sums (the same
decode, fp32 products and sums).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.quant.nvfp4 import BLOCK, NVFP4Weight
from pallas_kernels import loop_stages
from pallas_kernels.nvfp4_matmul import (DECODE_SCALE, MatmulConfig, f16_rows, load_tile, range_mask,
                                         row_inverse_scale, skinny_call, split_k_loop, store_tile)

loop_stages.install()

PLANES = 8         # fp16x2 activation pairs per 16-weight block
SIGNS, MAGNITUDES = 0x80808080, 0x0E0E0E0E
# prmt selectors: bytes 0, 1 (then 2, 3) of a register into the high bytes of two fp16 halves,
# zero bytes (index 4: the immediate 0) below them.
SPREAD = (0x1404, 0x3424)


# The decoded registers in decode_word's order: (nibble register, prmt selector) of each.
_SOURCES = [(s, sel) for s in ("u", "v") for sel in SPREAD]


def nibble_ptx(word: str) -> list[str]:
  """PTX leaving in v (u) the fp16 high bytes of the high (low) nibbles of `word`'s four bytes
  (needs .b32 t, u, v). Per byte, the fp16 high byte of a code is s<<7 | eem<<1 (its low byte
  is 0): for the high nibbles of all four bytes at once, (w & SIGNS) | ((w >> 3) & MAGNITUDES);
  for the low nibbles, the same of w << 4. prmt then spreads two of those bytes into the high
  bytes of an fp16x2 register: 11 integer instructions for 8 weights."""
  return [f"shr.b32 t, {word}, 3; and.b32 t, t, {MAGNITUDES:#x}; and.b32 v, {word}, {SIGNS:#x}; or.b32 v, v, t;",
          f"shl.b32 t, {word}, 1; and.b32 t, t, {MAGNITUDES:#x}; shl.b32 u, {word}, 4; and.b32 u, u, {SIGNS:#x}; "
          "or.b32 u, u, t;"]


def decode_ptx(word: str, regs: list[str]) -> list[str]:
  """PTX decoding code word `word` into the four fp16x2 registers `regs`, in decode_word's order."""
  return [*nibble_ptx(word), *(f"prmt.b32 {d}, {src}, 0, {sel:#x};" for d, (src, sel) in zip(regs, _SOURCES))]


def _word_ptx(word: str, planes: list[str], first: bool) -> str:
  """PTX decoding one code word into four fp16x2 registers and multiplying them into h, each
  register's FMA right after its prmt."""
  fmas = [f"mul.rn.f16x2 h, d, {planes[0]};" if first else f"fma.rn.f16x2 h, d, {planes[0]}, h;",
          *(f"fma.rn.f16x2 h, d, {plane}, h;" for plane in planes[1:])]
  spread = [f"prmt.b32 d, {src}, 0, {sel:#x}; {fma}" for (src, sel), fma in zip(_SOURCES, fmas)]
  return "\n".join([*nibble_ptx(word), *spread])


# $0 = $1 + scale $12 * (sum of the block's 16 products): $2, $3 the block's two code words,
# $4..$11 its activation planes (fp16x2), all .b32; $0, $1, $12 f32.
BLOCK_FMA_PTX = "\n".join([
    "{", ".reg .b32 t, u, v, d, h;", ".reg .b16 lo, hi;", ".reg .f32 fl, fh;",
    *(_word_ptx(f"${2 + h}", [f"${4 + 4 * h + p}" for p in range(4)], first=h == 0) for h in range(2)),
    "mov.b32 {lo, hi}, h; cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi; add.f32 fl, fl, fh;",
    "fma.rn.f32 $0, fl, $12, $1;", "}"])
BLOCK_FMA_CONSTRAINTS = ",".join(["=f", "f", *["r"] * (2 + PLANES), "f"])


def f16_pairs(words: jax.Array) -> jax.Array:
  """u32 [...] -> f32 [..., 2]: the fp16 pair in each word (low half first)."""
  return lax.bitcast_convert_type(words, jnp.float16).astype(jnp.float32)


def decode_word(word: jax.Array) -> list[jax.Array]:
  """u32 code words -> the four fp16x2 registers (as u32) _word_ptx decodes them into, in its
  order: the low nibbles of bytes 0, 1, of bytes 2, 3, then the high nibbles of the same."""
  u32 = jnp.uint32
  v = (word & u32(SIGNS)) | ((word >> 3) & u32(MAGNITUDES))
  u = ((word << 4) & u32(SIGNS)) | ((word << 1) & u32(MAGNITUDES))
  return [d for x in (u, v) for d in (((x & u32(0xFF)) << 8) | ((x & u32(0xFF00)) << 16),
                                      ((x & u32(0xFF0000)) >> 8) | (x & u32(0xFF000000)))]


def block_fma_twin(acc, word0, word1, planes, scale):
  """BLOCK_FMA_PTX in jnp: the same decode, products and sums in fp32 (the interpreter's
  stand-in; it cannot run PTX)."""
  total = jnp.zeros_like(acc)
  for h, word in enumerate((word0, word1)):
    for p, d in enumerate(decode_word(word)):
      total += jnp.sum(f16_pairs(d) * f16_pairs(planes[4 * h + p]), axis=-1)
  return acc + total * scale


def block_fma(acc, word0, word1, planes, scale, *, ptx: bool):
  """acc + scale * (the block's 16 weights . their activations), elementwise over tiles."""
  if not ptx:
    return block_fma_twin(acc, word0, word1, planes, scale)
  [out] = pltriton.elementwise_inline_asm(
      BLOCK_FMA_PTX, args=[acc, word0, word1, *planes, scale], constraints=BLOCK_FMA_CONSTRAINTS,
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, jnp.float32)])
  return out


def plane_pairs(x):
  """[M, K] -> [M, 8, K/16, 2] (a jax or numpy array): plane 4h + p of block b holds the two
  columns that decode_word's register p of the block's word h holds: columns 8h + c of the
  block with c = 4 (p % 2) + 2 q + p // 2 for half q (0 low, 1 high)."""
  m, k = x.shape
  cols = x.reshape(m, k // BLOCK, 2, 2, 2, 2)             # [m, b, h, p % 2, q, p // 2]
  return cols.transpose(0, 2, 5, 3, 1, 4).reshape(m, PLANES, k // BLOCK, 2)


def activation_planes(x16: jax.Array) -> jax.Array:
  """fp16 [M, K] -> u32 [M, 8, K/16]: `plane_pairs`, each pair one word (low half first)."""
  return lax.bitcast_convert_type(plane_pairs(x16), jnp.uint32)


def code_words(packed: jax.Array) -> jax.Array:
  """uint8 [..., N, K/2] packed codes -> u32 [..., N, K/8] (the same bytes, little-endian words)."""
  return lax.bitcast_convert_type(packed.reshape(*packed.shape[:-1], packed.shape[-1] // 4, 4), jnp.uint32)


def load_weights(words_ref, scale_ref, lead: tuple, step, *, blocks: int, rows_ok, cols_ok) -> tuple:
  """K step `step`'s weight tiles (`blocks` scale blocks a row, `cols_ok` their mask; `lead`
  indexes leading dims, an expert id): the blocks' first and second code words (u32 [bn,
  blocks] each, one contiguous load split in registers) and their scales in fp32."""
  words_ok = None if cols_ok is None else jnp.repeat(cols_ok, 2)
  words = load_tile(words_ref.at[(*lead, slice(None), pl.ds(2 * step * blocks, 2 * blocks))], rows_ok, words_ok)
  word0, word1 = (w[..., 0] for w in jnp.split(words.reshape(-1, blocks, 2), 2, axis=2))
  scale = load_tile(scale_ref.at[(*lead, slice(None), pl.ds(step * blocks, blocks))], rows_ok, cols_ok)
  return word0, word1, scale.astype(jnp.float32)


def words_shape(config: MatmulConfig) -> tuple[int, int]:
  """The code-word tile a K step of `load_weights` loads: [block_n, 2 * blocks] u32."""
  return config.block_n, 2 * config.block_k // BLOCK


def widen_word_loads(hint_ref, never) -> None:
  """A bf16 store of zeros into hint_ref (shaped `words_shape`) under `never`, a condition false
  at run time: it never runs, but it steers Triton's layouts. Triton's coalescing gives a load
  the widest vector among the memory ops of its shape that it is connected to, so beside a bf16
  tile of the code words' shape (8 elements to 16 bytes) the word loads take 8 words (32 bytes)
  a thread and split straight into the scales' layout. Without it they take 4, split into 2 a
  thread, and Triton moves them into the scales' layout through shared memory every K step (8
  barriers a step in moe_hfma2's gate/up loop; ptxas: 370 -> 334 SASS instructions, no barrier)."""
  pl.when(never)(lambda: store_tile(hint_ref, jnp.zeros(hint_ref.shape, hint_ref.dtype), None, None))


def load_planes(planes_ref, row, step, *, blocks: int, cols_ok, shape) -> list[jax.Array]:
  """Row `row`'s eight activation planes of K step `step` (planes_ref: activation_planes'
  [rows * 8, K/16]), broadcast to the weight tile's `shape`."""
  return [jnp.broadcast_to(load_tile(planes_ref.at[pl.ds(row * PLANES + i, 1), pl.ds(step * blocks, blocks)],
                                     None, cols_ok), shape) for i in range(PLANES)]


def row_result(acc: jax.Array, global_scale, amax) -> jax.Array:
  """fp32 [bn] outputs from a row's [bn, blocks] block sums: times the per-tensor scale, 2^14
  (DECODE_SCALE) and the inverse f16_rows scale of the row of largest magnitude `amax`."""
  return jnp.sum(acc, axis=1) * (global_scale * DECODE_SCALE) * row_inverse_scale(amax)


def _kernel(planes_ref, amax_ref, words_ref, scale_ref, global_ref, o_ref, *, m: int, n: int, k: int,
            config: MatmulConfig, interpret: bool):
  # planes_ref: u32 [M * 8, Kp/16] (activation_planes, rows flattened); amax_ref: f32 [M]
  # (f16_rows' row maxima); words_ref: u32 [bn, Kp/8]; scale_ref: e4m3 [bn, Kp/16]; global_ref:
  # f32 [1]; o_ref: [block_m, bn] of the [split_k, M, N] output.
  bn, blocks = config.block_n, config.block_k // BLOCK
  n_ok = range_mask(pl.program_id(0) * bn, bn, n)

  def body(step, accs):
    cols_ok = range_mask(step * blocks, blocks, k // BLOCK)
    word0, word1, scale = load_weights(words_ref, scale_ref, (), step, blocks=blocks, rows_ok=n_ok, cols_ok=cols_ok)
    return tuple(block_fma(acc, word0, word1, load_planes(planes_ref, row, step, blocks=blocks, cols_ok=cols_ok,
                                                          shape=(bn, blocks)), scale, ptx=not interpret)
                 for row, acc in enumerate(accs))

  accs = split_k_loop(body, k=k, block_m=m, config=config,
                      init=tuple(jnp.zeros((bn, blocks), jnp.float32) for _ in range(m)))
  for row, acc in enumerate(accs):
    y = row_result(acc, global_ref[0], amax_ref[row])
    store_tile(o_ref.at[pl.ds(row, 1)], y[None].astype(o_ref.dtype), None, n_ok)


def kernel_name(name: str, config: MatmulConfig) -> str:
  """The launch name of a dot="hfma2" kernel: with config.num_stages > 1 one that pipelines its
  K loop's loads that deep (pallas_kernels/loop_stages.py; Triton does not on its own, as
  they feed no dot), else `name` (each step loads, waits, then computes)."""
  return loop_stages.staged_name(name, config.num_stages if config.num_stages > 1 else None)


def hfma2_matmul(x: jax.Array, w: NVFP4Weight, config: MatmulConfig, interpret: bool) -> jax.Array:
  """nvfp4_matmul's dot="hfma2" path (inputs checked there)."""
  (m, k), n = x.shape, w.shape[0]
  bn, bk = config.block_n, config.block_k
  kp = pl.cdiv(k, bk) * bk  # blocks may overhang the arrays: the overhang is masked
  x16, amax = f16_rows(x)
  kernel = functools.partial(_kernel, m=m, n=n, k=k, config=config, interpret=interpret)
  specs = [pl.BlockSpec((m * PLANES, kp // BLOCK), lambda j, s: (0, 0)), pl.BlockSpec((m,), lambda j, s: (0,)),
           pl.BlockSpec((bn, kp // 8), lambda j, s: (j, 0)), pl.BlockSpec((bn, kp // BLOCK), lambda j, s: (j, 0)),
           pl.BlockSpec((1,), lambda j, s: (0,))]
  inputs = [activation_planes(x16).reshape(m * PLANES, k // BLOCK), amax, code_words(w.packed), w.block_scale,
            w.global_scale.reshape(1)]
  return skinny_call(kernel, inputs, specs, m=m, n=n, dtype=x.dtype, config=config, interpret=interpret,
                     name=kernel_name("nvfp4_hfma2", config))
