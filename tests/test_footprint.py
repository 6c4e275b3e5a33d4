"""Parameter, byte and KV accounting against the HF fixture and GLM-5's published numbers."""

import json
import math
import pathlib

import numpy as np
import pytest
from safetensors import safe_open

from configs import get_model_config
from experiments.describe import describe, format_table
from glmjax import footprint
from glmjax.config import ModelConfig

FIXTURE_DIR = pathlib.Path("/work/shared/fixtures/hf_glm_moe_dsa_tiny")
GLM5_PARAMS = 743_911_199_232  # transformers, meta device (NOTES.md).


def _param_sum(config: ModelConfig, groups) -> int:
  return sum(t.size for t in footprint.checkpoint_tensors(config)
             if t.group in groups and not t.mtp)


def test_tensors_match_fixture_checkpoint():
  config = ModelConfig.from_hf(FIXTURE_DIR)
  with safe_open(FIXTURE_DIR / "model.safetensors", framework="numpy") as f:
    stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
  listed = {t.name: t.shape for t in footprint.checkpoint_tensors(config)}
  assert listed == stored
  assert footprint.param_counts(config)["checkpoint"] == sum(map(math.prod, stored.values()))


def test_glm5_total():
  counts = footprint.param_counts(get_model_config("glm5"))
  assert counts["total"] == GLM5_PARAMS
  assert counts["checkpoint"] - counts["total"] == 75 * 256  # e_score_correction_bias buffers.
  assert sum(counts[g] for g in footprint.GROUPS) == counts["checkpoint"]


def test_glm5_mtp():
  c = get_model_config("glm5")
  h = c.hidden_size
  mtp = footprint.param_counts(c)["mtp"]
  assert 9.945e9 < mtp < 9.955e9
  # One MoE decoder layer with its indexer, plus enorm, hnorm, eh_proj, shared_head.norm.
  moe_layer = sum(t.size for t in footprint.checkpoint_tensors(c)
                  if t.name.startswith("model.layers.3.") and "e_score" not in t.name)
  assert mtp == moe_layer + 2 * h * h + 3 * h


def test_glm5_2_drops_57_indexers():
  c5, c52 = get_model_config("glm5"), get_model_config("glm5_2")
  per_layer = _param_sum(c5, {"indexer"}) // 78
  assert footprint.param_counts(c52)["total"] == GLM5_PARAMS - 57 * per_layer


@pytest.mark.parametrize("name", ["glm5", "tiny", "mini", "tep8_shard"])
def test_active_params(name):
  c = get_model_config(name)
  counts = footprint.param_counts(c)
  routed = counts["routed_experts"]
  dense = counts["checkpoint"] - routed - counts["embedding"]
  mtp_free = dense + c.hidden_size + routed * c.num_experts_per_tok / c.n_routed_experts
  assert footprint.active_params_per_token(c) == pytest.approx(mtp_free)
  assert footprint.weight_bytes_per_step(c, "bf16") == pytest.approx(2 * mtp_free)


def test_glm5_active_about_40b():
  assert 39.5e9 < footprint.active_params_per_token(get_model_config("glm5")) < 41.5e9


def test_rank_local_experts_counts_only_local():
  shard, full = get_model_config("tep8_shard"), get_model_config("glm5")
  shard_counts, full_counts = footprint.param_counts(shard), footprint.param_counts(full)
  assert shard_counts["routed_experts"] * 8 == full_counts["routed_experts"]
  assert shard_counts["router"] == full_counts["router"]
  assert shard_counts["embedding"] * 8 == full_counts["embedding"]


@pytest.mark.parametrize("num_tokens, top_k, n", [(1, 8, 256), (5, 8, 256), (3, 4, 16), (20, 2, 8)])
def test_expected_distinct_experts(num_tokens, top_k, n):
  rng = np.random.default_rng(0)
  trials = 4000
  picks = np.argsort(rng.random((trials, num_tokens, n)), axis=-1)[..., :top_k]
  touched = np.zeros((trials, n), bool)
  np.put_along_axis(touched, picks.reshape(trials, -1), True, axis=-1)
  simulated = touched.sum(-1).mean()
  expected = footprint.expected_distinct_experts(num_tokens, top_k, n)
  assert expected == pytest.approx(simulated, rel=0.02)
  assert top_k <= expected <= min(n, top_k * num_tokens) + 1e-9


