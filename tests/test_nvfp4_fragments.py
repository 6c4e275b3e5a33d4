"""The NVFP4 fragment-order kernel (pallas_kernels/nvfp4_fragments.py): the MMA's fragment layouts
against plain matrices, the weight layout against its description, the PTX program (emulated)
against the jnp twin the interpreter runs, the kernel against the fp32 reference, its errors, and
its lowering for an H200; the PTX assembled by ptxas where one is installed."""

import dataclasses
import functools
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glmjax.quant import FragmentWeight, NVFP4Weight, arrange_params, from_fragments, quantize_fp8_block, to_fragments
from glmjax.quant.fragments import OPERANDS, operands_for
from glmjax.quant.nvfp4 import quantize_nvfp4, unpack_e2m1
from pallas_kernels.nvfp4_fragments import (FRAGMENT_PTX, FragmentConfig, Lanes, activations_kernel,
                                            default_fragment_config, fragment_activations, fragment_matmul,
                                            fragment_matmul_partials, fragment_mma_twin, mma_m16n8k16)
from pallas_kernels.nvfp4_matmul import f16_rows, nvfp4_matmul_reference
from tests.fragment_checks import assert_same_product, fragment_case
from tests.h200_lowering import TRITON_CALL, h200_text
from tests.ptx_emulator import f32_value, run_ptx

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


def _pairs(values: np.ndarray, operands: str = "float16") -> np.ndarray:
  """fp16 (bf16) values [..., 2] -> their u32 registers (element 0 in the low half)."""
  return values.astype(np.float16 if operands == "float16" else ml_dtypes.bfloat16).view(np.uint32)[..., 0]


