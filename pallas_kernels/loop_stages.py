"""Software pipelining of loads that feed no dot: a `tt.num_stages` attribute on a kernel's loops.

Why: Triton pipelines a loop's loads (cp.async into shared memory, `num_stages` steps ahead)
only when they feed a `tl.dot`, unless the loop itself carries `tt.num_stages` (what
`tl.range(..., num_stages=n)` sets; Triton's AssignLatencies then also pipelines the loads of a
dot-free loop). Pallas lowers `lax.fori_loop` to a bare `scf.for`, so a CUDA-core kernel such as
nvfp4_hfma2's loads a step, waits, then computes: latency-bound (BENCHMARKS.md run 19).

How: a kernel opts in by its name, `staged_name(name, stages)` = name + "_stages<n>"; the
Triton lowering of every `scf.for` inside a kernel so named gets the attribute. Pallas exposes
no loop attributes, so this wraps its private `_lower_jaxpr_to_for_loop` (jax 0.11.2, pinned);
`install()` checks that the function it wraps is still there and fails loudly if not.

Measured (H200, BENCHMARKS.md run 20): no gain. The one-row NVFP4 GEMV [1, 8192] x [8192, 28672]
took 51.3 us bare against 52.0-55.0 at 2-4 stages, an expert's GEMVs 6.6-6.8 against 7.1-8.1,
the MoE pairs 61.5 against 60.5-65.4: the copy through shared memory costs what the overlap
gains. The dot="hfma2" defaults keep num_stages=1; the switch stays for ablations.
"""

import re

from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering

_SUFFIX = re.compile(r"_stages(\d+)$")


def staged_name(name: str, stages: int | None) -> str:
  """The kernel name under which its loops are pipelined `stages` deep (None: not at all)."""
  return name if stages is None else f"{name}_stages{stages}"


def loop_stages(kernel_name: str) -> int | None:
  """The stage count a kernel's name asks for (staged_name), or None."""
  match = _SUFFIX.search(kernel_name)
  return int(match.group(1)) if match else None


def install() -> None:
  """Wrap Pallas-Triton's loop lowering once (idempotent)."""
  lower = getattr(lowering, "_lower_jaxpr_to_for_loop", None)
  if lower is None:
    raise RuntimeError("loop_stages: jax's Pallas-Triton lowering has no _lower_jaxpr_to_for_loop; "
                       "this hook is written for jax 0.11.2")
  if getattr(lower, "_stages_hook", False):
    return

  def lower_staged(ctx, *args, **kwargs):
    results = lower(ctx, *args, **kwargs)
    stages = loop_stages(ctx.context.name)
    if stages is not None:
      for_op = _enclosing_for(results)
      for_op.attributes["tt.num_stages"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)
    return results

  lower_staged._stages_hook = True
  lowering._lower_jaxpr_to_for_loop = lower_staged


def _enclosing_for(results: list) -> ir.Operation:
  """The scf.for just lowered: its results' owner, or (no loop-carried values) the last
  operation at the insertion point, where the lowering put it."""
  if results:
    return results[0].owner
  operations = ir.InsertionPoint.current.block.operations
  return operations[len(operations) - 1]
