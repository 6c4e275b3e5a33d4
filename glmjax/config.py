"""Architecture config of a `glm_moe_dsa` model (GLM-5, GLM-5.2), with HF config.json conversion.

Field names are exactly those of transformers' `GlmMoeDsaConfig`, and the defaults are its defaults
(GLM-5). The config is frozen and hashable because model code takes it as a static jit argument.
"""

import dataclasses
import json
import os
from typing import Any, Sequence

MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")

# HF keys whose value the model code assumes; a config.json giving another value is refused.
_ASSUMED_HF_VALUES = {
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
  "rope_interleave": True,
  "moe_layer_freq": 1,
}


def derive_indexer_types(num_layers: int, *, pattern: str | Sequence[str] | None = None,
                         freq: int = 1, offset: int = 2) -> tuple[str, ...]:
  """Per-layer IndexShare schedule, derived as transformers' GlmMoeDsaConfig does.

  `pattern` ("FSSF..." or a list of "full"/"shared") wins; otherwise layer i is "full" iff
  `max(i - offset + 1, 0) % freq == 0` (freq clamped to >= 1), so freq 1 makes every layer full.
  """
  if pattern is not None:
    if not isinstance(pattern, str):
      return tuple(pattern)
    codes = {"F": "full", "S": "shared"}
    bad = sorted(set(pattern) - set(codes))
    if bad:
      raise ValueError(f"index_topk_pattern: characters must be F or S, got {bad}")
    return tuple(codes[c] for c in pattern)
  freq = max(freq, 1)
  return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
               for i in range(num_layers))