@pytest.mark.parametrize("operands", OPERANDS)
def test_mma_fragments_match_plain_matrices(operands):
  """mma_m16n8k16's reading of the registers, lane by lane from the PTX ISA's tables (lane =
  4 g + t): D = A B + C for random matrices."""
  rng = np.random.default_rng(0)
  warps = 3
  dtype = np.float16 if operands == "float16" else ml_dtypes.bfloat16
  a = rng.standard_normal((warps, 16, 16)).astype(dtype)
  b = rng.standard_normal((warps, 16, 8)).astype(dtype)
  c = rng.standard_normal((warps, 16, 8)).astype(np.float32)
  g, t = np.arange(32) // 4, np.arange(32) % 4
  a_regs = [_pairs(np.stack([a[:, g + 8 * (r % 2), 2 * t + 8 * (r // 2) + p] for p in (0, 1)], -1), operands)
            for r in range(4)]
  b_regs = [_pairs(np.stack([b[:, 2 * t + 8 * r + p, g] for p in (0, 1)], -1), operands) for r in range(2)]
  c_regs = [c[:, g + 8 * (r // 2), 2 * t + r % 2] for r in range(4)]
  d = mma_m16n8k16(*([jnp.asarray(x) for x in regs] for regs in (a_regs, b_regs, c_regs)), operands)
  want = a.astype(np.float64) @ b.astype(np.float64) + c
  for r in range(4):
    np.testing.assert_allclose(np.asarray(d[r]), want[:, g + 8 * (r // 2), 2 * t + r % 2], rtol=1e-6, atol=1e-6)


def test_to_fragments_layout():
  """Every word and scale byte where the module docstring puts it: word [c, h, 128 T + 4 l + j]
  byte 2 rh + cb holds row 16 T + g + 8 rh's codes at columns 128 c + 16 i + 2t + cb (low
  nibble) and + 8 (high), i = 4h + j; scale word [c, 32 T + 4 g + j] byte 2 q + rh the scale of
  row 16 T + g + 8 rh at block 8 c + 2 j + q. N and K padded with zeros."""
  n, k = 40, 272  # 3 tiles (the last half padding), 3 chunks (the last mostly padding)
  w = quantize_nvfp4(jnp.asarray(np.random.default_rng(1).standard_normal((n, k)), jnp.float32))
  f = to_fragments(w)
  codes = np.zeros((48, 384), np.uint8)
  codes[:n, :k] = np.asarray(unpack_e2m1(w.packed))
  scales = np.zeros((48, 24), np.uint8)
  scales[:n, :k // 16] = np.asarray(w.block_scale).view(np.uint8)
  words, scale_words = np.asarray(f.words).view(np.uint8), np.asarray(f.scales).view(np.uint8)
  assert words.shape == (3, 2, 3 * 128 * 4) and scale_words.shape == (3, 3 * 32 * 4)
  for c, h, tile, lane, j, rh, cb in np.ndindex(3, 2, 3, 32, 4, 2, 2):
    g, t, i = lane // 4, lane % 4, 4 * h + j
    row, col = 16 * tile + g + 8 * rh, 128 * c + 16 * i + 2 * t + cb
    byte = words[c, h, 4 * (128 * tile + 4 * lane + j) + 2 * rh + cb]
    assert (byte & 0xF, byte >> 4) == (codes[row, col], codes[row, col + 8])
  for c, tile, g, j, q, rh in np.ndindex(3, 3, 8, 4, 2, 2):
    assert scale_words[c, 4 * (32 * tile + 4 * g + j) + 2 * q + rh] == scales[16 * tile + g + 8 * rh, 8 * c + 2 * j + q]
  # bfloat16: K permuted inside each half-chunk. Lane 4g + t's word j of half h holds columns
  # 128 c + 64 h + 16 t + 4 j + cb and + 2, all of block 8 c + 4 h + t, whose scales (rows g,
  # g + 8) are bytes 2h, 2h + 1 of the lane's own word 32 T + 4 g + t; the codes' bits moved:
  # with b = 2 rh + cb, column col's s e1 e0 m at bits 8b + (7, 0, 6, 5), col + 2's at 8b +
  # (11 mod 32, 4, 2, 1).
  f = to_fragments(w, "bfloat16")
  words, scale_words = np.asarray(f.words), np.asarray(f.scales).view(np.uint8)
  code = lambda word, bits: sum(((int(word) >> p) & 1) << q for q, p in zip((3, 2, 1, 0), bits))
  for c, h, tile, lane, j, rh, cb in np.ndindex(3, 2, 3, 32, 4, 2, 2):
    g, t, b = lane // 4, lane % 4, 2 * rh + cb
    row, col = 16 * tile + g + 8 * rh, 128 * c + 64 * h + 16 * t + 4 * j + cb
    word = words[c, h, 128 * tile + 4 * lane + j]
    assert code(word, [8 * b + p for p in (7, 0, 6, 5)]) == codes[row, col]
    assert code(word, [(8 * b + p) % 32 for p in (11, 4, 2, 1)]) == codes[row, col + 2]
  for c, tile, g, t, h, rh in np.ndindex(3, 3, 8, 4, 2, 2):
    assert scale_words[c, 4 * (32 * tile + 4 * g + t) + 2 * h + rh] == scales[16 * tile + g + 8 * rh, 8 * c + 4 * h + t]


def _bytes(a) -> bytes:
  a = np.asarray(a)
  return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def _nvfp4_bytes(w: NVFP4Weight) -> list[bytes]:
  return [_bytes(getattr(w, field)) for field in ("packed", "block_scale", "global_scale", "input_scale")]


@pytest.mark.parametrize("operands", OPERANDS)
@pytest.mark.parametrize("n, k", [(40, 272), (16, 128), (33, 16), (130, 400)])
def test_from_fragments_inverts_to_fragments(n, k, operands):
  """ModelOpt's arrays back bit for bit (the padding dropped), from random weights with zero
  rows, zero blocks, both signs and a calibrated input scale; the same dequantized values."""
  rng = np.random.default_rng(n + k)
  w = rng.standard_normal((n, k)) * np.exp(rng.uniform(-8, 4, (n, 1)))
  w[n // 2] = 0
  w[:, :16] = 0
  q = quantize_nvfp4(jnp.asarray(w, jnp.float32), jnp.float32(0.37))
  f = to_fragments(q, operands)
  rows, cols = -(-n // 16) * 16, -(-k // 128) * 128  # padded to whole tiles and chunks, still 4.5 bits a weight
  assert f.shape == (n, k) and f.operands == operands and f.nbytes == rows * cols * 9 // 16 + 8
  assert _nvfp4_bytes(from_fragments(f)) == _nvfp4_bytes(q)
  np.testing.assert_array_equal(np.asarray(f.dequantize(jnp.float32)), np.asarray(q.dequantize(jnp.float32)))


def test_arrange_params_moves_only_2d_nvfp4_weights():
  """fragments=True: the 2-D NVFP4 weights in fragment order; stacked NVFP4 experts, MLA's kv_b,
  FP8 and plain leaves untouched. fragments=False: everything back as it was, bit for bit."""
  rng = np.random.default_rng(3)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  params = {"attn": {"weight": quantize_nvfp4(draw(48, 160))}, "fp8": {"weight": quantize_fp8_block(draw(32, 64))},
            "experts": {"gate_proj": quantize_nvfp4(draw(3, 32, 64))}, "norm": {"weight": draw(64)},
            "kv_b_proj": {"weight": quantize_nvfp4(draw(64, 32))}}  # RAW: read whole by the model
  arranged = arrange_params(params, fragments=True, operands="float16")
  assert isinstance(arranged["attn"]["weight"], FragmentWeight) and arranged["attn"]["weight"].shape == (48, 160)
  for path in (("fp8", "weight"), ("experts", "gate_proj"), ("norm", "weight"), ("kv_b_proj", "weight")):
    a, b = params[path[0]][path[1]], arranged[path[0]][path[1]]
    assert type(a) is type(b) and jax.tree.map(_bytes, a) == jax.tree.map(_bytes, b)
  assert arrange_params(arranged, fragments=True, operands="float16") is arranged  # already so: nothing to do
  back = arrange_params(arranged, fragments=False)
  assert _nvfp4_bytes(back["attn"]["weight"]) == _nvfp4_bytes(params["attn"]["weight"])
  # The other operands' order: the fragment weights re-arranged, the same codes underneath.
  bf16 = arrange_params(arranged, fragments=True, operands="bfloat16")
  assert bf16["attn"]["weight"].operands == "bfloat16" and bf16["fp8"]["weight"] is arranged["fp8"]["weight"]
  assert _nvfp4_bytes(from_fragments(bf16["attn"]["weight"])) == _nvfp4_bytes(params["attn"]["weight"])
  assert arrange_params(bf16, fragments=True, operands="float16")["attn"]["weight"].operands == "float16"
  # The default is Runtime's, "auto": these small weights take bf16.
  assert arrange_params(params, fragments=True)["attn"]["weight"].operands == "bfloat16"


def test_auto_operands_follow_each_weights_size(monkeypatch):
  """operands="auto": bf16 operands up to AUTO_BF16_MAX_WEIGHTS weights, fp16 above, weight by
  weight (a weight already arranged for the other dtype is moved); a bad choice is a clear error."""
  assert operands_for((4096, 8192), "auto") == "bfloat16"         # 2^25: at the bound
  assert operands_for((4097, 8192), "auto") == "float16"
  assert operands_for((28672, 8192), "float16") == "float16"
  rng = np.random.default_rng(4)
  draw = lambda *shape: quantize_nvfp4(jnp.asarray(rng.standard_normal(shape), jnp.float32))
  params = {"small": {"weight": draw(16, 64)}, "large": {"weight": draw(48, 160)}}
  monkeypatch.setattr("glmjax.quant.fragments.AUTO_BF16_MAX_WEIGHTS", 16 * 64)
  auto = arrange_params(params, fragments=True, operands="auto")
  assert auto["small"]["weight"].operands == "bfloat16" and auto["large"]["weight"].operands == "float16"
  assert arrange_params(auto, fragments=True, operands="auto") is auto
  moved = arrange_params(arrange_params(params, fragments=True, operands="bfloat16"), fragments=True, operands="auto")
  assert moved["large"]["weight"].operands == "float16"
  assert _nvfp4_bytes(from_fragments(moved["large"]["weight"])) == _nvfp4_bytes(params["large"]["weight"])
  with pytest.raises(ValueError, match="fragment operands must be one of"):
    arrange_params(params, fragments=True, operands="fp8")


def _e4m3_bytes(rng, shape) -> np.ndarray:
  """Random e4m3 scale bytes, any sign and exponent, never NaN (0x7F, 0xFF)."""
  b = rng.integers(0, 256, shape, dtype=np.uint32)
  return np.where((b & 0x7F) == 0x7F, b ^ 1, b)


@pytest.mark.parametrize("operands", OPERANDS)
@pytest.mark.parametrize("half", [0, 1])
def test_fragment_ptx_equals_its_twin(half, operands):
  """FRAGMENT_PTX[operands][half], emulated over 3 warps' lanes, against fragment_mma_twin on the
  same registers (every code, every scale but NaN, activations up to 2^14; bf16 ones down to
  2^-20): the decode, the scale pairing and the operand wiring agree (fp32 sums in either
  order)."""
  rng = np.random.default_rng(2 + half)
  size = 3 * 128
  words = rng.integers(0, 2 ** 32, size, dtype=np.uint32)
  scales = sum(_e4m3_bytes(rng, size) << (8 * i) for i in range(4)).astype(np.uint32)
  low = 0 if operands == "float16" else -20
  x = rng.standard_normal((2, size, 2)) * 2.0 ** rng.integers(low, 14, (2, size, 1))
  xa, xb = (_pairs(v, operands) for v in x)
  acc = rng.standard_normal(size).astype(np.float32)
  lanes = lambda v, j: v.reshape(-1, 4)[:, j]
  registers = {f"${4 + 4 * a + j}": lanes(v, j) for a, v in enumerate([acc.view(np.uint32), words, scales, xa, xb])
               for j in range(4)}
  regs = run_ptx(FRAGMENT_PTX[operands][half], registers)
  got = np.stack([f32_value(regs[f"${r}"]) for r in range(4)], -1).reshape(-1)
  twin = np.asarray(fragment_mma_twin(*(jnp.asarray(v) for v in (acc, words, scales, xa, xb)), half=half,
                                      operands=operands))
  scale = np.abs(twin).max()
  assert scale > 1.0
  np.testing.assert_allclose(got, twin, rtol=0, atol=1e-6 * scale)


# The operand dtype alternates over the cases (each dtype meets every shape but 2 x 64 x 384): only
# the MMA differs with it, and its PTX and twin are checked per dtype above.
@pytest.mark.parametrize("m, n, k, config, operands", [
    (1, 64, 128, None, "float16"),
    (3, 200, 272, FragmentConfig(tiles=4, split_k=2, num_warps=2), "bfloat16"),        # tiles overhang N, K padded
    # an unrolled pair and a left-over chunk
    (8, 136, 640, FragmentConfig(tiles=2, split_k=2, num_warps=1, unroll=2), "float16"),
    (5, 48, 256, FragmentConfig(tiles=2, split_k=3, num_warps=2), "bfloat16"),         # a split with no chunk
    (2, 64, 384, FragmentConfig(tiles=2, num_warps=1, fused_activations=False), "float16"),  # XLA's activations
    (3, 200, 272, FragmentConfig(tiles=4, split_k=2, num_warps=2, tile_groups=2), "float16"),  # a group wholly past N
    (8, 136, 640, FragmentConfig(tiles=4, split_k=2, num_warps=1, unroll=2, tile_groups=4), "bfloat16"),  # four share x
    (3, 200, 272, FragmentConfig(tiles=4, split_k=2, num_warps=2, rows_out=True), "bfloat16"),  # sums stored by row
    (8, 136, 640, FragmentConfig(tiles=2, split_k=3, num_warps=1, unroll=2, rows_out=True), "float16"),
    (5, 48, 256, FragmentConfig(tiles=4, split_k=3, num_warps=1, tile_groups=2, rows_out=True), "float16"),
    (1, 64, 128, None, "bfloat16"),
    # 4 chunks a step (the large GEMVs' default): 9 chunks in splits of 5 and 4, 11 in one split
    (8, 200, 1152, FragmentConfig(tiles=4, split_k=2, num_warps=2, unroll=4, tile_groups=2, rows_out=True), "bfloat16"),
    (4, 136, 1408, FragmentConfig(tiles=2, num_warps=1, unroll=4, tile_groups=2), "float16"),
])
def test_fragment_matmul_matches_reference(m, n, k, config, operands):
  """Fresh random x and weights against nvfp4_matmul_reference: within bf16 output rounding."""
  rng = np.random.default_rng(m * 1000 + n)
  x = jnp.asarray(rng.standard_normal((m, k)) + 0.1, jnp.bfloat16)
  w = quantize_nvfp4(jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.5, 2, (n, 1)), jnp.float32))
  got = np.asarray(fragment_matmul(x, to_fragments(w, operands), config=config), np.float64)
  want = np.asarray(nvfp4_matmul_reference(x, w), np.float64)
  assert got.shape == (m, n)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 4e-3
  assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()


@pytest.mark.parametrize("m, n, k, config", [
    (3, 200, 272, FragmentConfig(tiles=4, split_k=2, num_warps=2, tile_groups=2)),  # K padded: the row-end mask
    (8, 136, 1152, FragmentConfig(tiles=2, num_warps=1, unroll=4, tile_groups=2, rows_out=True)),
])
def test_wide_x_changes_no_bit(m, n, k, config):
  """wide_x spells the lanes' indices and x's row-end mask two ways for Triton's alignment
  analysis: the same indices, so the same loads and sums, bit for bit."""
  wide, narrow = (dataclasses.replace(config, wide_x=flag) for flag in (True, False))
  assert all(np.array_equal(a, b) for a, b in zip(Lanes.of(wide), Lanes.of(narrow)))
  assert_same_product(*fragment_case(m, n, k, "bfloat16", k), wide, narrow)


@pytest.mark.parametrize("m, n, k, config, operands", [
    (8, 136, 640, FragmentConfig(tiles=2, split_k=2, num_warps=1, unroll=2), "float16"),  # a left-over chunk
    (5, 48, 256, FragmentConfig(tiles=2, split_k=3, num_warps=2), "bfloat16"),  # a split with no chunk
    (3, 200, 1152, FragmentConfig(tiles=4, num_warps=2, unroll=2, tile_groups=2, rows_out=True), "bfloat16"),
])
def test_prefetch_changes_no_bit(m, n, k, config, operands):
  """prefetch (the next step's loads carried over the MMAs) multiplies the same chunks in the same
  order: the result bit for bit without it, and the reference's within bf16 rounding."""
  assert_same_product(*fragment_case(m, n, k, operands, m * 1000 + k), dataclasses.replace(config, prefetch=True),
                      config)


@pytest.mark.parametrize("m", [1, 3])
def test_token_mask_changes_no_bit(m):
  """token_mask (fp16 operands: the padding tokens' activation words not loaded) reads zeros
  where the words hold zeros: the same bits (at M = 8 nothing is masked)."""
  config = FragmentConfig(tiles=2, split_k=2, num_warps=1, unroll=2, tile_groups=2, rows_out=True)
  assert_same_product(*fragment_case(m, 136, 640, "float16", m), dataclasses.replace(config, token_mask=True), config)


@pytest.mark.parametrize("m, n, k, config", [
    (3, 200, 272, FragmentConfig(tiles=4, num_warps=2, tile_groups=2, final_out=True)),  # a group past N
    # rows past N in a tile, an unrolled pair
    (5, 40, 256, FragmentConfig(tiles=8, num_warps=2, tile_groups=2, unroll=2, final_out=True)),
])
def test_final_out_stores_the_epilogues_result(m, n, k, config):
  """final_out: the program's own scaled bf16 stores equal the one-split epilogue's result bit for
  bit (the same sums, scaled by the same powers of two), and the reference within bf16 rounding."""
  rng = np.random.default_rng(m * 1000 + n + 7)
  x = jnp.asarray(rng.standard_normal((m, k)) + 0.1, jnp.bfloat16)
  w = quantize_nvfp4(jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.5, 2, (n, 1)), jnp.float32))
  w = to_fragments(w, "bfloat16")
  got = fragment_matmul(x, w, config=config)
  epilogue = fragment_matmul(x, w, config=dataclasses.replace(config, final_out=False, rows_out=True))
  assert got.shape == (m, n) and got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(epilogue, np.float32))
  want = np.asarray(nvfp4_matmul_reference(x, from_fragments(w)), np.float64)
  assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) <= 4e-3


@pytest.mark.parametrize("m, n, k, config, split_k, operands", [  # operands alternating, as above
    (1, 64, 128, None, 1, "float16"),
    (3, 200, 272, FragmentConfig(tiles=4, num_warps=2, tile_groups=2), 2, "bfloat16"),  # a group past N
    (5, 48, 256, FragmentConfig(tiles=2, num_warps=2), 3, "float16"),  # a split with no chunk
    (8, 136, 640, FragmentConfig(tiles=8, num_warps=4, unroll=2, fused_activations=False), 2, "bfloat16"),
    (1, 64, 128, None, 1, "bfloat16"),
])
def test_partials_sum_to_the_product(m, n, k, config, split_k, operands):
  """fragment_matmul_partials: fp32 [S, M, N], each split scaled by the program, summing to the
  reference within fp32 and bf16 input rounding; at one split, rounded to bf16, fragment_matmul's
  result bit for bit (the same sum times the same powers of two)."""
  rng = np.random.default_rng(m * 1000 + n + split_k)
  x = jnp.asarray(rng.standard_normal((m, k)) * 10.0 ** rng.integers(-3, 3, (m, 1)), jnp.bfloat16)
  w = quantize_nvfp4(jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.5, 2, (n, 1)), jnp.float32))
  fragments = to_fragments(w, operands)
  partials = fragment_matmul_partials(x, fragments, split_k=split_k, config=config)
  assert partials.shape == (split_k, m, n) and partials.dtype == jnp.float32
  want = np.asarray(nvfp4_matmul_reference(x, w), np.float64)
  got = np.asarray(partials, np.float64).sum(0)
  scale = np.abs(want).max(axis=1, keepdims=True)  # rows of very different scales
  assert np.abs(got - want).max() <= 2 ** -7 * scale.max() and np.all(np.abs(got - want) <= 2 ** -7 * scale)
  if split_k == 1:
    one = dataclasses.replace(config or default_fragment_config(n, k), split_k=1, rows_out=True)
    np.testing.assert_array_equal(np.asarray(partials[0].astype(jnp.bfloat16), np.float32),
                                  np.asarray(fragment_matmul(x, fragments, config=one), np.float32))


def test_grouped_partials_equal_each_weights_own():
  """Weights sharing x in one launch (its row blocks over all of them: 200 rows, then 40, fewer
  than a block's, then 72): each one's partials bit for bit its own launch's; one operand dtype a
  launch. One operand dtype suffices: the grouping is in the row blocks, not the MMA."""
  rng, operands = np.random.default_rng(11), "float16"
  m, k = 5, 272
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ws = tuple(to_fragments(quantize_nvfp4(jnp.asarray(rng.standard_normal((n, k)) * s, jnp.float32)), operands)
             for n, s in ((200, 1.0), (40, 30.0), (72, 0.01)))
  config = FragmentConfig(tiles=4, num_warps=2, tile_groups=2)
  group = fragment_matmul_partials(x, ws, split_k=2, config=config)
  assert [p.shape for p in group] == [(2, m, w.shape[0]) for w in ws]
  for got, w in zip(group, ws):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fragment_matmul_partials(x, w, split_k=2, config=config)))
  other = to_fragments(from_fragments(ws[0]), OPERANDS[1 - OPERANDS.index(operands)])
  with pytest.raises(ValueError, match="one launch takes one operand dtype"):
    fragment_matmul_partials(x, (ws[0], other))


@pytest.mark.parametrize("m, k", [(1, 128), (3, 272), (8, 6144 + 32)])
def test_activations_kernel_equals_xla(m, k):
  """The one-launch activations: the same words as f16_rows then fragment_activations (rows
  past M and columns past K zero), and the same row maxima, for rows of very different scales."""
  rng = np.random.default_rng(k + m)
  x = jnp.asarray(rng.standard_normal((m, k)) * 10.0 ** rng.integers(-6, 6, (m, 1)), jnp.bfloat16)
  chunks = -(-k // 128)
  words, amax = activations_kernel(x, chunks, interpret=True)
  x16, want_amax = f16_rows(x)
  np.testing.assert_array_equal(np.asarray(words), np.asarray(fragment_activations(x16, chunks)))
  np.testing.assert_array_equal(np.asarray(amax), np.pad(np.asarray(want_amax), (0, 8 - m)))


def test_fragment_matmul_rejects_bad_inputs():
  w = to_fragments(quantize_nvfp4(jnp.ones((32, 128), jnp.float32)))
  for x in (jnp.ones((9, 128), jnp.bfloat16), jnp.ones((2, 144), jnp.bfloat16), jnp.ones((2, 128), jnp.float32)):
    with pytest.raises(ValueError, match="x must be bf16"):
      fragment_matmul(x, w)
  with pytest.raises(ValueError, match="one \\[N, K\\] weight or stacked experts \\[E, N, K\\], got shape"):
    to_fragments(quantize_nvfp4(jnp.ones((2, 2, 32, 128), jnp.float32)))
  with pytest.raises(ValueError, match="one \\[N, K\\] weight, got stacked experts \\(2, 32, 128\\)"):
    fragment_matmul(jnp.ones((2, 128), jnp.bfloat16), to_fragments(quantize_nvfp4(jnp.ones((2, 32, 128), jnp.float32))))
  with pytest.raises(ValueError, match="multiple of num_warps"):
    FragmentConfig(tiles=2, num_warps=4)
  with pytest.raises(ValueError, match="power of two"):
    FragmentConfig(tiles=3, num_warps=1)
  with pytest.raises(ValueError, match="tile_groups \\(4\\) must leave each group a multiple of num_warps"):
    FragmentConfig(tiles=4, num_warps=2, tile_groups=4)
  with pytest.raises(ValueError, match="final_out stores finished sums: it needs split_k=1, got 2"):
    FragmentConfig(tiles=2, num_warps=1, split_k=2, final_out=True)
  with pytest.raises(ValueError, match="final_out needs bfloat16 operands"):
    fragment_matmul(jnp.ones((2, 128), jnp.bfloat16), w, config=FragmentConfig(tiles=2, num_warps=1, final_out=True))


def test_default_fragment_config():
  """The measured tiles (BENCHMARKS.md runs 28, 31, 48, 49) at the issue's shapes and three more:
  4 chunks a loop step only where 4-tile programs keep >= 16 chunks a split."""
  shared = dict(tile_groups=2, rows_out=True)
  assert default_fragment_config(28672, 8192) == FragmentConfig(tiles=4, split_k=4, num_warps=2, unroll=4, **shared)
  assert default_fragment_config(154880, 6144) == FragmentConfig(tiles=4, split_k=1, num_warps=2, unroll=4, **shared)
  assert default_fragment_config(19360, 6144) == FragmentConfig(tiles=4, split_k=4, num_warps=2, unroll=2, **shared)
  assert default_fragment_config(6144, 16384) == FragmentConfig(tiles=2, split_k=8, num_warps=1, unroll=2, **shared)
  assert default_fragment_config(2048, 6144) == FragmentConfig(tiles=2, split_k=16, num_warps=1, **shared)
  assert default_fragment_config(6144, 2048) == FragmentConfig(tiles=2, split_k=8, num_warps=1, **shared)
  # x's rows loaded 16 bytes a lane from 2 rows on, and always on fp16 operands (run 49)
  assert not default_fragment_config(28672, 8192, 1).wide_x and default_fragment_config(28672, 8192, 2).wide_x
  assert default_fragment_config(28672, 8192, 1, "float16").wide_x


def test_fragment_matmul_lowers_for_h200():
  w = jax.eval_shape(lambda a: to_fragments(quantize_nvfp4(a)), jax.ShapeDtypeStruct((200, 272), jnp.float32))
  staged = FragmentConfig(tiles=4, split_k=2, num_warps=2, unroll=2, num_stages=2, fused_activations=False)
  grouped = FragmentConfig(tiles=4, split_k=2, num_warps=2, unroll=2, tile_groups=2, rows_out=True)
  w_bf16 = jax.eval_shape(lambda a: to_fragments(quantize_nvfp4(a), "bfloat16"),
                          jax.ShapeDtypeStruct((200, 272), jnp.float32))
  final = FragmentConfig(tiles=4, num_warps=2, unroll=2, tile_groups=2, final_out=True)
  prefetched = dataclasses.replace(grouped, prefetch=True)
  x = jax.ShapeDtypeStruct((3, 272), jnp.bfloat16)
  for config, weight in ((None, w), (staged, w), (grouped, w), (grouped, w_bf16), (final, w_bf16),
                         (prefetched, w), (prefetched, w_bf16), (dataclasses.replace(grouped, token_mask=True), w)):
    assert TRITON_CALL in h200_text(functools.partial(fragment_matmul, config=config, interpret=False), x, weight)
  for weight in (w, w_bf16, (w_bf16, w_bf16)):  # the programs that scale their partials, one weight or two
    assert TRITON_CALL in h200_text(functools.partial(fragment_matmul_partials, split_k=2, interpret=False), x, weight)


PTXAS = os.environ.get("GLMJAX_PTXAS") or shutil.which("ptxas")


@pytest.mark.skipif(not PTXAS, reason="no ptxas on PATH (or GLMJAX_PTXAS)")
@pytest.mark.parametrize("operands", OPERANDS)
def test_fragment_ptx_assembles_for_sm90(operands, tmp_path):
  """Each FRAGMENT_PTX program inside a kernel that loads its operands and stores its results,
  assembled by ptxas for sm_90: what the emulator cannot see (an operand kind an instruction
  does not take, as fma.bf16x2 with immediates was)."""
  for half, body in enumerate(FRAGMENT_PTX[operands]):
    body = re.sub(r"\$(\d+)", lambda m: f"%f{m[1]}" if int(m[1]) < 8 else f"%r{m[1]}", body)
    loads = [f"ld.global.f32 %f{i}, [%rd0+{4 * i}];" for i in range(4, 8)]
    loads += [f"ld.global.u32 %r{i}, [%rd0+{4 * i}];" for i in range(8, 24)]
    stores = [f"st.global.f32 [%rd0+{4 * i}], %f{i};" for i in range(4)]
    ptx = "\n".join([".version 8.4", ".target sm_90", ".address_size 64", ".visible .entry k(.param .u64 p) {",
                     ".reg .f32 %f<8>;", ".reg .b32 %r<24>;", ".reg .b64 %rd<1>;", "ld.param.u64 %rd0, [p];",
                     *loads, body, *stores, "ret;", "}"])
    (tmp_path / f"{half}.ptx").write_text(ptx)
    done = subprocess.run([PTXAS, "--gpu-name", "sm_90", str(tmp_path / f"{half}.ptx"), "-o",
                           str(tmp_path / f"{half}.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
