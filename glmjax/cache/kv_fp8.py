"""FP8 e4m3 storage for the KV and indexer-key caches (FlashMLA / DeepSeek-V3.2 layout).

Each token's vector is cut into blocks of `block` values (128 for GLM-5); a block stores e4m3
codes and one fp32 scale that is a power of two, so dequantisation (`code * scale`) is exact in
fp32 and a page re-quantised from its own dequantised values reproduces itself bit for bit.
GLM-5 per token: 512 latent codes + 4 scales + 64 bf16 RoPE values = 656 bytes; indexer key:
128 codes + 1 scale = 132 bytes.
"""

import jax.numpy as jnp
from jax import lax

E4M3_MAX = 448.0


def fp8_block_size(dim: int) -> int:
  """Scale-block length for a vector of `dim` values: 128, or `dim` itself when smaller."""
  block = min(128, dim)
  if dim % block:
    raise ValueError(f"FP8 cache needs a dimension divisible by {block}, got {dim}")
  return block


def fp8_scale(amax: jnp.ndarray) -> jnp.ndarray:
  """Per-block fp32 scale for block maxima `amax` (>= 0): the smallest power of two 2^e with
  amax / 2^e <= 448 (so dequantisation multiplies exactly), 1 for an all-zero block.

  e comes from the bits of r = amax / 448: its exponent, plus one unless r is a power of two.
  Integer work only, so the Pallas cache writer (pallas_kernels/paged_write.py) computes the
  same scales bit for bit: a kernel's float log2 may be the approximate instruction, whose
  error moves ceil(log2 r) by one near powers of two."""
  r = jnp.maximum(amax.astype(jnp.float32), 1e-30) / E4M3_MAX  # a normal float
  bits = lax.bitcast_convert_type(r, jnp.int32)
  exponent = (bits >> 23) + jnp.minimum(bits & 0x7FFFFF, 1)  # biased e: +1 unless r is 2^k
  scale = lax.bitcast_convert_type(exponent << 23, jnp.float32)
  return jnp.where(amax > 0, scale, 1.0)


def quantize_block(xb: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Blocks [..., block] float -> (codes float8_e4m3fn [..., block], scales float32 [...])."""
  xb = xb.astype(jnp.float32)
  scale = fp8_scale(jnp.max(jnp.abs(xb), axis=-1))
  return jnp.clip(xb / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn), scale


def quantize_fp8(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """[..., D] float -> (codes float8_e4m3fn [..., D], scales float32 [..., D // block])."""
  dim = x.shape[-1]
  block = fp8_block_size(dim)
  codes, scale = quantize_block(x.reshape(*x.shape[:-1], dim // block, block))
  return codes.reshape(x.shape), scale


def dequantize_fp8(codes: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
  """Inverse of `quantize_fp8`: (codes [..., D], scales [..., D // block]) -> float32 [..., D]."""
  dim = codes.shape[-1]
  block = dim // scale.shape[-1]
  xb = codes.astype(jnp.float32).reshape(*codes.shape[:-1], scale.shape[-1], block)
  return (xb * scale[..., None]).reshape(codes.shape)
