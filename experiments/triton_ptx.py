"""Pallas-Triton kernels compiled for sm_90 on a machine without a GPU: their PTX, what ptxas says
of it (registers a thread, spills, shared memory), the SASS size, the longest loop's opcodes and
the width of each global load. It runs in a side virtual environment that holds pip's Triton
(`experiments.kernel_registers` makes it and calls `python -m experiments.triton_ptx DIR` there),
so it imports only the standard library and, inside its functions, triton.

How it follows XLA: XLA compiles a Pallas kernel's Triton IR through Triton's MLIR passes (the
same stages as Triton's make_ttir, make_ttgir, make_llir) and links the LLVM IR into its own
module without Triton's LLVM optimizer; here Triton's stages run with that optimizer switched off
(`_skip_llvm_optimizer`), then ptxas. Checked against Nsight Compute on an H100 (BENCHMARKS.md
run 49): the fragment GEMV at 2 and 4 chunks a step 72 and 123 registers (Nsight 72, 122), the MoE
gate/up launch 96 (96); the MoE down launch 130 against Nsight's 156, not explained. ptxas
12.8 to 13.4 give the same counts within 2; Triton 3.5 to 3.9 parse jax 0.11.2's Triton IR.
The counts are ptxas's; how fast a program runs also follows its instruction schedule, which
two spellings with equal registers can change by 20% (run 49).
"""

import json
import os
import re
import subprocess
import sys

TRITON_VERSION = "3.7.1"  # pinned: _skip_llvm_optimizer patches its CUDA backend module
_LOAD = re.compile(r"\bld\.global(\S*)\s")  # its qualifiers: cache hints, .v2 / .v4, the element type
_COPY = re.compile(r"\bcp\.async\.\w+\.shared\.global\S*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")  # cuobjdump's "/*0350*/  @!P4 BRA 0x7140 ;"
_BACKWARD = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")
_PTXAS = {"registers": r"Used (\d+) registers", "spill_stores": r"(\d+) bytes spill stores",
          "spill_loads": r"(\d+) bytes spill loads", "smem": r"(\d+) bytes smem"}


def _load_bytes(qualifiers: str) -> int:
  """Bytes an ld.global with these qualifiers moves: its vector length times its element size."""
  vector = re.search(r"\.v(\d)\b", qualifiers)
  return (int(vector.group(1)) if vector else 1) * int(re.search(r"\.[bufs](\d+)$", qualifiers).group(1)) // 8


def load_widths(ptx: str) -> dict[str, int]:
  """{"16B": n, "4B": n, "16B async": n, ...}: the global loads in the PTX text by the bytes each
  moves (a vector load of 4 32-bit words is 16 bytes), and the asynchronous copies into shared
  memory (cp.async, Triton's pipelined loads) likewise."""
  sizes = [f"{_load_bytes(q)}B" for q in _LOAD.findall(ptx)] + [f"{int(n, 0)}B async" for n in _COPY.findall(ptx)]
  return {size: sizes.count(size) for size in dict.fromkeys(sizes)}


def loop_mix(sass: str, top: int = 8) -> dict:
  """The kernel's loops in SASS (each the span a backward branch closes, not the branch to
  itself that ends the code; a K loop's body, its unrolled steps included): {"loops": [its
  instructions, its barriers (BAR)] of each, in code order (a nested loop's span lies inside its
  outer one's; a barrier in a K loop is most often a layout moved through shared memory), and
  of the longest "loop": its instructions, "loop_ops": its `top` opcodes by count}, an opcode
  without its predicate and modifiers (LOP3, PRMT, HMMA, LDG...). Which pipe an opcode issues to
  (ALU: LOP3, PRMT, SHF, LEA; FMA: IMAD, HMUL2) says what a loop step costs besides its loads;
  {} without a loop."""
  code = [(int(address, 16), text.strip()) for address, text in _SASS.findall(sass)]
  spans = [(int(target.group(1), 16), address) for address, text in code
           for target in [_BACKWARD.search(text)] if target and int(target.group(1), 16) < address]
  if not spans:
    return {}
  opcodes = {(begin, end): [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                            for address, text in code if begin <= address <= end] for begin, end in sorted(spans)}
  loops = [[len(ops), ops.count("BAR")] for ops in opcodes.values()]
  ops = opcodes[max(spans, key=lambda span: span[1] - span[0])]
  counts = {op: ops.count(op) for op in dict.fromkeys(ops)}
  return {"loops": loops, "loop": len(ops), "loop_ops": dict(sorted(counts.items(), key=lambda item: -item[1])[:top])}


