"""Token sampling with explicit PRNG keys: greedy, temperature, top-p (nucleus)."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glmjax.parallel.mesh import TEP


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0 is greedy (argmax, no randomness); top_p < 1 keeps the smallest set of tokens
  whose probability reaches top_p."""
  temperature: float = 0.0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def processed_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """Logits [..., V] after temperature and top-p (masked entries -inf); the target distribution."""
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass strictly before it is below top_p (the top token always stays).
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    logits = jnp.where(keep, logits, -jnp.inf)
  return logits


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """logits [B, V] -> tokens [B] int32."""
  if sampling.temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, processed_logits(logits, sampling), axis=-1).astype(jnp.int32)


def top_k(scores: jax.Array, k: int, mesh=None) -> tuple[jax.Array, jax.Array]:
  """lax.top_k of scores [R, V], the vocab split over `mesh`'s "tep" axis (a TEP mesh's lm_head;
  None: one device). GSPMD cannot split a top_k along its axis: over sharded logits a plain
  lax.top_k gathers the whole [R, V] row to every device (GLM-5's vocab: 620 KB per draft
  token). Here each device takes the top k of its own slice (shard_map), and only those
  [R, tep * k] candidates are gathered for the final top k. Equal to lax.top_k, ties included:
  both stages keep the lower index first, and the candidates lie in index order."""
  r, v = scores.shape
  shards = 1 if mesh is None else mesh.shape[TEP]
  if shards == 1 or v % shards or v // shards < k:
    return jax.lax.top_k(scores, k)

  def local(slice_):
    values, index = jax.lax.top_k(slice_, k)
    return values[:, None], (index + jax.lax.axis_index(TEP) * (v // shards))[:, None]

  values, index = jax.shard_map(local, mesh=mesh, in_specs=P(None, TEP), out_specs=P(None, TEP))(scores)
  values, pick = jax.lax.top_k(values.reshape(r, shards * k), k)
  return values, jnp.take_along_axis(index.reshape(r, shards * k), pick, axis=1)
