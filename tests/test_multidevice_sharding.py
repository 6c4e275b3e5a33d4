"""TEP=2/4/8 sharding on 8 simulated CPU devices: same tokens and fp32 logits as one device, two
collectives per decoder layer in the compiled decode step (the ones comm_model lists), donated
caches that keep their sharding, per-device checkpoint reads, clear errors for indivisible
degrees; the communication model and the tep_project entry point.

Needs its own process (the device count is fixed when JAX's backend starts):
  pytest -m multidevice tests/test_multidevice_sharding.py
"""

import jax

try:
  jax.config.update("jax_num_cpu_devices", 8)
  _BACKEND_WAS_UP = False
except RuntimeError:  # collected in a process whose backend already runs: the fixture below skips
  _BACKEND_WAS_UP = True

import collections
import dataclasses
import json
import math
import re
import warnings

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import glmjax
from configs import get_model_config
from experiments.step_timing import with_layers
from glmjax import parallel
from glmjax.cache.paged import init_cache
from glmjax.checkpoint import TensorFiles, load_params, save_pretrained
from glmjax.engine import steps
from glmjax.engine.sampling import Sampling
from glmjax.model import abstract_params, init_params
from glmjax.quant import FragmentWeight, NVFP4Weight, quantize_params, to_fragments
from glmjax.parallel import comm_model, rules
from glmjax.runtime import Runtime
from tests.conftest import rel_err

pytestmark = pytest.mark.multidevice

DEGREES = (2, 4, 8)
# An HLO collective instruction (async ones by their -start); the result may be a tuple.
COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                        r"(-start)?\(")


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  if _BACKEND_WAS_UP:
    pytest.skip("JAX's backend started before this module could ask for 8 CPU devices; run it in its "
                "own process: pytest -m multidevice tests/test_multidevice_sharding.py")
  assert len(jax.devices()) >= 8, f"needs 8 devices, JAX has {jax.devices()}"


@pytest.fixture(scope="module")
def model():
  """tiny with 8 heads and 8 experts (divisible by every degree), fresh random fp32 params."""
  config = dataclasses.replace(get_model_config("tiny"), num_attention_heads=8, num_key_value_heads=8,
                               n_routed_experts=8)
  return config, init_params(config, jax.random.key(7), param_dtype=jnp.float32)


def _first_layers(model, n: int):
  """The model cut to its first n decoder layers (their params as they are): compiles faster."""
  config, params = model
  return with_layers(config, n, mtp=True), {k: v for k, v in params.items()
                                            if not k.startswith("layers_") or int(k[7:]) < n}


def _prompt(config, key: int, shape: tuple[int, int]) -> np.ndarray:
  return np.asarray(jax.random.randint(jax.random.key(key), shape, 0, config.vocab_size), np.int32)


@pytest.mark.parametrize("tep", DEGREES)
def test_forward_matches_one_device(model, tep):
  config, params = model
  ids = _prompt(config, tep, (2, 12))
  want = glmjax.forward(config, params, ids)
  mesh = parallel.make_mesh(tep)
  with parallel.use_mesh(mesh):
    got = glmjax.forward(config, parallel.shard_params(config, params, mesh), ids)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tep")), 3)  # vocab-split
  assert rel_err(got, want) < 1e-5
  np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


