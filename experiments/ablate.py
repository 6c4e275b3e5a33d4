"""The optimization chain, one optimization switched on per row (experiments/study.py's CHAIN).

  python -m experiments.ablate --output_dir=/tmp/ablate                  # trained mini, all rows
  python -m experiments.ablate --rows=baseline,mtp,device_loop --context=4096 --contexts=
  python -m experiments.ablate --config=tiny --checkpoint= --context=12 --new_tokens=5

Each row is `study.measure` of one workload: a first round of `--context` tokens, then
`--rounds - 1` rounds appending `--append` tokens, `--new_tokens` decoded each; the last round is
measured (every program compiled by then; its TTFT is served from the prefix cache when that is
on). Then the last of `--rows` runs again at each of `--contexts`. The default context, 384, keeps
the trained mini model inside its 512-token training windows: past them its MTP acceptance
collapses (docs/BENCHMARKS.md, run 4), so longer contexts measure a slower MTP, not a better one.

Writes to --output_dir: ablate.json (every row, kept between runs: a rerun skips finished rows
unless --noresume), ablate.csv, ablate.md (the table, also printed), and the plots
ablate_tokens_per_s.png, ablate_step_vs_floor.png, ablate_contexts.png.
"""

import dataclasses
import pathlib

import numpy as np
from absl import app, flags
from tqdm import tqdm

from experiments import study

FLAGS = flags.FLAGS
study.define_flags("ablate_out")
flags.DEFINE_list("rows", list(study.ROW_NAMES), f"chain rows to run, of {', '.join(study.ROW_NAMES)}")
flags.DEFINE_list("contexts", ["1024", "4096", "16384"], "contexts at which the last row runs again (empty: none)")


def jobs(workload: study.Workload, overrides: dict) -> list[tuple[str, study.Switches, study.Workload, dict]]:
  """(name, switches, workload, {label}): the chosen rows, then the last one at each context."""
  bad = sorted(set(FLAGS.rows) - set(study.ROW_NAMES))
  if bad or not FLAGS.rows:
    raise ValueError(f"--rows: unknown rows {bad} (rows are {', '.join(study.ROW_NAMES)})")
  labels = {name: label for name, label, _ in study.CHAIN}
  rows = [name for name in study.ROW_NAMES if name in FLAGS.rows]
  switches = {name: study.chain_switches(name, **overrides) for name in rows}
  label = lambda name: labels[name].format(**dataclasses.asdict(switches[name]))
  out = [(name, switches[name], workload, dict(label=label(name))) for name in rows]
  last = rows[-1]
  out += [(f"{last}@{c}", switches[last], dataclasses.replace(workload, context=int(c)),
           dict(label=f"{label(last)} @ {c}")) for c in FLAGS.contexts]
  return out


def plot(out: pathlib.Path, rows: list[tuple[str, dict]], contexts: list[tuple[str, dict]]) -> None:
  plt = study.pyplot()
  labels = [label for label, _ in rows]
  y = np.arange(len(rows))
  fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
  ax.barh(y, [m["decode_tokens_per_s"] for _, m in rows], color="tab:blue")
  ax.set(yticks=y, yticklabels=labels, xlabel="decode tokens/s", title=f"optimization chain ({rows[0][1]['device']})")
  ax.invert_yaxis()
  fig.tight_layout()
  fig.savefig(out / "ablate_tokens_per_s.png", dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
  ax.barh(y - 0.2, [1e3 * m["step_s"] for _, m in rows], height=0.4, label="step time")
  ax.barh(y + 0.2, [1e3 * m["floor_s"] for _, m in rows], height=0.4, label="bandwidth floor")
  ax.set(yticks=y, yticklabels=labels, xscale="log", xlabel="ms per decode step")
  ax.invert_yaxis()
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "ablate_step_vs_floor.png", dpi=120)
  plt.close(fig)

  if contexts:
    points = sorted(contexts, key=lambda p: p[1]["context"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([m["context"] for _, m in points], [m["decode_tokens_per_s"] for _, m in points], "o-")
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s",
           title=f"{labels[-1]}: tokens/s against context")
    fig.tight_layout()
    fig.savefig(out / "ablate_contexts.png", dpi=120)
    plt.close(fig)


def host_gap_line(points: dict[str, dict]) -> str:
  """The host's cost per decode step: the +NVFP4 row (a host-driven step loop, one dispatch and
  one readback a step) against the +device loop row (the same switches, every step inside one
  `lax.while_loop`); empty unless both rows were measured."""
  host, device = points.get("nvfp4"), points.get("device_loop")
  if not host or not device:
    return ""
  gap = host["step_s"] - device["step_s"]
  return (f"host gap per decode step: {1e3 * gap:.3f} ms ({1e3 * host['step_s']:.3f} ms host-driven "
          f"against {1e3 * device['step_s']:.3f} ms in the device loop)")


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.output_dir)
  model, workload, overrides = study.from_flags()
  todo = jobs(workload, overrides)
  results = study.Results(out / "ablate.json", dict(model=model.name), resume=FLAGS.resume)
  with tqdm(total=len(todo), desc="ablate") as bar:
    failed = study.measure_all(results, model, todo, bar)
  n_rows = len(todo) - len(FLAGS.contexts)
  measured = lambda part: [(extra["label"], results.points[name]) for name, _, _, extra in part
                           if name in results.points]
  rows, contexts = measured(todo[:n_rows]), measured(todo[n_rows:])
  if rows:
    table = "\n\n".join(filter(None, [study.markdown_table(rows + contexts), host_gap_line(results.points)]))
    print(table)
    (out / "ablate.md").write_text(table + "\n")
    study.write_csv(out / "ablate.csv", rows + contexts)
    plot(out, rows, [rows[-1]] + contexts if contexts else [])
  study.raise_failures(failed)


if __name__ == "__main__":
  app.run(main)
