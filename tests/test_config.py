"""ModelConfig: HF conversion, IndexShare derivation, validation, presets."""

import dataclasses
import json
import pathlib
import re

import pytest

from configs import MODEL_CONFIGS, get_model_config
from glmjax.config import ModelConfig, derive_indexer_types

SHARED = pathlib.Path("/work/shared")
FIXTURE_DIR = SHARED / "fixtures" / "hf_glm_moe_dsa_tiny"
HF_CONFIGS = {
  "fixture": FIXTURE_DIR / "config.json",
  "glm5": SHARED / "configs" / "glm5_config.json",
  "glm5_2": SHARED / "configs" / "glm5_2_config.json",
}
GLM5_2_FULL = (0, 1, 2) + tuple(range(6, 75, 4))


def _hf(name: str) -> dict:
  return json.loads(HF_CONFIGS[name].read_text())


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_from_hf_round_trips(name):
  c = ModelConfig.from_hf(HF_CONFIGS[name])
  assert ModelConfig.from_hf(c.to_hf_dict()) == c
  hf = _hf(name)
  out = c.to_hf_dict()
  for key in ("hidden_size", "num_hidden_layers", "indexer_types", "mlp_layer_types",
              "rope_parameters", "head_dim", "qk_head_dim", "eos_token_id", "pad_token_id",
              "model_type"):
    assert out[key] == hf[key], key
  assert len(out["layer_types"]) == c.num_hidden_layers


@pytest.mark.parametrize("mtp", [0, 1, 2])
def test_to_hf_dict_mtp_and_rank_fields(mtp):
  c = dataclasses.replace(get_model_config("tiny"), num_nextn_predict_layers=mtp)
  out = c.to_hf_dict()
  assert out.get("num_nextn_predict_layers", 0) == mtp
  assert "rank_local_experts" not in out and "rank_shared_intermediate" not in out
  assert out["architectures"] == ["GlmMoeDsaForCausalLM"]
  assert ModelConfig.from_hf(out) == c
  rank = get_model_config("tep8_shard")
  assert ModelConfig.from_hf(rank.to_hf_dict()) == rank


def test_from_hf_accepts_directory_file_and_dict():
  from_dir = ModelConfig.from_hf(FIXTURE_DIR)
  assert from_dir == ModelConfig.from_hf(str(HF_CONFIGS["fixture"]))
  assert from_dir == ModelConfig.from_hf(_hf("fixture"))


def test_defaults_are_transformers_glm5():
  assert ModelConfig() == ModelConfig.from_hf(HF_CONFIGS["glm5"])


def test_glm5_2_index_share():
  c = ModelConfig.from_hf(HF_CONFIGS["glm5_2"])
  assert c.full_indexer_layers == GLM5_2_FULL
  assert len(c.full_indexer_layers) == 21
  assert derive_indexer_types(78, freq=4, offset=3) == tuple(_hf("glm5_2")["indexer_types"])
  derived = _hf("glm5_2")
  del derived["indexer_types"]  # Falls back to index_topk_freq / index_skip_topk_offset.
  assert ModelConfig.from_hf(derived) == c
  assert get_model_config("glm5_2").indexer_types == c.indexer_types
  assert c.topk_source_layers[3:7] == (2, 2, 2, 6)
  assert c.topk_source_layers[-1] == 74


@pytest.mark.parametrize("freq, offset, full", [
  (1, 2, tuple(range(8))), (0, 2, tuple(range(8))), (2, 2, (0, 1, 3, 5, 7)), (4, 3, (0, 1, 2, 6)),
])
def test_derive_from_freq_offset(freq, offset, full):
  types = derive_indexer_types(8, freq=freq, offset=offset)
  assert tuple(i for i, t in enumerate(types) if t == "full") == full


@pytest.mark.parametrize("pattern", ["FFSF", ["full", "full", "shared", "full"]])
def test_index_topk_pattern(pattern):
  assert derive_indexer_types(4, pattern=pattern) == ("full", "full", "shared", "full")
  hf = _hf("fixture")
  del hf["indexer_types"]
  hf["index_topk_pattern"] = pattern
  hf["index_topk_freq"] = 4  # The pattern wins over freq / offset.
  assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(HF_CONFIGS["fixture"])


def test_bad_pattern_character():
  with pytest.raises(ValueError, match="index_topk_pattern"):
    derive_indexer_types(4, pattern="FFXF")


@pytest.mark.parametrize("key, value", [
  ("model_type", "deepseek_v32"),
  ("rope_parameters", {"rope_theta": 1e6, "rope_type": "yarn"}),
  ("scoring_func", "softmax"),
  ("rope_interleave", False),
])
def test_from_hf_refuses(key, value):
  hf = _hf("fixture") | {key: value}
  with pytest.raises(ValueError, match=key):
    ModelConfig.from_hf(hf)


