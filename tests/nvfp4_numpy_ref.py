"""Independent numpy implementation of ModelOpt NVFP4 and 128x128 block FP8, for the tests.

Written from the format description (NOTES.md "Formats", ModelOpt's quantizer), not from
glmjax.quant: the E2M1 values come from the bit fields, rounding is nearest-grid-point with ties
to the even code, packing is arithmetic, FP8 blocks are visited one by one. e4m3 casts use
ml_dtypes, which is independent of XLA.
"""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


def e2m1_value(code: np.ndarray) -> np.ndarray:
  """Value of 4-bit codes: sign bit 3, exponent bits 2-1, mantissa bit 0 (bias 1, no inf/NaN)."""
  code = np.asarray(code, np.int64)
  sign = np.where(code & 8, -1.0, 1.0)
  exponent, mantissa = (code >> 1) & 3, code & 1
  magnitude = np.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))
  return (sign * magnitude).astype(np.float32)


GRID = e2m1_value(np.arange(8))  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def e2m1_round(v: np.ndarray) -> np.ndarray:
  """fp32 -> codes: nearest grid magnitude (ties to the even code, beyond 6 -> 6), sign = v < 0."""
  v = np.asarray(v, np.float32)
  dist = np.abs(np.abs(v)[..., None].astype(np.float64) - GRID)
  nearest = dist == dist.min(axis=-1, keepdims=True)
  # Among (at most two adjacent) nearest codes take the even one.
  even_first = nearest & (np.arange(8) % 2 == 0)
  choice = np.where(even_first.any(axis=-1), even_first.argmax(axis=-1), nearest.argmax(axis=-1))
  return (choice + 8 * (v < 0)).astype(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
  """codes [..., K] -> bytes [..., K/2]: code 2j in the low nibble of byte j, 2j+1 in the high."""
  codes = np.asarray(codes, np.int64)
  return (codes[..., 0::2] + 16 * codes[..., 1::2]).astype(np.uint8)


def unpack(packed: np.ndarray) -> np.ndarray:
  high, low = np.divmod(np.asarray(packed, np.int64), 16)
  out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
  out[..., 0::2], out[..., 1::2] = low, high
  return out


def quantize_nvfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
  """2-D fp32 [out, in] -> (packed uint8 [out, in/2], block scale e4m3 [out, in/16], scale_2)."""
  w = np.asarray(w, np.float32)
  out, k = w.shape
  scale_2 = np.float32(np.abs(w).max()) / np.float32(6 * 448)
  blocks = w.reshape(out, k // 16, 16)
  amax = np.abs(blocks).max(axis=-1)
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio = amax / (np.float32(6) * scale_2)
  block_scale = np.where(amax > 0, ratio, np.float32(1)).astype(E4M3)
  scale = block_scale.astype(np.float32) * scale_2
  with np.errstate(divide="ignore", invalid="ignore"):
    scaled = np.where(scale[..., None] > 0, blocks / scale[..., None], np.float32(0))
  return pack(e2m1_round(scaled).reshape(out, k)), block_scale, scale_2


def dequantize_nvfp4(packed: np.ndarray, block_scale: np.ndarray, scale_2) -> np.ndarray:
  """fp32 [out, in] = value(code) * float(block scale) * scale_2."""
  values = e2m1_value(unpack(packed))
  scale = np.repeat(np.asarray(block_scale).astype(np.float32), 16, axis=-1)
  return values * scale * np.float32(scale_2)


def quantize_fp8_block(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
  """2-D fp32 [out, in] -> (e4m3 [out, in], scale_inv fp32 [ceil(out/128), ceil(in/128)])."""
  w = np.asarray(w, np.float32)
  out, k = w.shape
  nb, kb = -(-out // block), -(-k // block)
  codes = np.zeros((out, k), E4M3)
  scale_inv = np.zeros((nb, kb), np.float32)
  for i in range(nb):
    for j in range(kb):
      tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
      s = np.float32(np.abs(tile).max()) / np.float32(448)
      scale_inv[i, j] = s
      q = tile / s if s > 0 else np.zeros_like(tile)
      codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = np.clip(q, -448, 448).astype(E4M3)
  return codes, scale_inv


def dequantize_fp8_block(codes: np.ndarray, scale_inv: np.ndarray, block: int = 128) -> np.ndarray:
  out = np.asarray(codes).astype(np.float32)
  for i in range(scale_inv.shape[0]):
    for j in range(scale_inv.shape[1]):
      out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale_inv[i, j]
  return out
