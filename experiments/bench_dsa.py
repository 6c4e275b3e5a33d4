"""DSA kernels vs their XLA references (the `--attention=sparse` jnp path) at GLM-5 shapes.

  from experiments.bench_dsa import dsa_rows; rows = list(dsa_rows())   # on the H200

Shapes: one TEP=8 rank at batch 1: MLA 8 heads (kv_lora_rank 512, rope 64), indexer 32 x 128,
top-k 2048, page size 64; contexts 8K/32K/80K/128K, 1 and 5 query tokens, bf16 and FP8 caches;
plus top-k alone over 1 and 64 rows of 131,072 (normal scores, and ReLU-like rows whose k-th
score is an exact zero tied many times over), and the decode step's cache write (T new tokens
into one layer's latent, rope and indexer pages: XLA's scatters against the one-launch kernel,
timed in a loop that carries the pages, at the largest context). Queries are fp32, as the engine passes them
(the kernels split them into bf16 MMA terms for fp32-faithful results: see sparse_mla.py).
`bytes` is what a kernel must move through HBM at least (its bandwidth floor at 4.22 TB/s):
cache rows read once, outputs written once; the scores between scoring and top-k, and the
attention's split partials, stay in L2. Selections for the attention rows are random and
independent per query token (no shared rows: the worst case). quick=True: tiny shapes for a
CPU smoke test (interpret mode; times mean nothing).
"""

import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.bench import (agreement, bandwidth_tbs, kernel_breakdown, loop_breakdown, own_kernel_us, time_device,
                          time_device_carry, time_own_kernels)
from glmjax.cache import paged
from glmjax.cache.kv_fp8 import fp8_block_size, quantize_fp8
from glmjax.dsa import value_projection
from glmjax.footprint import H200_BANDWIDTH
from pallas_kernels.indexer_scores import ORIENTATIONS, IndexerScoresConfig, indexer_scores, indexer_scores_reference
from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference
from pallas_kernels.paged_write import paged_write
from pallas_kernels.sparse_mla import (SparseMLAConfig, sparse_mla_decode, sparse_mla_decode_reference,
                                       sparse_mla_decode_values)
from pallas_kernels.topk import TopKConfig, topk_indices, topk_indices_reference

FULL = dict(contexts=(8192, 32768, 81920, 131072), query_tokens=(1, 5), index_heads=32,
            index_dim=128, heads=8, rank=512, rope=64, nope=192, values=256, k=2048, page=64,
            topk_rows=(1, 64), topk_n=131072)
SOFTMAX_SCALE = (192 + 64) ** -0.5  # GLM-5's (qk_nope + qk_rope)^-0.5
QUICK = dict(contexts=(256,), query_tokens=(1, 2), index_heads=4, index_dim=32, heads=4, rank=64,
             rope=16, nope=16, values=32, k=32, page=16, topk_rows=(2,), topk_n=512)


def _timing(quick: bool) -> dict[str, int]:
  """time_device's loop for quick (CPU smoke) and full runs."""
  return dict(iters=2, repeats=1, warmup=1) if quick else dict(iters=20, repeats=3, warmup=2)


def _row(kernel: str, case: str, fn: Callable, ref: Callable, args: tuple, num_bytes: float,
         timing: dict[str, int], breakdown: bool) -> dict[str, Any]:
  seconds = time_device(fn, *args, **timing)
  xla_seconds = time_device(ref, *args, **timing)
  row = dict(kernel=kernel, case=case, us=seconds * 1e6, xla_us=xla_seconds * 1e6,
             speedup=xla_seconds / seconds, bytes=num_bytes,
             floor_us=num_bytes / H200_BANDWIDTH * 1e6, tbs=bandwidth_tbs(num_bytes, seconds),
             **agreement(fn(*args), ref(*args)))
  if breakdown:  # per-launch device time of the kernel path, from a profile
    row["kernels"] = kernel_breakdown(fn, *args)
    row["own_us"] = own_kernel_us(row["kernels"], loop_breakdown(*args))
  return row


