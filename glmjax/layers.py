"""Shared building blocks: linear layers over HF-oriented weights, norms, RoPE, the SwiGLU MLP.

Every linear weight is stored as in the HF checkpoint, `weight [out, in]`, and applied through
`linear`, so a quantized leaf (NVFP4 / block FP8, `glmjax.quant`) drops in where a bf16 array was.
Weights carry logical axis names (see `glmjax.parallel`) through `nn.with_logical_partitioning`.
"""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from glmjax import quant
from glmjax.quant import linear  # arrays: the reference einsum; quantized leaves: weight-only, by impl

init_normal = nn.initializers.normal


class Linear(nn.Module):
  """y = x @ weight.T with weight [out, in] (HF layout); no bias (GLM-5 has none). The weight may
  be a quantized leaf (NVFP4 / block FP8), applied through the `matmul` impl of the call; a
  plain one through its `dense` impl (glmjax.quant.linear)."""
  features: int
  axes: tuple[str | None, str | None] = (None, None)  # logical axes of (out, in)
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  init_std: float = 0.02

  @nn.compact
  def __call__(self, x: jax.Array, *, matmul: str = "xla", dense: str = "xla") -> jax.Array:
    weight = quant.param(self, "weight", nn.with_logical_partitioning(init_normal(self.init_std), self.axes),
                         (self.features, x.shape[-1]), self.param_dtype)
    return linear(x, weight, impl=matmul, dense=dense, dtype=self.dtype)


class Weight(nn.Module):
  """A bare [out, in] weight (the parameter Linear holds, at the same path): for kv_b_proj, whose
  halves MLA's decode path folds in, and for `linears`."""
  shape: tuple[int, int]
  axes: tuple[str | None, str | None]
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self) -> jax.Array:
    return quant.param(self, "weight", nn.with_logical_partitioning(init_normal(0.02), self.axes), self.shape,
                       self.param_dtype)


def linears(x: jax.Array, specs: Sequence[tuple[str, int, tuple[str | None, str | None]]], *, dtype, param_dtype,
            matmul: str = "xla", dense: str = "xla", partials: bool = False, gemv_splits: str | int = "rule",
            more: Sequence[jax.Array] = ()) -> list[jax.Array]:
  """Linear(features, axes, name=name)(x) for each (name, features, axes) of `specs`, inside the
  calling module, with the same parameters; applied together (glmjax.quant.linear_group: one
  launch for plain bf16 weights under dense="pallas_grouped"). partials: their fp32 split-K
  partials [S, rows, features] instead (quant.linear_group_partials, `gemv_splits` of them), for a
  fused epilogue.
  more: other modules' [out, in] weights that read x too, in the same group; their outputs follow."""
  weights = [Weight((features, x.shape[-1]), axes, param_dtype, name=name)() for name, features, axes in specs]
  weights += more
  if partials:
    return quant.linear_group_partials(x, weights, impl=matmul, dense=dense, gemv_splits=gemv_splits)
  return quant.linear_group(x, weights, impl=matmul, dense=dense, dtype=dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
  """RMSNorm as transformers computes it: normalise in fp32, cast to dtype, then scale in dtype."""
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight.astype(dtype) * normed.astype(dtype)


class RMSNorm(nn.Module):
  """rms_norm over `dim` features; its weight is an attribute, for a kernel that applies it itself."""
  dim: int
  eps: float
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  axis_name: str | None = None

  def setup(self):
    self.weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                             (self.dim,), self.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight, self.eps, self.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis with statistics in fp32 -> fp32."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  return (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)


class LayerNorm(nn.Module):
  """LayerNorm with bias over `dim` features (the indexer's k_norm), statistics in fp32; its
  weight and bias are attributes, for a kernel that applies them itself."""
  dim: int
  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (self.dim,),
                             self.param_dtype)
    self.bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (self.dim,),
                           self.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return layer_norm(x, self.weight, self.bias, self.eps).astype(self.dtype)


