"""Pieces shared by the kernels: input and tuning checks (one wording, one place), and the
exact bf16 split of fp32 operands for the tensor cores.

Tuning dataclasses validate themselves with these; the wrappers check paged-cache operands
(values, their FP8 scales, page tables) before building BlockSpecs.
"""

import jax
import jax.numpy as jnp
from jax import lax

NUM_WARPS = (1, 2, 4, 8, 16)


def resolve_interpret(interpret: bool | None) -> bool:
  """A kernel wrapper's `interpret` argument: None means the Pallas interpreter on the CPU
  backend (no GPU to compile for), the compiled kernel elsewhere."""
  return jax.default_backend() == "cpu" if interpret is None else interpret


def is_pow2(v: int) -> bool:
  return v > 0 and v & (v - 1) == 0


def check_tile(owner: str, name: str, value: int, minimum: int = 16) -> None:
  """Triton tiles and tensor-core dots need power-of-two sizes of at least 16."""
  if not is_pow2(value) or value < minimum:
    raise ValueError(f"{owner}.{name} must be a power of two >= {minimum}, got {value}")


def check_at_least(owner: str, name: str, value: int, minimum: int = 1) -> None:
  if value < minimum:
    raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def check_choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
  """A tuning field that names one of a fixed set of variants."""
  if value not in choices:
    raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


def check_splits(owner: str, value: int | None, maximum: int) -> None:
  """Programs per row or sequence: None (picked from the problem size) or a power of two <= maximum."""
  if value is not None and (not is_pow2(value) or value > maximum):
    raise ValueError(f"{owner}.num_splits must be a power of two <= {maximum}, got {value}")


FOLD_SPLITS = ("fill", "rule")  # bf16_matmul.fold_config's named choices


def check_fold_splits(value) -> None:
  """Runtime.fold_splits / bf16_matmul.fold_config: a named choice or a split count >= 1."""
  if value not in FOLD_SPLITS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise ValueError(f"fold_splits must be one of {FOLD_SPLITS} or a split count >= 1, got {value!r}")


def check_launch(owner: str, num_warps: int, num_stages: int | None = None) -> None:
  """Triton launch parameters: warps per program and (where tuned) software-pipeline depth."""
  if num_warps not in NUM_WARPS:
    raise ValueError(f"{owner}.num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
  if num_stages is not None:
    check_at_least(owner, "num_stages", num_stages)


def check_paged(name: str, pages: jax.Array, scale_name: str, scales: jax.Array | None, dim: int,
                scale_cols: int) -> None:
  """pages [P, page_size, dim] bf16 with scales None, or e4m3 with f32 scales [P, page_size, scale_cols]."""
  if pages.ndim != 3 or pages.shape[-1] != dim:
    raise ValueError(f"{name} must be [P, page_size, {dim}], got {list(pages.shape)}")
  if pages.dtype == jnp.float8_e4m3fn:
    want = (*pages.shape[:2], scale_cols)
    if scales is None or scales.shape != want or scales.dtype != jnp.float32:
      raise ValueError(f"an FP8 {name} needs {scale_name} f32 {list(want)}, got "
                       f"{None if scales is None else list(scales.shape)}")
  elif pages.dtype == jnp.bfloat16:
    if scales is not None:
      raise ValueError(f"a bf16 {name} takes {scale_name}=None")
  else:
    raise ValueError(f"{name} must be bf16 or float8_e4m3fn, got {pages.dtype}")


def check_page_table(page_table: jax.Array, batch: int) -> None:
  if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
    raise ValueError(f"page_table must be int32 [{batch}, max_pages], got "
                     f"{page_table.dtype}{list(page_table.shape)}")


def bf16_parts(x: jax.Array) -> list[jax.Array]:
  """x as bf16 terms whose sum is exactly x, largest first: [x] for bf16, three for fp32.

  Why: a Triton fp32 dot at default precision rounds its inputs to tf32 (10 mantissa bits), and
  an IEEE one runs on the CUDA cores. Three bf16 terms hold all 24 bits of an fp32 value.
  """
  if x.dtype == jnp.bfloat16:
    return [x]
  parts = []
  rest = x
  for _ in range(3):
    part = rest.astype(jnp.bfloat16)
    parts.append(part)
    rest = rest - part.astype(jnp.float32)  # exact: part is rest rounded to 8 bits
  return parts


def parts_dot(parts: list[jax.Array], other: jax.Array, dimension_numbers, *,
              parts_on_right: bool = False) -> jax.Array:
  """sum_i dot(parts[i], other) (or dot(other, parts[i])) with fp32 accumulation, smallest term
  first, for a bf16 `other`.

  Each term's products are exact (8 x 8 bits), so over `bf16_parts` of an fp32 operand this is
  an fp32 dot up to summation order, on bf16 tensor cores (one MMA per term).
  """
  out = None
  for part in reversed(parts):
    lhs, rhs = (other, part) if parts_on_right else (part, other)
    term = lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32)
    out = term if out is None else out + term
  return out
