"""The MoE router's expert choice in one launch: split-K partial logits -> top-k ids and weights.

glmjax.moe.route (the reference) is, on the H200, five XLA kernels a decoder layer after the
router's GEMV (the split-K sum with the sigmoid and bias; a sort for lax.top_k of 8 among 256
experts; the chosen scores' gather, fused with the MoE kernels' pair count; their normalisation
and scale; the ids' slice): about 10 us of a TEP=8 rank's layer for 5 tokens, 4.0 of them the
sort (docs/STUDY.md, run 21's launch map). Here one
program per token sums the GEMV's fp32 partials, takes the sigmoid, adds the choice-only bias,
keeps the topk_group best groups (by the sum of each group's two best biased scores) when
n_group > 1, and picks the k best experts by k max-reductions over the row, the lower index
first among equal scores, as lax.top_k does; the weights are the chosen unbiased scores,
renormalised (+1e-20) when norm_topk_prob and scaled by routed_scaling_factor.

The same choices as the reference wherever the summed logits are equal: the partials are summed
in split order here, in XLA's order there, so a tie broken by one ulp of a logit can differ.
Switch: `Runtime.router` ("xla" | "pallas"; --router on the experiments). On the H200: 3.2 us of
kernel time against XLA's 4.8-5.0 alone, 3.7 in the step (BENCHMARKS.md run 22).

Lowering: Triton: a few hundred scores a row, reductions and masked stores within one program;
nothing here for Mosaic GPU's TMA and wgmma to do.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.config import ModelConfig
from glmjax.moe import route
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.partials import split_sum


def _pow2(v: int) -> int:
  return 1 << max(0, v - 1).bit_length()


def _first_max(values: jax.Array, col: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """(max of values, the lowest column holding it): lax.top_k's order among equal values."""
  best = jnp.max(values)
  return best, jnp.min(jnp.where(values == best, col, width))


def _group_mask(choice: jax.Array, col: jax.Array, *, n_group: int, topk_group: int, experts: int) -> jax.Array:
  """True on the columns of the topk_group groups whose two best choice scores sum highest."""
  width, size = choice.shape[0], experts // n_group
  gcol = jnp.arange(_pow2(n_group), dtype=jnp.int32)
  group_scores = jnp.full(gcol.shape, -jnp.inf, jnp.float32)
  for g in range(n_group):
    member = (col >= g * size) & (col < (g + 1) * size)
    first, at = _first_max(jnp.where(member, choice, -jnp.inf), col, width)
    second = jnp.max(jnp.where(member & (col != at), choice, -jnp.inf))
    group_scores = jnp.where(gcol == g, first + second, group_scores)
  keep = jnp.zeros(col.shape, jnp.bool_)
  for _ in range(topk_group):
    _, g = _first_max(group_scores, gcol, gcol.shape[0])
    keep |= (col >= g * size) & (col < (g + 1) * size)
    group_scores = jnp.where(gcol == g, -jnp.inf, group_scores)
  return keep


def _route_kernel(partials_ref, bias_ref, ids_ref, weights_ref, *, experts: int, k: int,
                  n_group: int, topk_group: int, normalize: bool, scaling: float):
  # partials_ref [S, n, E] f32 and bias_ref [E] f32, whole; ids_ref [n, k] i32 and weights_ref
  # [n, k] f32, whole: this program (token `row`) writes its row.
  row = pl.program_id(0)
  width = _pow2(experts)
  col = jnp.arange(width, dtype=jnp.int32)
  valid = col < experts
  scores = jax.nn.sigmoid(split_sum(partials_ref, row, 0, width, valid))
  bias = pltriton.load(bias_ref.at[pl.ds(0, width)], mask=valid, other=0.0)
  choice = jnp.where(valid, scores + bias, -jnp.inf)
  if topk_group < n_group:
    choice = jnp.where(_group_mask(choice, col, n_group=n_group, topk_group=topk_group, experts=experts),
                       choice, -jnp.inf)
  slot = jnp.arange(_pow2(k), dtype=jnp.int32)
  ids = jnp.zeros(slot.shape, jnp.int32)
  weights = jnp.zeros(slot.shape, jnp.float32)
  for j in range(k):
    _, at = _first_max(choice, col, width)
    chosen = col == at
    ids = jnp.where(slot == j, at, ids)
    weights = jnp.where(slot == j, jnp.sum(jnp.where(chosen, scores, 0.0)), weights)
    choice = jnp.where(chosen, -jnp.inf, choice)
  if normalize:
    weights = weights / (jnp.sum(weights) + 1e-20)
  used = slot < k
  pltriton.store(ids_ref.at[row, pl.ds(0, slot.shape[0])], ids, mask=used)
  pltriton.store(weights_ref.at[row, pl.ds(0, slot.shape[0])], weights * scaling, mask=used)


def check_route_args(partials: jax.Array, bias: jax.Array, config: ModelConfig) -> None:
  """ValueError unless partials are f32 [S, n, E] and bias f32 [E] for the config's E experts."""
  e = config.n_routed_experts
  if partials.ndim != 3 or partials.shape[-1] != e or partials.dtype != jnp.float32:
    raise ValueError(f"route_select: partials must be f32 [splits, tokens, {e}], got "
                     f"{partials.dtype}{list(partials.shape)}")
  if bias.shape != (e,) or bias.dtype != jnp.float32:
    raise ValueError(f"route_select: bias must be f32 [{e}], got {bias.dtype}{list(bias.shape)}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def route_select(partials: jax.Array, bias: jax.Array, config: ModelConfig, *,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """glmjax.moe.route(partials.sum(0), bias, config) in one launch (module docstring).

  Args:
    partials: f32 [S, n, E]: the router GEMV's split-K partial logits (S = 1: the logits).
    bias: f32 [E]: the choice-only correction bias.
    config: the model's routing fields (n_routed_experts, num_experts_per_tok, n_group,
      topk_group, norm_topk_prob, routed_scaling_factor).
    interpret: run the Pallas interpreter; None: only on a CPU backend.
  Returns:
    (expert ids int32 [n, k], weights f32 [n, k]).
  """
  check_route_args(partials, bias, config)
  n, e = partials.shape[1:]
  k = config.num_experts_per_tok
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  kernel = functools.partial(_route_kernel, experts=e, k=k, n_group=config.n_group,
                             topk_group=config.topk_group, normalize=config.norm_topk_prob,
                             scaling=float(config.routed_scaling_factor))
  return pl.pallas_call(
      kernel,
      grid=(n,),
      in_specs=[whole(partials.shape), whole(bias.shape)],
      out_specs=[whole((n, k)), whole((n, k))],
      out_shape=[jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="moe_route",
  )(partials, bias)


def route_select_reference(partials: jax.Array, bias: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """The reference: the partials summed, then glmjax.moe.route."""
  return route(jnp.sum(partials, axis=0), bias, config)
