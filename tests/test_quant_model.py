"""The model with quantized weights: equal to the model on the dequantized weights (XLA impl), the
Pallas impl (interpret mode) close to the XLA impl, and Flax's param check on quantized leaves."""

import collections
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import glmjax
from configs import get_model_config
from glmjax.layers import Linear
from glmjax.model import abstract_params
from glmjax.engine.engine import Engine
from glmjax.quant import (FragmentWeight, NVFP4Weight, QuantizedWeight, arrange_params, linear, quantize_fp8_block,
                          quantize_nvfp4, quantize_params, to_fragments)
from glmjax.runtime import Runtime

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
# tiny's features (a dense and an MoE layer, MLA, indexer, IndexShare) in two layers: quicker to
# compile, and the interpret-mode kernels compile once per distinct weight shape.
CONFIG = get_model_config("tiny2")
MOE_LAYERS = ("layers_1",)


def is_quantized(x) -> bool:
  return isinstance(x, QuantizedWeight)


def quantized(params, case: str):
  """Params under a quantization policy."""
  return quantize_params(params, case)


def dequantized(params, dtype):
  return jax.tree.map(lambda w: w.dequantize(dtype) if is_quantized(w) else w, params, is_leaf=is_quantized)


def equations(jaxpr) -> list:
  """A jaxpr's equations through nested jaxprs, a pallas_call's own kernel not looked into."""
  found = []
  for eqn in jaxpr.eqns:
    found.append(eqn)
    for value in () if eqn.primitive.name == "pallas_call" else eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
          found += equations(getattr(sub, "jaxpr", sub))
  return found


def pallas_eqns(jaxpr) -> list:
  """The pallas_call equations of a jaxpr, one per call site, through nested jaxprs."""
  return [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "pallas_call"]


def kernel_launches(jaxpr) -> int:
  """pallas_call equations in a jaxpr, counted per call site through nested jaxprs."""
  return len(pallas_eqns(jaxpr))


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_params(seed: int, dtype) -> dict:
  """Fresh params drawn in numpy from the params' shapes (model.init would compile the model):
  vectors (norm scales, biases) around 1, matrices N(0, 0.05)."""
  rng = np.random.default_rng(seed)
  draw = lambda s: ((1 + 0.1 * rng.standard_normal(s.shape)) if len(s.shape) == 1
                    else 0.05 * rng.standard_normal(s.shape))
  return jax.tree.map(lambda s: jnp.asarray(draw(s), s.dtype), nn.unbox(abstract_params(CONFIG, param_dtype=dtype)))


@pytest.fixture(scope="module")
def params_fp32():
  return random_params(21, jnp.float32)


@pytest.fixture(scope="module")
def params_bf16():
  return random_params(22, jnp.bfloat16)


def tokens(seed: int, batch: int, length: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length), dtype=np.int32)


CASES = ["fp8", "nvfp4_experts", "nvfp4"]


@pytest.mark.parametrize("case", CASES)
def test_quantized_model_equals_dequantized_model(params_fp32, case):
  """fp32 compute: the XLA impl dequantizes to fp32 and the plain einsum runs on the same values,
  so only the accumulation order may differ."""
  q = quantized(params_fp32, case)
  assert isinstance(q["layers_1"]["self_attn"]["kv_b_proj"]["weight"], QuantizedWeight) != (case == "nvfp4_experts")
  ids = tokens(len(case), 2, 12)
  out = glmjax.forward(CONFIG, q, ids)
  ref = glmjax.forward(CONFIG, dequantized(q, jnp.float32), ids)
  assert rel_err(out, ref) <= 1e-5


def test_quantized_generate_equals_dequantized(params_fp32):
  """Through the paged cache (kv_b_proj absorbed into the query, decode-sized linears)."""
  q = quantized(params_fp32, "fp8")
  prompt = tokens(5, 2, 7)
  out = glmjax.generate(CONFIG, q, prompt, 6, ignore_eos=True)
  np.testing.assert_array_equal(out, glmjax.generate(CONFIG, dequantized(q, jnp.float32), prompt, 6, ignore_eos=True))