@pytest.mark.parametrize("policy", ["nvfp4", "fp8"])
def test_quantized_params_shard_field_by_field(model, policy):
  """shard_params on quantized leaves: codes and block scales split as their weight, per-tensor
  scales as its leading dims, an FP8 block-scale dim the degree does not divide replicated; the
  shared expert's quantized weights through the expert-parallel shard_map; the logits those of
  one device; a warning for each layer whose weights cannot split in its shard_map."""
  config, params = model
  q = quantize_params(params, policy)
  ids = _prompt(config, 3, (1, 8))
  want = glmjax.forward(config, q, ids)
  mesh = parallel.make_mesh(2)
  sharded = parallel.shard_params(config, q, mesh)
  o_proj, experts = sharded["layers_1"]["self_attn"]["o_proj"]["weight"], sharded["layers_1"]["mlp"]["experts"]
  spec = lambda a: tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
  if policy == "nvfp4":
    assert spec(o_proj.packed) == spec(o_proj.block_scale) == (None, "tep") and spec(o_proj.global_scale) == ()
    assert spec(experts["up_proj"].packed) == ("tep", None, None) and spec(experts["up_proj"].global_scale) == ("tep",)
  else:  # q_b [320, 64]: 3 blocks of 128 rows, which 2 does not divide
    q_b = sharded["layers_1"]["self_attn"]["q_b_proj"]["weight"]
    assert spec(q_b.weight) == ("tep", None) and spec(q_b.scale_inv) == (None, None)
    assert spec(o_proj.weight) == spec(o_proj.scale_inv) == (None, "tep")
    # In the expert-parallel shard_map a device reads its slice's scales from the start: fine
    # for the shared expert's one block, an error for q_b's three.
    with pytest.raises(ValueError, match=r"q_b: a FP8BlockWeight \(3, 1\) field does not split"):
      rules.quantized_specs(P("tep"), q_b, mesh.shape, local=True, param="q_b")
  with parallel.use_mesh(mesh), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = glmjax.forward(config, sharded, ids)
  assert rel_err(got, want) < 1e-5
  # FP8's q_b cannot split in the heads' shard_map: that layer's attention says it runs under GSPMD.
  fallbacks = [str(w.message) for w in caught if "runs under GSPMD" in str(w.message)]
  assert (policy == "fp8") == bool(fallbacks), fallbacks
  assert all(re.search(r"layers_\d+/self_attn .*q_b_proj", m) for m in fallbacks), fallbacks


def test_fragment_matmul_under_the_mesh(model):
  """bf16 NVFP4 params sharded, then put in fragment order by forward (runtime.arrange: weights
  split over the mesh stay in ModelOpt's order for the TEP shard_maps, a split FragmentWeight
  there is a clear error): the logits of one device up to bf16 rounding of the row-parallel sums."""
  config, params = _first_layers(model, 2)  # a dense and an MoE layer
  q = quantize_params(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), "nvfp4")
  ids, runtime, mesh = _prompt(config, 5, (1, 5)), Runtime(matmul="pallas_fragments"), parallel.make_mesh(2)
  want = glmjax.forward(config, q, ids, runtime=runtime)
  sharded = parallel.shard_params(config, q, mesh)
  attn = runtime.arrange(sharded)["layers_1"]["self_attn"]  # split weights stay in ModelOpt's order
  assert isinstance(attn["q_a_proj"]["weight"], FragmentWeight) and isinstance(attn["q_b_proj"]["weight"], NVFP4Weight)
  with pytest.raises(ValueError, match="q_b: a FragmentWeight .* cannot be split"):
    rules.quantized_specs(P("tep"), to_fragments(q["layers_1"]["self_attn"]["q_b_proj"]["weight"]), mesh.shape,
                          local=True, param="q_b")
  with parallel.use_mesh(mesh):
    got = glmjax.forward(config, sharded, ids, runtime=runtime)
  assert rel_err(got, want) < 1e-2


