"""DSA token selection and attention over the paged cache, behind the `--attention` switch.

`dense` is the reference: indexer scores and attention over every cached position, with the
top-k applied as a mask (what transformers computes). `sparse` gathers only the selected tokens
(jnp references of the kernels), `pallas` runs the kernels; all three select the same set.
"""

import functools

import jax
import jax.numpy as jnp

from glmjax import torch_topk
from glmjax.cache import kv_fp8, paged

NEG_INF = float("-inf")


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, valid: jax.Array) -> jax.Array:
  """score[b,t,s] = sum_h relu(q[b,t,h] . k[b,s] / sqrt(D)) * w[b,t,h] in fp32; -inf where not valid.

  q [B, T, H, D], weights [B, T, H] fp32, keys [B, S, D], valid [B, T, S] bool.
  """
  # HIGHEST: fp32 dots on the GPU would otherwise round through TF32 and flip near-tied picks.
  dots = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
  scores = jnp.einsum("bths,bth->bts", jax.nn.relu(dots * q.shape[-1] ** -0.5), weights,
                      precision=jax.lax.Precision.HIGHEST)
  return jnp.where(valid, scores, NEG_INF)


def index_query_operands(q: jax.Array, weights: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
  """The indexer's (q, head weights) in Runtime.indexer_queries' precision: q rounded to float32
  or bfloat16, or float8_e4m3fn codes of one power-of-two scale per (token, head) (the FP8
  cache's rule, kv_fp8.quantize_block) with that scale folded into the head weights:
  relu(s q.k) w = relu(q.k) (s w) for s > 0, and s w is exact, so every implementation scores
  the same codes and the scores kernel needs no scale operand."""
  if dtype != "float8_e4m3fn":
    return q.astype(dtype), weights
  codes, scale = kv_fp8.quantize_block(q)
  return codes, weights * scale


def select_topk(scores: jax.Array, k: int, *, ties: str = "index", lengths: jax.Array | None = None) -> jax.Array:
  """Top-min(k, S) positions [B, T, k'] by score; -1 where -inf.

  ties="index": among equal scores the lower position wins (lax.top_k). ties="torch_cpu":
  torch.topk's CPU choice over each row's first `lengths[b]` entries (glmjax.torch_topk).
  """
  if ties == "torch_cpu":
    if lengths is None:
      lengths = jnp.full(scores.shape[:1], scores.shape[-1], jnp.int32)
    return torch_topk.torch_cpu_topk(scores, min(k, scores.shape[-1]), lengths)
  values, indices = jax.lax.top_k(scores, min(k, scores.shape[-1]))
  return jnp.where(values > NEG_INF, indices, -1).astype(jnp.int32)


def selection_mask(topk: jax.Array, num_keys: int) -> jax.Array:
  """[B, T, k] positions (-1 empty) -> bool [B, T, num_keys]."""
  hits = topk[..., None] == jnp.arange(num_keys, dtype=topk.dtype)
  return jnp.any(hits, axis=-2)


def causal_valid(positions: jax.Array, num_keys: int) -> jax.Array:
  """Key s is visible to the query at position p iff s <= p; padded queries (p < 0) see nothing."""
  return jnp.arange(num_keys)[None, None, :] <= positions[:, :, None]


def cached_topk(q, weights, layer: paged.LayerCache, page_table, positions, k: int, impl: str,
                ties: str = "index", topk_config=None, scores_config=None) -> jax.Array:
  """Indexer selection over the cached keys for the step's queries: [B, T, min(k, S)].
  topk_config, scores_config: the Pallas top-k's TopKConfig and the scores kernel's
  IndexerScoresConfig (None: their defaults) (impl="pallas")."""
  if impl == "pallas" and ties == "index":
    from pallas_kernels import indexer_topk, topk
    return indexer_topk.indexer_topk(q, weights, layer.index_k, layer.index_scale, page_table, positions,
                                     num_keys=page_table.shape[1] * layer.page_size, k=k,
                                     scores_config=scores_config, topk_config=topk_config)
  # dense and sparse select alike (scores over every cached key); they differ in attention.
  keys = paged.gather_index_keys(layer, page_table)
  scores = index_scores(q, weights, keys, causal_valid(positions, keys.shape[1]))
  return select_topk(scores, k, ties=ties, lengths=jnp.max(positions, axis=1) + 1)


def _gathers_selection(impl: str, q_latent: jax.Array) -> bool:
  """Whether cached_attention gathers each query's selected tokens (decode-sized steps) rather
  than masking every cached one."""
  return impl in ("sparse", "pallas") and q_latent.shape[1] <= 8


def cached_attention(q_latent, q_rope, layer: paged.LayerCache, page_table, positions, topk,
                     scale: float, impl: str, config=None, warm: tuple = ()) -> jax.Array:
  """Latent-space attention of queries [B, T, H, R] over the selected cached tokens -> [B, T, H, R] fp32.
  config: the Pallas kernel's SparseMLAConfig (None: its defaults); warm: arrays its launch
  prefetches into L2 for a later one (sparse_mla_decode's docstring) (both impl="pallas")."""
  if _gathers_selection(impl, q_latent):
    if layer.latent.dtype == jnp.float32:
      raise ValueError(f"attention={impl!r} reads bf16 or fp8 pages; fp32 pages are for the dense reference")
    from pallas_kernels import sparse_mla
    fn = (functools.partial(sparse_mla.sparse_mla_decode, config=config, warm=warm) if impl == "pallas"
          else sparse_mla.sparse_mla_decode_reference)
    return fn(q_latent, q_rope, layer.latent, layer.latent_scale, layer.k_rope, page_table, topk,
              softmax_scale=scale)
  # Dense reference (also used for prefill chunks, whose many queries make a gather per query costly).
  latent, k_rope = paged.gather_latent(layer, page_table)
  num_keys = latent.shape[1]
  hi = jax.lax.Precision.HIGHEST
  logits = (jnp.einsum("bthr,bsr->bths", q_latent, latent, precision=hi)
            + jnp.einsum("bthp,bsp->bths", q_rope, k_rope, precision=hi)) * scale
  visible = selection_mask(topk, num_keys) & causal_valid(positions, num_keys)
  logits = jnp.where(visible[:, :, None, :], logits, NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  # Queries that see nothing (padding) produce NaN rows; zero them so they stay harmless.
  probs = jnp.where(jnp.any(visible, axis=-1)[:, :, None, None], probs, 0.0)
  return jnp.einsum("bths,bsr->bthr", probs, latent, precision=hi)


def cached_attention_values(q_latent, q_rope, layer: paged.LayerCache, page_table, positions, topk,
                            scale: float, impl: str, kv_b: jax.Array, nope: int, *, fuse: bool,
                            dtype=jnp.float32, config=None, warm: tuple = ()) -> jax.Array:
  """`cached_attention` through kv_b_proj's value half (kv_b [H, nope + V, R], rows nope..)
  -> [B, T, H, V], computed in fp32 and rounded to dtype. fuse: where the Pallas kernel runs,
  the product happens in its split merge (pallas_kernels/sparse_mla.sparse_mla_decode_values:
  one launch for XLA's six). config, warm: as cached_attention's."""
  if fuse and impl == "pallas" and _gathers_selection(impl, q_latent):
    from pallas_kernels.sparse_mla import sparse_mla_decode_values
    return sparse_mla_decode_values(q_latent, q_rope, layer.latent, layer.latent_scale, layer.k_rope, page_table,
                                    topk, kv_b, nope=nope, softmax_scale=scale, out_dtype=dtype, config=config,
                                    warm=warm)
  o_latent = cached_attention(q_latent, q_rope, layer, page_table, positions, topk, scale, impl, config, warm)
  return value_projection(o_latent, kv_b, nope).astype(dtype)


def value_projection(o_latent: jax.Array, kv_b: jax.Array, nope: int) -> jax.Array:
  """Latent attention outputs [B, T, H, R] through kv_b_proj's value half (kv_b [H, nope + V, R],
  rows nope..) -> [B, T, H, V] fp32: XLA's einsum."""
  return jnp.einsum("bthr,hvr->bthv", o_latent, kv_b[:, nope:].astype(jnp.float32))


def query_absorption(q_nope: jax.Array, kv_b: jax.Array, nope: int) -> jax.Array:
  """Queries' nope parts [..., H, nope] through kv_b_proj's key half (kv_b [H, nope + V, R], rows
  ..nope) -> the absorbed queries [..., H, R] fp32: XLA's einsum."""
  return jnp.einsum("...hn,hnr->...hr", q_nope.astype(jnp.float32), kv_b[:, :nope].astype(jnp.float32))
