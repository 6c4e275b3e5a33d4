"""Weight-only Pallas kernels (interpret mode on the CPU) against their fp32 references, plus a
check that each lowers to Triton IR for an H200.

Tolerance: ||out - ref|| / ||ref|| <= 1e-2. The kernels decode weights exactly and accumulate in
fp32, so what remains is bf16 output rounding (~2e-3) and, in the MoE, the bf16 intermediate
silu(g) * u that the model also keeps in bf16.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.quant import linear, moe_experts, quantize_fp8_block, quantize_nvfp4, to_fragments
from pallas_kernels.bf16_matmul import (bf16_matmul, bf16_matmul_group, bf16_matmul_reference, swiglu_matmul,
                                       swiglu_matmul_reference)
from pallas_kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from pallas_kernels.hfma2_planes import rows_planes
from pallas_kernels.moe_grouped_matmul import MoEConfig, moe_grouped_matmul, moe_grouped_matmul_reference
from pallas_kernels.nvfp4_fragments import FragmentConfig
from pallas_kernels.nvfp4_matmul import MatmulConfig, default_config, nvfp4_matmul, nvfp4_matmul_reference
from tests.h200_lowering import TRITON_CALL, h200_text
from tests.ptx_emulator import f16_value as _f16, f32_value as _f32, run_ptx as _run_ptx

TOL = 1e-2
# The slowest fragment-MoE tests (10-18 s each in the interpreter) run in the Makefile's second
# process, which evens out the two.
side_lane = pytest.mark.side_lane
pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


def rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def inputs(seed, m: int, n: int, k: int) -> tuple[jax.Array, np.ndarray]:
  """Fresh non-zero x bf16 [m, k] and fp32 weight [n, k] per parametrization."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)) + 0.1, jnp.bfloat16)
  return x, (rng.standard_normal((n, k)) * rng.uniform(0.5, 2, (n, 1))).astype(np.float32)


HFMA2 = dict(decode="ptx", operands="float16", dot="hfma2")
# (M, K, N, config): K, N not powers of two with ragged tiles; one aligned split-K case.
SKINNY_CASES = [(1, 272, 200, None), (3, 272, 200, None), (16, 272, 200, None),
                (5, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3)),
                (3, 272, 200, MatmulConfig(decode="ptx")),   # the interpreter runs its jnp twin
                (16, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3, decode="ptx")),
                (3, 272, 200, MatmulConfig(decode="ptx", operands="float16")),
                (5, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3, operands="float16")),
                # dot="hfma2" (the interpreter runs the PTX's twin): ragged K (17 scale blocks)
                # and N, split K, its default tiles, several rows (each its own FMAs).
                (1, 272, 200, MatmulConfig(block_n=32, block_k=128, **HFMA2)),
                (2, 512, 96, MatmulConfig(block_n=32, block_k=64, split_k=3, **HFMA2)),
                (1, 4096, 136, default_config(1, 136, 4096, dot="hfma2")),
                (3, 272, 200, MatmulConfig(block_n=16, block_k=64, **HFMA2))]
FP8_CASES = [(1, 300, 200, None), (3, 300, 130, None), (16, 272, 200, None),
             (5, 512, 256, MatmulConfig(block_n=64, block_k=64, split_k=2)),
             (3, 300, 130, MatmulConfig(block_n=64, block_k=128, operands="float16"))]

# The bf16 split-K GEMV: ragged tiles, and (5, 2048, 200) where the default config splits K 8 ways.
BF16_CASES = [(1, 300, 200, None), (3, 272, 130, None), (16, 272, 200, None), (5, 2048, 200, None),
              (5, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3))]

# (format tag, quantize, kernel, reference, cases): each skinny kernel against its reference.
WEIGHT_ONLY = {"nvfp4": (1, quantize_nvfp4, nvfp4_matmul, nvfp4_matmul_reference, SKINNY_CASES),
               "fp8": (2, quantize_fp8_block, fp8_matmul, fp8_matmul_reference, FP8_CASES),
               "bf16": (7, lambda w: w.astype(jnp.bfloat16), bf16_matmul, bf16_matmul_reference, BF16_CASES)}


@pytest.mark.parametrize("fmt,m,k,n,config", [(f, *case) for f, v in WEIGHT_ONLY.items() for case in v[-1]])
def test_weight_only_matmul(fmt, m, k, n, config):
  tag, quantize, kernel, reference, _ = WEIGHT_ONLY[fmt]
  x, w = inputs((tag, m, k, n), m, n, k)
  q = quantize(jnp.asarray(w))
  out = kernel(x, q, config=config)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  assert rel_err(out, reference(x, q)) <= TOL


def test_f16_rows_is_exact_per_row():
  """Rows far outside fp16's range (1e30, 1e-30, 6e4 beside 1e-3) and a row of zeros: each
  nonzero row's largest lands in [2^14, 2^15), and scaled back by the kernels' inverse (from the
  returned largest magnitudes) every entry equals the bf16 input."""
  from pallas_kernels.nvfp4_matmul import f16_rows, row_inverse_scale
  rng = np.random.default_rng(3)
  x = rng.standard_normal((5, 96)) * np.array([1e30, 1e-30, 1.0, 0.0, 1.0])[:, None]
  x[2, :3] = (6e4, -1e-3, 3.0)
  x = jnp.asarray(x, jnp.bfloat16)
  scaled, amax = f16_rows(x)
  assert scaled.dtype == jnp.float16 and amax.shape == (5,)
  np.testing.assert_array_equal(np.asarray(amax), np.abs(np.asarray(x, np.float32)).max(1))
  largest = np.abs(np.asarray(scaled, np.float32)).max(1)
  assert np.all((largest[[0, 1, 2, 4]] >= 2**14) & (largest[[0, 1, 2, 4]] < 2**15)) and largest[3] == 0
  np.testing.assert_array_equal(np.asarray(scaled, np.float32) * np.asarray(row_inverse_scale(amax))[:, None],
                                np.asarray(x, np.float32))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_f16_operands_take_activations_past_fp16_range(fmt):
  """Activations of 1e6 (past fp16's 65504) and of 1e-8 rows: fp16 operands give the reference's
  result, scaled per row."""
  tag, quantize, kernel, reference, _ = WEIGHT_ONLY[fmt]
  x, w = inputs((tag, 9), 3, 64, 256)
  x = (x * jnp.asarray([[1e6], [1e-8], [1.0]], jnp.bfloat16)).astype(jnp.bfloat16)
  q = quantize(jnp.asarray(w))
  out = kernel(x, q, config=MatmulConfig(block_n=32, block_k=128, operands="float16"))
  ref = reference(x, q)
  for row in range(3):
    assert rel_err(out[row], ref[row]) <= TOL


def test_ptx_decode_equals_the_jnp_decode():
  """Every byte value, four to a word, through the PTX programs equals `decode_halves`: $0 and
  $1 hold bytes 0-1 and 2-3 as fp16 pairs (element 0 in the low half), the even columns' codes
  from one program and the odd columns' from the other."""
  from pallas_kernels.nvfp4_matmul import DECODE_PTX_EVEN, DECODE_PTX_ODD, decode_halves
  packed = np.random.default_rng(7).permutation(np.tile(np.arange(256, dtype=np.uint8), 4)).reshape(-1, 4)
  words = packed.view("<u4")[:, 0]
  for asm, want in zip((DECODE_PTX_EVEN, DECODE_PTX_ODD), decode_halves(jnp.asarray(packed))):
    regs = _run_ptx(asm, {"$2": words})
    got = np.concatenate([regs[f"${i}"].view("<u2").reshape(-1, 2) for i in range(2)], axis=1)
    np.testing.assert_array_equal(got, np.asarray(want).view(np.uint16))


