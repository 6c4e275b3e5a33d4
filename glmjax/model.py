"""GLM-5 (`glm_moe_dsa`) as Flax modules applied functionally: params and caches are pytrees.

    logits, hidden, cache = CausalLM(config).apply({"params": params}, tokens, positions, cache=...)

Without a cache this is transformers' `GlmMoeDsaForCausalLM` forward (the reference path); with a
`KVCache` the new tokens are written to its pages and attention runs in latent space over the
DSA selection (`glmjax.attention`). The MTP layer (`mtp`) shares embedding and lm_head.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from glmjax import quant
from glmjax.attention import MLAttention
from glmjax.cache import paged
from glmjax.config import ModelConfig
from glmjax.layers import MLP, Linear, RMSNorm, init_normal, rope_cos_sin
from glmjax.moe import MoE
from glmjax.runtime import Runtime

DEFAULT_RUNTIME = Runtime()


class Embed(nn.Module):
  vocab_size: int
  features: int
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    table = self.param("weight", nn.with_logical_partitioning(init_normal(0.02), ("vocab", "embed")),
                       (self.vocab_size, self.features), self.param_dtype)
    return jnp.take(table, tokens, axis=0)


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), the MLP dense or MoE.

  Returns (x, the next norm's output or None, top-k, layer cache). Given `closing_norm` (the
  weight of the norm that follows the layer, Runtime.next_norm) at decode, the layer's last add
  and that norm run in one launch and it returns the norm's output, which the next layer takes
  as `normed` instead of running its input_layernorm.
  """
  config: ModelConfig
  layer_id: int
  sparse_mlp: bool
  has_indexer: bool
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x, cos, sin, prev_topk, *, positions, runtime, cache, cache_slot, normed=None,
               closing_norm=None):
    from glmjax.parallel import tensor_parallel  # the parallel package imports the model
    c = self.config
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    with jax.named_scope(f"layer{self.layer_id}_attn"):
      input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, name="input_layernorm", **kw)
      normed = input_norm(x) if normed is None else normed
      fused = runtime.residual_norm == "pallas" and quant.decode_sized(normed)
      call = dict(positions=positions, runtime=runtime, layer_id=self.layer_id, cache=cache, cache_slot=cache_slot,
                  o_partials=fused)
      if specs := self._split_specs("self_attn", tensor_parallel.HEAD_SPECS, runtime):
        attn, topk, layer_cache = tensor_parallel.attention(
            self.variables["params"]["self_attn"], specs, normed, cos, sin, prev_topk, config=c,
            has_indexer=self.has_indexer, **kw, **call)
      else:
        attn, topk, layer_cache = MLAttention(c, self.has_indexer, name="self_attn", **kw)(
            normed, cos, sin, prev_topk, **call)
    with jax.named_scope(f"layer{self.layer_id}_mlp"):
      post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, name="post_attention_layernorm", **kw)
      if fused:  # the residual add and the norm in one launch from o_proj's partials
        from pallas_kernels.residual_norm import residual_norm  # the kernels import the model
        x, h = (a.reshape(x.shape) for a in residual_norm(x.reshape(-1, x.shape[-1]), attn, post_norm.weight,
                                                           eps=post_norm.eps, dtype=self.dtype))
      else:
        x = x + attn.astype(x.dtype)
        h = post_norm(x)
      if self.sparse_mlp and runtime.moe_sum == "pallas" and quant.decode_sized(h) and _tep_mesh() is None:
        # the layer's sum in the shared expert's launch: the MoE returns the new residual
        return MoE(c, name="mlp", **kw)(h, runtime=runtime, residual=x), None, topk, layer_cache
      closing = closing_norm is not None and quant.decode_sized(h)
      term = None  # with closing: the output as partials [S, rows, D], the routed experts' as a term
      if self.sparse_mlp:
        h = MoE(c, name="mlp", **kw)(h, runtime=runtime, terms=closing)
        if closing:
          h, term = h
      elif specs := self._split_specs("mlp", tensor_parallel.MLP_SPECS, runtime):
        h = tensor_parallel.mlp(self.variables["params"]["mlp"], specs, h, hidden_size=c.hidden_size,
                                intermediate_size=c.intermediate_size, **kw, **runtime.mlp_impls)
        h = h.reshape(1, -1, c.hidden_size) if closing else h
      else:
        h = MLP(c.hidden_size, c.intermediate_size, name="mlp", **kw)(h, **runtime.mlp_impls, down_partials=closing)
    if closing:  # the add and the next norm in one launch
      from pallas_kernels.residual_norm import residual_norm  # the kernels import the model
      x, normed = (a.reshape(x.shape) for a in residual_norm(
          x.reshape(-1, x.shape[-1]), h, closing_norm, eps=c.rms_norm_eps, dtype=self.dtype, term=term))
      return x, normed, topk, layer_cache
    return x + h.astype(x.dtype), None, topk, layer_cache

  def _split_specs(self, name: str, table: dict, runtime: Runtime) -> dict | None:
    """The in_specs of submodule `name`'s shard_map over the TEP mesh
    (glmjax.parallel.tensor_parallel.split_specs: its params split by `table`); None on one
    device, at init, or where GSPMD partitions it instead (Runtime.tensor_parallel="gspmd", or a
    device's slice would straddle quantization blocks)."""
    if self.is_initializing() or runtime.tensor_parallel == "gspmd":
      return None
    from glmjax.parallel import tensor_parallel  # the parallel package imports the model
    return tensor_parallel.split_specs(self.variables["params"][name], table, module=f"{self.name}/{name}")


