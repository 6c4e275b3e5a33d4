"""MLA's one-launch projection epilogue (pallas_kernels/mla_epilogue.py) against the XLA path it
replaces: random q_a and kv_a partials at a TEP=8 rank's GLM-5 shapes and awkward ones, the
rotation's pairs, bad inputs, the H200 lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.cache import paged
from pallas_kernels.indexer_keys import indexer_keys
from pallas_kernels.mla_epilogue import mla_epilogue, mla_epilogue_reference
from tests import test_indexer_keys
from tests.h200_lowering import TRITON_CALL, h200_text

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
# (splits, tokens, q_lora Q, latent rank R, rope P): a rank's GLM-5 layer at 5 tokens and at 1;
# then no power of two (Q 40, R 22, a rope of 3 pairs).
SHAPES = [(8, 5, 2048, 512, 64), (1, 1, 2048, 512, 64), (3, 7, 40, 22, 6)]


def draw(shape, seed: int):
  """Partials on a grid of 1/64 (|p| < 256): their fp32 sums are exact in any order, so both
  paths round the same sums to bf16."""
  splits, tokens, q_lora, rank, rope = shape
  rng = np.random.default_rng(seed)
  grid = lambda width: jnp.asarray(rng.integers(-2**14, 2**14, size=(splits, tokens, width)) / 64, jnp.float32)
  norms = [jnp.asarray(1 + 0.1 * rng.normal(size=width), jnp.bfloat16) for width in (q_lora, rank)]
  angles = rng.uniform(0, 2 * np.pi, size=(tokens, rope // 2))
  cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
  return grid(q_lora), grid(rank + rope), *norms, cos, sin


@pytest.mark.parametrize("shape", SHAPES)
def test_mla_epilogue_matches_the_xla_path(shape):
  args = draw(shape, seed=hash(shape) % 2**31)
  got = mla_epilogue(*args)
  want = mla_epilogue_reference(*args)
  for g, w in zip(got, want, strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype == jnp.bfloat16
  as_f32 = lambda arrays: [np.asarray(a, np.float32) for a in arrays]
  (q_resid, latent, k_pe), (want_q, want_latent, want_pe) = as_f32(got), as_f32(want)
  for g, w in ((q_resid, want_q), (latent, want_latent)):  # fp32 statistics in another order: one bf16 ulp
    np.testing.assert_allclose(g, w, rtol=2.0 ** -7, atol=0)
  np.testing.assert_array_equal(k_pe, want_pe)  # the same bf16 sums: the reference's rotation, bit for bit


@pytest.mark.parametrize("shape, keys", [(SHAPES[0], (8, 5, 128, 4, 64)), (SHAPES[2], (3, 7, 22, 3, 6))])
def test_the_indexer_keys_join_the_launch(shape, keys):
  """index_keys: a third program per token does indexer_keys' work in the same launch: MLA's
  outputs as without it and the indexer's as indexer_keys' own launch, bit for bit (the same
  code), each near its reference."""
  args = draw(shape, seed=3)
  k, w, norm_weight, norm_bias, _, _ = test_indexer_keys.draw(keys, jnp.bfloat16, seed=4)
  index_keys = (k, w, norm_weight, norm_bias)
  got = mla_epilogue(*args, index_keys=index_keys)
  assert len(got) == 5
  for g, w_ in zip(got, (*mla_epilogue(*args), *indexer_keys(*index_keys, *args[-2:])), strict=True):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w_, np.float32))
  want_k, want_weights = mla_epilogue_reference(*args, index_keys=index_keys)[3:]
  np.testing.assert_allclose(got[3], want_k, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[4], want_weights, rtol=1e-6, atol=1e-6)


# (kv_dtype, shape, the indexer's (splits, tokens, D, H, rope) or None, batch): a rank's GLM-5
# layer over FP8 pages; two sequences over bf16 pages, no indexer.
WRITES = [("fp8", SHAPES[0], (8, 5, 128, 4, 64), 1), ("bf16", (2, 6, 64, 32, 16), None, 2)]


@pytest.mark.parametrize("kv_dtype, shape, keys, batch", WRITES)
def test_the_cache_write_joins_the_launch(kv_dtype, shape, keys, batch):
  """write: the launch also writes its own latent, k_pe and indexer key rows into the layer's
  pages, as paged.write_layer writes those outputs (codes and scales bit for bit): tokens across
  a page boundary, a padding position that writes nothing; the other outputs as without it (the
  bf16 ones bit for bit, the indexer's fp32 keys to fp32 rounding: the interpreter compiles the
  two launches as two XLA programs, and XLA's CPU emitter may round their fp32 norms apart)."""
  from tests.test_paged_write import _layer
  splits, tokens, _, rank, rope = shape
  args = draw(shape, seed=7)
  index_keys = None
  if keys:
    k, w, norm_weight, norm_bias, _, _ = test_indexer_keys.draw(keys, jnp.bfloat16, seed=8)
    index_keys = (k, w, norm_weight, norm_bias)
  layer = _layer(kv_dtype, rank, rope, keys and keys[2])
  page_table = jnp.asarray([[3, 5, 1], [2, 4, 6]][:batch], jnp.int32)
  positions = jnp.asarray([[6, 7, 8, -1, 9], [15, 16, 17, 18, 19]][:batch], jnp.int32)[:, :tokens // batch]
  got = mla_epilogue(*args, index_keys=index_keys, write=(layer, page_table, positions))
  plain = mla_epilogue(*args, index_keys=index_keys)
  for g, w_ in zip(got[:-1], plain, strict=True):
    if g.dtype == jnp.float32:
      scale = np.abs(np.asarray(w_)).max()
      np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=0, atol=4 * np.finfo(np.float32).eps * scale)
    else:
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w_, np.float32))
  rows = lambda a: a.reshape(*positions.shape, -1)
  want = paged.write_layer(layer, page_table, positions, rows(got[1]), rows(got[2]),
                           rows(got[3]) if keys else None)
  for g, w_, old in zip(jax.tree.leaves(got[-1]), jax.tree.leaves(want), jax.tree.leaves(layer), strict=True):
    assert g.dtype == w_.dtype and g.shape == w_.shape
    np.testing.assert_array_equal(np.asarray(g[1:]).view(np.uint8), np.asarray(w_[1:]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(g[0]).view(np.uint8), np.asarray(old[0]).view(np.uint8))


def test_rope_pairs_rotate_in_place():
  """A quarter turn maps each pair (x, y) of kv_a's rope part to (-y, x)."""
  q, kv, q_norm, kv_norm, cos, _ = draw(SHAPES[2], seed=5)
  _, _, k_pe = mla_epilogue(q, kv, q_norm, kv_norm, jnp.zeros_like(cos), jnp.ones_like(cos))
  rope = np.asarray(jnp.sum(kv, axis=0).astype(jnp.bfloat16).astype(jnp.float32))[:, 22:]
  np.testing.assert_array_equal(np.asarray(k_pe, np.float32)[:, 0::2], -rope[:, 1::2])
  np.testing.assert_array_equal(np.asarray(k_pe, np.float32)[:, 1::2], rope[:, 0::2])


def test_bad_inputs_are_named():
  q, kv, q_norm, kv_norm, cos, sin = draw(SHAPES[2], seed=1)
  with pytest.raises(ValueError, match="q_partials must be f32"):
    mla_epilogue(q.astype(jnp.bfloat16), kv, q_norm, kv_norm, cos, sin)
  with pytest.raises(ValueError, match=r"kv_partials must be f32 \[3, 7, rank \+ rope\]"):
    mla_epilogue(q, kv[:, :5], q_norm, kv_norm, cos, sin)
  with pytest.raises(ValueError, match=r"q_norm must be \[40\]"):
    mla_epilogue(q, kv, q_norm[:8], kv_norm, cos, sin)
  with pytest.raises(ValueError, match="kv_norm must be"):
    mla_epilogue(q, kv, q_norm, kv_norm[:21], cos, sin)
  with pytest.raises(ValueError, match=r"cos must be f32 \[7, 3\]"):
    mla_epilogue(q, kv, q_norm, kv_norm, cos[:, :2], sin)
  k, w, norm_weight, norm_bias, _, _ = test_indexer_keys.draw((2, 7, 22, 3, 6), jnp.bfloat16, seed=2)
  with pytest.raises(ValueError, match=r"k_partials must be f32 \[3, 7, D\]"):
    mla_epilogue(q, kv, q_norm, kv_norm, cos, sin, index_keys=(k, w, norm_weight, norm_bias))
  from tests.test_paged_write import _layer
  page_table, positions = jnp.ones((1, 3), jnp.int32), jnp.zeros((1, 7), jnp.int32)
  with pytest.raises(ValueError, match="the kernel needs a power-of-two latent width"):
    mla_epilogue(q, kv, q_norm, kv_norm, cos, sin, write=(_layer("bf16", 22, 6, None), page_table, positions))
  with pytest.raises(ValueError, match=r"write's positions \[1, 6\] must hold the 7 tokens'"):
    mla_epilogue(q, kv, q_norm, kv_norm, cos, sin, write=(_layer("bf16", 22, 6, None), page_table, positions[:, :6]))


def test_mla_epilogue_lowers_to_triton_for_h200():
  s = jax.ShapeDtypeStruct
  for splits, tokens, q_lora, rank, rope in SHAPES:
    args = (s((splits, tokens, q_lora), jnp.float32), s((splits, tokens, rank + rope), jnp.float32),
            s((q_lora,), jnp.bfloat16), s((rank,), jnp.bfloat16), s((tokens, rope // 2), jnp.float32),
            s((tokens, rope // 2), jnp.float32))
    assert TRITON_CALL in h200_text(lambda *a: mla_epilogue(*a, interpret=False), *args)
    keys = (s((splits, tokens, 128), jnp.float32), s((splits, tokens, 4), jnp.float32), s((128,), jnp.bfloat16),
            s((128,), jnp.bfloat16))
    assert TRITON_CALL in h200_text(lambda *a: mla_epilogue(*a[:6], index_keys=a[6:], interpret=False), *args, *keys)
    if (splits, tokens) == (8, 5):  # a rank's GLM-5 layer writing its FP8 pages too
      layer = paged.LayerCache(s((65, 64, 512), jnp.float8_e4m3fn), s((65, 64, 4), jnp.float32),
                               s((65, 64, 64), jnp.bfloat16), s((65, 64, 128), jnp.float8_e4m3fn),
                               s((65, 64, 1), jnp.float32))
      write = (layer, s((1, 64), jnp.int32), s((1, 5), jnp.int32))
      lowered = lambda *a: mla_epilogue(*a[:6], index_keys=a[6:10], write=a[10:], interpret=False)
      assert TRITON_CALL in h200_text(lowered, *args, *keys, *write)
