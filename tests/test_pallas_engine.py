"""`--attention=pallas` (the DSA kernels, interpret mode here) generates exactly the tokens of
`--attention=sparse` (their jnp references) on a random tiny model.

Contexts of 30-40 tokens exceed the tiny config's index_topk of 8, so the selection matters.
Besides the tokens, every kernel call of the pallas run is replayed through the reference on
the same inputs (the real model's queries and pages): selected sets exactly equal, attention
within fp32 rounding (1e-5 of the largest output), so a token mismatch names the kernel.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
# Imported before anything is traced: the first interpret-mode pallas_call lowering imports the
# Pallas fuser, whose tracing-context flag changes every jit cache key (so programs compiled
# before it would compile again).
from jax.experimental.pallas import fuser  # noqa: F401

import glmjax
from configs import get_model_config
from glmjax import attention, dsa, layers, quant
from glmjax.model import init_params
from glmjax.runtime import Runtime
from pallas_kernels import bf16_matmul as bf16_matmul_module
from pallas_kernels import indexer_keys as indexer_keys_module
from pallas_kernels import indexer_topk
from pallas_kernels import paged_write as paged_write_module
from pallas_kernels import residual_norm as residual_norm_module
from pallas_kernels import sparse_mla

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT, NEW = 30, 10


@pytest.fixture(scope="module")
def tiny():
  config = get_model_config("tiny")
  return config, init_params(config, jax.random.key(0))


def _generate(tiny, attention: str, kv_dtype: str, **switches) -> np.ndarray:
  config, params = tiny
  prompt = np.random.default_rng(0).integers(2, config.vocab_size, (2, PROMPT)).astype(np.int32)
  return glmjax.generate(config, params, prompt, NEW, ignore_eos=True,
                         runtime=Runtime(attention=attention, **switches), kv_dtype=kv_dtype, page_size=8)


_BASELINES: dict[tuple, np.ndarray] = {}


def _baseline(tiny, attention: str, kv_dtype: str, **switches) -> np.ndarray:
  """_generate's tokens for a test's reference arm, computed once for the module (the tiny
  model is module-scoped): call it before any monkeypatch, whose effect would be kept."""
  key = (attention, kv_dtype, tuple(sorted(switches.items())))
  if key not in _BASELINES:
    _BASELINES[key] = _generate(tiny, attention, kv_dtype, **switches)
  return _BASELINES[key]


def _record_pallas_calls(monkeypatch) -> list[tuple]:
  """Makes dsa's kernel dispatch also hand each call's output and inputs to the host; returns
  the list that collects (kind, reference fn, its static args, output, inputs) per call."""
  calls = []
  cached_topk, cached_attention = dsa.cached_topk, dsa.cached_attention
  ref_topk = jax.jit(cached_topk, static_argnums=(5, 6, 7))
  ref_attention = jax.jit(cached_attention, static_argnums=(6, 7))

  def record(kind, ref, static, got, *inputs):
    calls.append((kind, ref, static, *jax.tree.map(np.array, (got, inputs))))

  def topk(q, weights, layer, page_table, positions, k, impl, ties="index", topk_config=None, scores_config=None):
    got = cached_topk(q, weights, layer, page_table, positions, k, impl, ties, topk_config, scores_config)
    jax.debug.callback(functools.partial(record, "topk", ref_topk, (k, "sparse", ties)),
                       got, q, weights, layer, page_table, positions)
    return got

  def attention(q_latent, q_rope, layer, page_table, positions, topk, scale, impl, config=None):
    got = cached_attention(q_latent, q_rope, layer, page_table, positions, topk, scale, impl, config)
    jax.debug.callback(functools.partial(record, "attention", ref_attention, (scale, "sparse")),
                       got, q_latent, q_rope, layer, page_table, positions, topk)
    return got

  monkeypatch.setattr(dsa, "cached_topk", topk)
  monkeypatch.setattr(dsa, "cached_attention", attention)
  return calls


@pytest.mark.parametrize("kv_dtype", ["fp8"])  # bf16 pages: test_replay_pallas_equals_sparse
def test_pallas_generates_sparse_tokens(tiny, kv_dtype, monkeypatch):
  assert tiny[0].index_topk < PROMPT, "the contexts must exceed index_topk for selection to matter"
  sparse = _baseline(tiny, "sparse", kv_dtype)
  calls = _record_pallas_calls(monkeypatch)
  pallas = _generate(tiny, "pallas", kv_dtype)
  jax.effects_barrier()
  # NEW model calls (the prefill chunk, NEW - 1 decode steps) of 7 kernel calls: layers 0, 1
  # and 3 run their indexer, all 4 attend.
  assert len(calls) == 7 * NEW, "no kernel ran: a program compiled earlier served the call"
  for i, (kind, ref, static, got, inputs) in enumerate(calls):
    want = np.asarray(ref(*inputs, *static))
    if kind == "topk":  # the same set per query token, exactly
      np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1), err_msg=f"call {i}")
    else:  # fp32 rounding
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= 1e-5, f"call {i}: attention differs by {err:.2e} of its largest output"
  np.testing.assert_array_equal(pallas, sparse)


# The folds' token tests, two decodes each (~20 s apiece): in the side lane beside the
# multi-device tests (Makefile), which keeps the main suite's time in bounds.
fold_lane = pytest.mark.side_lane


def _fail_in_decode_steps(monkeypatch, module, name: str) -> None:
  """Makes module.name fail where a decode step calls it (at most 8 query tokens on axis 1 of its
  first argument); the prefill's calls go through."""
  original = getattr(module, name)

  def prefill_only(x, *args):
    if x.shape[1] <= 8:
      pytest.fail(f"a decode step called {name}")
    return original(x, *args)

  monkeypatch.setattr(module, name, prefill_only)


