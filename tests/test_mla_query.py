"""MLA's one-launch absorbed query (pallas_kernels/mla_query.py) against the XLA path it replaces:
random q_b partials at a TEP=8 rank's GLM-5 shapes and awkward ones, bad inputs, the H200
lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_query import absorbed_query, absorbed_query_reference
from tests.h200_lowering import TRITON_CALL, h200_text

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
# (splits, tokens, heads, nope, rope, values, rank): a rank's GLM-5 layer at 5 tokens and at 1;
# then no power of two anywhere (nope 22, a rope of 3 pairs, 40 latent columns: not a whole block).
SHAPES = [(8, 5, 8, 192, 64, 256, 512), (1, 1, 8, 192, 64, 256, 512), (3, 7, 3, 22, 6, 10, 40)]


def draw(shape, kv_dtype, seed: int):
  """Partials on a grid of 1/64 (|p| < 256): their fp32 sums are exact in any order, so the kernel's
  q rounds to bf16 as the reference's does, whichever order each sums its splits in."""
  splits, tokens, heads, nope, rope, values, rank = shape
  rng = np.random.default_rng(seed)
  partials = jnp.asarray(rng.integers(-2**14, 2**14, size=(splits, tokens, heads * (nope + rope))) / 64, jnp.float32)
  kv_b = jnp.asarray(0.05 * rng.normal(size=(heads, nope + values, rank)), kv_dtype)
  angles = rng.uniform(0, 2 * np.pi, size=(tokens, rope // 2))
  return partials, kv_b, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype,out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                                (jnp.float32, jnp.float32)])
def test_absorbed_query_matches_the_xla_path(shape, kv_dtype, out_dtype):
  partials, kv_b, cos, sin = draw(shape, kv_dtype, seed=hash((shape, kv_dtype, out_dtype)) % 2**31)
  nope = shape[3]
  got = absorbed_query(partials, kv_b, cos, sin, nope=nope, out_dtype=out_dtype)
  want = absorbed_query_reference(partials, kv_b, cos, sin, nope=nope, out_dtype=out_dtype)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == jnp.dtype(out_dtype)
  q_latent, q_pe = (np.asarray(a, np.float32) for a in got)
  want_latent, want_pe = (np.asarray(a, np.float32) for a in want)
  # The products' fp32 sum in another order, then one rounding to out_dtype: within its ulp.
  ulp = 2.0 ** (-7 if out_dtype == jnp.bfloat16 else -20)
  np.testing.assert_allclose(q_latent, want_latent, rtol=ulp, atol=ulp * np.abs(want_latent).max())
  np.testing.assert_array_equal(q_pe, want_pe)  # the same bf16 q: the reference's rotation, bit for bit


# (MLA shape, indexer heads Hi, their columns Di): a TEP=8 rank's 4 heads; all 32 of GLM-5's at
# one token (4 program blocks past the latent ones); 5 heads of 10 columns over 3 MLA heads.
INDEX_SHAPES = [(SHAPES[0], 4, 128), (SHAPES[1], 32, 128), (SHAPES[2], 5, 10)]


