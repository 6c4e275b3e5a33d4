"""Train the mini model on the Python standard library; write its HF checkpoint and model card.

  python -m experiments.train_mini --workdir=/tmp/mini_work --output_dir=checkpoints/mini

The defaults are sized for ONE H200 in under 8 minutes, compilation included: 3000 steps of
64 x 512 tokens (98M tokens, about 3 passes over the stdlib), AdamW at 2e-3 after 200 warmup
steps, cosine decay to 2e-4, 3 MTP depths weighted 0.3 in all. --time_budget_s (default 420 s)
is the safety net: past it the run stops cleanly, checkpoints and still writes its outputs;
running again with the same --workdir continues from the last checkpoint.

output_dir receives config.json and model.safetensors (bf16, glmjax.save_pretrained),
tokenizer.json, loss_curve.png and README.md, the model card (command, seed, steps, wall time,
device, final train and validation loss, MTP depth accuracies).

The flags are defined only when this runs as a program, so that tests can import the card and
plot helpers next to other experiments' flags.
"""

import dataclasses
import datetime
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

import glmjax
from configs import get_model_config
from glmjax import footprint, training
from glmjax.checkpoint import SINGLE_FILE
from glmjax.config import ModelConfig
from glmjax.data import Corpus, load_corpus
from glmjax.tokenizer import ByteTokenizer

FLAGS = flags.FLAGS
TOKENIZER_FILE = "tokenizer.json"
CARD_FILE = "README.md"
CURVE_FILE = "loss_curve.png"


def define_flags() -> None:
  d = training.TrainConfig()
  flags.DEFINE_string("config", "mini", "model config preset (configs/)")
  flags.DEFINE_integer("steps", d.steps, "optimizer steps (the cosine schedule's length)")
  flags.DEFINE_integer("batch_size", d.batch_size, "windows per step")
  flags.DEFINE_integer("seq_len", d.seq_len, "tokens per window")
  flags.DEFINE_float("lr", d.lr, "peak learning rate")
  flags.DEFINE_integer("warmup", d.warmup, "linear warmup steps")
  flags.DEFINE_float("weight_decay", d.weight_decay, "AdamW weight decay (matrices only)")
  flags.DEFINE_integer("mtp_depths", d.mtp_depths, "MTP prediction depths (one shared MTP layer)")
  flags.DEFINE_float("mtp_weight", sum(d.mtp_weights), "total MTP loss weight, split evenly over the depths")
  flags.DEFINE_list("mtp_depth_weights", [], "per-depth MTP loss weights (overrides --mtp_weight)")
  flags.DEFINE_float("indexer_weight", d.indexer_weight, "weight of the DSA indexer's KL loss")
  flags.DEFINE_float("balance_rate", d.balance_rate, "router bias step of the loss-free expert balancing")
  flags.DEFINE_enum("dtype", d.compute_dtype, list(training.DTYPES), "compute dtype (master weights fp32)")
  flags.DEFINE_integer("seed", d.seed, "PRNG seed: init and batch order")
  flags.DEFINE_string("corpus_root", "", "directory of *.py files (default: this Python's stdlib)")
  flags.DEFINE_float("val_fraction", 0.02, "share of files held out for validation")
  flags.DEFINE_string("workdir", "", "orbax checkpoints; an existing one is resumed")
  flags.DEFINE_integer("checkpoint_every", 1000, "steps between checkpoints")
  flags.DEFINE_string("output_dir", "", "where the HF checkpoint, tokenizer, card and curve go")
  flags.DEFINE_integer("eval_every", 500, "steps between validation evaluations")
  flags.DEFINE_integer("eval_windows", 512, "validation windows per evaluation (spread over the split)")
  flags.DEFINE_integer("log_every", 50, "steps per logged train-metric mean")
  flags.DEFINE_float("time_budget_s", 420.0, "stop cleanly once this much wall time has passed")


