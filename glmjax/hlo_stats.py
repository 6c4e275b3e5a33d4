"""Kernel counts of a compiled program: static, from its optimized HLO text (`Compiled.as_text()`),
and measured, from a profiler trace (`trace_kernels`).

The rule (what XLA's GPU backend launches): every `fusion`, every `custom-call` (cuBLAS GEMMs,
Triton / Pallas kernels) and every unfused compute op (`dot`, `copy`, `gather`, `sort`,
`all-reduce`, ...) is one kernel. Free: `parameter`, `constant`, `get-tuple-element`, `tuple`,
`bitcast` and the other bookkeeping ops of NON_KERNEL; of an asynchronous pair only the `-start`
counts. Control flow is not a kernel but runs computations that hold kernels: a `while` counts
its body and its condition once each (one iteration), a `conditional` every branch (a static
upper bound: one branch runs), a `call` its callee. Fused computations are inside their kernel
and are not entered.

Decode steps: `loop_kernels` counts one iteration of a program's decode loop, the entry's `while`
holding the most kernels (body + condition); `program_kernels` the whole entry computation, for
a host-driven one-step program. `kernels_per_layer` divides either by the decoder layers,
so kernels of the step that belong to no layer (embedding, lm_head, sampling, the MTP layer,
the loop's bookkeeping) are spread over them; kernels outside the loop (setup before it) are not
counted. Counts are static: XLA's command buffers (CUDA graphs) may batch launches at run time.

Launch maps: `scope_kernels` lists, rather than counts, the kernels of one run of the program
whose metadata `op_name` (the JAX name stack: jit, named_scope and Flax module names) contains a
scope such as "layers_4/", in program order (a compiled module is scheduled: each computation's
text order is its launch order) and with the module path each comes from. A fusion carries one
op_name (XLA keeps its fused root's), so a fusion that pulled in ops of two scopes is listed under
one of them.

`trace_kernels` counts the kernels a device really ran, in the perfetto trace that
`jax.profiler.trace(dir, create_perfetto_trace=True)` writes (`perfetto_trace.json.gz`): the
complete ("X") events on the device's stream lines (processes named "/device:...", lines named
"Stream ..."; memcpy / memset events left out), optionally only within the runs of one XLA module
(its events on the "XLA Modules" line). A CPU trace has no device process: the count is None.
"""

import bisect
import dataclasses
import gzip
import json
import os
import pathlib
import re
from typing import Iterator

