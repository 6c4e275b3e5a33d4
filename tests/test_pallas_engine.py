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
import jax.numpy as jnp
import numpy as np
import pytest
# Imported before anything is traced: the first interpret-mode pallas_call lowering imports the
# Pallas fuser, whose tracing-context flag changes every jit cache key (so programs compiled
# before it would compile again).
from jax.experimental.pallas import fuser  # noqa: F401

import glmjax
from configs import get_model_config
from configs.runs import PLANES_FOLDS, RANK_FASTEST
from experiments.bench_quant import rank_dense_launches
from experiments.step_timing import with_layers
from glmjax import attention, dsa, layers, quant
from glmjax.model import init_params
from glmjax.runtime import FOLD_SWITCHES, Runtime
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
  """tiny's first three layers: the dense one, an MoE layer with its indexer and one reusing that
  top-k (every kind of layer the kernels and folds meet; a fourth would only compile longer)."""
  config = with_layers(get_model_config("tiny"), 3)
  assert config.mlp_layer_types == ("dense", "sparse", "sparse") and config.indexer_types == ("full", "full", "shared")
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

  def attention(q_latent, q_rope, layer, page_table, positions, topk, scale, impl, config=None, warm=()):
    got = cached_attention(q_latent, q_rope, layer, page_table, positions, topk, scale, impl, config, warm)
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
  # NEW model calls (the prefill chunk, NEW - 1 decode steps) of 5 kernel calls: layers 0 and 1
  # run their indexer, all 3 attend.
  assert len(calls) == 5 * NEW, "no kernel ran: a program compiled earlier served the call"
  for i, (kind, ref, static, got, inputs) in enumerate(calls):
    want = np.asarray(ref(*inputs, *static))
    if kind == "topk":  # the same set per query token, exactly
      np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1), err_msg=f"call {i}")
    else:  # fp32 rounding
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= 1e-5, f"call {i}: attention differs by {err:.2e} of its largest output"
  np.testing.assert_array_equal(pallas, sparse)


def test_sparse_selection_path_equals_dense_reference(tiny):
  """--attention=sparse (gather of the selected tokens, the kernels' jnp references) generates
  the tokens of the dense masked reference, past index_topk, from FP8 pages (their scales
  applied alike on both paths)."""
  np.testing.assert_array_equal(_baseline(tiny, "sparse", "fp8"), _baseline(tiny, "dense", "fp8"))


# The folds' tests (a decode of 10-20 s each): in the side lane beside the multi-device tests
# (Makefile), which keeps the main suite's time in bounds. One unfolded run is the reference of
# those comparing tokens here: the split-K GEMVs grouped, the router and the cache write in their
# kernels.
fold_lane = pytest.mark.side_lane
UNFOLDED = dict(dense_matmul="pallas_grouped", router="pallas", cache_write="pallas")


def _fail_in_decode_steps(monkeypatch, module, name: str, arg: int = 0) -> None:
  """Makes module.name fail where a decode step calls it (at most 8 query tokens on axis 1 of its
  positional argument `arg`); the prefill's calls go through."""
  original = getattr(module, name)

  def prefill_only(*args, **kwargs):
    if args[arg].shape[1] <= 8:
      pytest.fail(f"a decode step called {name}")
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, prefill_only)


# The rank_fastest preset's folds over UNFOLDED, each with the unfolded step it replaces.
RANK_FOLDS = {"value_merge": "the two-step merge and value product (dsa.cached_attention)",
              "query_absorb": "XLA's absorbed query (dsa.query_absorption)",
              "indexer_keys": "k_norm's XLA path (layers.layer_norm)",
              "mla_epilogue": "k_pe's XLA rotation (attention.apply_rope)",
              "index_epilogue": "indexer_keys' own launch",
              "epilogue_write": "paged_write's own launch",
              "router_group": "the Router module's own GEMV",
              "index_query": "the indexer query's XLA rotation (attention.apply_rope_leading)",
              "residual_norm": "XLA's residual add and norm"}


