"""experiments.fold_chain: the arms' flags, the dumped program it maps, the layer's split into
Pallas calls and XLA kernels, resuming, and (side lane) two arms of tep_project end to end."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs.runs import RANK_FASTEST
from experiments import fold_chain
from glmjax import hlo_stats
from tests.test_hlo_stats import SCOPED

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_each_arm_adds_one_fold_and_a_value_overrides():
  base = "--config=tiny --moe_routing=pairs"
  folds = ["router", "moe_routing=pairs_fused", "index_epilogue+index_query"]
  assert fold_chain.arm_flags(base, folds, 0) == ["--config=tiny", "--moe_routing=pairs"]
  assert fold_chain.arm_flags(base, folds, 2) == ["--config=tiny", "--moe_routing=pairs", "--router=pallas",
                                                  "--moe_routing=pairs_fused"]
  assert fold_chain.arm_flags(base, folds, 3)[-2:] == ["--index_epilogue=pallas", "--index_query=pallas"]


def test_the_default_chain_reaches_the_rank_fastest_preset():
  """Arm 0 holds none of rank_fastest's folds; the arm after the last fold it holds is the
  preset, every flag of it; the chain's last arms add the folds it leaves out."""
  def settings(arm):
    flags = fold_chain.arm_flags(fold_chain._BASE, list(fold_chain._FOLDS), arm)
    return dict(flag[2:].partition("=")[::2] for flag in flags)  # a later flag overrides
  assert not {name for name, value in settings(0).items() if value == "pallas"} - {"attention", "cache_write"}
  last = max(i for i, fold in enumerate(fold_chain._FOLDS, 1) if fold.split("=")[0] in RANK_FASTEST)
  assert {name: settings(last)[name] for name in RANK_FASTEST} == RANK_FASTEST
  assert list(fold_chain._FOLDS[last:]) == ["shared_down", "next_norm", "swiglu", "moe_sum"]


def test_the_mapped_program_is_the_one_ending_at_the_layer(tmp_path):
  """Of the dumped programs (one per --measure_layers count), the one whose last layer is the mapped
  one; its layer split into Pallas calls and the rest; a missing program names the flag to fix."""
  (tmp_path / "a_after_optimizations.txt").write_text(SCOPED.replace("layers_1", "layers_2"))
  (tmp_path / "b_after_optimizations.txt").write_text(SCOPED)
  (tmp_path / "b_before_optimizations.txt").write_text("layers_1/")
  text = fold_chain.layer_module(tmp_path, 1)
  assert text == SCOPED
  # SCOPED's layers_1/: a pallas_call custom call, a negate in the other branch, an add.
  sites = hlo_stats.scope_kernels(text, "layers_1/")
  assert fold_chain.mapped_kernels(sites) == dict(map_kernels=3, map_pallas=1, map_xla=2)
  with pytest.raises(ValueError, match="--measure_layers must include 5"):
    fold_chain.layer_module(tmp_path, 4)



def test_a_mixed_schedule_maps_the_program_of_the_layers_kind(tmp_path):
  """Two programs end at layer 1 (a mixed IndexShare schedule's full and shared ones): the arm's
  schedule picks the one whose layer 1 runs its indexer (more kernels there), or the one whose
  layer reuses a top-k; programs alike there (the whole model timed), the first."""
  full = SCOPED.replace("layers_10/mul", "layers_1/self_attn/jit(indexer_scores)/pallas_call")  # one kernel more
  (tmp_path / "a_after_optimizations.txt").write_text(SCOPED)
  (tmp_path / "b_after_optimizations.txt").write_text(full)
  assert fold_chain.layer_module(tmp_path, 1, indexer=True) == full
  assert fold_chain.layer_module(tmp_path, 1, indexer=False) == SCOPED
  assert fold_chain.layer_module(tmp_path, 1) == SCOPED
  (tmp_path / "b_after_optimizations.txt").write_text(SCOPED.replace("layers_10/", "layers_0/"))
  assert fold_chain.layer_module(tmp_path, 1, indexer=True) == SCOPED


def test_a_rerun_measures_only_new_or_changed_arms(tmp_path, monkeypatch):
  measured = []

  def fake_arm(flags_list, arm_dir, layer, timeout):
    measured.append(flags_list[-1])
    return dict(map_kernels=30 - len(flags_list), map_pallas=len(flags_list), map_xla=30 - 2 * len(flags_list),
                rank_step_ms=17.0, layer_us=200.0 + len(flags_list), layer_stderr_us=1.0, tokens_per_s=190.0,
                latency_us=0, launches=None, kernel_us=None, source="cpu: fake")

  monkeypatch.setattr(fold_chain, "run_arm", fake_arm)
  chain = lambda base, folds: fold_chain.run_chain(tmp_path, base, folds, layer=4, timeout=1)
  rows = chain("--config=tiny", ["router", "value_merge"])
  assert [name for name, _ in rows] == ["base", "+router", "+value_merge"]
  assert measured == ["--config=tiny", "--router=pallas", "--value_merge=pallas"]
  chain("--config=tiny", ["router", "value_merge", "mla_epilogue"])
  assert measured[3:] == ["--mla_epilogue=pallas"]
  chain("--config=tiny --context=64", ["router"])   # a new base: every arm's flags changed
  assert measured[4:] == ["--context=64", "--router=pallas"]
  table = (tmp_path / "fold_chain.md").read_text().splitlines()
  assert [line.split(" | ")[0] for line in table[2:]] == ["| base", "| +router"]
  assert " | 28 | 2 | 26 | " in table[2] and " | - | - | " in table[2]   # no profile on the CPU
  assert (tmp_path / "fold_chain.png").stat().st_size > 1000


@pytest.mark.side_lane  # about a minute on 2 cores: beside the multi-device tests (Makefile)
def test_two_arms_of_tep_project_end_to_end(tmp_path):
  # The whole 2-layer model timed (no --measure_layers): a quick fit of 1 and 2 layers on a busy
  # CPU can come out negative, and tep_project rightly refuses a negative step. A plain decode
  # step, whose program (jit_decode) the chain must find too: the speculative one also compiles
  # the MTP layer and the draft loop.
  base = ("--config=tiny2 --full_config=tiny2 --tep=2 --context=256 --quick --attention=pallas "
          "--dense_matmul=pallas_grouped")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
  proc = subprocess.run([sys.executable, "-m", "experiments.fold_chain", f"--base={base}", "--folds=query_absorb",
                         "--map_layer=1", f"--output_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  points = json.loads((tmp_path / "fold_chain.json").read_text())["points"]
  assert list(points) == ["base", "+query_absorb"]
  assert points["+query_absorb"]["settings"][-1] == "--query_absorb=pallas"
  for name, m in points.items():
    assert m["map_kernels"] > 0 and m["map_pallas"] == 0   # interpret mode: no custom call on the CPU
    assert m["rank_step_ms"] > 0 and m["tokens_per_s"] > 0 and m["layer_us"] is None, name
    assert m["launches"] is None and m["source"].startswith("timed on cpu"), name
    arm = tmp_path / f"arm_{list(points).index(name)}"
    assert json.loads((arm / "tep.json").read_text())["measured"]["source"] == m["source"]
    sites = json.loads((arm / "layer_map.json").read_text())
    assert len(sites) == m["map_kernels"] and all("layers_1/" in s["op_name"] for s in sites)
  assert (tmp_path / "fold_chain.md").read_text() in proc.stdout