def train_config_from_flags() -> training.TrainConfig:
  if FLAGS.mtp_depth_weights:
    weights = tuple(float(w) for w in FLAGS.mtp_depth_weights)
    if len(weights) != FLAGS.mtp_depths:
      raise ValueError(f"--mtp_depth_weights has {len(weights)} entries for --mtp_depths={FLAGS.mtp_depths}")
  else:
    weights = training.split_mtp_weight(FLAGS.mtp_weight, FLAGS.mtp_depths) if FLAGS.mtp_depths else ()
  return training.TrainConfig(steps=FLAGS.steps, batch_size=FLAGS.batch_size, seq_len=FLAGS.seq_len, lr=FLAGS.lr,
                              warmup=FLAGS.warmup, weight_decay=FLAGS.weight_decay, mtp_weights=weights,
                              indexer_weight=FLAGS.indexer_weight, balance_rate=FLAGS.balance_rate,
                              compute_dtype=FLAGS.dtype, seed=FLAGS.seed)


def device_name() -> str:
  dev = jax.devices()[0]
  return f"{jax.device_count()} x {dev.device_kind} ({dev.platform})"


def plot_history(history: dict, path: str) -> None:
  """Train (main head and each MTP depth) and validation loss against the step."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  train = history["train"]
  steps = [h["step"] for h in train]
  ax.plot(steps, [h["main_loss"] for h in train], label="train, main head", lw=1.5)
  for d in range(len(train[0]["mtp_loss"]) if train else 0):
    ax.plot(steps, [h["mtp_loss"][d] for h in train], label=f"train, MTP depth {d + 1}", lw=0.8, alpha=0.7)
  if history["eval"]:
    ax.plot([e["step"] for e in history["eval"]], [e["loss"] for e in history["eval"]], "o-k",
            label="validation, main head")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / byte)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _fmt(values: list[float], pattern: str = "{:.3f}") -> str:
  return " / ".join(pattern.format(v) for v in values) or "n/a"


def model_card(facts: dict) -> str:
  """README.md of the checkpoint from the facts of `run_facts`."""
  tc, ev, tr, corpus = facts["train_config"], facts["final_eval"], facts["final_train"], facts["corpus"]
  depths = len(ev["mtp_accuracy"])
  stop = (f"stopped by the time budget at step {facts['steps_done']} of {tc['steps']}" if facts["stopped_early"]
          else f"all {tc['steps']} steps")
  mtp_rows = "\n".join(
      f"| {d + 1} | {ev['mtp_loss'][d]:.4f} | {ev['mtp_accuracy'][d]:.4f} | {ev['mtp_agreement'][d]:.4f} | "
      f"{tr['mtp_loss'][d]:.4f} |" for d in range(depths))
  return f"""# glmjax mini: a byte-level GLM-MoE-DSA trained on the Python standard library

A {facts['params']['total'] / 1e6:.2f}M-parameter GLM-5-architecture model (MLA + DSA indexer with
IndexShare, sigmoid-routed MoE, {facts['params']['mtp'] / 1e6:.2f}M more in one MTP layer), config
`{facts['config_name']}`, trained from scratch for {stop}. bf16 checkpoint: {facts['checkpoint_mb']:.2f} MB.

## Run

```
{facts['command']}
```

