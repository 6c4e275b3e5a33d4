"""Token sampling with explicit PRNG keys: greedy, temperature, top-p (nucleus)."""

import dataclasses

import jax
import jax.numpy as jnp


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
