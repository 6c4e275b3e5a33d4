"""glmjax.bench: the in-program timer and the profile-trace kernel breakdown."""

import gzip
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.bench import (agreement, device_kernel_times, kernel_breakdown, own_kernel_us, read_tbs,
                          time_device, time_own_kernels)


def _write_trace(directory, events):
  run = os.path.join(directory, "plugins", "profile", "run1")
  os.makedirs(run)
  with gzip.open(os.path.join(run, "perfetto_trace.json.gz"), "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_device_kernel_times_counts_only_device_events(tmp_path):
  """Launches and own time per kernel on device lines; the idle time before each launch on its
  stream line (event order by start time, not file order), none on a named non-stream line."""
  meta = lambda pid, name: {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  kernel = lambda pid, name, ts, dur, tid=1: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
  _write_trace(str(tmp_path), [
      meta(1, "/host:CPU"), meta(7, "/device:GPU:0"), meta(8, "/device:GPU:0 Stream #2"),
      {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "XLA Modules"}},
      kernel(1, "PjitFunction(f)", 0, 50.0),          # host event: not a kernel
      kernel(7, "topk_digit0", 10.0, 7.5), kernel(7, "topk_digit0", 0.0, 6.5),  # idle 3.5 before the second
      kernel(7, "jit_step", 0.0, 4.0, tid=2), kernel(7, "jit_step", 30.0, 4.0, tid=2),  # no idle: not a stream
      kernel(8, "loop_add_fusion", 5.0, 1.25),        # first on its line: no idle
      {"ph": "i", "pid": 7, "name": "marker"},        # not a duration event
  ])
  assert device_kernel_times(str(tmp_path)) == {"topk_digit0": (2, 14.0, 3.5), "jit_step": (2, 8.0, 0.0),
                                                "loop_add_fusion": (1, 1.25, 0.0)}


def test_device_kernel_times_without_trace_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="perfetto_trace"):
    device_kernel_times(str(tmp_path))


def test_kernel_breakdown_runs_a_profile_and_time_device_is_positive():
  x = jnp.arange(64.0).reshape(8, 8) / 64
  # The CPU backend's trace has no device events: the breakdown is empty, not an error.
  assert kernel_breakdown(lambda a: jnp.sin(a) @ a, x, iters=2) == []
  assert time_device(lambda a: jnp.sin(a) @ a, x, iters=2, repeats=1) > 0
  # Own-kernel time needs those events: a clear error, not a zero time.
  with pytest.raises(RuntimeError, match="no device kernel events"):
    time_own_kernels(lambda a: jnp.sin(a) @ a, x)


def test_the_timing_loop_computes_every_output_whole():
  """The loop reads one element of fn's first output; the compiled program still computes all
  of fn's outputs in full (before the barrier on them, XLA dropped the second output here and
  sliced the first to the element read)."""
  from glmjax.bench import _loop_program
  x = jnp.arange(4096.0).reshape(64, 64) / 4096
  fn = lambda a: (jnp.exp(a) + 1, jnp.sin(a).sum(axis=0))
  hlo = _loop_program(fn, 2).lower((x,)).compile().as_text()
  assert re.search(r"f32\[64,64\]\S* sine\(", hlo), "the second output computed"
  assert re.search(r"f32\[64,64\]\S* exponential\(", hlo), "the first output computed whole, not one element"


def test_own_kernel_us_takes_away_the_timing_loops_bookkeeping():
  """The loop's counter and accumulator kernels (measured alone) come off by name, never below
  zero; the path's own kernels, including one the loop lacks, stay."""
  path = [("topk_select", 1.0, 10.0), ("loop_add_fusion", 1.0, 1.2), ("loop_add_fusion_1", 1.0, 0.7),
          ("topk_count", 1.0, 6.5)]
  loop = [("loop_add_fusion", 1.0, 1.1), ("loop_add_fusion_1", 1.0, 0.9), ("set_while_condition", 0.1, 0.1)]
  assert own_kernel_us(path, loop) == pytest.approx(10.0 + 0.1 + 6.5)
  assert own_kernel_us(path, []) == pytest.approx(18.4)