@pytest.mark.side_lane  # about 30 s on 2 cores: beside the multi-device tests (Makefile)
@pytest.mark.parametrize("case", ["fp8", "nvfp4"])
def test_pallas_matmul_matches_xla(params_bf16, case):
  """bf16, 8 rows: every quantized linear (and MoE) runs its interpret-mode kernel. Tolerance: the
  kernels round their outputs to bf16 once where XLA's path may round differently (~4e-3 per
  matmul), compounded over the layers and the MoE's routing."""
  q = quantized(params_bf16, case)
  ids = tokens(len(case) + 1, 1, 8)
  launches = {impl: kernel_launches(jax.make_jaxpr(
      lambda p: glmjax.forward(CONFIG, p, ids, runtime=Runtime(matmul=impl)))(q).jaxpr) for impl in ("xla", "pallas")}
  # 8 attention and 3 dense-MLP projections, 2 MoE launches (+3 once the shared expert gets the impl).
  assert launches == {"xla": 0, "pallas": launches["pallas"]} and launches["pallas"] >= 13
  xla = glmjax.forward(CONFIG, q, ids)
  pallas = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas"))
  assert rel_err(pallas, xla) <= 2e-2
  # fp16 operands (activations scaled per row into fp16): the same products, summed in fp32.
  f16 = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas_ptx_f16"))
  assert rel_err(f16, pallas) <= 2e-3
  if case == "nvfp4":  # the PTX decode's path (its jnp twin here) through every linear and the MoE
    ptx = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas_ptx"))
    assert rel_err(ptx, pallas) <= 2e-3
    # The MoE kernels' own scan of the ids: the same experts and weights, partial sums grouped
    # in another order.
    scan = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas", moe_routing="scan"))
    assert rel_err(scan, pallas) <= 2e-3
    # One token: its NVFP4 linears on the CUDA cores (dot="hfma2"; the PTX's twin here).
    one = ids[:, :1]
    hfma2 = glmjax.forward(CONFIG, q, one, runtime=Runtime(matmul="pallas_hfma2"))
    assert rel_err(hfma2, glmjax.forward(CONFIG, q, one, runtime=Runtime(matmul="pallas"))) <= 2e-3
    # Its routed experts too, a (token, expert) pair at a time (moe_routing="pairs").
    pairs = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas_hfma2", moe_routing="pairs"))
    assert rel_err(pairs, pallas) <= 2e-3
    # and with the activations' planes built in one launch each: the same bits
    fused = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas_hfma2", moe_routing="pairs_fused"))
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(pairs, np.float32))