def _skip_llvm_optimizer() -> None:
  """Triton's make_llir runs LLVM's O3 on the kernel; XLA's path does not (module docstring)."""
  import triton.backends.nvidia.compiler as backend
  from triton._C.libtriton import llvm

  class NoOptimizer:
    def __getattr__(self, name):
      return getattr(llvm, name)

    def optimize_module(self, *args, **kwargs):
      return None

  backend.llvm = NoOptimizer()


def compile_ptx(ttir_path: str, num_warps: int, num_stages: int) -> tuple[str, int]:
  """(PTX, Triton's shared memory bytes) of a Triton IR text file, every stage from make_ttir on
  (triton.compile skips that stage for IR input; XLA runs it), for sm_90."""
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget, Language
  from triton.compiler.compiler import make_backend
  target = GPUTarget("cuda", 90, 32)
  backend = make_backend(target)
  options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages, num_ctas=1))
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  module = ir.parse_mlir_module(ttir_path, context)
  module.context = context
  stages: dict = {}
  backend.add_stages(stages, options, Language.TRITON)
  metadata = {"target": target, **options.__dict__, "hash": "0" * 64}
  for stage in ("ttir", "ttgir", "llir", "ptx"):
    module = stages[stage](module, metadata)
  return module, metadata.get("shared", 0)


def _tool(name: str) -> str:
  import triton
  return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_report(ptx_path: str) -> dict:
  """ptxas -v's registers, spill bytes and static shared memory for the PTX (its own .target),
  the SASS's size and its longest loop (loop_mix)."""
  with open(ptx_path) as f:
    arch = re.search(r"^\.target\s+(\w+)", f.read(), re.M).group(1)
  cubin = ptx_path.removesuffix(".ptx") + ".cubin"
  done = subprocess.run([_tool("ptxas"), "-v", f"--gpu-name={arch}", ptx_path, "-o", cubin], capture_output=True,
                        text=True, check=True)
  found = {key: re.findall(pattern, done.stderr + done.stdout) for key, pattern in _PTXAS.items()}
  sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
  return {key: int(hits[-1]) if hits else 0 for key, hits in found.items()} | {
      "sass": len(_SASS.findall(sass))} | loop_mix(sass)


def main(directory: str) -> None:
  """For each <name>.ttir (with its <name>.json: name, num_warps, num_stages) in directory, a
  JSON line of what ptxas says; the PTX beside it."""
  os.environ.setdefault("TRITON_PTXAS_PATH", _tool("ptxas"))
  os.environ.setdefault("TRITON_PTXAS_BLACKWELL_PATH", _tool("ptxas"))
  _skip_llvm_optimizer()
  for name in sorted(os.listdir(directory)):
    if not name.endswith(".ttir"):
      continue
    stem = os.path.join(directory, name.removesuffix(".ttir"))
    with open(stem + ".json") as f:
      meta = json.load(f)
    ptx, shared = compile_ptx(stem + ".ttir", meta["num_warps"], meta["num_stages"])
    with open(stem + ".ptx", "w") as f:
      f.write(ptx)
    print(json.dumps(dict(meta, **ptxas_report(stem + ".ptx"), triton_smem=shared, loads=load_widths(ptx))),
          flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