def _hfma2_block_case(seed: int, blocks: int):
  """Random NVFP4 blocks (every byte value among their codes) and activations: (code words u32
  [blocks, 2], planes u32 [8, blocks], scale f32 [blocks], acc f32 [blocks], exact weights f64
  [blocks, 16], x f64 [blocks, 16])."""
  from glmjax.quant.nvfp4 import E2M1_VALUES
  from pallas_kernels.nvfp4_hfma2 import activation_planes
  rng = np.random.default_rng(seed)
  packed = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), blocks * 8)).reshape(blocks, 8)
  codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(blocks, 16)
  x = (rng.standard_normal((blocks, 16)) * 2.0 ** rng.integers(8, 15, (blocks, 1))).astype(np.float16)
  planes = np.asarray(activation_planes(jnp.asarray(x.reshape(1, -1))))[0]
  scale = rng.choice([0.0625, 0.75, 3.0, 448.0], blocks).astype(np.float32)
  acc = rng.standard_normal(blocks).astype(np.float32)
  return (packed.view("<u4"), planes, scale, acc, E2M1_VALUES[codes].astype(np.float64) * 2.0 ** -14,
          x.astype(np.float64))


def test_hfma2_decode_pairs_codes_with_their_columns():
  """decode_word's registers hold, against the planes that activation_planes builds, exactly
  the E2M1 values (times 2^-14) of the columns those planes hold: for each block, the sum of
  the register-by-plane products of exact arithmetic is the block's dot product."""
  from pallas_kernels.nvfp4_hfma2 import decode_word
  words, planes, _, _, w, x = _hfma2_block_case(3, 64)
  got = np.zeros(len(words))
  for h in range(2):
    for p, d in enumerate(decode_word(jnp.asarray(words[:, h]))):
      d = np.asarray(d)
      got += _f16(d & 0xFFFF) * _f16(planes[4 * h + p] & 0xFFFF) + _f16(d >> 16) * _f16(planes[4 * h + p] >> 16)
  np.testing.assert_allclose(got, (w * x).sum(1), rtol=1e-12, atol=0)


def test_hfma2_block_program_within_its_fp16_bound():
  """BLOCK_FMA_PTX, emulated, against exact arithmetic: acc + scale * sum(w x), off by at most
  the fp16 sums' rounding (7 additions a lane, 2^-11 of a running sum each, bounded by
  2^-8 of sum |w x|) and fp32's; the jnp twin the interpreter runs agrees within the same bound."""
  from pallas_kernels.nvfp4_hfma2 import BLOCK_FMA_PTX, block_fma_twin
  words, planes, scale, acc, w, x = _hfma2_block_case(4, 512)
  regs = _run_ptx(BLOCK_FMA_PTX, {"$1": acc.view(np.uint32), "$2": words[:, 0], "$3": words[:, 1],
                                  **{f"${4 + i}": planes[i] for i in range(8)}, "$12": scale.view(np.uint32)})
  exact = acc + scale * (w * x).sum(1)
  bound = 2.0 ** -8 * scale * np.abs(w * x).sum(1) + 2.0 ** -22 * (np.abs(acc) + np.abs(exact))
  got = _f32(regs["$0"])
  assert np.all(np.abs(got - exact) <= bound)
  assert np.mean(np.abs(got - exact) / bound) < 0.25  # the bound is not slack enough to hide a wrong pairing
  twin = np.asarray(block_fma_twin(jnp.asarray(acc), *(jnp.asarray(words[:, h]) for h in range(2)),
                                   [jnp.asarray(p) for p in planes], jnp.asarray(scale)))
  assert np.all(np.abs(twin - exact) <= bound)


def test_bf16_matmul_fp32_result():
  """out_dtype=f32 (the fp32 computations of bf16 operands): XLA's fp32 matmul of the same values
  up to summation order, split K included."""
  x, w = inputs(11, 5, 130, 2048)
  w = jnp.asarray(w, jnp.bfloat16)
  out = bf16_matmul(x, w, out_dtype=jnp.float32)
  assert out.dtype == jnp.float32 and rel_err(out, bf16_matmul_reference(x, w, out_dtype=jnp.float32)) <= 1e-6
  with pytest.raises(ValueError, match="out_dtype"):
    bf16_matmul(x, w, out_dtype=jnp.float16)


@pytest.mark.parametrize("m,k,ns,out_dtype", [(5, 272, (200, 4, 130), jnp.bfloat16),
                                               (1, 2048, (576, 130), jnp.float32)])
def test_bf16_matmul_group_equals_each_weight_alone(m, k, ns, out_dtype):
  """Weights sharing x in one launch, with ragged row blocks (200, 4 and 130 rows of 64-row
  tiles; K split 8 ways at 2048): each output is the lone kernel's under the same tiles, and
  the reference's within bf16 rounding."""
  from pallas_kernels.bf16_matmul import default_bf16_config
  rng = np.random.default_rng(m)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ws = tuple(jnp.asarray(rng.standard_normal((n, k)) * 0.1, jnp.bfloat16) for n in ns)
  config = default_bf16_config(sum(ns), k)
  outs = bf16_matmul_group(x, ws, out_dtype=out_dtype)
  for out, w in zip(outs, ws):
    assert out.shape == (m, w.shape[0]) and out.dtype == out_dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(bf16_matmul(x, w, out_dtype=out_dtype, config=config), np.float32))
    assert rel_err(out, bf16_matmul_reference(x, w, out_dtype=out_dtype)) <= TOL
  with pytest.raises(ValueError, match=f"K={k}"):
    bf16_matmul_group(x, (ws[0], ws[1][:, :100]))


@pytest.mark.parametrize("splits,m,k,n", [(8, 5, 256, 300), (1, 1, 96, 64), (3, 16, 200, 130), (2, 3, 1536, 520)])
def test_swiglu_matmul_equals_the_mlps_two_steps(splits, m, k, n):
  """The down GEMV from the gate/up partials (K not a power of two, ragged row blocks, K split
  2 ways at 1536): bit for bit the MLP's XLA path, silu(gate) * up from the split sums in
  order, then bf16_matmul at the same tiles; and the fp32 reference within bf16 rounding."""
  from pallas_kernels.bf16_matmul import swiglu_config
  rng = np.random.default_rng(k)
  g, u = (jnp.asarray(rng.standard_normal((splits, m, k)) * scale, jnp.float32) for scale in (2.0, 1.0))
  w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
  in_order = lambda p: functools.reduce(jnp.add, list(p)).astype(jnp.bfloat16)
  h = jax.nn.silu(in_order(g)) * in_order(u)
  out = swiglu_matmul(g, u, w)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(bf16_matmul(h, w, config=swiglu_config(n, k, splits, m)), np.float32))
  assert rel_err(out, swiglu_matmul_reference(g, u, w)) <= TOL