@fold_lane
def test_the_rank_stacks_folds_generate_the_unfolded_tokens(tiny, monkeypatch):
  """Every fold of configs/runs.RANK_FASTEST at once, each unfolded step failing where a decode
  step would take it (prefill keeps them; RANK_FOLDS names them): tokens equal to the unfolded
  run's. Recorded besides: q_b shares its GEMV launch with the indexer's wq_b, the router with the
  shared expert's gate and up, q_a and kv_a with the indexer's wk and weights_proj; residual_norm
  runs once a layer and decode step; every GEMV the folds read (q_a, kv_a, q_b, o_proj) takes
  Runtime.fold_splits (here a cap of 3; tiny's K takes 1 anyway)."""
  # route_planes, shared_swiglu: the NVFP4 experts' folds (tests/test_quant_model.py), not this bf16 model's
  assert {k for k in RANK_FASTEST if k in FOLD_SWITCHES} - set(PLANES_FOLDS) == set(RANK_FOLDS) | set(UNFOLDED) - {
      "dense_matmul"}
  unfolded = _baseline(tiny, "pallas", "fp8", **UNFOLDED)
  for module, name in ((dsa, "cached_attention"), (dsa, "query_absorption"), (layers, "layer_norm"),
                       (attention, "apply_rope"), (attention, "apply_rope_leading")):
    _fail_in_decode_steps(monkeypatch, module, name)
  _fail_in_decode_steps(monkeypatch, paged_write_module, "paged_write", arg=2)  # (layer, page_table, positions, ...)
  monkeypatch.setattr(indexer_keys_module, "indexer_keys", lambda *a, **kw: pytest.fail("indexer_keys' own launch ran"))
  c = tiny[0]
  groups, splits, norms = [], {}, []
  own_gemv, own_group = quant.linear_partials, quant.linear_group_partials

  def gemv(x, w, **kw):
    if w.shape == (c.n_routed_experts, c.hidden_size) and quant.decode_sized(x):
      pytest.fail("a decode step ran the router's GEMV")
    splits.setdefault((1, w.shape), set()).add(kw.get("gemv_splits"))
    return own_gemv(x, w, **kw)

  def group(x, weights, **kw):
    groups.append(len(weights))
    for w in weights:
      splits.setdefault((len(weights), w.shape), set()).add(kw.get("gemv_splits"))
    return own_group(x, weights, **kw)

  monkeypatch.setattr(quant, "linear_partials", gemv)
  monkeypatch.setattr(quant, "linear_group_partials", group)
  own_norm = residual_norm_module.residual_norm
  monkeypatch.setattr(residual_norm_module, "residual_norm",
                      lambda *a, **kw: norms.append(a[1].shape) or own_norm(*a, **kw))
  folded = _generate(tiny, "pallas", "fp8", **UNFOLDED, **dict.fromkeys(RANK_FOLDS, "pallas"), fold_splits=3)
  np.testing.assert_array_equal(folded, unfolded)
  assert {2, 3, 4} <= set(groups)  # q_b + wq_b; router + gate + up; q_a + kv_a + wk + weights_proj
  assert norms and all(shape[1] <= 8 for shape in norms)  # decode steps' partials [S, tokens, D]; none at prefill
  gemvs = [(4, (c.q_lora_rank, c.hidden_size)), (4, (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)),
           (2, (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)),
           (1, (c.hidden_size, c.num_attention_heads * c.v_head_dim))]  # (launch's weights, shape)
  assert {gemv: splits.get(gemv) for gemv in gemvs} == {gemv: {3} for gemv in gemvs}
  # bench_quant's rank_dense rows time these launches: the same weights grouped alike, each at its split rule
  # (the folds' Runtime.fold_splits, here 3; the router's launch its default)
  for name, k, ns, rule in rank_dense_launches(c):
    if rule is not None:
      assert all(splits.get((len(ns), (n, k))) == {3 if rule == "fill" else None} for n in ns), (name, splits)


