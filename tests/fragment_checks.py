"""The check behind the fragment GEMV's switches that must change no bit (they multiply the same
chunks in the same order): a random case, and its product with and without the switch."""

import jax.numpy as jnp
import numpy as np

from glmjax.quant import from_fragments, quantize_nvfp4, to_fragments
from pallas_kernels.nvfp4_fragments import FragmentConfig, fragment_matmul
from pallas_kernels.nvfp4_matmul import nvfp4_matmul_reference


def fragment_case(m: int, n: int, k: int, operands: str, seed: int):
  """x bf16 [m, k] and a random [n, k] weight quantized to NVFP4 in `operands`' fragment order."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  return x, to_fragments(quantize_nvfp4(jnp.asarray(rng.standard_normal((n, k)), jnp.float32)), operands)


def assert_same_product(x, f, switched: FragmentConfig, plain: FragmentConfig) -> None:
  """fragment_matmul under `switched` equals it under `plain` bit for bit, and the reference
  within bf16 rounding."""
  got = fragment_matmul(x, f, config=switched)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(fragment_matmul(x, f, config=plain),
                                                                          np.float32))
  want = np.asarray(nvfp4_matmul_reference(x, from_fragments(f)), np.float64)
  assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) <= 4e-3