@pytest.mark.parametrize("splits,m,k,n,routed_splits,dtype", [(8, 5, 256, 300, 4, jnp.float32),
                                                              (1, 1, 96, 64, 1, jnp.float32),
                                                              (3, 16, 200, 130, 2, jnp.bfloat16)])
def test_swiglu_matmul_sums_the_moe_layer(splits, m, k, n, routed_splits, dtype):
  """With the residual and the routed experts' partials, the launch returns the MoE layer's new
  residual: bit for bit the model's XLA sum (routed partials summed in order and rounded to
  bf16, plus the shared expert's bf16 output, rounded, added to the residual in its dtype, fp32
  or bf16: a layer whose residual stream is still the bf16 embedding, as in a TEP rank's run)."""
  from pallas_kernels.bf16_matmul import swiglu_config
  rng = np.random.default_rng(n)
  g, u = (jnp.asarray(rng.standard_normal((splits, m, k)) * scale, jnp.float32) for scale in (2.0, 1.0))
  w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
  residual = jnp.asarray(rng.standard_normal((m, n)) * 3, dtype)
  routed = jnp.asarray(rng.standard_normal((routed_splits, m, n)), jnp.float32)
  in_order = lambda p: functools.reduce(jnp.add, list(p))
  shared = bf16_matmul(jax.nn.silu(in_order(g).astype(jnp.bfloat16)) * in_order(u).astype(jnp.bfloat16), w,
                       config=swiglu_config(n, k, splits, m))
  out = swiglu_matmul(g, u, w, residual=residual, routed=routed)
  assert out.dtype == dtype and out.shape == (m, n)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(
      residual + (in_order(routed).astype(jnp.bfloat16) + shared).astype(dtype), np.float32))
  assert rel_err(out, swiglu_matmul_reference(g, u, w, residual=residual, routed=routed)) <= TOL


def test_swiglu_tiles_fit_in_shared_memory():
  """Triton stages every split's gate/up tile in shared memory: at a TEP=8 rank's shared expert
  (8 splits, 5 rows, K 256) 128-wide steps would take 288 KB of the H200's 227 KB (the GPU's
  RESOURCE_EXHAUSTED, run 27); the default halves block_k, keeps the grid (one program a row
  block, as the layer sum needs), and a config that does not fit is a clear error."""
  from pallas_kernels.bf16_matmul import (SHARED_MEMORY, default_bf16_config, swiglu_config,
                                          swiglu_stage_bytes)
  wide = default_bf16_config(6144, 256)
  assert swiglu_stage_bytes(wide, 8, 5) == 294912 > SHARED_MEMORY
  fitted = swiglu_config(6144, 256, 8, 5)
  assert (fitted.block_k, fitted.split_k) == (64, 1) and swiglu_stage_bytes(fitted, 8, 5) <= SHARED_MEMORY
  assert swiglu_config(6144, 256, 1, 1) == wide  # one split fits as it is
  g = jnp.zeros((8, 5, 256), jnp.float32)
  with pytest.raises(ValueError, match="294912 bytes of shared memory, over the 232448"):
    swiglu_matmul(g, g, jnp.zeros((64, 256), jnp.bfloat16), config=wide)


def test_swiglu_matmul_rejects_bad_partials():
  g = jnp.zeros((2, 3, 64), jnp.float32)
  w = jnp.zeros((32, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="u must be shaped as g"):
    swiglu_matmul(g, g[:, :2], w)
  with pytest.raises(ValueError, match="g must be f32"):
    swiglu_matmul(g.astype(jnp.bfloat16), g, w)
  with pytest.raises(ValueError, match="K=64"):
    swiglu_matmul(g, g, w[:, :48])
  with pytest.raises(ValueError, match="M must be 1..16"):
    swiglu_matmul(jnp.zeros((2, 17, 64)), jnp.zeros((2, 17, 64)), w)
  residual, routed = jnp.zeros((3, 32)), jnp.zeros((4, 3, 32))
  with pytest.raises(ValueError, match="residual and routed come together"):
    swiglu_matmul(g, g, w, residual=residual)
  with pytest.raises(ValueError, match=r"residual must be f32 or bf16 \[3, 32\]"):
    swiglu_matmul(g, g, w, residual=residual[:, :16], routed=routed)
  with pytest.raises(ValueError, match=r"routed must be f32 \[S2, 3, 32\]"):
    swiglu_matmul(g, g, w, residual=residual, routed=routed[:, :2])
  with pytest.raises(ValueError, match="the whole K in one program, got split_k=2"):
    swiglu_matmul(g, g, w, residual=residual, routed=routed, config=MatmulConfig(block_n=16, block_k=32, split_k=2))


def test_linear_pallas_matches_xla():
  x, w = inputs(3, 4, 48, 80)
  q = quantize_nvfp4(jnp.asarray(w))
  out = linear(x.reshape(2, 2, 80), q, impl="pallas")
  assert out.shape == (2, 2, 48)
  assert rel_err(out.reshape(4, 48), linear(x, q, impl="xla")) <= TOL


def moe_inputs(seed, quantize):
  """E=6 experts, D=80, I=48 (neither a power of two), T=5 tokens, top-3. Experts repeat across
  tokens (2 is chosen by four of them), ids 7 and -1 are not local, token 4 has no local expert."""
  e, d, i = 6, 80, 48
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((5, d)) + 0.1, jnp.bfloat16)
  w = lambda *shape: quantize(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32))
  ids = jnp.array([[0, 2, 7], [2, 3, -1], [5, 0, 2], [1, 2, 3], [7, -1, 9]], jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, (5, 3)), jnp.float32)
  return x, ids, weights, w(e, i, d), w(e, i, d), w(e, d, i)


FORMATS = {"bf16": lambda w: w.astype(jnp.bfloat16), "nvfp4": quantize_nvfp4, "fp8": quantize_fp8_block}


@pytest.mark.parametrize("fmt,decode,routing,operands", [
    ("nvfp4", "jnp", "table", "bfloat16"), ("nvfp4", "ptx", "table", "bfloat16"), ("fp8", "jnp", "table", "bfloat16"),
    ("nvfp4", "ptx", "scan", "bfloat16"), ("fp8", "jnp", "scan", "bfloat16"), ("nvfp4", "ptx", "scan", "float16"),
    ("fp8", "jnp", "table", "float16")])
def test_moe_grouped_matmul(fmt, decode, routing, operands):
  """Both routings (XLA's table of the chosen experts, or the kernels' own scan of the ids), and
  fp16 operands."""
  args = moe_inputs(len(fmt), FORMATS[fmt])
  config = MoEConfig(block_n=16, block_k=32, down_split=2, decode=decode, routing=routing, operands=operands)
  out = moe_grouped_matmul(*args, config=config)
  ref = moe_grouped_matmul_reference(*args)
  assert out.shape == (5, 80) and out.dtype == jnp.bfloat16
  assert rel_err(out, ref) <= TOL
  np.testing.assert_array_equal(np.asarray(out[4], np.float32), 0.0)  # no local expert


