"""The jitted device programs: a prefill chunk, and a whole decode run as one `lax.while_loop`.

Both take params and the KVCache explicitly and return the new cache; the cache argument is
donated, so XLA updates the pages in place. The decode loop samples, appends and stops on device
(max tokens or EOS per sequence), so the host does not synchronise per token.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from glmjax.cache.paged import KVCache
from glmjax.config import ModelConfig
from glmjax.engine.sampling import Sampling, sample
from glmjax.model import CausalLM
from glmjax.runtime import Runtime


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about the compiled steps (hashable: a jit static argument)."""
  config: ModelConfig
  runtime: Runtime
  dtype: str = "bfloat16"

  @property
  def model(self) -> CausalLM:
    dt = jnp.dtype(self.dtype)
    return CausalLM(self.config, dtype=dt, param_dtype=dt)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("cache",))
def prefill_chunk(params, cache: KVCache, tokens: jax.Array, positions: jax.Array, *, spec: StepSpec):
  """Write a chunk of tokens [B, C] at positions [B, C] (-1 = padding) into the cache.

  Returns (logits [B, V] fp32 at each sequence's last real token of the chunk, hidden [B, D] there,
  new cache with lengths advanced by the real tokens).
  """
  logits, hidden, cache = spec.model.apply({"params": params}, tokens, positions, cache=cache,
                                           runtime=spec.runtime)
  last = jnp.argmax(positions, axis=1)
  pick = lambda a: jnp.take_along_axis(a, last[:, None, None], axis=1)[:, 0]
  lengths = jnp.maximum(cache.lengths, jnp.max(positions, axis=1) + 1)
  return pick(logits), pick(hidden), cache.replace(lengths=lengths)


@functools.partial(jax.jit, static_argnames=("spec", "sampling", "max_new_tokens"),
                   donate_argnames=("cache",))
def decode_loop(params, cache: KVCache, first_tokens: jax.Array, active: jax.Array, key: jax.Array,
                eos_ids: jax.Array, budget: jax.Array, *, spec: StepSpec, sampling: Sampling,
                max_new_tokens: int):
  """Generate up to max_new_tokens per sequence on device.

  first_tokens [B]: each sequence's next input token (sampled from its prefill logits, not yet
  in the cache). active [B] bool: sequences taking part. eos_ids [E] int32 (empty = ignore EOS).
  budget [B] int32: tokens each sequence may emit (<= max_new_tokens).
  Returns (tokens [B, max_new_tokens] int32 with -1 after each sequence stops, counts [B],
  steps run, new cache). Stopped sequences write nothing (their position is -1).
  """
  b = first_tokens.shape[0]
  out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(jnp.where(active, first_tokens, -1))
  stopped = ~active | (budget <= 1) | jnp.isin(first_tokens, eos_ids)
  counts = jnp.where(active, 1, 0).astype(jnp.int32)

  def cond(state):
    _, _, _, stopped, step, _ = state
    return (step < max_new_tokens) & ~jnp.all(stopped)

  def body(state):
    cache, out, counts, stopped, step, key = state
    tokens = out[:, step - 1]
    positions = jnp.where(stopped, -1, cache.lengths)[:, None]
    logits, _, cache = spec.model.apply({"params": params}, tokens[:, None], positions, cache=cache,
                                        runtime=spec.runtime)
    key, sub = jax.random.split(key)
    new = sample(logits[:, 0], sub, sampling)
    running = ~stopped
    out = out.at[:, step].set(jnp.where(running, new, -1))
    lengths = cache.lengths + running.astype(jnp.int32)
    counts = counts + running.astype(jnp.int32)
    stopped = stopped | jnp.isin(new, eos_ids) | (counts >= budget)
    return cache.replace(lengths=lengths), out, counts, stopped, step + 1, key

  state = (cache, out, counts, stopped, jnp.int32(1), key)
  cache, out, counts, stopped, steps, _ = jax.lax.while_loop(cond, body, state)
  # The last emitted token of each sequence is not in the cache yet (it is the next input).
  return out, counts, steps, cache
