"""The pieces shared by kernels that finish a GEMV's split-K partials: the epilogues that read the
fp32 partials unsummed (glmjax.quant.linear_partials, linear_group_partials) add them up in their
own launch, one XLA kernel fewer than summing them first, and check their arguments alike."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nvfp4_matmul import load_tile


def split_sum(ref, row, start, size: int, ok) -> jax.Array:
  """sum over the splits (ref's axis 0), in split order, of ref[s, row, start:start + size]; 0
  where not ok. A trailing axis of ref (a pair axis) comes along whole."""
  load = lambda s: pltriton.load(ref.at[jnp.int32(s), row, pl.ds(start, size)], mask=ok, other=0.0)
  total = load(0)
  for s in range(1, ref.shape[0]):
    total += load(s)
  return total


def split_tile_sum(ref, rows_ok, cols_ok, *index) -> jax.Array:
  """sum over the splits (ref's axis 0), in split order, of the 2-D tile ref[s, *index]
  (load_tile's masks: 0 where not ok)."""
  return sum(load_tile(ref.at[(jnp.int32(s), *index)], rows_ok, cols_ok) for s in range(ref.shape[0]))


def rms_normed(x: jax.Array, weight_ref, ok: jax.Array, width: int, eps: float, dtype) -> jax.Array:
  """layers.rms_norm of a row's fp32 values x [pad] (0 where not ok; `width` of them ok) with
  weight_ref's first `width` values: fp32 statistics, the scale in dtype."""
  rstd = jax.lax.rsqrt(jnp.sum(x * x) / width + eps)
  weight = pltriton.load(weight_ref.at[pl.ds(0, x.shape[0])], mask=ok, other=0.0).astype(dtype)
  return weight * (x * rstd).astype(dtype)


def rotate_pairs(pairs: jax.Array, cos_ref, sin_ref, row, ok: jax.Array, dtype) -> jax.Array:
  """apply_rope's rotation of a tile of pairs [Pp, 2] (columns 2i, 2i + 1; fp32 values exact in
  dtype) by row `row` of the angle tables [n, P / 2] (pairs not ok: angle tables read as 0), in
  dtype as apply_rope computes it; each pair's halves are taken by a masked sum along the pair
  axis (exact: one term of each sum is not zero)."""
  first = jnp.arange(2)[None, :] == 0
  x1, x2 = (jnp.sum(jnp.where(lane, pairs, 0.0), axis=1).astype(dtype) for lane in (first, ~first))
  cos, sin = (pltriton.load(ref.at[row, pl.ds(0, pairs.shape[0])], mask=ok, other=0.0).astype(dtype)
              for ref in (cos_ref, sin_ref))
  return jnp.where(first, (x1 * cos - x2 * sin)[:, None], (x2 * cos + x1 * sin)[:, None])


def check_partials(owner: str, name: str, partials: jax.Array, columns: str, *, lead: tuple[int, ...] = (),
                   multiple: int = 1, dtypes: tuple[str, ...] = ("float32",)) -> None:
  """ValueError unless partials is [splits, tokens, columns] in one of `dtypes` (f32): its leading
  dims `lead` (if given), its columns a multiple of `multiple`."""
  if (partials.ndim != 3 or partials.dtype.name not in dtypes or (lead and partials.shape[:2] != lead)
      or partials.shape[-1] % multiple):
    dims = ", ".join(map(str, lead)) if lead else "splits, tokens"
    kinds = " or ".join(d.replace("float", "f") for d in dtypes)
    raise ValueError(f"{owner}: {name} must be {kinds} [{dims}, {columns}], got {partials.dtype}"
                     f"{list(partials.shape)}")


def check_angles(owner: str, cos: jax.Array, sin: jax.Array, tokens: int, half: int) -> None:
  """ValueError unless cos and sin are f32 [tokens, half] (half: the rope columns' pairs)."""
  for name, table in (("cos", cos), ("sin", sin)):
    if table.shape != (tokens, half) or table.dtype != jnp.float32:
      raise ValueError(f"{owner}: {name} must be f32 [{tokens}, {half}], got {table.dtype}{list(table.shape)}")