def test_moe_grouped_matmul_mixed_formats_with_ptx_decode():
  """decode="ptx" with an NVFP4 gate beside a bf16 up: one launch reads x whole and by column
  parity; the result equals the jnp decode's (the interpreter runs the PTX's jnp twin)."""
  x, ids, weights, gate, up, down = moe_inputs(9, FORMATS["bf16"])
  args = (x, ids, weights, quantize_nvfp4(gate.astype(jnp.float32)), up, quantize_nvfp4(down.astype(jnp.float32)))
  config = MoEConfig(block_n=16, block_k=32, down_split=2)
  ptx = moe_grouped_matmul(*args, config=dataclasses.replace(config, decode="ptx"))
  assert rel_err(ptx, moe_grouped_matmul_reference(*args)) <= TOL
  assert rel_err(ptx, moe_grouped_matmul(*args, config=config)) <= 1e-2 * TOL


def test_moe_experts_pallas_bf16_matches_xla():
  args = moe_inputs(11, FORMATS["bf16"])
  out = moe_experts(*args, impl="pallas")
  assert rel_err(out, moe_grouped_matmul_reference(*args)) <= TOL
  assert rel_err(out, moe_experts(*args, impl="xla")) <= TOL
  np.testing.assert_array_equal(np.asarray(out[4], np.float32), 0.0)


@pytest.mark.parametrize("gate_up,down,groups", [((16, 32, 2), (16, 32, 1), 3), ((32, 64, 1), (32, 32, 2), 1)])
def test_moe_hfma2_pairs(gate_up, down, groups):
  """Each (token, local expert) pair a one-row product (the PTX's twin here): pairs spread over
  program groups or all in one, K split or not, ragged rows (48 = 32 + 16) and K (80 = 5 blocks
  of 16); expert 2 meets four tokens, token 4 none; equal to the tensor-core kernel's result."""
  from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
  tiles = lambda n, k, split: MatmulConfig(block_n=n, block_k=k, split_k=split, **HFMA2)
  args = moe_inputs(4, FORMATS["nvfp4"])
  # the down launch's partials, kept (one compile: the call without keep_partials returns their sum rounded to
  # bf16, its last line, from the same kernels)
  partials = moe_hfma2(*args, config=PairsConfig(tiles(*gate_up), tiles(*down), groups), keep_partials=True)
  assert partials.dtype == jnp.float32 and partials.shape == (down[2] * groups, 5, 80)
  out = partials.sum(0).astype(jnp.bfloat16)
  assert rel_err(out, moe_grouped_matmul_reference(*args)) <= TOL
  grouped = moe_grouped_matmul(*args, config=MoEConfig(block_n=16, block_k=32, decode="ptx", operands="float16"))
  assert rel_err(out, grouped) <= TOL
  np.testing.assert_array_equal(np.asarray(out[4], np.float32), 0.0)  # no local expert
  # x's and h's planes in one launch each (x's 5 lines in chunks of 2): the same bits, so the same
  # result (on a GPU, h's silu takes Triton's exp and may round differently to bf16)
  fused = moe_hfma2(*args, config=PairsConfig(tiles(*gate_up), tiles(*down), groups, fused_planes=True,
                                              planes_chunk_lines=2))
  assert fused.shape == (5, 80) and fused.dtype == jnp.bfloat16
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(out, np.float32))
  assert rel_err(fused, out) <= TOL
  # x's planes handed over (as the router's launch builds them, moe_route.route_select_planes)
  given = moe_hfma2(*args, config=PairsConfig(tiles(*gate_up), tiles(*down), groups, fused_planes=True,
                                              planes_chunk_lines=2), x_planes=rows_planes(args[0], chunk_lines=4))
  np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(fused, np.float32))
  if groups == 3:  # wide_words' layout hint (a store that never runs): the same bits
    wide = moe_hfma2(*args, config=PairsConfig(tiles(*gate_up), tiles(*down), groups, fused_planes=True,
                                               planes_chunk_lines=2, wide_words=True))
    np.testing.assert_array_equal(np.asarray(wide, np.float32), np.asarray(fused, np.float32))


@pytest.mark.parametrize("tokens,k_shared,splits,keep", [(5, 1040, 4, True), (1, 48, 1, False)])
def test_moe_hfma2_shared_down_rides_in_the_gate_up_launch(tokens, k_shared, splits, keep):
  """shared_down: the shared expert's down GEMV as more programs of the gate/up launch (no launch
  of its own): its output equals bf16_matmul's (kept: bf16_matmul_partials', K split 4 ways)
  bit for bit, and the routed output the launch's own without it, at D = 80 (a ragged second
  row block) and K = 1040 or 48 (a ragged last step), 5 tokens or 1 (their programs idle past
  the GEMV's: 2 row blocks x 4 splits, or x 1, against 8 programs a grid row)."""
  from pallas_kernels.bf16_matmul import bf16_matmul_partials, default_bf16_config
  from pallas_kernels.moe_hfma2 import moe_hfma2
  x, ids, weights, *experts = moe_inputs(4, FORMATS["nvfp4"])
  args = (x[:tokens], ids[:tokens], weights[:tokens], *experts)
  rng = np.random.default_rng(tokens)
  hidden = jnp.asarray(rng.standard_normal((tokens, k_shared)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((80, k_shared)) * 0.1, jnp.bfloat16)
  assert default_bf16_config(80, k_shared).split_k == splits
  routed, shared = moe_hfma2(*args, keep_partials=keep, shared_down=(hidden, w))
  names = [e.params["name"] for e in jax.make_jaxpr(
      lambda *a: moe_hfma2(*a, shared_down=(hidden, w)))(*args).jaxpr.eqns[0].params["jaxpr"].eqns
           if e.primitive.name == "pallas_call"]
  assert names == ["moe_hfma2_gate_up", "moe_hfma2_down"]
  alone = moe_hfma2(*args, keep_partials=keep)
  np.testing.assert_array_equal(np.asarray(routed, np.float32), np.asarray(alone, np.float32))
  want = bf16_matmul_partials(hidden, w) if keep else bf16_matmul(hidden, w)
  assert shared.shape == want.shape and shared.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(shared, np.float32), np.asarray(want, np.float32))
  assert rel_err(shared.astype(jnp.float32).sum(0) if keep else shared, bf16_matmul_reference(hidden, w)) <= TOL


@pytest.mark.parametrize("gate_up,down,groups,down_groups,fused,operands", [
    (None, None, 12, 8, False, "bfloat16"),  # the defaults: gate/up's second K split idle (80 inputs: one chunk)
    (FragmentConfig(tiles=2, num_warps=1, tile_groups=2), FragmentConfig(tiles=2, num_warps=1, tile_groups=1), 3,
     2, False, "bfloat16"),  # down in groups of its own
    (None, None, 2, None, True, "bfloat16"),  # h from the gate/up launch: one gate and one up tile a program
    (FragmentConfig(tiles=4, num_warps=2, tile_groups=2), None, 1, None, True, "bfloat16"),  # two of each: 48 rows
    (None, None, 8, None, False, "float16"),  # x's and h's rows scaled into fp16 by their maxima
    (FragmentConfig(tiles=2, num_warps=1, tile_groups=2), FragmentConfig(tiles=2, num_warps=1, tile_groups=1), 3,
     5, False, "float16")])