def _cache(key: jax.Array, shape: tuple[int, ...], fp8: bool):
  x = jax.random.normal(key, shape, jnp.float32)
  return quantize_fp8(x) if fp8 else (x.astype(jnp.bfloat16), None)


def _page_table(key: jax.Array, context: int, page: int) -> jax.Array:
  """One sequence whose pages are a shuffled set of physical pages (page 0 stays null)."""
  pages = context // page
  return (jax.random.permutation(key, pages) + 1).astype(jnp.int32)[None]


def _cache_write_row(s: dict, context: int, t: int, fp8: bool, key: jax.Array, timing: dict[str, int]):
  """One layer's cache write of t new tokens: paged.write_layer (XLA) against paged_write, on
  the same pages; `exact`: every page array equal byte for byte after one call of each."""
  k1, k2, k3, k4, k5 = jax.random.split(key, 5)
  pages, page = context // s["page"] + 1, s["page"]
  latent, latent_scale = _cache(k1, (pages, page, s["rank"]), fp8)
  index_k, index_scale = _cache(k2, (pages, page, s["index_dim"]), fp8)
  layer = paged.LayerCache(latent, latent_scale, jax.random.normal(k3, (pages, page, s["rope"]), jnp.bfloat16),
                           index_k, index_scale)
  rows = [jax.random.normal(k, (1, t, d), jnp.bfloat16)
          for k, d in zip(jax.random.split(k4, 3), (s["rank"], s["rope"], s["index_dim"]))]
  args = (_page_table(k5, context, page), jnp.arange(context - t, context, dtype=jnp.int32)[None], *rows)
  seconds = time_device_carry(paged_write, layer, *args, **timing)
  xla_seconds = time_device_carry(jax.jit(paged.write_layer), layer, *args, **timing)
  same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
             for a, b in zip(jax.tree.leaves(paged_write(layer, *args)),
                             jax.tree.leaves(paged.write_layer(layer, *args))))
  scales = t * (s["rank"] // fp8_block_size(s["rank"]) + 1) * 4 if fp8 else 0
  row_bytes = (sum(r.size * 2 for r in rows) + t * (s["rank"] + s["index_dim"]) * (1 if fp8 else 2) + scales
               + t * s["rope"] * 2)  # the new rows in, their pages' rows out
  return dict(kernel="cache_write", case=f"ctx={context} T={t} {'fp8' if fp8 else 'bf16'}", us=seconds * 1e6,
              xla_us=xla_seconds * 1e6, speedup=xla_seconds / seconds, bytes=row_bytes,
              floor_us=row_bytes / H200_BANDWIDTH * 1e6, tbs=bandwidth_tbs(row_bytes, seconds), exact=same)


def _indexer_cases(s: dict, context: int, t: int, fp8: bool, key: jax.Array):
  """Arguments of the indexer ops and the bytes they must move."""
  kq, kw, kk, kp = jax.random.split(key, 4)
  h, d = s["index_heads"], s["index_dim"]
  pages = context // s["page"] + 1
  q = jax.random.normal(kq, (1, t, h, d), jnp.float32)
  weights = jax.random.normal(kw, (1, t, h), jnp.float32) * h ** -0.5
  index_k, index_scale = _cache(kk, (pages, s["page"], d), fp8)
  positions = jnp.arange(context - t, context, dtype=jnp.int32)[None]
  args = (q, weights, index_k, index_scale, _page_table(kp, context, s["page"]), positions)
  key_bytes = context * (d * (1 if fp8 else 2) + (4 if fp8 else 0))
  small = q.size * 4 + weights.size * 4 + context // s["page"] * 4
  return args, key_bytes + small


def _mla_case(s: dict, context: int, t: int, fp8: bool, key: jax.Array):
  """Arguments of sparse MLA (random ascending selections) and the bytes it must move."""
  kq, kr, kl, ke, kp, ki = jax.random.split(key, 6)
  h, rank, rope, k = s["heads"], s["rank"], s["rope"], s["k"]
  pages = context // s["page"] + 1
  q_latent = jax.random.normal(kq, (1, t, h, rank), jnp.float32)
  q_rope = jax.random.normal(kr, (1, t, h, rope), jnp.float32)
  latent, latent_scale = _cache(kl, (pages, s["page"], rank), fp8)
  k_rope = jax.random.normal(ke, (pages, s["page"], rope), jnp.bfloat16)
  picks = [jnp.sort(jax.random.choice(sub, context - t + i + 1, (min(k, context),),
                                      replace=False))
           for i, sub in enumerate(jax.random.split(ki, t))]
  indices = jnp.stack(picks).astype(jnp.int32)[None]
  args = (q_latent, q_rope, latent, latent_scale, k_rope, _page_table(kp, context, s["page"]),
          indices)
  row = rank * (1 if fp8 else 2) + (rank // fp8_block_size(rank) * 4 if fp8 else 0) + rope * 2
  num_bytes = t * k * (row + 4) + (q_latent.size + q_rope.size) * 4 + t * h * rank * 4
  return args, num_bytes


def _values_row(s: dict, case: str, q_tag: str, args: tuple, mla_bytes: float, key: jax.Array,
                timing: dict[str, int], breakdown: bool) -> dict[str, Any]:
  """Sparse MLA through kv_b_proj's value half: the merge and the value product in one launch
  (sparse_mla_decode_values, --value_merge=pallas) against the model's two steps (the kernel,
  then XLA's merge and dsa.value_projection). Bytes add W_UV's and the [T, H, V] output's."""
  h, nope, values, rank = s["heads"], s["nope"], s["values"], s["rank"]
  kv_b = jax.random.normal(key, (h, nope + values, rank), jnp.bfloat16) * 0.05
  fused = functools.partial(sparse_mla_decode_values, nope=nope, softmax_scale=SOFTMAX_SCALE)
  two_steps = lambda *a: value_projection(sparse_mla_decode(*a[:-1], softmax_scale=SOFTMAX_SCALE), a[-1], nope)
  t = args[0].shape[1]
  num_bytes = mla_bytes + h * values * rank * 2 + t * h * (values - rank) * 4
  return _row(_named("sparse_mla_decode", q_tag, "values"), case, fused, two_steps, (*args, kv_b), num_bytes,
              timing, breakdown)


def dsa_rows(*, quick: bool = False, contexts: Sequence[int] = (), query_tokens: Sequence[int] = (),
             breakdown: bool = False, topk_methods: Sequence[str] = ("sampled",),
             query_dtypes: Sequence[str] = ("float32",),
             mla_combines: Sequence[str] = ("xla",)) -> Iterator[dict[str, Any]]:
  """Yields one dict per (kernel, case) as it is measured: us, xla_us, speedup, bytes, floor_us,
  tbs (achieved TB/s); with `breakdown` also own_us (the path's kernels alone, without the
  timing loop's launch gaps and bookkeeping: glmjax.bench.own_kernel_us) and `kernels`,
  glmjax.bench.kernel_breakdown of the kernel path. contexts / query_tokens: override the shape
  set's (empty: keep). topk_methods: the top-k algorithms timed (indexer_topk and topk_indices
  rows, one per method, TOPK_VARIANTS; a method other than radix is named in the kernel column). query_dtypes:
  the dtypes of the queries fed to the indexer and attention kernels (float32: three bf16 MMA
  terms; bfloat16: one), likewise named. mla_combines: how sparse MLA merges its splits
  (SparseMLAConfig.combine), likewise, or "values": the merge with kv_b's value product in one
  launch against the two steps (`_values_row`)."""
  s = dict(QUICK if quick else FULL)
  s["contexts"] = tuple(contexts) or s["contexts"]
  s["query_tokens"] = tuple(query_tokens) or s["query_tokens"]
  timing = _timing(quick)
  key = jax.random.key(0)
  for context in s["contexts"]:
    for t in s["query_tokens"]:
      for fp8 in (False, True):
        case = f"ctx={context} T={t} {'fp8' if fp8 else 'bf16'}"
        key, k1, k2 = jax.random.split(key, 3)
        fp32_args, key_bytes = _indexer_cases(s, context, t, fp8, k1)
        fp32_mla_args, mla_bytes = _mla_case(s, context, t, fp8, k2)
        for queries in query_dtypes:
          args = (fp32_args[0].astype(queries), *fp32_args[1:])
          q_bytes = args[0].size * (args[0].dtype.itemsize - 4)  # the cases count fp32 queries
          q_tag = "" if queries == "float32" else f"{queries} q"
          scores_fn = functools.partial(indexer_scores, num_keys=context)
          scores_ref = functools.partial(indexer_scores_reference, num_keys=context)
          yield _row(_named("indexer_scores", q_tag), case, scores_fn, scores_ref, args,
                     key_bytes + q_bytes + t * context * 4, timing, breakdown)
          select_ref = functools.partial(indexer_topk_reference, num_keys=context, k=s["k"])
          for method in topk_methods:
            select_fn = functools.partial(indexer_topk, num_keys=context, k=s["k"],
                                          topk_config=topk_variant(method))
            yield _row(_named("indexer_topk", q_tag, _method_tag(method)), case, select_fn, select_ref, args,
                       key_bytes + q_bytes + t * min(s["k"], context) * 4, timing, breakdown)
          args = (*(q.astype(queries) for q in fp32_mla_args[:2]), *fp32_mla_args[2:])
          q_bytes = (args[0].size + args[1].size) * (args[0].dtype.itemsize - 4)
          for combine in mla_combines:
            if combine == "values":
              key, sub = jax.random.split(key)
              yield _values_row(s, case, q_tag, args, mla_bytes + q_bytes, sub, timing, breakdown)
              continue
            yield _row(_named("sparse_mla_decode", q_tag, "" if combine == "xla" else f"{combine} combine"), case,
                       functools.partial(sparse_mla_decode, softmax_scale=SOFTMAX_SCALE,
                                         config=SparseMLAConfig(combine=combine)),
                       functools.partial(sparse_mla_decode_reference, softmax_scale=SOFTMAX_SCALE),
                       args, mla_bytes + q_bytes, timing, breakdown)
  for t in s["query_tokens"]:
    for fp8 in (False, True):
      key, sub = jax.random.split(key)
      yield _cache_write_row(s, max(s["contexts"]), t, fp8, sub, timing)
  n, k = s["topk_n"], s["k"]
  for num_rows in s["topk_rows"]:
    key, sub, mask = jax.random.split(key, 3)
    normal = jax.random.normal(sub, (num_rows, n), jnp.float32)
    # ReLU-summed indexer scores: 1% positive, the rest exact zeros that tie the k-th score.
    relu = jnp.maximum(normal, 0.0) * (jax.random.uniform(mask, normal.shape) < 0.02)
    for data, scores in (("", normal), (" relu", relu)):
      for method in topk_methods:
        yield _row(_named("topk_indices", _method_tag(method)), f"rows={num_rows} n={n} k={k}{data}",
                   functools.partial(topk_indices, k=k, config=topk_variant(method)),
                   functools.partial(topk_indices_reference, k=k), (scores,),
                   num_rows * (n + k) * 4, timing, breakdown)


TOPK_VARIANTS = ("radix", "sampled", "one_launch")  # --topk_methods: the sampled method in one launch too


def topk_variant(method: str) -> TopKConfig:
  """The TopKConfig of a --topk_methods entry: a method, or "one_launch" (the sampled one in one launch)."""
  return TopKConfig(one_launch=True) if method == "one_launch" else TopKConfig(method=method)


def _method_tag(method: str) -> str:
  return "" if method == "radix" else method


def _named(kernel: str, *tags: str) -> str:
  """The kernel column: its name, then each non-default variant in parentheses."""
  return kernel + "".join(f" ({tag})" for tag in tags if tag)


def config_sweep_rows(*, quick: bool = False) -> Iterator[dict[str, Any]]:
  """Tuning aid (not part of dsa_rows): each DSA kernel at a TEP=8 rank's case in the full stack
  (80K keys, 5 query tokens, FP8 keys and pages, bf16 queries; sparse MLA with the value merge;
  top-k of 2048 from 131,072 over 1 and 64 rows) under a grid of configs. Yields rows with the
  config, `us` (the kernel path in the timing loop) and, off the CPU, `own_us` (its kernels
  alone: the number that carries into the step, BENCHMARKS.md run 26)."""
  s = QUICK if quick else FULL
  context, t = (s["contexts"][0], 2) if quick else (81920, 5)
  n, k, timing = s["topk_n"], s["k"], _timing(quick)
  bf16_queries = lambda args, count: tuple(a.astype(jnp.bfloat16) for a in args[:count]) + args[count:]
  idx_args = bf16_queries(_indexer_cases(s, context, t, True, jax.random.key(1))[0], 1)  # --indexer_queries
  mla_args = bf16_queries(_mla_case(s, context, t, True, jax.random.key(2))[0], 2)  # --attention_queries
  kv_b = jax.random.normal(jax.random.key(3), (s["heads"], s["nope"] + s["values"], s["rank"]), jnp.bfloat16) * 0.05
  grids = {
      "indexer_scores": (functools.partial(indexer_scores, num_keys=context), idx_args,
                         [IndexerScoresConfig(block_k=bk, num_splits=sp, num_warps=w, orientation=o)
                          for o in ORIENTATIONS for bk in (32, 64, 128) for sp in (None, 128, 512)
                          for w in (4, 8)]),
      "sparse_mla_decode_values": (functools.partial(sparse_mla_decode_values, nope=s["nope"],
                                                     softmax_scale=SOFTMAX_SCALE, out_dtype=jnp.bfloat16),
                                   (*mla_args, kv_b),
                                   [SparseMLAConfig(block_n=bn, num_splits=sp, num_warps=w, num_stages=st)
                                    for bn in (16, 32, 64) for sp in (None, 32, 128) for w in (4, 8)
                                    for st in (2, 3)]),
  }
  for rows, splits in ((1, (None, 64)), (64, (None, 16, 32))):
    scores = jax.random.normal(jax.random.key(rows), (rows, n), jnp.float32)
    grids[f"topk_indices rows={rows}"] = (
        functools.partial(topk_indices, k=k), (scores,),
        [TopKConfig(block=b, num_splits=sp, num_warps=w, method="radix")
         for b in (256, 512, 1024) for sp in splits for w in (4, 8)]
        + [TopKConfig(scan_block=b, select_warps=sw, num_splits=sp, candidate_keys=ck)  # the sampled method
           for b in (1024, 2048) for sw in (8, 16) for sp in (None, 16, 64) for ck in (True, False)])
  for kernel, (fn, args, configs) in grids.items():
    for config in configs[:2] if quick else configs:
      tuned = functools.partial(fn, config=config)
      try:
        times = dict(us=time_device(tuned, *args, **timing) * 1e6)
        if not quick:
          times["own_us"] = time_own_kernels(jax.jit(tuned), *args) * 1e6
      except Exception as e:  # a config the compiler rejects (registers, shared memory) is a result too
        times, config = dict(us=float("nan")), f"{config} failed: {type(e).__name__}: {str(e)[:120]}"
      yield dict(kernel=kernel, config=str(config), **times)