@fold_lane
def test_value_merge_in_the_kernel_generates_the_same_tokens(tiny, monkeypatch):
  """value_merge="pallas": decode steps run the split merge and the value product in one launch
  (their two-step path fails here); tokens equal to the two steps'."""
  two_steps = _baseline(tiny, "pallas", "fp8")
  _fail_in_decode_steps(monkeypatch, dsa, "cached_attention")
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", value_merge="pallas"), two_steps)


@fold_lane
def test_query_absorb_in_the_kernel_generates_the_same_tokens(tiny, monkeypatch):
  """query_absorb="pallas": decode steps build the absorbed query in one launch from q_b's
  partials (the XLA product fails for them here); tokens equal to the XLA path's."""
  xla = _baseline(tiny, "pallas", "fp8")
  _fail_in_decode_steps(monkeypatch, dsa, "query_absorption")
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", query_absorb="pallas"), xla)


def _record_group_sizes(monkeypatch) -> list[int]:
  """The number of weights in each quant.linear_group_partials call from now on."""
  groups, original = [], quant.linear_group_partials
  record = lambda x, weights, **kw: groups.append(len(weights)) or original(x, weights, **kw)
  monkeypatch.setattr(quant, "linear_group_partials", record)
  return groups


@fold_lane
def test_query_absorb_groups_q_b_with_the_indexers_wq_b(tiny, monkeypatch):
  """Under dense_matmul="pallas_grouped", query_absorb="pallas" runs the indexer's wq_b in q_b's
  GEMV launch (both read q_resid): decode steps hand both weights to one group; tokens equal."""
  ungrouped = _baseline(tiny, "pallas", "fp8", dense_matmul="pallas_grouped")
  groups = _record_group_sizes(monkeypatch)
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", dense_matmul="pallas_grouped", query_absorb="pallas"),
                                ungrouped)
  assert 2 in groups and set(groups) <= {1, 2}  # 1: a layer reusing a preceding top-k runs no wq_b


@fold_lane
def test_indexer_keys_in_the_kernel_generate_the_same_tokens(tiny, monkeypatch):
  """indexer_keys="pallas": decode steps finish the indexer's key and head weights in one launch
  from their GEMV's partials (k_norm's XLA path fails for them here); tokens equal."""
  xla = _baseline(tiny, "pallas", "fp8")
  _fail_in_decode_steps(monkeypatch, layers, "layer_norm")
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", indexer_keys="pallas"), xla)


