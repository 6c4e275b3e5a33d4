"""Quantized checkpoints: ModelOpt NVFP4 / block-FP8 safetensors written here with the independent
numpy implementation (tests/nvfp4_numpy_ref.py), loaded bit for bit; save/load round trips;
errors naming the tensor; quantize-on-load; sharded loading of quantized leaves."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import glmjax
from configs import get_model_config
from glmjax.checkpoint import CheckpointError, TensorFiles, hf_state_dict, read_quantization_config
from glmjax.model import abstract_params
from glmjax.quant import FP8BlockWeight, NVFP4Weight, QuantizedWeight, arrange_params, quantize_params
from tests import nvfp4_numpy_ref as ref

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = get_model_config("tiny")
MOE_LAYERS = ("layers_1", "layers_2", "layers_3", "mtp/block")  # tiny: layer 0 dense, MTP is MoE
INDEXER_LAYERS = ("layers_0", "layers_1", "layers_3", "mtp/block")  # layer 2 shares layer 1's top-k


def is_quantized(x) -> bool:
  return isinstance(x, QuantizedWeight)


def assert_same(a, b) -> None:
  """Same dtype, shape and bytes (e4m3 compared as bits, so -0.0 and NaN patterns count)."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
  np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def assert_same_tree(a, b) -> None:
  assert jax.tree.structure(a, is_leaf=is_quantized) == jax.tree.structure(b, is_leaf=is_quantized)
  jax.tree.map(assert_same, a, b)


def quantized_paths(params) -> dict[str, str]:
  """'layers_1/mlp/experts/gate_proj' -> 'nvfp4' | 'fp8_block' for every quantized leaf."""
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
  return {"/".join(str(k.key) for k in path): leaf.format for path, leaf in leaves if is_quantized(leaf)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[pathlib.Path, dict]:
  """A random bf16 tiny checkpoint (MTP layer included) and its params (drawn in numpy from the
  params' shapes: model.init would compile the whole model)."""
  rng = np.random.default_rng(11)
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.05, s.dtype),
                        nn.unbox(abstract_params(CONFIG)))
  path = tmp_path_factory.mktemp("plain")
  glmjax.save_pretrained(CONFIG, params, path)
  return path, params


def write_quantized(src: pathlib.Path, dst: pathlib.Path, formats: dict[str, str], *, seed: int,
                    edit=None) -> dict[str, np.ndarray]:
  """Copy the plain checkpoint with each weight in `formats` (HF name -> "nvfp4" | "fp8") stored as
  ModelOpt NVFP4 (fresh random input_scale) or 128x128 block FP8, made by the numpy reference.
  `edit(tensors)` may break the result. Returns the tensors written."""
  tensors = load_file(src / "model.safetensors")
  rng = np.random.default_rng(seed)
  for name, fmt in formats.items():
    w, stem = tensors.pop(name).astype(np.float32), name[:-len("weight")]
    if fmt == "nvfp4":
      packed, block_scale, scale_2 = ref.quantize_nvfp4(w)
      tensors |= {name: packed, stem + "weight_scale": block_scale,
                  stem + "weight_scale_2": np.asarray(scale_2, np.float32),
                  stem + "input_scale": np.asarray(rng.uniform(0.01, 1.0), np.float32)}
    else:
      codes, scale_inv = ref.quantize_fp8_block(w)
      tensors |= {name: codes, stem + "weight_scale_inv": scale_inv}
  if edit is not None:
    edit(tensors)
  dst.mkdir(exist_ok=True)
  shutil.copy(src / "config.json", dst / "config.json")
  save_file(tensors, dst / "model.safetensors")
  return tensors


def hf_layers() -> list[str]:
  return [f"model.layers.{i}." for i in range(CONFIG.num_hidden_layers + 1)]  # + the MTP layer


def expert_names(proj: str = "gate_proj") -> list[str]:
  return [f"{layer}mlp.experts.{e}.{p}.weight" for layer in hf_layers()[1:] for e in range(CONFIG.n_routed_experts)
          for p in (("gate_proj", "up_proj", "down_proj") if proj == "all" else (proj,))]