NON_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "domain", "get-dimension-size"})
CONTROL = frozenset({"while", "conditional", "call"})

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\b(body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'metadata=\{[^}]*?\bop_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
  opcode: str
  callees: tuple[str, ...]  # computations a control-flow op runs (empty for other ops)
  name: str = ""            # without the %, e.g. "fusion.12"
  shape: str = ""           # result type, e.g. "f32[4]{0}" or a tuple "(s32[], f32[4]{0})"
  op_name: str = ""         # metadata op_name, "" when it has none


def _split(rhs: str) -> tuple[str, str, str]:
  """'<shape> opcode(operands), attrs' -> (shape, opcode, text after it). Tuple shapes nest parentheses."""
  if rhs.startswith("("):
    depth = 0
    for i, ch in enumerate(rhs):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        break
    i += 1
  else:
    i = rhs.index(" ")
  rest = rhs[i:].lstrip()
  paren = rest.index("(")
  return rhs[:i], rest[:paren], rest[paren:]


def _first_shape(shape: str) -> str:
  """An array type, or a tuple type's first element (nested tuples entered)."""
  while shape.startswith("("):
    depth = 0
    for i, ch in enumerate(shape):
      depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
      if depth == 0 or (depth == 1 and ch == ","):
        break
    shape = shape[1:i].strip()
  return shape


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
  """HLO module text -> ({computation name: its instructions}, entry computation name)."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if current is None:
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    shape, opcode, rest = _split(m.group(2))
    callees: tuple[str, ...] = ()
    if opcode in CONTROL:
      callees = tuple(name for key, name in _CALLEE.findall(rest) if opcode != "call" or key == "to_apply")
      branches = _BRANCHES.search(rest)
      if branches:
        callees += tuple(b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip())
    op_name = _OP_NAME.search(rest)
    computations[current].append(Instruction(opcode, callees, m.group(1), shape, op_name.group(1) if op_name else ""))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text: pass Compiled.as_text() of a whole module")
  return computations, entry


def _is_kernel(opcode: str) -> bool:
  return opcode not in NON_KERNEL and opcode not in CONTROL and not opcode.endswith(("-done", "-update"))


def kernel_instructions(computations: dict[str, list[Instruction]], name: str) -> Iterator[Instruction]:
  """The kernels one run of computation `name` launches, in program order, control flow entered
  as the module doc says (a loop's condition, then its body; a conditional's branches in turn)."""
  if name not in computations:
    raise ValueError(f"computation {name!r} is not in the module (known: {sorted(computations)[:8]}...)")
  for inst in computations[name]:
    if inst.opcode in CONTROL:
      for callee in inst.callees:
        yield from kernel_instructions(computations, callee)
    elif _is_kernel(inst.opcode):
      yield inst


def computation_kernels(computations: dict[str, list[Instruction]], name: str) -> int:
  """Kernels one run of computation `name` launches, control flow entered as the module doc says."""
  return sum(1 for _ in kernel_instructions(computations, name))


def program_kernels(hlo_text: str) -> int:
  """Kernels one run of the whole program launches (its entry computation; loops entered once)."""
  computations, entry = parse(hlo_text)
  return computation_kernels(computations, entry)


def loop_kernels(hlo_text: str) -> int:
  """Kernels of one iteration (body + condition) of the entry's largest `while`: a decode loop."""
  computations, entry = parse(hlo_text)
  loops = [sum(computation_kernels(computations, c) for c in inst.callees)
           for inst in computations[entry] if inst.opcode == "while"]
  if not loops:
    raise ValueError("the entry computation has no while loop: count a one-step program with program_kernels")
  return max(loops)


def kernels_per_layer(hlo_text: str, num_layers: int, *, loop: bool = True) -> float:
  """Kernels per decode step (`loop_kernels`, or with loop=False `program_kernels` of a one-step
  program) / num_layers; see the module docstring for what is counted."""
  if num_layers <= 0:
    raise ValueError(f"num_layers must be positive, got {num_layers}")
  return (loop_kernels(hlo_text) if loop else program_kernels(hlo_text)) / num_layers


@dataclasses.dataclass(frozen=True)
class KernelSite:
  """One kernel of a scope, as `scope_kernels` lists it. For op_name
  ".../layers_4/layer4_attn/self_attn/o_proj/jit(bf16_matmul)/bf16_matmul/pallas_call" and scope
  "layers_4/": module "layer4_attn/self_attn/o_proj/jit(bf16_matmul)/bf16_matmul", op "pallas_call"."""
  name: str     # instruction name, e.g. "pallas_call.961"
  opcode: str   # fusion, custom-call, dot, copy, ...
  shape: str    # result type; a tuple's first element
  op_name: str  # the full metadata op_name
  module: str   # op_name after the scope's first occurrence, less its last segment; "" for an op directly in the scope
  op: str       # op_name's last segment: the JAX primitive (dot_general, pallas_call, ...)


def scope_kernels(hlo_text: str, scope: str) -> list[KernelSite]:
  """The kernels one run of the program launches (`kernel_instructions` of the entry) whose
  metadata op_name contains `scope`, in program order. A plain substring match: end the scope with
  "/" ("layers_1/"), or "layers_1" also matches "layers_10". Kernels without an op_name (copies XLA
  added) belong to no scope."""
  computations, entry = parse(hlo_text)
  sites = []
  for inst in kernel_instructions(computations, entry):
    if scope in inst.op_name:
      module, _, op = inst.op_name.split(scope, 1)[1].rpartition("/")
      sites.append(KernelSite(inst.name, inst.opcode, _first_shape(inst.shape), inst.op_name, module, op))
  if not sites:
    raise ValueError(f"no kernel of the program has {scope!r} in its metadata op_name")
  return sites


def module_name(hlo_text: str) -> str:
  """The HLO module's name (`HloModule <name>, ...`): what a trace's "XLA Modules" line calls it."""
  m = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
  if not m:
    raise ValueError("the text does not start with an HloModule line: pass Compiled.as_text()")
  return m.group(1)


def perfetto_events(trace: str | os.PathLike) -> list[dict]:
  """The events of a perfetto trace: a trace.json.gz file, or a directory holding one (its
  newest), as `jax.profiler.trace(..., create_perfetto_trace=True)` writes them."""
  path = pathlib.Path(trace)
  if path.is_dir():
    found = sorted(path.glob("**/*perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
      raise ValueError(f"no perfetto_trace.json.gz under {path}: trace with create_perfetto_trace=True")
    path = found[-1]
  with gzip.open(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def device_pids(events: list[dict]) -> set:
  """The perfetto process ids of devices: processes named "/device:..." (none on the CPU)."""
  return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and e.get("args", {}).get("name", "").startswith("/device:")}


def trace_kernels(trace: str | os.PathLike, module: str | None = None) -> dict[str, int] | None:
  """Device kernels in a perfetto trace (see `perfetto_events`) -> {"kernels": kernel events,
  "module_runs": runs of `module`}, kernels counted within those runs only when `module` is given
  (a substring of the module's event names, e.g. `module_name(...)`). None when the trace has no
  device kernel events (a CPU run) or, with `module`, no run of it (a name that did not match)."""
  events = perfetto_events(trace)
  key = lambda e, kind: (e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]
  meta = lambda kind: {key(e, kind): e.get("args", {}).get("name", "")
                       for e in events if e.get("ph") == "M" and e.get("name") == kind}
  threads, devices = meta("thread_name"), device_pids(events)
  line = lambda e: threads.get((e.get("pid"), e.get("tid")), "")
  complete = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]
  kernels = [e for e in complete if line(e).startswith("Stream")
             and not any(w in e.get("name", "").lower() for w in ("memcpy", "memset"))]
  if not kernels:
    return None
  runs = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in complete
                if line(e) == "XLA Modules" and (module is None or module in e.get("name", "")))
  if module is not None:
    if not runs:
      return None
    starts = [start for start, _ in runs]
    inside = lambda t: (i := bisect.bisect_right(starts, t) - 1) >= 0 and t <= runs[i][1]
    kernels = [e for e in kernels if inside(e["ts"])]
  return dict(kernels=len(kernels), module_runs=len(runs))
