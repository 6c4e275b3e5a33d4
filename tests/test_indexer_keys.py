"""The indexer's one-launch key and head weights (pallas_kernels/indexer_keys.py) against the
XLA path it replaces: random wk and weights_proj partials at a TEP=8 rank's GLM-5 shapes and
awkward ones, the rotation's pairs, bad inputs, the H200 lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer_keys import indexer_keys, indexer_keys_reference
from tests.h200_lowering import TRITON_CALL, h200_text

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
# (splits, tokens, key dims D, heads H, rope): a rank's GLM-5 layer at 5 tokens and at 1; then
# no power of two (D 22 of which 6 rotate, 3 heads).
SHAPES = [(8, 5, 128, 4, 64), (1, 1, 128, 32, 64), (3, 7, 22, 3, 6)]


def draw(shape, param_dtype, seed: int):
  splits, tokens, dim, heads, rope = shape
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.normal(size=(splits, tokens, dim)) + 0.3, jnp.float32)  # a mean to subtract
  w = jnp.asarray(rng.normal(size=(splits, tokens, heads)), jnp.float32)
  norm_weight = jnp.asarray(1 + 0.1 * rng.normal(size=dim), param_dtype)
  norm_bias = jnp.asarray(0.1 * rng.normal(size=dim), param_dtype)
  angles = rng.uniform(0, 2 * np.pi, size=(tokens, rope // 2))
  cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
  return k, w, norm_weight, norm_bias, cos, sin


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32])
def test_indexer_keys_match_the_xla_path(shape, param_dtype):
  args = draw(shape, param_dtype, seed=hash((shape, param_dtype)) % 2**31)
  k, weights = indexer_keys(*args)
  want_k, want_weights = indexer_keys_reference(*args)
  assert k.shape == want_k.shape and k.dtype == jnp.float32 and weights.shape == want_weights.shape
  np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=1e-5)  # unit-variance keys: fp32 sums' order
  np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-6)


def test_rope_pairs_rotate_in_place():
  """A quarter turn maps each rotated pair (x, y) to (-y, x) and leaves the other columns."""
  k_partials, w, norm_weight, norm_bias, cos, _ = draw(SHAPES[2], jnp.float32, seed=5)
  plain, _ = indexer_keys(k_partials, w, norm_weight, norm_bias, jnp.ones_like(cos), jnp.zeros_like(cos))
  turned, _ = indexer_keys(k_partials, w, norm_weight, norm_bias, jnp.zeros_like(cos), jnp.ones_like(cos))
  plain, turned = np.asarray(plain), np.asarray(turned)
  np.testing.assert_array_equal(turned[:, 0:6:2], -plain[:, 1:6:2])
  np.testing.assert_array_equal(turned[:, 1:6:2], plain[:, 0:6:2])
  np.testing.assert_array_equal(turned[:, 6:], plain[:, 6:])


def test_bad_inputs_are_named():
  k, w, norm_weight, norm_bias, cos, sin = draw(SHAPES[2], jnp.float32, seed=1)
  with pytest.raises(ValueError, match="k_partials must be f32"):
    indexer_keys(k[..., :-1], w, norm_weight, norm_bias, cos, sin)
  with pytest.raises(ValueError, match=r"w_partials must be f32 \[3, 7, heads\]"):
    indexer_keys(k, w[:, :5], norm_weight, norm_bias, cos, sin)
  with pytest.raises(ValueError, match=r"norm_bias must be \[22\]"):
    indexer_keys(k, w, norm_weight, norm_bias[:20], cos, sin)
  with pytest.raises(ValueError, match="cos must be f32"):
    indexer_keys(k, w, norm_weight, norm_bias, jnp.ones((7, 12), jnp.float32), sin)
  with pytest.raises(ValueError, match="sin must be f32"):
    indexer_keys(k, w, norm_weight, norm_bias, cos, sin[:5])


def test_indexer_keys_lower_to_triton_for_h200():
  s = jax.ShapeDtypeStruct
  for splits, tokens, dim, heads, rope in SHAPES:
    args = (s((splits, tokens, dim), jnp.float32), s((splits, tokens, heads), jnp.float32),
            s((dim,), jnp.bfloat16), s((dim,), jnp.bfloat16), s((tokens, rope // 2), jnp.float32),
            s((tokens, rope // 2), jnp.float32))
    assert TRITON_CALL in h200_text(lambda *a: indexer_keys(*a, interpret=False), *args)
