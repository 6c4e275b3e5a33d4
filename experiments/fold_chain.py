"""The launch folds measured one after another on one TEP rank's decode step (docs/BENCHMARKS.md
runs 22-24): a tep_project arm per fold, each in its own process with XLA's optimized HLO dumped
and one decoder layer's kernels mapped to the model's code (glmjax.hlo_stats, as layer_map).

  python -m experiments.fold_chain --output_dir=/tmp/folds               # on a GPU: every fold in turn
  python -m experiments.fold_chain --folds=mla_epilogue,residual_norm --output_dir=/tmp/folds

Arm 0 runs tep_project with --base (by default the rank's k = 4 step at 80K with the preset
rank_fastest's settings but none of its folds, configs/runs.py: the chain's arms then reach that
preset and go on to the folds it leaves out); arm i adds the first i of --folds,
each `switch` (set to "pallas": glmjax.runtime.FOLD_SWITCHES) or `switch=value`, or several
joined by "+" for one arm (run 24's "index_epilogue+index_query"). Per arm: the fitted decoder
layer (none when --base times the whole model: no --measure_layers) and rank step, the projected
tokens/s at the first latency, one layer's launches and kernel time from the profile (a GPU's;
none on the CPU), and the mapped layer (--map_layer, in the program of map_layer + 1 layers:
--base's --measure_layers must hold that count, or the model have that many; under a mixed
IndexShare schedule, the program whose layer is of that layer's kind) split into Pallas calls
and XLA kernels. Writes fold_chain.json (a rerun keeps finished arms; --noresume
remeasures), fold_chain.md and fold_chain.png (launches and kernel us per arm), and under
arm_<i>/ each arm's tep_project JSON and log and its layer's kernels (layer_map.json).
"""

import dataclasses
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

from absl import app, flags
from tqdm import tqdm

from configs.runs import RANK_FASTEST
from experiments import study
from glmjax import hlo_stats
from glmjax.runtime import FOLD_SWITCHES

_RANK_STEP = ("--config=tep8_shard --context=80000 --draft_steps=4 --accept_length=3.5 --measure_layers=3,5,8 "
              "--layer_kernels")
_UNFOLDED = {name: value for name, value in RANK_FASTEST.items() if name not in FOLD_SWITCHES} | dict(
    moe_routing="pairs", cache_write="pallas")  # pairs_fused is a fold of the chain; the cache write's launch is
                                                # its base's (runs 22-24)
_BASE = " ".join([_RANK_STEP, *(f"--{name}={value}" for name, value in _UNFOLDED.items())])
_FOLDS = ("router", "router_group", "value_merge", "moe_routing=pairs_fused", "query_absorb", "indexer_keys",
          "mla_epilogue", "index_epilogue", "index_query", "epilogue_write", "residual_norm", "route_planes",
          "shared_swiglu", "shared_down", "next_norm", "swiglu", "moe_sum")

_OUT = flags.DEFINE_string("output_dir", "fold_chain_out", "where the chain's files go")
_BASE_FLAGS = flags.DEFINE_string("base", _BASE, "tep_project's flags for arm 0 (space-separated)")
_FOLD_LIST = flags.DEFINE_list("folds", list(_FOLDS), "switches added one per arm: name (=pallas) or name=value")
_MAP_LAYER = flags.DEFINE_integer("map_layer", 4, "the decoder layer mapped (4: a MoE layer of tep8_shard, past "
                                  "its 3 dense ones, in the 5-layer program)")
_TIMEOUT = flags.DEFINE_integer("arm_timeout", 600, "seconds an arm may run")
_RESUME = flags.DEFINE_bool("resume", True, "keep the arms fold_chain.json already holds")


def arm_flags(base: str, folds: list[str], arm: int) -> list[str]:
  """tep_project's flags for arm `arm`: base, then the first `arm` folds (a later flag overrides)."""
  added = [f"--{one}" if "=" in one else f"--{one}=pallas" for fold in folds[:arm] for one in fold.split("+")]
  return shlex.split(base) + added


def layer_module(hlo_dir: pathlib.Path, layer: int, indexer: bool | None = None) -> str:
  """The optimized HLO text of the dumped decode program whose last decoder layer is `layer`.
  Under a mixed IndexShare schedule step_timing's full and shared programs both end there:
  `indexer` (whether the arm's schedule runs that layer's indexer) picks the one whose layer
  launches more kernels (its indexer's), or fewer; programs alike there, or None, the first.
  (Counted, not named: under the folds the indexer's kernels run in the attention's module path.)"""
  ending = [text for text in (path.read_text() for path in sorted(hlo_dir.glob("*after_optimizations.txt")))
            if f"layers_{layer}/" in text and f"layers_{layer + 1}/" not in text]
  if not ending:
    raise ValueError(f"no dumped program ends at decoder layer {layer} under {hlo_dir}: --base's --measure_layers "
                     f"must include {layer + 1} (or the model have {layer + 1} layers)")
  if indexer is None:
    return ending[0]
  counts = [len(hlo_stats.scope_kernels(text, f"layers_{layer}/")) for text in ending]
  return ending[counts.index(max(counts) if indexer else min(counts))]