def _tep_mesh():
  """The active TEP mesh (None: one device, or one rank's program). A fold that reads the MoE's
  unsummed partials applies only without it."""
  from glmjax.parallel.mesh import active_mesh  # the parallel package imports the model
  return active_mesh()


class MTPBlock(nn.Module):
  """The multi-token-prediction layer: h' = eh_proj([enorm(embed(next)); hnorm(h)]), one decoder
  layer (MLA + indexer + MoE), then shared_head.norm; logits come from the main lm_head."""
  config: ModelConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, embedded, hidden, cos, sin, *, positions, runtime, cache, prev_topk=None):
    c = self.config
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    joined = jnp.concatenate([RMSNorm(c.hidden_size, c.rms_norm_eps, name="enorm", **kw)(embedded),
                              RMSNorm(c.hidden_size, c.rms_norm_eps, name="hnorm", **kw)(hidden)], axis=-1)
    x = Linear(c.hidden_size, ("embed", None), name="eh_proj", **kw)(joined, **runtime.linear_impls)
    head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, name="shared_head_norm", **kw)
    closing = None if runtime.next_norm != "pallas" or self.is_initializing() else head_norm.weight
    x, normed, topk, layer_cache = DecoderLayer(c, c.num_hidden_layers, True, True, name="block", **kw)(
        x, cos, sin, prev_topk, positions=positions, runtime=runtime, cache=cache, cache_slot=0, closing_norm=closing)
    return x, head_norm(x) if normed is None else normed, topk, layer_cache