def test_moe_fragments(gate_up, down, groups, down_groups, fused, operands):
  """The chosen experts each read once for all tokens on the fragment GEMV (its PTX's twin
  here), found in-kernel: expert 2 meets four tokens, ids 7, 9 and -1 are other ranks', token 4
  has no local expert; ragged tiles (48 rows in two-tile blocks) and padded chunks (K = 80,
  48); a weight's row blocks shared by the gate's and up's launch; the chosen experts dealt over
  12 program groups (the default, down's 8), 8, 3, 2 or 1 (groups; the down launch's 2 or 5 where
  down_groups says); h built in the gate/up launch (fused_swiglu); experts on either operand
  dtype (float16: x and h in fp16 activation words, a launch for x's); each token's routing
  weights from the swiglu launch (or fused_swiglu's)."""
  from pallas_kernels.moe_fragments import ExpertsConfig, moe_fragments
  x, ids, weights, *experts = moe_inputs(6, FORMATS["nvfp4"])
  fragments = [to_fragments(w, operands) for w in experts]
  config = ExpertsConfig(gate_up, down, groups, down_groups, fused)
  # the down launch's partials (one compile: without keep_partials the call returns their sum rounded to bf16,
  # its last line, from the same kernels)
  run = lambda ids: moe_fragments(x, ids, weights, *fragments, config=config, keep_partials=True)
  partials = run(ids)
  assert partials.dtype == jnp.float32 and partials.shape == (down_groups or groups, 5, 80)
  out = partials.sum(0).astype(jnp.bfloat16)
  assert rel_err(out, moe_grouped_matmul_reference(x, ids, weights, *experts)) <= TOL
  np.testing.assert_array_equal(np.asarray(out[4], np.float32), 0.0)  # no local expert
  # no local expert at all: zeros, with every slot's partials unwritten
  np.testing.assert_array_equal(np.asarray(run(jnp.full_like(ids, 7)).sum(0), np.float32), 0.0)


@pytest.mark.parametrize("gate_up,down,groups,operands", [
    # gate/up: 3 chunks in splits of 2 and 1, a chunk a step, prefetched; down: 2 chunks in one step
    (FragmentConfig(tiles=2, num_warps=1, tile_groups=2, split_k=2, prefetch=True),
     FragmentConfig(tiles=2, num_warps=1, tile_groups=2, unroll=2), 2, "bfloat16"),
    # gate/up: 3 chunks in steps of 2 (the second half masked); down: 2 steps of a chunk
    (FragmentConfig(tiles=2, num_warps=1, tile_groups=2, unroll=2), FragmentConfig(tiles=2, num_warps=1, tile_groups=2),
     1, "float16")])
@side_lane
def test_moe_fragments_stream_changes_no_bit(gate_up, down, groups, operands):
  """ExpertsConfig.stream (a program's experts as one K loop) multiplies the same chunks in the
  same order as a loop per expert, the masked chunks past a ragged split adding zeros: the same
  bits, with and without prefetch; 2 or 4 experts a program (groups 2, 1)."""
  from pallas_kernels.moe_fragments import ExpertsConfig, moe_fragments
  rng = np.random.default_rng(5)
  e, d, i = 5, 272, 144
  x = jnp.asarray(rng.standard_normal((3, d)), jnp.bfloat16)
  experts = [quantize_nvfp4(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32))
             for shape in ((e, i, d), (e, i, d), (e, d, i))]
  ids = jnp.array([[2, 0], [1, 2], [4, 7]], jnp.int32)  # 2 meets two tokens, 7 is not local
  weights = jnp.asarray(rng.uniform(0.1, 1, (3, 2)), jnp.float32)
  fragments = [to_fragments(w, operands) for w in experts]
  config = ExpertsConfig(gate_up, down, groups)
  looped = moe_fragments(x, ids, weights, *fragments, config=config)
  assert looped.shape == (3, d) and looped.dtype == jnp.bfloat16
  # the call returns the down launch's partials (keep_partials) summed and rounded to bf16
  partials = moe_fragments(x, ids, weights, *fragments, config=config, keep_partials=True)
  np.testing.assert_array_equal(np.asarray(partials.sum(0).astype(jnp.bfloat16), np.float32),
                                np.asarray(looped, np.float32))
  streamed = moe_fragments(x, ids, weights, *fragments, config=dataclasses.replace(config, stream=True))
  np.testing.assert_array_equal(np.asarray(streamed, np.float32), np.asarray(looped, np.float32))
  assert rel_err(streamed, moe_grouped_matmul_reference(x, ids, weights, *experts)) <= TOL
  with pytest.raises(ValueError, match="stream .* fused_swiglu"):
    ExpertsConfig(stream=True, fused_swiglu=True)


@pytest.mark.parametrize("fused", [False, True])
def test_moe_fragments_l2_ahead_changes_no_bit(fused):
  """FragmentConfig.l2_ahead in both launches (fused_swiglu: gate's and up's weights, a pair of
  refs, prefetched side by side) adds prefetches and no value: the same bits; not with stream."""
  from pallas_kernels.moe_fragments import DOWN, FUSED_GATE_UP, GATE_UP, ExpertsConfig, moe_fragments
  x, ids, weights, *experts = moe_inputs(7, FORMATS["nvfp4"])
  fragments = [to_fragments(w, "bfloat16") for w in experts]
  gate_up = dataclasses.replace(FUSED_GATE_UP if fused else GATE_UP, unroll=1)
  plain = ExpertsConfig(gate_up, DOWN, groups=2, fused_swiglu=fused)
  ahead = dataclasses.replace(plain, gate_up=dataclasses.replace(gate_up, l2_ahead=2),
                              down=dataclasses.replace(DOWN, l2_ahead=1))
  got, want = (moe_fragments(x, ids, weights, *fragments, config=c) for c in (ahead, plain))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert rel_err(got, moe_grouped_matmul_reference(x, ids, weights, *experts)) <= TOL
  with pytest.raises(ValueError, match="l2_ahead needs stream=False"):
    dataclasses.replace(ahead, fused_swiglu=False, stream=True)


@side_lane
def test_moe_experts_splits_the_fragment_gate_up_for_few_chosen_experts():
  """routing="fragments" takes its launches from the experts a step is expected to choose
  (default_experts_config): gate/up over 4 K splits where at most half of its 12 program groups
  get one (a TEP rank's view), else the defaults; the same product either way."""
  from glmjax.quant import FRAGMENT_IMPL
  from pallas_kernels.moe_fragments import GATE_UP, ExpertsConfig, default_experts_config
  assert default_experts_config() == default_experts_config(24.0) == default_experts_config(7) == ExpertsConfig()
  assert default_experts_config(4.7) == ExpertsConfig(gate_up=dataclasses.replace(GATE_UP, split_k=4))
  x, ids, weights, *experts = moe_inputs(6, FORMATS["nvfp4"])
  fragments = [to_fragments(w, "bfloat16") for w in experts]
  want = moe_grouped_matmul_reference(x, ids, weights, *experts)
  for chosen, splits in ((None, GATE_UP.split_k), (4.7, 4)):
    run = lambda *a, chosen=chosen: moe_experts(*a, impl=FRAGMENT_IMPL, routing="fragments", chosen=chosen)
    [grid] = [e.params["grid_mapping"].grid for e in jax.make_jaxpr(run)(x, ids, weights, *fragments).eqns[0]
              .params["jaxpr"].eqns if e.primitive.name == "pallas_call" and e.params["name"].endswith("gate_up")]
    assert grid[1] == splits
    assert rel_err(run(x, ids, weights, *fragments), want) <= TOL


