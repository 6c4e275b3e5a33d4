"""MLA attention with the DSA lightning indexer (GLM-5 / DeepSeek-V3.2).

Einsum letters: b batch, t query tokens, s key tokens, h heads, n nope dims, p rope dims,
r latent (kv_lora_rank) dims, v value dims, d indexer head dims.

Two paths share the projections:
- `reference` (no cache): transformers' formulation, K/V expanded per head through kv_b_proj
  and the top-k selection applied as a mask. It is the numerics every fast path is tested against.
- `cached`: new tokens are written to the paged cache, then attention runs in latent space with
  the absorbed query (kv_b_proj's key half folded into q, its value half applied after), over the
  selected tokens. Dots accumulate in fp32: bf16 accumulation drifts over 78 layers.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from glmjax import dsa, quant
from glmjax.cache import paged
from glmjax.config import ModelConfig
from glmjax.layers import LayerNorm, RMSNorm, Weight, apply_rope, apply_rope_leading, linears
from glmjax.runtime import Runtime

NEG_INF = float("-inf")


class Indexer(nn.Module):
  """Lightning indexer: per-token queries/weights and one key head; scores pick the top-k keys.

  Computed in fp32 whatever the model's dtype: it is a small share of the work, and bf16
  rounding of its queries and head weights flips near-tied selections. Its weights are
  attributes (wq_b, wk, weights_proj, k_norm), so MLAttention can group wq_b with q_b_proj.
  """
  config: ModelConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  def setup(self):
    c = self.config
    self.wq_b = Weight((c.index_n_heads * c.index_head_dim, c.q_lora_rank), ("index_heads", "q_lora"),
                       self.param_dtype)
    self.wk = Weight((c.index_head_dim, c.hidden_size), (None, "embed"), self.param_dtype)
    self.weights_proj = Weight((c.index_n_heads, c.hidden_size), ("index_heads", "embed"), self.param_dtype)
    self.k_norm = LayerNorm(c.index_head_dim, eps=1e-6, dtype=jnp.float32, param_dtype=self.param_dtype)

  def __call__(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array, *, matmul: str = "xla",
               dense: str = "xla", keys: str = "xla", q_partials: jax.Array | None = None,
               finished_q: jax.Array | None = None, finished_keys: tuple[jax.Array, jax.Array] | None = None):
    """-> q [B, T, H, D] (roped), weights [B, T, H] fp32 (H^-0.5 folded in), k [B, T, D] (roped).
    matmul, dense: the projections' quantized- and plain-weight matmuls (glmjax.quant.linear,
    linear_group: Runtime.matmul, dense_matmul). keys:
    Runtime.indexer_keys ("pallas": k and the weights from their GEMV's partials in one launch
    at decode, pallas_kernels/indexer_keys.py). q_partials: wq_b's split-K partials where the
    caller ran it (grouped with q_b_proj), else wq_b runs here. finished_q, finished_keys: q, and
    (k, weights), where the caller made them (in the absorbed-query launch, Runtime.index_query;
    in MLA's epilogue launch, Runtime.index_epilogue)."""
    c = self.config
    b, t, _ = x.shape
    q = finished_q
    if q is None:
      q = (jnp.sum(q_partials, axis=0) if q_partials is not None
           else quant.linear(q_resid, self.wq_b(), impl=matmul, dense=dense, dtype=jnp.float32))
      q = apply_rope_leading(q.reshape(b, t, c.index_n_heads, c.index_head_dim), cos, sin)
    if finished_keys is not None:
      k, weights = finished_keys
      return q, weights, k
    # Both from x, in one launch under dense="pallas_grouped"; the head weights kept in fp32: bf16
    # rounding of them flips near-tied selections.
    projections = [self.wk(), self.weights_proj()]
    if keys == "pallas" and quant.decode_sized(x):
      from pallas_kernels.indexer_keys import indexer_keys  # the kernels import the model
      k, weights = indexer_keys(*quant.linear_group_partials(x, projections, impl=matmul, dense=dense),
                                self.k_norm.weight, self.k_norm.bias, *(a.reshape(b * t, -1) for a in (cos, sin)),
                                eps=self.k_norm.eps)
      return q, weights.reshape(b, t, -1), k.reshape(b, t, -1)
    k, weights = quant.linear_group(x, projections, impl=matmul, dense=dense, dtype=jnp.float32)
    return q, weights * c.index_n_heads ** -0.5, apply_rope_leading(self.k_norm(k), cos, sin)


class MLAttention(nn.Module):
  """Multi-head latent attention with DSA top-k selection (full or shared indexer)."""
  config: ModelConfig
  has_indexer: bool
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x, cos, sin, prev_topk, *, positions, runtime: Runtime, layer_id: int,
               cache: paged.KVCache | None = None, cache_slot: int = 0, o_partials: bool = False):
    """x [B, T, D] -> (out [B, T, D], topk [B, T, k] int32 or None, new LayerCache or None).
    o_partials: out as o_proj's fp32 split-K partials [S, B * T, D] (quant.linear_partials), for
    a fused residual add (Runtime.residual_norm).

    `prev_topk`: the selection of the nearest preceding layer that ran its indexer, reused when
    this layer does not run its own (IndexShare). Indices are absolute token positions, -1 empty.
    """
    c = self.config
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    b, t, _ = x.shape
    h, nope, r, v = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim
    run_indexer = runtime.runs_indexer(layer_id, self.has_indexer) or prev_topk is None
    if run_indexer and not self.has_indexer:
      raise ValueError(f"layer {layer_id} must run its indexer but has no indexer weights "
                       "(a 'shared' layer in the checkpoint): choose an IndexShare pattern whose "
                       "full layers have indexers")
    indexer = Indexer(c, name="indexer", **kw) if (self.has_indexer and run_indexer) else None
    with jax.named_scope("mla_proj"):
      # [b, t, q_lora], [b, t, r], [b, t, p]; the indexer's (k, weights) where its epilogue joined MLA's, else
      # None; the layer's cache with the new rows written where the epilogue wrote them, else None
      write = None
      if cache is not None and runtime.epilogue_write == "pallas":
        write = (cache.layers[cache_slot], cache.page_table, positions)
      q_resid, latent, k_pe, index_keys, written = self._projections(x, cos, sin, runtime, indexer, write)
      q_b = Weight((h * c.qk_head_dim, c.q_lora_rank), ("heads", "q_lora"), self.param_dtype, name="q_b_proj")()
      kv_b = Weight((h * (nope + v), r), ("heads", None), self.param_dtype, name="kv_b_proj")()
      kv_b = kv_b if isinstance(kv_b, jax.Array) else kv_b.dequantize(jnp.float32)  # used raw (absorbed)
      kv_b = kv_b.reshape(h, nope + v, r)

    o_proj = Weight((c.hidden_size, h * v), ("embed", "heads"), self.param_dtype, name="o_proj")()
    if cache is None:
      q_nope, q_pe = self._query(q_resid, q_b, cos, sin, runtime)
      idx = self._index(indexer, x, q_resid, cos, sin, runtime)
      out, topk = self._reference(q_nope, q_pe, latent, k_pe, kv_b, idx, prev_topk, positions, runtime)
      new_layer = None
    else:
      q_latent, q_pe, index_q = self._absorbed_query(q_resid, q_b, kv_b, cos, sin, runtime,
                                                     None if indexer is None else indexer.wq_b())
      idx = self._index(indexer, x, q_resid, cos, sin, runtime, finished_keys=index_keys, **index_q)
      out, topk, new_layer = self._cached(q_latent, q_pe, latent, k_pe, kv_b, idx, prev_topk, positions,
                                          cache, cache_slot, runtime, written, o_proj)
    out = out.reshape(b, t, h * v).astype(self.dtype)
    impls = dict(impl=runtime.matmul, dense=runtime.dense_matmul, dtype=self.dtype)
    if o_partials:
      return (quant.linear_partials(out, o_proj, gemv_splits=runtime.fold_splits, **impls), topk,
              new_layer)
    return quant.linear(out, o_proj, **impls), topk, new_layer

  def _index(self, indexer, x, q_resid, cos, sin, runtime, **finished):
    """The indexer's (q, weights, k), q in Runtime.indexer_queries (bfloat16: one MMA term in the
    scores kernel, not three; float8_e4m3fn: codes, their scales in the weights,
    dsa.index_query_operands); None without an indexer to run (the layer reuses a top-k).
    finished: the Indexer's q_partials, finished_q, finished_keys where fused launches made them."""
    if indexer is None:
      return None
    q, weights, k = indexer(x, q_resid, cos, sin, matmul=runtime.matmul, dense=runtime.dense_matmul,
                            keys=runtime.indexer_keys, **finished)
    return *dsa.index_query_operands(q, weights, runtime.indexer_queries), k

  def _projections(self, x, cos, sin, runtime, indexer, write=None):
    """x through q_a_proj and kv_a_proj_with_mqa (one launch under dense="pallas_grouped") and
    their norms -> (q_resid, latent, k_pe roped, None, None). With mla_epilogue="pallas" at
    decode (quant.decode_sized), the norms and the rotation in one launch from the GEMV's
    partials; with index_epilogue="pallas", the indexer's (k, weights) instead of the first
    None: its wk and weights_proj in the same GEMV, its key epilogue in the same launch; and
    given `write` (the layer's pages, the page table, the positions: Runtime.epilogue_write),
    the new rows written into the pages in that launch too: the written LayerCache last."""
    c = self.config
    b, t, _ = x.shape
    r, rope = c.kv_lora_rank, c.qk_rope_head_dim
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    specs = [("q_a_proj", c.q_lora_rank, ("q_lora", "embed")), ("kv_a_proj_with_mqa", r + rope, (None, "embed"))]
    q_norm = RMSNorm(c.q_lora_rank, 1e-6, name="q_a_layernorm", **kw)
    kv_norm = RMSNorm(r, 1e-6, name="kv_a_layernorm", **kw)
    if runtime.mla_epilogue == "pallas" and quant.decode_sized(x):
      from pallas_kernels.mla_epilogue import mla_epilogue  # the kernels import the model
      joined = runtime.index_epilogue == "pallas" and indexer is not None
      more = [indexer.wk(), indexer.weights_proj()] if joined else []
      q_partials, kv_partials, *index_partials = linears(x, specs, partials=True, more=more,
                                                         gemv_splits=runtime.fold_splits,
                                                         **runtime.linear_impls, **kw)
      index_keys = (*index_partials, indexer.k_norm.weight, indexer.k_norm.bias) if joined else None
      *outs, written = mla_epilogue(q_partials, kv_partials, q_norm.weight, kv_norm.weight,
                                    *(a.reshape(b * t, -1) for a in (cos, sin)), eps=q_norm.eps, dtype=self.dtype,
                                    index_keys=index_keys, index_eps=indexer.k_norm.eps if joined else 1e-6,
                                    write=write) + ((None,) if write is None else ())
      outs = [a.reshape(b, t, -1) for a in outs]
      return *outs[:3], (tuple(outs[3:]) if joined else None), written
    q_a, kv_a = linears(x, specs, **runtime.linear_impls, **kw)
    return q_norm(q_a), kv_norm(kv_a[..., :r]), apply_rope(kv_a[..., r:], cos, sin), None, None

  def _query(self, q_resid, q_b, cos, sin, runtime):
    """q_b_proj's output per head -> (q_nope [B, T, H, nope], q_pe [B, T, H, rope] rotated)."""
    c = self.config
    q = quant.linear(q_resid, q_b, impl=runtime.matmul, dense=runtime.dense_matmul, dtype=self.dtype)
    q = q.reshape(*q_resid.shape[:2], c.num_attention_heads, c.qk_head_dim)
    return q[..., :c.qk_nope_head_dim], apply_rope(q[..., c.qk_nope_head_dim:], cos, sin)

  def _absorbed_query(self, q_resid, q_b, kv_b, cos, sin, runtime, index_wq):
    """The cached path's queries in Runtime.attention_queries: (q_latent [B, T, H, R], the q_nope
    part through kv_b's key half; q_pe [B, T, H, rope]; the Indexer's q arguments: {} or its
    wq_b's partials, or its finished q). With query_absorb="pallas" at decode
    (quant.decode_sized), one launch from q_b's split-K partials, and index_wq (the indexer's
    wq_b, which also reads q_resid, or None) in q_b's GEMV launch under dense="pallas_grouped";
    with index_query="pallas" the indexer's q finished in the same launch."""
    c = self.config
    b, t, _ = q_resid.shape
    queries = jnp.dtype(runtime.attention_queries)
    if runtime.query_absorb == "pallas" and quant.decode_sized(q_resid):
      from pallas_kernels import mla_query  # the kernels import the model
      partials, *index_q = quant.linear_group_partials(q_resid, [q_b] + ([] if index_wq is None else [index_wq]),
                                                       impl=runtime.matmul, dense=runtime.dense_matmul,
                                                       gemv_splits=runtime.fold_splits)
      angles = [a.reshape(b * t, -1) for a in (cos, sin)]
      joined = runtime.index_query == "pallas" and index_wq is not None
      # e4m3 codes are cut from the fp32 query in _index (dsa.index_query_operands)
      index_dtype = "float32" if runtime.indexer_queries == "float8_e4m3fn" else runtime.indexer_queries
      q_latent, q_pe, *finished_q = mla_query.absorbed_query(
          partials, kv_b, *angles, nope=c.qk_nope_head_dim, q_dtype=self.dtype, out_dtype=queries,
          index_partials=index_q[0] if joined else None, index_heads=c.index_n_heads,
          index_dtype=jnp.dtype(index_dtype))
      index_args = (dict(finished_q=finished_q[0].reshape(b, t, *finished_q[0].shape[1:])) if joined
                    else dict(q_partials=index_q[0]) if index_q else {})
      return q_latent.reshape(b, t, *q_latent.shape[1:]), q_pe.reshape(b, t, *q_pe.shape[1:]), index_args
    q_nope, q_pe = self._query(q_resid, q_b, cos, sin, runtime)
    return dsa.query_absorption(q_nope, kv_b, c.qk_nope_head_dim).astype(queries), q_pe.astype(queries), {}

  def _reference(self, q_nope, q_pe, latent, k_pe, kv_b, idx, prev_topk, positions, runtime):
    """transformers' expanded-KV attention over the sequence itself (no cache)."""
    c = self.config
    b, t, h, _ = q_nope.shape
    nope, v = c.qk_nope_head_dim, c.v_head_dim
    kv = jnp.einsum("bsr,hxr->bshx", latent, kv_b.astype(self.dtype)).reshape(b, t, h, nope + v)
    k_nope, values = kv[..., :nope], kv[..., nope:]
    query = jnp.concatenate([q_nope, q_pe], axis=-1)
    key = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], k_nope.shape[:3] + k_pe.shape[-1:])], -1)
    causal = positions[:, None, :] <= positions[:, :, None]                          # [b, t, s]
    if idx is not None:
      q_idx, w_idx, k_idx = idx
      prev_topk = dsa.select_topk(dsa.index_scores(q_idx, w_idx, k_idx, causal), c.index_topk, ties=runtime.topk_ties)
    selected = dsa.selection_mask(prev_topk, t) & causal
    logits = jnp.einsum("bthd,bshd->bhts", query, key) * c.softmax_scale
    logits = jnp.where(selected[:, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(self.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, values), prev_topk

  def _cached(self, q_latent, q_pe, latent, k_pe, kv_b, idx, prev_topk, positions, cache, cache_slot, runtime,
              written, o_proj):
    """Write the new tokens to the pages (unless MLA's epilogue launch wrote them: `written`),
    then attend in latent space over the selection (warming o_proj's weight into L2 under
    runtime.warm_o_proj)."""
    c = self.config
    layer = written
    if layer is None:
      layer = cache.layers[cache_slot]
      if runtime.cache_write == "pallas":
        from pallas_kernels.paged_write import paged_write as write  # the kernels import the cache
      else:
        write = paged.write_layer
      layer = write(layer, cache.page_table, positions, latent, k_pe,
                    None if idx is None or layer.index_k is None else idx[2])
    if idx is not None:
      q_idx, w_idx, _ = idx
      prev_topk = dsa.cached_topk(q_idx, w_idx, layer, cache.page_table, positions, c.index_topk,
                                  runtime.attention, runtime.topk_ties, runtime.topk_config(),
                                  runtime.indexer_scores_config())
    out = dsa.cached_attention_values(q_latent, q_pe, layer, cache.page_table, positions, prev_topk,
                                      c.softmax_scale, runtime.attention, kv_b, c.qk_nope_head_dim,
                                      fuse=runtime.value_merge == "pallas", dtype=self.dtype,
                                      config=runtime.attention_config(),
                                      warm=tuple(jax.tree.leaves(o_proj)) if runtime.warm_o_proj else ())
    return out, prev_topk, layer
