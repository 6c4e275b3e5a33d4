"""The study runners on the tiny config: the host-driven decode loop equals the device loop, the
chain's switches accumulate, and `ablate` / `sweep` run end to end, resume, and keep the greedy
tokens of the rows that must not change them.

The entry points run in their own processes (their absl flags stand alone), side by side, with
XLA's CPU backend at optimization level 0 and a shared persistent compilation cache: compiling
is nearly all of their time at this scale.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_model_config
from experiments import study
from glmjax import hlo_stats
from glmjax.engine.engine import Engine
from glmjax.model import init_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
# page_size 8: contexts 10 and 12 share one engine geometry, so the context point reuses programs.
TINY = ["--config=tiny2", "--checkpoint=", "--dtype=float32", "--context=12", "--new_tokens=5", "--append=3",
        "--page_size=8", "--prefill_chunk=16", "--num_draft=2"]


def test_host_loop_equals_device_loop():
  """Plain decoding, both ways: same tokens, same steps (test_ablate_and_sweep_on_tiny compares
  the speculative loop's two modes: its rows nvfp4 and device_loop)."""
  config = get_model_config("tiny")
  params = jax.jit(lambda k: init_params(config, k, param_dtype=jnp.float32))(jax.random.key(7))
  rng = np.random.default_rng(7)
  rounds = [rng.integers(2, config.vocab_size, n).tolist() for n in (11, 4)]
  runs = {}
  for device_loop in (True, False):
    engine = Engine(config, params, page_size=4, max_seq_len=64, num_pages=40, prefill_chunk=16, kv_dtype="fp32",
                    device_loop=device_loop)
    session = engine.open_session()
    stats = [engine.run_round([session], [r], 6, ignore_eos=True)[0] for r in rounds]
    runs[device_loop] = [(s.output, s.decode_steps, s.cached_tokens) for s in stats]
    text = engine.compiled_decode().as_text()
    # The device program holds the loop; the host's one-step program is one iteration of it.
    kernels = hlo_stats.loop_kernels(text) if device_loop else hlo_stats.program_kernels(text)
    assert kernels > 10 * config.num_hidden_layers
  assert runs[True] == runs[False]
  assert all(len(out) == 6 for out, *_ in runs[True])


def test_chain_switches_accumulate():
  previous = None
  for name, _, changes in study.CHAIN:
    s = study.chain_switches(name)
    assert all(getattr(s, k) == v for k, v in changes.items())
    if previous is not None:
      changed = {f.name for f in dataclasses.fields(s) if getattr(s, f.name) != getattr(previous, f.name)}
      assert changed == set(changes), name
    previous = s
  # A row's value overrides apply from that row on; other overrides everywhere.
  assert (study.chain_switches("prefix_cache", num_draft=2, index_topk=5)
          == study.Switches(prefix_cache=True, index_topk=5))
  assert study.chain_switches("mtp", num_draft=2).num_draft == 2
  with pytest.raises(ValueError, match="unknown chain row"):
    study.chain_switches("turbo")
  with pytest.raises(ValueError, match="index_share"):
    study.Switches(index_share=0)


@pytest.mark.parametrize("context", [200, 5000])
def test_step_bytes_follow_the_switches(context):
  config = get_model_config("mini")
  bytes_of = lambda **kw: study.step_bytes(config, study.Switches(**kw), context, 1)
  dense, sparse = bytes_of(attention="dense"), bytes_of(attention="sparse")
  assert dense[0] == sparse[0]
  assert dense[1] > sparse[1] if context > config.index_topk else dense[1] == sparse[1]
  assert bytes_of(kv_dtype="fp8")[1] < dense[1]
  assert bytes_of(weights="nvfp4_experts")[0] < dense[0]
  assert bytes_of(index_share=2)[1] < dense[1]          # fewer indexer keys read
  spec = bytes_of(num_draft=4)
  assert spec[0] > dense[0] and spec[1] > dense[1]      # k MTP passes and a k + 1 token verify
  tree = bytes_of(num_draft=4, draft_branch=2)          # 8 paths verified as batch rows
  assert tree[0] > spec[0] and tree[1] > spec[1]


def _launch(module: str, args: list[str], log: pathlib.Path, cache: pathlib.Path) -> subprocess.Popen:
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")  # XLA_FLAGS: conftest's compile flags
  with open(log, "w") as f:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: pathlib.Path, *, ok: bool = True) -> str:
  proc.wait(timeout=600)
  text = log.read_text()
  assert (proc.returncode == 0) == ok, text[-3000:]
  return text


