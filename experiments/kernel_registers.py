"""What ptxas makes of glmjax's Pallas-Triton kernels for an H100 / H200 (sm_90), on a machine
without a GPU: registers a thread, spills, shared memory, SASS instructions (all, and those of the
longest loop by opcode), each loop's instructions and barriers (a barrier in a K loop is most
often a layout moved through shared memory), the global loads by width, and the programs an SM
holds for its registers.

  python -m experiments.kernel_registers --case=gemv --m=8
  python -m experiments.kernel_registers --case=gemv --operands=float16 --vary=unroll=8,prefetch=True
  python -m experiments.kernel_registers --case=moe --output=regs.json
  python -m experiments.kernel_registers --case=pairs --shared_down
  python -m experiments.kernel_registers --case=pairs --wide_words
  python -m experiments.kernel_registers --case=dsa

Why: the lent GPU gives 30 minutes a session; a kernel's register count decides how many of its
programs an SM holds (the MoE launches' wave model, BENCHMARKS.md runs 47-49), and its PTX shows
how it loads. This found the bf16 fragment program loading x's rows 4 bytes at a time (run 49).
What it cannot show is speed: two spellings of one mask with equal registers here ran 49.5 and
59.2 us on an H100 (ptxas schedules differently). Time candidates on the GPU.

How: the case is lowered for an abstract H200 (no device); each Pallas kernel's Triton IR is
taken from its custom call and written as text, then `experiments.triton_ptx` compiles it in
`.venv-triton` (pip's Triton, pinned; made on first use), as XLA would (that module's
docstring has the method and its check against Nsight Compute).
"""

import json
import tempfile

from absl import app, flags

from experiments.kernel_ir import case_from_flags, compile_rows, define_case_flags, triton_kernels
from experiments.triton_ptx import TRITON_VERSION

define_case_flags()
flags.DEFINE_string("output", "", "also write the rows here as JSON")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  fn, args = case_from_flags()
  with tempfile.TemporaryDirectory() as work_dir:
    rows = compile_rows(triton_kernels(fn, *args), work_dir)
  print(f"{'kernel':30s} {'grid':>14s} {'warps':>5s} {'regs':>4s} {'an SM':>5s} {'spills':>7s} {'sass':>5s} "
        f"{'loop':>5s}  loads; the loop's opcodes; each loop's instructions/barriers")
  for r in rows:
    grid = f"{r['grid_x']}x{r['grid_y']}x{r['grid_z']}"
    ops = " ".join(f"{op} {n}" for op, n in r.get("loop_ops", {}).items())
    loops = " ".join(f"{n}/{bars}" for n, bars in r.get("loops", []))
    print(f"{r['name']:30s} {grid:>14s} {r['num_warps']:5d} {r['registers']:4d} {r['programs_per_sm']:5d} "
          f"{r['spill_stores']:3d}/{r['spill_loads']:<3d} {r['sass']:5d} {r.get('loop', 0):5d}  {r['loads']}; {ops}; "
          f"{loops}")
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump(dict(case=FLAGS.case, flags={key: FLAGS[key].value for key in ("m", "n", "k", "operands", "vary",
                                                                                "shared_down", "wide_words")},
                     triton=TRITON_VERSION, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