@fold_lane
def test_swiglu_and_moe_sum_run_in_the_down_gemvs_launches(tiny, monkeypatch):
  """swiglu="pallas": decode steps' MLPs (dense layers and shared experts) take silu(gate) * up
  in the down GEMV's launch from the gate/up partials; moe_sum="pallas": the MoE layers end in
  the shared expert's down launch (residual + routed + shared; one per MoE layer and step). The
  launches recorded: decode rows only, both kinds of MLP. (Their tokens: the next test, where
  XLA rounds as the model is written.)"""
  calls, original = [], bf16_matmul_module.swiglu_matmul
  monkeypatch.setattr(bf16_matmul_module, "swiglu_matmul",
                      lambda g, u, w, **kw: calls.append((g.shape, *kw)) or original(g, u, w, **kw))
  _generate(tiny, "pallas", "fp8", **UNFOLDED, swiglu="pallas", moe_sum="pallas")
  config = tiny[0]
  assert {shape[-1] for shape, *kw in calls} == {config.intermediate_size, config.shared_intermediate}
  assert all(shape[1] <= 2 * 8 for shape, *kw in calls)  # decode steps' rows (2 sequences); none at prefill
  summed = [shape for shape, *kw in calls if kw == ["residual", "routed"]]
  assert summed and {shape[-1] for shape in summed} == {config.shared_intermediate}
  assert len(summed) == len([c for c in calls if c[0][-1] == config.shared_intermediate])


_BF16_STREAM_SCRIPT = """
import json, sys
import numpy as np, jax
from configs import get_model_config
from experiments.step_timing import with_layers
from glmjax.engine.engine import Engine
from glmjax.engine.speculative import SpecConfig
from glmjax.model import init_params
from glmjax.runtime import Runtime
config = with_layers(get_model_config("tiny"), 2, mtp=True)  # a dense layer, an MoE layer, the MTP layer
params = init_params(config, jax.random.key(0))
prompt = np.random.default_rng(1).integers(2, config.vocab_size, 30).tolist()
out = {}
arms = (("xla", {}), ("folded", {"swiglu": "pallas", "moe_sum": "pallas"}),
        ("next_norm", {"swiglu": "pallas", "next_norm": "pallas"}))
for name, switches in arms:
  engine = Engine(config, params, runtime=Runtime(dense_matmul="pallas_grouped", **switches),
                  page_size=8, max_seq_len=64, prefill_chunk=16, num_pages=32, kv_dtype="fp8", mtp_cache=True)
  stats = engine.run_round([engine.open_session()], [prompt], 10, ignore_eos=True,
                           spec=SpecConfig(num_draft=2, threshold=0.0))[0]
  out[name] = dict(output=stats.output, verify_steps=stats.verify_steps)
print(json.dumps(out))
"""


