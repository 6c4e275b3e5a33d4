"""The MoE layer under expert parallelism: an explicit shard_map with one psum over "tep".

Layout over N devices: device r holds the routed experts [r E/N, (r+1) E/N) whole, and 1/N of
the shared expert's intermediate (gate/up rows, down columns). Tokens are replicated (a decode
step has few). Each device shifts the router's ids by r E/N, so ids of other devices' experts
fall outside [0, E/N) and add nothing (`glmjax.moe.experts_reference`), adds its slice of the
shared expert, and one psum sums the partials.

Collectives per decoder layer in decode: 2, each an all-reduce of [tokens, hidden] in the compute
dtype (tests/test_multidevice_sharding.py counts them in the compiled HLO):
  1. after attention: o_proj is row-parallel (its input columns are the local heads): the psum
     of tensor_parallel.attention.
  2. after the MLP: the psum below on MoE layers (routed and shared experts together),
     tensor_parallel.mlp's after the row-parallel down_proj on dense layers.
The norms, the q/kv latent projections, the router, the indexer and the MLA cache are replicated
and need none. Per step, outside the layers: the vocab-split embedding lookup (one all-reduce of
[tokens, hidden]) and the reductions of sampling over the vocab-split logits.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glmjax import quant
from glmjax.config import ModelConfig
from glmjax.layers import MLP
from glmjax.moe import expected_local_experts, shared_route
from glmjax.parallel.mesh import TEP
from glmjax.parallel.rules import check_config
from glmjax.parallel.tensor_parallel import MLP_SPECS, local_specs

# The shard_map's view of the params: whole experts per device, the shared expert split as a
# column- then row-parallel MLP (tensor_parallel.MLP_SPECS). rules.py gives the params the same
# layout, so entering the shard_map moves nothing.
EXPERT_SPEC = P(TEP)


def moe(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, shared: dict, *,
        config: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, matmul: str, dense: str,
        routing: str, mesh: jax.sharding.AbstractMesh, swiglu: str = "xla", router: dict | None = None,
        wide_words: bool = False) -> jax.Array:
  """Routed plus shared experts of tokens x [n, d] -> [n, d] in dtype, replicated.

  ids, weights [n, k]: the router's choice over all E experts (replicated). experts: the
  `Experts` params (gate/up [E, i, d], down [E, d, i]); shared: the shared expert's `MLP` params.
  matmul, dense: the quantized and plain-weight matmul impls (glmjax.quant.linear); routing:
  the grouped MoE kernels' (glmjax.quant.moe_experts); swiglu: the shared expert's fold (MLP).
  router: None, or the Router's params (replicated; ids and weights then None): each device
  chooses in its shared expert's gate/up launch (glmjax.moe.shared_route, Runtime.router_group),
  the same choice everywhere. wide_words: the pairs kernels' layout hint (Runtime.pairs_wide_words).
  """
  check_config(config, mesh)
  degree = mesh.shape[TEP]
  local_experts = config.n_routed_experts // degree
  shared_mlp = MLP(config.hidden_size, config.shared_intermediate // degree,
                   dtype=dtype, param_dtype=param_dtype)

  def local(x, ids, weights, experts, shared, router):
    x = x.astype(dtype)
    gate_up = None
    if router is not None:
      ids, weights, _, gate_up, _ = shared_route(x, router, shared, config, dense)
    offset = jax.lax.axis_index(TEP) * local_experts
    routed = quant.moe_experts(x, ids - offset, weights, experts["gate_proj"], experts["up_proj"],
                               experts["down_proj"], impl=matmul, routing=routing,
                               chosen=expected_local_experts(config, x.shape[0]) / degree, wide_words=wide_words)
    partial = routed + shared_mlp.apply({"params": shared}, x, matmul=matmul, dense=dense, swiglu=swiglu,
                                        partials=gate_up)
    return jax.lax.psum(partial, TEP)

  specs = (P(), P(), P(), EXPERT_SPEC, local_specs(shared, MLP_SPECS, mesh, module="shared_experts"), P())
  # check_vma=False: the Pallas kernels inside (the MoE and bf16 GEMVs at decode sizes) state no
  # varying-axes type for their outputs, which the check requires; the psum makes the result
  # replicated, as out_specs says.
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(x, ids, weights, experts,
                                                                                        shared, router)
