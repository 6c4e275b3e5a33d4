"""The router's one-launch expert choice (pallas_kernels/moe_route.py) against glmjax.moe.route:
random partial logits at GLM-5's, mini's and awkward routing shapes, ties, bad inputs, the H200
lowering, and the GEMV partials it reads; the choice launched beside x's fp16 planes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_model_config
from glmjax import quant
from pallas_kernels.nvfp4_fragments import default_fragment_config
from pallas_kernels.hfma2_planes import rows_planes
from pallas_kernels.moe_route import route_select, route_select_planes, route_select_reference
from tests.h200_lowering import TRITON_CALL, h200_text
from tests.test_quant_model import equations

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
TINY = get_model_config("tiny")
# Non-power-of-two experts, groups and k; no renormalisation; a scale other than GLM-5's.
AWKWARD = dataclasses.replace(TINY, n_routed_experts=24, n_group=3, topk_group=2, num_experts_per_tok=5,
                              norm_topk_prob=False, routed_scaling_factor=1.75)
ODD_SINGLE_GROUP = dataclasses.replace(TINY, n_routed_experts=40, num_experts_per_tok=3)
CONFIGS = {"glm5": get_model_config("glm5"), "mini": get_model_config("mini"), "awkward": AWKWARD,
           "odd_single_group": ODD_SINGLE_GROUP}


def draw(config, splits: int, tokens: int, seed: int):
  rng = np.random.default_rng(seed)
  partials = jnp.asarray(rng.normal(size=(splits, tokens, config.n_routed_experts)), jnp.float32)
  bias = jnp.asarray(0.1 * rng.normal(size=(config.n_routed_experts,)), jnp.float32)
  return partials, bias


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("splits,tokens", [(1, 1), (8, 5), (3, 7)])
def test_route_select_matches_route(name, splits, tokens):
  config = CONFIGS[name]
  partials, bias = draw(config, splits, tokens, seed=hash((name, splits, tokens)) % 2**31)
  ids, weights = route_select(partials, bias, config)
  want_ids, want_weights = route_select_reference(partials, bias, config)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)
  assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32


@pytest.mark.parametrize("name", ["glm5", "awkward"])
def test_equal_scores_choose_the_lower_index_as_top_k_does(name):
  """Logits from three values and no bias: most scores tie, within and across groups."""
  config = CONFIGS[name]
  rng = np.random.default_rng(7)
  partials = jnp.asarray(rng.integers(-1, 2, size=(1, 6, config.n_routed_experts)), jnp.float32)
  bias = jnp.zeros((config.n_routed_experts,), jnp.float32)
  ids, weights = route_select(partials, bias, config)
  want_ids, want_weights = route_select_reference(partials, bias, config)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want_weights, rtol=2e-6)


@pytest.mark.parametrize("name, splits, tokens, width, chunk_lines, shared_width",
                         [("glm5", 8, 5, 6144, 128, 256), ("glm5", 1, 1, 6144, None, 64),
                          ("awkward", 3, 7, 176, 4, 200)])
def test_route_beside_the_planes_and_the_shared_hidden(name, splits, tokens, width, chunk_lines, shared_width):
  """route_select_planes: the choice as route_select's, x's planes and maxima as rows_planes', bit
  for bit (a rank's case: 5 tokens, 3 planes programs a row; one token, whole rows; 7 tokens of
  11 lines in 3 chunks of 4); with shared=(gate, up) partials, the shared expert's hidden
  silu(gate) * up from the split sums in order, bit for bit as the MLP's bf16 ops round it one by
  one on the CPU (eager here; 200 columns: a ragged last block of 64), within a bf16 ulp on a GPU
  (Triton's exp against XLA's), the rest unchanged."""
  config = CONFIGS[name]
  partials, bias = draw(config, splits, tokens, seed=tokens)
  rng = np.random.default_rng(width)
  x = jnp.asarray(rng.normal(size=(tokens, width)) * 3, jnp.bfloat16)
  ids, weights, planes, amax = route_select_planes(partials, bias, config, x, chunk_lines=chunk_lines)
  want_ids, want_weights = route_select(partials, bias, config)
  want_planes, want_amax = rows_planes(x, chunk_lines=chunk_lines)
  for got, want in ((ids, want_ids), (weights, want_weights), (planes, want_planes), (amax, want_amax)):
    np.testing.assert_array_equal(got, want)
  assert np.count_nonzero(np.asarray(planes)) > planes.size // 2
  gate, up = (jnp.asarray(rng.normal(size=(splits, tokens, shared_width)) * scale, jnp.float32) for scale in (2.0, 1.0))
  *routed, hidden = route_select_planes(partials, bias, config, x, shared=(gate, up), chunk_lines=chunk_lines)
  in_order = lambda p: functools.reduce(jnp.add, list(p)).astype(jnp.bfloat16)
  want = jax.nn.silu(in_order(gate)) * in_order(up)
  assert hidden.shape == (tokens, shared_width) and hidden.dtype == jnp.bfloat16
  ulps = 0 if jax.default_backend() == "cpu" else 2 ** -7
  np.testing.assert_allclose(np.asarray(hidden, np.float32), np.asarray(want, np.float32), rtol=ulps, atol=0)
  for got, alone in zip(routed, (ids, weights, planes, amax), strict=True):
    np.testing.assert_array_equal(got, alone)


def test_bad_inputs_are_named():
  config = CONFIGS["glm5"]
  partials, bias = draw(config, 2, 3, seed=1)
  with pytest.raises(ValueError, match=r"partials must be f32 \[splits, tokens, 256\]"):
    route_select(partials[..., :255], bias, config)
  with pytest.raises(ValueError, match="partials must be f32"):
    route_select(partials.astype(jnp.bfloat16), bias, config)
  with pytest.raises(ValueError, match=r"bias must be f32 \[256\]"):
    route_select(partials, bias[:8], config)
  with pytest.raises(ValueError, match=r"x must hold the partials' 3 tokens, got \[4, 64\]"):
    route_select_planes(partials, bias, config, jnp.zeros((4, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"rows_planes: a must be bf16 \[M, K\]"):
    route_select_planes(partials, bias, config, jnp.zeros((3, 64), jnp.float32))
  gate = jnp.zeros((2, 3, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"shared must be f32 \[splits, 3, I\] gate and up partials alike"):
    route_select_planes(partials, bias, config, jnp.zeros((3, 64), jnp.bfloat16), shared=(gate, gate[:, :2]))


def test_route_select_lowers_to_triton_for_h200():
  for name, splits, tokens in (("glm5", 8, 5), ("glm5", 1, 1), ("awkward", 2, 3)):
    config = CONFIGS[name]
    args = (jax.ShapeDtypeStruct((splits, tokens, config.n_routed_experts), jnp.float32),
            jax.ShapeDtypeStruct((config.n_routed_experts,), jnp.float32))
    assert TRITON_CALL in h200_text(lambda *a, c=config: route_select(*a, c, interpret=False), *args)
  args = (jax.ShapeDtypeStruct((8, 5, 256), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32),
          jax.ShapeDtypeStruct((5, 6144), jnp.bfloat16))
  config = CONFIGS["glm5"]
  assert TRITON_CALL in h200_text(lambda p, b, x: route_select_planes(p, b, config, x, interpret=False), *args)
  shared = jax.ShapeDtypeStruct((8, 5, 256), jnp.float32)
  assert TRITON_CALL in h200_text(lambda p, b, x, g, u: route_select_planes(p, b, config, x, shared=(g, u),
                                                                            interpret=False), *args, shared, shared)


@pytest.mark.parametrize("dense", ["xla", "pallas"])
def test_linear_partials_sum_to_the_fp32_linear(dense):
  """Under the Pallas GEMV: its K splits unsummed (4 at this K by the rule, at most a cap, 4 to
  cover the SMs with 2 column blocks); else one term."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(1, 5, 1536)), jnp.bfloat16)
  w = jnp.asarray(0.05 * rng.normal(size=(72, 1536)), jnp.bfloat16)
  parts = quant.linear_partials(x, w, dense=dense)
  assert parts.dtype == jnp.float32 and parts.shape[1:] == (5, 72)
  assert (parts.shape[0] > 1) == (dense == "pallas")
  want = quant.linear(x, w, dense=dense, dtype=jnp.float32).reshape(5, 72)
  np.testing.assert_allclose(parts.sum(0), want, rtol=1e-5, atol=1e-5)
  capped, filled = (quant.linear_partials(x, w, dense=dense, gemv_splits=s) for s in (2, "fill"))
  assert (parts.shape[0], capped.shape[0], filled.shape[0]) == ((4, 2, 4) if dense == "pallas" else (1, 1, 1))
  np.testing.assert_allclose(capped.sum(0), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense", ["xla", "pallas", "pallas_grouped"])
def test_linear_group_partials_sum_to_the_group(dense):
  """Weights sharing x: their partials in the group's one launch under pallas_grouped (its K
  splits unsummed), else each weight's; summed, each equals linear_group's fp32 output."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(1, 5, 1536)), jnp.bfloat16)
  ws = [jnp.asarray(0.05 * rng.normal(size=(n, 1536)), jnp.bfloat16) for n in (72, 5)]
  groups = quant.linear_group(x, ws, dense=dense, dtype=jnp.float32)
  for parts, out, w in zip(quant.linear_group_partials(x, ws, dense=dense), groups, ws, strict=True):
    assert parts.dtype == jnp.float32 and parts.shape[1:] == (5, w.shape[0])
    assert (parts.shape[0] > 1) == (dense != "xla")
    np.testing.assert_allclose(parts.sum(0), out.reshape(5, -1), rtol=1e-5, atol=1e-5)


def test_linear_group_partials_share_one_split_count():
  """An NVFP4 weight beside a bf16 one (the indexer's wk and weights_proj under --weights=nvfp4):
  one summed term each. The NVFP4 term is its decode kernel's bf16 output (as the unfused path
  rounds it), not an fp32 dequantize-and-dot of the whole weight; the bf16 term its K splits'
  sum."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(1, 5, 1536)), jnp.bfloat16)
  ws = [quant.quantize_nvfp4(jnp.asarray(rng.normal(size=(72, 1536)), jnp.float32)),
        jnp.asarray(0.05 * rng.normal(size=(32, 1536)), jnp.bfloat16)]
  assert quant.linear_partials(x, ws[1], dense="pallas").shape[0] > 1
  group = lambda x: quant.linear_group_partials(x, ws, impl="pallas_hfma2", dense="pallas_grouped")
  assert "pallas_call" in str(jax.make_jaxpr(lambda x: group(x)[0])(x))
  nvfp4, bf16 = group(x)
  assert nvfp4.shape == (1, 5, 72) and bf16.shape == (1, 5, 32)
  kernel = quant.linear(x, ws[0], impl="pallas_hfma2").reshape(5, 72)
  np.testing.assert_array_equal(np.asarray(nvfp4[0]), np.asarray(kernel, np.float32))
  want = quant.linear(x, ws[1], dense="pallas_grouped", dtype=jnp.float32).reshape(5, 32)
  np.testing.assert_allclose(bf16[0], want, rtol=1e-5, atol=1e-5)


def _outside_kernels(jaxpr) -> list[str]:
  """The primitives of a jaxpr through nested jaxprs, a pallas_call by its kernel's name."""
  return [eqn.params["name"] if eqn.primitive.name == "pallas_call" else eqn.primitive.name
          for eqn in equations(jaxpr)]


@pytest.mark.parametrize("dense", ["pallas", "pallas_grouped"])
@pytest.mark.parametrize("with_bf16", [True, False])
def test_fragment_partials_take_the_groups_split_count(with_bf16, dense):
  """FragmentWeights under pallas_fragments: their partials come from the fragment kernel, K
  splits scaled in the program (no XLA epilogue), one launch for them all under
  dense="pallas_grouped", with the split-K bf16 weight's split count beside one (the indexer's
  wk and weights_proj under --weights=nvfp4), else the fragment launches' default; each summing
  to its product."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(1, 5, 1536)), jnp.bfloat16)
  nvfp4 = [quant.quantize_nvfp4(jnp.asarray(rng.normal(size=(n, 1536)), jnp.float32)) for n in (72, 40)]
  ws = [quant.to_fragments(w, "bfloat16") for w in nvfp4]
  ws += [jnp.asarray(0.05 * rng.normal(size=(32, 1536)), jnp.bfloat16)] if with_bf16 else []
  group = lambda x: quant.linear_group_partials(x, ws, impl="pallas_fragments", dense=dense)
  ops = _outside_kernels(jax.make_jaxpr(group)(x).jaxpr)
  grouped = dense == "pallas_grouped"
  assert ops.count("nvfp4_fragments") == (1 if grouped else 2) and "reduce_sum" not in ops  # no XLA epilogue
  parts = group(x)
  splits = (quant.linear_partials(x, ws[2], dense=dense).shape[0] if with_bf16
            else default_fragment_config(112 if grouped else 72, 1536).split_k)
  assert splits > 1 and [p.shape for p in parts] == [(splits, 5, w.shape[0]) for w in ws]
  for p, w in zip(parts, nvfp4):
    want = jnp.einsum("tk,nk->tn", x[0].astype(jnp.float32), w.dequantize(jnp.float32))
    np.testing.assert_allclose(p.sum(0), want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


def test_fragment_group_is_one_launch_with_each_weights_product():
  """linear_group on FragmentWeights under dense="pallas_grouped" (an MLP's gate and up under
  --weights=nvfp4): one fragment launch, each output its own fragment_matmul's within bf16
  rounding (the splits scaled before their sum, not after)."""
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(1, 5, 640)), jnp.bfloat16)
  ws = [quant.to_fragments(quant.quantize_nvfp4(jnp.asarray(rng.normal(size=(n, 640)), jnp.float32)), "bfloat16")
        for n in (96, 96)]
  group = lambda x: quant.linear_group(x, ws, impl="pallas_fragments", dense="pallas_grouped")
  assert _outside_kernels(jax.make_jaxpr(group)(x).jaxpr).count("nvfp4_fragments") == 1
  for got, w in zip(group(x), ws):
    want = np.asarray(quant.linear(x, w, impl="pallas_fragments"), np.float32)
    assert got.shape == (1, 5, 96) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2.0 ** -7, atol=1e-6 * np.abs(want).max())