def test_agreement_compares_index_sets_and_float_errors():
  """A benchmark row's check of the kernel's output against its reference's."""
  rng = np.random.default_rng(0)
  ids = np.stack([rng.permutation(50)[:8] for _ in range(3)]).astype(np.int32)
  assert agreement(ids[:, ::-1], ids) == dict(exact=True)          # the same sets, in any order
  other = ids.copy()
  other[2, 0] = next(i for i in range(50) if i not in ids[2])
  assert agreement(other, ids) == dict(exact=False)
  want = rng.standard_normal((4, 6)).astype(np.float32)
  want[0, :2] = -np.inf
  assert agreement(want, want) == dict(exact=True, max_rel_err=0.0)
  got = want.copy()
  got[1, 1] += 0.01 * np.max(np.abs(want[np.isfinite(want)]))
  check = agreement(got, want)
  assert not check["exact"] and check["max_rel_err"] == pytest.approx(0.01, rel=1e-3)
  got[0, 0] = 0.0   # a finite value where the reference has -inf
  assert agreement(got, want)["max_rel_err"] == float("inf")
  assert agreement(want[:2], want) == dict(exact=False, max_rel_err=float("inf"))


def test_read_tbs_times_one_read_of_the_bytes():
  """The read speed is nbytes over the timer's seconds for an fp32 sum of nbytes of bf16 (a timer
  that checks what it is handed), and a real timing of it is a finite positive speed."""
  def timer(fn, x):
    assert x.dtype == jnp.bfloat16 and x.nbytes == 1 << 16
    assert float(fn(x)) == 1 << 15 and fn(x).dtype == jnp.float32  # every element summed, in fp32
    return 2e-6
  assert read_tbs(1 << 16, timer) == pytest.approx(65536 / 2e-6 / 1e12)
  measured = read_tbs(1 << 20, lambda fn, x: time_device(fn, x, iters=2, repeats=1))
  assert np.isfinite(measured) and measured > 0


def test_rows_take_their_read_fraction_from_the_read_measured_first():
  """bench_quant's entry points lead with the device's read speed and divide every timed row's
  TB/s by it (an untimed row passes through as it is)."""
  from experiments.bench_quant import with_read_fraction
  rows = list(with_read_fraction([dict(name="a", tbs=1.5), dict(name="b")], lambda fn, x: x.nbytes / 3e12,
                                 quick=True))
  assert rows[0] == dict(name="read", impl="xla", us=pytest.approx(2 ** 20 / 3e6), bytes=2 ** 20,
                         tbs=pytest.approx(3.0), frac_of_read=1.0)
  assert rows[1] == dict(name="a", tbs=1.5, frac_of_read=pytest.approx(0.5))
  assert rows[2] == dict(name="b")


