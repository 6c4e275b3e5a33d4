"""The Mosaic GPU NVFP4 matmul: Mosaic GPU's interpreter on the CPU against the fp32 reference,
its lowering for an H200 (layout inference runs there, so the register-A wgmma is checked even
though the interpreter takes A through SMEM), and its input checks.

Tolerance as in test_quant_kernels: the decode is exact and the dot accumulates in fp32, so the
output's bf16 rounding is what remains.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from glmjax.quant import quantize_nvfp4
from pallas_kernels.nvfp4_matmul import nvfp4_matmul_reference
from pallas_kernels.nvfp4_matmul_mgpu import (MgpuMatmulConfig, default_mgpu_config,
                                              nvfp4_matmul_mgpu)
from tests.test_quant_kernels import TOL, inputs, rel_err

# (M, K, N, config): M padded to 8 and 16 tokens; N not a multiple of the row block (the last
# block overhangs); K = 3 and 5 steps of 256; split K over 128-row blocks; a 1-deep pipeline;
# warp-specialized CTAs of 2 compute warpgroups. (3 ran on the H200 but can deadlock in the
# interpreter on a 2-core machine: see the module docstring.)
CASES = [(3, 768, 200, None),
         (16, 512, 96, None),
         (9, 1280, 136, MgpuMatmulConfig(max_concurrent_steps=1)),
         (5, 1024, 320, MgpuMatmulConfig(block_n=128, split_k=2, max_concurrent_steps=2)),
         (2, 1024, 320, MgpuMatmulConfig(warpgroups=2, split_k=2))]


@pytest.mark.parametrize("m,k,n,config", CASES)
def test_matches_reference(m, k, n, config):
  x, w = inputs((4, m, k, n), m, n, k)
  q = quantize_nvfp4(jnp.asarray(w))
  out = nvfp4_matmul_mgpu(x, q, config=config)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  assert rel_err(out, nvfp4_matmul_reference(x, q)) <= TOL


def test_lowers_for_h200():
  """Lowering runs Mosaic GPU's layout inference and wgmma checks for sm_90 without a GPU: the
  register-A wgmma (the kernel's point), the SMEM-A ablation, 8 and 16 padded tokens, split K,
  the warp-specialized pipeline (which the interpreter tests run at 2 warpgroups)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  w = jax.eval_shape(quantize_nvfp4, jax.ShapeDtypeStruct((200, 1024), jnp.float32))
  cases = [(1, None), (3, MgpuMatmulConfig(a_operand="smem")),
           (16, MgpuMatmulConfig(block_n=128, block_k=512, split_k=2)),
           (9, MgpuMatmulConfig(warpgroups=3))]
  with jax.sharding.use_abstract_mesh(mesh):
    for m, config in cases:
      op = functools.partial(nvfp4_matmul_mgpu, config=config, interpret=False)
      text = jax.jit(op).trace(jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16), w).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text


def test_default_config():
  """K split only when there are few row blocks, keeping >= 4 steps a split; always valid."""
  big = default_mgpu_config(1, 28672, 8192)
  assert (big.block_n, big.block_k, big.split_k, big.warpgroups) == (64, 256, 1, 1)
  small = default_mgpu_config(1, 2048, 8192)
  assert small.split_k == 8 and 8192 // (small.block_k * small.split_k) >= 4
  assert default_mgpu_config(16, 200, 768).split_k == 1


def test_bad_inputs_raise():
  x, w = inputs(7, 3, 64, 512)
  q = quantize_nvfp4(jnp.asarray(w))
  with pytest.raises(ValueError, match="bf16"):
    nvfp4_matmul_mgpu(x.astype(jnp.float32), q)
  with pytest.raises(ValueError, match="M must be"):
    nvfp4_matmul_mgpu(jnp.ones((17, 512), jnp.bfloat16), q)
  with pytest.raises(ValueError, match=r"weight must be \[N, K=256\]"):
    nvfp4_matmul_mgpu(x[:, :256], q)
  with pytest.raises(ValueError, match="NVFP4Weight"):
    nvfp4_matmul_mgpu(x, w)
  q130 = quantize_nvfp4(jnp.ones((130, 512), jnp.float32))
  with pytest.raises(ValueError, match="N must be a multiple of 8"):
    nvfp4_matmul_mgpu(x, q130)
  q272 = quantize_nvfp4(jnp.ones((64, 272), jnp.float32))
  with pytest.raises(ValueError, match="multiple of 256"):
    nvfp4_matmul_mgpu(jnp.ones((1, 272), jnp.bfloat16), q272)
  with pytest.raises(ValueError, match="block_k \\* split_k"):
    nvfp4_matmul_mgpu(x, q, config=MgpuMatmulConfig(block_k=256, split_k=3))
  for field, value, match in [("block_n", 96, "block_n"), ("block_k", 128, "block_k"),
                              ("warpgroups", 4, "warpgroups"),
                              ("max_concurrent_steps", 0, "max_concurrent_steps"),
                              ("split_k", 0, "split_k"), ("a_operand", "tmem", "a_operand")]:
    with pytest.raises(ValueError, match=match):
      MgpuMatmulConfig(**{field: value})
