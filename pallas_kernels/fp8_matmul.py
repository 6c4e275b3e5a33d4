"""Weight-only block-FP8 matmul for decode: y [M, N] = x [M, K] @ dequant(w [N, K]).T, M <= 16.

Same design and lowering as nvfp4_matmul.py (read it first): Triton, grid (N / block_n,
split_k), a K loop of contiguous weight tiles, tensor-core dot with M padded to 16, fp32
accumulation. FP8 moves 8 bits per weight, so the ceiling is 2x XLA's bf16 GEMV and the target
(80% of copy bandwidth) 1.6x.

Scales: tiles are at most 128 x 128 and aligned, so each lies inside one 128x128 scale block and
its scale is one scalar: the e4m3 tile converts to bf16 exactly, the dot accumulates in fp32 and
the scalar multiplies the [M, block_n] partial product, not the weights. Per weight that leaves
one conversion: e4m3 -> bf16, or with MatmulConfig.operands="float16" e4m3 -> fp16, sm_90's packed
cvt (bf16 takes more instructions), against activations in fp16
(nvfp4_matmul.f16_rows). Measured (H200, [1, 8192] x [8192, 28672], fp16 operands): 67.2 us
of kernel time, 3.50 TB/s, 83% of copy, 1.60x XLA's bf16 GEMV (M = 8: 66.8 us, 1.69x); 74.9 us
loop-timed; bf16 operands 96.3 us (BENCHMARKS.md run 18).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from glmjax.quant.fp8_block import BLOCK, FP8BlockWeight
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.nvfp4_matmul import (MatmulConfig, check_skinny_input, check_tensor_core_config,
                                         default_config, dot_t, load_tile, operand_refs, operand_rows,
                                         range_mask, scale_rows, skinny_call, skinny_rows, split_k_loop,
                                         store_tile)


def check_fp8_config(config: MatmulConfig) -> None:
  """FP8 tiles must sit inside one scale block: block_n, block_k <= 128 (powers of two); the
  tensor cores multiply."""
  check_tensor_core_config(config, "fp8_matmul")
  if config.block_n > BLOCK or config.block_k > BLOCK:
    raise ValueError(f"FP8 block scales need block_n, block_k <= {BLOCK}, got "
                     f"{config.block_n}, {config.block_k}")


def default_fp8_config(m: int, n: int, k: int, *, operands: str = "bfloat16") -> MatmulConfig:
  """nvfp4_matmul.default_config's tiles, K steps capped at one scale block (128)."""
  return default_config(m, n, k, max_block_k=BLOCK, operands=operands)


def load_fp8_tile(w_ref, scale_ref, lead: tuple, n_block, step, *, block_n: int, block_k: int,
                  k: int, rows_ok: jax.Array | None, dtype) -> tuple[jax.Array, jax.Array]:
  """([bn, block_k] tile of K step `step` in `dtype` (bf16 or fp16: exact either way), its fp32
  block scale).

  w_ref: e4m3 [..., bn, Kp] (the program's row block); scale_ref: f32 [..., N/128, K/128] (whole);
  `lead` indexes the leading dims (an expert id); n_block is the program's row-block index.
  """
  w = load_tile(w_ref.at[(*lead, slice(None), pl.ds(step * block_k, block_k))], rows_ok,
                range_mask(step * block_k, block_k, k))
  scale = scale_ref[(*lead, n_block * block_n // BLOCK, step * block_k // BLOCK)]
  return w.astype(dtype), scale


def _fp8_matmul_kernel(*refs, m: int, n: int, k: int, block_m: int, config: MatmulConfig):
  # x_ref: [block_m, Kp] of [M, K], bf16 or (operands="float16") f16_rows' fp16, then its rows'
  # largest magnitudes f32 [block_m] of [M]; w_ref: e4m3 [bn, Kp]; scale_ref: f32 [N/128, K/128]; o_ref:
  # [block_m, bn] of the [split_k, M, N] output (fp32 or bf16).
  *x_refs, w_ref, scale_ref, o_ref = refs
  (x_ref,), row_amax = operand_refs(x_refs, config.operands == "float16")
  bn, bk = config.block_n, config.block_k
  rows_ok = range_mask(0, block_m, m)
  n_block = pl.program_id(0)
  n_ok = range_mask(n_block * bn, bn, n)

  def body(step, acc):
    x = load_tile(x_ref.at[:, pl.ds(step * bk, bk)], rows_ok, range_mask(step * bk, bk, k))
    w, scale = load_fp8_tile(w_ref, scale_ref, (), n_block, step, block_n=bn, block_k=bk, k=k,
                             rows_ok=n_ok, dtype=x_ref.dtype)
    return acc + dot_t(x, w) * scale

  acc = split_k_loop(body, k=k, block_m=block_m, config=config)
  store_tile(o_ref, scale_rows(acc, row_amax, rows_ok).astype(o_ref.dtype), rows_ok, n_ok)


def _fp8_matmul(x: jax.Array, w: FP8BlockWeight, config: MatmulConfig, interpret: bool) -> jax.Array:
  (m, k), n = x.shape, w.shape[0]
  bn, bk = config.block_n, config.block_k
  block_m = skinny_rows(m)
  kp = pl.cdiv(k, bk) * bk  # blocks may overhang the arrays: the overhang is masked
  xs = operand_rows(x, config.operands == "float16")
  kernel = functools.partial(_fp8_matmul_kernel, m=m, n=n, k=k, block_m=block_m, config=config)
  specs = [pl.BlockSpec((block_m, kp), lambda j, s: (0, 0)),
           *[pl.BlockSpec((block_m,), lambda j, s: (0,))] * (len(xs) - 1),
           pl.BlockSpec((bn, kp), lambda j, s: (j, 0)), pl.BlockSpec(w.scale_inv.shape, lambda j, s: (0, 0))]
  return skinny_call(kernel, [*xs, w.weight, w.scale_inv], specs, m=m, n=n, dtype=x.dtype, config=config,
                     interpret=interpret, name="fp8_matmul")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp8_matmul(x: jax.Array, w: FP8BlockWeight, *, config: MatmulConfig | None = None,
               interpret: bool | None = None) -> jax.Array:
  """x @ dequant(w).T with e4m3 weights converted in registers, fp32 accumulation.

  Args:
    x: bf16 [M, K], 1 <= M <= 16.
    w: FP8BlockWeight of logical shape [N, K] (any N, K).
    config: tiling (block_n, block_k <= 128); default `default_fp8_config(M, N, K)`.
    interpret: run the Pallas interpreter; default: on the CPU backend.
  Returns:
    bf16 [M, N].
  """
  if not isinstance(w, FP8BlockWeight):
    raise ValueError(f"fp8_matmul needs an FP8BlockWeight, got {type(w).__name__}")
  check_skinny_input(x, w.shape, "fp8_matmul")
  config = default_fp8_config(x.shape[0], *w.shape) if config is None else config
  check_fp8_config(config)
  interpret = resolve_interpret(interpret)
  return _fp8_matmul(x, w, config, interpret)


def fp8_matmul_reference(x: jax.Array, w: FP8BlockWeight) -> jax.Array:
  """fp32 reference: dequantize in fp32, matmul in fp32, cast to x.dtype."""
  return jnp.dot(x.astype(jnp.float32), w.dequantize(jnp.float32).T,
                 precision=lax.Precision.HIGHEST).astype(x.dtype)