@pytest.mark.side_lane  # 15-20 s on 2 cores: beside the multi-device tests (Makefile)
def test_quant_sweep_covers_the_stacks_kernels():
  """kernels_bench --sweep's quant rows: the NVFP4 GEMV on the CUDA cores beside the tensor
  cores' default, the routed experts as pairs and on the fragment GEMV at a rank's view, the FP8
  and bf16 GEMVs and the fragment-order NVFP4 GEMV at 1 and 8 rows, and a rank's five bf16
  launches beside XLA's (one config each in the quick sweep; the fragment GEMV's also with one L2
  prefetch arm), every one timed (interpret mode: the PTX runs its jnp twin)."""
  import dataclasses
  from experiments.bench_quant import quant_sweep_rows
  from pallas_kernels.moe_fragments import ExpertsConfig
  from pallas_kernels.nvfp4_fragments import default_fragment_config
  read, *rows = quant_sweep_rows(quick=True)
  assert read["name"] == "read" and read["tbs"] > 0
  assert all(r["frac_of_read"] == pytest.approx(r["tbs"] / read["tbs"]) for r in rows)
  assert {r["name"] for r in rows} == {"sweep", "moe_sweep", "rank_dense"}
  dense = [(r["launch"], r["impl"]) for r in rows if r["name"] == "rank_dense"]  # each launch's own tiling
  assert len(dense) == 10 and {impl for _, impl in dense[1::2]} == {"pallas_partials", "pallas"}
  gemv = [r["config"] for r in rows if r["name"] == "sweep" and r["format"] == "nvfp4"]
  assert len(gemv) == 2 and {"dot='hfma2'" in c for c in gemv} == {True, False}
  moe = [r["config"] for r in rows if r["name"] == "moe_sweep"]
  assert len(moe) == 2 and moe[0].startswith("PairsConfig(") and "fused_planes=True" in moe[0]
  assert moe[1] == repr(ExpertsConfig())  # its defaults
  for fmt in ("fp8", "bf16"):
    assert len({r["config"] for r in rows if r["name"] == "sweep" and r["format"] == fmt}) == 1
  for fmt, operands in (("nvfp4_fragments", "float16"), ("nvfp4_fragments_bf16", "bfloat16")):
    fragments = [(r["m"], r["config"]) for r in rows if r["name"] == "sweep" and r["format"] == fmt]
    # each default, then (the l2 case) its one L2 prefetch arm
    defaults = [(m, default_fragment_config(128, 64, m, operands)) for m in (1, 8)]
    assert fragments == [(m, repr(c)) for m, base in defaults for c in (base, dataclasses.replace(base, l2_ahead=1))]
  assert all(np.isfinite(r["us"]) and r["us"] > 0 and r["bytes"] > 0 for r in rows)


def test_fragment_sweep_varies_one_field_of_the_default_at_a_time():
  """around_default: the default first, then each arm differs from it in one field (tiles with
  their warps), none twice; the sweep's groups run alone, and an unknown group is named."""
  import dataclasses
  from experiments.bench_quant import around_default, l2_arms, quant_sweep_rows
  from pallas_kernels.nvfp4_fragments import default_fragment_config
  base = default_fragment_config(28672, 8192, 1, "float16")
  configs = around_default(base, "float16")
  assert configs[0] == base and len(set(configs)) == len(configs)
  changed = [{f.name for f in dataclasses.fields(base) if getattr(c, f.name) != getattr(base, f.name)}
             for c in configs[1:]]
  assert changed == ([{"unroll"}] * 2 + [{"split_k"}] * 2 + [{"prefetch"}, {"wide_x"}, {"token_mask"}]
                     + [{"tiles", "num_warps"}] * 2)
  assert [c.unroll for c in configs[1:3]] == [2, 8] and [c.split_k for c in configs[3:5]] == [2, 8]
  assert around_default(base, "bfloat16") == [c for c in configs if not c.token_mask]  # no fp16 activation words
  arms = l2_arms(base)  # the L2 prefetch distances, then 4 ahead over half the splits
  assert arms[0] == base and [(c.l2_ahead, c.split_k) for c in arms[1:]] == [(1, 4), (2, 4), (4, 4), (8, 4), (4, 2)]
  read, *rows = quant_sweep_rows(quick=True, cases=("fp8",))
  assert read["name"] == "read" and [(r["name"], r["format"]) for r in rows] == [("sweep", "fp8")]
  with pytest.raises(ValueError, match="unknown sweep cases \\['gemv'\\]"):
    next(quant_sweep_rows(quick=True, cases=("gemv",)))


