"""TEP=N sharding with JAX's own machinery: a one-axis mesh, one rules table from the params'
logical axes to it, explicit shard_maps for each decoder layer's parts (attention by heads and
the dense MLP by its intermediate, tensor_parallel.py; the MoE by experts, expert_parallel.py),
and GSPMD for the rest (embedding, lm_head, sampling).

    mesh = parallel.make_mesh(8)
    params = parallel.shard_params(config, params, mesh)
    with parallel.use_mesh(mesh):                       # traced under the mesh: the layers' shard_maps
      logits = glmjax.forward(config, params, ids)
      ... steps.prefill_chunk / decode_loop with parallel.shard_cache(cache, mesh) ...

or load straight into the layout: `load_pretrained(path, shardings=parallel.shardings_fn(config, mesh))`
(each device reads only its slice).
"""

import jax

from glmjax.cache.paged import KVCache
from glmjax.config import ModelConfig
from glmjax.model import abstract_params
from glmjax.parallel.mesh import (TEP, abstract_mesh, active_mesh, initialize_distributed, make_mesh,
                                  use_mesh)
from glmjax.parallel.rules import (RULES, cache_shardings, check_config, param_shardings, quantized_shardings,
                                   shardings_fn)
from glmjax.quant import QuantizedWeight

__all__ = ["RULES", "TEP", "abstract_mesh", "active_mesh", "cache_shardings", "check_config",
           "initialize_distributed", "make_mesh", "param_shardings", "quantized_shardings", "shard_cache",
           "shard_params", "shardings_fn", "use_mesh"]


def shard_params(config: ModelConfig, params, mesh: jax.sharding.Mesh):
  """Place params (unboxed arrays of `config`, quantized leaves among them) in the TEP layout of
  the rules table. Params in host memory of one process; across hosts, load with `shardings_fn`
  instead."""
  check_config(config, mesh)
  shardings = jax.tree.map(lambda s, leaf: quantized_shardings(s, leaf) if isinstance(leaf, QuantizedWeight) else s,
                           param_shardings(abstract_params(config), mesh), params,
                           is_leaf=lambda x: isinstance(x, QuantizedWeight))
  return jax.device_put(params, shardings)


def shard_cache(cache: KVCache, mesh: jax.sharding.Mesh) -> KVCache:
  """Place a KVCache on the mesh (replicated, see rules.cache_shardings)."""
  return jax.device_put(cache, cache_shardings(cache, mesh))
