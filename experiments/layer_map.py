"""Launch map of one decoder layer: the kernels a compiled program launches for it, in program
order, each with the model code it comes from (the JAX name stack: Flax modules, jitted helpers),
and a count per module, to see where a layer's kernels go.

  python -m experiments.layer_map --hlo=FILE --scope=layers_4/ [--output=map.json] [--depth=3]

FILE is a compiled program's optimized HLO text, either
  - XLA's dump: run with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" and take the
    program's DIR/module_*.jit_<name>.*after_optimizations.txt, or
  - written from Python: `jax.jit(f).lower(*args).compile().as_text()`.
What counts as a kernel and how kernels map to scopes: glmjax.hlo_stats (`scope_kernels`). The
map is static: a conditional lists every branch's kernels.
"""

import collections
import dataclasses
import json
import pathlib

from absl import app, flags

from glmjax import hlo_stats

_HLO = flags.DEFINE_string("hlo", None, "Optimized HLO text file of a compiled program.", required=True)
_SCOPE = flags.DEFINE_string("scope", None, "Name-scope substring of the layer, e.g. layers_4/.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Write the map as JSON here.")
_DEPTH = flags.DEFINE_integer("depth", 3, "Module path segments the summary groups by.")


def summary(sites: list[hlo_stats.KernelSite], depth: int) -> dict[str, dict[str, int]]:
  """{module path cut to `depth` segments: {opcode: kernels}}, groups in program order."""
  groups: dict[str, collections.Counter] = {}
  for s in sites:
    groups.setdefault("/".join(s.module.split("/")[:depth]), collections.Counter())[s.opcode] += 1
  return {g: dict(c) for g, c in groups.items()}


def format_map(sites: list[hlo_stats.KernelSite], groups: dict[str, dict[str, int]]) -> str:
  """The table of kernels, then the per-module counts ("-" for ops directly in the scope)."""
  rows = [("#", "kernel", "opcode", "shape", "module", "op")]
  rows += [(str(i), s.name, s.opcode, s.shape, s.module or "-", s.op) for i, s in enumerate(sites)]
  widths = [max(len(r[c]) for r in rows) for c in range(5)]
  lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[5] for r in rows]
  width = max(len(g or "-") for g in groups)
  lines += ["", "kernels  " + "module".ljust(width) + "  by opcode"]
  for g, counts in groups.items():
    kinds = ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    lines.append(f"{sum(counts.values()):7d}  {(g or '-').ljust(width)}  {kinds}")
  return "\n".join(lines)


def main(argv):
  del argv
  text = pathlib.Path(_HLO.value).read_text()
  sites = hlo_stats.scope_kernels(text, _SCOPE.value)
  groups = summary(sites, _DEPTH.value)
  total = hlo_stats.program_kernels(text)
  print(f"{hlo_stats.module_name(text)}: {len(sites)} of the program's {total} kernels are under {_SCOPE.value}\n")
  print(format_map(sites, groups))
  if _OUTPUT.value:
    out = dict(hlo=_HLO.value, scope=_SCOPE.value, program_kernels=total,
               kernels=[dataclasses.asdict(s) for s in sites], summary=groups)
    pathlib.Path(_OUTPUT.value).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