@fold_lane
def test_swiglu_and_moe_sum_keep_the_tokens_on_a_bf16_residual_stream():
  """swiglu="pallas" with moe_sum="pallas", or with next_norm="pallas" (its MTP layer closing
  with shared_head_norm), where the residual stream is bf16: 16-token
  prefill chunks (decode-sized, so the folds apply; the stream is still the bf16 embedding) and
  the MTP layer under speculative decoding (a TEP rank's step failed there, BENCHMARKS.md run
  27). The folds round as the model is written, op by op (moe_sum: (routed + shared) to bf16,
  then the residual add). XLA's default excess precision may drop such an intermediate rounding
  in a bf16 fusion (the 4-layer tiny model's tokens then differed from the fourth on), so all
  three run in a process with xla_allow_excess_precision off, where the emitted tokens must be
  equal."""
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip())
  done = subprocess.run([sys.executable, "-c", _BF16_STREAM_SCRIPT], env=env, capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 0, done.stderr[-2000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["folded"]["verify_steps"] > 0
  assert out["folded"]["output"] == out["xla"]["output"] == out["next_norm"]["output"]


@fold_lane
def test_kernel_tuning_reaches_the_kernels_and_keeps_the_tokens(tiny, monkeypatch):
  """indexer_splits=256, indexer_block_k=16, indexer_warps=8, indexer_stages=2, indexer_prefetch,
  attention_warps=8, attention_scales="columns", attention_block_n=16, warm_o_proj: every scores
  and sparse MLA launch runs with them (each attention launch warming its layer's o_proj weight);
  each computes what it did, so the tokens are the untuned run's (FP8 pages, fp32 queries: the
  rows' path by default)."""
  default = _baseline(tiny, "pallas", "fp8", **UNFOLDED)
  seen = []

  def recording(name, fn):
    def call(*args, config, **kwargs):
      seen.append((name, config, kwargs.get("warm")))
      return fn(*args, config=config, **kwargs)
    return call

  monkeypatch.setattr(indexer_topk, "indexer_scores", recording("scores", indexer_topk.indexer_scores))
  monkeypatch.setattr(sparse_mla, "sparse_mla_decode", recording("mla", sparse_mla.sparse_mla_decode))
  tuned = _generate(tiny, "pallas", "fp8", **UNFOLDED, indexer_splits=256, indexer_block_k=16, indexer_warps=8,
                    indexer_stages=2, indexer_prefetch=True, attention_warps=8, attention_scales="columns",
                    attention_block_n=16, warm_o_proj=True)
  np.testing.assert_array_equal(tuned, default)
  assert {(c.num_splits, c.block_k, c.num_warps, c.num_stages, c.prefetch) for name, c, _ in seen
          if name == "scores"} == {(256, 16, 8, 2, True)}
  mla = [(c, warm) for name, c, warm in seen if name == "mla"]
  assert {(c.num_warps, c.scale_rows, c.block_n) for c, _ in mla} == {(8, False, 16)}
  o_proj = tiny[0].hidden_size, tiny[0].num_attention_heads * tiny[0].v_head_dim
  assert mla and all(len(warm) == 1 and warm[0].shape == o_proj for _, warm in mla)


@fold_lane
def test_e4m3_indexer_queries_select_alike_on_every_path(tiny, monkeypatch):
  """indexer_queries="float8_e4m3fn": the Pallas scores kernel gets e4m3 codes (also where the
  absorbed-query launch finishes the indexer's query) and generates the sparse path's tokens,
  which the codes change against fp32 queries."""
  sparse = _generate(tiny, "sparse", "fp8", indexer_queries="float8_e4m3fn")
  queries, original = [], indexer_topk.indexer_scores

  def scores(q, *args, **kwargs):
    queries.append(q.dtype)
    return original(q, *args, **kwargs)

  monkeypatch.setattr(indexer_topk, "indexer_scores", scores)
  pallas = _generate(tiny, "pallas", "fp8", query_absorb="pallas", index_query="pallas",
                     indexer_queries="float8_e4m3fn")
  assert set(queries) == {jnp.dtype(jnp.float8_e4m3fn)}
  np.testing.assert_array_equal(pallas, sparse)
  assert not np.array_equal(sparse, _baseline(tiny, "sparse", "fp8"))


@pytest.mark.side_lane  # an entry point in its own process: beside the multi-device tests (Makefile)
def test_replay_pallas_equals_sparse(tmp_path):
  """The replay entry point (prefix-cached rounds through the Engine), as a user runs it: both
  in their own processes (their absl flags stand alone), side by side."""
  procs = {}
  for attention in ("sparse", "pallas"):
    with open(tmp_path / f"{attention}.log", "w") as log:
      procs[attention] = subprocess.Popen(
          [sys.executable, "-m", "experiments.replay", "--config=tiny2", "--scale=400",
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
