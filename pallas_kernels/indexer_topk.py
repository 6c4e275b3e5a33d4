"""DSA key selection: indexer scores + exact top-k, optionally with top-k's first pass fused
into scoring.

Unfused (the default): `indexer_scores`, then `topk_indices` over the scores (5 x 80K scores =
1.6 MB, read back from L2); with TopKConfig.sample_source="scores" the scoring kernel also
writes each row's strided sample for the sampled top-k contiguously, which its threshold then
reads whole rather than gathering it from the row. Fused (`fuse_first_pass=True`): the scores kernel also histograms the
top 8 key bits of every score it writes (topk.py's digit 0), one launch and one read of the
scores fewer. Measured on the H200 (docs/BENCHMARKS.md, run 6), the fusion loses badly: at 80K
keys and 5 query tokens the fused scoring kernel takes 1.32 ms against 35 us unfused, as each
program then builds one-hot histogram operands for every query token of its group (8) inside
its key loop. The switch stays for the ablation.

Lowering: Triton, as the two kernels it composes (see indexer_scores.py and topk.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import topk
from pallas_kernels.checks import resolve_interpret
from pallas_kernels.indexer_scores import (QUERY_GROUP, IndexerScoresConfig, check_indexer_args,
                                           indexer_scores, indexer_scores_reference, pad_queries,
                                           scores_call)


@functools.partial(jax.jit,
                   static_argnames=("num_keys", "k", "scores_config", "topk_config", "fuse_first_pass",
                                    "interpret"))
def indexer_topk(q: jax.Array, weights: jax.Array, index_k: jax.Array,
                 index_scale: jax.Array | None, page_table: jax.Array, q_positions: jax.Array,
                 *, num_keys: int, k: int, scores_config: IndexerScoresConfig | None = None,
                 topk_config: topk.TopKConfig | None = None, fuse_first_pass: bool = False,
                 interpret: bool | None = None) -> jax.Array:
  """Positions of the k best-scoring cached keys for each query token.

  Args: as `indexer_scores`, plus
    k: keys to select (>= 1); contexts shorter than k select min(k, num_keys), as lax.top_k
      over the scores would.
    scores_config / topk_config: tuning of the two kernels; None for the defaults (fused: the
      radix select). Fused, the split count comes from scores_config (it sets the scoring grid
      and the top-k chunks).
    fuse_first_pass: histogram top-k's digit 0 inside the scoring kernel (module docstring).
  Returns:
    int32 [B, T, min(k, num_keys)]: for each query token the exact top-k set of positions
    s <= q_positions[b, t] (order: see topk.py), then -1 where fewer positions are valid.
  """
  check_indexer_args(q, weights, index_k, index_scale, page_table, q_positions, num_keys)
  k = min(k, num_keys)
  topk.check_topk_args(num_keys, k)
  scores_config = scores_config or IndexerScoresConfig()
  # Fused, the radix select's first pass is what scoring takes over.
  topk_config = topk_config or (topk.TopKConfig(method="radix") if fuse_first_pass else topk.TopKConfig())
  interpret = resolve_interpret(interpret)
  if fuse_first_pass and topk_config.method != "radix":
    raise ValueError(f"fuse_first_pass fuses the radix select's first pass into scoring; "
                     f"topk_config.method={topk_config.method!r} has no such pass")
  if not fuse_first_pass:
    plan = topk.sample_plan(num_keys, k, topk_config.sample) if topk_config.method == "sampled" else None
    sample = (plan.stride, topk_config.sample) if plan and topk_config.sample_source == "scores" else None
    out = indexer_scores(q, weights, index_k, index_scale, page_table, q_positions, num_keys=num_keys,
                         config=scores_config, interpret=interpret, sample=sample)
    scores, sampled = out if sample else (out, None)
    return topk.topk_indices(scores, k, config=topk_config, interpret=interpret, sample=sampled)
  if (scores_config.num_splits or 0) > topk.MAX_SPLITS:
    raise ValueError(f"fuse_first_pass: scores_config.num_splits={scores_config.num_splits} splits the top-k's "
                     f"rows too, at most topk.MAX_SPLITS={topk.MAX_SPLITS}")
  b, t = q.shape[:2]
  q, weights, q_positions = pad_queries(q, weights, q_positions)
  tp = q.shape[1]
  granule = scores_config.block_k
  splits = scores_config.num_splits or topk.row_splits(b * pl.cdiv(tp, QUERY_GROUP), num_keys,
                                                       granule)
  chunk = topk.split_chunk(num_keys, splits, granule)
  tot = jnp.zeros((topk.PREFIX_DIGITS, b, tp, topk.BINS), jnp.float32)
  scores, ge0, tot = scores_call(q, weights, index_k, index_scale, page_table, q_positions,
                                 num_keys=num_keys, splits=splits, chunk=chunk,
                                 block_k=granule, config=scores_config, interpret=interpret,
                                 tot=tot)
  rows = b * tp
  out = topk.select_from_first_pass(
      scores.reshape(rows, num_keys), ge0.reshape(rows, splits, topk.BINS),
      tot.reshape(topk.PREFIX_DIGITS, rows, topk.BINS), k=k, splits=splits, chunk=chunk,
      block=topk.loop_block(chunk, topk_config.block), config=topk_config, interpret=interpret)
  return out.reshape(b, tp, k)[:, :t]


@functools.partial(jax.jit, static_argnames=("num_keys", "k"))
def indexer_topk_reference(q: jax.Array, weights: jax.Array, index_k: jax.Array,
                           index_scale: jax.Array | None, page_table: jax.Array,
                           q_positions: jax.Array, *, num_keys: int, k: int) -> jax.Array:
  """Reference scores + `lax.top_k` (descending score order): same arguments as the kernel."""
  scores = indexer_scores_reference(q, weights, index_k, index_scale, page_table, q_positions,
                                    num_keys=num_keys)
  return topk.topk_indices_reference(scores, min(k, num_keys))

