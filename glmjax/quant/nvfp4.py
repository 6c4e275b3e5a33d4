"""NVFP4 weights exactly as NVIDIA ModelOpt exports them, as a pytree leaf.

Per weight [..., out, in] (leading dims: stacked experts):
  packed       uint8          [..., out, in/2]   E2M1 codes, even column in the LOW nibble
  block_scale  float8_e4m3fn  [..., out, in/16]  one scale per 16 inputs ("weight_scale")
  global_scale float32        [...]              one per tensor ("weight_scale_2")
  input_scale  float32        [...]              activation amax / (448 * 6); weight-only compute
                                                 ignores it, it is kept for the checkpoint
Dequant: w = LUT[code] * float(block_scale) * global_scale, with E2M1 code = sign (bit 3) |
magnitude index (bits 0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. 4.5 bits per weight with scales.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.quant.leaf import QuantizedWeight

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Value of each 4-bit code: magnitudes for codes 0-7, the same negated for 8-15.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# ModelOpt's rounding thresholds between grid points; a value equal to an odd-indexed one
# (0.75, 1.75, 3.5) rounds up, to an even-indexed one down: round-to-nearest-even on the codes.
_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIE_ROUNDS_UP = np.array([False, True, False, True, False, True, False])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight(QuantizedWeight):
  """A ModelOpt NVFP4 weight of logical shape [..., out, in] (see the module docstring)."""
  packed: jax.Array        # uint8 [..., out, in/2]
  block_scale: jax.Array   # float8_e4m3fn [..., out, in/16]
  global_scale: jax.Array  # float32 [...]
  input_scale: jax.Array   # float32 [...]
  format: ClassVar[str] = "nvfp4"
  bits_per_weight: ClassVar[float] = 4 + 8 / BLOCK

  @property
  def shape(self) -> tuple[int, ...]:
    """Logical [..., out, in], derived from the arrays so it stays right under vmap / scan."""
    return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    """[..., out, in] in `dtype` (computed in fp32, rounded once)."""
    values = jnp.asarray(E2M1_VALUES)[unpack_e2m1(self.packed)]
    scale = jnp.repeat(self.block_scale.astype(jnp.float32), BLOCK, axis=-1)
    return (values * scale * self.global_scale[..., None, None]).astype(dtype)

  @staticmethod
  def storage(shape: tuple[int, ...]) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays (field -> shape and dtype) that hold a weight of logical shape [..., out, in]."""
    if len(shape) < 2:
      raise ValueError(f"NVFP4 quantizes [..., out, in] weights, got shape {tuple(shape)}")
    *lead, out, k = shape
    if k % BLOCK:
      raise ValueError(f"NVFP4 needs the input dim divisible by {BLOCK}, got {k} (shape {tuple(shape)})")
    return {"packed": jax.ShapeDtypeStruct((*lead, out, k // 2), jnp.uint8),
            "block_scale": jax.ShapeDtypeStruct((*lead, out, k // BLOCK), jnp.float8_e4m3fn),
            "global_scale": jax.ShapeDtypeStruct(tuple(lead), jnp.float32),
            "input_scale": jax.ShapeDtypeStruct(tuple(lead), jnp.float32)}

  @classmethod
  def from_modelopt(cls, weight: jax.Array, weight_scale: jax.Array, weight_scale_2: jax.Array,
                    input_scale: jax.Array | None = None) -> "NVFP4Weight":
    """Wrap the checkpoint tensors (HF names), checking their dtypes and shapes."""
    weight_scale_2 = jnp.asarray(weight_scale_2, jnp.float32)
    input_scale = jnp.ones_like(weight_scale_2) if input_scale is None else input_scale
    if weight.dtype != jnp.uint8:
      raise ValueError(f"NVFP4 weight must be uint8 (two codes per byte), got {weight.dtype}")
    if weight_scale.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    want = cls.storage((*weight.shape[:-1], 2 * weight.shape[-1]))
    if weight_scale.shape != want["block_scale"].shape:
      raise ValueError(f"NVFP4 weight_scale {weight_scale.shape} does not match weight {weight.shape}: "
                       f"need one scale per {BLOCK} inputs")
    if weight_scale_2.shape != want["global_scale"].shape:
      raise ValueError(f"NVFP4 weight_scale_2 {weight_scale_2.shape} must have the leading dims "
                       f"{weight.shape[:-2]} of weight")
    return cls(weight, weight_scale, weight_scale_2, jnp.asarray(input_scale, jnp.float32))


def pack_e2m1(codes: jax.Array) -> jax.Array:
  """uint8 codes [..., K] (values 0-15) -> uint8 [..., K/2], even column in the low nibble."""
  return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_e2m1`: uint8 [..., K/2] -> codes uint8 [..., K]."""
  return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def encode_e2m1(v: jax.Array) -> jax.Array:
  """fp32 values already divided by their scale -> uint8 E2M1 codes, as ModelOpt rounds them:
  nearest grid point, ties to the even code, magnitudes above 6 clamp to 6, sign = (v < 0)."""
  mag = jnp.abs(v)[..., None]
  above = jnp.where(_TIE_ROUNDS_UP, mag >= _BOUNDS, mag > _BOUNDS)
  index = jnp.sum(above, axis=-1, dtype=jnp.uint8)
  return index | jnp.where(v < 0, jnp.uint8(8), jnp.uint8(0))


def divide_exact(x: jax.Array, d) -> jax.Array:
  """x / d correctly rounded, as torch divides. XLA rewrites x / broadcast(d) into
  x * broadcast(1 / d), which is 1 ulp off often enough to flip e4m3 scales and E2M1 ties; a
  full-shape divisor behind an optimization barrier is not a broadcast, so it stays a division."""
  x, d = jax.lax.optimization_barrier((x, jnp.broadcast_to(jnp.asarray(d, x.dtype), x.shape)))
  return x / d


@jax.jit
def quantize_nvfp4(w: jax.Array, input_scale: jax.Array | None = None) -> NVFP4Weight:
  """[..., out, in] float -> NVFP4Weight with ModelOpt's scales (one global scale per [out, in]).

  global = amax|w| / (6 * 448); block scale = e4m3(amax|block| / (6 * global)); codes =
  E2M1(w / (block scale * global)). As in ModelOpt an all-zero block stores scale 1.0; a block
  whose scale underflows e4m3 to 0 (or an all-zero tensor) gets codes 0 instead of NaN.
  `input_scale` defaults to 1.0 (uncalibrated; weight-only compute never reads it).
  """
  NVFP4Weight.storage(w.shape)  # checks the shape
  *lead, out, k = w.shape
  w32 = w.astype(jnp.float32)
  global_scale = divide_exact(jnp.max(jnp.abs(w32), axis=(-2, -1)), E2M1_MAX * E4M3_MAX)
  blocks = w32.reshape(*lead, out, k // BLOCK, BLOCK)
  block_amax = jnp.max(jnp.abs(blocks), axis=-1)
  ratio = divide_exact(block_amax, E2M1_MAX * global_scale[..., None, None])
  block_scale = jnp.clip(jnp.where(block_amax > 0, ratio, 1.0), 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
  scale = block_scale.astype(jnp.float32) * global_scale[..., None, None]
  scaled = jnp.where(scale[..., None] > 0, divide_exact(blocks, scale[..., None]), 0.0)
  packed = pack_e2m1(encode_e2m1(scaled).reshape(*lead, out, k))
  input_scale = jnp.ones(lead, jnp.float32) if input_scale is None else jnp.asarray(input_scale, jnp.float32)
  return NVFP4Weight(packed, block_scale, global_scale, input_scale)
