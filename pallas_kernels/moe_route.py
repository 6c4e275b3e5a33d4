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
from pallas_kernels.bf16_matmul import swiglu_tile
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.hfma2_planes import rows_launch, rows_program
from pallas_kernels.nvfp4_matmul import store_tile
from pallas_kernels.partials import split_sum


_SHARED_BLOCK = 64  # columns a program of the shared expert's hidden takes


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


def _route_row(row, partials_ref, bias_ref, ids_ref, weights_ref, *, experts: int, k: int,
               n_group: int, topk_group: int, normalize: bool, scaling: float):
  # partials_ref [S, n, E] f32 and bias_ref [E] f32, whole; ids_ref [n, k] i32 and weights_ref
  # [n, k] f32, whole: the program of token `row` writes its row.
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


def _route_kernel(*refs, **route):
  _route_row(pl.program_id(0), *refs, **route)


def _route_planes_kernel(partials_ref, bias_ref, a_ref, *refs, tokens: int, chunks: int, blocks: int, chunk: int,
                         shared: tuple[int, int] | None, **route):
  # Programs 0..tokens-1: _route_row's; then x's planes programs (row, chunk) in row order (x has
  # the tokens' rows); with shared (its columns, block), a program a column block of the shared
  # expert's hidden.
  g_ref, u_ref, ids_ref, weights_ref, planes_ref, amax_ref, *hidden_ref = refs if shared else (None, None, *refs)
  pid, planes_end = pl.program_id(0), tokens + tokens * chunks

  @pl.when(pid < tokens)
  def _():
    _route_row(pid, partials_ref, bias_ref, ids_ref, weights_ref, **route)

  @pl.when((pid >= tokens) & (pid < planes_end))
  def _():
    rows_program(a_ref, planes_ref, amax_ref, (pid - tokens) // chunks, (pid - tokens) % chunks, blocks=blocks,
                 chunk=chunk)

  if shared:
    width, block = shared

    @pl.when(pid >= planes_end)
    def _():
      cols = (pid - planes_end) * block + jnp.arange(block)
      rows_ok, cols_ok = jnp.arange(g_ref.shape[1]) < tokens, cols < width
      tile = pl.ds((pid - planes_end) * block, block)
      store_tile(hidden_ref[0].at[:, tile], swiglu_tile(g_ref, u_ref, tile, rows_ok, cols_ok), rows_ok, cols_ok)


def check_route_args(partials: jax.Array, bias: jax.Array, config: ModelConfig) -> None:
  """ValueError unless partials are f32 [S, n, E] and bias f32 [E] for the config's E experts."""
  e = config.n_routed_experts
  if partials.ndim != 3 or partials.shape[-1] != e or partials.dtype != jnp.float32:
    raise ValueError(f"route_select: partials must be f32 [splits, tokens, {e}], got "
                     f"{partials.dtype}{list(partials.shape)}")
  if bias.shape != (e,) or bias.dtype != jnp.float32:
    raise ValueError(f"route_select: bias must be f32 [{e}], got {bias.dtype}{list(bias.shape)}")


def _route_fields(config: ModelConfig) -> dict:
  return dict(experts=config.n_routed_experts, k=config.num_experts_per_tok, n_group=config.n_group,
              topk_group=config.topk_group, normalize=config.norm_topk_prob,
              scaling=float(config.routed_scaling_factor))


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
  n, k = partials.shape[1], config.num_experts_per_tok
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_route_kernel, **_route_fields(config)),
      grid=(n,),
      in_specs=[whole(partials.shape), whole(bias.shape)],
      out_specs=[whole((n, k)), whole((n, k))],
      out_shape=[jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="moe_route",
  )(partials, bias)


