"""A residual add and the RMSNorm after it in one launch, from a GEMV's partials.

glmjax.model.DecoderLayer adds attention's output to the residual stream, x + o_proj(attn), and
normalises the sum for the MLP (post_attention_layernorm). On the H200 that is two XLA kernels of
a TEP=8 rank's layer after o_proj's split-K GEMV: the partials' sum with the add (one fusion),
then the norm's reduction and scale (another; BENCHMARKS.md run 24's map), about 3.7 us. Here one
program per token sums o_proj's partials, rounds them to the activations' dtype (o_proj's
output), adds the residual row, stores it, and normalises it: one launch. Measured there (run
24): one launch fewer but no time saved, 5.6 us against XLA's 3.8 in two: each program reads a
token's 8 split rows of 6144 (4.05 us alone; 2.28 with one split, TEP's case after the
all-reduce; 8 warps the fastest of 4-32). So o_proj's GEMV takes the fewest K splits that
cover the SMs under this fold, 2 at a TEP=8 rank (`Runtime.fold_splits`; run 35, H100: GEMV +
norm 17.5 -> 13.4 us, the norm in the step 5.36 -> 3.51).

The same launch closes a decoder layer (`Runtime.next_norm`): the MLP's output added to the
residual stream with the next layer's input_layernorm (after the last layer, the final norm),
from the shared expert's down GEMV partials and, as `term`, the routed experts' down partials. In
XLA that is the add (with the split sums) and then the norm, two kernels a layer (1.7 and 2.0 us
in a TEP=8 rank's layer on an H100, run 39); given the routed experts' output summed, XLA kept
their sum as a kernel of its own (1.5 us; session 33, call 1).

Numerics: as the model computes them: the partials' sum rounded to dtype (and the term added in
dtype), the add in the residual's dtype, RMSNorm's statistics in fp32 and its scale in dtype.
Equal to the XLA path wherever the partials' sums round alike (split order here, XLA's there)
and the fp32 statistics do. Switches: `Runtime.residual_norm`, `Runtime.next_norm` ("xla" |
"pallas").

Lowering: Triton: one row of a few thousand values a program (6144 at GLM-5), a reduction and
elementwise work in registers; eight warps keep the padded row at 32 values a thread.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax import layers
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.partials import check_partials, rms_normed, split_sum


def _residual_norm_kernel(residual_ref, partials_ref, *refs, eps: float, has_term: bool):
  # residual_ref [n, D] ; partials_ref, term_ref (has_term) f32 [S, n, D] (or bf16 [1, n, D]) ;
  # weight_ref [D] ; x_out_ref [n, D] (the residual's dtype) ; h_out_ref [n, D] (dtype): all whole,
  # each program its row.
  term_ref, weight_ref, x_out_ref, h_out_ref = refs if has_term else (None, *refs)
  row = pl.program_id(0)
  width = residual_ref.shape[-1]
  pad = pl.next_power_of_2(width)
  ok = jnp.arange(pad) < width
  out = split_sum(partials_ref, row, 0, pad, ok).astype(h_out_ref.dtype)
  if has_term:  # term + the partials' output, a sum in dtype
    term = split_sum(term_ref, row, 0, pad, ok).astype(h_out_ref.dtype)
    out = (term.astype(jnp.float32) + out.astype(jnp.float32)).astype(h_out_ref.dtype)
  residual = pltriton.load(residual_ref.at[row, pl.ds(0, pad)], mask=ok, other=0.0)
  x = (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(x_out_ref.dtype)
  pltriton.store(x_out_ref.at[row, pl.ds(0, pad)], x, mask=ok)
  h = rms_normed(x.astype(jnp.float32), weight_ref, ok, width, eps, h_out_ref.dtype)
  pltriton.store(h_out_ref.at[row, pl.ds(0, pad)], h, mask=ok)


def check_residual_norm_args(residual: jax.Array, partials: jax.Array, weight: jax.Array,
                             term: jax.Array | None = None) -> None:
  """ValueError naming the argument whose shape or dtype does not fit."""
  if residual.ndim != 2 or residual.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"residual_norm: residual must be bf16 or f32 [tokens, D], got {residual.dtype}"
                     f"{list(residual.shape)}")
  for name, terms in (("partials", partials), ("term", term)):
    if terms is None:
      continue
    check_partials("residual_norm", name, terms, str(residual.shape[1]), dtypes=("float32", "bfloat16"))
    if terms.shape[1:] != residual.shape:
      raise ValueError(f"residual_norm: {name} must be [splits, {residual.shape[0]}, {residual.shape[1]}], "
                       f"got {list(terms.shape)}")
    if terms.dtype != jnp.float32 and terms.shape[0] != 1:
      raise ValueError(f"residual_norm: bf16 {name} must be one split (a sum already rounded), got "
                       f"{terms.shape[0]}")
  if weight.shape != residual.shape[1:]:
    raise ValueError(f"residual_norm: weight must be [{residual.shape[1]}], got {list(weight.shape)}")


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "num_warps", "interpret"))
def residual_norm(residual: jax.Array, partials: jax.Array, weight: jax.Array, *, eps: float, dtype=jnp.bfloat16,
                  term: jax.Array | None = None, num_warps: int = 8,
                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """residual_norm_reference in one launch (module docstring).

  Args:
    residual: [n, D], bf16 or f32: the residual stream's rows.
    partials: f32 [S, n, D]: o_proj's split-K partial outputs (S = 1: the output); or bf16
      [1, n, D], the output already rounded (a TEP rank's after the all-reduce).
    weight: the norm's [D] (post_attention_layernorm's; the next layer's input_layernorm's).
    eps: its epsilon.
    dtype: the activations' dtype (the model's; the partials' output and the norm's).
    term: None, or the partials of another output the residual gains (as `partials`), their
      sum rounded to dtype and added to the partials' in dtype (the routed experts' beside the
      shared expert's).
    num_warps: a program's warps (Triton).
  Returns:
    (the new residual [n, D] in residual's dtype, its norm [n, D] in dtype).
  """
  check_residual_norm_args(residual, partials, weight, term)
  n, width = residual.shape
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  inputs = (residual, partials, *(() if term is None else (term,)), weight)
  return pl.pallas_call(
      functools.partial(_residual_norm_kernel, eps=eps, has_term=term is not None),
      grid=(n,),
      in_specs=[whole(a.shape) for a in inputs],
      out_specs=[whole((n, width))] * 2,
      out_shape=[jax.ShapeDtypeStruct((n, width), residual.dtype), jax.ShapeDtypeStruct((n, width), dtype)],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="residual_norm",
  )(*inputs)


def residual_norm_reference(residual: jax.Array, partials: jax.Array, weight: jax.Array, *, eps: float,
                            dtype=jnp.bfloat16, term: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The XLA path (DecoderLayer's, MoE's): the partials summed and rounded to dtype, the term
  added in dtype, the sum added to the residual in its dtype, then the norm."""
  check_residual_norm_args(residual, partials, weight, term)
  out = jnp.sum(partials, axis=0).astype(dtype)
  if term is not None:
    out = jnp.sum(term, axis=0).astype(dtype) + out
  x = residual + out.astype(residual.dtype)
  return x, layers.rms_norm(x, weight, eps, dtype)
