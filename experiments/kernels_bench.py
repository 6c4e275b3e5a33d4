"""Every kernel against its XLA path at GLM-5 shapes: time, bytes, achieved bandwidth, floor.

  python -m experiments.kernels_bench --suites=dsa,quant --output=/tmp/kernels.json
  python -m experiments.kernels_bench --suites=dsa --contexts=81920 --query_tokens=5   # the targets
  python -m experiments.kernels_bench --suites=quant --sweep   # tile sweeps of the stack's kernels
  python -m experiments.kernels_bench --suites=quant --quant_timer=own --quant_cases=gemv   # issue 6

Rows come from `experiments.bench_dsa.dsa_rows` (indexer scores, top-k, sparse MLA: one TEP=8
rank's shapes) and `experiments.bench_quant.quant_rows` (NVFP4 / FP8 weight-only GEMV and the
grouped MoE kernel). Device time is measured as METHOD.md says (glmjax.bench.time_device: many
calls in one on-device loop, median), or for the quant suite with --quant_timer=own by each
implementation's own kernels in a profile (launch gaps excluded); XLA is measured in the same
run. Each row is printed as it is measured (a long suite cut by a time limit still reports),
the table at the end.
"""

import functools
import platform

import jax
from absl import app, flags

from experiments import bench_dsa, bench_quant, write_json
from glmjax.bench import maybe_profile

SUITES = {"dsa": bench_dsa.dsa_rows, "quant": bench_quant.quant_rows}
_SUITES = flags.DEFINE_list("suites", list(SUITES), "which suites to run")
_QUICK = flags.DEFINE_bool("quick", False, "tiny shapes (CPU smoke test)")
_CONTEXTS = flags.DEFINE_list("contexts", [], "dsa: cached tokens per case (empty: 8K, 32K, 80K, 128K)")
_QUERY = flags.DEFINE_list("query_tokens", [], "dsa: query tokens per step (empty: 1 and 5)")
_TOPK = flags.DEFINE_list("topk_methods", ["radix", "sampled"], "dsa: top-k algorithms to time "
                          f"(pallas_kernels/topk.py), of {', '.join(bench_dsa.TOPK_VARIANTS)} (one_launch: the "
                          "sampled method in one launch)")
flags.register_validator("topk_methods", lambda methods: set(methods) <= set(bench_dsa.TOPK_VARIANTS),
                         f"--topk_methods takes {', '.join(bench_dsa.TOPK_VARIANTS)}")
_QUERIES = flags.DEFINE_list("query_dtypes", ["float32", "bfloat16"],
                             "dsa: dtypes of the queries fed to the indexer and attention kernels")
_COMBINES = flags.DEFINE_list("mla_combines", ["xla", "pallas", "values"],
                              "dsa: sparse MLA split merges to time (values: the merge with kv_b's value "
                              "product in one launch, against the two steps)")
_QUANT_TIMER = flags.DEFINE_enum("quant_timer", "loop", list(bench_quant.TIMERS),
                                  "quant: loop (many calls in one program, launch gaps included) or own "
                                  "(each implementation's own kernels' device time, from a profile)")
_QUANT_CASES = flags.DEFINE_list("quant_cases", list(bench_quant.QUANT_CASES), "quant: which cases to run")
_SWEEP = flags.DEFINE_bool("sweep", False, "run each suite's tile/config sweep instead of its rows")
_SWEEP_CASES = flags.DEFINE_list("sweep_cases", list(bench_quant.SWEEP_CASES), "quant --sweep: which groups to run")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "dsa: also profile each kernel path's launches")
_PROFILE = flags.DEFINE_string("profile", "", "write a jax.profiler trace (TensorBoard/XProf) here")
_OUTPUT = flags.DEFINE_string("output", "", "write all rows as JSON here")


def format_rows(rows: list[dict]) -> str:
  """A plain table of every row's scalar fields, columns in first-seen order."""
  columns = []
  for row in rows:
    columns += [k for k, v in row.items() if k not in columns and isinstance(v, (int, float, str))]
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
  return "\n".join(lines)


def main(_):
  unknown = set(_SUITES.value) - set(SUITES)
  if unknown:
    raise app.UsageError(f"unknown suites {sorted(unknown)}; known: {sorted(SUITES)}")
  report = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                host=platform.node(), jax=jax.__version__, suites={})
  quant = functools.partial(bench_quant.quant_rows, timer=_QUANT_TIMER.value, cases=tuple(_QUANT_CASES.value))
  sweeps = dict(dsa=bench_dsa.config_sweep_rows,
                quant=functools.partial(bench_quant.quant_sweep_rows, cases=tuple(_SWEEP_CASES.value)))
  suites = sweeps if _SWEEP.value else dict(SUITES, quant=quant, dsa=functools.partial(
      bench_dsa.dsa_rows, contexts=[int(c) for c in _CONTEXTS.value], query_tokens=[int(t) for t in _QUERY.value],
      breakdown=_BREAKDOWN.value, topk_methods=_TOPK.value, query_dtypes=_QUERIES.value,
      mla_combines=_COMBINES.value))
  for name in _SUITES.value:
    rows = report["suites"][name] = []
    with maybe_profile(_PROFILE.value and f"{_PROFILE.value}/{name}"):
      for row in suites[name](quick=_QUICK.value):
        rows.append(row)
        print(f"{name}: " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in row.items() if isinstance(v, (int, float, str))), flush=True)
        for kernel, launches, us in row.get("kernels", []):
          print(f"    {us:9.2f} us  {launches:5.2f} x  {kernel}", flush=True)
    print(f"\n== {name} on {report['device']} ==\n{format_rows(rows)}", flush=True)
  write_json(_OUTPUT.value, report, default=str)


if __name__ == "__main__":
  app.run(main)