@pytest.mark.side_lane  # 80-100 s on 2 cores: beside the multi-device tests (Makefile)
def test_ablate_and_sweep_on_tiny(tmp_path):
  """The chain in two processes sharing one ablate.json (Pallas rows compile slowly in interpret
  mode), the sweeps after the first (their programs are its sparse row's, from the disk cache),
  then the whole chain again with one row dropped: it measures that row only."""
  cache, out = tmp_path / "jax_cache", tmp_path / "ablate"
  ablate = lambda rows, contexts, log: _launch("experiments.ablate", TINY + [
      f"--rows={rows}", f"--contexts={contexts}", f"--output_dir={out}"], tmp_path / log, cache)
  cut = study.ROW_NAMES.index("index_share")
  first = ablate(",".join(study.ROW_NAMES[:cut]), "", "first.log")
  second = ablate(",".join(study.ROW_NAMES[cut:]), "10", "second.log")
  _wait(first, tmp_path / "first.log")
  sweep = _launch("experiments.sweep", TINY + [
      "--base=sparse", "--sweep=context,draft,concurrency,topk,index_share", "--contexts=10,5000", "--drafts=2",
      "--branches=1", "--concurrencies=1,2", "--topks=8", "--index_shares=1", "--profile_kernels",
      f"--profile={tmp_path / 'traces'}", f"--output_dir={tmp_path / 'sweep'}"], tmp_path / "sweep.log", cache)
  _wait(second, tmp_path / "second.log")
  # tiny has 4096 positions: the 5000-token point fails, is reported, and the others still run.
  log = _wait(sweep, tmp_path / "sweep.log", ok=False)
  assert "context=5000: FAILED ValueError" in log and "1 point(s) failed" in log

  points = json.loads((out / "ablate.json").read_text())["points"]
  assert set(points) == set(study.ROW_NAMES) | {"device_loop@10"}
  for name, m in points.items():
    for key in ("decode_tokens_per_s", "step_s", "ttft_s", "floor_s", "floor_fraction", "weight_bytes_per_step",
                "kv_bytes_per_step", "kernels_per_layer_hlo", "decode_program_bytes", "decode_steps"):
      assert m[key] > 0, (name, key, m[key])
    assert m["acceptance_length"] >= 1
    assert all(len(rnd) == 5 for rnd in m["generated"][0])
  tokens = {name: m["generated"] for name, m in points.items()}
  # Exact: the prefix cache, greedy speculation, the Pallas kernels (against their references) and
  # the device loop (here the speculative one) keep the tokens. Dense -> sparse, IndexShare, FP8
  # KV and NVFP4 change numerics.
  assert tokens["baseline"] == tokens["prefix_cache"] == tokens["mtp"]
  assert tokens["sparse"] == tokens["pallas"]
  assert tokens["nvfp4"] == tokens["device_loop"]
  assert points["device_loop@10"]["context"] < points["device_loop"]["context"]
  assert points["baseline"]["cached_tokens"] == 0 < points["prefix_cache"]["cached_tokens"]
  assert points["mtp"]["verify_steps"] > 0 and points["sparse"]["verify_steps"] > 0
  assert points["baseline"]["verify_steps"] == 0

  sweeps = {name: json.loads((tmp_path / "sweep" / f"sweep_{name}.json").read_text())["points"]
            for name in ("context", "draft", "concurrency", "topk", "index_share")}
  assert {n: list(p) for n, p in sweeps.items()} == {
      "context": ["context=10"], "draft": ["k=2,b=1"], "concurrency": ["concurrency=1", "concurrency=2"],
      "topk": ["topk=8"], "index_share": ["index_share=1"]}
  for name, pts in sweeps.items():
    assert all(m["decode_tokens_per_s"] > 0 and m["step_s"] > 0 for m in pts.values()), name
    assert all(m["kernels_per_layer_trace"] is None for m in pts.values())   # no device events on the CPU
    assert (tmp_path / "sweep" / f"sweep_{name}.png").stat().st_size > 1000
  assert len(list((tmp_path / "traces").glob("*/plugins/profile/*/perfetto_trace.json.gz"))) == 6
  assert len(sweeps["concurrency"]["concurrency=2"]["generated"]) == 2
  # The sweep's base is the chain's sparse row: the same tokens.
  assert sweeps["draft"]["k=2,b=1"]["generated"] == tokens["sparse"]

  stored = json.loads((out / "ablate.json").read_text())
  del stored["points"]["prefix_cache"]
  (out / "ablate.json").write_text(json.dumps(stored))
  log = _wait(ablate(",".join(study.ROW_NAMES), "10", "all.log"), tmp_path / "all.log")
  again = json.loads((out / "ablate.json").read_text())["points"]
  assert set(again) == set(points)
  assert log.count("done earlier, skipped") == len(points) - 1
  for name, m in again.items():
    assert (m["measured_at"] == points[name]["measured_at"]) == (name != "prefix_cache"), name
  assert again["prefix_cache"]["generated"] == tokens["prefix_cache"]
  table = (out / "ablate.md").read_text()
  assert table in log and "+MTP (k=2)" in table
  *rows, blank, gap = table.splitlines()
  assert len(rows) == 2 + len(points) and blank == ""
  host_gap = again["nvfp4"]["step_s"] - again["device_loop"]["step_s"]
  assert gap.startswith(f"host gap per decode step: {1e3 * host_gap:.3f} ms"), gap
  assert [line.split(",")[0] for line in (out / "ablate.csv").read_text().splitlines()[1:4]] == [
      "baseline", "+prefix cache", "+MTP (k=2)"]
  for png in ("ablate_tokens_per_s.png", "ablate_step_vs_floor.png", "ablate_contexts.png"):
    assert (out / png).stat().st_size > 1000


