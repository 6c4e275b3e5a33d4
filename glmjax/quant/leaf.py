"""What every quantized weight leaf shares: derived size facts (formats define shape, dequantize)."""

import jax


class QuantizedWeight:
  """Mixin of NVFP4Weight and FP8BlockWeight: a pytree leaf standing in for a [..., out, in] array."""
  shape: tuple[int, ...]

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))