def test_tensor_bytes_formats():
  expert = footprint.Tensor("w", (256, 300), "routed_experts", linear=True)
  assert footprint.tensor_bytes(expert, "bf16") == 2 * 256 * 300
  assert footprint.tensor_bytes(expert, "fp8") == 256 * 300 + 4 * 2 * 3
  assert footprint.tensor_bytes(expert, "nvfp4_experts") == 256 * 150 + 256 * 19 + 4
  attention = footprint.Tensor("w", (256, 300), "attention", linear=True)
  assert footprint.tensor_bytes(attention, "nvfp4_experts") == 2 * 256 * 300
  norm = footprint.Tensor("n", (256,), "norms")
  assert footprint.tensor_bytes(norm, "nvfp4") == 512
  with pytest.raises(ValueError, match="policy"):
    footprint.tensor_bytes(expert, "int4")


@pytest.mark.parametrize("name", ["glm5", "glm5_2"])
def test_weight_bytes_order(name):
  c = get_model_config(name)
  one, five = ({p: footprint.weight_bytes_per_step(c, p, t) for p in footprint.POLICIES}
               for t in (1, 5))
  assert five["nvfp4"] < five["nvfp4_experts"] < five["fp8"] < five["bf16"]
  # At one token only 8 of 256 experts are read, so bf16 attention outweighs the expert saving.
  assert one["nvfp4"] < one["fp8"] < one["nvfp4_experts"] < one["bf16"]


def test_many_tokens_read_every_expert():
  c = get_model_config("tiny")
  everything = 2 * sum(t.size for t in footprint.checkpoint_tensors(c) if not t.mtp)
  embedding_unread = 2 * _param_sum(c, {"embedding"}) * (1 - 100 / c.vocab_size)
  many = footprint.weight_bytes_per_step(c, "bf16", num_tokens=100)
  assert many == pytest.approx(everything - embedding_unread, rel=1e-6)


@pytest.mark.parametrize("name, full_layers", [("glm5", 78), ("glm5_2", 21)])
def test_kv_bytes_per_token(name, full_layers):
  c = get_model_config(name)
  fp8, bf16 = footprint.kv_bytes_per_token(c, "fp8"), footprint.kv_bytes_per_token(c, "bf16")
  assert (fp8["latent"], fp8["indexer"]) == (656, 132)
  assert (bf16["latent"], bf16["indexer"]) == (1152, 256)
  assert fp8["main"] == 78 * 656 + full_layers * 132
  assert fp8["mtp"] == 656 + 132
  with pytest.raises(ValueError, match="kv_dtype"):
    footprint.kv_bytes_per_token(c, "int8")


@pytest.mark.parametrize("context, num_tokens, selected", [
  (1000, 5, 1000), (5000, 5, 5000), (80_000, 1, 2048), (80_000, 5, 10_240)])
def test_kv_bytes_per_step(context, num_tokens, selected):
  c = get_model_config("glm5_2")
  got = footprint.kv_bytes_per_step(c, context, num_tokens, "fp8")
  assert got == 78 * selected * 656 + 21 * context * 132
  mtp = footprint.kv_bytes_per_step(c, context, num_tokens, "fp8", mtp=True)
  assert mtp == selected * 656 + context * 132


def test_mini_checkpoint_fits():
  assert footprint.checkpoint_bytes(get_model_config("mini"), "bf16") <= 20e6


@pytest.mark.parametrize("name", ["glm5", "mini", "tep8_shard"])
def test_describe(name):
  d = describe(get_model_config(name), context=80_000, verify_tokens=5)
  json.dumps(d)
  assert "tokens/s" in format_table(d)
  assert d["params"]["total"] > 0 and d["params"]["mtp"] > 0
  assert d["active_params_per_token"] > 0
  assert all(v > 0 for v in d["weight_bytes_per_step"].values())
  assert all(v > 0 for v in d["kv_bytes_per_step"].values())
  for by_kv in d["step"].values():
    assert by_kv["fp8"]["seconds"] < by_kv["bf16"]["seconds"]
    assert all(s["tokens_per_s"] > 0 for s in by_kv.values())


def test_describe_glm5_policy_order():
  w = describe(get_model_config("glm5"))["weight_bytes_per_step"]
  assert w["nvfp4_experts"] < w["fp8"] < w["bf16"]
