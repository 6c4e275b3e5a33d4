"""Run presets (configs/runs.py): each builds a valid Runtime, every experiment with --preset
defines its keys, and a flag on the command line wins over its preset's value."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
from absl import flags

from configs import get_model_config
from configs.runs import EXPERIMENT_FLAGS, RUN_PRESETS, get_run_preset
from experiments.kernel_flags import apply_preset
from glmjax.runtime import Runtime, make_runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME_FIELDS = {f.name for f in dataclasses.fields(Runtime)}


@pytest.mark.parametrize("name", sorted(RUN_PRESETS))
def test_each_preset_builds_a_valid_runtime(name):
  preset = get_run_preset(name)
  assert set(preset) <= RUNTIME_FIELDS | set(EXPERIMENT_FLAGS)
  runtime = make_runtime(get_model_config("tiny"), **{k: v for k, v in preset.items() if k not in EXPERIMENT_FLAGS})
  assert all(getattr(runtime, k) == v for k, v in preset.items() if k in RUNTIME_FIELDS)


def test_an_unknown_preset_names_the_known_ones():
  with pytest.raises(ValueError, match="'fastest'.*rank_fastest"):
    get_run_preset("fastest")


def _flag_values(names) -> flags.FlagValues:
  values = flags.FlagValues()
  for name in ("preset", *names):
    flags.DEFINE_string(name, "unset", "", flag_values=values)
  return values


def test_the_command_line_wins_over_the_preset():
  values = _flag_values(RUN_PRESETS["rank_fastest"])
  values(["prog", "--preset=rank_fastest", "--kv_dtype=bf16"])
  apply_preset(values)
  assert values.kv_dtype == "bf16"
  assert values.weights == "nvfp4_experts" and values.residual_norm == "pallas"


def test_a_preset_key_the_experiment_lacks_is_named():
  values = _flag_values(set(RUN_PRESETS["rank_fastest"]) - {"moe_routing"})
  values(["prog", "--preset=rank_fastest"])
  with pytest.raises(ValueError, match="--moe_routing, which this experiment does not define"):
    apply_preset(values)


_APPLY = """
import importlib, json, sys
from absl import flags
from configs.runs import RUN_PRESETS
from experiments.kernel_flags import apply_preset
importlib.import_module(sys.argv[1])
for name, preset in RUN_PRESETS.items():
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["prog", f"--preset={name}"])
  apply_preset()
  print(json.dumps({key: flags.FLAGS[key].value for key in preset}))
"""


@pytest.mark.parametrize("module", ["experiments.replay", "experiments.tep_project", "experiments.multigpu_run"])
def test_every_experiment_with_the_flag_takes_every_preset(module):
  proc = subprocess.run([sys.executable, "-c", _APPLY, module], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert [json.loads(line) for line in proc.stdout.splitlines()] == list(RUN_PRESETS.values())