def test_from_hf_legacy_rope_theta_and_eos_list():
  hf = _hf("fixture")
  del hf["rope_parameters"]
  hf |= {"rope_theta": 5e5, "rope_scaling": None, "eos_token_id": [1, 2], "pad_token_id": 3,
         "num_nextn_predict_layers": 1}
  c = ModelConfig.from_hf(hf)
  assert c.rope_theta == 5e5
  assert c.eos_token_id == (1, 2) and c.eos_token_ids == (1, 2)
  assert c.num_nextn_predict_layers == 1


BAD_CASES = [
  ("hidden_size", {"hidden_size": 0}),
  ("vocab_size", {"vocab_size": -1}),
  ("q_lora_rank", {"q_lora_rank": 0}),
  ("num_key_value_heads", {"num_key_value_heads": 3}),
  ("mlp_layer_types", {"mlp_layer_types": ("dense", "sparse", "sparse")}),
  ("indexer_types", {"indexer_types": ("full",) * 5}),
  ("mlp_layer_types", {"mlp_layer_types": ("dense", "moe", "sparse", "sparse")}),
  ("indexer_types", {"indexer_types": ("full", "skip", "full", "full")}),
  ("indexer_types", {"indexer_types": ("shared", "full", "full", "full")}),
  ("index_topk", {"index_topk": 0}),
  ("num_experts_per_tok", {"num_experts_per_tok": 9}),
  ("n_group", {"n_group": 3}),
  ("topk_group", {"n_group": 2, "topk_group": 3}),
  ("num_experts_per_tok", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}),
  ("rank_local_experts", {"rank_local_experts": 3}),
  ("rank_local_experts", {"rank_local_experts": -1}),
  ("rank_shared_intermediate", {"rank_shared_intermediate": -1}),
  ("rank_shared_intermediate", {"rank_shared_intermediate": 3}),
  ("qk_rope_head_dim", {"qk_rope_head_dim": 15}),
  ("index_head_dim", {"index_head_dim": 8}),
  ("hidden_act", {"hidden_act": "gelu"}),
  ("bos_token_id", {"bos_token_id": 512}),
  ("eos_token_id", {"eos_token_id": (1, 600)}),
  ("pad_token_id", {"pad_token_id": -1}),
  ("rms_norm_eps", {"rms_norm_eps": 0.0}),
  ("num_nextn_predict_layers", {"num_nextn_predict_layers": -1}),
  ("attention_bias", {"attention_bias": True}),
]


@pytest.mark.parametrize("field, changes", BAD_CASES, ids=[f"{f}-{i}" for i, (f, _) in
                                                           enumerate(BAD_CASES)])
def test_validation_names_field(field, changes):
  with pytest.raises(ValueError, match=rf"ModelConfig\.{re.escape(field)}:"):
    dataclasses.replace(get_model_config("tiny"), **changes)


def test_hashable_and_lists_become_tuples():
  tiny = get_model_config("tiny")
  c = dataclasses.replace(tiny, indexer_types=["full", "full", "shared", "full"],
                          mlp_layer_types=list(tiny.mlp_layer_types), eos_token_id=[1, 2])
  assert isinstance(c.indexer_types, tuple) and isinstance(c.eos_token_id, tuple)
  assert hash(c) == hash(dataclasses.replace(tiny, eos_token_id=(1, 2)))
  assert {c: 1}[dataclasses.replace(c)] == 1


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_presets_construct(name):
  c = get_model_config(name)
  assert isinstance(c, ModelConfig)
  assert c.num_nextn_predict_layers == 1
  assert ModelConfig.from_hf(c.to_hf_dict()) == c


def test_unknown_preset_lists_names():
  with pytest.raises(ValueError, match="glm5_2"):
    get_model_config("glm6")


def test_tiny_matches_fixture():
  fixture = ModelConfig.from_hf(HF_CONFIGS["fixture"])
  assert get_model_config("tiny") == dataclasses.replace(fixture, num_nextn_predict_layers=1,
                                                         num_attention_heads=8, num_key_value_heads=8)


def test_glm5_preset():
  c = get_model_config("glm5")
  assert c.rope_theta == 1e6
  assert len(c.full_indexer_layers) == 78
  assert c.qk_head_dim == 256 and c.softmax_scale == 256 ** -0.5
  assert c.dense_layers == (0, 1, 2) and c.moe_layers == tuple(range(3, 78))
  assert c.num_local_experts == 256


