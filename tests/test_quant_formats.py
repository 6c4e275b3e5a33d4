"""NVFP4 / block-FP8 formats against the independent numpy implementation, error bounds,
pytree behaviour and the quantization policy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glmjax.quant import (FP8BlockWeight, NVFP4Weight, linear, quantize_fp8_block, quantize_nvfp4,
                          quantize_params, quantizes)
from glmjax.quant import nvfp4 as nvfp4_lib
from tests import nvfp4_numpy_ref as ref


def awkward_weight(seed: int, out: int, k: int) -> np.ndarray:
  """Random fp32 weight with signs, exact zeros, -0.0, values at E2M1 grid ties, blocks of every
  scale regime (normal, e4m3-subnormal, underflowing to 0) and all-zero blocks."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((out, k)).astype(np.float32)
  w[rng.random((out, k)) < 0.1] = 0.0
  w[rng.random((out, k)) < 0.02] = -0.0
  blocks = w.reshape(out, k // 16, 16)
  regime = rng.integers(0, 5, size=blocks.shape[:2])
  blocks[regime == 1] *= 1e-5        # block scale in e4m3's subnormal range
  blocks[regime == 2] *= 1e-8        # block scale underflows e4m3 to 0
  blocks[regime == 3] = 0.0          # all-zero block
  # A block holding its amax and exact E2M1 ties (v = 0.25, 0.75, ..., 5 once scaled by amax/6).
  blocks[0, 0, :8] = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -5], np.float32) * 0.5
  return w


def nvfp4_scales(w: np.ndarray):
  """Per-element effective scale S = e4m3 block scale * scale_2 and v = w / S (numpy ref)."""
  _, block_scale, scale_2 = ref.quantize_nvfp4(w)
  s = np.repeat(block_scale.astype(np.float32), 16, axis=-1) * scale_2
  with np.errstate(divide="ignore", invalid="ignore"):
    return s, np.where(s > 0, w / s, 0.0)


@pytest.mark.parametrize("seed,shape", [(0, (24, 64)), (1, (7, 272)), (2, (3, 16))])
def test_nvfp4_quantize_bit_exact_vs_numpy(seed, shape):
  w = awkward_weight(seed, *shape)
  q = quantize_nvfp4(jnp.asarray(w))
  packed, block_scale, scale_2 = ref.quantize_nvfp4(w)
  np.testing.assert_array_equal(np.asarray(q.packed), packed)
  np.testing.assert_array_equal(np.asarray(q.block_scale).view(np.uint8), block_scale.view(np.uint8))
  assert np.float32(q.global_scale) == scale_2
  np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)),
                                ref.dequantize_nvfp4(packed, block_scale, scale_2))


def test_divide_exact_is_true_division():
  """XLA turns x / broadcast(d) into x * (1/d); the quantizers must divide as torch does."""
  rng = np.random.default_rng(14)
  x = rng.random((4096, 16), np.float32) * 5
  d = rng.random((4096, 1), np.float32) + 0.1
  np.testing.assert_array_equal(np.asarray(jax.jit(nvfp4_lib.divide_exact)(x, d)), x / d)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: nvfp4_lib.divide_exact(a, 448.0))(x)),
                                x / np.float32(448))


def test_e2m1_ties_round_to_even_code():
  v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -5.0], np.float32)
  expected = np.array([0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 14], np.uint8)
  np.testing.assert_array_equal(np.asarray(nvfp4_lib.encode_e2m1(jnp.asarray(v))), expected)
  np.testing.assert_array_equal(ref.e2m1_round(v), expected)


def test_pack_unpack_bit_exact_vs_numpy():
  codes = np.random.default_rng(3).integers(0, 16, size=(5, 3, 64), dtype=np.uint8)
  packed = np.asarray(nvfp4_lib.pack_e2m1(jnp.asarray(codes)))
  np.testing.assert_array_equal(packed, ref.pack(codes))
  np.testing.assert_array_equal(np.asarray(nvfp4_lib.unpack_e2m1(jnp.asarray(packed))), codes)
  np.testing.assert_array_equal(nvfp4_lib.E2M1_VALUES, ref.e2m1_value(np.arange(16)))


def test_nvfp4_zero_blocks_and_tensor_have_no_nan():
  w = awkward_weight(4, 8, 64)
  for x in (w, np.zeros_like(w)):
    q = quantize_nvfp4(jnp.asarray(x))
    dq = np.asarray(q.dequantize(jnp.float32))
    assert np.isfinite(dq).all()
    np.testing.assert_array_equal(dq[x == 0], 0.0)
  zero_blocks = (np.abs(w.reshape(8, 4, 16)).max(-1) == 0)
  np.testing.assert_array_equal(np.asarray(quantize_nvfp4(jnp.asarray(w)).block_scale,
                                           np.float32)[zero_blocks], 1.0)  # ModelOpt stores 1.0


