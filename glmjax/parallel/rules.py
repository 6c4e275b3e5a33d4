"""The one table from logical axis names (on every param, `nn.with_logical_partitioning`) to the
mesh, and the shardings it gives params, caches and checkpoint loading.

TEP layout (SGLang's TP8 + EP8 for GLM-5), all over the single "tep" axis of N devices:
- attention heads: q_b_proj and kv_b_proj rows, o_proj columns (row-parallel: all-reduce after);
- routed experts: E/N whole experts per device (glmjax.parallel.expert_parallel);
- MLP intermediates: dense MLPs and the shared expert (gate/up rows, down columns: all-reduce after);
- vocabulary: embedding rows and lm_head rows (logits come out split over the vocabulary).
Replicated: the q/kv latent projections and norms, the router (every device scores all experts),
and the DSA indexer. SGLang and vLLM replicate the indexer too: its score sums over heads before a
top-k, so split heads would need an extra all-reduce of [tokens, context] scores per layer.
Splitting an expert's own intermediate ("expert_mlp") would clash with "experts" on one axis.
"""

from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from glmjax.cache.paged import KVCache
from glmjax.checkpoint import ShardingFn
from glmjax.config import RANK_FIELDS, ModelConfig
from glmjax.model import abstract_params
from glmjax.quant import FragmentWeight, QuantizedWeight
from glmjax.quant.leaf import field_spec
from glmjax.parallel.mesh import TEP

RULES: dict[str, str | None] = {
  "heads": TEP,
  "experts": TEP,
  "mlp": TEP,
  "vocab": TEP,
  "index_heads": None,
  "expert_mlp": None,
  "embed": None,
  "q_lora": None,
}


def mesh_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, *,
              param: str) -> PartitionSpec:
  """Logical axis names of one array -> its PartitionSpec on `mesh`.

  Raises ValueError naming `param` for an unknown logical name, two dims on one mesh axis, or a
  dim its mesh axis does not divide.
  """
  if len(names) != len(shape):
    raise ValueError(f"{param}: {len(names)} logical axis names {names} for shape {shape}")
  axes = []
  for name, size in zip(names, shape):
    if name is not None and name not in RULES:
      raise ValueError(f"{param}: logical axis {name!r} has no rule; known: {sorted(RULES)}")
    axis = None if name is None else RULES[name]
    if axis is not None and axis in axes:
      raise ValueError(f"{param}: logical axes {names} put two dims on mesh axis {axis!r}")
    if axis is not None and size % mesh.shape[axis]:
      raise ValueError(f"{param}: dim {name!r} of size {size} is not divisible by the {axis} "
                       f"degree {mesh.shape[axis]}")
    axes.append(axis)
  return PartitionSpec(*axes)


def _path(keypath) -> str:
  return jax.tree_util.keystr(keypath, simple=True, separator="/")


def param_shardings(abstract_params: Any, mesh: Mesh) -> Any:
  """A tree of NamedSharding, shaped as the unboxed params, from `abstract_params` (params or
  shapes boxed in nn.Partitioned, as `glmjax.model.abstract_params` returns them)."""
  def sharding(keypath, leaf):
    if not isinstance(leaf, nn.Partitioned):
      raise ValueError(f"{_path(keypath)}: param has no logical axis names (nn.Partitioned)")
    return NamedSharding(mesh, mesh_spec(leaf.names, leaf.value.shape, mesh, param=_path(keypath)))
  return jax.tree_util.tree_map_with_path(sharding, abstract_params,
                                          is_leaf=lambda x: isinstance(x, nn.Partitioned))


def quantized_specs(spec: PartitionSpec, leaf: QuantizedWeight, mesh_shape, *, local: bool = False,
                    param: str = "") -> QuantizedWeight:
  """A quantized leaf's PartitionSpecs, field by field, from its logical weight's `spec`
  (glmjax.quant.leaf.field_spec: a dim the mesh does not divide is replicated, which GSPMD keeps
  correct). local: for a shard_map, where each device dequantizes its own slice and reads a
  replicated block-scale dim from its start: a ValueError naming `param` unless that dim holds
  one block, or for a split FragmentWeight (its static shape is the whole weight's: split weights
  stay in ModelOpt's order, glmjax.quant.fragments.arrange_params)."""
  if local and isinstance(leaf, FragmentWeight) and any(axis is not None for axis in spec):
    raise ValueError(f"{param}: a FragmentWeight {leaf.shape} cannot be split over {spec} in a shard_map; keep "
                     "split weights in ModelOpt's order (Runtime.arrange does, for params already sharded)")
  def field(array: jax.Array) -> PartitionSpec:
    axes = field_spec(spec, leaf.ndim, array.shape, mesh_shape)
    wanted = field_spec(spec, leaf.ndim, array.shape, None)
    if local and any(a != w and n > 1 for a, w, n in zip(axes, wanted, array.shape)):
      raise ValueError(f"{param}: a {type(leaf).__name__} {array.shape} field does not split as its weight "
                       f"{leaf.shape} over {spec}: the devices' slices would straddle its blocks")
    return axes
  return jax.tree.map(field, leaf)


def quantized_shardings(sharding: NamedSharding, leaf: QuantizedWeight) -> QuantizedWeight:
  """`quantized_specs` as NamedShardings on the sharding's mesh (for device_put)."""
  specs = quantized_specs(sharding.spec, leaf, sharding.mesh.shape)
  return jax.tree.map(lambda spec: NamedSharding(sharding.mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def check_config(config: ModelConfig, mesh: Mesh | AbstractMesh) -> None:
  """Raise ValueError naming the config field whose count the TEP degree does not divide.

  Param shapes alone cannot tell: q_b_proj's rows are heads * head_dim, which 8 may divide when
  the head count (4) is not, and the heads would then straddle devices.
  """
  degree = mesh.shape[TEP]
  counts = {"num_attention_heads": (config.num_attention_heads, "attention heads"),
            "vocab_size": (config.vocab_size, "vocabulary rows")}
  if config.dense_layers:
    counts["intermediate_size"] = (config.intermediate_size, "dense MLP intermediate")
  if config.moe_layers or config.num_nextn_predict_layers:
    counts["n_routed_experts"] = (config.n_routed_experts, "routed experts")
    counts["moe_intermediate_size"] = (config.moe_intermediate_size * config.n_shared_experts,
                                       "shared-expert intermediate (times n_shared_experts)")
  for field, (count, what) in counts.items():
    if count % degree:
      raise ValueError(f"{field}: {count} {what} are not divisible by the TEP degree {degree} "
                       f"(they are split over mesh axis {TEP!r})")
  for field in RANK_FIELDS:
    if getattr(config, field):
      raise ValueError(f"{field}={getattr(config, field)}: a mesh holds the whole model and splits it; that "
                       "config is one rank's shard")


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
  """Replicated everywhere: the MLA latent (and the indexer key) is one head shared by all
  attention heads, so splitting heads does not split the pages; page tables and lengths are
  read by every device."""
  return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), cache)


def shardings_fn(config: ModelConfig, mesh: Mesh) -> ShardingFn:
  """`load_pretrained(path, shardings=...)` callback: (param path, shape) -> its NamedSharding."""
  check_config(config, mesh)
  table = {}
  for keypath, sharding in jax.tree_util.tree_flatten_with_path(
      param_shardings(abstract_params(config), mesh))[0]:
    table[tuple(_path(keypath).split("/"))] = sharding

  def fn(path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    if path not in table:
      raise ValueError(f"{'/'.join(path)}: not a param of this config")
    return table[path]
  return fn
