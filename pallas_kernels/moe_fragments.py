"""Routed-expert MLP of a decode step on the fragment GEMV: each chosen expert's weights read once,
by the tensor cores, for all the step's tokens at once.

  out[t] = sum_s w[t,s] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t,s] in [0, E)

Why: nvfp4_fragments' program (weights stored in mma.sync's fragment order, decoded in the lanes
that multiply them) streams one weight at 75% of copy speed where the CUDA-core pairs of
moe_hfma2 reach 51% at one TEP=8 rank's experts (BENCHMARKS.md run 27), and an expert that two
tokens chose is read once, not once a token: the tokens are the MMA's N, which pads to 8 anyway.

The chosen experts are found in-kernel, with no XLA routing table: every program loads the step's
T*k ids (a few hundred bytes), marks the local experts any id names (0 <= id < E) and ranks them;
slot s is the s-th of them in id order, `count` of them. Programs loop over the slots, so a
launch has the grid of one expert's weights whatever the choice, and no program waits on an
expert nobody chose.

  gate_up: program (row block j of gate's then up's tiles, K split s): for each slot, the rows'
           sums against every token (bf16 operands: x's rows read as they are), scaled by the
           expert's global scale, at [slot, s, token, row] of fp32 partials (slots >= count
           unwritten).
  swiglu:  h = silu(sum_s g) * sum_s u, bf16 [slot, token, I], a program per chosen slot and
           token (`swiglu`), and each slot's routing weights [slot, token]; or, with
           ExpertsConfig.fused_swiglu, none: gate_up's programs run the whole K for the same rows
           of gate and up and store h (and row block 0's the routing weights) themselves.
  down:    program (row block j, K split s): for each slot, the rows' sums against h[slot],
           times the expert's global scale and each token's routing weight for it (zero where the
           token did not choose it), summed over the slots in registers: fp32 partials [S * groups,
           T, D], summed by XLA (or by a kernel that takes them: `keep_partials`).

Weights: `to_fragments` of the stacked NVFP4 experts, on either operand dtype (the three alike):
- bfloat16: x's and h's rows read as they are (no launch before gate/up);
- float16: fewer instructions a weight's decode (nvfp4_fragments: 9 a word of 8 codes against
  11), but x and h must be scaled into fp16 by their rows' maxima and laid out as the MMA's B
  fragments: x by activations_kernel, a launch before gate/up; h by the swiglu launch, which
  holds whole rows (so fused_swiglu, whose programs hold a few of a row's columns, cannot).
  On an H100 that costs more than it saves (BENCHMARKS.md run 46: 249.4 against 224.7 us at the
  issue's case, 84.8 against 75.5 at a rank's view).
Numerics are nvfp4_fragments': exact products, fp32 sums; h is rounded to bf16 as the model's
expert MLP rounds it (and then scaled into fp16 exactly, but for entries under 2^-31 of its row's
largest, f16_rows). The reference is moe_grouped_matmul_reference (the model's expert MLP in fp32).
Lowering: Triton, as nvfp4_fragments and for its reason (loads, inline-PTX MMAs on registers the
program states, a store; Mosaic GPU's wgmma wants 64-row operands from shared memory); the
interpreter runs the MMAs' jnp twin.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.quant.fragments import CHUNK, OPERANDS, FragmentWeight
from pallas_kernels.checks import check_at_least, resolve_interpret
from pallas_kernels.moe_grouped_matmul import check_moe_inputs
from pallas_kernels.moe_hfma2 import strided_loop, strided_share
from pallas_kernels.nvfp4_fragments import (BF16_SCALE, TOKENS, FragmentConfig, FragmentOps, Lanes, activation_words,
                                            activations_kernel, fragment_ops, fragment_sums, group_starts,
                                            mask_and, operand_scale, split_chunks, split_size, store_row_words,
                                            store_rows, zero_sums)


# The launches' defaults, the fastest of BENCHMARKS.md runs 44 (H100) and 45 (H200) at 5 tokens,
# top-8, GLM-5's experts, and against run 48's 18 others (H100): gate/up in 4-tile programs over
# 2 K splits, down in 2-tile programs over the whole K; run 49 (H100): x's rows loaded 16 bytes a
# lane by gate/up, h's 4 bytes by down (FragmentConfig.wide_x).
GATE_UP = FragmentConfig(tiles=4, num_warps=2, split_k=2, unroll=2, tile_groups=2)
DOWN = FragmentConfig(tiles=2, num_warps=1, split_k=1, unroll=2, tile_groups=2, wide_x=False)
FUSED_GATE_UP = FragmentConfig(tiles=2, num_warps=1, unroll=2, tile_groups=2)


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
  """Each launch's FragmentConfig (tiles a program, K splits, warps, chunks a loop step); None:
  GATE_UP / DOWN (FUSED_GATE_UP under fused_swiglu). groups: programs sharing a row block and K
  split, each taking every groups-th chosen expert: a program walks its experts one after
  another, so more groups put more of them in flight (down's partials then [S * groups, T, D]).
  down_groups: the down launch's groups (None: groups). The launches differ in programs a group
  and in registers a thread. The down launch's 8 groups (1,536 one-warp programs) took 67 us on
  an H100 at the issue's case, 6, 10 or 13 groups 78 (runs 47-48, 156 registers: 0.97 waves); its
  routing weights now come from the swiglu launch (store_routing_weights), about 60 registers
  fewer. gate/up's 12 (1,536 two-warp programs) take 122-124 us against 8's 133 since its x loads
  are wide (run 49; 80 registers by ptxas on the CPU: 12 programs an SM, 0.97 waves), 16 122.5.
  fused_swiglu: the gate/up launch runs the whole K in each program, gate's rows in its first
  tile group and up's same rows in its second, and stores h = silu(g) * u itself: no swiglu
  launch, no fp32 partials (gate_up: split_k 1 and 2 tile groups).
  stream: a program's experts as one K loop (stream_sums) instead of a loop per expert, so its
  loads (and under FragmentConfig.prefetch the next step's) run on from one expert into the next
  where each expert's loop would start empty and end with its last MMAs. On an H100 213.0 us
  against the defaults' 214.7-216.0 at the issue's case (BENCHMARKS.md run 47), within the noise:
  off by default; not with fused_swiglu.

  Defaults measured (BENCHMARKS.md runs 44-45, own us; run 49 below), 5 tokens, top-8: all 32 experts local,
  24 chosen (510 MB), on an H200 211.7, the best of 10 configs there, against the pairs' 347.8
  (2.41 TB/s: 57% of the H200's 4.22 TB/s copy, 53% of its 4.57 TB/s read stream); on an H100
  228.0 against session 37's defaults' 348.5 and the pairs' 399.4. One TEP=8 rank's view, 6
  chosen (127.5 MB): H200 72.6 against the pairs' 56.3, H100 75.1 against 63.9 (each expert
  chosen by one token there: nothing to share). Run 49 (H100), the issue's case: these launches'
  own times sum to about 196 us (gate/up 122.2, down 65.75, swiglu 6.1, the sum 1.7, each timed
  in a tree whose kernel is this one), against the old defaults' 208.9-210.6."""
  gate_up: FragmentConfig | None = None
  down: FragmentConfig | None = None
  groups: int = 12
  down_groups: int | None = 8
  fused_swiglu: bool = False
  stream: bool = False

  def __post_init__(self):
    check_at_least("ExpertsConfig", "groups", self.groups)
    if self.down_groups is not None:
      check_at_least("ExpertsConfig", "down_groups", self.down_groups)
    if self.stream and self.fused_swiglu:
      raise ValueError("ExpertsConfig.stream runs the gate/up and down launches' experts as one K loop each; "
                       "fused_swiglu's launch has no such loop: set one of them")
    if self.stream and any(c is not None and c.l2_ahead for c in (self.gate_up, self.down)):
      raise ValueError("ExpertsConfig.stream's one K loop over a program's experts has no L2 prefetches: "
                       "FragmentConfig.l2_ahead needs stream=False")
    if self.fused_swiglu and self.gate_up is not None and (self.gate_up.split_k, self.gate_up.tile_groups) != (1, 2):
      raise ValueError(f"ExpertsConfig.fused_swiglu takes gate's and up's rows as a program's two tile groups over "
                       f"the whole K: gate_up needs split_k=1 and tile_groups=2, got {self.gate_up}")

  def resolved(self) -> tuple[FragmentConfig, FragmentConfig]:
    plain = lambda c: dataclasses.replace(c, rows_out=False, final_out=False)
    gate_up = self.gate_up or (FUSED_GATE_UP if self.fused_swiglu else GATE_UP)
    return plain(gate_up), plain(self.down or DOWN)


def default_experts_config(chosen: float | None = None) -> ExpertsConfig:
  """ExpertsConfig for a step expected to choose `chosen` distinct local experts (None: all):
  gate/up over 4 K splits where at most half of its program groups get an expert, so the idle
  groups' share of the card goes to more splits of the busy ones; else the defaults. Measured on
  an H100 (BENCHMARKS.md run 51, a TEP=8 rank's view, 6 of 32 experts chosen): 75.5 -> 66.0 us,
  the pairs' 63.2 (in the run's 6-group arm the swiglu launch, which sums the splits, took 5.1 ->
  7.9 us of it); at issue 6's case (24 chosen) 4 splits lose to 2 (run 45, H200: 217.4 against
  211.7)."""
  config = ExpertsConfig()
  if chosen is not None and chosen <= config.groups // 2:
    config = dataclasses.replace(config, gate_up=dataclasses.replace(GATE_UP, split_k=4))
  return config


def chosen_experts(ids_ref, *, slots: int, experts: int):
  """(count, expert_of): the local experts the step's [slots] ids name, and expert_of(s) -> the
  s-th of them in id order (s < count), from ids_ref read whole (padded past `slots`)."""
  s = jnp.arange(ids_ref.shape[0])
  ids = pltriton.load(ids_ref, mask=s < slots, other=-1)
  e = jnp.arange(pl.next_power_of_2(experts))
  named = jnp.max(jnp.where(ids[:, None] == e[None, :], 1, 0), axis=0)
  present = jnp.where(e < experts, named, 0)
  rank = jnp.cumsum(present) - present  # chosen experts before e
  return jnp.sum(present), lambda slot: jnp.sum(jnp.where((present == 1) & (rank == slot), e, 0))


def store_routing_weights(ids_ref, weights_ref, rw_ref, slot, expert, *, m: int, top_k: int) -> None:
  """rw_ref[slot * TOKENS + t]: the routing weight token t gives `expert`, the sum of its top_k
  weights whose ids name it (0 if none, and for t >= m), for the down launch to read one word a
  sum: working it out there from the ids took a lane 2 top_k loads a sum and about 60 of its
  program's registers (ptxas 13.0 on the CPU counts 130 -> 66; Nsight Compute counted 156 before,
  BENCHMARKS.md run 48)."""
  t, j = jnp.arange(TOKENS)[:, None], jnp.arange(pl.next_power_of_2(top_k))[None, :]
  ok = (t < m) & (j < top_k)
  index = jnp.where(ok, t * top_k + j, 0)
  ids = pltriton.load(ids_ref.at[index], mask=ok, other=-1)
  weights = pltriton.load(weights_ref.at[index], mask=ok, other=0.0)
  pltriton.store(rw_ref.at[slot * TOKENS + jnp.arange(TOKENS)], jnp.sum(jnp.where(ids == expert, weights, 0.0), axis=1))


def stream_sums(ops: FragmentOps, split, *, count, group, groups: int, expert_of, x_base_of, finish, state,
                chunks: int, config: FragmentConfig):
  """The program's share of the `count` chosen slots (as strided_loop's: s = group, group +
  groups, ...; expert_of(s), x from x_base_of(s)) over K split `split` as one loop of `steps`
  steps a slot, so the loads run on from one expert into the next (and, under config.prefetch,
  each step's loads go out before the previous step's MMAs, across experts too). After slot s's
  last step finish(s, e, accs, state) -> state, and its accs restart at zero. Every slot takes
  ceil(split chunks / unroll) steps; chunks past a split's end (a ragged split or unroll) load
  masked zeros, which add nothing. expert_of runs only where a step starts a slot. Returns the
  state."""
  trips, slot_of = strided_share(count, group, groups)
  begin, end = split_chunks(split, chunks, config)
  per_split = split_size(chunks, config)
  steps = pl.cdiv(per_split, config.unroll)
  ragged = bool(chunks % config.split_k or per_split % config.unroll)
  total, n = trips * steps, jnp.int32(steps)  # lax.rem / div: q >= 0, and Triton wants one int type
  slot_at = lambda q: slot_of(lax.div(q, n))  # step q's slot
  zeros = zero_sums(config)

  def expert_of_step(q, e):  # the expert of step q, given step q - 1's
    return lax.cond(lax.rem(q, n) == 0, lambda: expert_of(slot_at(q)), lambda: e)

  def step_loads(q, e, valid=None) -> list:
    c0 = begin + lax.rem(q, n) * config.unroll
    masks = [mask_and(valid, (c0 + u < end) if ragged else None) for u in range(config.unroll)]
    return [ops.chunk(jnp.minimum(c0 + u, end - 1), e, x_base_of(slot_at(q)), mask)
            for u, mask in enumerate(masks)]

  def multiply(q, e, accs, state, loads):
    for chunk_loads in loads:
      accs = ops.multiply(accs, chunk_loads)
    close = lambda accs, state: (zeros, finish(slot_at(q), e, accs, state))
    return lax.cond(lax.rem(q, n) == steps - 1, close, lambda accs, state: (accs, state), accs, state)

  def prefetched(q, carry):  # carry: step q's loads and expert
    accs, state, loads, e = carry
    ahead_e = expert_of_step(jnp.minimum(q + 1, total - 1), e)
    ahead = step_loads(jnp.minimum(q + 1, total - 1), ahead_e)
    accs, state = multiply(q, e, accs, state, loads)
    return accs, state, ahead, ahead_e

  def plain(q, carry):  # carry: step q - 1's expert
    accs, state, e = carry
    e = expert_of_step(q, e)
    accs, state = multiply(q, e, accs, state, step_loads(q, e))
    return accs, state, e

  if config.prefetch:
    first = expert_of(slot_of(0))
    return lax.fori_loop(0, total, prefetched, (zeros, state, step_loads(0, first, total > 0), first))[1]
  return lax.fori_loop(0, total, plain, (zeros, state, jnp.int32(0)))[1]


def _x_refs(refs: tuple, operands: str) -> tuple:
  """(x_ref, amax_ref, the other refs) of a kernel's refs after its ids: float16 operands take
  the activation words and their rows' maxima, bfloat16 ones x's rows alone (amax_ref None)."""
  return (refs[0], refs[1], refs[2:]) if operands == "float16" else (refs[0], None, refs[1:])


def _gate_up_kernel(ids_ref, *refs, m: int, slots: int, experts: int, d: int, i: int, tiles: int, groups: int,
                    config: FragmentConfig, operands: str, interpret: bool, stream: bool):
  # ids_ref i32 [Sp] of the [T*k] ids; x_ref u32: bfloat16, [T * D / 2] (x's bf16 pairs); float16,
  # [Kc * 4 * 128] activation words (activations_kernel) and amax_ref f32 [8]; gate / up words
  # u32 [E * Kc * 2 * Nt * 128], scales u32 [E * Kc * Nt * 32], global f32 [E]; g_ref, u_ref f32
  # [E * S * T * I] ([slot, split, token, row]). Row blocks [0, B) are gate's, [B, 2B) up's.
  x_ref, amax_ref, (gate_words, up_words, gate_scales, up_scales, gate_global, up_global, g_ref, u_ref) = _x_refs(
      refs, operands)
  block, split, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  count, expert_of = chosen_experts(ids_ref, slots=slots, experts=experts)
  lanes = Lanes.of(config)
  blocks = pl.cdiv(tiles, config.tiles)
  sizes = dict(m=m, k=d, tiles=tiles, chunks=pl.cdiv(d, CHUNK), config=config, operands=operands,
               interpret=interpret)
  scale = operand_scale(amax_ref, lanes, m=m, operands=operands)
  for w, (words, scales, global_ref, o_ref) in enumerate(((gate_words, gate_scales, gate_global, g_ref),
                                                          (up_words, up_scales, up_global, u_ref))):
    own = block - w * blocks

    def store(s, e, accs, starts, o_ref=o_ref, global_ref=global_ref):  # slot s's sums (expert e)
      store_rows(o_ref, accs, starts, lanes, global_ref[e] * scale, m=m, n=i,
                 base=(s * config.split_k + split) * m * i)

    def slot(s, carry, words=words, scales=scales, own=own, store=store):
      e = expert_of(s)
      accs, starts, _ = fragment_sums(x_ref, words, scales, own, split, lanes, expert=e, **sizes)
      store(s, e, accs, starts)
      return carry

    @pl.when((own >= 0) & (own < blocks))
    def _(slot=slot, words=words, scales=scales, own=own, store=store):
      if not stream:
        strided_loop(count, slot, 0, group=group, groups=groups)
        return
      ops = fragment_ops(x_ref, words, scales, own, lanes, **sizes)

      def finish(s, e, accs, state):
        store(s, e, accs, ops.starts)
        return state

      stream_sums(ops, split, count=count, group=group, groups=groups, expert_of=expert_of, x_base_of=lambda s: 0,
                  finish=finish, state=jnp.int32(0), chunks=sizes["chunks"], config=config)


def _swiglu_gate_up_kernel(ids_ref, weights_ref, x_ref, gate_words, up_words, gate_scales, up_scales, gate_global,
                           up_global, h_ref, rw_ref, *, m: int, top_k: int, slots: int, experts: int, d: int, i: int,
                           tiles: int, groups: int, config: FragmentConfig, operands: str, interpret: bool):
  # As _gate_up_kernel's refs (bfloat16 operands only) with weights_ref f32 [Sp] after the ids,
  # and h_ref bf16 [E * T * I] ([slot, token, row]) for the partials: program (row block j, 0,
  # group g) takes rows j of gate (tile group 0) and of up (group 1) over the whole K, so its
  # sums are final and it stores h = silu(g) * u itself; row block 0's programs store their
  # slots' routing weights (rw_ref f32 [E * 8], store_routing_weights).
  block, group = pl.program_id(0), pl.program_id(2)
  count, expert_of = chosen_experts(ids_ref, slots=slots, experts=experts)
  lanes = Lanes.of(config)

  def slot(s, carry):
    e = expert_of(s)
    (g, u), starts, _ = fragment_sums(x_ref, (gate_words, up_words), (gate_scales, up_scales), block, 0, lanes, m=m,
                                      k=d, tiles=tiles, chunks=pl.cdiv(d, CHUNK), config=config, operands=operands,
                                      interpret=interpret, expert=e)
    h = jax.nn.silu(g * (gate_global[e] * BF16_SCALE)) * (u * (up_global[e] * BF16_SCALE))
    store_rows(h_ref, [h], starts[:1], lanes, 1.0, m=m, n=i, base=s * m * i)
    pl.when(block == 0)(lambda: store_routing_weights(ids_ref, weights_ref, rw_ref, s, e, m=m, top_k=top_k))
    return carry

  strided_loop(count, slot, 0, group=group, groups=groups)


def _down_kernel(ids_ref, rw_ref, *refs, m: int, slots: int, experts: int, d: int, i: int, tiles: int, groups: int,
                 config: FragmentConfig, operands: str, interpret: bool, stream: bool):
  # ids_ref i32 [Sp] of the [T*k] choice; rw_ref f32 [E * 8], each chosen slot's routing weights
  # (store_routing_weights); h_ref u32 (`swiglu`'s): bfloat16,
  # [E * T * I / 2] (h's bf16 pairs, [slot, token, I]); float16, [E * Ic * 4 * 128] (slot s's
  # activation words from s * Ic * 512) and amax_ref f32 [E * 8]; down words, scales, global as
  # gate's; o_ref f32 [S * G * T * D].
  h_ref, amax_ref, (words_ref, scales_ref, global_ref, o_ref) = _x_refs(refs, operands)
  block, split, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  count, expert_of = chosen_experts(ids_ref, slots=slots, experts=experts)
  lanes = Lanes.of(config)
  chunks = pl.cdiv(i, CHUNK)

  sizes = dict(m=m, k=i, tiles=tiles, chunks=chunks, config=config, operands=operands, interpret=interpret)
  h_base = lambda s: s * (activation_words(chunks) if operands == "float16" else m * (i // 2))

  def add(s, e, accs, totals):  # slot s's sums (expert e), weighted
    scale = operand_scale(amax_ref, lanes, m=m, operands=operands, base=s * TOKENS)
    factor = global_ref[e] * scale * pltriton.load(rw_ref.at[s * TOKENS + lanes.token])
    return tuple(total + acc * factor for total, acc in zip(totals, accs))

  def slot(s, totals):
    e = expert_of(s)
    accs, _, _ = fragment_sums(h_ref, words_ref, scales_ref, block, split, lanes, expert=e, x_base=h_base(s), **sizes)
    return add(s, e, accs, totals)

  totals = zero_sums(config)
  if stream:
    totals = stream_sums(fragment_ops(h_ref, words_ref, scales_ref, block, lanes, **sizes), split, count=count,
                         group=group, groups=groups, expert_of=expert_of, x_base_of=h_base, finish=add, state=totals,
                         chunks=chunks, config=config)
  else:
    totals = strided_loop(count, slot, totals, group=group, groups=groups)
  store_rows(o_ref, totals, group_starts(block, config), lanes, 1.0, m=m, n=d, base=(split * groups + group) * m * d)


def _swiglu_kernel(ids_ref, weights_ref, g_ref, u_ref, rw_ref, *h_refs, slots: int, experts: int, m: int, i: int,
                   splits: int, top_k: int, operands: str):
  # ids_ref, weights_ref i32 / f32 [Sp]; g_ref, u_ref f32 [E * S * T * I]; rw_ref f32 [E * 8];
  # h_refs as _down_kernel's h_ref (and amax_ref). Program (slot, token): h's row, rounded to
  # bf16, for chosen slots only (the others' partials are unwritten); float16: tokens past M too,
  # as zeros (the MMA reads all 8). Token 0's program stores the slot's routing weights.
  slot, token = pl.program_id(0), pl.program_id(1)
  count, expert_of = chosen_experts(ids_ref, slots=slots, experts=experts)
  chunks = pl.cdiv(i, CHUNK)
  pairs = jnp.arange(pl.next_power_of_2(chunks * CHUNK // 2))
  ok = (pairs < i // 2) & (token < m)

  @pl.when((slot < count) & (token == 0))
  def _():
    store_routing_weights(ids_ref, weights_ref, rw_ref, slot, expert_of(slot), m=m, top_k=top_k)

  @pl.when(slot < count)
  def _():
    at = lambda s, c: ((slot * splits + s) * m + jnp.minimum(token, m - 1)) * i + 2 * pairs + c
    row = lambda ref, s, c: pltriton.load(ref.at[at(s, c)], mask=ok, other=0.0)
    h = [(jax.nn.silu(sum(row(g_ref, s, c) for s in range(splits))) * sum(row(u_ref, s, c) for s in range(splits))
          ).astype(jnp.bfloat16) for c in range(2)]
    if operands == "float16":
      words_ref, amax_ref = h_refs
      store_row_words(words_ref, amax_ref, *(v.astype(jnp.float32) for v in h), token, pairs,
                      pairs=chunks * CHUNK // 2, words_base=slot * activation_words(chunks), amax_base=slot * TOKENS)
      return
    bits = [lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32) for v in h]
    pltriton.store(h_refs[0].at[(slot * m + token) * (i // 2) + pairs], bits[0] | (bits[1] << 16), mask=ok)


def swiglu(ids: jax.Array, weights: jax.Array, g: jax.Array, u: jax.Array, *, slots: int, experts: int, m: int,
           i: int, splits: int, top_k: int, operands: str, interpret: bool) -> tuple[jax.Array, list[jax.Array]]:
  """h = silu(sum_s g) * sum_s u in bf16 for the chosen slots' rows, one launch, as the down
  program reads it, and the slots' routing weights (f32 [E * 8], store_routing_weights): h as
  bfloat16 operands' bf16 pairs u32 [E * T * I / 2], or float16's activation words of each slot
  (fragment_activations' order, [E * Ic * 4 * 128] u32) and its rows' maxima (f32 [E * 8]). Rows
  of unchosen slots are left unwritten."""
  whole = lambda n: pl.BlockSpec((n,), lambda s, t: (0,))
  if operands == "float16":
    outs = [jax.ShapeDtypeStruct((experts * activation_words(pl.cdiv(i, CHUNK)),), jnp.uint32),
            jax.ShapeDtypeStruct((experts * TOKENS,), jnp.float32)]
  else:
    outs = [jax.ShapeDtypeStruct((experts * m * i // 2,), jnp.uint32)]
  outs = [jax.ShapeDtypeStruct((experts * TOKENS,), jnp.float32), *outs]
  rw, *h = pl.pallas_call(
      functools.partial(_swiglu_kernel, slots=slots, experts=experts, m=m, i=i, splits=splits, top_k=top_k,
                        operands=operands),
      grid=(experts, TOKENS if operands == "float16" else m),
      in_specs=[whole(pl.next_power_of_2(slots))] * 2 + [whole(g.size), whole(u.size)],
      out_specs=[whole(o.size) for o in outs], out_shape=outs,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="moe_fragments_swiglu")(ids, weights, g, u)
  return rw, h


def bf16_pairs(x: jax.Array) -> jax.Array:
  """bf16 [...] (an even size) -> its pairs as u32, the order the bfloat16 program reads rows."""
  return lax.bitcast_convert_type(x.reshape(-1, 2), jnp.uint32)


def check_expert_fragments(gate: FragmentWeight, up: FragmentWeight, down: FragmentWeight) -> None:
  """ValueError unless the three are stacked experts' FragmentWeights on one operand dtype."""
  for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
    if not isinstance(w, FragmentWeight) or w.ndim != 3 or w.operands != getattr(gate, "operands", None):
      raise ValueError(f"moe_fragments: {name} must be stacked experts in fragment order on gate_proj's operands "
                       f"(to_fragments(w, operands) of an NVFP4Weight [E, N, K], operands in {OPERANDS}; "
                       f"Runtime(moe_routing='fragments').arrange moves them, except experts split over devices), "
                       f"got {type(w).__name__}{list(w.shape)}{getattr(w, 'operands', '')}")


@functools.partial(jax.jit, static_argnames=("config", "keep_partials", "interpret"))
def moe_fragments(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, gate_proj: FragmentWeight,
                  up_proj: FragmentWeight, down_proj: FragmentWeight, *, config: ExpertsConfig | None = None,
                  keep_partials: bool = False, interpret: bool | None = None) -> jax.Array:
  """Routed-expert MLP of a decode step on the fragment GEMV (module docstring).

  Args:
    x: bf16 [T, D], T <= 8 (the MMA's N).
    topk_ids: int32 [T, k] expert ids; outside [0, E) contributes zero.
    topk_weights: [T, k] routing weights (applied in fp32).
    gate_proj, up_proj: stacked [E, I, D], down_proj [E, D, I]: to_fragments(w, operands) of
      NVFP4Weights, one operand dtype: bfloat16 reads x and h as they are; float16 scales x into fp16
      in a launch before gate/up, and the swiglu launch stores h so (fused_swiglu cannot).
    config: the launches' tiles; default ExpertsConfig() (default_experts_config picks one by the
      experts a step is expected to choose).
    keep_partials: return the down launch's fp32 partials [S * down groups, T, D] unsummed.
    interpret: run the Pallas interpreter; default: on the CPU backend.
  Returns:
    bf16 [T, D], or the partials.
  """
  check_expert_fragments(gate_proj, up_proj, down_proj)
  check_moe_inputs("moe_fragments", x, topk_ids, topk_weights, gate_proj, up_proj, down_proj)
  (t, d), (e, i), top_k = x.shape, gate_proj.shape[:2], topk_ids.shape[1]
  if t > TOKENS:
    raise ValueError(f"moe_fragments: at most {TOKENS} tokens (the MMA's N), got {t}")
  config = config or ExpertsConfig()
  (gate_up_config, down_config), groups = config.resolved(), config.groups
  down_groups = config.down_groups or groups
  operands = gate_proj.operands
  if config.fused_swiglu and operands == "float16":
    raise ValueError("moe_fragments: fused_swiglu stores h from the gate/up programs, which cannot scale its rows "
                     "into fp16 (each holds a few of a row's columns): it needs experts on bfloat16 operands")
  interpret = resolve_interpret(interpret)
  slots = t * top_k
  ids, weights = topk_ids.reshape(slots), topk_weights.astype(jnp.float32).reshape(slots)
  sizes = dict(m=t, slots=slots, experts=e, d=d, i=i, operands=operands, interpret=interpret)

  def launch(kernel, inputs, outs: list[jax.ShapeDtypeStruct], cfg: FragmentConfig, tiles: int, blocks: int, name: str,
             groups: int = groups, choice: int = 1, **extra):
    # The first `choice` inputs are the step's choice ([T*k] ids, weights), read padded.
    whole = lambda n: pl.BlockSpec((n,), lambda j, s, g: (0,))
    return pl.pallas_call(
        functools.partial(kernel, **sizes, config=cfg, tiles=tiles, groups=groups, **extra),
        grid=(blocks, cfg.split_k, groups),
        in_specs=[whole(pl.next_power_of_2(slots))] * choice + [whole(a.size) for a in inputs[choice:]],
        out_specs=[whole(o.size) for o in outs], out_shape=outs,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret, name=name)(*inputs)

  flat = lambda w: (w.words.reshape(-1), w.scales.reshape(-1))
  (gw, gs), (uw, us) = flat(gate_proj), flat(up_proj)
  x_in = list(activations_kernel(x, pl.cdiv(d, CHUNK), interpret)) if operands == "float16" else [bf16_pairs(x)]
  gate_up = [ids, *x_in, gw, uw, gs, us, gate_proj.global_scale, up_proj.global_scale]
  if config.fused_swiglu:  # h (and the routing weights) straight from the gate/up launch
    routing = jax.ShapeDtypeStruct((e * TOKENS,), jnp.float32)
    h, rw = launch(_swiglu_gate_up_kernel, [ids, weights, *gate_up[1:]],
                   [jax.ShapeDtypeStruct((e * t * i,), x.dtype), routing], gate_up_config, gate_proj.tiles,
                   pl.cdiv(gate_proj.tiles, gate_up_config.tiles // 2), "moe_fragments_gate_up_swiglu", choice=2,
                   top_k=top_k)
    h = [bf16_pairs(h)]
  else:
    sums = jax.ShapeDtypeStruct((e * gate_up_config.split_k * t * i,), jnp.float32)
    g, u = launch(_gate_up_kernel, gate_up, [sums] * 2, gate_up_config, gate_proj.tiles,
                  2 * pl.cdiv(gate_proj.tiles, gate_up_config.tiles), "moe_fragments_gate_up", stream=config.stream)
    rw, h = swiglu(ids, weights, g, u, slots=slots, experts=e, m=t, i=i, splits=gate_up_config.split_k, top_k=top_k,
                   operands=operands, interpret=interpret)
  partials = launch(_down_kernel, [ids, rw, *h, *flat(down_proj), down_proj.global_scale],
                    [jax.ShapeDtypeStruct((down_config.split_k * down_groups * t * d,), jnp.float32)], down_config,
                    down_proj.tiles, pl.cdiv(down_proj.tiles, down_config.tiles), "moe_fragments_down",
                    groups=down_groups, stream=config.stream)
  partials = partials[0].reshape(down_config.split_k * down_groups, t, d)
  return partials if keep_partials else partials.sum(0).astype(x.dtype)