def apply_rope_leading(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """apply_rope on x's first 2 * cos.shape[-1] columns, the rest as they are: the indexer's
  heads and key put their rope part first ([rope | nope])."""
  rope = 2 * cos.shape[-1]
  return jnp.concatenate([apply_rope(x[..., :rope], cos, sin), x[..., rope:]], axis=-1)


def rope_cos_sin(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin [..., dim // 2] in fp32 for integer positions [...]."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate x [B, S, ..., d] by per-position angles (cos/sin [B, S, d/2]), interleaved pairs.

  GLM-5 rotates the pairs (2i, 2i+1), in MLA and in the indexer alike (checked against the
  transformers fixture: the rotate-half pairing (i, i + d/2) does not reproduce it). cos/sin are
  rounded to x's dtype first, as transformers does.
  """
  extra = x.ndim - cos.ndim
  cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:]).astype(x.dtype)
  sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:]).astype(x.dtype)
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


class MLP(nn.Module):
  """SwiGLU MLP: down(silu(gate(x)) * up(x)); used dense and as the shared expert. swiglu="pallas":
  at decode, where all three weights take the bf16 GEMV, the down GEMV's launch computes
  silu(gate) * up itself from the gate/up partials (pallas_kernels/bf16_matmul.swiglu_matmul).
  With residual and routed (the shared expert under Runtime.moe_sum): the MoE layer's new
  residual, residual + (bf16(sum of the routed partials) + the MLP's output), in that launch
  where its down GEMV takes the whole K in one program, else in XLA's kernels. partials: the
  gate and up projections' split-K partials [S, rows, I] where the caller ran them in a launch
  of its own (the MoE's router GEMV, Runtime.router_group): summed as linear_group sums them.
  down_partials: the output as fp32 terms [S, rows, D] that sum to it (quant.linear_partials;
  swiglu="pallas": its output [1, rows, D]), for a launch that adds them up itself
  (Runtime.next_norm). hidden: silu(gate) * up [rows, I] where a caller computed it from those
  partials (the router's launch, Runtime.shared_swiglu): only the down projection runs."""
  hidden_size: int
  intermediate_size: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, matmul: str = "xla", dense: str = "xla", swiglu: str = "xla",
               residual: jax.Array | None = None, routed: jax.Array | None = None,
               partials: tuple[jax.Array, jax.Array] | None = None, down_partials: bool = False,
               hidden: jax.Array | None = None) -> jax.Array:
    impls = dict(impl=matmul, dense=dense)
    gate_up = [Weight((self.intermediate_size, x.shape[-1]), ("mlp", "embed"), self.param_dtype, name=name)()
               for name in ("gate_proj", "up_proj")]
    down = Weight((self.hidden_size, self.intermediate_size), ("embed", "mlp"), self.param_dtype, name="down_proj")()
    out_shape = (*x.shape[:-1], self.hidden_size)
    if hidden is None and swiglu == "pallas" and all(quant.takes_bf16_gemv(x, w, dense, self.dtype)
                                                      for w in (*gate_up, down)):
      from pallas_kernels.bf16_matmul import swiglu_config, swiglu_matmul  # the kernels import the formats
      g, u = partials or quant.linear_group_partials(x, gate_up, **impls)
      if residual is None:
        out = swiglu_matmul(g, u, down)
        return out[None] if down_partials else out.reshape(out_shape)
      if swiglu_config(*down.shape, *g.shape[:2]).split_k == 1:
        return swiglu_matmul(g, u, down, residual=residual.reshape(-1, self.hidden_size),
                             routed=routed).reshape(out_shape)
      out = swiglu_matmul(g, u, down).reshape(out_shape)
    else:
      if hidden is None:
        if partials:
          from pallas_kernels.nvfp4_matmul import summed_splits  # the kernels import the model
          gate, up = (summed_splits(p, self.dtype) for p in partials)
        else:
          gate, up = quant.linear_group(x, gate_up, **impls, dtype=self.dtype)
        hidden = nn.silu(gate) * up
      hidden = hidden.reshape(*x.shape[:-1], -1)
      if down_partials:
        return quant.linear_partials(hidden, down, **impls, dtype=self.dtype)
      out = linear(hidden, down, **impls, dtype=self.dtype)
    if residual is None:
      return out
    return residual + (routed.sum(0).reshape(out_shape).astype(self.dtype) + out).astype(residual.dtype)


def split_last(x: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
  """Split the last axis into consecutive pieces of the given sizes."""
  cuts = list(jnp.cumsum(jnp.array(sizes))[:-1].tolist())
  return jnp.split(x, cuts, axis=-1)
