"""One switch swept over its values on a chain row (experiments/study.py), one JSON and PNG each.

  python -m experiments.sweep --sweep=context --contexts=8192,32768,65536,126976
  python -m experiments.sweep --sweep=draft,concurrency,topk,index_share --output_dir=/tmp/sweep

Sweeps (several may be given, comma-separated; each is `study.measure` per value):
  context      the first prompt's length (--contexts; up to 124K: the mini config stops at 128K)
  draft        MTP draft length k (--drafts) for each branching b (--branches; b > 1 drafts a tree
               over the first positions, at most 8 paths)
  concurrency  conversations decoded as one batch (--concurrencies)
  topk         the DSA indexer's tokens per query, ModelConfig.index_topk (--topks)
  index_share  keep every N-th of the checkpoint's indexers (--index_shares; 1 = all)
on the switches of chain row --base (default the full stack) with the workload of --context etc.
(the values every sweep but its own keeps: --context, --concurrency, --num_draft, --index_share).
Writes sweep_<name>.json (kept between runs: a rerun skips finished points unless --noresume)
and sweep_<name>.png (decode tokens/s, step time and acceptance length against the value), and
prints each sweep's table.
"""

import dataclasses
import pathlib

from absl import app, flags
from tqdm import tqdm

from experiments import study

SWEEPS = ("context", "draft", "concurrency", "topk", "index_share")

FLAGS = flags.FLAGS
study.define_flags("sweep_out")
flags.DEFINE_list("sweep", ["draft"], f"sweeps to run, of {', '.join(SWEEPS)}")
flags.DEFINE_string("base", study.ROW_NAMES[-1],
                    f"the chain row whose switches are swept, of {', '.join(study.ROW_NAMES)}")
flags.DEFINE_list("contexts", ["8192", "32768", "65536", "126976"], "values of the context sweep")
flags.DEFINE_list("drafts", [str(k) for k in range(1, 8)], "draft lengths k of the draft sweep")
flags.DEFINE_list("branches", ["1", "2"], "branchings b of the draft sweep")
flags.DEFINE_list("concurrencies", ["1", "2", "4", "8", "16"], "values of the concurrency sweep")
flags.DEFINE_list("topks", ["16", "32", "64", "128", "256"], "index_topk values of the topk sweep")
flags.DEFINE_list("index_shares", ["1", "2", "3", "4"], "values of the index_share sweep")


def points(sweep: str, base: study.Switches, workload: study.Workload
           ) -> list[tuple[str, str, float, study.Switches, study.Workload]]:
  """(name, series, x, switches, workload) of every point of one sweep."""
  ints = lambda values: [int(v) for v in values]
  if sweep == "context":
    return [(f"context={c}", "", c, base, dataclasses.replace(workload, context=c)) for c in ints(FLAGS.contexts)]
  if sweep == "draft":
    return [(f"k={k},b={b}", f"b={b}", k, dataclasses.replace(base, num_draft=k, draft_branch=b), workload)
            for b in ints(FLAGS.branches) for k in ints(FLAGS.drafts)]
  if sweep == "concurrency":
    return [(f"concurrency={n}", "", n, base, dataclasses.replace(workload, concurrency=n))
            for n in ints(FLAGS.concurrencies)]
  if sweep == "topk":
    return [(f"topk={k}", "", k, dataclasses.replace(base, index_topk=k), workload) for k in ints(FLAGS.topks)]
  if sweep == "index_share":
    return [(f"index_share={n}", "", n, dataclasses.replace(base, index_share=n), workload)
            for n in ints(FLAGS.index_shares)]
  raise ValueError(f"--sweep: unknown sweep {sweep!r} (sweeps are {', '.join(SWEEPS)})")


def plot(path: pathlib.Path, sweep: str, measured: list[tuple[str, float, dict]]) -> None:
  """Tokens/s, step time and acceptance length against the swept value, one line per series."""
  plt = study.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  panels = (("decode tokens/s", lambda m: m["decode_tokens_per_s"]),
            ("ms per decode step", lambda m: 1e3 * m["step_s"]),
            ("acceptance length", lambda m: m["acceptance_length"]))
  for series in dict.fromkeys(s for s, _, _ in measured):
    mine = sorted((x, m) for s, x, m in measured if s == series)
    for ax, (_, value) in zip(axes, panels):
      ax.plot([x for x, _ in mine], [value(m) for _, m in mine], "o-", label=series or None)
  for ax, (label, _) in zip(axes, panels):
    ax.set(xlabel=sweep, ylabel=label)
    if sweep in ("context", "concurrency", "topk"):
      ax.set_xscale("log", base=2)
    if any(s for s, _, _ in measured):
      ax.legend()
  fig.suptitle(f"{sweep} sweep ({measured[0][2]['device']})")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  bad = sorted(set(FLAGS.sweep) - set(SWEEPS))
  if bad:
    raise ValueError(f"--sweep: unknown sweeps {bad} (sweeps are {', '.join(SWEEPS)})")
  out = pathlib.Path(FLAGS.output_dir)
  model, workload, overrides = study.from_flags()
  base = study.chain_switches(FLAGS.base, **overrides)
  todo = [(sweep, points(sweep, base, workload)) for sweep in FLAGS.sweep]
  failed = {}
  with tqdm(total=sum(len(p) for _, p in todo), desc="sweep") as bar:
    for sweep, pts in todo:
      results = study.Results(out / f"sweep_{sweep}.json", dict(model=model.name, base=FLAGS.base, sweep=sweep),
                              resume=FLAGS.resume)
      failed |= study.measure_all(results, model,
                                  [(name, s, w, dict(sweep=sweep, value=x)) for name, _, x, s, w in pts], bar)
      measured = [(name, series, x, results.points[name]) for name, series, x, _, _ in pts if name in results.points]
      if measured:
        bar.write(f"\n{sweep} sweep, base {FLAGS.base}\n" + study.markdown_table([(n, m) for n, _, _, m in measured]))
        plot(out / f"sweep_{sweep}.png", sweep, [(series, x, m) for _, series, x, m in measured])
  study.raise_failures(failed)


if __name__ == "__main__":
  app.run(main)
