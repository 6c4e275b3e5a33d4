"""Bulk prefetch into L2 from a Pallas-Triton kernel: `prefetch_l2(ref, address, num_warps=)`, and
`prefetch_share`: a program's share of a whole array, warmed for a later launch.

Why: a skinny matmul is latency-bound when its SMs keep too few bytes in flight (the fragment GEMV
takes about the same time on an H100 and on the H200, whose memory is 1.4x faster: BENCHMARKS.md
run 51, STUDY.md gaps). A load's bytes in flight cost registers until its data arrives; a
prefetch costs none. `cp.async.bulk.prefetch.L2.global` (PTX ISA 8.0, sm_90) asks the memory
system for up to kilobytes at once and returns at once, so a program can have chunks it reads
later on their way to L2 while its loads wait on nearer chunks, there at L2's latency.

How: Pallas exposes no pointers, so a primitive whose Triton lowering adds the offsets to its
ref's pointer and hands the addresses to inline PTX (not pure: nothing may drop it). Each thread
issues at most one prefetch a call: the element at 4 i of the [num_warps * 128] offsets speaks
for its pack of four (Triton's layout of such arrays gives each lane four consecutive elements,
as the fragment kernels rely on; another layout could only drop or repeat prefetches, never
change a value). Its bytes: a multiple of 16, 16-byte aligned, 0 for none. A prefetch changes
no value, so the interpreter discharges it to nothing. ptxas issues the instruction (UBLKPF) a
warp at a time from uniform registers, looping over the lanes that prefetch.

Measured (H100, BENCHMARKS.md run 52): it slows the fragment GEMV at every distance; Nsight
Compute at 4 chunks ahead finds half the demand loads still missing L2 and DRAM reading 151 MB
for the 132 MB weight, at 68% of its peak against 80% without. A launch that leaves DRAM idle
(the latency-bound sparse attention, STUDY.md) can instead warm the next launch's weight.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import effects
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import lowering
from jax._src.state import discharge as state_discharge
from jax.experimental import pallas as pl

PACK = 4  # elements a lane holds of the [num_warps * 128] arrays, one asm call's
PREFETCH_PTX = ("{ .reg .pred p; setp.ne.u32 p, $8, 0; @p cp.async.bulk.prefetch.L2.global [$4], $8; "
                "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }")
PREFETCH_CONSTRAINTS = ",".join(["=r"] * PACK + ["l"] * PACK + ["r"] * PACK)


class PrefetchEffect(effects.Effect):
  """What keeps a prefetch in the kernel: it has no result, and a ref read alone may be dropped."""


prefetch_effect = PrefetchEffect()
effects.control_flow_allowed_effects.add_type(PrefetchEffect)
pallas_core.kernel_local_effects.add_type(PrefetchEffect)

l2_prefetch_p = jax_core.Primitive("l2_prefetch")
l2_prefetch_p.multiple_results = True


@l2_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref, offsets, nbytes):
  if offsets.shape != nbytes.shape or offsets.ndim != 1 or offsets.shape[0] % PACK:
    raise ValueError(f"prefetch_l2: offsets and bytes must be 1-D, of one length, a multiple of {PACK}; got "
                     f"{offsets.shape} and {nbytes.shape}")
  return [], {prefetch_effect}


@state_discharge.register_discharge_rule(l2_prefetch_p)
def _discharge(ctx, ref, offsets, nbytes):
  del ctx, ref, offsets, nbytes
  return (None, None, None), []


@lowering.register_lowering(l2_prefetch_p)
def _lowering(ctx: lowering.LoweringRuleContext, ptr, offsets, nbytes):
  [block_info, *_] = ctx.block_infos
  if block_info is None or tuple(block_info.block_shape) != tuple(block_info.full_shape_dtype.shape):
    raise NotImplementedError("prefetch_l2 takes a ref whose block is its whole array")
  addresses = lowering._add(lowering._bcast_to(ptr, ctx.avals_in[1].shape), offsets)
  # The asm's unused results: int32, as the offsets are.
  tt_dialect.elementwise_inline_asm([offsets.type], PREFETCH_PTX, constraints=PREFETCH_CONSTRAINTS, pure=False,
                                    packed_element=PACK, args=[addresses, nbytes])
  return []


Address = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def prefetch_items(address: Address, *, num_warps: int) -> tuple[jax.Array, jax.Array]:
  """The [num_warps * 128] int32 offsets and bytes of prefetch_l2's items, each thread's item at
  the lead element of its pack (the other elements' bytes 0)."""
  e = jnp.arange(num_warps * 32 * PACK, dtype=jnp.int32)
  offsets, nbytes = address(e // PACK)
  return offsets.astype(jnp.int32), jnp.where(e % PACK == 0, nbytes, 0).astype(jnp.int32)


def prefetch_l2(ref, address: Address, *, num_warps: int) -> None:
  """Thread i of the program's num_warps warps prefetches item i into L2: address(item) -> (its
  first element's offset into `ref`, a whole-array ref; its bytes, a multiple of 16 from a
  16-byte aligned element, or 0 for none), as int32 arrays of item's shape."""
  l2_prefetch_p.bind(ref, *prefetch_items(address, num_warps=num_warps))


def prefetch_share(ref, *, program, programs: int, num_warps: int) -> None:
  """Program `program` of `programs` prefetches its share of a whole-array ref into L2: the
  array's bytes (its tail past a multiple of 16 left out) in `programs` contiguous shares, each
  cut into one range a warp (its first lane's: the fewer prefetches, the fewer issue slots; a
  range may span kilobytes). For a later launch's operand, warmed while this launch's programs
  leave DRAM idle (sparse_mla's `warm`)."""
  itemsize = ref.dtype.itemsize
  total = ref.size * itemsize // 16 * 16
  if total >= 2 ** 31:
    raise ValueError(f"prefetch_share takes arrays under 2 GiB (int32 offsets), got {total} bytes")
  share = pl.cdiv(pl.cdiv(total, programs), 16) * 16
  piece = pl.cdiv(pl.cdiv(share, num_warps), 16) * 16

  def item(i):  # thread i: lane 0 of warp w = i // 32 takes the warp's range (first element, bytes)
    start = program * share + i // 32 * piece
    end = jnp.minimum(jnp.minimum(start + piece, (program + 1) * share), total)
    return start // itemsize, jnp.where(i % 32 == 0, jnp.maximum(end - start, 0), 0)

  prefetch_l2(ref, item, num_warps=num_warps)