def mapped_kernels(sites: list[hlo_stats.KernelSite]) -> dict[str, int]:
  """A layer's launches (hlo_stats.scope_kernels' sites): Pallas calls and XLA kernels."""
  pallas = sum(site.op == "pallas_call" for site in sites)
  return dict(map_kernels=len(sites), map_pallas=pallas, map_xla=len(sites) - pallas)


def arm_metrics(report: dict, mapped: dict[str, int]) -> dict:
  """One arm's row from tep_project's JSON report and its layer map."""
  measured, first = report["measured"], report["projection"][0]
  kernels = measured.get("layer_kernels") or []
  us = lambda key: None if measured.get(key) is None else 1e6 * measured[key]
  return dict(mapped, rank_step_ms=1e3 * measured["rank_step_s"], layer_us=us("per_layer_s"),
              layer_stderr_us=us("per_layer_stderr_s"),
              tokens_per_s=first["tokens_per_s"], latency_us=first["latency_us"],
              launches=sum(row[1] for row in kernels) if kernels else None,
              kernel_us=sum(row[2] for row in kernels) if kernels else None, source=measured["source"])


def run_arm(flags_list: list[str], arm_dir: pathlib.Path, layer: int, timeout: int) -> dict:
  """tep_project with flags_list in its own process, its decode program's HLO dumped; its row."""
  arm_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as hlo_dir:
    # the timed programs: jit_decode (plain steps) or jit_spec_decode (speculative ones)
    dump = f"--xla_dump_to={hlo_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {dump}".strip())
    report_path = arm_dir / "tep.json"
    with open(arm_dir / "tep.log", "w") as log:
      done = subprocess.run([sys.executable, "-m", "experiments.tep_project", *flags_list, f"--output={report_path}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if done.returncode:
      raise RuntimeError(f"tep_project failed (exit {done.returncode}): see {arm_dir / 'tep.log'}")
    report = json.loads(report_path.read_text())
    types = report.get("indexer_types", ())
    indexer = types[layer] == "full" if "shared" in types else None  # a mixed schedule: two programs
    sites = hlo_stats.scope_kernels(layer_module(pathlib.Path(hlo_dir), layer, indexer), f"layers_{layer}/")
  (arm_dir / "layer_map.json").write_text(json.dumps([dataclasses.asdict(s) for s in sites], indent=1) + "\n")
  return arm_metrics(report, mapped_kernels(sites))


COLUMNS = (  # (header, key, scale, format): study.markdown's
    ("launches (profile)", "launches", 1, "{:.1f}"), ("kernel us (profile)", "kernel_us", 1, "{:.1f}"),
    ("mapped", "map_kernels", 1, "{}"), ("Pallas", "map_pallas", 1, "{}"), ("XLA", "map_xla", 1, "{}"),
    ("layer us (fit)", "layer_us", 1, "{:.1f}"), ("+-", "layer_stderr_us", 1, "{:.1f}"),
    ("rank step ms", "rank_step_ms", 1, "{:.2f}"), ("tok/s", "tokens_per_s", 1, "{:.1f}"))


def plot(path: pathlib.Path, rows: list[tuple[str, dict]]) -> None:
  """Launches a layer (mapped, and the profile's where a GPU gave one) and kernel us per arm."""
  plt = study.pyplot()
  fig, (launches, kernel) = plt.subplots(1, 2, figsize=(12, 4))
  x = range(len(rows))
  launches.plot(x, [m["map_kernels"] for _, m in rows], "o-", label="mapped (HLO)")
  if all(m["launches"] is not None for _, m in rows):
    launches.plot(x, [m["launches"] for _, m in rows], "s--", label="profile")
    kernel.plot(x, [m["kernel_us"] for _, m in rows], "o-")
  for ax, label in ((launches, "launches a layer"), (kernel, "kernel us a layer")):
    ax.set_xticks(list(x), [name for name, _ in rows], rotation=35, ha="right")
    ax.set_ylabel(label)
  launches.legend()
  fig.suptitle(f"the launch folds, one per arm ({rows[0][1]['source'].split(':')[0]})")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_chain(out: pathlib.Path, base: str, folds: list[str], *, layer: int, timeout: int,
              resume: bool = True) -> list[tuple[str, dict]]:
  """Measures the arms fold_chain.json does not hold yet; writes the table and plot; the rows."""
  arms = [("base" if i == 0 else f"+{folds[i - 1]}", arm_flags(base, folds, i)) for i in range(len(folds) + 1)]
  results = study.Results(out / "fold_chain.json", dict(base=base, folds=folds), resume=resume)
  for i, (name, flags_list) in enumerate(tqdm(arms, desc="fold chain")):
    if not results.done(name, flags_list):
      results.add(name, flags_list, run_arm(flags_list, out / f"arm_{i}", layer, timeout))
  rows = [(name, results.points[name]) for name, _ in arms]
  (out / "fold_chain.md").write_text(study.markdown("arm", rows, COLUMNS) + "\n")
  plot(out / "fold_chain.png", rows)
  return rows


def main(argv):
  del argv
  rows = run_chain(pathlib.Path(_OUT.value), _BASE_FLAGS.value, list(_FOLD_LIST.value), layer=_MAP_LAYER.value,
                   timeout=_TIMEOUT.value, resume=_RESUME.value)
  print(study.markdown("arm", rows, COLUMNS))


if __name__ == "__main__":
  app.run(main)