def test_glm5_2_preset():
  c = get_model_config("glm5_2")
  assert (c.rope_theta, c.max_position_embeddings) == (8e6, 1_048_576)
  assert c.full_indexer_layers == GLM5_2_FULL


def test_mini_has_every_feature():
  c = get_model_config("mini")
  assert 0 < len(c.full_indexer_layers) < c.num_hidden_layers
  assert c.dense_layers and c.moe_layers
  assert c.n_group > 1 and c.topk_group < c.n_group
  assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (256, (257,), 258)
  assert c.vocab_size == 260


def test_tep8_shard_holds_one_device_of_the_tep8_layout():
  """Every parameter of the tep8_shard preset has the shape GLM-5's has on one device of the TEP=8
  layout (glmjax.parallel.rules: split dims divided by 8; routed experts by expert parallelism).
  Their first 4 layers (the 3 dense ones and an MoE one) and the MTP layer: every kind of layer,
  traced in 0.8 s where the whole model took 13."""
  import flax.linen as nn
  import jax
  from jax.sharding import AbstractMesh
  from experiments.step_timing import with_layers
  from glmjax.model import abstract_params
  from glmjax.parallel import rules
  mesh = AbstractMesh((8,), (rules.TEP,))
  shapes = lambda config, shape: {
      jax.tree_util.keystr(path): shape(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
          abstract_params(with_layers(get_model_config(config), 4, mtp=True)),
          is_leaf=lambda x: isinstance(x, nn.Partitioned))}
  one_device = lambda path, leaf: tuple(size // (8 if axis else 1) for size, axis in zip(
      leaf.value.shape, rules.mesh_spec(leaf.names, leaf.value.shape, mesh, param=jax.tree_util.keystr(path))))
  expected, held = shapes("glm5", one_device), shapes("tep8_shard", lambda _, leaf: leaf.value.shape)
  assert set(held) == set(expected)
  differ = {path: (expected[path], held[path]) for path in expected if expected[path] != held[path]}
  assert not differ, list(differ.items())[:5]
  c = get_model_config("tep8_shard")
  assert (c.index_n_heads, c.shared_intermediate, c.intermediate_size, c.num_local_experts) == (32, 256, 1536, 32)


def test_a_rank_config_is_not_a_mesh_config():
  from jax.sharding import AbstractMesh
  from glmjax.parallel import rules
  with pytest.raises(ValueError, match="rank_local_experts=32"):
    rules.check_config(get_model_config("tep8_shard"), AbstractMesh((8,), (rules.TEP,)))
  rank = dataclasses.replace(get_model_config("tiny"), rank_shared_intermediate=8)
  with pytest.raises(ValueError, match="rank_shared_intermediate=8"):
    rules.check_config(rank, AbstractMesh((2,), (rules.TEP,)))


@pytest.mark.parametrize("field,value", [("attention", "flash"), ("matmul", "cublas"), ("dense_matmul", "cublas"),
                                         ("cache_write", "numpy"), ("moe_routing", "sort"), ("router", "sort"),
                                         ("value_merge", "atomic"), ("query_absorb", "triton"),
                                         ("indexer_keys", "cuda"), ("mla_epilogue", "fused"), ("index_epilogue", "on"),
                                         ("index_query", "fused"), ("residual_norm", "fused"), ("swiglu", "fused"),
                                         ("moe_sum", "on"), ("next_norm", "fused"), ("route_planes", "on"),
                                         ("shared_swiglu", "fused"), ("shared_down", "on"),
                                         ("topk_ties", "random"),
                                         ("topk_method", "sort"), ("topk_sample", "sorted"),
                                         ("indexer_orientation", "rows"),
                                         ("indexer_queries", "float16"), ("attention_queries", "int8"),
                                         ("tensor_parallel", "pjit")])
def test_runtime_rejects_unknown_switches(field, value):
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match=field):
    Runtime(**{field: value})


@pytest.mark.parametrize("field,bad,message,good", [("indexer_splits", 3, "a power of two <= 1024", 1024),
                                                     ("indexer_splits", 2048, "a power of two <= 1024", 1),
                                                     ("indexer_splits", -4, "a power of two <= 1024", 256),
                                                     ("indexer_block_k", 48, "a power of two >= 16", 16),
                                                     ("indexer_block_k", 8, "a power of two >= 16", 256),
                                                     ("indexer_warps", 3, "1, 2, 4, 8 or 16", 8),
                                                     ("indexer_stages", -1, ">= 1", 3)])
