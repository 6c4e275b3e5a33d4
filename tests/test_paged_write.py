"""The one-launch cache write (pallas_kernels/paged_write.py, interpret mode) against
paged.write_layer: the same pages bit for bit, padding written nowhere, the model's cached
forward writing through it when asked, and a lowering to Triton for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_model_config
from glmjax.cache import paged
from glmjax.model import init_params
from glmjax.runtime import Runtime
from pallas_kernels.paged_write import paged_write
from tests.h200_lowering import TRITON_CALL, h200_text
from tests.test_quant_model import kernel_launches

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


def _layer(kv_dtype: str, rank: int, rope: int, index: int | None, pages: int = 7, page_size: int = 8):
  """An empty layer of the given widths with random contents in the pages already there."""
  rng = np.random.default_rng(len(kv_dtype) + rank)
  fp8 = kv_dtype == "fp8"
  plain = jnp.float32 if kv_dtype == "fp32" else jnp.bfloat16

  def pages_of(dim):
    values = rng.standard_normal((pages, page_size, dim)).astype(np.float32)
    if not fp8:
      return jnp.asarray(values, plain), None
    from glmjax.cache.kv_fp8 import quantize_fp8
    return quantize_fp8(jnp.asarray(values))

  latent, latent_scale = pages_of(rank)
  index_k, index_scale = pages_of(index) if index else (None, None)
  k_rope = jnp.asarray(rng.standard_normal((pages, page_size, rope)), plain)
  return paged.LayerCache(latent, latent_scale, k_rope, index_k, index_scale)


def _rows(seed: int, b: int, t: int, dim: int) -> jax.Array:
  """New rows with blocks of very different magnitudes (distinct scales), one all-zero block."""
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((b, t, dim)) * 10.0 ** rng.integers(-3, 4, (b, t, max(1, dim // 128), 1)).repeat(
      min(128, dim), axis=-1).reshape(b, t, dim)
  if dim >= 256:
    rows[0, 0, 128:256] = 0.0
  return jnp.asarray(rows, jnp.bfloat16)


CASES = [("bf16", 64, 32, 32), ("fp8", 512, 64, 128), ("fp8", 256, 64, None), ("fp32", 64, 16, 64)]


@pytest.mark.parametrize("kv_dtype,rank,rope,index", CASES)
def test_paged_write_equals_write_layer(kv_dtype, rank, rope, index):
  """Two sequences, tokens across a page boundary, one padding slot; FP8 with 4 and 2 scale
  blocks per latent row: every page but the null page equal bit for bit."""
  layer = _layer(kv_dtype, rank, rope, index)
  page_table = jnp.asarray([[3, 5, 1], [2, 4, 6]], jnp.int32)
  positions = jnp.asarray([[6, 7, 8, -1], [17, 18, 19, 20]], jnp.int32)
  b, t = positions.shape
  new = (_rows(1, b, t, rank), _rows(2, b, t, rope), None if index is None else _rows(3, b, t, index))
  want = paged.write_layer(layer, page_table, positions, *new)
  got = paged_write(layer, page_table, positions, *new)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g[1:]).view(np.uint8), np.asarray(w[1:]).view(np.uint8))
  # Padding writes nothing: the null page keeps what it held.
  for g, old in zip(jax.tree.leaves(got), jax.tree.leaves(layer)):
    np.testing.assert_array_equal(np.asarray(g[0]).view(np.uint8), np.asarray(old[0]).view(np.uint8))


def test_paged_write_refuses_mismatched_rows():
  layer = _layer("fp8", 256, 64, None)
  page_table, positions = jnp.ones((1, 3), jnp.int32), jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="latent rows must be"):
    paged_write(layer, page_table, positions, jnp.zeros((1, 2, 128)), jnp.zeros((1, 2, 64)), None)
  with pytest.raises(ValueError, match="no indexer keys"):
    paged_write(layer, page_table, positions, jnp.zeros((1, 2, 256)), jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 32)))


def test_model_writes_through_the_kernel_only_when_asked():
  """Runtime.cache_write="pallas": the cached forward's page writes are paged_write launches (one
  per layer), and none under "xla". (The pages it writes equal write_layer's, above.)"""
  from glmjax.cache.paged import init_cache
  from glmjax.model import CausalLM
  config = get_model_config("tiny")
  params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  cache = jax.eval_shape(lambda: init_cache(config, num_pages=9, page_size=8, batch=1, max_pages=8, kv_dtype="fp8"))
  tokens, positions = jnp.zeros((1, 3), jnp.int32), jnp.arange(3, dtype=jnp.int32)[None]
  def writes(write: str) -> int:  # the only Pallas kernels of this runtime
    run = lambda p, c: CausalLM(config).apply({"params": p}, tokens, positions, cache=c,
                                              runtime=Runtime(attention="sparse", cache_write=write))
    return kernel_launches(jax.make_jaxpr(run)(params, cache).jaxpr)
  assert writes("pallas") == config.num_hidden_layers and writes("xla") == 0


def test_paged_write_lowers_to_triton_for_h200():
  s = jax.ShapeDtypeStruct
  layer = paged.LayerCache(s((65, 64, 512), jnp.float8_e4m3fn), s((65, 64, 4), jnp.float32),
                           s((65, 64, 64), jnp.bfloat16), s((65, 64, 128), jnp.float8_e4m3fn),
                           s((65, 64, 1), jnp.float32))
  args = (layer, s((1, 64), jnp.int32), s((1, 5), jnp.int32), s((1, 5, 512), jnp.bfloat16),
          s((1, 5, 64), jnp.bfloat16), s((1, 5, 128), jnp.bfloat16))
  assert TRITON_CALL in h200_text(lambda *a: paged_write(*a, interpret=False), *args)