@functools.partial(jax.jit, static_argnames=("config", "chunk_lines", "interpret"))
def route_select_planes(partials: jax.Array, bias: jax.Array, config: ModelConfig, x: jax.Array, *,
                        shared: tuple[jax.Array, jax.Array] | None = None, chunk_lines: int | None = 128,
                        interpret: bool | None = None):
  """route_select and hfma2_planes.rows_planes(x, chunk_lines=chunk_lines) in one launch: the
  route's n programs beside x's planes programs (independent work that the routed experts'
  pairs_fused kernels need both of; `Runtime.route_planes`). Both are a few latency-bound
  programs (3.7 and 1.9 us in a TEP=8 rank's layer on an H100, run 40), so side by side the
  planes cost neither a launch nor, where they finish first, time (run 40: 5.5 -> 3.7 us).
  With shared, the shared expert's gate and up split-K partials f32 [S, n, I] from the router's
  GEMV launch (Runtime.router_group), more programs also compute its hidden silu(gate) * up in
  bf16 as the MLP does, op by op (bf16_matmul.swiglu_tile; `Runtime.shared_swiglu`), 64 columns
  a program: XLA's kernel between the two GEMVs otherwise (1.31 us in that layer; with it the
  route launch took 3.72 -> 3.84 us, run 41, H100). On a GPU Triton's exp may round a hidden
  value one bf16 ulp away from XLA's.

  Returns:
    (ids int32 [n, k], weights f32 [n, k], x's planes u32 [n * 8, K/16], their row maxima f32
    [n]), and with shared the hidden bf16 [n, I].
  """
  check_route_args(partials, bias, config)
  n, k = partials.shape[1], config.num_experts_per_tok
  if x.shape[0] != n:
    raise ValueError(f"route_select_planes: x must hold the partials' {n} tokens, got {list(x.shape)}")
  planes_of = lambda pid: (jnp.minimum(jnp.maximum(pid - n, 0) // rows.chunks, n - 1),
                           jnp.maximum(pid - n, 0) % rows.chunks)
  rows = rows_launch(x, chunk_lines, planes_of)
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  inputs, in_specs = [partials, bias, rows.lines], [whole(partials.shape), whole(bias.shape), rows.in_spec]
  out_specs = [whole((n, k)), whole((n, k)), *rows.out_specs]
  out_shape = [jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), jnp.float32), *rows.out_shape]
  programs, tiling = n + rows.rows * rows.chunks, None
  if shared is not None:
    gate, up = shared
    check_shared_args(gate, up, n)
    width = gate.shape[2]
    block = min(_SHARED_BLOCK, pl.next_power_of_2(width))
    padded = whole((gate.shape[0], pl.next_power_of_2(n), pl.cdiv(width, block) * block))
    inputs, in_specs = [*inputs, gate, up], [*in_specs, padded, padded]
    out_specs.append(whole((pl.next_power_of_2(n), pl.cdiv(width, block) * block)))
    out_shape.append(jax.ShapeDtypeStruct((n, width), jnp.bfloat16))
    programs, tiling = programs + pl.cdiv(width, block), (width, block)
  return pl.pallas_call(
      functools.partial(_route_planes_kernel, tokens=n, chunks=rows.chunks, blocks=rows.blocks, chunk=rows.chunk,
                        shared=tiling, **_route_fields(config)),
      grid=(programs,),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=resolve_interpret(interpret),
      name="moe_route_planes",
  )(*inputs)


def check_shared_args(gate: jax.Array, up: jax.Array, tokens: int) -> None:
  """ValueError unless the shared expert's gate and up partials are f32 [S, tokens, I] alike."""
  if gate.shape != up.shape or gate.ndim != 3 or gate.shape[1] != tokens or {gate.dtype, up.dtype} != {
      jnp.dtype(jnp.float32)}:
    raise ValueError(f"route_select_planes: shared must be f32 [splits, {tokens}, I] gate and up partials alike, "
                     f"got {gate.dtype}{list(gate.shape)} and {up.dtype}{list(up.shape)}")


def route_select_reference(partials: jax.Array, bias: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """The reference: the partials summed, then glmjax.moe.route."""
  return route(jnp.sum(partials, axis=0), bias, config)
