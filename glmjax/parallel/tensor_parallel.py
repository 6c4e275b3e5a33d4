"""The dense parts of a decoder layer under TEP as explicit shard_maps over "tep": attention by
heads, a SwiGLU MLP by its intermediate. Each device runs the model's own module on its slice
(local config: H/N heads, I/N intermediate) and one psum sums the row-parallel outputs.

Why not GSPMD: GSPMD partitions XLA's ops, but it cannot split a Pallas call. Every sharded
weight a kernel reads (q_b, kv_b's halves, o_proj, the MLP's) would be gathered whole to every
device, each step (BENCHMARKS.md run 29: 75% of a two-GPU step's kernel time). Inside these
shard_maps the kernels see their device's slice, and the step keeps the collectives
comm_model counts: one all-reduce of [tokens, hidden] after attention and one after the MLP.
Runtime.tensor_parallel="gspmd" keeps GSPMD's layout instead, for the ablation.

Layout (rules.py gives the params the same one, so entering a shard_map moves no weight):
- attention: q_b_proj and kv_b_proj rows (whole heads), o_proj columns; the latent projections,
  norms, the indexer and the cache replicated (each device writes the same pages and selects the
  same top-k);
- MLP: gate/up rows, down columns (also the shared expert's, glmjax.parallel.expert_parallel).
"""

import dataclasses
import warnings

import jax
from jax.sharding import PartitionSpec as P

from glmjax import quant
from glmjax.config import ModelConfig
from glmjax.layers import MLP
from glmjax.parallel.mesh import TEP, active_mesh
from glmjax.parallel.rules import check_config, quantized_specs

HEAD_SPECS = {"q_b_proj": {"weight": P(TEP)}, "kv_b_proj": {"weight": P(TEP)}, "o_proj": {"weight": P(None, TEP)}}
MLP_SPECS = {"gate_proj": {"weight": P(TEP)}, "up_proj": {"weight": P(TEP)}, "down_proj": {"weight": P(None, TEP)}}


def local_specs(params: dict, table: dict, mesh, *, module: str) -> dict:
  """A module's params -> their shard_map in_specs: `table`'s spec where it names the param
  (a quantized weight's fields as rules.quantized_specs splits them for a shard_map: a clear
  error where a device's slice would straddle blocks), replicated elsewhere."""
  def spec(path, leaf):
    names = [getattr(key, "key", None) for key in path]
    node = table
    for name in names:
      node = node.get(name, {}) if isinstance(node, dict) else node
    axes = node if isinstance(node, P) else P()
    if isinstance(leaf, quant.QuantizedWeight):
      return quantized_specs(axes, leaf, mesh.shape, local=True, param=f"{module}/{'/'.join(map(str, names))}")
    return axes
  return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))


def split_specs(params: dict, table: dict, *, module: str) -> dict | None:
  """`local_specs` of `module`'s params on the active TEP mesh, the in_specs of its shard_map;
  None on one device, or, with a warning, where a device's slice would straddle quantization
  blocks (FP8's 128-row blocks of a small model): GSPMD then partitions the module's XLA ops and
  gathers the weights its kernels read."""
  mesh = active_mesh()
  if mesh is None:
    return None
  try:
    return local_specs(params, table, mesh, module=module)
  except ValueError as err:
    warnings.warn(f"tensor_parallel: {module} runs under GSPMD, not its shard_map, so the weights its "
                  f"kernels read are gathered every step: {err}", stacklevel=2)
    return None


def attention(params: dict, specs: dict, x, cos, sin, prev_topk, *, cache, config: ModelConfig, has_indexer: bool,
              dtype, param_dtype, o_partials: bool = False, **call):
  """MLAttention's call (glmjax.attention; `call`: its keyword arguments) with each device's
  heads of the active mesh, params split as `specs` (split_specs with HEAD_SPECS): (out
  [B, T, D] replicated, topk, new LayerCache). o_partials: out as [1, B * T, D] in dtype, o_proj's
  split-K partials summed on each device and rounded to dtype before the psum, as o_proj's output
  is without it (Runtime.residual_norm reads it as one split): the all-reduce moves dtype's bytes."""
  from glmjax.attention import MLAttention  # attention imports the layers this module does
  mesh = active_mesh()
  check_config(config, mesh)
  degree = mesh.shape[TEP]
  local_config = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // degree,
                                     num_key_value_heads=max(1, config.num_key_value_heads // degree))
  mla = MLAttention(local_config, has_indexer, dtype=dtype, param_dtype=param_dtype, parent=None)

  def local(params, x, cos, sin, prev_topk, cache):
    out, topk, layer = mla.apply({"params": params}, x, cos, sin, prev_topk, cache=cache, o_partials=o_partials,
                                 **call)
    if o_partials:
      out = out.sum(0, keepdims=True).astype(dtype)
    return jax.lax.psum(out, TEP), topk, layer

  # check_vma=False: the Pallas kernels inside state no varying-axes type for their outputs; the
  # replicated outputs (top-k, pages) are the same on every device, the psum makes out so.
  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P(), P(), P(), P()), out_specs=(P(), P(), P()),
                       check_vma=False)(params, x, cos, sin, prev_topk, cache)


def mlp(params: dict, specs: dict, x: jax.Array, *, hidden_size: int, intermediate_size: int, dtype, param_dtype,
        **impls) -> jax.Array:
  """A SwiGLU MLP's output [..., D] in dtype, replicated: each device's intermediate slice of the
  active mesh, params split as `specs` (split_specs with MLP_SPECS), one psum (`impls`: MLP's
  keyword arguments)."""
  mesh = active_mesh()
  local_mlp = MLP(hidden_size, intermediate_size // mesh.shape[TEP], dtype=dtype, param_dtype=param_dtype,
                  parent=None)
  local = lambda params, x: jax.lax.psum(local_mlp.apply({"params": params}, x, **impls), TEP)
  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)(params, x)