def test_nvfp4_error_bound():
  """|w - dq| <= half an E2M1 step of v = w/S, times S (S = e4m3 block scale * scale_2): S/4 for
  |v| < 2, S/2 below 4, S up to 6. Rounding the block scale to e4m3 can push |v| past 6, where it
  clamps (error (|v| - 6) S): by at most 0.4 for a normal e4m3 scale (<= 2^-4 relative rounding),
  more for a subnormal one. Blocks whose scale underflows to 0 dequantize to 0 (error |w|, below
  6 * 2^-10 * scale_2)."""
  w = awkward_weight(5, 32, 256)
  q = quantize_nvfp4(jnp.asarray(w))
  err = np.abs(np.asarray(q.dequantize(jnp.float32)) - w)
  s, v = nvfp4_scales(w)
  half_step = np.where(np.abs(v) < 2, 0.25, np.where(np.abs(v) < 4, 0.5, 1.0))
  overshoot = np.maximum(np.abs(v) - 6, 0)
  assert overshoot[s >= 2.0 ** -6 * float(q.global_scale)].max() <= 0.4
  bound = np.where(s > 0, (half_step + overshoot) * s, np.abs(w)) * (1 + 1e-6)
  assert (err <= bound).all()
  assert np.abs(w[s == 0]).max() <= 6 * 2.0 ** -10 * float(q.global_scale)


def test_nvfp4_input_dim_not_multiple_of_16():
  with pytest.raises(ValueError, match="divisible by 16"):
    quantize_nvfp4(jnp.ones((4, 40)))


@pytest.mark.parametrize("seed,shape", [(6, (200, 272)), (7, (130, 300)), (8, (3, 5))])
def test_fp8_block_bit_exact_vs_numpy(seed, shape):
  w = awkward_weight(seed, shape[0], 16 * -(-shape[1] // 16))[:, :shape[1]]
  q = quantize_fp8_block(jnp.asarray(w))
  codes, scale_inv = ref.quantize_fp8_block(w)
  np.testing.assert_array_equal(np.asarray(q.weight).view(np.uint8), codes.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q.scale_inv), scale_inv)
  dq = np.asarray(q.dequantize(jnp.float32))
  np.testing.assert_array_equal(dq, ref.dequantize_fp8_block(codes, scale_inv))
  # e4m3 keeps 3 mantissa bits: error <= 2^-4 |w| (normal codes) or 2^-10 * scale (subnormal).
  s = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:shape[0], :shape[1]]
  assert (np.abs(dq - w) <= np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * s) * (1 + 1e-6)).all()


def test_stacked_weights_quantize_per_expert():
  w = jnp.asarray(np.stack([awkward_weight(9 + e, 16, 64) * (e + 1) for e in range(3)]))
  q4, q8 = quantize_nvfp4(w), quantize_fp8_block(w)
  assert q4.shape == q8.shape == (3, 16, 64)
  assert q4.packed.shape == (3, 16, 32) and q4.block_scale.shape == (3, 16, 4)
  assert q4.global_scale.shape == q4.input_scale.shape == (3,)
  assert q8.scale_inv.shape == (3, 1, 1)
  for e in range(3):
    packed, block_scale, scale_2 = ref.quantize_nvfp4(np.asarray(w[e]))
    np.testing.assert_array_equal(np.asarray(q4.packed[e]), packed)
    assert np.float32(q4.global_scale[e]) == scale_2
  np.testing.assert_array_equal(np.asarray(q4.dequantize(jnp.float32))[1],
                                np.asarray(quantize_nvfp4(w[1]).dequantize(jnp.float32)))
  assert q4.nbytes == 3 * (16 * 32 + 16 * 4 + 4 + 4)


def test_pytree_round_trip_jit_and_gather():
  w = jnp.asarray(np.stack([awkward_weight(12 + e, 16, 64) for e in range(4)]))
  for q in (quantize_nvfp4(w), quantize_fp8_block(w)):
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == (4 if isinstance(q, NVFP4Weight) else 2)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(back) is type(q) and back.shape == q.shape
    dq = jax.jit(lambda a: a.dequantize(jnp.float32))(q)
    np.testing.assert_array_equal(np.asarray(dq), np.asarray(q.dequantize(jnp.float32)))
    picked = jax.tree.map(lambda a: a[jnp.array([2, 0])], q)  # how the model gathers experts
    assert picked.shape == (2, 16, 64)
    np.testing.assert_array_equal(np.asarray(picked.dequantize(jnp.float32))[0], np.asarray(dq)[2])
    shapes = jax.eval_shape(lambda a: a, q)
    assert type(shapes) is type(q) and shapes.shape == q.shape
  assert jax.jit(quantize_nvfp4)(w).shape == (4, 16, 64)