def attention_names(*projs: str) -> list[str]:
  return [f"{layer}self_attn.{p}.weight" for layer in hf_layers() for p in projs]


# Which weights each hand-made checkpoint quantizes, and how.
LAYOUTS = {
  "nvfp4": lambda: {n: "nvfp4" for n in expert_names("all") + attention_names("q_b_proj", "o_proj")},
  "fp8": lambda: {n: "fp8" for n in expert_names("all") + attention_names("q_a_proj", "kv_b_proj")},
  "mixed": lambda: ({n: "nvfp4" for n in expert_names("all")}
                    | {n: "fp8" for n in attention_names("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_handmade_checkpoint_loads_bit_exact(tmp_path, plain, layout):
  src, params = plain
  formats = LAYOUTS[layout]()
  written = write_quantized(src, tmp_path, formats, seed=len(layout))
  config, loaded = glmjax.load_pretrained(tmp_path)
  assert config == CONFIG
  exported = dict(hf_state_dict(config, loaded))
  assert exported.keys() == written.keys()
  for name, array in written.items():
    assert_same(exported[name], array)
  # One leaf per quantized 2-D weight and per stacked projection; the rest stays plain bf16.
  assert len(quantized_paths(loaded)) == len({re.sub(r"experts\.\d+\.", "", n) for n in formats})
  assert_same(loaded["lm_head"]["weight"], params["lm_head"]["weight"])
  # Spot checks on the leaves themselves: a stacked expert and a 2-D projection.
  experts = loaded["layers_2"]["mlp"]["experts"]["down_proj"]
  kv_b = loaded["layers_3"]["self_attn"]["kv_b_proj"]["weight"]
  if layout != "fp8":
    assert isinstance(experts, NVFP4Weight) and experts.shape == (CONFIG.n_routed_experts, 128, 64)
    packed, block_scale, scale_2 = ref.quantize_nvfp4(np.asarray(params["layers_2"]["mlp"]["experts"]["down_proj"][5],
                                                                  np.float32))
    assert_same(experts.packed[5], packed)
    assert_same(experts.block_scale[5], block_scale)
    assert_same(experts.global_scale[5], np.float32(scale_2))
    assert_same(experts.input_scale[5], written["model.layers.2.mlp.experts.5.down_proj.input_scale"])
  if layout != "nvfp4":
    assert isinstance(kv_b, FP8BlockWeight)
    codes, scale_inv = ref.quantize_fp8_block(np.asarray(params["layers_3"]["self_attn"]["kv_b_proj"]["weight"],
                                                         np.float32))
    assert_same(kv_b.weight, codes)
    assert_same(kv_b.scale_inv, scale_inv)


POLICY_FORMATS = {"fp8": ("fp8", "F8_E4M3", "fmt"), "nvfp4_experts": ("modelopt", "U8", "group_size"),
                  "nvfp4": ("modelopt", "U8", "group_size")}


@pytest.mark.parametrize("policy", list(POLICY_FORMATS))
def test_save_load_round_trip_is_exact(tmp_path, plain, policy):
  _, params = plain
  quantized = quantize_params(params, policy)
  # 2-D NVFP4 weights in the fragment kernel's order are written in ModelOpt's, bit for bit.
  glmjax.save_pretrained(CONFIG, arrange_params(quantized, fragments=True), tmp_path, max_shard_bytes=150_000)
  assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
  config, loaded = glmjax.load_pretrained(tmp_path)
  assert config == CONFIG
  assert_same_tree(loaded, quantized)
  method, code_dtype, key = POLICY_FORMATS[policy]
  quant_config = read_quantization_config(tmp_path)
  assert quant_config["quant_method"] == method and key in quant_config
  files = TensorFiles(tmp_path)
  stem = "model.layers.3.mlp.experts.6.up_proj."
  assert files.dtype(stem + "weight") == code_dtype
  if method == "modelopt":
    assert quant_config["quant_algo"] == "NVFP4" and quant_config["group_size"] == 16
    assert "lm_head" in quant_config["exclude_modules"]
    assert files.shape(stem + "weight") == (64, 64) and files.shape(stem + "weight_scale") == (64, 8)
    assert files.dtype(stem + "weight_scale") == "F8_E4M3"
    assert files.shape(stem + "weight_scale_2") == files.shape(stem + "input_scale") == ()
    assert ("model.layers.0.self_attn.q_a_proj.weight_scale" in files.names()) == (policy == "nvfp4")
  else:
    assert quant_config["weight_block_size"] == [128, 128]
    assert files.shape(stem + "weight_scale_inv") == (1, 1) and files.dtype(stem + "weight_scale_inv") == "F32"
  assert read_quantization_config(plain[0]) is None


def _break(name: str, value=None):
  """An edit that replaces tensor `name` by `value` (None: removes it)."""
  def edit(tensors):
    if value is None:
      tensors.pop(name)
    else:
      tensors[name] = value
  return edit


def _unquantize(tensors, stem: str) -> None:
  """Store one weight plain again (bf16), dropping its NVFP4 scales."""
  for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
    tensors.pop(stem + suffix)
  tensors[stem + "weight"] = np.ones((64, 128), ml_dtypes.bfloat16)


E4M3 = ml_dtypes.float8_e4m3fn
EXPERT = "model.layers.1.mlp.experts.2.up_proj."
Q_A = "model.layers.0.self_attn.q_a_proj."
BROKEN = {
  "block scale shape": ("nvfp4", _break(EXPERT + "weight_scale", np.ones((64, 4), E4M3)),
                        r"experts\.2\.up_proj\.weight_scale has shape \(64, 4\), expected \(64, 8\)"),
  "fp8 scale shape": ("fp8", _break(Q_A + "weight_scale_inv", np.ones((2, 1), np.float32)),
                      r"q_a_proj\.weight_scale_inv has shape \(2, 1\), expected \(1, 1\) "
                      r"\(for a fp8_block weight of shape \(64, 128\)\)"),
  "packed shape": ("nvfp4", _break(EXPERT + "weight", np.zeros((64, 128), np.uint8)),
                   r"experts\.2\.up_proj\.weight has shape \(64, 128\), expected \(64, 64\)"),
  "scale_2 missing": ("nvfp4", _break(EXPERT + "weight_scale_2"),
                      r"missing tensor .*experts\.2\.up_proj\.weight_scale_2"),
  "scale dtype": ("nvfp4", _break(EXPERT + "weight_scale", np.ones((64, 8), np.float32)),
                  r"experts\.2\.up_proj\.weight_scale has dtype F32, expected F8_E4M3"),
  "experts mixed": ("nvfp4", lambda t: _unquantize(t, EXPERT),
                    r"experts\.0\.up_proj\.weight \(nvfp4\) and "
                    r".*experts\.2\.up_proj\.weight \(plain\) .*different formats"),
  "quantized lm_head": ("fp8", lambda t: t.update({"lm_head.weight": np.zeros((512, 128), E4M3),
                                                   "lm_head.weight_scale_inv": np.ones((4, 1), np.float32)}),
                        r"tensor lm_head\.weight is stored as fp8_block, but glmjax runs this weight unquantized"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_quantized_tensors_are_named(tmp_path, plain, case):
  fmt, edit, message = BROKEN[case]
  names = [n for n in expert_names("all") if ".layers.1." in n] + attention_names("q_a_proj")
  write_quantized(plain[0], tmp_path, {n: fmt for n in names}, seed=3, edit=edit)
  with pytest.raises(CheckpointError, match=message):
    glmjax.load_pretrained(tmp_path)


def expected_paths(policy: str) -> set[str]:
  """The leaves of the tiny config each policy quantizes, listed by hand."""
  experts = {f"{layer}/mlp/experts/{p}" for layer in MOE_LAYERS for p in ("gate_proj", "up_proj", "down_proj")}
  if policy == "nvfp4_experts":
    return experts
  layers = ("layers_0",) + MOE_LAYERS
  attn = {f"{layer}/self_attn/{p}/weight" for layer in layers
          for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
  indexer = {f"{layer}/self_attn/indexer/{p}/weight" for layer in INDEXER_LAYERS for p in ("wq_b", "wk")}
  mlps = {f"layers_0/mlp/{p}/weight" for p in ("gate_proj", "up_proj", "down_proj")}
  mlps |= {f"{layer}/mlp/shared_experts/{p}/weight" for layer in MOE_LAYERS
           for p in ("gate_proj", "up_proj", "down_proj")}
  return experts | attn | indexer | mlps | {"mtp/eh_proj/weight"}


@pytest.mark.parametrize("policy", ["fp8", "nvfp4_experts", "nvfp4"])
def test_quantize_on_load_applies_the_policy(plain, policy):
  path, _ = plain
  _, loaded = glmjax.load_pretrained(path, quantize=policy)
  fmt = "fp8_block" if policy == "fp8" else "nvfp4"
  assert quantized_paths(loaded) == {p: fmt for p in expected_paths(policy)}
  assert_same_tree(loaded, quantize_params(glmjax.load_pretrained(path)[1], policy))


def test_quantize_on_load_keeps_stored_formats_and_checks_policy(tmp_path, plain):
  write_quantized(plain[0], tmp_path, {n: "nvfp4" for n in expert_names("all")}, seed=5)
  _, loaded = glmjax.load_pretrained(tmp_path, quantize="fp8")
  paths = quantized_paths(loaded)
  assert {p for p, f in paths.items() if f == "nvfp4"} == expected_paths("nvfp4_experts")
  assert {p for p, f in paths.items() if f == "fp8_block"} == expected_paths("fp8") - expected_paths("nvfp4_experts")
  with pytest.raises(ValueError, match="quantize must be None or a policy"):
    glmjax.load_pretrained(tmp_path, quantize="int4")


SHARDED_LOAD = """
import jax, numpy as np, glmjax
from jax.sharding import NamedSharding, PartitionSpec as P
from glmjax.quant import QuantizedWeight
mesh = jax.make_mesh((4,), ("x",))
def shardings(path, shape):  # split the leading dim (experts, or out) where 4 divides it
  return NamedSharding(mesh, P("x") if shape[0] % 4 == 0 else P())
_, whole = glmjax.load_pretrained("{path}")
_, split = glmjax.load_pretrained("{path}", shardings=shardings)
assert jax.tree.structure(whole) == jax.tree.structure(split)
for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
  assert a.dtype == b.dtype and a.shape == b.shape and np.asarray(a).tobytes() == np.asarray(b).tobytes()
shard_shapes = lambda a: {{s.data.shape for s in a.addressable_shards}}
experts = split["layers_1"]["mlp"]["experts"]["gate_proj"]  # NVFP4 [8, 64, 128]: 2 experts per device
assert shard_shapes(experts.packed) == {{(2, 64, 64)}} and shard_shapes(experts.block_scale) == {{(2, 64, 8)}}
assert shard_shapes(experts.global_scale) == shard_shapes(experts.input_scale) == {{(2,)}}
kv_b = split["layers_0"]["self_attn"]["kv_b_proj"]["weight"]  # FP8 [H * 56, 32]: rows split
rows, (scale_rows, scale_cols) = kv_b.weight.shape[0], kv_b.scale_inv.shape
assert shard_shapes(kv_b.weight) == {{(rows // 4, 32)}}
# Its 128-row scale blocks split with the rows where 4 divides their count, else stay replicated.
if scale_rows % 4:
  assert kv_b.scale_inv.sharding.is_fully_replicated
else:
  assert shard_shapes(kv_b.scale_inv) == {{(scale_rows // 4, scale_cols)}}
print("ok")
"""


def test_sharded_load_of_quantized_leaves(tmp_path, plain):
  """Four simulated CPU devices (own process: the device count is fixed when jax starts)."""
  write_quantized(plain[0], tmp_path, LAYOUTS["mixed"](), seed=7)
  env = dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")  # conftest's compile flags, and four devices
  result = subprocess.run([sys.executable, "-c", SHARDED_LOAD.format(path=tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
