"""FP8 e4m3 storage for the KV and indexer-key caches (FlashMLA / DeepSeek-V3.2 layout).

Each token's vector is cut into blocks of `block` values (128 for GLM-5); a block stores e4m3
codes and one fp32 scale that is a power of two, so dequantisation (`code * scale`) is exact in
fp32 and a page re-quantised from its own dequantised values reproduces itself bit for bit.
GLM-5 per token: 512 latent codes + 4 scales + 64 bf16 RoPE values = 656 bytes; indexer key:
128 codes + 1 scale = 132 bytes.
"""

import jax.numpy as jnp

E4M3_MAX = 448.0


def fp8_block_size(dim: int) -> int:
  """Scale-block length for a vector of `dim` values: 128, or `dim` itself when smaller."""
  block = min(128, dim)
  if dim % block:
    raise ValueError(f"FP8 cache needs a dimension divisible by {block}, got {dim}")
  return block


def quantize_fp8(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """[..., D] float -> (codes float8_e4m3fn [..., D], scales float32 [..., D // block])."""
  dim = x.shape[-1]
  block = fp8_block_size(dim)
  xb = x.astype(jnp.float32).reshape(*x.shape[:-1], dim // block, block)
  amax = jnp.max(jnp.abs(xb), axis=-1)
  # Power-of-two scale: the smallest 2^e with amax / 2^e <= 448 (exact multiply on dequant).
  exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / E4M3_MAX))
  scale = jnp.where(amax > 0, jnp.exp2(exponent), 1.0).astype(jnp.float32)
  codes = jnp.clip(xb / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  return codes.reshape(x.shape), scale


def dequantize_fp8(codes: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
  """Inverse of `quantize_fp8`: (codes [..., D], scales [..., D // block]) -> float32 [..., D]."""
  dim = codes.shape[-1]
  block = dim // scale.shape[-1]
  xb = codes.astype(jnp.float32).reshape(*codes.shape[:-1], scale.shape[-1], block)
  return (xb * scale[..., None]).reshape(codes.shape)