| | |
|---|---|
| seed | {tc['seed']} |
| steps | {facts['steps_done']} of {tc['steps']}{f" (resumed at step {facts['resumed_from']})" if facts['resumed_from'] else ""} |
| tokens seen | {facts['steps_done'] * tc['batch_size'] * tc['seq_len']:,} ({tc['batch_size']} x {tc['seq_len']} per step) |
| wall time | {facts['wall_time_s']:.0f} s in all, compilation included ({facts['run_wall_s']:.0f} s in this run) |
| device | {facts['device']} |
| throughput | {facts['steps_per_s']:.2f} steps/s, {facts['steps_per_s'] * tc['batch_size'] * tc['seq_len']:,.0f} tokens/s after the first log interval (evaluations included) |
| software | {facts['software']} |
| date (UTC) | {facts['date']} |
| optimizer | AdamW lr {tc['lr']:g} (warmup {tc['warmup']}, cosine to {tc['lr'] * tc['final_lr_fraction']:g}), betas ({tc['b1']}, {tc['b2']}), weight decay {tc['weight_decay']} on matrices, clip {tc['clip_norm']} |
| losses | main + MTP weights {_fmt(tc['mtp_weights'], '{:g}')} + indexer KL x {tc['indexer_weight']:g}; loss-free expert balancing, rate {tc['balance_rate']:g} |
| precision | {tc['compute_dtype']} compute, fp32 master weights and optimizer state |

## Results

| | train (last {facts['log_every']} steps) | validation |
|---|---|---|
| main-head loss (nats / byte) | {tr['main_loss']:.4f} | {ev['loss']:.4f} |
| bits per byte | {tr['main_loss'] / np.log(2):.4f} | {ev['bits_per_byte']:.4f} |
| top-1 accuracy | | {ev['accuracy']:.4f} |

Validation: {ev['tokens']:,} held-out tokens.

| MTP depth | val loss | val accuracy (draft == true token) | val agreement (draft == main greedy) | train loss |
|---|---|---|---|---|
{mtp_rows}

Depth d at position t predicts token t+d+1 from the main model's hidden state at t and the tokens
t+1..t+d fed through d chained passes of the MTP layer: it sees the same prefix as the main head
one position later, with up to d more layers, so on a model this small its loss can be below the
main head's (tests/test_training.py checks that no head sees its target).

Expected accepted length under greedy verification, teacher-forced estimate: {ev['accept_length']:.3f}
tokens per step (1 + the share of positions whose drafts 1..d all agree with the main model, summed
over d; drafts here condition on true tokens, so decoding measures its own).

DSA indexer: KL to the dense attention {ev['indexer_kl']:.4f} nats per query; its top-k holds
{ev['indexer_coverage']:.1%} of the dense attention mass (mean over indexers and queries).

![loss curve]({CURVE_FILE})

## Data

Every `*.py` file of the Python standard library at `{corpus['root']}` (site-packages excluded), one
document per file (bos + bytes + eos). Files are split by a SHA-256 of their relative path:
{corpus['train_files']} train files ({corpus['train_tokens']:,} tokens), {corpus['val_files']} validation
files ({corpus['val_tokens']:,} tokens, fraction {facts['val_fraction']}); corpus digest `{corpus['digest']}`.

## Tokenizer

Byte-level (`{TOKENIZER_FILE}`, `glmjax.tokenizer.ByteTokenizer`): ids 0-255 are bytes, bos
{facts['tokenizer']['bos']}, eos {facts['tokenizer']['eos']}, pad {facts['tokenizer']['pad']}.

## Use

