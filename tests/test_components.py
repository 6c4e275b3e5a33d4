"""Model components against small independent numpy references."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_model_config
from glmjax import dsa, footprint, torch_topk
from glmjax.analysis import layer_selections
from glmjax.cache import kv_fp8
from glmjax.layers import apply_rope, rope_cos_sin
from glmjax.model import abstract_params, init_params, CausalLM
from glmjax.moe import experts_reference, route
from glmjax.runtime import Runtime, make_runtime


def numpy_rope(x, positions, theta):
  """Interleaved-pair rotation written out with complex numbers."""
  d = x.shape[-1]
  freqs = positions[..., None] * (1.0 / theta ** (np.arange(0, d, 2) / d))
  z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * freqs)[:, :, None, :]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = z.real, z.imag
  return out


@pytest.mark.parametrize("dim,theta", [(16, 1e6), (64, 8e6)])
def test_rope_matches_complex_rotation(dim, theta):
  rng = np.random.default_rng(dim)
  x = rng.standard_normal((2, 5, 3, dim)).astype(np.float32)
  pos = rng.integers(0, 5000, (2, 5)).astype(np.int32)
  cos, sin = rope_cos_sin(jnp.asarray(pos), dim, theta)
  got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
  np.testing.assert_allclose(got, numpy_rope(x, pos.astype(np.float64), theta), rtol=2e-4, atol=2e-4)


def test_rope_dot_depends_only_on_relative_position():
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((2, 1, 1, 1, 32)).astype(np.float32)
  def rot(x, p):
    cos, sin = rope_cos_sin(jnp.full((1, 1), p), 32, 1e4)
    return np.asarray(apply_rope(jnp.asarray(x), cos, sin)).ravel()
  assert np.dot(rot(q, 7), rot(k, 3)) == pytest.approx(np.dot(rot(q, 104), rot(k, 100)), rel=1e-4)


def numpy_route(logits, bias, c):
  """Brute force: enumerate allowed groups, then experts, as the GLM-5 router defines them."""
  scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
  choice = scores + bias
  per = c.n_routed_experts // c.n_group
  ids, weights = [], []
  for row, srow in zip(choice, scores):
    group_score = [np.sort(row[g * per:(g + 1) * per])[-2:].sum() for g in range(c.n_group)]
    allowed = np.argsort(group_score)[::-1][:c.topk_group]
    cand = [e for e in range(c.n_routed_experts) if e // per in allowed]
    chosen = sorted(cand, key=lambda e: -row[e])[:c.num_experts_per_tok]
    w = srow[chosen] / (srow[chosen].sum() + 1e-20) * c.routed_scaling_factor
    ids.append(chosen)
    weights.append(w)
  return np.array(ids), np.array(weights)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
def test_routing_matches_brute_force(n_group, topk_group):
  c = dataclasses.replace(get_model_config("tiny"), n_routed_experts=16, num_experts_per_tok=4,
                          n_group=n_group, topk_group=topk_group)
  rng = np.random.default_rng(n_group)
  logits = rng.standard_normal((32, 16)).astype(np.float32)
  bias = rng.standard_normal(16).astype(np.float32) * 0.5
  ids, weights = route(jnp.asarray(logits), jnp.asarray(bias), c)
  ref_ids, ref_w = numpy_route(logits, bias, c)
  order = np.argsort(np.asarray(ids), axis=1)
  ref_order = np.argsort(ref_ids, axis=1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                np.take_along_axis(ref_ids, ref_order, 1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                             np.take_along_axis(ref_w, ref_order, 1), rtol=1e-5)
  # The bias steers the choice but never enters the weights: they sum to the scaling factor.
  np.testing.assert_allclose(np.asarray(weights).sum(1), c.routed_scaling_factor, rtol=1e-5)


@pytest.mark.parametrize("tokens", [2, 40])  # gather path (few tokens) and all-experts path
def test_experts_match_per_token_loop(tokens):
  rng = np.random.default_rng(tokens)
  e, i, d, k = 6, 8, 12, 2
  x = rng.standard_normal((tokens, d)).astype(np.float32)
  gate, up = rng.standard_normal((2, e, i, d)).astype(np.float32)
  down = rng.standard_normal((e, d, i)).astype(np.float32)
  ids = rng.integers(-1, e + 2, (tokens, k)).astype(np.int32)   # some ids are not local: they add 0
  w = rng.random((tokens, k)).astype(np.float32)
  got = experts_reference(*map(jnp.asarray, (x, ids, w, gate, up, down)))
  silu = lambda a: a / (1 + np.exp(-a))
  ref = np.zeros_like(x)
  for n in range(tokens):
    for s in range(k):
      if 0 <= ids[n, s] < e:
        ex = ids[n, s]
        ref[n] += w[n, s] * (down[ex] @ (silu(gate[ex] @ x[n]) * (up[ex] @ x[n])))
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length,k", [(5, 8), (8, 8), (30, 8)])
def test_topk_selection_shorter_equal_longer_than_k(length, k):
  rng = np.random.default_rng(length)
  scores = rng.standard_normal((1, 1, 32)).astype(np.float32)
  scores[..., length:] = -np.inf
  scores[0, 0, 2] = scores[0, 0, 3]   # a tie: the lower position must win
  got = np.asarray(dsa.select_topk(jnp.asarray(scores), k))[0, 0]
  valid = np.argsort(-scores[0, 0], kind="stable")[:min(k, length)]
  assert sorted(got[got >= 0].tolist()) == sorted(valid.tolist())
  assert (got < 0).sum() == k - min(k, length)


def test_torch_topk_emulation_without_ties_is_plain_topk():
  rng = np.random.default_rng(1)
  rows = rng.standard_normal((20, 37))
  got = torch_topk.torch_topk_rows(rows, 9)
  np.testing.assert_array_equal(np.sort(got, 1), np.sort(np.argsort(-rows, 1)[:, :9], 1))


def test_shared_layer_reuses_previous_full_selection():
  """A 'shared' layer runs no indexer: its top-k is the preceding full layer's, bit for bit."""
  config = get_model_config("tiny")
  assert config.indexer_types[2] == "shared"
  params = init_params(config, jax.random.key(0), param_dtype=jnp.float32)
  tokens = jax.random.randint(jax.random.key(1), (1, 20), 0, config.vocab_size)
  seen = layer_selections(config, params, tokens)
  np.testing.assert_array_equal(seen[2], seen[1])
  assert not np.array_equal(seen[3], seen[1])
  assert "indexer" not in params["layers_2"]["self_attn"]