def test_runtime_indexer_scores_fields_name_their_bad_value(field, bad, message, good):
  """The scores kernel's tuning fields reach IndexerScoresConfig (0: its default) and a bad
  value is an error naming the Runtime field and the rule."""
  from glmjax.runtime import Runtime
  from pallas_kernels.indexer_scores import IndexerScoresConfig
  with pytest.raises(ValueError, match=f"{field} must be 0 .*{message}, got {bad}"):
    Runtime(**{field: bad})
  name = {"indexer_splits": "num_splits", "indexer_block_k": "block_k", "indexer_warps": "num_warps",
          "indexer_stages": "num_stages"}[field]
  config = Runtime(**{field: good}, indexer_orientation="heads").indexer_scores_config()
  assert config == IndexerScoresConfig(**{name: good}, orientation="heads")
  assert Runtime().indexer_scores_config() == IndexerScoresConfig()
  assert Runtime(indexer_prefetch=True).indexer_scores_config() == IndexerScoresConfig(prefetch=True)


def test_runtime_topk_trials_reach_the_topk_config():
  """topk_trials (0: the kernel's default), topk_method, topk_sample and topk_one_launch make the
  TopKConfig the attention reads; a bad trial count is an error naming the field."""
  from glmjax.runtime import Runtime
  from pallas_kernels.topk import TopKConfig
  with pytest.raises(ValueError, match="topk_trials must be 0 .*threshold_trials must be a power of two >= 1, got 3"):
    Runtime(topk_trials=3)
  assert Runtime().topk_config() == TopKConfig()
  assert Runtime(topk_trials=1, topk_method="radix").topk_config() == TopKConfig(threshold_trials=1, method="radix")
  assert Runtime(topk_sample="row").topk_config() == TopKConfig(sample_source="row")
  assert Runtime(topk_one_launch=True).topk_config() == TopKConfig(one_launch=True)


@pytest.mark.parametrize("bad", [0, -1, "fewest", 2.0, True])
def test_runtime_fold_splits_is_a_rule_or_a_cap(bad):
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match=r"fold_splits must be one of \('fill', 'rule'\) or a split count >= 1, got"):
    Runtime(fold_splits=bad)
  assert [Runtime(**kw).fold_splits
          for kw in ({}, dict(fold_splits="rule"), dict(fold_splits=3))] == ["fill", "rule", 3]


def test_runtime_expert_routings_need_their_matmuls():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match=r"moe_routing='pairs'.*matmul in \('pallas_hfma2', 'pallas_fragments'\)"):
    Runtime(matmul="pallas_ptx_f16", moe_routing="pairs")
  with pytest.raises(ValueError, match="moe_routing='pairs_fused'.*matmul in .'pallas_hfma2'"):
    Runtime(matmul="pallas", moe_routing="pairs_fused")
  assert Runtime(matmul="pallas_hfma2", moe_routing="pairs").moe_routing == "pairs"
  assert Runtime(matmul="pallas_fragments", moe_routing="pairs_fused").moe_routing == "pairs_fused"
  with pytest.raises(ValueError, match="moe_routing='fragments' runs the experts on the fragment GEMV: it needs "
                     "matmul='pallas_fragments', got 'pallas_hfma2'"):
    Runtime(matmul="pallas_hfma2", moe_routing="fragments")
  assert Runtime(matmul="pallas_fragments", moe_routing="fragments").moe_routing == "fragments"


def test_runtime_route_planes_needs_the_pallas_router_and_fused_pairs():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="route_planes='pallas'.*got router='xla', moe_routing='pairs_fused'"):
    Runtime(route_planes="pallas", moe_routing="pairs_fused", matmul="pallas_hfma2")
  with pytest.raises(ValueError, match="route_planes='pallas'.*got router='pallas', moe_routing='pairs'"):
    Runtime(route_planes="pallas", router="pallas", moe_routing="pairs", matmul="pallas_hfma2")
  assert Runtime(route_planes="pallas", router="pallas", moe_routing="pairs_fused",
                 matmul="pallas_hfma2").route_planes == "pallas"


def test_runtime_shared_swiglu_needs_the_routers_planes_launch():
  from glmjax.runtime import Runtime
  folds = dict(router="pallas", dense_matmul="pallas_grouped", moe_routing="pairs_fused", matmul="pallas_hfma2")
  with pytest.raises(ValueError, match="shared_swiglu='pallas'.*got route_planes='xla', router_group='pallas'"):
    Runtime(shared_swiglu="pallas", router_group="pallas", **folds)
  with pytest.raises(ValueError, match="shared_swiglu='pallas'.*router_group='pallas', swiglu='pallas'"):
    Runtime(shared_swiglu="pallas", route_planes="pallas", router_group="pallas", swiglu="pallas", **folds)
  assert Runtime(shared_swiglu="pallas", route_planes="pallas", router_group="pallas",
                 **folds).shared_swiglu == "pallas"


