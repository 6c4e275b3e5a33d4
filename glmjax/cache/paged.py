"""The device side of the paged MLA cache: an explicit pytree, updated functionally.

Per decoder layer the cache holds, for every token, the normalised MLA latent (kv_lora_rank
values), the roped key (qk_rope_head_dim), and, on layers whose indexer runs, the indexer key
(index_head_dim). Storage is bf16 (fp32 for exactness checks of fp32 models), or FP8 e4m3
with per-token power-of-two scales stored in
arrays indexed by the same page id, so a page id names values and scales together (prefix hits,
eviction, copies and host offload move both). Page 0 is the null page: page-table slots past a
sequence's end point at it, and padded tokens write there; it is never read as valid.

Token position s of sequence b lives at (page_table[b, s // page_size], s % page_size).
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from glmjax.cache.kv_fp8 import dequantize_fp8, fp8_block_size, quantize_fp8
from glmjax.cache.prefix_cache import NULL_PAGE
from glmjax.config import ModelConfig

KVDtype = Literal["bf16", "fp32", "fp8"]
KV_DTYPES = ("bf16", "fp32", "fp8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """One layer's pages. Scales are None for bf16 storage; index arrays None where no indexer runs."""
  latent: jax.Array                    # [P, page_size, R] bf16 | f32 | float8_e4m3fn
  latent_scale: jax.Array | None       # [P, page_size, R // block] f32
  k_rope: jax.Array                    # [P, page_size, dr] bf16 (f32 in fp32 storage)
  index_k: jax.Array | None            # [P, page_size, Di] bf16 | f32 | float8_e4m3fn
  index_scale: jax.Array | None        # [P, page_size, Di // block] f32

  @property
  def num_pages(self) -> int:
    return self.latent.shape[0]

  @property
  def page_size(self) -> int:
    return self.latent.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """All layers' pages plus the per-sequence page tables and lengths (tokens written)."""
  layers: tuple[LayerCache, ...]
  page_table: jax.Array                # [B, max_pages] int32
  lengths: jax.Array                   # [B] int32

  @property
  def page_size(self) -> int:
    return self.layers[0].page_size

  @property
  def capacity(self) -> int:
    """Tokens one sequence can address: max_pages * page_size."""
    return self.page_table.shape[1] * self.page_size

  def replace(self, **kw) -> "KVCache":
    return dataclasses.replace(self, **kw)


def check_geometry(config: ModelConfig, page_size: int, max_seq_len: int | None) -> int:
  """The sequence capacity (default: max_position_embeddings), checked against the page size and
  the model's positions; ValueError naming the bad value."""
  max_seq_len = max_seq_len or config.max_position_embeddings
  if page_size <= 0 or max_seq_len % page_size:
    raise ValueError(f"page_size {page_size} must divide max_seq_len {max_seq_len}")
  if max_seq_len > config.max_position_embeddings:
    raise ValueError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings "
                     f"{config.max_position_embeddings}")
  return max_seq_len


def init_cache(config: ModelConfig, *, num_pages: int, page_size: int, batch: int, max_pages: int,
               kv_dtype: KVDtype = "bf16", indexer_layers: tuple[int, ...] | None = None) -> KVCache:
  """Allocate an empty cache. `indexer_layers`: layers that store indexer keys (default: full ones)."""
  if page_size <= 0 or num_pages < 2 or max_pages <= 0 or batch <= 0:
    raise ValueError(f"bad cache geometry: num_pages={num_pages} (need >= 2: page 0 is the null "
                     f"page), page_size={page_size}, max_pages={max_pages}, batch={batch}")
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
  if indexer_layers is None:
    indexer_layers = config.full_indexer_layers
  num_layers = config.num_hidden_layers

  plain = jnp.float32 if kv_dtype == "fp32" else jnp.bfloat16

  def pages(dim, store_fp8):
    if not store_fp8:
      return jnp.zeros((num_pages, page_size, dim), plain), None
    block = fp8_block_size(dim)
    return (jnp.zeros((num_pages, page_size, dim), jnp.float8_e4m3fn),
            jnp.ones((num_pages, page_size, dim // block), jnp.float32))

  fp8 = kv_dtype == "fp8"
  layers = []
  for i in range(num_layers):
    latent, latent_scale = pages(config.kv_lora_rank, fp8)
    index_k, index_scale = pages(config.index_head_dim, fp8) if i in indexer_layers else (None, None)
    k_rope = jnp.zeros((num_pages, page_size, config.qk_rope_head_dim), plain)
    layers.append(LayerCache(latent, latent_scale, k_rope, index_k, index_scale))
  return KVCache(tuple(layers), jnp.zeros((batch, max_pages), jnp.int32), jnp.zeros((batch,), jnp.int32))


def token_slots(page_table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
  """(page id, offset) [B, T] of each position; negative positions (padding) go to the null page."""
  valid = positions >= 0
  safe = jnp.where(valid, positions, 0)
  page = jnp.take_along_axis(page_table, safe // page_size, axis=1)
  return jnp.where(valid, page, NULL_PAGE), jnp.where(valid, safe % page_size, 0)


def _store(pages: jax.Array, scales: jax.Array | None, page: jax.Array, offset: jax.Array,
           values: jax.Array) -> tuple[jax.Array, jax.Array | None]:
  if scales is None:
    return pages.at[page, offset].set(values.astype(pages.dtype)), None
  codes, scale = quantize_fp8(values)
  return pages.at[page, offset].set(codes), scales.at[page, offset].set(scale)


def write_layer(layer: LayerCache, page_table: jax.Array, positions: jax.Array, latent: jax.Array,
                k_rope: jax.Array, index_k: jax.Array | None) -> LayerCache:
  """Write new tokens [B, T, ...] at `positions` [B, T] (-1 = padding, discarded)."""
  page, offset = token_slots(page_table, positions, layer.page_size)
  new_latent, new_latent_scale = _store(layer.latent, layer.latent_scale, page, offset, latent)
  new_rope = layer.k_rope.at[page, offset].set(k_rope.astype(layer.k_rope.dtype))
  new_index, new_index_scale = layer.index_k, layer.index_scale
  if index_k is not None:
    if layer.index_k is None:
      raise ValueError("this layer's cache stores no indexer keys, but its indexer ran")
    new_index, new_index_scale = _store(layer.index_k, layer.index_scale, page, offset, index_k)
  return LayerCache(new_latent, new_latent_scale, new_rope, new_index, new_index_scale)


def gather_pages(pages: jax.Array, scales: jax.Array | None, page_table: jax.Array) -> jax.Array:
  """Gather each sequence's pages [P, page_size, dim] (FP8 dequantised with its scales) into
  [B, max_pages * page_size, dim] fp32."""
  b, m = page_table.shape
  flat = lambda a: a[page_table].reshape(b, m * a.shape[1], a.shape[2])
  if scales is None:
    return flat(pages).astype(jnp.float32)
  return dequantize_fp8(flat(pages), flat(scales))


def gather_latent(layer: LayerCache, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(latent [B, S, R], k_rope [B, S, dr]) in fp32 for every addressable position."""
  return gather_pages(layer.latent, layer.latent_scale, page_table), gather_pages(layer.k_rope, None, page_table)


def gather_index_keys(layer: LayerCache, page_table: jax.Array) -> jax.Array:
  """Indexer keys [B, S, Di] fp32 for every addressable position."""
  return gather_pages(layer.index_k, layer.index_scale, page_table)
