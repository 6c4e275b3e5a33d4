"""Kernel counts: from compiled HLO (predictable on the CPU backend) and from perfetto traces."""

import dataclasses
import gzip
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax import hlo_stats


def _layers(n: int, branch: bool):
  """n "layers" of tanh(x @ w) in a 5-step loop, optionally ending in a data-dependent cond.

  XLA's CPU backend compiles each layer to 2 kernels (the dot's fusion, the tanh fusion), the
  loop counter's add to 1 and the loop condition to 1; the cond adds its predicate (1) and both
  branches (a sort, a multiply fusion)."""
  def f(x, w):
    def body(_, x):
      for _ in range(n):
        x = jnp.tanh(x @ w)
      if branch:
        x = jax.lax.cond(x.sum() > 0, lambda x: jnp.sort(x, axis=-1), lambda x: x * 3.0, x)
      return x
    return jax.lax.fori_loop(0, 5, body, x)
  return f


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("branch", [False, True])
def test_loop_kernels_of_a_hand_built_loop(n, branch):
  rng = np.random.default_rng(n)
  x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8), (8, 8)))
  text = jax.jit(_layers(n, branch)).lower(x, w).compile().as_text()
  want = 2 * n + 2 + (3 if branch else 0)
  assert hlo_stats.loop_kernels(text) == want
  assert hlo_stats.kernels_per_layer(text, n) == pytest.approx(want / n)
  # The entry also runs two copies of the loop's inputs before the loop.
  assert hlo_stats.program_kernels(text) == want + 2
  assert hlo_stats.module_name(text) == "jit_f"


@pytest.mark.parametrize("n", [1, 2])
def test_program_kernels_of_a_one_step_program(n):
  rng = np.random.default_rng(10 + n)
  x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8), (8, 8)))

  def step(x, w):
    for _ in range(n):
      x = jnp.tanh(x @ w)
    return x

  text = jax.jit(step).lower(x, w).compile().as_text()
  assert hlo_stats.program_kernels(text) == 2 * n
  assert hlo_stats.kernels_per_layer(text, n, loop=False) == 2
  with pytest.raises(ValueError, match="no while loop"):
    hlo_stats.loop_kernels(text)