@fold_lane
def test_mla_epilogue_in_the_kernel_generates_the_same_tokens(tiny, monkeypatch):
  """mla_epilogue="pallas": decode steps normalise q_a and kv_a and rotate k_pe in one launch from
  their GEMV's partials (attention's XLA rotation fails for them here, the query's RoPE being in
  the absorbed-query kernel); tokens equal."""
  xla = _baseline(tiny, "pallas", "fp8", query_absorb="pallas")
  _fail_in_decode_steps(monkeypatch, attention, "apply_rope")
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", query_absorb="pallas", mla_epilogue="pallas"), xla)


@fold_lane
def test_index_epilogue_joins_the_indexers_keys_to_mlas_launch(tiny, monkeypatch):
  """index_epilogue="pallas": decode steps run the indexer's wk and weights_proj in q_a's and
  kv_a's GEMV group and its key epilogue in MLA's launch (indexer_keys' own launch fails here);
  tokens equal to the separate launches'."""
  switches = dict(dense_matmul="pallas_grouped", query_absorb="pallas", indexer_keys="pallas", mla_epilogue="pallas")
  separate = _baseline(tiny, "pallas", "fp8", **switches)
  groups = _record_group_sizes(monkeypatch)
  monkeypatch.setattr(indexer_keys_module, "indexer_keys", lambda *a, **kw: pytest.fail("indexer_keys' own launch ran"))
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", index_epilogue="pallas", **switches), separate)
  assert 4 in groups  # q_a, kv_a, wk, weights_proj


@fold_lane
def test_epilogue_write_moves_the_cache_write_into_mlas_launch(tiny, monkeypatch):
  """epilogue_write="pallas": MLA's joined epilogue launch writes the decode step's new rows into
  the pages (paged_write's own launch fails for decode steps here; prefill keeps it); tokens
  equal to the separate write's."""
  switches = dict(dense_matmul="pallas_grouped", indexer_keys="pallas", mla_epilogue="pallas", index_epilogue="pallas",
                  cache_write="pallas")
  separate = _baseline(tiny, "pallas", "fp8", **switches)
  own_launch = paged_write_module.paged_write

  def prefill_only(layer, page_table, positions, *rows, **kw):
    if positions.shape[1] <= 8:
      pytest.fail("a decode step called paged_write")
    return own_launch(layer, page_table, positions, *rows, **kw)

  monkeypatch.setattr(paged_write_module, "paged_write", prefill_only)
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", epilogue_write="pallas", **switches), separate)


@fold_lane
def test_router_group_runs_the_router_in_the_shared_experts_launch(tiny, monkeypatch):
  """router_group="pallas": decode steps run the MoE router's GEMV in the shared expert's gate/up
  launch (the Router module's own GEMV fails for them here) and choose from its partials; tokens
  equal to the separate launches'."""
  switches = dict(dense_matmul="pallas_grouped", router="pallas")
  separate = _baseline(tiny, "pallas", "fp8", **switches)
  groups = _record_group_sizes(monkeypatch)
  own_gemv = quant.linear_partials
  router = (tiny[0].n_routed_experts, tiny[0].hidden_size)
  monkeypatch.setattr(quant, "linear_partials", lambda x, w, **kw: pytest.fail("a decode step ran the router's GEMV")
                      if w.shape == router and quant.decode_sized(x) else own_gemv(x, w, **kw))
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", router_group="pallas", **switches), separate)
  assert 3 in groups  # the router, the shared expert's gate and up


@fold_lane
def test_index_query_finishes_the_indexers_query_in_the_absorbed_query_launch(tiny, monkeypatch):
  """index_query="pallas": decode steps sum and rotate the indexer's query in the absorbed-query
  launch (the XLA rotation fails for decode steps here, the key's being in indexer_keys' launch);
  tokens equal to the XLA path's."""
  switches = dict(dense_matmul="pallas_grouped", query_absorb="pallas", indexer_keys="pallas")
  separate = _baseline(tiny, "pallas", "fp8", **switches)
  _fail_in_decode_steps(monkeypatch, attention, "apply_rope_leading")
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", index_query="pallas", **switches), separate)


