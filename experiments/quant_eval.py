"""What each weight quantization policy costs in accuracy, against the checkpoint as stored.

  python -m experiments.quant_eval --checkpoint=checkpoints/mini --policies=none,fp8,nvfp4_experts,nvfp4 \
      --tokens=32 --output=/tmp/quant_eval.json

Per policy (glmjax.quant.quantize_params on the loaded params; "none", the checkpoint as stored,
is the reference and always runs first):
  loss, ppl         next-token cross-entropy (nats) over validation windows, and exp(loss)
  ppl_change        ppl / ppl(none) - 1
  agreement         generated greedy tokens equal to the reference's, position by position, over
                    --tokens tokens per prompt (free running: after a first flip the texts differ)
  agreement_forced  the policy's argmax equals the reference's next token at every position of
                    the reference continuation (teacher forced: per-step agreement, no compounding)
  weight_bytes      bytes of every param array (packed weights and scales included), and the ratio
Validation text is the held-out corpus of glmjax.data (byte-level, the mini model's) when that
module exists, else random tokens (with a warning: then only the agreement columns mean much).
Without the checkpoint directory the model is a random --config (with a warning).
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import glmjax
from configs import get_model_config
from experiments import kernel_flags, write_json
from glmjax.config import ModelConfig
from glmjax.model import init_params
from glmjax.quant import POLICIES, quantize_params
from glmjax.runtime import ATTENTION_IMPLS, Runtime, make_runtime

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "checkpoints/mini", "HF checkpoint directory; a random --config if absent")
flags.DEFINE_string("config", "mini", "model preset (configs/) when there is no checkpoint")
flags.DEFINE_list("policies", ["none", "fp8", "nvfp4_experts", "nvfp4"], f"weight policies, of {POLICIES}")
flags.DEFINE_integer("tokens", 32, "greedy tokens generated per prompt")
flags.DEFINE_integer("prompts", 4, "validation prompts generated from")
flags.DEFINE_integer("prompt_len", 64, "tokens per prompt")
flags.DEFINE_integer("windows", 16, "validation windows the loss averages over")
flags.DEFINE_integer("seq_len", 256, "tokens per validation window")
flags.DEFINE_enum("attention", "dense", list(ATTENTION_IMPLS), "DSA attention implementation")
kernel_flags.define_matmul("xla")
flags.DEFINE_string("dtype", "bfloat16", "params and compute dtype of the plain weights")
flags.DEFINE_integer("seed", 0, "random init, prompt choice and random-token fallback")
flags.DEFINE_string("output", "", "write the JSON report here")


def load_model(checkpoint: str, config_name: str, *, dtype, seed: int) -> tuple[ModelConfig, dict, str]:
  """(config, params, where they came from): the checkpoint if it exists, else random params."""
  if checkpoint and os.path.isdir(checkpoint):
    config, params = glmjax.load_pretrained(checkpoint, dtype=dtype)
    return config, params, checkpoint
  warnings.warn(f"no checkpoint at {checkpoint!r}: evaluating a random {config_name} model", stacklevel=2)
  config = get_model_config(config_name)
  return config, init_params(config, jax.random.key(seed), param_dtype=dtype), f"random {config_name}"


def validation_data(config: ModelConfig, *, windows: int, seq_len: int, prompts: int, prompt_len: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray, str]:
  """(windows int32 [n, seq_len + 1], prompts int32 [prompts, prompt_len], source)."""
  rng = np.random.default_rng(seed)
  try:
    from glmjax import data  # written alongside; absent in older trees
  except ImportError:
    data = None
  if data is not None:
    corpus = data.load_corpus()
    text = corpus.validation_windows(seq_len, windows)
    starts = np.stack([corpus.sample_validation_text(rng, prompt_len) for _ in range(prompts)])
    if max(text.max(), starts.max()) < config.vocab_size:
      return text.astype(np.int32), starts.astype(np.int32), "glmjax.data validation split"
    warnings.warn(f"the corpus' token ids exceed vocab_size={config.vocab_size}: using random tokens",
                  stacklevel=2)
  else:
    warnings.warn("glmjax.data is not available: using random tokens as validation text", stacklevel=2)
  return (rng.integers(0, config.vocab_size, (windows, seq_len + 1), dtype=np.int32),
          rng.integers(0, config.vocab_size, (prompts, prompt_len), dtype=np.int32), "random tokens")


def mean_nll(config: ModelConfig, params, windows: np.ndarray, runtime: Runtime) -> float:
  """Mean next-token cross-entropy (nats) of windows [n, L + 1]."""
  logits = glmjax.forward(config, params, windows[:, :-1], runtime=runtime)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return float(-jnp.mean(jnp.take_along_axis(logp, jnp.asarray(windows[:, 1:, None]), axis=-1)))


def weight_bytes(params) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def evaluate(config: ModelConfig, params, policies: list[str], windows: np.ndarray, prompts: np.ndarray,
             new_tokens: int, runtime: Runtime) -> list[dict]:
  """One row per policy, "none" (the reference) first; see the module docstring."""
  bad = [p for p in policies if p not in POLICIES]
  if bad:
    raise ValueError(f"unknown policies {bad}; known: {POLICIES}")
  rows, reference = [], None
  for policy in ["none"] + [p for p in policies if p != "none"]:
    quantized = runtime.arrange(quantize_params(params, policy))  # moved once, not per call
    loss = mean_nll(config, quantized, windows, runtime)
    generated = glmjax.generate(config, quantized, prompts, new_tokens, ignore_eos=True, runtime=runtime)
    if reference is None:
      reference = dict(loss=loss, tokens=generated, bytes=weight_bytes(quantized))
    # The policy's argmax along the reference continuation (its last token predicts nothing).
    forced = np.asarray(jnp.argmax(glmjax.forward(config, quantized, reference["tokens"][:, :-1], runtime=runtime),
                                   axis=-1))[:, prompts.shape[1] - 1:]
    continuation = reference["tokens"][:, prompts.shape[1]:]
    rows.append(dict(policy=policy, loss=loss, ppl=float(np.exp(loss)),
                     ppl_change=float(np.exp(loss - reference["loss"]) - 1),
                     agreement=float(np.mean(generated[:, prompts.shape[1]:] == continuation)),
                     agreement_forced=float(np.mean(forced == continuation)),
                     weight_bytes=weight_bytes(quantized),
                     bytes_ratio=weight_bytes(quantized) / reference["bytes"]))
  return rows


def format_table(rows: list[dict]) -> str:
  header = f"{'policy':<14}{'loss':>8}{'ppl':>10}{'ppl chg':>9}{'agree':>8}{'forced':>8}{'MB':>9}{'ratio':>7}"
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(f"{r['policy']:<14}{r['loss']:>8.4f}{r['ppl']:>10.3f}{r['ppl_change']:>+9.2%}{r['agreement']:>8.1%}"
                 f"{r['agreement_forced']:>8.1%}{r['weight_bytes'] / 1e6:>9.2f}{r['bytes_ratio']:>7.3f}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  dtype = jnp.dtype(FLAGS.dtype)
  config, params, source = load_model(FLAGS.checkpoint, FLAGS.config, dtype=dtype, seed=FLAGS.seed)
  windows, prompts, text = validation_data(config, windows=FLAGS.windows, seq_len=FLAGS.seq_len,
                                           prompts=FLAGS.prompts, prompt_len=FLAGS.prompt_len, seed=FLAGS.seed)
  runtime = make_runtime(config, attention=FLAGS.attention, matmul=FLAGS.matmul)
  rows = evaluate(config, params, FLAGS.policies, windows, prompts, FLAGS.tokens, runtime)
  print(f"model: {source}; text: {text}; {len(windows)} windows x {FLAGS.seq_len} tokens; "
        f"{len(prompts)} prompts x {FLAGS.prompt_len} + {FLAGS.tokens} generated; matmul={FLAGS.matmul}")
  print(format_table(rows))
  if FLAGS.output:
    report = dict(model=source, text=text, flags={k: FLAGS[k].value for k in (
        "policies", "tokens", "prompts", "prompt_len", "windows", "seq_len", "attention", "matmul", "dtype", "seed")},
        rows=rows)
    write_json(FLAGS.output, report)


if __name__ == "__main__":
  app.run(main)