@pytest.mark.side_lane  # 30 s on 2 cores
def test_quant_eval_on_tiny(tmp_path):
  """The policies' accuracy table: the reference first and equal to itself, every loss finite and
  positive, weights smaller in the order bf16 > NVFP4 experts > NVFP4 everywhere, the table printed."""
  out = tmp_path / "quant_eval.json"
  log = _wait(_launch("experiments.quant_eval", [
      "--config=tiny2", "--checkpoint=", "--policies=none,nvfp4_experts,nvfp4", "--tokens=4", "--prompts=2",
      "--prompt_len=8", "--windows=2", "--seq_len=16", f"--output={out}"], tmp_path / "log", tmp_path / "cache"),
      tmp_path / "log")
  rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
  assert list(rows) == ["none", "nvfp4_experts", "nvfp4"]
  assert rows["none"]["ppl_change"] == 0 and rows["none"]["agreement"] == rows["none"]["agreement_forced"] == 1
  assert all(0 < r["loss"] < 20 and r["ppl"] == pytest.approx(np.exp(r["loss"]), rel=1e-6) for r in rows.values())
  assert 1 == rows["none"]["bytes_ratio"] > rows["nvfp4_experts"]["bytes_ratio"] > rows["nvfp4"]["bytes_ratio"] > 0.25
  assert all(f"{name} " in log for name in rows)