@pytest.mark.side_lane  # 15-20 s on 2 cores: evens out the two processes' times (Makefile)
def test_the_routers_launch_builds_the_planes_and_the_shared_hidden(params_bf16):
  """route_planes="pallas" (3 rows, NVFP4 experts as pairs_fused): each MoE layer's x planes come
  from its router's launch (moe_route_planes), not a rows_planes launch of their own, with the
  router's GEMV grouped with the shared expert's or not: the same logits, bit for bit. With
  shared_swiglu="pallas" too, the shared expert takes silu(gate) * up from that launch (the same
  launches, one silu fewer in XLA per MoE layer): the logits within bf16 rounding (the kernel
  rounds the MLP's bf16 ops one by one, bit for bit in tests/test_moe_route.py; XLA's fusion may
  skip one of those roundings). With shared_down="pallas" too, the shared expert's down GEMV runs
  in the routed experts' gate/up launch: one bf16_matmul launch fewer per MoE layer, the same
  logits bit for bit, also with next_norm (the layer's terms unsummed). pairs_wide_words (a
  layout hint in the experts' launches) changes no launch and no bit."""
  q = quantized(params_bf16, "nvfp4_experts")
  ids = tokens(9, 1, 3)
  base = Runtime(matmul="pallas_hfma2", moe_routing="pairs_fused", router="pallas", router_group="pallas",
                 dense_matmul="pallas_grouped")
  arms = {"own": base, "beside": dataclasses.replace(base, route_planes="pallas"),
          "shared": dataclasses.replace(base, route_planes="pallas", shared_swiglu="pallas"),
          "ungrouped": dataclasses.replace(base, route_planes="pallas", router_group="xla")}
  arms["down"] = dataclasses.replace(arms["shared"], shared_down="pallas")
  arms |= {f"{name}_next": dataclasses.replace(arms[name], next_norm="pallas") for name in ("shared", "down")}
  arms["wide"] = dataclasses.replace(arms["shared"], pairs_wide_words=True)
  forwards = {name: (lambda p, runtime=runtime: glmjax.forward(CONFIG, p, ids, runtime=runtime))
              for name, runtime in arms.items()}
  eqns = {name: list(equations(jax.make_jaxpr(forward)(q).jaxpr)) for name, forward in forwards.items()}
  launches = {name: collections.Counter(e.params["name"] for e in found if e.primitive.name == "pallas_call")
              for name, found in eqns.items()}
  moe = len(MOE_LAYERS)
  assert (launches["own"]["hfma2_rows_planes"], launches["own"]["moe_route"]) == (moe, moe)
  for name in ("beside", "shared", "ungrouped"):
    assert (launches[name]["hfma2_rows_planes"], launches[name]["moe_route"], launches[name]["moe_route_planes"]) == (
        0, 0, moe), name
  assert launches["shared"] == launches["beside"] and sum(launches["beside"].values()) == sum(
      launches["own"].values()) - moe
  silus = {name: sum(e.primitive.name == "logistic" for e in found) for name, found in eqns.items()}
  assert silus["shared"] == silus["beside"] - moe
  own, beside, shared = (forwards[name](q) for name in ("own", "beside", "shared"))
  np.testing.assert_array_equal(np.asarray(beside, np.float32), np.asarray(own, np.float32))
  assert rel_err(shared, beside) <= 2e-3
  assert launches["wide"] == launches["shared"]
  outputs = lambda name: sorted(len(e.outvars) for e in eqns[name]
                                if e.primitive.name == "pallas_call" and e.params["name"].startswith("moe_hfma2"))
  assert outputs("wide") == [n + 1 for n in outputs("shared")]  # each experts' launch holds the hint
  np.testing.assert_array_equal(np.asarray(forwards["wide"](q), np.float32), np.asarray(shared, np.float32))
  for name in ("down", "down_next"):
    unfolded = name.replace("down", "shared")
    assert launches[name] == launches[unfolded] - collections.Counter(bf16_matmul=moe), name
    np.testing.assert_array_equal(np.asarray(forwards[name](q), np.float32),
                                  np.asarray(shared if name == "down" else forwards[unfolded](q), np.float32))