@side_lane
def test_moe_fragments_split_k_and_bad_inputs():
  """K split in both launches (two chunks of 128 each): the split sums equal one split's within
  fp32 rounding; weights not in bf16 fragment order, or more tokens than the MMA's 8, are clear
  errors."""
  from pallas_kernels.moe_fragments import ExpertsConfig, moe_fragments
  rng = np.random.default_rng(3)
  e, d, i = 3, 256, 256
  x = jnp.asarray(rng.standard_normal((3, d)), jnp.bfloat16)
  experts = [quantize_nvfp4(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32))
             for shape in ((e, i, d), (e, i, d), (e, d, i))]
  ids, weights = jnp.array([[2, 0], [1, 2], [2, 5]], jnp.int32), jnp.asarray(rng.uniform(0.1, 1, (3, 2)), jnp.float32)
  fragments = [to_fragments(w, "bfloat16") for w in experts]
  one = FragmentConfig(tiles=2, num_warps=1, tile_groups=2)
  split = dataclasses.replace(one, split_k=2)
  whole = moe_fragments(x, ids, weights, *fragments, config=ExpertsConfig(one, one))
  halves = moe_fragments(x, ids, weights, *fragments, config=ExpertsConfig(split, split))
  assert rel_err(halves, whole) <= 1e-2 * TOL + 2 ** -8
  assert rel_err(whole, moe_grouped_matmul_reference(x, ids, weights, *experts)) <= TOL
  ahead = dataclasses.replace(split, prefetch=True)  # the same chunks in the same order: the same bits
  prefetched = moe_fragments(x, ids, weights, *fragments, config=ExpertsConfig(ahead, ahead))
  np.testing.assert_array_equal(np.asarray(prefetched, np.float32), np.asarray(halves, np.float32))
  with pytest.raises(ValueError, match="up_proj must be stacked experts in fragment order on gate_proj's operands"):
    moe_fragments(x, ids, weights, fragments[0], experts[1], fragments[2])
  with pytest.raises(ValueError, match=r"down_proj must be stacked experts .*got FragmentWeight\[3, 256, 256\]float16"):
    moe_fragments(x, ids, weights, *fragments[:2], to_fragments(experts[2]))
  with pytest.raises(ValueError, match="fused_swiglu .* needs experts on bfloat16 operands"):
    moe_fragments(x, ids, weights, *(to_fragments(w) for w in experts), config=ExpertsConfig(fused_swiglu=True))
  with pytest.raises(ValueError, match="at most 8 tokens"):
    moe_fragments(jnp.zeros((9, d), jnp.bfloat16), jnp.zeros((9, 2), jnp.int32), jnp.ones((9, 2)), *fragments)
  with pytest.raises(ValueError, match="ExpertsConfig.groups must be >= 1, got 0"):
    ExpertsConfig(groups=0)
  with pytest.raises(ValueError, match="ExpertsConfig.down_groups must be >= 1, got 0"):
    ExpertsConfig(down_groups=0)
  with pytest.raises(ValueError, match="fused_swiglu .* gate_up needs split_k=1 and tile_groups=2"):
    ExpertsConfig(gate_up=split, fused_swiglu=True)
  fused = moe_fragments(x, ids, weights, *fragments, config=ExpertsConfig(down=split, fused_swiglu=True))
  assert rel_err(fused, whole) <= 1e-2 * TOL + 2 ** -8


def test_moe_experts_pairs_routing():
  """routing="pairs" (impl="pallas_hfma2"): one token with one local expert, and a step whose
  experts are all on other ranks (zeros); other impls or unquantized experts are clear errors."""
  x, ids, weights, *experts = moe_inputs(12, FORMATS["nvfp4"])
  pairs = functools.partial(moe_experts, impl="pallas_hfma2", routing="pairs")
  one = (x[3:4], ids[4:5], weights[4:5])  # ids 7, -1, 9 ...
  np.testing.assert_array_equal(np.asarray(pairs(*one, *experts), np.float32), 0.0)
  one = (x[:1], jnp.array([[7, 4, -1]], jnp.int32), weights[:1])
  assert rel_err(pairs(*one, *experts), moe_grouped_matmul_reference(*one, *experts)) <= TOL
  with pytest.raises(ValueError, match=r"impl in \('pallas_hfma2', 'pallas_fragments'\), got 'pallas_ptx_f16'"):
    moe_experts(x, ids, weights, *experts, impl="pallas_ptx_f16", routing="pairs")
  with pytest.raises(ValueError, match="routing='pairs_fused'.*impl in .'pallas_hfma2'"):
    moe_experts(x, ids, weights, *experts, impl="pallas", routing="pairs_fused")
  with pytest.raises(ValueError, match="down_proj is Array"):
    pairs(x, ids, weights, *experts[:2], experts[2].dequantize())