@pytest.mark.side_lane  # 15-20 s on 2 cores: evens out the two processes' times (Makefile)
def test_dsa_sweep_times_each_kernel_at_the_stacks_case():
  """kernels_bench --sweep's DSA rows: the scores, sparse MLA with the value merge and both
  top-k row counts, each config timed (the quick sweep: the first two of each grid, on FP8 keys
  and pages with bf16 queries, as a TEP=8 rank's stack runs them)."""
  from experiments.bench_dsa import config_sweep_rows
  rows = list(config_sweep_rows(quick=True))
  assert [r["kernel"] for r in rows[::2]] == ["indexer_scores", "sparse_mla_decode_values", "topk_indices rows=1",
                                              "topk_indices rows=64"]
  assert all(np.isfinite(r["us"]) and r["us"] > 0 and "failed" not in r["config"] for r in rows)
  assert len({r["config"] for r in rows[:2]}) == 2


@pytest.mark.side_lane  # 15-20 s on 2 cores: beside the multi-device tests (Makefile)
def test_gemv_rows_time_every_impl_against_xla_bf16():
  """A GEMV case's rows: XLA bf16 first (the speedup reference), the bf16 split-K kernel and
  each format's kernels checked against XLA on the timed inputs, bytes by format."""
  from experiments.bench_quant import gemv_rows
  seconds = {"bf16": 4e-6, "nvfp4": 1e-6, "fp8": 2e-6}
  timer = lambda fn, *args: seconds["fp8" if "FP8" in type(args[-1]).__name__ else
                                    "nvfp4" if type(args[-1]).__name__ in ("NVFP4Weight", "FragmentWeight")
                                    else "bf16"]
  rows = gemv_rows(3, 96, 160, name="t", timer=timer)
  impls = [(r["format"], r["impl"]) for r in rows]
  assert impls[:2] == [("bf16", "xla"), ("bf16", "pallas")]
  assert {("nvfp4", "pallas_ptx"), ("nvfp4", "pallas_ptx_f16"), ("fp8", "pallas_f16")} <= set(impls)
  checked = [r for r in rows if r["impl"].startswith("pallas")]
  assert len(checked) == 11 and all(r["max_rel_err"] <= 1e-2 for r in checked)
  by = {(r["format"], r["impl"]): r for r in rows}
  acts = (3 * 160 + 3 * 96) * 2
  assert by["bf16", "pallas"]["bytes"] == 96 * 160 * 2 + acts
  assert by["nvfp4", "pallas"]["bytes"] == 96 * 80 + 96 * 10 + 8 + acts  # codes, e4m3 scales, 2 f32
  assert by["nvfp4", "pallas"]["speedup_vs_bf16"] == pytest.approx(4.0)
  # The fragment-order weight as stored: 6 tiles of 16 rows, K padded to 2 chunks of 128.
  assert by["nvfp4", "pallas_fragments"]["bytes"] == 2 * 2 * 6 * 128 * 4 + 2 * 6 * 32 * 4 + 8 + acts
  assert by["nvfp4", "pallas_fragments"]["speedup_vs_bf16"] == pytest.approx(4.0)
  assert by["nvfp4", "pallas_fragments_bf16"]["bytes"] == by["nvfp4", "pallas_fragments"]["bytes"]
  for impl in ("pallas_fragments_bf16_final", "pallas_fragments_prefetch", "pallas_fragments_bf16_prefetch"):
    assert by["nvfp4", impl]["bytes"] == by["nvfp4", "pallas_fragments"]["bytes"]
  # One row: the CUDA-core NVFP4 GEMV joins (dot="hfma2"), checked the same way.
  one = {(r["format"], r["impl"]): r for r in gemv_rows(1, 96, 160, name="t", timer=timer)}
  assert ("nvfp4", "pallas_hfma2") not in by and one["nvfp4", "pallas_hfma2"]["max_rel_err"] <= 1e-2


def test_group_rows_check_the_grouped_launch_against_the_lone_ones():
  from experiments.bench_quant import group_rows
  rows = group_rows(3, 64, (48, 16), name="q_a+kv_a", timer=lambda fn, *args: 1e-6)
  assert [r["impl"] for r in rows] == ["xla", "pallas", "pallas_grouped", "pallas_fragments_bf16_partials",
                                       "pallas_fragments_bf16_grouped"]
  assert all(r["max_rel_err"] <= 1e-2 for r in rows[1:])
  assert rows[0]["bytes"] == (48 + 16) * 64 * 2 + (3 * 64 + 3 * 64) * 2
  assert rows[3]["bytes"] == rows[4]["bytes"] < rows[0]["bytes"]