def test_planes_kernel_traces_inside_a_shard_map():
  """The hfma2 planes kernel's column table, built while a kernel traces, inside the expert-parallel
  shard_map (where a jnp constant would be a manual-sharded value): the same planes as outside."""
  from pallas_kernels import hfma2_planes
  a = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.bfloat16)
  hfma2_planes._plane_columns.cache_clear()
  mesh = parallel.make_mesh(2)
  with parallel.use_mesh(mesh):
    inside = jax.jit(jax.shard_map(hfma2_planes.rows_planes, mesh=mesh, in_specs=P(), out_specs=P(),
                                   check_vma=False))(a)
  for got, want in zip(inside, hfma2_planes.rows_planes(a), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tep", (2,))
def test_generate_matches_one_device(model, tep):
  """The public API through the cache. Batch 1 at TEP=2 is the case whose local experts (4)
  outnumber the token slots (2), so experts_reference gathers (ids of the other device's experts
  included); the step test below covers every degree."""
  config, params = model
  prompt = _prompt(config, 10 + tep, (1, 14))
  want = glmjax.generate(config, params, prompt, 6, ignore_eos=True)
  mesh = parallel.make_mesh(tep)
  with parallel.use_mesh(mesh):
    got = glmjax.generate(config, parallel.shard_params(config, params, mesh), prompt, 6, ignore_eos=True)
  np.testing.assert_array_equal(got, want)


def test_swiglu_fold_in_the_shared_experts_shard_map(model, monkeypatch):
  """swiglu="pallas" under TEP=2 with bf16 weights: the shared expert's down GEMV, inside the
  expert shard_map, takes its column shard's gate/up partials (the launches recorded, the
  shared intermediate split 2 ways); tokens equal to the XLA path's under the same mesh. The
  first two layers: a dense MLP and an MoE layer's shared expert."""
  from pallas_kernels import bf16_matmul
  config, params = _first_layers(model, 2)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  prompt = _prompt(config, 21, (1, 10))
  mesh = parallel.make_mesh(2)
  calls, original = [], bf16_matmul.swiglu_matmul
  monkeypatch.setattr(bf16_matmul, "swiglu_matmul", lambda g, u, w: calls.append(g.shape) or original(g, u, w))
  tokens = {}
  with parallel.use_mesh(mesh):
    sharded = parallel.shard_params(config, params, mesh)
    for swiglu in ("xla", "pallas"):
      runtime = Runtime(dense_matmul="pallas_grouped", swiglu=swiglu)
      tokens[swiglu] = glmjax.generate(config, sharded, prompt, 4, ignore_eos=True, runtime=runtime)
  np.testing.assert_array_equal(tokens["pallas"], tokens["xla"])
  assert config.shared_intermediate // 2 in {shape[-1] for shape in calls}


def _collectives(hlo: str) -> list[tuple[str, str, int, str]]:
  """(scope, kind, elements of the result, its element types) of every collective of a compiled
  module; scope is the decoder layer ("layers_3") or the op name."""
  found = []
  for line in hlo.splitlines():
    if match := COLLECTIVE.search(line):
      elements = sum(math.prod(int(d) for d in dims.split(",") if d)
                     for dims in re.findall(r"\w+\[([\d,]*)\]", match.group(1)))
      op_name = re.search(r'op_name="([^"]*)"', line)
      op_name = op_name.group(1) if op_name else line.strip()
      layer = re.search(r"/(layers_\d+)/", op_name)
      types = ",".join(sorted(set(re.findall(r"(\w+)\[", match.group(1)))))
      found.append((layer.group(1) if layer else op_name, match.group(2), elements, types))
  return found


def _empty_cache(config):
  cache = init_cache(config, num_pages=9, page_size=4, batch=2, max_pages=4, kv_dtype="fp32")
  return cache.replace(page_table=1 + jnp.arange(8, dtype=jnp.int32).reshape(2, 4))


def _check_donated_and_replicated(before, after, mesh):
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(before))
  for leaf in jax.tree.leaves(after):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P()), leaf.ndim), leaf.sharding


@pytest.fixture(scope="module")
def reference_steps(model):
  """A batch of 2 prefilled, then decoded, on one device."""
  config, params = model
  spec = steps.StepSpec(config, Runtime(), "float32")
  prompt = jnp.asarray(_prompt(config, 3, (2, 10)))
  positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), prompt.shape)
  logits, _, cache = steps.prefill_chunk(params, _empty_cache(config), prompt, positions, spec=spec)
  first = jnp.argmax(logits, -1).astype(jnp.int32)
  args = (first, jnp.ones(2, bool), jax.random.key(0), jnp.asarray([], jnp.int32),
          jnp.full((2,), 5, jnp.int32))
  static = dict(spec=spec, sampling=Sampling(), max_new_tokens=5)
  want, _, _, _ = steps.decode_loop(params, cache, *args, **static)
  return (prompt, positions, spec), np.asarray(logits), args, static, np.asarray(want)