def _check(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ValueError(f"ModelConfig.{field}: {message}")


# glmjax-only fields that make a config one TEP rank's shard (not HF keys; config.json keeps
# them so a rank's config round-trips).
RANK_FIELDS = ("rank_local_experts", "rank_shared_intermediate")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """GLM-MoE-DSA architecture: MLA attention with a DSA indexer, dense then MoE MLPs, MTP layers.

  `indexer_types` / `mlp_layer_types` left as None are derived (all full; first
  `first_k_dense_replace` dense). When `dataclasses.replace` changes `num_hidden_layers`, pass
  both lists (or None) too.
  """
  vocab_size: int = 154880
  hidden_size: int = 6144
  intermediate_size: int = 12288
  moe_intermediate_size: int = 2048
  num_hidden_layers: int = 78
  num_attention_heads: int = 64
  num_key_value_heads: int = 64
  n_shared_experts: int = 1
  n_routed_experts: int = 256
  routed_scaling_factor: float = 2.5
  kv_lora_rank: int = 512
  q_lora_rank: int = 2048
  qk_rope_head_dim: int = 64
  v_head_dim: int = 256
  qk_nope_head_dim: int = 192
  n_group: int = 1
  topk_group: int = 1
  num_experts_per_tok: int = 8
  norm_topk_prob: bool = True
  hidden_act: str = "silu"
  max_position_embeddings: int = 202752
  initializer_range: float = 0.02
  rms_norm_eps: float = 1e-5
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 1
  pad_token_id: int | None = None
  tie_word_embeddings: bool = False
  # transformers' default; the released GLM-5 checkpoint uses 1e6 (see configs/glm5.py).
  rope_theta: float = 10000.0
  attention_bias: bool = False
  mlp_bias: bool = False
  index_topk: int = 2048
  index_head_dim: int = 128
  index_n_heads: int = 32
  first_k_dense_replace: int = 3
  mlp_layer_types: tuple[str, ...] | None = None
  indexer_types: tuple[str, ...] | None = None
  num_nextn_predict_layers: int = 0
  # glmjax only: routed experts one tensor/expert-parallel rank holds (0 = all). Routing still
  # scores all n_routed_experts.
  rank_local_experts: int = 0
  # glmjax only: the shared experts' intermediate one rank holds (0 = all of moe_intermediate_size *
  # n_shared_experts). TEP splits it over the ranks (glmjax/parallel/expert_parallel.py).
  rank_shared_intermediate: int = 0

  def __post_init__(self):
    layers = self.num_hidden_layers
    _check(isinstance(layers, int) and layers > 0, "num_hidden_layers",
           f"must be a positive int, got {layers!r}")
    mlp_types = self.mlp_layer_types
    if mlp_types is None:
      dense = min(self.first_k_dense_replace, layers)
      mlp_types = ("dense",) * dense + ("sparse",) * (layers - dense)
    indexer_types = self.indexer_types
    if indexer_types is None:
      indexer_types = derive_indexer_types(layers)
    eos = self.eos_token_id
    if isinstance(eos, (list, tuple)):
      eos = tuple(eos)
    # Frozen: normalise lists to tuples in place so the config stays hashable.
    object.__setattr__(self, "mlp_layer_types", tuple(mlp_types))
    object.__setattr__(self, "indexer_types", tuple(indexer_types))
    object.__setattr__(self, "eos_token_id", eos)
    self._validate()

  def _validate(self) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "n_routed_experts",
                 "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                 "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
                 "max_position_embeddings", "index_topk", "index_head_dim", "index_n_heads"):
      value = getattr(self, name)
      _check(isinstance(value, int) and value > 0, name, f"must be a positive int, got {value!r}")
    for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", *RANK_FIELDS):
      value = getattr(self, name)
      _check(isinstance(value, int) and value >= 0, name,
             f"must be a non-negative int, got {value!r}")
    for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
      _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
    _check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
           f"{self.num_key_value_heads} does not divide num_attention_heads "
           f"{self.num_attention_heads}")
    _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
           f"RoPE rotates pairs, so it must be even, got {self.qk_rope_head_dim}")
    _check(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
           f"{self.index_head_dim} is smaller than its RoPE part qk_rope_head_dim "
           f"{self.qk_rope_head_dim}")
    _check(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got "
           f"{self.hidden_act!r}")
    _check(not self.attention_bias, "attention_bias", "biased attention projections are not "
           "supported (GLM-5 has none)")
    _check(not self.mlp_bias, "mlp_bias", "biased MLP projections are not supported (GLM-5 has "
           "none)")

    layers = self.num_hidden_layers
    for name, allowed in (("mlp_layer_types", MLP_LAYER_TYPES),
                          ("indexer_types", INDEXER_TYPES)):
      types = getattr(self, name)
      _check(len(types) == layers, name,
             f"has {len(types)} entries for num_hidden_layers {layers}")
      bad = sorted(set(types) - set(allowed))
      _check(not bad, name, f"entries must be in {allowed}, got {bad}")
    _check(self.indexer_types[0] == "full", "indexer_types",
           "layer 0 must be 'full': a 'shared' layer reuses the top-k of an earlier full layer")

    experts, groups = self.n_routed_experts, self.n_group
    _check(self.num_experts_per_tok <= experts, "num_experts_per_tok",
           f"{self.num_experts_per_tok} exceeds n_routed_experts {experts}")
    _check(experts % groups == 0, "n_group",
           f"{groups} does not divide n_routed_experts {experts}")
    _check(self.topk_group <= groups, "topk_group", f"{self.topk_group} exceeds n_group {groups}")
    selectable = self.topk_group * (experts // groups)
    _check(self.num_experts_per_tok <= selectable, "num_experts_per_tok",
           f"{self.num_experts_per_tok} exceeds the {selectable} experts of topk_group "
           f"{self.topk_group} groups")
    _check(self.rank_local_experts == 0 or experts % self.rank_local_experts == 0,
           "rank_local_experts",
           f"{self.rank_local_experts} does not divide n_routed_experts {experts}")
    shared = self.moe_intermediate_size * self.n_shared_experts
    _check(self.rank_shared_intermediate == 0 or (shared and shared % self.rank_shared_intermediate == 0),
           "rank_shared_intermediate",
           f"{self.rank_shared_intermediate} does not divide the shared experts' intermediate {shared}")

    for name in ("bos_token_id", "pad_token_id"):
      token = getattr(self, name)
      _check(token is None or 0 <= token < self.vocab_size, name,
             f"{token} is outside the vocabulary [0, {self.vocab_size})")
    bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
    _check(not bad_eos, "eos_token_id",
           f"{bad_eos} outside the vocabulary [0, {self.vocab_size})")

  @property
  def qk_head_dim(self) -> int:
    """Per-head query/key width: [nope | rope]."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """MLA attention scale (nope + rope)^-0.5 (no YaRN correction)."""
    return self.qk_head_dim ** -0.5

  @property
  def full_indexer_layers(self) -> tuple[int, ...]:
    """Layers that run (and ship weights for) their own DSA indexer."""
    return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

  @property
  def topk_source_layers(self) -> tuple[int, ...]:
    """For each layer, the full-indexer layer whose top-k it uses (itself when full)."""
    sources, last = [], 0
    for i, t in enumerate(self.indexer_types):
      last = i if t == "full" else last
      sources.append(last)
    return tuple(sources)

  @property
  def dense_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")

  @property
  def num_local_experts(self) -> int:
    """Routed experts held locally: rank_local_experts, or all when it is 0."""
    return self.rank_local_experts or self.n_routed_experts

  @property
  def shared_intermediate(self) -> int:
    """The shared experts' intermediate held locally: rank_shared_intermediate, or all of it."""
    return self.rank_shared_intermediate or self.moe_intermediate_size * self.n_shared_experts

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    eos = self.eos_token_id
    if eos is None:
      return ()
    return eos if isinstance(eos, tuple) else (eos,)

  @classmethod
  def from_hf(cls, source: str | os.PathLike | dict[str, Any]) -> "ModelConfig":
    """Reads an HF `glm_moe_dsa` config: a dict, a json file, or a directory with config.json.

    Keys that do not change the architecture (architectures, dtype, use_cache, layer_types,
    head_dim, ...) are ignored.
    """
    if isinstance(source, dict):
      hf = source
    else:
      path = os.fspath(source)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") != "glm_moe_dsa":
      raise ValueError(f"model_type: expected 'glm_moe_dsa', got {hf.get('model_type')!r}")
    for key, value in _ASSUMED_HF_VALUES.items():
      if key in hf and hf[key] != value:
        raise ValueError(f"{key}: glmjax assumes {value!r}, got {hf[key]!r}")

    derived = {"rope_theta", "indexer_types", "mlp_layer_types"}
    kwargs = {f.name: hf[f.name] for f in dataclasses.fields(cls)
              if f.name in hf and f.name not in derived}
    kwargs["rope_theta"] = _rope_theta(hf)
    kwargs["mlp_layer_types"] = hf.get("mlp_layer_types")
    layers = hf.get("num_hidden_layers", cls.num_hidden_layers)
    indexer_types = hf.get("indexer_types")
    if indexer_types is None:
      indexer_types = derive_indexer_types(
        layers, pattern=hf.get("index_topk_pattern"),
        freq=hf.get("index_topk_freq") or 1,
        offset=2 if hf.get("index_skip_topk_offset") is None else hf["index_skip_topk_offset"])
    kwargs["indexer_types"] = indexer_types
    return cls(**kwargs)

  def to_hf_dict(self) -> dict[str, Any]:
    """config.json contents that transformers' GlmMoeDsaConfig accepts; `from_hf` inverts it."""
    hf: dict[str, Any] = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
    for f in dataclasses.fields(self):
      if f.name not in ("rope_theta", "num_nextn_predict_layers", *RANK_FIELDS):
        value = getattr(self, f.name)
        hf[f.name] = list(value) if isinstance(value, tuple) else value
    hf["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
    hf["layer_types"] = ["indexed_attention"] * self.num_hidden_layers
    hf["head_dim"] = self.qk_rope_head_dim
    hf["qk_head_dim"] = self.qk_head_dim
    if self.num_nextn_predict_layers:
      hf["num_nextn_predict_layers"] = self.num_nextn_predict_layers
    hf.update({name: getattr(self, name) for name in RANK_FIELDS if getattr(self, name)})
    return hf


def _rope_theta(hf: dict[str, Any]) -> float:
  """RoPE base from `rope_parameters` (or the older top-level `rope_theta`); only plain RoPE."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"rope_parameters.rope_type: only 'default' RoPE is supported, got "
                     f"{rope_type!r}")
  theta = params.get("rope_theta", hf.get("rope_theta", ModelConfig.rope_theta))
  return float(theta)