@pytest.mark.side_lane  # 40-50 s on 2 cores: evens out the two processes' times (Makefile)
def test_fragment_matmul_in_the_model(params_bf16):
  """matmul="pallas_fragments", 5 rows (an MTP verify): forward puts the NVFP4 params in fragment
  order itself (not kv_b, read whole, nor the shared expert: fragments.RAW); each other 2-D
  NVFP4 linear is the fragment kernel's two launches where pallas_hfma2 runs one nvfp4_matmul;
  the MoE is the same; the logits equal pallas_hfma2's (exact fp16 products, fp32 sums, one bf16
  rounding a linear). With fragment_operands="bfloat16" the activations launches are gone and
  the logits the same (checked with the epilogue folds); so under "auto" (the default), whose
  rule gives these small weights bf16."""
  q = quantized(params_bf16, "nvfp4")
  ids = tokens(7, 1, 5)
  names = lambda runtime: collections.Counter(eqn.params["name"] for eqn in pallas_eqns(jax.make_jaxpr(
      lambda p: glmjax.forward(CONFIG, p, ids, runtime=runtime))(q).jaxpr))
  fp16 = Runtime(matmul="pallas_fragments", fragment_operands="float16")
  hfma2, fragments = names(Runtime(matmul="pallas_hfma2")), names(fp16)
  linears, shared = hfma2.pop("nvfp4_matmul"), 3 * len(MOE_LAYERS)  # the shared experts' stay (RAW)
  # Every 2-D NVFP4 linear of the decoder layers runs a kernel, the indexer's fp32 projections too
  # (kv_b: read whole; the MTP layer: not in forward).
  names_of = lambda path: jax.tree_util.keystr(path)
  assert linears == sum(isinstance(leaf, NVFP4Weight) and leaf.ndim == 2 and "kv_b_proj" not in names_of(path)
                        and names_of(path).startswith("['layers_")
                        for path, leaf in jax.tree_util.tree_flatten_with_path(q, is_leaf=is_quantized)[0]) >= 13
  assert fragments == hfma2 + collections.Counter(nvfp4_matmul=shared, nvfp4_fragments=linears - shared,
                                                  nvfp4_fragment_activations=linears - shared)
  out = glmjax.forward(CONFIG, q, ids, runtime=fp16)
  want = glmjax.forward(CONFIG, q, ids, runtime=Runtime(matmul="pallas_hfma2"))
  assert rel_err(out, want) <= 2e-3
  # bf16 operands: the kernels read x's rows themselves, no activations launch (their logits are
  # checked with the folds below).
  bf16 = Runtime(matmul="pallas_fragments", fragment_operands="bfloat16")
  assert names(bf16) == fragments - collections.Counter(nvfp4_fragment_activations=linears - shared)
  assert names(Runtime(matmul="pallas_fragments")) == names(bf16)
  # With the epilogue folds, they read the fragment kernel's scaled K splits, q_a's and kv_a's
  # from one launch a layer, and the dense MLP's gate and up share one (dense_matmul=
  # "pallas_grouped"): the same logits.
  folds = dataclasses.replace(bf16, mla_epilogue="pallas", residual_norm="pallas", dense_matmul="pallas_grouped")
  folded = names(folds)
  assert folded["mla_epilogue"] == folded["residual_norm"] == CONFIG.num_hidden_layers
  dense_layers = CONFIG.mlp_layer_types.count("dense")
  assert folded["nvfp4_fragments"] == linears - shared - CONFIG.num_hidden_layers - dense_layers
  assert rel_err(glmjax.forward(CONFIG, q, ids, runtime=folds), want) <= 2e-3
  # The engine arranges its params once, the same weights.
  engine = Engine(CONFIG, q, runtime=fp16, num_pages=4, page_size=16)
  attention = engine.params["layers_1"]["self_attn"]
  assert isinstance(attention["kv_b_proj"]["weight"], NVFP4Weight)
  assert isinstance(engine.params["layers_1"]["mlp"]["experts"]["up_proj"], NVFP4Weight)
  o_proj = attention["o_proj"]["weight"]
  assert isinstance(o_proj, FragmentWeight)
  np.testing.assert_array_equal(np.asarray(o_proj.dequantize(jnp.float32)),
                                np.asarray(q["layers_1"]["self_attn"]["o_proj"]["weight"].dequantize(jnp.float32)))
  engine = Engine(CONFIG, q, runtime=bf16, num_pages=4, page_size=16)
  assert engine.params["layers_1"]["self_attn"]["o_proj"]["weight"].operands == "bfloat16"