@pytest.mark.parametrize("shape, index_heads, index_dim", INDEX_SHAPES)
@pytest.mark.parametrize("index_dtype", [jnp.float32, jnp.bfloat16])
def test_the_indexer_query_joins_the_launch(shape, index_heads, index_dim, index_dtype):
  """index_partials: the indexer's query from its wq_b partials in the same launch, as the
  reference (the Indexer's sum and leading RoPE in fp32, one cast); MLA's outputs unchanged."""
  partials, kv_b, cos, sin = draw(shape, jnp.bfloat16, seed=7)
  rng = np.random.default_rng(8)
  index = jnp.asarray(rng.integers(-2**14, 2**14, size=(shape[0], shape[1], index_heads * index_dim)) / 64,
                      jnp.float32)  # on draw's grid: sums exact in any order
  kw = dict(nope=shape[3], out_dtype=jnp.bfloat16, index_partials=index, index_heads=index_heads,
            index_dtype=index_dtype)
  q_latent, q_pe, index_q = absorbed_query(partials, kv_b, cos, sin, **kw)
  for g, w in zip((q_latent, q_pe), absorbed_query(partials, kv_b, cos, sin, nope=shape[3], out_dtype=jnp.bfloat16)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  want = absorbed_query_reference(partials, kv_b, cos, sin, **kw)[2]
  assert index_q.shape == want.shape == (shape[1], index_heads, index_dim) and index_q.dtype == jnp.dtype(index_dtype)
  ulp = 2.0 ** (-8 if index_dtype == jnp.bfloat16 else -22)  # the rotation's fp32 products, then one rounding
  np.testing.assert_allclose(np.asarray(index_q, np.float32), np.asarray(want, np.float32), rtol=ulp,
                             atol=ulp * float(jnp.abs(want.astype(jnp.float32)).max()))
  # the columns past the rope ones are the summed partials, unrotated
  plain = jnp.sum(index, axis=0).reshape(shape[1], index_heads, index_dim)[..., shape[4]:].astype(index_dtype)
  np.testing.assert_array_equal(np.asarray(index_q[..., shape[4]:], np.float32), np.asarray(plain, np.float32))


def test_pairs_rotate_in_place():
  """A rotation by a quarter turn maps each pair (x, y) to (-y, x): the pairs are (2i, 2i + 1)."""
  partials, kv_b, _, _ = draw(SHAPES[2], jnp.bfloat16, seed=3)
  quarter = jnp.zeros((7, 3), jnp.float32), jnp.ones((7, 3), jnp.float32)
  _, q_pe = absorbed_query(partials, kv_b, *quarter, nope=22)
  q = np.asarray(jnp.sum(partials, axis=0).astype(jnp.bfloat16).astype(jnp.float32)).reshape(7, 3, 28)[..., 22:]
  np.testing.assert_allclose(np.asarray(q_pe)[..., 0::2], -q[..., 1::2], rtol=2.0 ** -8)
  np.testing.assert_allclose(np.asarray(q_pe)[..., 1::2], q[..., 0::2], rtol=2.0 ** -8)


def test_bad_inputs_are_named():
  partials, kv_b, cos, sin = draw(SHAPES[2], jnp.bfloat16, seed=1)
  with pytest.raises(ValueError, match="kv_b must be bf16 or f32"):
    absorbed_query(partials, kv_b[0], cos, sin, nope=22)
  with pytest.raises(ValueError, match="kv_b must be"):
    absorbed_query(partials, kv_b, cos, sin, nope=32)
  with pytest.raises(ValueError, match=r"partials must be f32 \[splits, tokens, 3 \* \(nope \+ rope\)\]"):
    absorbed_query(partials[..., :-1], kv_b, cos, sin, nope=22)
  with pytest.raises(ValueError, match="both must be positive and even"):
    absorbed_query(partials, kv_b, cos, sin, nope=21)
  with pytest.raises(ValueError, match=r"sin must be f32 \[7, 3\]"):
    absorbed_query(partials, kv_b, cos, sin[:5], nope=22)
  index = jnp.ones((3, 7, 5 * 10), jnp.float32)
  with pytest.raises(ValueError, match=r"index_partials must be f32 \[3, 7, 4 \* D"):
    absorbed_query(partials, kv_b, cos, sin, nope=22, index_partials=index, index_heads=4)
  with pytest.raises(ValueError, match="heads of at least 6 columns"):
    absorbed_query(partials, kv_b, cos, sin, nope=22, index_partials=index[..., :20], index_heads=5)


def test_absorbed_query_lowers_to_triton_for_h200():
  s = jax.ShapeDtypeStruct
  for splits, tokens, heads, nope, rope, values, rank in SHAPES:
    args = (s((splits, tokens, heads * (nope + rope)), jnp.float32), s((heads, nope + values, rank), jnp.bfloat16),
            s((tokens, rope // 2), jnp.float32), s((tokens, rope // 2), jnp.float32))
    op = lambda *a, nope=nope: absorbed_query(*a, nope=nope, out_dtype=jnp.bfloat16, interpret=False)
    assert TRITON_CALL in h200_text(op, *args)
    joined = lambda *a, nope=nope: absorbed_query(*a[:4], nope=nope, out_dtype=jnp.bfloat16, index_partials=a[4],
                                                  index_heads=4, index_dtype=jnp.bfloat16, interpret=False)
    assert TRITON_CALL in h200_text(joined, *args, s((splits, tokens, 4 * 128), jnp.float32))
