"""What every quantized weight leaf shares: derived size facts (formats define shape, dequantize),
and how its arrays split over a mesh."""

import math

import jax
from jax.sharding import PartitionSpec


class QuantizedWeight:
  """Mixin of the quantized formats: a pytree leaf standing in for a [..., out, in] array."""
  shape: tuple[int, ...]

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))


def field_spec(spec, weight_ndim: int, shape: tuple[int, ...], mesh_shape) -> PartitionSpec:
  """The PartitionSpec of one array of a quantized leaf, from its logical weight's `spec` (over
  [..., out, in]): an array of the weight's rank (codes, block scales) the same spec along the
  same dims, a per-tensor scale [...] that of the leading dims; a dim its mesh axes do not divide
  (FP8's 128 x 128 block scales) replicated; mesh_shape None: every dim as the weight's."""
  spec = (*spec, *(None,) * weight_ndim)[:weight_ndim]
  spec = spec if len(shape) == weight_ndim else spec[:len(shape)]
  if mesh_shape is None:
    return PartitionSpec(*spec)
  size = lambda axes: math.prod(mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
  return PartitionSpec(*(a if n % size(a) == 0 else None for a, n in zip(spec, shape)))
