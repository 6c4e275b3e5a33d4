"""HF checkpoint loading, saving and its errors; orbax save/restore."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import glmjax
from configs import get_model_config
from glmjax.checkpoint import CheckpointError, TensorFiles, load_params, restore_orbax, save_orbax
from glmjax.model import init_params


def test_round_trip_is_exact(tmp_path, fixture_dir, fixture_bf16):
  config, params = fixture_bf16
  glmjax.save_pretrained(config, params, tmp_path / "ckpt")
  original = load_file(fixture_dir / "model.safetensors")
  written = load_file(tmp_path / "ckpt" / "model.safetensors")
  assert original.keys() == written.keys()
  for name in original:
    # The router's correction bias is held in fp32 (as transformers does): its values round-trip.
    if not name.endswith("e_score_correction_bias"):
      assert written[name].dtype == original[name].dtype, name
    np.testing.assert_array_equal(original[name].astype(np.float32), written[name].astype(np.float32), err_msg=name)
  config2, params2 = glmjax.load_pretrained(tmp_path / "ckpt")
  assert config2 == config
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_sharded_files_with_index_and_mtp_layer(tmp_path):
  config = get_model_config("tiny")
  assert config.num_nextn_predict_layers == 1
  params = init_params(config, jax.random.key(3))
  glmjax.save_pretrained(config, params, tmp_path, max_shard_bytes=200_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert any(n.startswith(f"model.layers.{config.num_hidden_layers}.eh_proj") for n in index["weight_map"])
  _, loaded = glmjax.load_pretrained(tmp_path)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, loaded)


def _edit(tmp_path, fixture_dir, fn):
  shutil.copy(fixture_dir / "config.json", tmp_path / "config.json")
  tensors = load_file(fixture_dir / "model.safetensors")
  fn(tensors)
  save_file(tensors, tmp_path / "model.safetensors")
  return tmp_path


def test_missing_tensor_is_named(tmp_path, fixture_dir):
  name = "model.layers.1.self_attn.kv_b_proj.weight"
  path = _edit(tmp_path, fixture_dir, lambda t: t.pop(name))
  with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
    glmjax.load_pretrained(path)


def test_unexpected_tensor_is_named(tmp_path, fixture_dir):
  def add(t):
    t["model.layers.2.self_attn.indexer.wk.weight"] = np.zeros((32, 128), np.float32)
  with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.2\.self_attn\.indexer\.wk\.weight"):
    glmjax.load_pretrained(_edit(tmp_path, fixture_dir, add))


def test_misshaped_tensor_names_both_shapes(tmp_path, fixture_dir):
  def bad(t):
    t["model.layers.3.mlp.experts.5.down_proj.weight"] = np.zeros((128, 63), np.float32)
  with pytest.raises(CheckpointError,
                     match=r"experts\.5\.down_proj\.weight has shape \(128, 63\), expected \(128, 64\)"):
    glmjax.load_pretrained(_edit(tmp_path, fixture_dir, bad))


def test_no_checkpoint_files(tmp_path, fixture_dir):
  shutil.copy(fixture_dir / "config.json", tmp_path / "config.json")
  with pytest.raises(CheckpointError, match="model.safetensors"):
    glmjax.load_pretrained(tmp_path)


def test_loader_reads_each_tensor_once(fixture_dir):
  files = TensorFiles(fixture_dir)
  config = glmjax.ModelConfig.from_hf(fixture_dir)
  load_params(files, config, dtype=jnp.bfloat16)
  total = sum(np.prod(files.shape(n)) * 2 for n in files.names())
  assert files.bytes_read == total


def test_orbax_round_trip(tmp_path, fixture_bf16):
  _, params = fixture_bf16
  save_orbax(params, tmp_path / "orbax")
  restored = restore_orbax(tmp_path / "orbax", params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored)
