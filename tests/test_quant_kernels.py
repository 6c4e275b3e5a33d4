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

from glmjax.quant import linear, moe_experts, quantize_fp8_block, quantize_nvfp4
from pallas_kernels.bf16_matmul import bf16_matmul, bf16_matmul_group, bf16_matmul_reference
from pallas_kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from pallas_kernels.moe_grouped_matmul import MoEConfig, moe_grouped_matmul, moe_grouped_matmul_reference
from pallas_kernels.nvfp4_matmul import MatmulConfig, nvfp4_matmul, nvfp4_matmul_reference

TOL = 1e-2
pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


def rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def inputs(seed, m: int, n: int, k: int) -> tuple[jax.Array, np.ndarray]:
  """Fresh non-zero x bf16 [m, k] and fp32 weight [n, k] per parametrization."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)) + 0.1, jnp.bfloat16)
  return x, (rng.standard_normal((n, k)) * rng.uniform(0.5, 2, (n, 1))).astype(np.float32)


# (M, K, N, config): K, N not powers of two with ragged tiles; one aligned split-K case.
SKINNY_CASES = [(1, 272, 200, None), (3, 272, 200, None), (16, 272, 200, None),
                (5, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3)),
                (3, 272, 200, MatmulConfig(decode="ptx")),   # the interpreter runs its jnp twin
                (16, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3, decode="ptx")),
                (3, 272, 200, MatmulConfig(decode="ptx", operands="float16")),
                (5, 512, 96, MatmulConfig(block_n=32, block_k=128, split_k=3, operands="float16"))]
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


def _run_ptx(asm: str, word: np.ndarray) -> list[np.ndarray]:
  """Evaluates a decode PTX program (prmt, shl, and, or on .b32 registers) on uint32 words:
  $2 in, $0 and $1 out. An emulator of exactly the instructions the program uses, to check its
  bit logic on the CPU (the interpreter cannot run inline PTX)."""
  regs = {"$2": word.astype(np.uint64)}
  value = lambda tok: regs[tok] if tok in regs else np.uint64(int(tok, 0))
  for line in asm.replace("{", "").replace("}", "").split(";"):
    line = line.strip()
    if not line or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    dst, *src = [a.strip() for a in args.split(",")]
    a = [value(x) for x in src]
    if op == "prmt.b32":   # bytes of {b, a}: a is bytes 0-3, b 4-7; selector nibble i picks byte i
      pool = [(x >> np.uint64(8 * i)) & np.uint64(0xFF) for x in a[:2] for i in range(4)]
      sel = int(a[2])
      out = sum(pool[(sel >> (4 * i)) & 7] << np.uint64(8 * i) for i in range(4))
    elif op == "shl.b32":
      out = a[0] << a[1]
    elif op == "and.b32":
      out = a[0] & a[1]
    elif op == "or.b32":
      out = a[0] | a[1]
    else:
      raise AssertionError(f"unexpected instruction {op}")
    regs[dst] = out & np.uint64(0xFFFFFFFF)
  return [regs[f"${i}"].astype(np.uint32) for i in range(2)]


def test_ptx_decode_equals_the_jnp_decode():
  """Every byte value, four to a word, through the PTX programs equals `decode_halves`: $0 and
  $1 hold bytes 0-1 and 2-3 as fp16 pairs (element 0 in the low half), the even columns' codes
  from one program and the odd columns' from the other."""
  from pallas_kernels.nvfp4_matmul import DECODE_PTX_EVEN, DECODE_PTX_ODD, decode_halves
  packed = np.random.default_rng(7).permutation(np.tile(np.arange(256, dtype=np.uint8), 4)).reshape(-1, 4)
  words = packed.view("<u4")[:, 0]
  for asm, want in zip((DECODE_PTX_EVEN, DECODE_PTX_ODD), decode_halves(jnp.asarray(packed))):
    got = np.concatenate([reg.view("<u2").reshape(-1, 2) for reg in _run_ptx(asm, words)], axis=1)
    np.testing.assert_array_equal(got, np.asarray(want).view(np.uint16))


def test_bf16_matmul_fp32_result():
  """out_dtype=f32 (the fp32 computations of bf16 operands): XLA's fp32 matmul of the same values
  up to summation order, split K included."""
  x, w = inputs(11, 5, 130, 2048)
  w = jnp.asarray(w, jnp.bfloat16)
  out = bf16_matmul(x, w, out_dtype=jnp.float32)
  assert out.dtype == jnp.float32 and rel_err(out, bf16_matmul_reference(x, w, out_dtype=jnp.float32)) <= 1e-6
  with pytest.raises(ValueError, match="out_dtype"):
    bf16_matmul(x, w, out_dtype=jnp.float16)


@pytest.mark.parametrize("m,k,ns,out_dtype", [(5, 272, (200, 4, 130), jnp.bfloat16), (1, 2048, (576, 2048), jnp.float32)])
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
  args = moe_inputs(5, FORMATS["nvfp4"])
  with pytest.raises(ValueError, match="down_proj"):
    moe_grouped_matmul(*args[:5], args[3])
  with pytest.raises(ValueError, match="int32"):
    moe_grouped_matmul(args[0], args[1].astype(jnp.float32), *args[2:])


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
                                    jax.ShapeDtypeStruct((4, 272), jnp.bfloat16))))]
  for fmt in FORMATS.values():
    cases.append((moe_grouped_matmul, (*moe[:3], *(jax.eval_shape(fmt, w) for w in moe[3:]))))
  for routing, operands in (("table", "bfloat16"), ("scan", "float16")):
    config = MoEConfig(decode="ptx", routing=routing, operands=operands)
    cases.append((functools.partial(moe_grouped_matmul, config=config),
                  (*moe[:3], *(jax.eval_shape(quantize_nvfp4, w) for w in moe[3:]))))
  cases.append((functools.partial(nvfp4_matmul, config=MatmulConfig(decode="ptx", operands="float16")),
                (x, shape(quantize_nvfp4, (200, 272)))))
  with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for op, args in cases:
      text = jax.jit(lambda *a, op=op: op(*a, interpret=False)).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "__gpu$xla.gpu.triton" in text


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