def test_rank_dense_rows_time_each_launch_over_cold_weight_copies():
  """One row pair per bf16 launch of rank_dense_launches: XLA's einsums, then the launch as the
  stack runs it, its partials' sum checked against XLA; each timed over distinct copies of its
  weights (same values, other buffers) that together pass cold_bytes, the time per copy."""
  from configs import get_model_config
  from experiments.bench_quant import rank_dense_launches, rank_dense_rows
  config, cold = get_model_config("tiny"), 40_000
  copies = []

  def timer(fn, x, sets):
    copies.append(len(sets))
    pointers = {w.unsafe_buffer_pointer() for ws in sets for w in ws}
    assert len(pointers) == len(sets) * len(sets[0])
    assert all(bool(jnp.array_equal(a, b)) for ws in sets for a, b in zip(ws, sets[0]))
    return 1e-6 * len(sets)

  rows = rank_dense_rows(config, timer=timer, cold_bytes=cold)
  launches = rank_dense_launches(config)
  assert [(r["launch"], r["impl"]) for r in rows] == [
      (name, impl) for name, _, _, splits in launches for impl in ("xla", "pallas_partials" if splits else "pallas")]
  for (name, k, ns, splits), (xla, kernel), n in zip(launches, zip(rows[::2], rows[1::2]), copies[::2]):
    weights = sum(ns) * k * 2
    assert xla["bytes"] == kernel["bytes"] == weights + (5 * k + 5 * sum(ns)) * 2
    assert n == kernel["cold_copies"] == -(-cold // weights) and xla["us"] == pytest.approx(1.0)
    assert kernel["max_rel_err"] <= (1e-6 if splits else 1e-2), name  # fp32 partials; a bf16 output
  assert max(copies) > 1  # the smallest weight, copied past cold_bytes


def test_shared_down_rows_time_the_fold_against_separate_launches():
  """The shared_down case: the routed experts and the shared expert's down GEMV in launches of
  their own (the baseline row), so with wide_words' layout hint, then folded into one gate/up
  launch: the same outputs bit for bit,
  the same bytes; each timed over distinct copies of the GEMV's weight and hidden past cold_bytes."""
  from experiments.bench_quant import QUICK_MOE_CASE, shared_down_rows
  copies = []

  def timer(fn, x, ids, weights, sets):
    copies.append(len(sets))
    assert len({a.unsafe_buffer_pointer() for down in sets for a in down}) == 2 * len(sets)
    return 1e-6 * len(sets) * (2 if len(copies) == 1 else 1)

  rows = shared_down_rows(**QUICK_MOE_CASE, shared=48, routed=16, timer=timer, cold_bytes=20_000)
  assert [r["impl"] for r in rows] == ["separate", "separate_wide_words", "folded"]
  assert {r["name"] for r in rows} == {"shared_down"}
  assert copies == [rows[0]["cold_copies"]] * 3 == [-(-20_000 // (64 * 48 * 2))] * 3
  assert rows[0]["bytes"] == rows[1]["bytes"] == rows[2]["bytes"] > 64 * 48 * 2
  assert (rows[0]["us"], rows[2]["us"], rows[2]["speedup_vs_bf16"]) == pytest.approx((2.0, 1.0, 2.0))
  assert all(r["max_rel_err"] == 0.0 and r["exact"] for r in rows[1:])


def test_rank_dense_sweep_times_each_launch_at_tilings_around_its_own():
  """around_bf16: the launch's own tiling first, then each arm differs from it in one field, none
  twice; rank_dense_rows(around=...) times and checks every arm of every launch after XLA's row."""
  import dataclasses
  from configs import get_model_config
  from experiments.bench_quant import around_bf16, rank_dense_launches, rank_dense_rows
  from pallas_kernels.bf16_matmul import default_bf16_config, fold_config
  base = fold_config(2048 + 576, 6144)
  configs = around_bf16(base)
  assert configs[0] == base and len(set(configs)) == len(configs)
  changed = [{f.name for f in dataclasses.fields(base) if getattr(c, f.name) != getattr(base, f.name)}
             for c in configs[1:]]
  assert changed == ([{"block_n"}] * 2 + [{"block_k"}] * 2 + [{"split_k"}] * 2 + [{"num_warps"}] * 2
                     + [{"num_stages"}] * 3)
  config = get_model_config("tiny")
  rows = rank_dense_rows(config, timer=lambda fn, x, sets: 1e-6, cold_bytes=1, around=lambda c: around_bf16(c)[2:4])
  launches = rank_dense_launches(config)
  assert [r["launch"] for r in rows] == [name for name, *_ in launches for _ in range(3)]
  for i, (name, k, ns, splits) in enumerate(launches):
    own = fold_config(sum(ns), k, splits) if splits else default_bf16_config(sum(ns), k)
    xla, *kernels = rows[3 * i:3 * i + 3]
    assert xla["impl"] == "xla" and xla["config"] is None
    assert [r["config"] for r in kernels] == [str(c) for c in around_bf16(own)[2:4]]
    assert all(r["max_rel_err"] <= (1e-6 if splits else 1e-2) for r in kernels), name


def test_router_rows_check_the_kernel_by_its_routing_matrix():
  """XLA's choice first, then the one-launch kernel with the agreement of both [tokens, E]
  matrices (mini: group-limited routing)."""
  from configs import get_model_config
  from experiments.bench_quant import router_rows
  rows = router_rows(5, get_model_config("mini"), timer=lambda fn, *args: 2e-6, splits=3)
  assert [r["impl"] for r in rows] == ["xla", "pallas"]
  assert rows[1]["max_rel_err"] <= 1e-6 and rows[0]["bytes"] == 3 * 5 * 16 * 4 + 16 * 4 + 5 * 4 * 8


def test_epilogue_rows_check_each_kernel_against_its_xla_path():
  """XLA's path, then the one-launch kernel with the worst agreement of their outputs, for each
  of the projection epilogues (mini's shapes)."""
  from configs import get_model_config
  from experiments.bench_quant import epilogue_rows
  rows = list(epilogue_rows(3, get_model_config("mini"), timer=lambda fn, *args: 2e-6, splits=2))
  assert [(r["name"], r["impl"]) for r in rows] == [(n, i) for n in ("absorbed_query", "indexer_keys", "mla_epilogue",
                                                                                 "mla_index_epilogue",
                                                                                 "absorbed_index_query",
                                                                                 "residual_norm")
                                                    for i in ("xla", "pallas")]
  assert all(r["max_rel_err"] <= 1e-2 for r in rows[1::2]) and all(r["bytes"] > 0 for r in rows)


def test_values_row_checks_the_fused_merge_against_the_two_steps():
  import jax
  from experiments.bench_dsa import QUICK, _mla_case, _values_row
  args, mla_bytes = _mla_case(QUICK, 256, 2, True, jax.random.key(1))
  row = _values_row(QUICK, "c", "", args, mla_bytes, jax.random.key(2), dict(iters=2, repeats=1, warmup=1), False)
  assert row["kernel"] == "sparse_mla_decode (values)" and row["max_rel_err"] <= 1e-5
  assert row["bytes"] == mla_bytes + 4 * 32 * 64 * 2 + 2 * 4 * (32 - 64) * 4 and row["us"] > 0 and row["xla_us"] > 0


def test_cache_write_row_times_both_writes_and_checks_the_pages():
  """bench_dsa's cache-write row: both writes timed in a loop that carries the pages (time_device_carry),
  the kernel's pages equal to write_layer's."""
  from experiments.bench_dsa import QUICK, _cache_write_row
  import jax
  row = _cache_write_row(QUICK, 256, 2, False, jax.random.key(0), dict(iters=2, repeats=1, warmup=1))
  assert row["kernel"] == "cache_write" and row["exact"] is True
  assert row["us"] > 0 and row["xla_us"] > 0 and row["bytes"] == 2 * (2 * (64 + 16 + 32) + (64 + 32) * 2 + 16 * 2)


def test_layer_kernels_from_two_programs():
  """One layer's kernels: families match across programs despite XLA's numbering, per-step counts
  divide by the loop's steps, and what both programs launch alike cancels."""
  from experiments.step_timing import kernel_family, layer_difference, step_kernels
  assert kernel_family("loop_add_fusion_12") == "loop_add_fusion"
  assert kernel_family("fusion.3") == "fusion" and kernel_family("sparse_mla_decode") == "sparse_mla_decode"
  three = step_kernels({"sparse_mla_decode": (12, 60.0, 12.0), "loop_add_fusion_1": (4, 8.0, 8.0),
                        "loop_add_fusion_7": (2, 4.0, 4.0), "embed_fusion": (2, 10.0, 0.0)}, steps=2)
  assert three["loop_add_fusion"] == (3.0, 6.0, 6.0) and three["sparse_mla_decode"] == (6.0, 30.0, 6.0)
  five = step_kernels({"sparse_mla_decode": (20, 100.0, 20.0), "loop_add_fusion_9": (10, 20.0, 40.0),
                       "embed_fusion": (2, 10.0, 0.0), "moe_down": (4, 16.0, 2.0)}, steps=2)
  rows = {name: rest for name, *rest in layer_difference(three, five, layers=2)}
  assert rows == {"sparse_mla_decode": [2.0, 10.0, 2.0], "loop_add_fusion": [1.0, 2.0, 7.0],
                  "embed_fusion": [0.0, 0.0, 0.0], "moe_down": [1.0, 4.0, 0.5]}
  # Ordered by own plus idle time: the fusions' launch gaps put them first.
  assert [r[0] for r in layer_difference(three, five, layers=2)][:3] == ["sparse_mla_decode", "loop_add_fusion",
                                                                           "moe_down"]


def test_rank_step_fits_a_line_through_the_layer_counts(monkeypatch):
  """measure_rank_step over three layer counts: the least-squares slope and its standard error
  from the timed programs (stubbed: 1 ms + 0.2 ms a layer, with noise), the line evaluated at the
  config's layers, and one layer's kernels from the fewest and most layers' profiles."""
  from configs import get_model_config
  from experiments import step_timing
  noise = {1: 1e-5, 2: -2e-5, 4: 1e-5}
  monkeypatch.setattr(step_timing, "_timed_counts", lambda configs, kernels, **kw: [(
      1e-3 + 2e-4 * c.num_hidden_layers + noise[c.num_hidden_layers],
      {"moe_down": (float(c.num_hidden_layers), 10.0 * c.num_hidden_layers, 0.0)}) for c in configs])
  config = get_model_config("tiny")
  out = step_timing.measure_rank_step(config, [4, 1, 2], kernels=True)
  slope, base = np.polyfit([1, 2, 4], [1.21e-3, 1.38e-3, 1.81e-3], 1)
  assert out["measured_layers"] == [1, 2, 4] and out["per_layer_s"] == pytest.approx(slope)
  assert out["rank_step_s"] == pytest.approx(base + 4 * slope)
  assert 0 < out["per_layer_stderr_s"] < 2e-5
  assert out["layer_kernels"] == [("moe_down", 1.0, 10.0, 0.0)]
  two = step_timing.measure_rank_step(config, [1, 4])
  assert "per_layer_stderr_s" not in two and two["per_layer_s"] == pytest.approx((1.81e-3 - 1.21e-3) / 3)
  with pytest.raises(ValueError, match="two or more counts"):
    step_timing.measure_rank_step(config, [2])
  with pytest.raises(ValueError, match="one MLP type"):
    step_timing.measure_rank_step(config, [0, 2])


def test_rank_step_fits_each_indexer_kind_its_own_line(monkeypatch):
  """IndexShare layers past the fewest count: one line per indexer kind (programs whose later
  layers are all full, or all shared, beside the shared fewest-count program; stubbed: 1 ms, 0.3
  ms a full layer, 0.1 ms a shared one), the step at the config's pattern, and the average
  layer's kernels weighted by the pattern."""
  from configs import get_model_config
  from experiments import step_timing
  seen = []

  def timed(configs, kernels, **kw):
    seen.extend(c.indexer_types for c in configs)
    full = [c.indexer_types.count("full") for c in configs]
    layers = [c.num_hidden_layers for c in configs]
    return [(1e-3 + 3e-4 * f + 1e-4 * (n - f),
             {"indexer_scores": (float(f), 10.0 * f, 0.0), "moe": (float(n), 5.0 * n, 0.0)})
            for n, f in zip(layers, full)]

  monkeypatch.setattr(step_timing, "_timed_counts", timed)
  config = get_model_config("tiny")
  assert config.indexer_types == ("full", "full", "shared", "full")
  out = step_timing.measure_rank_step(config, [1, 4], kernels=True)
  assert seen == [("full",), ("full",) * 4, ("full",) + ("shared",) * 3]
  assert out["rank_step_s"] == pytest.approx(1e-3 + 3 * 3e-4 + 1e-4)
  assert out["per_layer_by_indexer"] == pytest.approx({"full": 3e-4, "shared": 1e-4})
  assert out["per_layer_s"] == pytest.approx((2 * 3e-4 + 1e-4) / 3)
  kernels = {name: rest for name, *rest in out["layer_kernels"]}
  assert kernels["indexer_scores"] == pytest.approx([2 / 3, 20 / 3, 0.0])
  assert kernels["moe"] == pytest.approx([1.0, 5.0, 0.0])


def test_tep_project_takes_another_configs_indexshare_schedule():
  """--indexer_types_of=glm5_2: the rank keeps its shapes and takes GLM-5.2's 21 full indexer
  layers of 78; a schedule of another depth is refused by name."""
  from configs import get_model_config, with_indexer_types_of
  rank = get_model_config("tep8_shard")
  shared = with_indexer_types_of(rank, "glm5_2")
  assert shared.indexer_types.count("full") == 21 and rank.indexer_types.count("full") == 78
  assert shared.num_attention_heads == rank.num_attention_heads and with_indexer_types_of(rank, "") is rank
  with pytest.raises(ValueError, match="indexer_types_of=tiny: its 4 layers' schedule does not fit the rank's 78"):
    with_indexer_types_of(rank, "tiny")


def test_step_times_interleave_the_programs():
  """All lengths run twice first (compiling; a program compiled first may compile again after
  the others), then every program's lengths are timed in turn, round after round; each step
  time is its lengths' median times apart over their steps, so a slow round (the device's
  clocks) moves no median."""
  from experiments import step_timing
  calls, traced = [], []

  def program(name, per_step):
    def once(n, trace_dir=""):
      if trace_dir:
        traced.append((name, n, trace_dir))
        return 0.0, n
      calls.append((name, n))
      # call 5: a's short loop compiling again in the second warm-up; 11, 12: b's first timed round
      slow = {5: 1000.0, 11: 5.0, 12: 5.0}.get(len(calls), 1.0)
      return slow * (0.5 + per_step * n), n  # loop steps = n
    return step_timing._Program(once, (2, 6))

  times = step_timing._step_times([program("a", 0.1), program("b", 0.3)], repeats=3, trace_dirs=["", "tb"])
  assert calls == [("a", 2), ("a", 6), ("b", 2), ("b", 6)] * 5
  assert traced == [("b", 6, "tb")]  # one more call of the longer loop, traced inside once
  assert [t.seconds for t in times] == pytest.approx([0.1, 0.3]) and [t.long_loop_steps for t in times] == [6, 6]
