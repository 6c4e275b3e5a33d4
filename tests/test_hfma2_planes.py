"""The CUDA-core kernels' activation planes in one launch (pallas_kernels/hfma2_planes.py): the
same bits as XLA's f16_rows + activation_planes, and as moe_hfma2's h glue before them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hfma2_planes import rows_planes, swiglu_planes
from pallas_kernels.nvfp4_hfma2 import activation_planes
from pallas_kernels.nvfp4_matmul import f16_rows
from tests.h200_lowering import TRITON_CALL, h200_text

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


def xla_planes(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  a16, amax = f16_rows(a)
  return activation_planes(a16).reshape(-1, a.shape[1] // 16), amax


def draw_rows(m: int, k: int, seed: int) -> jax.Array:
  """Normal rows with exact and negative zeros, one row of zeros, one of large values."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((m, k)).astype(np.float32)
  a[rng.random((m, k)) < 0.05] = 0.0
  a[rng.random((m, k)) < 0.05] = -0.0
  a[0] = 0.0
  if m > 1:
    a[1] *= 3e4
  return jnp.asarray(a, jnp.bfloat16)


@pytest.mark.parametrize("m,k", [(5, 6144), (1, 2048), (3, 48), (2, 16)])
def test_rows_planes_equal_xla_bit_for_bit(m, k):
  a = draw_rows(m, k, seed=m * 1000 + k)
  planes, amax = rows_planes(a)
  want_planes, want_amax = xla_planes(a)
  assert planes.dtype == jnp.uint32 and planes.shape == want_planes.shape
  np.testing.assert_array_equal(planes, want_planes)
  np.testing.assert_array_equal(amax, want_amax)


@pytest.mark.parametrize("splits,slots,i,bad_ids", [(2, 40, 2048, 6), (1, 7, 96, 2), (3, 5, 32, 0)])
def test_swiglu_planes_equal_moe_hfma2_glue(splits, slots, i, bad_ids):
  rng = np.random.default_rng(slots + i)
  g = jnp.asarray(rng.standard_normal((splits, slots, i)), jnp.float32)
  u = jnp.asarray(rng.standard_normal((splits, slots, i)), jnp.float32)
  experts = 32
  ids = rng.integers(0, experts, slots)
  ids[rng.choice(slots, bad_ids, replace=False)] = rng.choice([-1, experts, experts + 3], bad_ids)
  ids = jnp.asarray(ids, jnp.int32)
  local = jnp.sum((ids >= 0) & (ids < experts))
  g, u = (x.at[:, int(local):].set(jnp.nan) for x in (g, u))  # moe_hfma2 leaves these rows unwritten
  h = jnp.where(jnp.arange(slots)[:, None] < local, jax.nn.silu(g.sum(0)) * u.sum(0), 0.0).astype(jnp.bfloat16)
  planes, amax = swiglu_planes(g, u, ids, experts=experts)
  want_planes, want_amax = xla_planes(h)
  np.testing.assert_array_equal(planes, want_planes)
  np.testing.assert_array_equal(amax, want_amax)
  assert int(local) == slots - bad_ids and np.all(np.asarray(amax)[slots - bad_ids:] == 0)


@pytest.mark.parametrize("m,k,chunk_lines", [(5, 6144, None), (1, 2064, 16), (3, 48, 1)])
def test_rows_planes_in_chunks_equal_xla(m, k, chunk_lines):
  """Whole rows (None) and (row, chunk) programs, the last chunk partly past the row: the same bits."""
  a = draw_rows(m, k, seed=k + (chunk_lines or 0))
  planes, amax = rows_planes(a, chunk_lines=chunk_lines)
  want_planes, want_amax = xla_planes(a)
  np.testing.assert_array_equal(planes, want_planes)
  np.testing.assert_array_equal(amax, want_amax)


@pytest.mark.parametrize("splits,slots,i,chunk_lines", [(2, 40, 2048, 32), (1, 7, 96, 4)])
def test_swiglu_planes_in_chunks_equal_whole_rows(splits, slots, i, chunk_lines):
  rng = np.random.default_rng(i + chunk_lines)
  g, u = (jnp.asarray(rng.standard_normal((splits, slots, i)), jnp.float32) for _ in range(2))
  ids = jnp.asarray(np.r_[rng.integers(0, 32, slots - 2), [-1, 40]], jnp.int32)
  whole = swiglu_planes(g, u, ids, experts=32)
  chunks = swiglu_planes(g, u, ids, experts=32, chunk_lines=chunk_lines)
  for got, want in zip(chunks, whole):
    np.testing.assert_array_equal(got, want)
  assert np.any(np.asarray(whole[0]) != 0)


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match="K divisible by 16"):
    rows_planes(jnp.ones((2, 40), jnp.bfloat16))
  with pytest.raises(ValueError, match="a must be bf16"):
    rows_planes(jnp.ones((2, 32), jnp.float32))
  with pytest.raises(ValueError, match="chunk_lines must be a power of two >= 1, got 24"):
    rows_planes(jnp.ones((2, 32), jnp.bfloat16), chunk_lines=24)
  g = jnp.ones((2, 4, 32), jnp.float32)
  with pytest.raises(ValueError, match="g and u must be"):
    swiglu_planes(g, g[:1], jnp.zeros((4,), jnp.int32), experts=8)
  with pytest.raises(ValueError, match=r"ids must be int32 \[4\]"):
    swiglu_planes(g, g, jnp.zeros((5,), jnp.int32), experts=8)


def test_planes_lower_to_triton_for_h200():
  s = jax.ShapeDtypeStruct
  assert TRITON_CALL in h200_text(lambda a: rows_planes(a, interpret=False), s((5, 6144), jnp.bfloat16))
  assert TRITON_CALL in h200_text(lambda g, u, ids: swiglu_planes(g, u, ids, experts=32, interpret=False),
                                  s((2, 40, 2048), jnp.float32), s((2, 40, 2048), jnp.float32), s((40,), jnp.int32))