def test_fragment_experts_in_the_model(params_bf16):
  """moe_routing="fragments" (NVFP4 experts): forward moves the stacked routed experts into bf16
  fragment order too, and each MoE layer runs the fragment MoE's three launches (gate/up, the
  chosen slots' swiglu, down) where the pairs run theirs; the logits equal the pairs' within bf16
  rounding. Past 8 rows (the MMA's N) the experts take the reference on the weights moved back,
  its logits the XLA path's. The engine arranges the experts once; moved back, the same bits.
  expert_operands="float16": the experts in fp16 fragment order, one activations launch more a
  layer (x's), the same logits within bf16 rounding."""
  q = quantized(params_bf16, "nvfp4_experts")
  runtime = Runtime(matmul="pallas_fragments", moe_routing="fragments")
  names = lambda runtime, ids: collections.Counter(eqn.params["name"] for eqn in pallas_eqns(jax.make_jaxpr(
      lambda p: glmjax.forward(CONFIG, p, ids, runtime=runtime))(q).jaxpr))
  ids = tokens(8, 1, 5)
  pairs = Runtime(matmul="pallas_fragments", moe_routing="pairs")
  launched, paired = names(runtime, ids), names(pairs, ids)
  moe = len(MOE_LAYERS)
  assert {name: launched[name] for name in ("moe_fragments_gate_up", "moe_fragments_swiglu", "moe_fragments_down")
          } == dict.fromkeys(("moe_fragments_gate_up", "moe_fragments_swiglu", "moe_fragments_down"), moe)
  assert not any(name.startswith("moe_hfma2") for name in launched)
  assert sum(launched.values()) == sum(paired.values()) - sum(n for name, n in paired.items()
                                                              if name.startswith("moe_hfma2")) + 3 * moe
  want = glmjax.forward(CONFIG, q, ids, runtime=pairs)
  assert rel_err(glmjax.forward(CONFIG, q, ids, runtime=runtime), want) <= 2e-3
  fp16 = dataclasses.replace(runtime, expert_operands="float16")
  extra = names(fp16, ids) - launched
  assert extra == collections.Counter({"nvfp4_fragment_activations": moe}) and not launched - names(fp16, ids)
  assert rel_err(glmjax.forward(CONFIG, q, ids, runtime=fp16), want) <= 2e-3
  assert all(w.operands == "float16" for w in fp16.arrange(q)["layers_1"]["mlp"]["experts"].values())
  many = tokens(8, 1, 10)
  assert rel_err(glmjax.forward(CONFIG, q, many, runtime=runtime),
                 glmjax.forward(CONFIG, q, many, runtime=Runtime())) <= 2e-3
  engine = Engine(CONFIG, q, runtime=runtime, num_pages=4, page_size=16)
  experts = engine.params["layers_1"]["mlp"]["experts"]
  assert all(isinstance(w, FragmentWeight) and w.ndim == 3 and w.operands == "bfloat16" for w in experts.values())
  back = arrange_params(engine.params, fragments=False)["layers_1"]["mlp"]["experts"]
  for name, w in back.items():
    assert isinstance(w, NVFP4Weight)
    for got, original in zip(jax.tree.leaves(w), jax.tree.leaves(q["layers_1"]["mlp"]["experts"][name])):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(original))


def test_fragment_linear_takes_rows_in_eights():
  """linear on a FragmentWeight: 12 rows in two launches (8 + 4) close to the NVFP4 reference."""
  rng = np.random.default_rng(5)
  w = quantize_nvfp4(jnp.asarray(rng.standard_normal((40, 160)), jnp.float32))
  x = jnp.asarray(rng.standard_normal((3, 4, 160)), jnp.bfloat16)
  out = linear(x, to_fragments(w), impl="pallas_fragments")
  ref = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.dequantize(jnp.float32))
  assert out.shape == (3, 4, 40) and out.dtype == jnp.bfloat16 and rel_err(out, ref) <= 4e-3