HAND_WRITTEN = """HloModule decode, entry_computation_layout={()->f32[4]}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %f)
}

%inner_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%left (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %s = f32[4]{0} sort(%x), dimensions={0}, to_apply=%fused
  ROOT %k = f32[4]{0} custom-call(%s), custom_call_target="kernel"
}

%right (x: f32[4]) -> f32[4] {
  ROOT %x = f32[4]{0} parameter(0)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %w = (s32[], f32[4]{0}) while(%t), condition=%inner_cond, body=%inner_body
  %y = f32[4]{0} get-tuple-element(%w), index=1
  %b = s32[] constant(0)
  %z = f32[4]{0} conditional(%b, %y, %y), branch_computations={%left, %right}
  %ar = f32[4]{0} all-reduce-start(%z), to_apply=%fused
  %ad = f32[4]{0} all-reduce-done(%ar)
  %cp = f32[4]{0} copy(%ad)
  %bc = f32[2,2]{1,0} bitcast(%cp)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %cp)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(9)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main () -> f32[4] {
  %z = f32[4]{0} constant({1, 2, 3, 4})
  %i = s32[] constant(0)
  %d = f32[4]{0} dot(%z, %z)
  %t = (s32[], f32[4]{0}) tuple(%i, %d)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_rules_on_hand_written_hlo():
  """Body: inner loop (fusion + compare = 2), conditional (sort + custom-call in one branch,
  nothing in the other = 2), all-reduce start only (1), copy (1); condition: compare (1).
  Fused computations are not entered; constants, tuples, bitcasts are free."""
  assert hlo_stats.loop_kernels(HAND_WRITTEN) == 7
  assert hlo_stats.program_kernels(HAND_WRITTEN) == 8   # + the dot before the loop
  assert hlo_stats.kernels_per_layer(HAND_WRITTEN, 2) == 3.5
  with pytest.raises(ValueError, match="num_layers"):
    hlo_stats.kernels_per_layer(HAND_WRITTEN, 0)
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_stats.loop_kernels(HAND_WRITTEN.replace("ENTRY ", ""))


def _perfetto(path, events):
  with gzip.open(path, "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)


@pytest.mark.parametrize("steps", [2, 5])
def test_trace_kernels_counts_device_stream_events_within_the_module(tmp_path, steps):
  rng = np.random.default_rng(steps)
  per_step = int(rng.integers(3, 9))
  meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
          dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #7(Compute)")),
          dict(ph="M", name="thread_name", pid=1, tid=1, args=dict(name="XLA Modules")),
          dict(ph="M", name="thread_name", pid=1, tid=2, args=dict(name="XLA Ops")),
          dict(ph="M", name="process_name", pid=9, args=dict(name="/host:CPU")),
          dict(ph="M", name="thread_name", pid=9, tid=3, args=dict(name="python"))]
  events, t = list(meta), 0.0
  for s in range(steps):
    events.append(dict(ph="X", pid=1, tid=1, name="jit__host_step(42)", ts=t, dur=100.0))
    for k in range(per_step):
      events.append(dict(ph="X", pid=1, tid=7, name=f"fusion_{k}", ts=t + 1 + 10 * k, dur=5.0))
      events.append(dict(ph="X", pid=1, tid=2, name=f"fusion_{k}", ts=t + 1 + 10 * k, dur=5.0))  # derived line
    events.append(dict(ph="X", pid=1, tid=7, name="MemcpyDtoH", ts=t + 95, dur=1.0))
    events.append(dict(ph="X", pid=9, tid=3, name="host work", ts=t + 2, dur=50.0))
    t += 200.0
  # Another program's kernels, outside the decode step's runs.
  events += [dict(ph="X", pid=1, tid=1, name="jit_prefill_chunk(3)", ts=t, dur=50.0),
             dict(ph="X", pid=1, tid=7, name="other", ts=t + 1, dur=5.0)]
  (tmp_path / "plugins" / "profile" / "run").mkdir(parents=True)
  _perfetto(tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz", events)
  assert hlo_stats.trace_kernels(tmp_path, module="jit__host_step") == dict(kernels=steps * per_step,
                                                                            module_runs=steps)
  assert hlo_stats.trace_kernels(tmp_path)["kernels"] == steps * per_step + 1
  # A module name that matches no run is "unknown", not zero kernels (the H200 ablate run of
  # 2026-12-01 reported 0.0 this way).
  assert hlo_stats.trace_kernels(tmp_path, module="jit_no_such_program") is None


def test_trace_kernels_of_a_cpu_trace_is_none(tmp_path):
  """The CPU backend's kernels run on host threads: no device events, so no count."""
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    f(x).block_until_ready()
  assert hlo_stats.trace_kernels(tmp_path, module="jit__lambda") is None
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="perfetto"):
    hlo_stats.trace_kernels(tmp_path / "empty")