class CausalLM(nn.Module):
  """Embedding, decoder layers, final norm, lm_head; and the MTP layer when the config has one."""
  config: ModelConfig
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    c = self.config
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    self.embed_tokens = Embed(c.vocab_size, c.hidden_size, self.param_dtype)
    self.layers = [DecoderLayer(c, i, c.mlp_layer_types[i] == "sparse", c.indexer_types[i] == "full", **kw)
                   for i in range(c.num_hidden_layers)]
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
    self.lm_head = Linear(c.vocab_size, ("vocab", "embed"), **kw)
    if c.num_nextn_predict_layers:
      self.mtp = MTPBlock(c, **kw)

  def __call__(self, tokens, positions=None, *, cache: paged.KVCache | None = None,
               runtime: Runtime = DEFAULT_RUNTIME, init_mtp: bool = False):
    """tokens [B, T] -> (logits [B, T, V] fp32, final normed hidden [B, T, D], new cache or None).

    positions [B, T] int32 (default 0..T-1); with a cache, -1 marks padding tokens.
    """
    c = self.config
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta)
    # The residual stream stays fp32 whatever the compute dtype: it carries 78 layers' sums.
    x = self.embed_tokens(jnp.clip(tokens, 0, c.vocab_size - 1)).astype(jnp.float32)
    topk, normed, new_layers = None, None, []
    for i, layer in enumerate(self.layers):
      x, normed, topk, layer_cache = layer(x, cos, sin, topk, positions=positions, runtime=runtime, cache=cache,
                                           cache_slot=i, normed=normed, closing_norm=self._closing_norm(i, runtime))
      new_layers.append(layer_cache)
    hidden = self.norm(x) if normed is None else normed
    logits = self.lm_head(hidden).astype(jnp.float32)
    if init_mtp and c.num_nextn_predict_layers:  # only so that `init` creates the MTP params
      self.mtp_step(tokens, hidden, positions)
    new_cache = None if cache is None else cache.replace(layers=tuple(new_layers))
    return logits, hidden, new_cache

  def _closing_norm(self, i: int, runtime: Runtime) -> jax.Array | None:
    """Runtime.next_norm: the weight of the norm after layer i (layer i + 1's input_layernorm,
    after the last the final norm), which layer i applies in its closing launch; None where the
    fold is off, or while the params are being created."""
    if runtime.next_norm != "pallas" or self.is_initializing():
      return None
    if i + 1 == len(self.layers):
      return self.norm.weight
    return self.variables["params"][f"layers_{i + 1}"]["input_layernorm"]["weight"]

  def mtp_step(self, next_tokens, hidden, positions, *, cache: paged.KVCache | None = None,
               runtime: Runtime = DEFAULT_RUNTIME, prev_topk: jax.Array | None = None):
    """MTP draft: next_tokens [B, T] (the token after each position), hidden [B, T, D] (the main
    model's final normed hidden state there, as vLLM and SGLang feed it) -> (logits [B, T, V],
    the MTP block's output [B, T, D] before shared_head.norm, which chained draft steps feed back
    as `hidden`, new MTP cache, the MTP layer's top-k [B, T, k] or None). `cache` is the MTP
    layer's own single-layer KVCache. `prev_topk` [B, T, k] is a selection to reuse instead of
    running the MTP indexer (IndexShare across draft steps); it is used when `runtime` marks the
    MTP layer (index num_hidden_layers) as shared.
    """
    c = self.config
    cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta)
    embedded = self.embed_tokens(jnp.clip(next_tokens, 0, c.vocab_size - 1)).astype(self.dtype)
    h, normed, topk, layer_cache = self.mtp(embedded, hidden.astype(self.dtype), cos, sin, positions=positions,
                                            runtime=runtime, cache=cache, prev_topk=prev_topk)
    logits = self.lm_head(normed).astype(jnp.float32)
    new_cache = None if cache is None else cache.replace(layers=(layer_cache,))
    return logits, h, new_cache, topk


@functools.partial(jax.jit, static_argnames=("config", "param_dtype"))
def _init_variables(key: jax.Array, config: ModelConfig, param_dtype):
  """The model's variables from `key`, the MTP layer's included; params boxed with their logical
  axes (nn.Partitioned). Jitted: one compile per config, where the eager init compiled its few
  hundred ops one by one (the same bits; tiny: 4.5 against 6.8 s on the CPU)."""
  model = CausalLM(config, dtype=param_dtype, param_dtype=param_dtype)
  return model.init(key, jnp.zeros((1, 2), jnp.int32), init_mtp=True)


def init_params(config: ModelConfig, key: jax.Array, *, param_dtype=jnp.bfloat16):
  """Random params (HF-style init, std 0.02), the MTP layer included when the config has one."""
  return nn.unbox(_init_variables(key, config, param_dtype)["params"])


def abstract_params(config: ModelConfig, *, param_dtype=jnp.bfloat16):
  """Shapes and dtypes of the params (no memory), with logical axis metadata (nn.Partitioned)."""
  return jax.eval_shape(functools.partial(_init_variables, config=config, param_dtype=param_dtype),
                        jax.random.key(0))["params"]