def test_dense_pallas_matmul_matches_xla(params_bf16):
  """bf16 weights, 8 rows, dense_matmul="pallas": the split-K GEMV replaces exactly the plain bf16
  linears: 4 attention projections a layer, the indexer's 3 (fp32 results; layer 0 runs the
  only indexer), the dense MLP's 3, the shared expert's 3 and the router (fp32); not the
  lm_head or the routed experts. Close to XLA's einsum. "pallas_grouped": q_a with kv_a, wk
  with weights_proj, each MLP's gate with up in one launch, with the lone launches' products."""
  ids = tokens(9, 1, 8)
  run = lambda p, dense: glmjax.forward(CONFIG, p, ids, runtime=Runtime(dense_matmul=dense))
  launches = lambda dense: kernel_launches(jax.make_jaxpr(lambda p: run(p, dense))(params_bf16).jaxpr)
  assert (launches("pallas"), launches("pallas_grouped")) == (4 * 2 + 3 + 3 + 3 + 1, 3 * 2 + 2 + 2 + 2 + 1)
  pallas = run(params_bf16, "pallas")
  assert rel_err(pallas, run(params_bf16, "xla")) <= 2e-2
  assert rel_err(run(params_bf16, "pallas_grouped"), pallas) <= 2e-3


def test_pallas_router_matches_xla(params_bf16):
  """router="pallas": one more launch per MoE layer (the choice kernel, reading the router GEMV's
  partials) and XLA's choice kernels gone; the same experts, so the logits agree to the fp32
  order of the partials' sums."""
  ids = tokens(4, 1, 8)
  run = lambda p, router: glmjax.forward(CONFIG, p, ids, runtime=Runtime(dense_matmul="pallas_grouped", router=router))
  launches = lambda router: kernel_launches(jax.make_jaxpr(lambda p: run(p, router))(params_bf16).jaxpr)
  assert launches("pallas") == launches("xla") + len(MOE_LAYERS)
  assert rel_err(run(params_bf16, "pallas"), run(params_bf16, "xla")) <= 1e-5


def test_next_norm_closes_each_layer_with_the_next_norm(params_bf16):
  """next_norm="pallas" (bf16, 5 rows): each layer ends in one residual_norm launch, the MoE
  layers' with the routed experts' partials as its term (one operand more), and XLA runs the
  other input norms and the final norm no more (those launches do); the logits within bf16
  rounding of the unfolded ones (tokens: the bf16-stream engine test, where XLA rounds as the
  model is written)."""
  ids = tokens(11, 1, 5)
  run = lambda p, fold: glmjax.forward(CONFIG, p, ids, runtime=Runtime(dense_matmul="pallas_grouped", next_norm=fold))
  eqns = {fold: list(equations(jax.make_jaxpr(lambda p, fold=fold: run(p, fold))(params_bf16).jaxpr))
          for fold in ("xla", "pallas")}
  closes = [len(e.invars) for e in eqns["pallas"] if e.primitive.name == "pallas_call"
            and e.params["name"] == "residual_norm"]
  assert sorted(closes) == sorted(4 if kind == "sparse" else 3 for kind in CONFIG.mlp_layer_types)
  norms = {fold: sum(e.primitive.name == "rsqrt" for e in found) for fold, found in eqns.items()}
  assert norms["xla"] - norms["pallas"] == CONFIG.num_hidden_layers  # layer 1's input norm, the final norm
  assert rel_err(run(params_bf16, "pallas"), run(params_bf16, "xla")) <= 1e-2  # bf16 logits: 2e-3 seen


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_fp8_block])
def test_linear_checks_a_quantized_weights_logical_shape(quantize):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32)), jnp.float32)
  w = quantize(jnp.asarray(np.random.default_rng(1).standard_normal((8, 32)), jnp.float32))
  out = Linear(8).apply({"params": {"weight": w}}, x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(x @ w.dequantize(jnp.float32).T), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError,
                     match=r"quantized param .*weight has logical shape \(8, 32\), the module expects \(16, 32\)"):
    Linear(16).apply({"params": {"weight": w}}, x)