@pytest.mark.parametrize("tep", DEGREES)
def test_sharded_steps_collectives_and_donated_caches(model, reference_steps, tep):
  """prefill_chunk and decode_loop under GSPMD: the reference's logits and tokens, donated caches
  that stay replicated, and in the compiled decode two all-reduces of [tokens, hidden] per decoder
  layer (after o_proj, after the MLP / MoE psum) plus, per step, the embedding's all-reduce and
  sampling's gathers: the collectives comm_model lists."""
  config, params = model
  (prompt, positions, spec), want_logits, args, static, want = reference_steps
  mesh = parallel.make_mesh(tep)
  with parallel.use_mesh(mesh):
    sharded_params = parallel.shard_params(config, params, mesh)
    empty = parallel.shard_cache(_empty_cache(config), mesh)
    logits, _, cache = steps.prefill_chunk(sharded_params, empty, prompt, positions, spec=spec)
    _check_donated_and_replicated(empty, cache, mesh)
    compiled = steps.decode_loop.lower(sharded_params, cache, *args, **static).compile()
    out, _, _, new_cache = compiled(sharded_params, cache, *args)
  assert rel_err(logits, want_logits) < 1e-5
  np.testing.assert_array_equal(np.asarray(out), want)
  _check_donated_and_replicated(cache, new_cache, mesh)

  found = _collectives(compiled.as_text())
  message = 2 * config.hidden_size  # [batch 2, hidden]: no weight ever moves
  per_layer = collections.defaultdict(list)
  for scope, kind, elements, _ in found:
    if scope.startswith("layers_"):
      per_layer[scope].append((kind, elements))
  layers = range(config.num_hidden_layers)
  assert per_layer == {f"layers_{i}": [("all-reduce", message)] * 2 for i in layers}, per_layer
  assert [e for scope, _, e, _ in found if "embed_tokens" in scope] == [message], found
  # fp32 here: 4 bytes per element.
  listed = comm_model.pass_collectives(config, tokens=2, layers=config.num_hidden_layers, tep=tep,
                                       act_bytes=4, label="decode")
  expected = collections.Counter()
  for c in listed:
    expected[(c.kind, c.nbytes // 4)] += c.count
  assert collections.Counter((kind, e) for _, kind, e, _ in found) == expected, found


# Every Pallas switch the bf16 model can take at decode: the DSA kernels, the grouped split-K GEMVs
# and the folds (the NVFP4 experts' pairs_fused aside: its weights are not bf16).
PALLAS_STACK = dict(attention="pallas", dense_matmul="pallas_grouped", cache_write="pallas", router="pallas",
              router_group="pallas",
              value_merge="pallas", query_absorb="pallas", indexer_keys="pallas", mla_epilogue="pallas",
              index_epilogue="pallas", epilogue_write="pallas", index_query="pallas", residual_norm="pallas",
              next_norm="pallas", swiglu="pallas",
              indexer_queries="bfloat16", attention_queries="bfloat16")


def test_pallas_stack_under_the_mesh_gathers_no_weight(model):
  """The Pallas stack in bf16 at TEP=2: the compiled decode step's collectives are the XLA path's
  (two bf16 all-reduces of [tokens, hidden] a layer, the residual norm's too), and its greedy
  tokens are one device's. With tensor_parallel="gspmd" (decoding from the same prefill) the
  same tokens, but every layer gathers weights (GSPMD cannot split a Pallas call: q_b, kv_b,
  o_proj, the dense MLP). Three layers: the dense one, an MoE layer with its indexer and one
  reusing that top-k."""
  config, params = _first_layers(model, 3)
  assert config.mlp_layer_types == ("dense", "sparse", "sparse") and config.indexer_types[1:] == ("full", "shared")
  params = jax.tree_util.tree_map_with_path(  # the router's bias stays fp32, as checkpoints keep it
    lambda path, a: a if "e_score_correction_bias" in jax.tree_util.keystr(path) else a.astype(jnp.bfloat16), params)
  prompt = jnp.asarray(_prompt(config, 4, (1, 6)))
  positions = jnp.arange(6, dtype=jnp.int32)[None]

  spec = lambda layout: steps.StepSpec(config, Runtime(**PALLAS_STACK, tensor_parallel=layout), "bfloat16")
  prefill = lambda params, cache: steps.prefill_chunk(params, cache, prompt, positions,  # (logits, cache)
                                                      spec=spec("shard_map"))[::2]

  def run(params, logits, cache, layout):
    static = dict(spec=spec(layout), sampling=Sampling(), max_new_tokens=4)
    step_args = (jnp.argmax(logits, -1).astype(jnp.int32), jnp.ones(1, bool), jax.random.key(0),
                 jnp.asarray([], jnp.int32), jnp.full((1,), 4, jnp.int32))
    lowered = steps.decode_loop.lower(params, cache, *step_args, **static)
    compiled = lowered.compile()
    layers = collections.defaultdict(list)
    for scope, kind, elements, _ in _collectives(compiled.as_text()):
      if scope.startswith("layers_"):
        layers[scope].append((kind, elements))
    # The [token, hidden] all-reduces' element types before compiling (which promotes a bf16
    # all-reduce to f32 on the CPU; that HLO keeps no op names).
    types = [types for _, kind, elements, types in _collectives(lowered.as_text("hlo"))
             if (kind, elements) == ("all-reduce", config.hidden_size)]
    return np.asarray(compiled(params, cache, *step_args)[0]), compiled.as_text(), layers, types

  cache = lambda: init_cache(config, num_pages=5, page_size=8, batch=1, max_pages=4, kv_dtype="fp8").replace(
    page_table=1 + jnp.arange(4, dtype=jnp.int32)[None])
  want, one_device, *_ = run(params, *prefill(params, cache()), "shard_map")
  assert "bf16_matmul" in one_device and "sparse_mla" in one_device  # the kernels do run
  mesh = parallel.make_mesh(2)
  with parallel.use_mesh(mesh):
    sharded = parallel.shard_params(config, params, mesh)
    logits, filled = prefill(sharded, parallel.shard_cache(cache(), mesh))
    # GSPMD's decode from a copy of the same prefill (its own would compile once more for it).
    gspmd, _, gspmd_layers, _ = run(sharded, logits, jax.tree.map(jnp.copy, filled), "gspmd")
    got, _, layers, types = run(sharded, logits, filled, "shard_map")
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(gspmd, want)
  message = config.hidden_size  # [1 token, hidden]
  assert layers == {f"layers_{i}": [("all-reduce", message)] * 2 for i in range(config.num_hidden_layers)}, layers
  assert set(types) == {"bf16"} and len(types) >= 2 * config.num_hidden_layers  # the residual norm's too
  assert all(("all-gather" in {kind for kind, *_ in found}) for found in gspmd_layers.values()), gspmd_layers
  assert len(gspmd_layers) == config.num_hidden_layers


class _RecordingFiles(TensorFiles):
  """TensorFiles that remembers the size of every read, per tensor."""

  def __init__(self, directory):
    super().__init__(directory)
    self.reads = collections.defaultdict(list)

  def read(self, name, index=()):
    part = super().read(name, index)
    self.reads[name].append(part.nbytes)
    return part


@pytest.mark.parametrize("tep", (2, 8))
def test_sharded_load_reads_only_local_slices(model, tmp_path, tep):
  config, params = model
  save_pretrained(config, params, tmp_path)
  mesh = parallel.make_mesh(tep)
  files = _RecordingFiles(tmp_path)
  loaded = load_params(files, config, dtype=jnp.float32, shardings=parallel.shardings_fn(config, mesh))
  shardings = rules.param_shardings(abstract_params(config), mesh)
  per_device, replicated = collections.Counter(), 0
  for leaf, sharding, got in zip(*map(jax.tree.leaves, (params, shardings, loaded))):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))
    if sharding.is_fully_replicated:
      replicated += leaf.nbytes  # JAX reads a replicated tensor once for all devices
    else:
      for device in mesh.devices.flat:  # each device's own slice
        per_device[device.id] += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
  assert len(per_device) == tep and files.bytes_read == sum(per_device.values()) + replicated
  # A split tensor is never read whole: each read is one device's slice of it.
  q_b = "model.layers.1.self_attn.q_b_proj.weight"
  assert files.reads[q_b] == [params["layers_1"]["self_attn"]["q_b_proj"]["weight"].nbytes // tep] * tep
  expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
  assert len(files.reads[expert]) == 1  # read by the one device that holds expert 0


def test_rules_layout(model):
  """The TEP layout: heads, experts, MLP intermediates and vocabulary split; the rest replicated."""
  config, _ = model
  shardings = rules.param_shardings(abstract_params(config), parallel.make_mesh(8))
  layer, mlp = shardings["layers_1"], shardings["layers_1"]["mlp"]
  specs = {
    "q_b_proj": (layer["self_attn"]["q_b_proj"]["weight"], P("tep", None)),
    "kv_b_proj": (layer["self_attn"]["kv_b_proj"]["weight"], P("tep", None)),
    "o_proj": (layer["self_attn"]["o_proj"]["weight"], P(None, "tep")),
    "q_a_proj": (layer["self_attn"]["q_a_proj"]["weight"], P(None, None)),
    "indexer wq_b": (layer["self_attn"]["indexer"]["wq_b"]["weight"], P(None, None)),
    "router": (mlp["gate"]["weight"], P(None, None)),
    "experts down": (mlp["experts"]["down_proj"], P("tep", None, None)),
    "shared down": (mlp["shared_experts"]["down_proj"]["weight"], P(None, "tep")),
    "dense gate": (shardings["layers_0"]["mlp"]["gate_proj"]["weight"], P("tep", None)),
    "embedding": (shardings["embed_tokens"]["weight"], P("tep", None)),
    "lm_head": (shardings["lm_head"]["weight"], P("tep", None)),
  }
  assert {k: s.spec for k, (s, _) in specs.items()} == {k: spec for k, (_, spec) in specs.items()}


@pytest.mark.parametrize("overrides, tep", [
  (dict(num_attention_heads=4, num_key_value_heads=4), 8),  # rows 4 * 40 divide by 8, heads do not
  (dict(n_routed_experts=6), 4),
  (dict(vocab_size=500), 8),
])
def test_indivisible_degree_is_a_clear_error(model, overrides, tep):
  config = dataclasses.replace(model[0], **overrides)
  field, value = next(iter(overrides.items()))
  with pytest.raises(ValueError, match=rf"{field}: {value} .* not divisible by the TEP degree {tep}"):
    parallel.shardings_fn(config, parallel.make_mesh(tep))


def test_param_level_errors_name_the_param(model):
  config = dataclasses.replace(model[0], n_routed_experts=6)
  mesh = parallel.make_mesh(4)
  with pytest.raises(ValueError, match=r"layers_1/mlp/experts/\w+_proj: dim 'experts' of size 6 is not "
                                       r"divisible by the tep degree 4"):
    rules.param_shardings(abstract_params(config), mesh)
  with pytest.raises(ValueError, match="two dims on mesh axis 'tep'"):
    rules.mesh_spec(("experts", "heads"), (8, 8), mesh, param="w")
  with pytest.raises(ValueError, match="logical axis 'rows' has no rule"):
    rules.mesh_spec(("rows",), (8,), mesh, param="w")
  with pytest.raises(ValueError, match="tep=16 needs 1..8 devices"):
    parallel.make_mesh(16)
  unboxed = nn.unbox(abstract_params(model[0]))
  with pytest.raises(ValueError, match="no logical axis names"):
    rules.param_shardings(unboxed, mesh)


@pytest.mark.parametrize("draft_steps, accept_length", [(0, 1.0), (3, 3.48)])
@pytest.mark.parametrize("latency_us", [5.0, 15.0])
def test_comm_model_projection(draft_steps, accept_length, latency_us):
  """GLM-5 at TEP=8: 2 all-reduces per layer of [tokens, 6144] bf16, latency-bound."""
  config = get_model_config("glm5")
  link = comm_model.Link(latency=latency_us * 1e-6)
  got = comm_model.project(config, rank_step_s=0.02, tep=8, link=link, accept_length=accept_length,
                           draft_steps=draft_steps)
  ring = lambda nbytes, share: latency_us * 1e-6 + share * nbytes / 450e9
  layer = lambda tokens, layers: (2 * layers + 1) * ring(tokens * 6144 * 2, 2 * 7 / 8)
  # verify: 78 layers, the embedding, greedy sampling's 2 gathers; each draft: 1 layer, the
  # embedding, the draft's candidates gathered, its index and confidence (4 scalar all-reduces)
  assert got["collectives"] == 2 * 78 + 3 + draft_steps * (2 + 1 + 5)
  comm = (layer(draft_steps + 1, 78) + 2 * ring((draft_steps + 1) * 8 * 4, 7 / 8)
          + draft_steps * (layer(1, 1) + ring(8 * 4, 7 / 8) + 4 * ring(4, 2 * 7 / 8)))
  assert got["comm_ms"] == pytest.approx(comm * 1e3)
  assert got["tokens_per_s"] == pytest.approx(accept_length / (0.02 + comm))
  with pytest.raises(ValueError, match="accept_length"):
    comm_model.project(config, rank_step_s=0.02, tep=8, link=link, accept_length=draft_steps + 2,
                       draft_steps=draft_steps)


def test_tep_project_writes_the_table(tmp_path, capsys):
  from absl import flags
  from experiments import tep_project

  out = tmp_path / "tep.json"
  flags.FLAGS(["tep_project", "--config=tiny", "--full_config=tiny", "--tep=2", "--rank_step_ms=2",
               "--latency_us=0,10", f"--output={out}"])
  tep_project.main([])
  report = json.loads(out.read_text())
  assert [r["latency_us"] for r in report["projection"]] == [0, 10]
  no_latency, slow = report["projection"]
  assert no_latency["step_ms"] == pytest.approx(2, rel=1e-3) and slow["step_ms"] > 2 + 4 * 2 * 10e-3
  # tiny holds every weight: one device of the TEP=2 layout holds less.
  assert report["layout"]["layout_gb"] < report["layout"]["rank_config_gb"]
  assert "latency per collective: assumed" in capsys.readouterr().out


@pytest.mark.parametrize("tep", [2, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_vocab_sharded_top_k_equals_lax_top_k(tep, k):
  """sampling.top_k over logits split along the vocab: lax.top_k's values and indices, ties
  included (rows of few distinct values, a row with -inf), while its compiled program moves only
  the per-device candidates: no collective result larger than [rows, tep * k]."""
  from glmjax.engine import sampling

  mesh, rng = parallel.make_mesh(tep), np.random.default_rng(10 * tep + k)
  scores = rng.integers(-2, 3, (3, 8 * 40)).astype(np.float32)
  scores[1] = rng.standard_normal(8 * 40)
  scores[2, ::3] = -np.inf
  sharded = jax.device_put(scores, NamedSharding(mesh, P(None, "tep")))
  fn = jax.jit(lambda x: sampling.top_k(x, k, mesh))
  got, want = fn(sharded), jax.lax.top_k(jnp.asarray(scores), k)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  moved = re.findall(r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|all-to-all|collective-permute)",
                     fn.lower(sharded).compile().as_text())
  assert moved and all(math.prod(int(d) for d in dims.split(",") if d) <= 3 * tep * k for dims in moved)


def test_speculative_program_gathers_no_vocab_row(model):
  """The TEP=2 speculative decode program: drafting takes its tokens from the vocab-split logits
  without gathering a [rows, V] row (it did, per draft token: GLM-5's 620 KB, run 27's two-GPU
  profile); what stays is scalar: each draft's confidence (softmax's max and sum, then the max
  of the probabilities), three all-reduces for the first draft and three in the draft loop."""
  from experiments import step_timing
  from glmjax.engine import steps
  from glmjax.runtime import make_runtime

  config, _ = model
  mesh = parallel.make_mesh(2)
  with parallel.use_mesh(mesh):
    params = jax.jit(lambda key: init_params(config, key), out_shardings=parallel.param_shardings(
        abstract_params(config), mesh)).eval_shape(jax.random.key(0))
    spec = steps.StepSpec(config, make_runtime(config, attention="sparse", matmul="xla"), "bfloat16")
    cache = step_timing._random_cache(config, 64, 16, "bf16", jax.random.key(1))
    program, mtp = step_timing._decode_program(config, spec, 2, cache.page_table.shape[1] + 1, "bf16",
                                               jax.random.key(2))
    cache, mtp = parallel.shard_cache(cache, mesh), jax.device_put(mtp, NamedSharding(mesh, P()))
    text = jax.jit(program(3)).lower(params, cache, mtp).compile().as_text()
  moved = re.findall(r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce)", text)
  assert moved and not [dims for dims, _ in moved if str(config.vocab_size) in dims.split(",")]
  scalars = [kind for dims, kind in moved if dims == "1" and kind == "all-reduce"]
  assert len(scalars) == 6


@pytest.mark.parametrize("tep", [2, 8])
def test_comm_bench_times_the_steps_collectives(tep):
  """glmjax.parallel.comm_bench: a row per collective comm_model lists for a step (its kind, bytes
  and count), each timed from a program that really chains that many collectives (XLA keeps them
  all: counted in the compiled program), finite times, and a summary whose matching latency
  reproduces the measured step."""
  from glmjax.parallel import comm_bench

  config, mesh = get_model_config("tiny"), parallel.make_mesh(tep)
  for kind in ("all-reduce", "all-gather"):
    nbytes = 5 * tep * 4 if kind == "all-gather" else 5 * 2 * config.hidden_size
    fn, x = comm_bench.chained(kind, nbytes, mesh, 3)
    assert x.shape == ((5 * tep, 1) if kind == "all-gather" else (tep, 5 * config.hidden_size))
    assert len(re.findall(rf"= \S+ {kind}(-start)?\(", jax.jit(fn).lower(x).compile().as_text())) == 3
  result = comm_bench.bench_collectives(config, mesh, draft_steps=2, chain=4, latency_us=5.0, iters=3, repeats=3)
  want = comm_model.step_collectives(config, tep=tep, draft_steps=2)
  assert [(r["kind"], r["nbytes"], r["count"]) for r in result["rows"]] == [(c.kind, c.nbytes, c.count) for c in want]
  assert all(np.isfinite(r["measured_us"]) for r in result["rows"])  # their sign is the GPU's to show: the
  # CPU's 4-byte all-reduces, timed beside the main suite, came out negative once (a difference of noise)
  s = result["summary"]
  assert s["collectives"] == sum(c.count for c in want) and s["tep"] == tep
  # The matching latency: the measured step less the bytes' time, per collective (negative where
  # CPU timing noise beats the bytes: a Link would reject it, so the identity is checked directly).
  transfer_ms = sum(c.count * c.seconds(tep, comm_model.Link(latency=0.0)) for c in want) * 1e3
  assert transfer_ms + s["collectives"] * s["matching_latency_us"] * 1e-3 == pytest.approx(s["step_measured_ms"])
  with pytest.raises(ValueError, match="chain must be >= 2"):
    comm_bench.bench_collectives(config, mesh, draft_steps=2, chain=1, latency_us=5.0)


def test_collective_bench_entry_point(tmp_path):
  """python -m experiments.collective_bench (its own process: it simulates the devices it asks
  for) writes the rows and the summary."""
  import subprocess
  import sys

  out = tmp_path / "collectives.json"
  subprocess.run([sys.executable, "-m", "experiments.collective_bench", "--config=tiny", "--cpu_devices=2", "--quick",
                  "--chain=2", f"--output={out}"], check=True, capture_output=True)
  report = json.loads(out.read_text())
  assert report["summary"]["tep"] == 2 and len(report["rows"]) == 7


@pytest.mark.multidevice
def test_replay_tep8_produces_the_tokens_of_tep1(tmp_path):
  """experiments.replay --config=tiny2 --tep=8 on 8 simulated devices equals --tep=1."""
  import json
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
  outs = {}
  for tep in (1, 8):
    out = tmp_path / f"tep{tep}.json"
    subprocess.run([sys.executable, "-m", "experiments.replay", "--config=tiny2", "--scale=60", "--rounds=2",
                    "--attention=sparse", "--dtype=float32", f"--tep={tep}", f"--output={out}"],
                   check=True, capture_output=True, env=env)
    outs[tep] = [r["generated"] for r in json.loads(out.read_text())["rounds"]]
  assert outs[8] == outs[1] and all(len(g) == 4 for g in outs[1])