def test_runtime_shared_down_needs_the_shared_hidden_from_the_routers_launch():
  from glmjax.runtime import Runtime
  folds = dict(router="pallas", dense_matmul="pallas_grouped", moe_routing="pairs_fused", matmul="pallas_hfma2",
               route_planes="pallas", router_group="pallas")
  with pytest.raises(ValueError, match="shared_down='pallas'.*needs shared_swiglu='pallas', got 'xla'"):
    Runtime(shared_down="pallas", **folds)
  assert Runtime(shared_down="pallas", shared_swiglu="pallas", **folds).shared_down == "pallas"


def test_runtime_pairs_wide_words_needs_the_pairs():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="pairs_wide_words is the pairs kernels' layout hint.*got 'table'"):
    Runtime(pairs_wide_words=True)
  assert Runtime(pairs_wide_words=True, moe_routing="pairs", matmul="pallas_hfma2").pairs_wide_words


def test_runtime_closes_a_layer_in_one_fold_only():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="next_norm='pallas' and moe_sum='pallas' both close an MoE layer"):
    Runtime(swiglu="pallas", moe_sum="pallas", next_norm="pallas")
  assert Runtime(swiglu="pallas", next_norm="pallas").next_norm == "pallas"


def test_runtime_moe_sum_needs_the_swiglu_launch():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="moe_sum='pallas'.*needs swiglu='pallas', got 'xla'"):
    Runtime(moe_sum="pallas")
  assert Runtime(swiglu="pallas", moe_sum="pallas").moe_sum == "pallas"


def test_runtime_index_epilogue_needs_both_epilogue_kernels():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="index_epilogue='pallas'.*mla_epilogue='xla', indexer_keys='pallas'"):
    Runtime(indexer_keys="pallas", index_epilogue="pallas")
  with pytest.raises(ValueError, match="index_epilogue='pallas'.*mla_epilogue='pallas', indexer_keys='xla'"):
    Runtime(mla_epilogue="pallas", index_epilogue="pallas")
  assert Runtime(mla_epilogue="pallas", indexer_keys="pallas", index_epilogue="pallas").index_epilogue == "pallas"


def test_runtime_router_group_needs_the_route_kernel_and_grouped_gemvs():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="router_group='pallas'.*got router='xla', dense_matmul='pallas_grouped'"):
    Runtime(router_group="pallas", dense_matmul="pallas_grouped")
  with pytest.raises(ValueError, match="router_group='pallas'.*got router='pallas', dense_matmul='pallas'"):
    Runtime(router_group="pallas", router="pallas", dense_matmul="pallas")
  assert Runtime(router_group="pallas", router="pallas", dense_matmul="pallas_grouped").router_group == "pallas"


def test_runtime_epilogue_write_needs_the_write_and_both_epilogue_kernels():
  from glmjax.runtime import Runtime
  joined = dict(mla_epilogue="pallas", indexer_keys="pallas", index_epilogue="pallas")
  with pytest.raises(ValueError, match=r"epilogue_write='pallas'.*got \('xla', 'pallas', 'pallas'\)"):
    Runtime(epilogue_write="pallas", **joined)
  with pytest.raises(ValueError, match=r"epilogue_write='pallas'.*got \('pallas', 'pallas', 'xla'\)"):
    Runtime(epilogue_write="pallas", cache_write="pallas", mla_epilogue="pallas")
  assert Runtime(epilogue_write="pallas", cache_write="pallas", **joined).epilogue_write == "pallas"


def test_runtime_index_query_needs_the_absorbed_query_kernel():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="index_query='pallas'.*query_absorb='pallas', got 'xla'"):
    Runtime(index_query="pallas")
  assert Runtime(query_absorb="pallas", index_query="pallas").index_query == "pallas"


def test_runtime_value_merge_needs_the_pallas_attention():
  from glmjax.runtime import Runtime
  with pytest.raises(ValueError, match="value_merge='pallas'.*attention='pallas'"):
    Runtime(attention="sparse", value_merge="pallas")
  assert Runtime(attention="pallas", value_merge="pallas").value_merge == "pallas"


def test_kernel_modules_import_before_glmjax():
  """A kernel module imported first (pallas_kernels.topk and indexer_topk read glmjax, whose
  Runtime reads their tuning at import) does not meet a half-initialised module."""
  import subprocess
  import sys
  for module in ("topk", "indexer_topk", "indexer_scores", "sparse_mla"):
    done = subprocess.run([sys.executable, "-c", f"from pallas_kernels import {module}"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
