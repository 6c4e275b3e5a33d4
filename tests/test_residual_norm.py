"""The one-launch residual add and RMSNorm (pallas_kernels/residual_norm.py) against the XLA path
it replaces: random o_proj partials at a TEP=8 rank's GLM-5 shapes and awkward ones, both residual
dtypes; a layer's close (the shared expert's partials and the routed experts' term); bad inputs,
the H200 lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.residual_norm import residual_norm, residual_norm_reference
from tests.h200_lowering import TRITON_CALL, h200_text

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
# (splits, tokens, hidden D): a rank's GLM-5 layer at 5 tokens and at 1 (after TEP's all-reduce:
# one split); then no power of two (D 40, 7 tokens).
SHAPES = [(8, 5, 6144), (1, 1, 6144), (3, 7, 40)]


def draw(shape, residual_dtype, seed: int):
  """Partials on a grid of 1/64 (|p| < 256): their fp32 sums are exact in any order, so both
  paths round the same sums."""
  splits, tokens, width = shape
  rng = np.random.default_rng(seed)
  partials = jnp.asarray(rng.integers(-2**14, 2**14, size=(splits, tokens, width)) / 64, jnp.float32)
  residual = jnp.asarray(50 * rng.normal(size=(tokens, width)), residual_dtype)
  weight = jnp.asarray(1 + 0.1 * rng.normal(size=width), jnp.bfloat16)
  return residual, partials, weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual_dtype", [jnp.float32, jnp.bfloat16])
def test_residual_norm_matches_the_xla_path(shape, residual_dtype):
  args = draw(shape, residual_dtype, seed=hash((shape, str(residual_dtype))) % 2**31)
  (x, h), (want_x, want_h) = residual_norm(*args, eps=1e-5), residual_norm_reference(*args, eps=1e-5)
  assert x.dtype == want_x.dtype == jnp.dtype(residual_dtype) and h.dtype == want_h.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))  # the same sums
  # fp32 statistics summed in another order: at most one bf16 ulp
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), rtol=2.0 ** -7, atol=0)
  assert np.abs(np.asarray(h, np.float32)).max() > 0.5  # normalised rows, not zeros


@pytest.mark.parametrize("tokens, width", [(5, 6144), (7, 40)])
def test_rounded_output_matches_the_xla_path(tokens, width):
  """A TEP rank's case: o_proj's output already rounded to bf16 and all-reduced, one split."""
  residual, partials, weight = draw((1, tokens, width), jnp.bfloat16, seed=tokens)
  args = (residual, partials.astype(jnp.bfloat16), weight)
  (x, h), (want_x, want_h) = residual_norm(*args, eps=1e-5), residual_norm_reference(*args, eps=1e-5)
  np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), rtol=2.0 ** -7, atol=0)
  assert np.abs(np.asarray(h, np.float32)).max() > 0.5


@pytest.mark.parametrize("shape, term_splits", [((1, 5, 6144), 4), ((2, 1, 6144), 1), ((3, 7, 40), 2)])
def test_layer_close_with_a_term_matches_the_xla_path(shape, term_splits):
  """Runtime.next_norm's case: the shared expert's down partials (one split at a TEP=8 rank) and
  the routed experts' down partials as the term (4 at the rank), each sum rounded to dtype."""
  residual, partials, weight = draw(shape, jnp.float32, seed=shape[1])
  term = draw((term_splits, *shape[1:]), jnp.float32, seed=shape[2])[1] / 3  # sums off the bf16 grid
  (x, h), (want_x, want_h) = (fn(residual, partials, weight, eps=1e-5, term=term)
                              for fn in (residual_norm, residual_norm_reference))
  np.testing.assert_array_equal(np.asarray(x), np.asarray(want_x))
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), rtol=2.0 ** -7, atol=0)
  (without, _) = residual_norm_reference(residual, partials, weight, eps=1e-5)
  assert np.abs(np.asarray(x - without)).max() > 1  # the term reached the residual
  bf16_term = jnp.sum(term, axis=0).astype(jnp.bfloat16)[None]  # a TEP rank's: one split, rounded
  np.testing.assert_array_equal(*(np.asarray(fn(residual, partials, weight, eps=1e-5, term=bf16_term)[0])
                                  for fn in (residual_norm, residual_norm_reference)))


def test_bad_inputs_are_named():
  residual, partials, weight = draw(SHAPES[2], jnp.float32, seed=1)
  with pytest.raises(ValueError, match=r"residual must be bf16 or f32 \[tokens, D\]"):
    residual_norm(residual[None], partials, weight, eps=1e-5)
  with pytest.raises(ValueError, match=r"partials must be \[splits, 7, 40\]"):
    residual_norm(residual, partials[:, :5], weight, eps=1e-5)
  with pytest.raises(ValueError, match="partials must be f32 or bf16"):
    residual_norm(residual, partials.astype(jnp.float16), weight, eps=1e-5)
  with pytest.raises(ValueError, match="bf16 partials must be one split"):
    residual_norm(residual, partials.astype(jnp.bfloat16), weight, eps=1e-5)
  with pytest.raises(ValueError, match=r"weight must be \[40\]"):
    residual_norm(residual, partials, weight[:8], eps=1e-5)
  with pytest.raises(ValueError, match=r"term must be \[splits, 7, 40\], got \[3, 5, 40\]"):
    residual_norm(residual, partials, weight, eps=1e-5, term=partials[:, :5])
  with pytest.raises(ValueError, match="bf16 term must be one split"):
    residual_norm(residual, partials, weight, eps=1e-5, term=partials.astype(jnp.bfloat16))


def test_residual_norm_lowers_to_triton_for_h200():
  s = jax.ShapeDtypeStruct
  for (splits, tokens, width), partials in [*((shape, jnp.float32) for shape in SHAPES), ((1, 5, 6144), jnp.bfloat16)]:
    args = (s((tokens, width), jnp.float32), s((splits, tokens, width), partials), s((width,), jnp.bfloat16))
    assert TRITON_CALL in h200_text(lambda *a: residual_norm(*a, eps=1e-5, interpret=False), *args)
  args = (s((5, 6144), jnp.float32), s((1, 5, 6144), jnp.float32), s((6144,), jnp.bfloat16),
          s((4, 5, 6144), jnp.float32))
  assert TRITON_CALL in h200_text(lambda r, p, w, t: residual_norm(r, p, w, eps=1e-5, term=t, interpret=False), *args)