@pytest.mark.parametrize("indexer,attention", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                               ("float32", "float32"), ("float8_e4m3fn", "float32")])
def test_query_precision_switches_reach_their_kernels(monkeypatch, indexer, attention):
  """Runtime.indexer_queries rounds the indexer queries before scoring, on the no-cache forward
  (index_scores) and on the cached path (cached_topk) alike; Runtime.attention_queries rounds
  the absorbed queries entering the cached attention; float32 keeps them as computed."""
  from glmjax.cache.paged import init_cache
  from glmjax.engine import steps
  config = get_model_config("tiny")
  params = abstract_params(config)
  cache = init_cache(config, num_pages=4, page_size=4, batch=1, max_pages=3, kv_dtype="bf16")
  tokens = jnp.arange(2, 14)[None]
  seen = []
  for name in ("index_scores", "cached_topk", "cached_attention"):
    monkeypatch.setattr(dsa, name, functools.partial(
        lambda fn, name, q, *a, **k: seen.append((name, q.dtype)) or fn(q, *a, **k), getattr(dsa, name), name))
  runtime = Runtime(attention="sparse", indexer_queries=indexer, attention_queries=attention)
  jax.eval_shape(lambda p: CausalLM(config).apply({"params": p}, tokens, runtime=runtime), params)
  jax.eval_shape(functools.partial(steps.prefill_chunk, spec=steps.StepSpec(config, runtime, "bfloat16")),
                 params, cache, tokens, tokens - 2)
  dtypes = lambda *names: {dtype for name, dtype in seen if name in names}
  assert dtypes("index_scores", "cached_topk") == {jnp.dtype(indexer)}
  assert dtypes("cached_attention") == {jnp.dtype(attention)}
  assert {name for name, _ in seen} == {"index_scores", "cached_topk", "cached_attention"}


def test_indexer_query_codes_score_as_their_scaled_values():
  """float8_e4m3fn indexer queries: e4m3 codes of one power-of-two scale per (token, head), that
  scale in the head weights; the scores equal those of the dequantized queries bit for bit (the
  scale is exact), and stay within e4m3's rounding of the fp32 queries' scores."""
  kq, kw, kk = jax.random.split(jax.random.key(5), 3)
  magnitude = 10.0 ** jax.random.uniform(kw, (2, 3, 4, 1), minval=-3, maxval=3)  # heads far apart in size
  q = jax.random.normal(kq, (2, 3, 4, 32)) * magnitude
  weights = jax.random.normal(kw, (2, 3, 4))
  keys = jax.random.normal(kk, (2, 11, 32))
  valid = dsa.causal_valid(jnp.array([[7, 8, 10], [2, 3, -1]]), 11)
  codes, folded = dsa.index_query_operands(q, weights, "float8_e4m3fn")
  assert codes.dtype == jnp.float8_e4m3fn
  scale = kv_fp8.quantize_block(q)[1]
  np.testing.assert_array_equal(np.frexp(np.asarray(scale))[0], 0.5)  # powers of two
  np.testing.assert_array_equal(folded, weights * scale)
  assert float(jnp.max(jnp.abs(codes.astype(jnp.float32)))) > 224  # each head's largest code near the range's top
  dequantized = codes.astype(jnp.float32) * scale[..., None]
  got = dsa.index_scores(codes, folded, keys, valid)
  np.testing.assert_array_equal(got, dsa.index_scores(dequantized, weights, keys, valid))
  exact = dsa.index_scores(q, weights, keys, valid)
  finite = np.isfinite(exact)
  np.testing.assert_array_equal(np.isfinite(got), finite)
  assert 0 < np.max(np.abs(got - exact)[finite]) < 2 ** -4 * np.max(np.abs(exact)[finite])
  rounded, same = dsa.index_query_operands(q, weights, "bfloat16")
  assert rounded.dtype == jnp.bfloat16 and same is weights


def test_index_share_override_needs_indexer_weights():
  config = get_model_config("tiny")
  params = init_params(config, jax.random.key(0), param_dtype=jnp.float32)
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="no indexer weights"):  # refused while tracing: nothing runs
    jax.eval_shape(lambda p: CausalLM(config).apply({"params": p}, tokens,
                                                    runtime=make_runtime(config, index_share="off")), params)
  rt = make_runtime(config, index_share=4)
  assert rt.indexer_pattern == (True, False, False, False)


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_param_tree_matches_footprint_accounting(name):
  """The model's params, named as in the checkpoint, are exactly the tensors footprint counts."""
  from glmjax.checkpoint import _path_str, hf_names
  config = get_model_config(name)
  ours = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(nn.unbox(abstract_params(config)))[0]:
    names, stacked = hf_names(config, _path_str(path))
    ours.update({n: tuple(leaf.shape[1:] if stacked else leaf.shape) for n in names})
  assert ours == {t.name: tuple(t.shape) for t in footprint.checkpoint_tensors(config)}