@fold_lane
def test_swiglu_in_the_down_gemv_generates_the_same_tokens(tiny, monkeypatch):
  """swiglu="pallas": decode steps' MLPs (dense layers and shared experts) take silu(gate) * up
  in the down GEMV's launch from the gate/up partials (the launches recorded: decode rows, both
  kinds of MLP); tokens equal to the XLA path's."""
  xla = _baseline(tiny, "pallas", "fp8", dense_matmul="pallas_grouped")
  calls, original = [], bf16_matmul_module.swiglu_matmul
  monkeypatch.setattr(bf16_matmul_module, "swiglu_matmul", lambda g, u, w: calls.append(g.shape) or original(g, u, w))
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", dense_matmul="pallas_grouped", swiglu="pallas"), xla)
  config = tiny[0]
  assert {shape[-1] for shape in calls} == {config.intermediate_size, config.shared_intermediate}
  assert all(shape[1] <= 2 * 8 for shape in calls)  # decode steps' rows (2 sequences); none at prefill


@fold_lane
def test_moe_sum_in_the_shared_experts_launch_generates_the_same_tokens(tiny, monkeypatch):
  """moe_sum="pallas": decode steps' MoE layers end in the shared expert's down GEMV launch
  (residual + routed + shared; the launches recorded with the routed partials, one per MoE
  layer and step); tokens equal to the XLA sum's."""
  switches = dict(dense_matmul="pallas_grouped", swiglu="pallas")
  xla = _baseline(tiny, "pallas", "fp8", **switches)
  calls, original = [], bf16_matmul_module.swiglu_matmul
  monkeypatch.setattr(bf16_matmul_module, "swiglu_matmul",
                      lambda g, u, w, **kw: calls.append((g.shape, *kw)) or original(g, u, w, **kw))
  np.testing.assert_array_equal(_generate(tiny, "pallas", "fp8", moe_sum="pallas", **switches), xla)
  config = tiny[0]
  summed = [shape for shape, *kw in calls if kw == ["residual", "routed"]]
  assert summed and {shape[-1] for shape in summed} == {config.shared_intermediate}
  assert len(summed) == len([c for c in calls if c[0][-1] == config.shared_intermediate])


_BF16_STREAM_SCRIPT = """
import json, sys
import numpy as np, jax
from configs import get_model_config
from glmjax.engine.engine import Engine
from glmjax.engine.speculative import SpecConfig
from glmjax.model import init_params
from glmjax.runtime import Runtime
config = get_model_config("tiny")
params = init_params(config, jax.random.key(0))
prompt = np.random.default_rng(1).integers(2, config.vocab_size, 30).tolist()
out = {}
for name, switches in (("xla", {}), ("folded", {"moe_sum": "pallas"})):
  engine = Engine(config, params, runtime=Runtime(dense_matmul="pallas_grouped", swiglu="pallas", **switches),
                  page_size=8, max_seq_len=64, prefill_chunk=16, num_pages=32, kv_dtype="fp8", mtp_cache=True)
  stats = engine.run_round([engine.open_session()], [prompt], 10, ignore_eos=True,
                           spec=SpecConfig(num_draft=2, threshold=0.0))[0]
  out[name] = dict(output=stats.output, verify_steps=stats.verify_steps)
print(json.dumps(out))
"""