def test_from_checkpoint_checks_shapes():
  q = quantize_nvfp4(jnp.ones((8, 32)))
  NVFP4Weight.from_modelopt(q.packed, q.block_scale, q.global_scale, q.input_scale)
  with pytest.raises(ValueError, match="one scale per 16"):
    NVFP4Weight.from_modelopt(q.packed, q.block_scale[:, :1], q.global_scale)
  f = quantize_fp8_block(jnp.ones((8, 200)))
  FP8BlockWeight.from_checkpoint(f.weight, f.scale_inv)
  with pytest.raises(ValueError, match="128x128"):
    FP8BlockWeight.from_checkpoint(f.weight, f.scale_inv[:, :1])


def test_linear_paths():
  rng = np.random.default_rng(13)
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(linear(x, w)), np.asarray(jnp.einsum("...k,nk->...n", x, w)))
  for q in (quantize_nvfp4(w), quantize_fp8_block(w)):
    out = linear(x, q)
    expected = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), q.dequantize(jnp.bfloat16).astype(jnp.float32))
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 3, 40)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), rtol=1e-2, atol=1e-2)
  with pytest.raises(ValueError, match="impl"):
    linear(x, w, impl="cuda")


def fake_params(num_layers: int = 4, experts: int = 4) -> dict:
  """The model's params layout (HF names) with tiny shapes; layer 0 dense, the rest MoE.
  Layers as a list (params["layers"][i]); `flax_names` re-keys them as Flax does (layers_i)."""
  a = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  lin = lambda out, k: {"weight": a(out, k)}
  layers = []
  for i in range(num_layers):
    attn = {"q_a_proj": lin(32, 64), "q_a_layernorm": {"weight": a(32)}, "q_b_proj": lin(64, 32),
            "kv_a_proj_with_mqa": lin(48, 64), "kv_a_layernorm": {"weight": a(32)},
            "kv_b_proj": lin(64, 32), "o_proj": lin(64, 64),
            "indexer": {"wq_b": lin(64, 32), "wk": lin(32, 64), "weights_proj": lin(16, 64),
                        "k_norm": {"weight": a(32), "bias": a(32)}}}
    if i == 0:
      mlp = {"gate_proj": lin(96, 64), "up_proj": lin(96, 64), "down_proj": lin(64, 96)}
    else:
      mlp = {"gate": {"weight": a(experts, 64), "e_score_correction_bias": a(experts)},
             "experts": {"gate_proj": a(experts, 32, 64), "up_proj": a(experts, 32, 64),
                         "down_proj": a(experts, 64, 32)},
             "shared_experts": {"gate_proj": lin(32, 64), "up_proj": lin(32, 64), "down_proj": lin(64, 32)}}
    layers.append({"self_attn": attn, "mlp": mlp, "input_layernorm": {"weight": a(64)},
                   "post_attention_layernorm": {"weight": a(64)}})
  return {"embed_tokens": {"weight": a(100, 64)}, "layers": layers, "norm": {"weight": a(64)},
          "lm_head": {"weight": a(100, 64)}}


def flax_names(params: dict) -> dict:
  renamed = {k: v for k, v in params.items() if k != "layers"}
  return renamed | {f"layers_{i}": layer for i, layer in enumerate(params["layers"])}


def quantized_paths(tree) -> set[str]:
  paths = set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, (NVFP4Weight, FP8BlockWeight)))[0]:
    if isinstance(leaf, (NVFP4Weight, FP8BlockWeight)):
      paths.add("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path))
  return paths


def test_policy_picks_expected_leaves():
  params = fake_params()
  experts = {f"layers/{i}/mlp/experts/{n}" for i in (1, 2, 3) for n in ("gate_proj", "up_proj", "down_proj")}
  attn = {f"layers/{i}/self_attn/{n}/weight" for i in range(4)
          for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer/wq_b", "indexer/wk")}
  dense = {f"layers/0/mlp/{n}/weight" for n in ("gate_proj", "up_proj", "down_proj")}
  shared = {f"layers/{i}/mlp/shared_experts/{n}/weight" for i in (1, 2, 3)
            for n in ("gate_proj", "up_proj", "down_proj")}
  assert quantized_paths(quantize_params(params, "none")) == set()
  assert quantized_paths(quantize_params(params, "nvfp4_experts")) == experts
  assert quantized_paths(quantize_params(params, "nvfp4")) == experts | attn | dense | shared
  fp8 = quantize_params(params, "fp8")
  assert quantized_paths(fp8) == experts | attn | dense | shared
  assert isinstance(fp8["layers"][1]["mlp"]["experts"]["down_proj"], FP8BlockWeight)
  assert fp8["lm_head"]["weight"].dtype == jnp.bfloat16
  assert not quantizes(("layers", "1", "mlp", "gate", "weight"), 2, "nvfp4")
  assert {p.replace("layers_", "layers/") for p in quantized_paths(
      quantize_params(flax_names(params), "nvfp4"))} == experts | attn | dense | shared
  with pytest.raises(ValueError, match="policy"):
    quantize_params(params, "int4")
