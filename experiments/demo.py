"""`make demo`: the embedded default end to end on the CPU.

Loads the tiny GLM-5-architecture checkpoint (the transformers-made fixture when present, else a
random `tiny` model), prints its describe table, and generates greedily from a prompt through the
paged cache, checking the cached decode against the reference forward pass.
"""

import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import glmjax
from configs import get_model_config
from experiments.describe import describe, format_table
from glmjax.model import init_params

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf_glm_moe_dsa_tiny"
_CHECKPOINT = flags.DEFINE_string("checkpoint", str(FIXTURE) if FIXTURE.exists() else "",
                                  "HF checkpoint directory (random tiny model when empty)")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 24, "tokens to generate")


def main(_):
  if _CHECKPOINT.value and os.path.isdir(_CHECKPOINT.value):
    config, params = glmjax.load_pretrained(_CHECKPOINT.value, dtype=jnp.float32)
    source = _CHECKPOINT.value
  else:
    config = get_model_config("tiny")
    params = init_params(config, jax.random.key(0), param_dtype=jnp.float32)
    source = "random init (configs/tiny.py)"
  print(f"model: {source}\n")
  print(format_table(describe(config, context=4096, verify_tokens=1)))
  prompt = np.random.default_rng(0).integers(2, config.vocab_size, (2, 16)).astype(np.int32)
  start = time.perf_counter()
  out = glmjax.generate(config, params, prompt, _NEW_TOKENS.value, ignore_eos=True)
  elapsed = time.perf_counter() - start
  print(f"\ngenerated {out.shape[0]} x {_NEW_TOKENS.value} tokens in {elapsed:.2f} s (CPU, compile included)")
  for row in out:
    print("  prompt", row[:16].tolist(), "\n  new   ", row[16:].tolist())
  logits = np.asarray(glmjax.forward(config, params, out))
  agree = np.mean(np.argmax(logits[:, 15:-1], -1) == out[:, 16:])
  print(f"cached decode vs reference forward: {agree:.0%} of greedy tokens agree")
  if agree < 1:
    raise SystemExit("cached decode disagrees with the reference forward")


if __name__ == "__main__":
  app.run(main)
