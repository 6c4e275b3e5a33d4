"""`make demo`: the embedded default end to end on the CPU.

Loads the trained mini GLM-5 shipped in checkpoints/mini (byte-level, trained on the Python
standard library), prints its describe table, and continues a held-out source file greedily
through the paged cache, with and without MTP speculative decoding, checking both against the
reference forward pass.
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
from glmjax.data import load_corpus
from glmjax.engine.engine import Engine
from glmjax.engine.speculative import SpecConfig
from glmjax.model import init_params
from glmjax.runtime import make_runtime
from glmjax.tokenizer import ByteTokenizer

MINI = pathlib.Path(__file__).resolve().parents[1] / "checkpoints" / "mini"
_CHECKPOINT = flags.DEFINE_string("checkpoint", str(MINI), "HF checkpoint directory (random tiny model when empty)")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 96, "tokens to generate")


def main(_):
  if _CHECKPOINT.value and os.path.isdir(_CHECKPOINT.value):
    config, params = glmjax.load_pretrained(_CHECKPOINT.value, dtype=jnp.bfloat16)
    source = _CHECKPOINT.value
    prompt = load_corpus().sample_validation_text(np.random.default_rng(0), 256)
  else:
    config = get_model_config("tiny")
    params = init_params(config, jax.random.key(0))
    source = "random init (configs/tiny.py)"
    prompt = np.random.default_rng(0).integers(2, config.vocab_size, 64).tolist()
  print(f"model: {source}\n")
  print(format_table(describe(config, context=4096, verify_tokens=5)))
  tokenizer = ByteTokenizer()
  outputs = {}
  for name, spec in [("plain", None), ("mtp k=4", SpecConfig(num_draft=4, threshold=0.0))]:
    engine = Engine(config, params, runtime=make_runtime(config, attention="sparse"), num_pages=64,
                    page_size=16, max_seq_len=512, mtp_cache=spec is not None)
    start = time.perf_counter()
    st = engine.run_round([engine.open_session()], [prompt], _NEW_TOKENS.value, ignore_eos=True, spec=spec)[0]
    outputs[name] = st.output
    accept = f", {st.acceptance_length:.2f} tokens per verify step" if spec else ""
    print(f"\n{name}: {len(st.output)} tokens in {time.perf_counter() - start:.2f} s (CPU, compile included){accept}")
  print("\nprompt (end):", repr(tokenizer.decode(prompt[-160:])))
  print("continuation:", repr(tokenizer.decode(outputs["plain"])))
  full = np.asarray([prompt + outputs["plain"]], np.int32)
  logits = np.asarray(glmjax.forward(config, params, full))
  agree = np.mean(np.argmax(logits[0, len(prompt) - 1:-1], -1) == np.asarray(outputs["plain"]))
  print(f"cached decode vs reference forward: {agree:.0%} of greedy tokens agree; "
        f"MTP output identical: {outputs['mtp k=4'] == outputs['plain']}")
  if outputs["mtp k=4"] != outputs["plain"]:
    raise SystemExit("speculative decoding changed the greedy tokens")


if __name__ == "__main__":
  app.run(main)