SCOPED = """HloModule scoped, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p), metadata={op_name="jit(f)/while/body/layers_0/exp"}
  ROOT %n = f32[4]{0} negate(%e), metadata={op_name="jit(f)/while/body/layers_1/neg"}
}

%left (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %k = (f32[4,8]{1,0}, s32[2,3]{1,0}) custom-call(%x), custom_call_target="kernel", metadata={op_name="jit(f)/while/body/cond/branch_0_fun/layers_1/attn/jit(kern)/kern/pallas_call" source_file="/x.py" source_line=3}
  ROOT %g = f32[4]{0} get-tuple-element(%k), index=0, metadata={op_name="jit(f)/while/body/cond/branch_0_fun/layers_1/attn/jit(kern)/kern/pallas_call"}
}

%right (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%x), metadata={op_name="jit(f)/while/body/cond/branch_1_fun/layers_1/neg"}
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1, metadata={op_name="jit(f)/while/body/layers_0/x"}
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/while/body/layers_0/exp"}
  %d = f32[4]{0} dot(%f, %f), metadata={op_type="dot" op_name="jit(f)/while/body/layers_0/mlp/dot_general"}
  %b = s32[] constant(0)
  %z = f32[4]{0} conditional(%b, %d, %d), branch_computations={%left, %right}, metadata={op_name="jit(f)/while/body/cond"}
  %c = f32[4]{0} copy(%z)
  %a = f32[4]{0} add(%c, %c), metadata={op_name="jit(f)/while/body/layers_1/add"}
  %m = f32[4]{0} multiply(%a, %a), metadata={op_name="jit(f)/while/body/layers_10/mul"}
  %i = s32[] get-tuple-element(%t), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one), metadata={op_name="jit(f)/while/body/add"}
  ROOT %r = (s32[], f32[4]{0}) tuple(%next, %m)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(9)
  ROOT %lt = pred[] compare(%i, %c), direction=LT, metadata={op_name="jit(f)/while/cond/lt"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x"}
  %s = f32[4]{0} sine(%x), metadata={op_name="jit(f)/layers_0/sin"}
  %i = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%i, %s)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_scope_kernels_of_hand_written_hlo():
  """Program order through a loop and its conditional's branches; fused computations are not
  entered (their layers_0 / layers_1 ops are inside fusion %f); free ops are not kernels."""
  Site = hlo_stats.KernelSite
  body = "jit(f)/while/body/"
  assert hlo_stats.scope_kernels(SCOPED, "layers_0/") == [
    Site("s", "sine", "f32[4]{0}", "jit(f)/layers_0/sin", "", "sin"),
    Site("f", "fusion", "f32[4]{0}", body + "layers_0/exp", "", "exp"),
    Site("d", "dot", "f32[4]{0}", body + "layers_0/mlp/dot_general", "mlp", "dot_general")]
  assert hlo_stats.scope_kernels(SCOPED, "layers_1/") == [
    Site("k", "custom-call", "f32[4,8]{1,0}",
         body + "cond/branch_0_fun/layers_1/attn/jit(kern)/kern/pallas_call", "attn/jit(kern)/kern", "pallas_call"),
    Site("n", "negate", "f32[4]{0}", body + "cond/branch_1_fun/layers_1/neg", "", "neg"),
    Site("a", "add", "f32[4]{0}", body + "layers_1/add", "", "add")]
  # A plain substring: without the slash, layers_1 also takes layers_10.
  assert [s.name for s in hlo_stats.scope_kernels(SCOPED, "layers_1")] == ["k", "n", "a", "m"]
  assert hlo_stats.program_kernels(SCOPED) == 10   # sine; compare; f, d, k, n, copy, a, m, next


def test_scope_kernels_of_an_unknown_scope_raises():
  with pytest.raises(ValueError, match="'layers_9/'"):
    hlo_stats.scope_kernels(SCOPED, "layers_9/")


@pytest.mark.parametrize("n", [2, 3])
def test_scope_kernels_of_a_compiled_program(n):
  """n named-scope "layers" in a loop, compiled on the CPU: each layer has kernels of its own
  scope only, and all of them are kernels of the program."""
  def f(x, w):
    def body(_, x):
      for i in range(n):
        with jax.named_scope(f"layers_{i}"):
          x = jnp.tanh(x @ w) + 1.0
          x = x / jnp.sum(x, axis=-1, keepdims=True)
      return x
    return jax.lax.fori_loop(0, 3, body, x)

  rng = np.random.default_rng(n)
  x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8), (8, 8)))
  text = jax.jit(f).lower(x, w).compile().as_text()
  computations, entry = hlo_stats.parse(text)
  every = [inst.name for inst in hlo_stats.kernel_instructions(computations, entry)]
  assert len(every) == hlo_stats.program_kernels(text)
  names = []
  for i in range(n):
    sites = hlo_stats.scope_kernels(text, f"layers_{i}/")
    assert sites and all(f"layers_{i}/" in s.op_name for s in sites)
    names += [s.name for s in sites]
  assert len(set(names)) == len(names) and set(names) <= set(every)


def test_layer_map_cli_writes_scope_kernels(tmp_path):
  (tmp_path / "m.txt").write_text(SCOPED)
  out = tmp_path / "map.json"
  run = subprocess.run([sys.executable, "-m", "experiments.layer_map", f"--hlo={tmp_path / 'm.txt'}",
                        "--scope=layers_1/", "--depth=1", f"--output={out}"],
                       cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, check=True)
  assert "3 of the program's 10 kernels are under layers_1/" in run.stdout
  got = json.loads(out.read_text())
  assert got["kernels"] == [dataclasses.asdict(s) for s in hlo_stats.scope_kernels(SCOPED, "layers_1/")]
  assert got["summary"] == {"attn": {"custom-call": 1}, "": {"negate": 1, "add": 1}}
