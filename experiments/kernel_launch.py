"""One case's kernels launched once on the GPU, for a profiler to catch: Nsight Compute's view of
a launch (stall reasons, pipe use, achieved occupancy) with committed code and no probe.

  ncu --clock-control none -k regex:nvfp4_fragments$ -c 1 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy \
      python -m experiments.kernel_launch --case=gemv --operands=float16
  ncu ... python -m experiments.kernel_launch --case=gemv --m=8 --vary=unroll=8
  ncu -k regex:moe_fragments_gate_up -c 1 ... python -m experiments.kernel_launch --case=moe
  ncu -k regex:moe_hfma2_gate_up -c 1 ... python -m experiments.kernel_launch --case=pairs --shared_down

The cases are `experiments.kernel_registers`' (`kernel_ir.case`, the same flags): what ptxas
makes of a kernel there, what the GPU does with it here. The inputs are real (activations and
weights from random bf16, the weights quantized; the MoE a routed step), so the launch reads
the bytes and takes the paths a benchmark's does; the first launch compiles, so profile with
`-c 1` on the kernel's name. Prints each output's shape and whether it is finite.
"""

import jax
import jax.numpy as jnp
from absl import app

from experiments.kernel_ir import case_from_flags, define_case_flags

define_case_flags()


def launch() -> list[jax.Array]:
  """The flags' case run once on the default device (its outputs, ready)."""
  fn, args = case_from_flags(concrete=True)
  return jax.tree.leaves(jax.block_until_ready(jax.jit(fn)(*args)))


def main(argv):
  del argv
  for out in launch():
    finite = bool(jnp.all(jnp.isfinite(out))) if jnp.issubdtype(out.dtype, jnp.floating) else True
    print(f"{out.dtype}{list(out.shape)} finite={finite}", flush=True)


if __name__ == "__main__":
  app.run(main)
