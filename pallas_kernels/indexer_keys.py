"""The lightning indexer's new key and head weights in one launch, from their GEMV's partials.

glmjax.attention.Indexer projects x through wk (the one key head, D columns) and weights_proj
(a weight per query head, H columns) in one split-K launch, then normalises the key (k_norm, a
LayerNorm with bias), rotates its first `rope` columns (apply_rope's pairs (2i, 2i + 1)) and
scales the head weights by H^-0.5. On the H200 the steps after the GEMV are four XLA kernels of
a TEP=8 rank's layer (the weights' scale, k_norm's statistics and its application, the RoPE
concatenation; BENCHMARKS.md run 22's map). Here one program per token sums the partials and
does all of it, in fp32 as the Indexer does: 2.1 us there, 3.0 us of the layer's kernel time
saved (run 23).

The key is handled as D/2 pairs of columns (a [D/2, 2] tile of a free reshape), so the rotation
reads each pair's halves by masked sums along the pair axis, and one store writes the row.
Numerics: equal to the XLA path to fp32 rounding (the statistics' sums run in another order).
Switch: `Runtime.indexer_keys` ("xla" | "pallas").

Lowering: Triton: a few hundred values a row, reductions and elementwise work in registers.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax import layers
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.partials import check_angles, check_partials, rotate_pairs, split_sum


def keys_row(row, k_ref, w_ref, norm_w_ref, norm_b_ref, cos_ref, sin_ref, k_out_ref, w_out_ref, *, dim: int,
             heads: int, rope: int, eps: float) -> jax.Array:
  """Token `row`'s key and head weights (the module docstring's steps); also run by
  mla_epilogue's launch (pallas_kernels/mla_epilogue.py, Runtime.index_epilogue), which writes
  the key it returns (f32 [D / 2, 2]) into the cache too."""
  # k_ref f32 [S, n, D / 2, 2] ; w_ref f32 [S, n, H] ; norm_w_ref, norm_b_ref [D / 2, 2] ; cos_ref,
  # sin_ref f32 [n, >= rope / 2] ; k_out_ref f32 [n, D / 2, 2] ; w_out_ref f32 [n, H]: all whole.
  pairs = pl.next_power_of_2(dim // 2)
  pair = jnp.arange(pairs)
  ok = (pair < dim // 2)[:, None]
  k = split_sum(k_ref, row, 0, pairs, ok)                                  # [pairs, 2], 0 past D
  mean = jnp.sum(jnp.sum(k, axis=1)) / dim
  centred = jnp.where(ok, k - mean, 0.0)
  var = jnp.sum(jnp.sum(centred * centred, axis=1)) / dim
  scale, shift = (pltriton.load(ref.at[pl.ds(0, pairs)], mask=ok, other=0.0).astype(jnp.float32)
                  for ref in (norm_w_ref, norm_b_ref))
  k = centred * jax.lax.rsqrt(var + eps) * scale + shift

  roped = pair < rope // 2
  rotated = rotate_pairs(k, cos_ref, sin_ref, row, roped, jnp.float32)
  k = jnp.where(roped[:, None], rotated, k)
  pltriton.store(k_out_ref.at[row, pl.ds(0, pairs)], k, mask=ok)

  h_pad = pl.next_power_of_2(heads)
  h_ok = jnp.arange(h_pad) < heads
  weights = split_sum(w_ref, row, 0, h_pad, h_ok) * heads ** -0.5
  pltriton.store(w_out_ref.at[row, pl.ds(0, h_pad)], weights, mask=h_ok)
  return k


def keys_operands(k_partials, w_partials, norm_weight, norm_bias) -> tuple[jax.Array, ...]:
  """keys_row's inputs before the angles: the key's partials and k_norm's parameters as pairs."""
  as_pairs = lambda a: a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2)
  return as_pairs(k_partials), w_partials, as_pairs(norm_weight), as_pairs(norm_bias)


def keys_out_shapes(tokens: int, dim: int, heads: int) -> list[jax.ShapeDtypeStruct]:
  """keys_row's outputs: the key as pairs f32 [n, D / 2, 2], the head weights f32 [n, H]."""
  return [jax.ShapeDtypeStruct((tokens, dim // 2, 2), jnp.float32), jax.ShapeDtypeStruct((tokens, heads), jnp.float32)]


def check_keys_args(k_partials, w_partials, norm_weight, norm_bias, cos, sin) -> None:
  """ValueError naming the argument whose shape or dtype does not fit."""
  check_partials("indexer_keys", "k_partials", k_partials, "D (even)", multiple=2)
  splits, n, dim = k_partials.shape
  check_partials("indexer_keys", "w_partials", w_partials, "heads", lead=(splits, n))
  for name, p in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
    if p.shape != (dim,):
      raise ValueError(f"indexer_keys: {name} must be [{dim}], got {list(p.shape)}")
  if cos.ndim != 2 or not 0 < 2 * cos.shape[1] <= dim:
    raise ValueError(f"indexer_keys: cos must be f32 [{n}, rope / 2] with rope <= {dim}, got "
                     f"{cos.dtype}{list(cos.shape)}")
  check_angles("indexer_keys", cos, sin, n, cos.shape[1])


def _keys_kernel(*refs, **static) -> None:
  keys_row(pl.program_id(0), *refs, **static)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def indexer_keys(k_partials: jax.Array, w_partials: jax.Array, norm_weight: jax.Array, norm_bias: jax.Array,
                 cos: jax.Array, sin: jax.Array, *, eps: float = 1e-6,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """indexer_keys_reference in one launch (module docstring).

  Args:
    k_partials: f32 [S, n, D]: wk's split-K partial outputs (S = 1: the output).
    w_partials: f32 [S, n, H]: weights_proj's.
    norm_weight, norm_bias: k_norm's [D] parameters.
    cos, sin: f32 [n, rope / 2]: the tokens' RoPE angles (the key's first rope columns rotate).
    eps: k_norm's epsilon.
    interpret: run the Pallas interpreter; None: only on a CPU backend.
  Returns:
    (k f32 [n, D], head weights f32 [n, H]).
  """
  check_keys_args(k_partials, w_partials, norm_weight, norm_bias, cos, sin)
  (splits, n, dim), heads = k_partials.shape, w_partials.shape[-1]
  inputs = (*keys_operands(k_partials, w_partials, norm_weight, norm_bias), cos, sin)
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  shapes = keys_out_shapes(n, dim, heads)
  k, weights = pl.pallas_call(
      functools.partial(_keys_kernel, dim=dim, heads=heads, rope=2 * cos.shape[1], eps=eps),
      grid=(n,),
      in_specs=[whole(a.shape) for a in inputs],
      out_specs=[whole(shape.shape) for shape in shapes],
      out_shape=shapes,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="indexer_keys",
  )(*inputs)
  return k.reshape(n, dim), weights


def indexer_keys_reference(k_partials: jax.Array, w_partials: jax.Array, norm_weight: jax.Array,
                           norm_bias: jax.Array, cos: jax.Array, sin: jax.Array, *,
                           eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
  """The XLA path (glmjax.attention.Indexer's): the partials summed, k_norm, RoPE on the first
  rope columns, the head weights times H^-0.5."""
  check_keys_args(k_partials, w_partials, norm_weight, norm_bias, cos, sin)
  k = layers.layer_norm(jnp.sum(k_partials, axis=0), norm_weight, norm_bias, eps)
  weights = jnp.sum(w_partials, axis=0) * w_partials.shape[-1] ** -0.5
  return layers.apply_rope_leading(k[None], cos[None], sin[None])[0], weights