@fold_lane
def test_moe_sum_on_a_bf16_residual_stream_keeps_the_tokens():
  """moe_sum="pallas" where the residual stream is bf16: 16-token prefill chunks (decode-sized,
  so the fold applies; the stream is still the bf16 embedding) and the MTP layer under
  speculative decoding (a TEP rank's step failed there, BENCHMARKS.md run 27). The fold rounds as
  the model is written, op by op: (routed + shared) to bf16, then the residual add. XLA's default
  excess precision may drop that intermediate rounding in a bf16 fusion (this case's tokens
  then differ from the fourth on), so both run in a process with xla_allow_excess_precision off,
  where the emitted tokens must be equal."""
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip())
  done = subprocess.run([sys.executable, "-c", _BF16_STREAM_SCRIPT], env=env, capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 0, done.stderr[-2000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["folded"]["verify_steps"] > 0 and out["folded"]["output"] == out["xla"]["output"]


@fold_lane
def test_residual_norm_in_the_kernel_generates_the_same_tokens(tiny, monkeypatch):
  """residual_norm="pallas": decode steps add attention's output to the residual and normalise
  it in one launch from o_proj's partials (the launches counted: one a layer and step). With
  MLA's epilogue and absorbed query folded too, every GEMV those folds read (q_a, kv_a, q_b,
  o_proj) takes Runtime.fold_splits (here a cap of 3; tiny's K takes 1 anyway); tokens equal to
  the XLA path's."""
  xla = _baseline(tiny, "pallas", "fp8", dense_matmul="pallas")
  calls, original = [], residual_norm_module.residual_norm
  record = lambda *args, **kw: calls.append(args[1].shape) or original(*args, **kw)
  monkeypatch.setattr(residual_norm_module, "residual_norm", record)
  splits, partials = {}, quant.linear_partials
  monkeypatch.setattr(quant, "linear_partials",
                      lambda x, w, **kw: splits.setdefault(w.shape, set()).add(kw.get("gemv_splits")) or partials(x, w, **kw))
  folded = _generate(tiny, "pallas", "fp8", dense_matmul="pallas", residual_norm="pallas", mla_epilogue="pallas",
                     query_absorb="pallas", fold_splits=3)
  np.testing.assert_array_equal(folded, xla)
  assert calls and all(shape[1] <= 8 for shape in calls)  # decode steps' partials [S, tokens, D]; none at prefill
  c = tiny[0]
  gemvs = [(c.q_lora_rank, c.hidden_size), (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
           (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank), (c.hidden_size, c.num_attention_heads * c.v_head_dim)]
  assert {shape: splits.get(shape) for shape in gemvs} == {shape: {3} for shape in gemvs}


@fold_lane
def test_kernel_tuning_reaches_the_kernels_and_keeps_the_tokens(tiny, monkeypatch):
  """indexer_splits=256, indexer_block_k=16, indexer_warps=8, indexer_stages=2, indexer_prefetch,
  attention_warps=8: every scores and sparse MLA launch runs with them; each computes what it
  did, so the tokens are the default's."""
  default = _baseline(tiny, "pallas", "fp8")
  seen = []

  def recording(name, fn):
    def call(*args, config, **kwargs):
      seen.append((name, config))
      return fn(*args, config=config, **kwargs)
    return call

  monkeypatch.setattr(indexer_topk, "indexer_scores", recording("scores", indexer_topk.indexer_scores))
  monkeypatch.setattr(sparse_mla, "sparse_mla_decode", recording("mla", sparse_mla.sparse_mla_decode))
  tuned = _generate(tiny, "pallas", "fp8", indexer_splits=256, indexer_block_k=16, indexer_warps=8, indexer_stages=2,
                    indexer_prefetch=True, attention_warps=8)
  np.testing.assert_array_equal(tuned, default)
  assert {(c.num_splits, c.block_k, c.num_warps, c.num_stages, c.prefetch) for name, c in seen if name == "scores"} == {
      (256, 16, 8, 2, True)}
  assert {c.num_warps for name, c in seen if name == "mla"} == {8}


@pytest.mark.side_lane  # an entry point in its own process: beside the multi-device tests (Makefile)
def test_replay_pallas_equals_sparse(tmp_path):
  """The replay entry point (prefix-cached rounds through the Engine), as a user runs it: both
  in their own processes (their absl flags stand alone), side by side."""
  procs = {}
  for attention in ("sparse", "pallas"):
    with open(tmp_path / f"{attention}.log", "w") as log:
      procs[attention] = subprocess.Popen(
          [sys.executable, "-m", "experiments.replay", "--config=tiny", "--scale=400",
           "--rounds=2", f"--attention={attention}", f"--output={tmp_path / attention}.json"],
          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  for attention, proc in procs.items():
    proc.wait(timeout=300)
    log = (tmp_path / f"{attention}.log").read_text()
    assert proc.returncode == 0, f"replay --attention={attention} failed:\n{log[-2000:]}"
  reports = {a: json.loads((tmp_path / f"{a}.json").read_text()) for a in procs}
  generated = {a: [r["generated"] for r in rep["rounds"]] for a, rep in reports.items()}
  assert all(generated["sparse"]) and generated["pallas"] == generated["sparse"]
  # Every round's prompt is longer than index_topk: the selections are real.
  assert min(r["prompt_tokens"] for r in reports["sparse"]["rounds"]) > get_model_config("tiny").index_topk