def test_bad_inputs_raise():
  x, w = inputs(4, 3, 64, 64)
  q4, q8 = quantize_nvfp4(jnp.asarray(w)), quantize_fp8_block(jnp.asarray(w))
  with pytest.raises(ValueError, match="bf16"):
    nvfp4_matmul(x.astype(jnp.float32), q4)
  with pytest.raises(ValueError, match="M must be"):
    nvfp4_matmul(jnp.zeros((17, 64), jnp.bfloat16), q4)
  with pytest.raises(ValueError, match="K=48"):
    fp8_matmul(x[:, :48], q8)
  with pytest.raises(ValueError, match="NVFP4Weight"):
    nvfp4_matmul(x, q8)
  with pytest.raises(ValueError, match="bf16 weight"):
    bf16_matmul(x, jnp.asarray(w))
  with pytest.raises(ValueError, match="M must be"):
    bf16_matmul(jnp.zeros((17, 64), jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
  with pytest.raises(ValueError, match="<= 128"):
    fp8_matmul(x, q8, config=MatmulConfig(block_k=256))
  with pytest.raises(ValueError, match="power of two"):
    MatmulConfig(block_n=48)
  with pytest.raises(ValueError, match="down_split"):
    MoEConfig(down_split=0)
  with pytest.raises(ValueError, match="decode"):
    MoEConfig(decode="asm")
  with pytest.raises(ValueError, match="routing"):
    MoEConfig(routing="sort")
  with pytest.raises(ValueError, match="operands"):
    MatmulConfig(operands="float8")
  with pytest.raises(ValueError, match="decode='ptx' and operands='float16'"):
    MatmulConfig(dot="hfma2")
  with pytest.raises(ValueError, match="NVFP4 only"):
    fp8_matmul(x, q8, config=MatmulConfig(block_k=64, **HFMA2))
  args = moe_inputs(5, FORMATS["nvfp4"])
  with pytest.raises(ValueError, match="down_proj"):
    moe_grouped_matmul(*args[:5], args[3])
  with pytest.raises(ValueError, match="int32"):
    moe_grouped_matmul(args[0], args[1].astype(jnp.float32), *args[2:])
  from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
  with pytest.raises(ValueError, match="down_proj must be \\[E, D, I\\]"):
    moe_hfma2(*args[:5], args[3])
  with pytest.raises(ValueError, match="dot='hfma2'"):
    PairsConfig(down=MatmulConfig())
  with pytest.raises(ValueError, match="groups"):
    PairsConfig(groups=0)
  with pytest.raises(ValueError, match="PairsConfig.planes_chunk_lines must be a power of two >= 1, got 3"):
    PairsConfig(planes_chunk_lines=3)
  planes = rows_planes(args[0])
  with pytest.raises(ValueError, match="x_planes replace the fused planes launch: they need PairsConfig.fused_planes"):
    moe_hfma2(*args, x_planes=planes)
  with pytest.raises(ValueError, match=r"x_planes must be u32 \[40, 5\] and f32 \[5\], got uint32\[32, 5\]"):
    moe_hfma2(*args, config=PairsConfig(fused_planes=True), x_planes=(planes[0][:32], planes[1]))
  with pytest.raises(ValueError, match="x_planes are the pairs_fused kernels' at decode, not routing='pairs'"):
    moe_experts(*args, impl="pallas_hfma2", routing="pairs", x_planes=planes)
  hidden, down = jnp.zeros((5, 32), jnp.bfloat16), jnp.zeros((80, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"shared_down must be the shared expert's hidden bf16 \[5, Is\] and down "
                                       r"weight bf16 \[80, Is\], got bfloat16\[4, 32\] and bfloat16\[80, 32\]"):
    moe_hfma2(*args, shared_down=(hidden[:4], down))
  with pytest.raises(ValueError, match=r"got bfloat16\[5, 32\] and float32\[80, 32\]"):
    moe_hfma2(*args, shared_down=(hidden, down.astype(jnp.float32)))
  with pytest.raises(ValueError, match="shared_down rides in the pairs_fused kernels' gate/up launch at decode, not "
                                       "routing='pairs'"):
    moe_experts(*args, impl="pallas_hfma2", routing="pairs", shared_down=(hidden, down))
  with pytest.raises(ValueError, match="wide_words is the pairs kernels' layout hint .*not routing='table'"):
    moe_experts(*args, impl="pallas", wide_words=True)


def test_kernels_lower_to_triton_for_h200():
  """Lowering runs the Pallas -> Triton IR translation (shape and op support) without a GPU."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  shape = lambda f, *a: jax.eval_shape(f, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in a))
  x = jax.ShapeDtypeStruct((3, 272), jnp.bfloat16)
  moe = moe_inputs(6, lambda w: w)
  cases = [(nvfp4_matmul, (x, shape(quantize_nvfp4, (200, 272)))),
           (functools.partial(nvfp4_matmul, config=MatmulConfig(decode="ptx")),
            (x, shape(quantize_nvfp4, (200, 272)))),
           (fp8_matmul, (x, shape(quantize_fp8_block, (200, 272)))),
           (bf16_matmul, (x, jax.ShapeDtypeStruct((200, 272), jnp.bfloat16))),
           (bf16_matmul_group, (x, (jax.ShapeDtypeStruct((200, 272), jnp.bfloat16),
                                    jax.ShapeDtypeStruct((4, 272), jnp.bfloat16)))),
           (swiglu_matmul, (*[jax.ShapeDtypeStruct((8, 5, 256), jnp.float32)] * 2,
                            jax.ShapeDtypeStruct((6144, 256), jnp.bfloat16)))]
  for fmt in FORMATS.values():
    cases.append((moe_grouped_matmul, (*moe[:3], *(jax.eval_shape(fmt, w) for w in moe[3:]))))
  for routing, operands in (("table", "bfloat16"), ("scan", "float16")):
    config = MoEConfig(decode="ptx", routing=routing, operands=operands)
    cases.append((functools.partial(moe_grouped_matmul, config=config),
                  (*moe[:3], *(jax.eval_shape(quantize_nvfp4, w) for w in moe[3:]))))
  cases.append((functools.partial(nvfp4_matmul, config=MatmulConfig(decode="ptx", operands="float16")),
                (x, shape(quantize_nvfp4, (200, 272)))))
  from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
  pairs = lambda t: (jax.ShapeDtypeStruct((t, 80), jnp.bfloat16), jax.ShapeDtypeStruct((t, 3), jnp.int32),
                     jax.ShapeDtypeStruct((t, 3), jnp.float32), *(jax.eval_shape(quantize_nvfp4, w) for w in moe[3:]))
  cases += [(moe_hfma2, pairs(5)), (moe_hfma2, pairs(1))]  # the CUDA-core pairs: a step's tokens, one token
  cases.append((functools.partial(moe_hfma2, config=PairsConfig(wide_words=True)), pairs(5)))  # with the hint
  shared = (jax.ShapeDtypeStruct((5, 272), jnp.bfloat16), jax.ShapeDtypeStruct((80, 272), jnp.bfloat16))
  cases.append((lambda *a, interpret: moe_hfma2(*a[:6], shared_down=a[6:], interpret=interpret),  # its GEMV beside
                (*pairs(5), *shared)))
  for config in (MatmulConfig(block_n=32, block_k=128, **HFMA2), default_config(1, 200, 272, dot="hfma2")):
    cases.append((functools.partial(nvfp4_matmul, config=config),
                  (jax.ShapeDtypeStruct((2, 272), jnp.bfloat16), shape(quantize_nvfp4, (200, 272)))))
  with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for op, args in cases:
      text = jax.jit(lambda *a, op=op: op(*a, interpret=False)).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "__gpu$xla.gpu.triton" in text


def test_wide_words_hint_takes_the_code_word_tiles_shape():
  """PairsConfig.wide_words steers Triton's coalescing only through a bf16 store of exactly the
  code-word tile's shape (nvfp4_hfma2.widen_word_loads): in each launch's Triton IR the hint's
  store and the word loads share their shape, at tiles other than the defaults (gate/up 32 x 256,
  down 16 x 128: words [32, 32] and [16, 16])."""
  import re
  from experiments.kernel_ir import triton_kernels
  from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
  sds = jax.ShapeDtypeStruct
  t, k, e, d, i = 5, 3, 6, 512, 256
  experts = [jax.eval_shape(quantize_nvfp4, sds(shape, jnp.float32)) for shape in ((e, i, d), (e, i, d), (e, d, i))]
  tiles = lambda n, kk: MatmulConfig(block_n=n, block_k=kk, split_k=1, num_stages=1, **HFMA2)
  config = PairsConfig(gate_up=tiles(32, 256), down=tiles(16, 128), wide_words=True)
  kernels = triton_kernels(lambda *a: moe_hfma2(*a, config=config, interpret=False), sds((t, d), jnp.bfloat16),
                           sds((t, k), jnp.int32), sds((t, k), jnp.float32), *experts)
  shapes = {meta["name"]: (set(re.findall(r"tt.load %\S+ : tensor<(\d+x\d+)x!tt.ptr<i32>>", text)),
                           set(re.findall(r"tt.store %\S+, %\S+ : tensor<(\d+x\d+)x!tt.ptr<bf16>>", text)))
            for meta, text in kernels if meta["name"].startswith("moe_hfma2")}
  assert shapes == {"moe_hfma2_gate_up": ({"32x32", "1x16"}, {"32x32"}),
                    "moe_hfma2_down": ({"16x16", "1x8"}, {"16x16"})}


def test_ptx_default_tiles():
  """decode="ptx" picks its measured tiles only where they apply: the GEMV's 32 x 512 up to 4
  rows, the MoE's block_k=256 only over NVFP4-only weights (FP8 tiles stay <= 128)."""
  from pallas_kernels.moe_grouped_matmul import default_moe_config
  from pallas_kernels.nvfp4_matmul import default_config
  one, eight = default_config(1, 28672, 8192, decode="ptx"), default_config(8, 28672, 8192, decode="ptx")
  assert (one.block_n, one.block_k, one.decode) == (32, 512, "ptx")
  assert (eight.block_n, eight.block_k) == (default_config(8, 28672, 8192).block_n, 128)
  moe = moe_inputs(3, lambda w: w)
  q4 = [jax.eval_shape(quantize_nvfp4, w.astype(jnp.float32)) for w in moe[3:]]
  q8 = jax.eval_shape(quantize_fp8_block, moe[5].astype(jnp.float32))
  assert default_moe_config(q4, decode="ptx") == MoEConfig(block_k=256, decode="ptx")
  assert default_moe_config([*q4[:2], q8], decode="ptx").block_k == 128
  assert default_moe_config(q4) == MoEConfig()


def test_rank_step_default_tiles():
  """One TEP=8 rank at 5 tokens: about 4.7 of its 32 experts chosen, which takes the MoE's
  32 x 512 tiles (GLM-5's I = 2048: 4.7 x 32 row blocks of 64 is under 2 per SM); a step that
  chooses 24 keeps 64 x 256. The bf16 GEMV splits K 8 ways at the 25 MB projections."""
  from configs import get_model_config
  from glmjax.moe import expected_local_experts
  from pallas_kernels.bf16_matmul import default_bf16_config
  from pallas_kernels.moe_grouped_matmul import default_moe_config
  chosen = expected_local_experts(get_model_config("tep8_shard"), 5)
  assert 4.6 < chosen < 4.8
  q4 = [jax.eval_shape(quantize_nvfp4, jax.ShapeDtypeStruct(s, jnp.float32))
        for s in ((32, 2048, 6144), (32, 2048, 6144), (32, 6144, 2048))]
  assert default_moe_config(q4, decode="ptx", chosen=chosen) == MoEConfig(block_n=32, block_k=512, decode="ptx")
  assert default_moe_config(q4, decode="ptx", chosen=24) == MoEConfig(block_k=256, decode="ptx")
  for n, k in ((2048, 6144), (6144, 2048)):
    assert default_bf16_config(n, k) == MatmulConfig(block_n=64, block_k=128, split_k=8)
  assert default_bf16_config(28672, 8192).split_k == 2  # wide outputs fill the GPU with fewer splits


def test_fold_config_covers_the_sms_with_the_fewest_splits():
  """A TEP=8 rank's GEMVs whose partials a fold reads: o_proj [2048] -> 6144 (96 column blocks)
  and the q_b group [2048] -> 2048 + 4096 take 2 splits to cover 132 SMs, the q_a group
  [6144] -> 2784 (44 blocks) 4; the router's 4 blocks keep the rule's 8 (never more than the
  rule); "rule" is default_bf16_config, a cap takes at most that many."""
  from pallas_kernels.bf16_matmul import default_bf16_config, fold_config
  for (n, k), split in {(6144, 2048): 2, (2784, 6144): 4, (256, 6144): 8, (160, 6144): 8}.items():
    assert fold_config(n, k) == dataclasses.replace(default_bf16_config(n, k), split_k=split)
    assert fold_config(n, k, "rule") == default_bf16_config(n, k)
    assert fold_config(n, k, 3).split_k == min(3, default_bf16_config(n, k).split_k)
  assert fold_config(6144, 256).split_k == 1  # a K of 2 steps is not split: nor is it to cover the SMs
  with pytest.raises(ValueError, match="fold_splits must be one of .* got 'all'"):
    fold_config(6144, 2048, "all")


def test_hfma2_k_loop_pipelining_reaches_the_triton_loop(monkeypatch):
  """num_stages > 1 on a dot="hfma2" config names the launch for loop_stages, whose lowering
  hook puts tt.num_stages on its K loop (Triton pipelines dot-free loads only then); 1 leaves
  the loop bare. Checked on the Triton IR of an H200 lowering."""
  from jax._src.pallas.triton import lowering
  from pallas_kernels import loop_stages
  assert loop_stages.loop_stages(loop_stages.staged_name("moe_hfma2_down", 3)) == 3
  assert loop_stages.staged_name("nvfp4_hfma2", None) == "nvfp4_hfma2"
  assert loop_stages.loop_stages("nvfp4_hfma2") is None
  modules = []
  lower = lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(str(result.module))
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  q = jax.eval_shape(quantize_nvfp4, jax.ShapeDtypeStruct((64, 1024), jnp.float32))
  x = jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16)
  for stages in (1, 3):
    config = MatmulConfig(block_n=32, block_k=256, num_stages=stages, **HFMA2)
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      jax.jit(lambda x, q: nvfp4_matmul(x, q, config=config, interpret=False)).trace(x, q).lower(
          lowering_platforms=("cuda",))
  bare, staged = modules
  assert "tt.num_stages" not in bare and "nvfp4_hfma2_stages3" in staged
  assert staged.count("tt.num_stages = 3") == 1  # the K loop


def test_moe_fragments_lowers_for_h200():
  """Every launch of the fragment MoE (its slot loops under pl.when, the in-kernel choice, the
  swiglu program, the fused gate/up; on fp16 operands x's activations launch too) lowers to
  Triton for an H200 on this machine."""
  from pallas_kernels.moe_fragments import DOWN, GATE_UP, ExpertsConfig, moe_fragments
  stacked = lambda shape, operands: jax.eval_shape(lambda a: to_fragments(quantize_nvfp4(a), operands),
                                                   jax.ShapeDtypeStruct(shape, jnp.float32))
  e, d, i = 6, 272, 96
  head = (jax.ShapeDtypeStruct((5, d), jnp.bfloat16), jax.ShapeDtypeStruct((5, 8), jnp.int32),
          jax.ShapeDtypeStruct((5, 8), jnp.float32))
  cases = ((ExpertsConfig(), "bfloat16", 3), (ExpertsConfig(groups=3, fused_swiglu=True), "bfloat16", 2),
           (ExpertsConfig(), "float16", 4),
           (ExpertsConfig(dataclasses.replace(GATE_UP, prefetch=True), dataclasses.replace(DOWN, prefetch=True)),
            "bfloat16", 3),
           (ExpertsConfig(dataclasses.replace(GATE_UP, prefetch=True), DOWN, stream=True), "bfloat16", 3),
           (ExpertsConfig(stream=True), "float16", 4))
  for config, operands, launches in cases:
    args = (*head, *(stacked(shape, operands) for shape in ((e, i, d), (e, i, d), (e, d, i))))
    text = h200_text(functools.partial(moe_fragments, config=config, interpret=False), *args)
    assert text.count(TRITON_CALL) == launches
