"""Block-scaled FP8 weights (GLM-5-FP8 / DeepSeek-V3 layout), as a pytree leaf.

Per weight [..., out, in]:
  weight           float8_e4m3fn [..., out, in]
  scale_inv        float32       [..., ceil(out/128), ceil(in/128)]  one per 128x128 block
Dequant: w = float(weight) * scale_inv of its block (edge blocks are partial). 8 bits per weight.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from glmjax.quant.leaf import QuantizedWeight
from glmjax.quant.nvfp4 import divide_exact

BLOCK = 128
E4M3_MAX = 448.0


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def expand_block_scale(scale_inv: jax.Array, out: int, k: int) -> jax.Array:
  """[..., ceil(out/128), ceil(in/128)] -> fp32 [..., out, in], each block's scale repeated."""
  s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), BLOCK, axis=-2), BLOCK, axis=-1)
  return s[..., :out, :k]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8BlockWeight(QuantizedWeight):
  """An e4m3 weight of logical shape [..., out, in] with 128x128 block scales."""
  weight: jax.Array     # float8_e4m3fn [..., out, in]
  scale_inv: jax.Array  # float32 [..., ceil(out/128), ceil(in/128)]
  format: ClassVar[str] = "fp8_block"
  bits_per_weight: ClassVar[float] = 8.0

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.weight.shape)

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    """[..., out, in] in `dtype` (computed in fp32, rounded once)."""
    *_, out, k = self.weight.shape
    return (self.weight.astype(jnp.float32) * expand_block_scale(self.scale_inv, out, k)).astype(dtype)

  @staticmethod
  def storage(shape: tuple[int, ...]) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays (field -> shape and dtype) that hold a weight of logical shape [..., out, in]."""
    if len(shape) < 2:
      raise ValueError(f"FP8 block quantization needs [..., out, in] weights, got shape {tuple(shape)}")
    *lead, out, k = shape
    return {"weight": jax.ShapeDtypeStruct(tuple(shape), jnp.float8_e4m3fn),
            "scale_inv": jax.ShapeDtypeStruct((*lead, _cdiv(out, BLOCK), _cdiv(k, BLOCK)), jnp.float32)}

  @classmethod
  def from_checkpoint(cls, weight: jax.Array, weight_scale_inv: jax.Array) -> "FP8BlockWeight":
    """Wrap the checkpoint tensors (HF names), checking their dtypes and shapes."""
    if weight.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    expected = cls.storage(weight.shape)["scale_inv"].shape
    if weight_scale_inv.shape != expected:
      raise ValueError(f"FP8 weight_scale_inv {weight_scale_inv.shape} does not match weight "
                       f"{weight.shape}: need {expected} ({BLOCK}x{BLOCK} blocks)")
    return cls(weight, jnp.asarray(weight_scale_inv, jnp.float32))


@jax.jit
def quantize_fp8_block(w: jax.Array) -> FP8BlockWeight:
  """[..., out, in] float -> FP8BlockWeight with scale_inv = amax|block| / 448 (0 for all-zero
  blocks, whose codes are 0)."""
  FP8BlockWeight.storage(w.shape)  # checks the shape
  *lead, out, k = w.shape
  nb, kb = _cdiv(out, BLOCK), _cdiv(k, BLOCK)
  w32 = w.astype(jnp.float32)
  padded = jnp.pad(w32, [(0, 0)] * len(lead) + [(0, nb * BLOCK - out), (0, kb * BLOCK - k)])
  blocks = padded.reshape(*lead, nb, BLOCK, kb, BLOCK)
  scale_inv = divide_exact(jnp.max(jnp.abs(blocks), axis=(-3, -1)), E4M3_MAX)
  s = expand_block_scale(scale_inv, out, k)
  codes = jnp.clip(jnp.where(s > 0, divide_exact(w32, s), 0.0), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  return FP8BlockWeight(codes, scale_inv)