```python
import glmjax
from glmjax.tokenizer import ByteTokenizer
config, params = glmjax.load_pretrained("checkpoints/{facts['config_name']}")
tok = ByteTokenizer.from_json(open("checkpoints/{facts['config_name']}/{TOKENIZER_FILE}").read())
out = glmjax.generate(config, params, [tok.encode("def main(", bos=True)], 64)
print(tok.decode(out[0]))
```
"""


def run_facts(config: ModelConfig, result: training.FitResult, tc: training.TrainConfig, corpus: Corpus,
              tokenizer: ByteTokenizer, *, command: str, config_name: str, run_wall_s: float, log_every: int,
              val_fraction: float) -> dict:
  """What the model card reports about a finished `fit`."""
  final_train, final_eval = result.history["train"][-1], result.history["eval"][-1]
  # Throughput between this run's first log (which includes compilation) and its last.
  run = [h for h in result.history["train"] if h["step"] > result.resumed_from]
  seconds = run[-1]["elapsed_s"] - run[0]["elapsed_s"] if len(run) > 1 else 0.0
  steps_per_s = (run[-1]["step"] - run[0]["step"]) / seconds if seconds > 0 else float("nan")
  return dict(
      command=command, config_name=config_name, train_config=dataclasses.asdict(tc), steps_done=final_eval["step"],
      stopped_early=result.stopped_early, resumed_from=result.resumed_from, wall_time_s=final_train["elapsed_s"],
      run_wall_s=run_wall_s, device=device_name(),
      software=f"jax {jax.__version__}, Python {platform.python_version()}",
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
      params=footprint.param_counts(config), final_train=final_train, final_eval=final_eval,
      log_every=log_every, corpus=corpus.describe(), val_fraction=val_fraction, tokenizer=tokenizer.special_tokens,
      steps_per_s=steps_per_s)


def write_outputs(output_dir: str, config: ModelConfig, tokenizer: ByteTokenizer, result: training.FitResult,
                  facts: dict) -> None:
  """bf16 HF checkpoint, tokenizer.json, loss curve and model card into output_dir."""
  glmjax.save_pretrained(config, training.cast_params(config, result.state["params"], jnp.bfloat16), output_dir)
  with open(os.path.join(output_dir, TOKENIZER_FILE), "w") as f:
    f.write(tokenizer.to_json())
  plot_history(result.history, os.path.join(output_dir, CURVE_FILE))
  facts = dict(facts, checkpoint_mb=os.path.getsize(os.path.join(output_dir, SINGLE_FILE)) / 1e6)
  with open(os.path.join(output_dir, CARD_FILE), "w") as f:
    f.write(model_card(facts))


def main(argv: list[str]) -> None:
  start = time.monotonic()
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint save at INFO
  tc = train_config_from_flags()
  tokenizer = ByteTokenizer()
  config = tokenizer.configure(get_model_config(FLAGS.config))
  corpus = load_corpus(FLAGS.corpus_root or None, val_fraction=FLAGS.val_fraction, tokenizer=tokenizer)
  params = footprint.param_counts(config)
  print(f"{FLAGS.config}: {params['total']:,} parameters + {params['mtp']:,} MTP; "
        f"bf16 checkpoint {footprint.checkpoint_bytes(config) / 1e6:.2f} MB; device {device_name()}")
  print(f"corpus: {corpus.describe()}")
  print(f"train config: {tc}")
  result = training.fit(config, tc, corpus, workdir=FLAGS.workdir or None, checkpoint_every=FLAGS.checkpoint_every,
                        eval_windows=corpus.validation_windows(tc.seq_len, FLAGS.eval_windows),
                        eval_every=FLAGS.eval_every, log_every=FLAGS.log_every, time_budget_s=FLAGS.time_budget_s,
                        start_time=start)
  final_train, final_eval = result.history["train"][-1], result.history["eval"][-1]
  print(f"step {final_eval['step']}: train loss {final_train['main_loss']:.4f}, validation {final_eval['loss']:.4f} "
        f"({final_eval['bits_per_byte']:.3f} bits/byte), MTP accuracy {_fmt(final_eval['mtp_accuracy'])}, "
        f"accept length {final_eval['accept_length']:.2f}, indexer coverage {final_eval['indexer_coverage']:.1%}")
  if not FLAGS.output_dir:
    return
  facts = run_facts(config, result, tc, corpus, tokenizer,
                    command="python -m experiments.train_mini " + " ".join(sys.argv[1:]),
                    config_name=FLAGS.config, run_wall_s=time.monotonic() - start, log_every=FLAGS.log_every,
                    val_fraction=FLAGS.val_fraction)
  write_outputs(FLAGS.output_dir, config, tokenizer, result, facts)
  print(f"wrote {FLAGS.output_dir}: {sorted(os.listdir(FLAGS.output_dir))}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
