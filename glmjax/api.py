"""The public entry points: forward (one causal pass, no cache) and generate (through the cache)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.cache.paged import init_cache
from glmjax.config import ModelConfig
from glmjax.engine import steps
from glmjax.engine.sampling import Sampling, sample
from glmjax.model import CausalLM
from glmjax.runtime import Runtime
from glmjax.serve.host_tier import bucket_pow2


def params_dtype(params) -> jnp.dtype:
  """The compute dtype implied by the params: that of the embedding table."""
  return jnp.dtype(params["embed_tokens"]["weight"].dtype)


def check_tokens(config: ModelConfig, tokens, *, extra_positions: int = 0) -> np.ndarray:
  """Host-side validation of token ids [B, S]: in the vocabulary and within max positions."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or tokens.shape[1] == 0:
    raise ValueError(f"token ids must be [batch, seq] with seq >= 1, got shape {tokens.shape}")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"token ids must be integers, got {tokens.dtype}")
  bad = (tokens < 0) | (tokens >= config.vocab_size)
  if bad.any():
    b, s = map(int, np.argwhere(bad)[0])
    raise ValueError(f"token id {int(tokens[b, s])} at [{b}, {s}] is outside the vocabulary "
                     f"[0, {config.vocab_size})")
  if tokens.shape[1] + extra_positions > config.max_position_embeddings:
    raise ValueError(f"context of {tokens.shape[1] + extra_positions} tokens exceeds "
                     f"max_position_embeddings={config.max_position_embeddings}")
  return tokens.astype(np.int32)


@functools.partial(jax.jit, static_argnames=("config", "runtime", "dtype"))
def _forward(params, tokens, *, config, runtime, dtype):
  return CausalLM(config, dtype=dtype, param_dtype=dtype).apply({"params": params}, tokens, runtime=runtime)[0]


def forward(config: ModelConfig, params, input_ids, *, runtime: Runtime = Runtime()) -> jax.Array:
  """One causal pass with no cache: logits float32 [B, S, V] (the reference path). Params in the
  runtime's weight layout (Runtime.arrange) are used as they are; others are moved on each call,
  so a loop of calls under matmul="pallas_fragments" should arrange them once first."""
  tokens = check_tokens(config, input_ids)
  return _forward(runtime.arrange(params), tokens, config=config, runtime=runtime, dtype=params_dtype(params))


def generate(config: ModelConfig, params, prompt_ids, max_new_tokens: int, *, ignore_eos: bool = False,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, runtime: Runtime = Runtime(),
             kv_dtype: str | None = None, page_size: int = 16, prefill_chunk: int = 256) -> np.ndarray:
  """Prompt [B, S] -> int32 [B, S + max_new_tokens], prompt included, greedy by default.

  Runs through the paged cache: a chunked prefill, then the on-device decode loop. After a
  sequence emits EOS (unless ignore_eos) the rest of its row is filled with the pad token
  (EOS when the config has none), as transformers does. kv_dtype defaults to the params'
  precision (fp32 pages for an fp32 model, else bf16).

  Shapes go up to powers of two (`bucket_pow2`: the last prefill chunk, padded as the engine pads
  its chunks; the cache's pages; the decode loop's length, each row stopped at its budget), so
  calls with other prompt lengths or token counts reuse the compiled programs.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  prompt = check_tokens(config, prompt_ids, extra_positions=max_new_tokens)
  params = runtime.arrange(params)
  b, s = prompt.shape
  if kv_dtype is None:
    kv_dtype = "fp32" if params_dtype(params) == jnp.float32 else "bf16"
  pages_per_seq = bucket_pow2(math.ceil((s + max_new_tokens) / page_size))
  cache = init_cache(config, num_pages=1 + b * pages_per_seq, page_size=page_size, batch=b,
                     max_pages=pages_per_seq, kv_dtype=kv_dtype)
  cache = cache.replace(page_table=1 + jnp.arange(b * pages_per_seq, dtype=jnp.int32).reshape(b, pages_per_seq))
  spec = steps.StepSpec(config, runtime, jnp.dtype(params_dtype(params)).name)
  for start in range(0, s, prefill_chunk):
    piece = prompt[:, start:start + prefill_chunk]
    width = min(bucket_pow2(piece.shape[1]), prefill_chunk)
    chunk = np.zeros((b, width), np.int32)
    positions = np.full((b, width), -1, np.int32)  # -1: padding, written to the null page
    chunk[:, :piece.shape[1]] = piece
    positions[:, :piece.shape[1]] = np.arange(start, start + piece.shape[1])
    logits, _, cache = steps.prefill_chunk(params, cache, jnp.asarray(chunk), jnp.asarray(positions), spec=spec)
  sampling = Sampling(temperature, top_p)
  key, first_key = jax.random.split(jax.random.key(seed))
  first = sample(logits, first_key, sampling)
  eos = jnp.asarray([] if ignore_eos else config.eos_token_ids, jnp.int32)
  out, _, _, _ = steps.decode_loop(params, cache, first, jnp.ones((b,), bool), key, eos,
                                   jnp.full((b,), max_new_tokens, jnp.int32), spec=spec,
                                   sampling=sampling, max_new_tokens=bucket_pow2(max_new_tokens))
  out = np.asarray(out)[:, :max_new_tokens]
  pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_ids[0]
  return np.concatenate([prompt, np.where(out < 0, pad, out)], axis=1).astype(np.int32)
