"""transformers' GlmMoeDsaForCausalLM as glmjax's decode peer (issue 8): same weights, same prompt,
batch 1, greedy.

  PYTHONPATH=$PWD python3 -m experiments.hf_peer --checkpoint=checkpoints/mini --prompt_tokens=256 \
      --new_tokens=128 --dtype=bfloat16,float32 --glmjax=plain,full --output=/tmp/hf_peer.json

Needs torch and transformers (the GPU image has them; the project's pins do not): both sides load
the one HF directory, transformers through `from_pretrained` (which leaves out the MTP layer),
glmjax through `load_pretrained`. Per dtype:

- peer: `generate(do_sample=False, max_new_tokens=N)` with EOS ignored, on its default cache
  (`--peer_cache=static`: a StaticCache, with which transformers torch.compiles the decode step on
  CUDA). After a warm-up, `--repeats` timed calls; a stopping criterion stamps each token as it
  is ready (after a device sync), so the decode time is the first token's stamp to the last's.
- glmjax, per `--glmjax` variant: a fresh Engine decodes the prompt once to compile, then
  `--repeats` fresh engines are timed (the engine times its on-device decode loop alone).
  plain: the default Runtime (dense attention over the indexer's top-k), single-token steps;
  sparse: gathered DSA attention and the config's IndexShare; full: sparse + MTP speculative
  decoding (`--num_draft`), which is exact under greedy verification. KV pages are fp32 for a
  float32 plain run, else bf16 (the gathered attention reads only bf16 or fp8 pages).
- teacher-forced check: both models' no-cache forward pass on the prompt + the peer's tokens.

Both sides count decode tokens/s the same way: N - 1 tokens (the first comes from the prefill)
over the decode time. "Identical" means the N generated ids are equal position by position, the
first (from the prefill logits) included; `first_mismatch` is the index of the first difference.
Greedy is the argmax of the logits, ties to the lowest id on both sides. In float32 glmjax matches
transformers' logits to ~1e-6 (tests/test_model_fixture.py), so tokens should be identical unless
two logits, or the indexer scores deciding a top-k selection, (nearly) tie: `margin` at the first
mismatch is the peer's logit of its token minus its logit of glmjax's, a near-tie when small. In
bfloat16 the implementations round differently (transformers keeps the residual stream in bf16,
glmjax in fp32), so bf16 tokens may part after a near-tie. float32 runs use JAX's "highest"
matmul precision (TF32 off, as in torch's default).
"""

import json
import os
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import glmjax
from experiments import write_json
from glmjax.api import params_dtype
from glmjax.config import ModelConfig
from glmjax.data import load_corpus
from glmjax.engine.engine import Engine, RoundStats
from glmjax.engine.speculative import SpecConfig
from glmjax.runtime import Runtime, make_runtime

DTYPES = ("bfloat16", "float32")
VARIANTS = ("plain", "sparse", "full")
PAGE_SIZE = 16

_CHECKPOINT = flags.DEFINE_string("checkpoint", "checkpoints/mini", "HF checkpoint directory (config.json, weights)")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 256, "prompt length")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "tokens generated (the first from the prefill)")
_TEXT = flags.DEFINE_enum("text", "auto", ["auto", "random", "validation"],
                          "prompt: random ids, or held-out stdlib text (glmjax.data); auto = text when the "
                          "checkpoint has a tokenizer.json")
_DTYPE = flags.DEFINE_list("dtype", list(DTYPES), f"params and compute dtypes to run, of {DTYPES}")
_DEVICE = flags.DEFINE_string("device", "", "torch device of the peer; empty: cuda when available, else cpu")
_GLMJAX = flags.DEFINE_list("glmjax", ["plain", "full"], f"glmjax paths to compare, of {VARIANTS}")
_PEER_CACHE = flags.DEFINE_enum("peer_cache", "dynamic", ["dynamic", "static"],
                                "the peer's KV cache (static: torch.compile of the decode step on CUDA)")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "MTP draft tokens per step of the full variant")
_DRAFT_THRESHOLD = flags.DEFINE_float("draft_threshold", 0.0, "stop drafting below this draft probability "
                                       "(full; 0: always k drafts, as the mini model's MTP test measures)")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per side (median)")
_SEED = flags.DEFINE_integer("seed", 0, "prompt seed")
_OUTPUT = flags.DEFINE_string("output", "", "write the JSON report here")


def decode_tokens_per_s(token_times: Sequence[float]) -> float:
  """Decode rate from the times at which each generated token was ready: the first comes from the
  prefill, so len - 1 decode steps lie between the first time and the last."""
  if len(token_times) < 2:
    raise ValueError(f"need the times of >= 2 tokens to time a decode step, got {len(token_times)}")
  if token_times[-1] <= token_times[0]:
    raise ValueError(f"token times must increase, got first {token_times[0]} and last {token_times[-1]}")
  return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def first_mismatch(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
  """Index of the first position where the two token lists differ (the shorter one's length when
  one is a prefix of the other), None when they are identical."""
  for i, (a, b) in enumerate(zip(reference, tokens)):
    if a != b:
      return i
  return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def make_prompt(config: ModelConfig, checkpoint: str, n: int, text: str, seed: int) -> list[int]:
  """n prompt ids: held-out text as experiments/replay.py draws it, or random ids."""
  rng = np.random.default_rng(seed)
  if text == "validation" or (text == "auto" and os.path.exists(os.path.join(checkpoint, "tokenizer.json"))):
    return load_corpus().sample_validation_text(rng, n)
  return rng.integers(2, config.vocab_size, n).tolist()


def variant_setup(config: ModelConfig, variant: str) -> tuple[Runtime, SpecConfig | None]:
  """plain: the default Runtime, no speculation; sparse and full: gathered DSA attention with the
  config's IndexShare, full also drafting with the MTP layer."""
  if variant == "plain":
    return Runtime(), None
  spec = SpecConfig(num_draft=_NUM_DRAFT.value, threshold=_DRAFT_THRESHOLD.value) if variant == "full" else None
  return make_runtime(config, attention="sparse"), spec


def load_peer(checkpoint: str, config: ModelConfig, dtype: str, device: str):
  """transformers' model on `device`; every tensor of the checkpoint but the MTP layer's loaded."""
  import torch  # the peer's packages are imported here only: the project's pins do not include them
  from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
  from transformers.utils import logging
  logging.set_verbosity_error()   # the load report lists every MTP tensor as unexpected
  logging.disable_progress_bar()
  with open(os.path.join(checkpoint, "config.json")) as f:
    hf = json.load(f)
  # Every layer is DSA, but the name of that layer type differs across transformers versions
  # (5.23 writes "indexed_attention", 5.17 accepts only "deepseek_sparse_attention"): let the
  # installed one derive it.
  hf.pop("layer_types", None)
  model, info = GlmMoeDsaForCausalLM.from_pretrained(
      checkpoint, config=GlmMoeDsaConfig(**hf), dtype=getattr(torch, dtype), output_loading_info=True)
  mtp = f"model.layers.{config.num_hidden_layers}."
  stray = sorted(k for k in info["unexpected_keys"] if not k.startswith(mtp))
  if info["missing_keys"] or info["mismatched_keys"] or stray:
    raise ValueError(f"{checkpoint}: transformers found missing {sorted(info['missing_keys'])}, mis-shaped "
                     f"{sorted(info['mismatched_keys'])} and unexpected non-MTP {stray} tensors")
  return model.to(device).eval()


def time_peer(model, prompt: list[int], new_tokens: int, cache: str, repeats: int) -> dict:
  """Greedy generate at batch 1, EOS ignored: decode tokens/s and the generated ids. A stopping
  criterion (called once per token, after generate's own per-step host sync) stamps each token."""
  import torch
  from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList
  device = model.device
  ids = torch.tensor([prompt], dtype=torch.long, device=device)
  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

  class Stamp(StoppingCriteria):
    def __init__(self):
      self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
      sync()
      self.times.append(time.perf_counter())
      return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

  def generate() -> dict:
    stamp = Stamp()
    kw = dict(past_key_values=StaticCache(config=model.config, max_cache_len=len(prompt) + new_tokens)
              ) if cache == "static" else {}
    sync()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, stopping_criteria=StoppingCriteriaList([stamp]), **kw)
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != new_tokens or len(stamp.times) != new_tokens:
      raise RuntimeError(f"transformers generated {len(tokens)} tokens and stamped {len(stamp.times)}, "
                         f"asked for {new_tokens}")
    return dict(rate=decode_tokens_per_s(stamp.times), ttft=stamp.times[0] - start, tokens=tokens)

  generate()                          # warm-up (with a static cache on CUDA: compiles the decode step)
  runs = [generate() for _ in range(repeats)]
  tokens = runs[0]["tokens"]
  return dict(decode_tokens_per_s=statistics.median(r["rate"] for r in runs),
              ttft_s=statistics.median(r["ttft"] for r in runs),
              deterministic=all(r["tokens"] == tokens for r in runs), tokens=tokens,
              attn_implementation=model.config._attn_implementation,
              experts_implementation=model.config._experts_implementation)


def peer_logits(model, ids: list[int]) -> np.ndarray:
  """The peer's no-cache forward pass: float32 [S, V]."""
  import torch
  with torch.no_grad():
    return model(torch.tensor([ids], device=model.device), use_cache=False).logits[0].float().cpu().numpy()


def time_glmjax(config: ModelConfig, params, prompt: list[int], new_tokens: int, variant: str,
                repeats: int) -> dict:
  """One compile run, then `repeats` timed rounds, each on a fresh Engine (nothing cached).
  KV pages in the params' precision, but the gathered (sparse) attention reads only bf16 pages."""
  runtime, spec = variant_setup(config, variant)
  fp32 = params_dtype(params) == jnp.float32 and runtime.attention == "dense"
  kv_dtype = "fp32" if fp32 else "bf16"
  pages = -(-(len(prompt) + new_tokens + (spec.num_draft if spec else 0)) // PAGE_SIZE)

  def run() -> RoundStats:
    engine = Engine(config, params, runtime=runtime, num_pages=pages + 1, page_size=PAGE_SIZE,
                    max_seq_len=pages * PAGE_SIZE, kv_dtype=kv_dtype, mtp_cache=spec is not None)
    return engine.run_round([engine.open_session()], [prompt], new_tokens, ignore_eos=True, spec=spec)[0]

  run()
  runs = [run() for _ in range(repeats)]
  tokens = runs[0].output
  return dict(variant=variant, kv_dtype=kv_dtype,
              decode_tokens_per_s=statistics.median(r.decode_tokens_per_s for r in runs),
              ttft_s=statistics.median(r.ttft_s for r in runs),
              acceptance_length=runs[0].acceptance_length if spec else None,
              deterministic=all(r.output == tokens for r in runs), tokens=tokens)


def compare(peer: dict, ours: dict, peer_seq_logits: np.ndarray, prompt_len: int) -> dict:
  """Ratio, identity and, at the first mismatch, the peer's logit margin (its token over ours)."""
  i = first_mismatch(peer["tokens"], ours["tokens"])
  margin = None
  if i is not None and i < min(len(peer["tokens"]), len(ours["tokens"])):
    row = peer_seq_logits[prompt_len - 1 + i]   # both sides share the prefix up to i
    margin = float(row[peer["tokens"][i]] - row[ours["tokens"][i]])
  return dict(speedup=ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"], identical=i is None,
              first_mismatch=i, margin=margin)


def run_dtype(config: ModelConfig, prompt: list[int], dtype: str, device: str) -> dict:
  """The peer, then each glmjax variant, in one dtype; the peer is freed before glmjax runs."""
  import torch
  model = load_peer(_CHECKPOINT.value, config, dtype, device)
  peer = time_peer(model, prompt, _NEW_TOKENS.value, _PEER_CACHE.value, _REPEATS.value)
  sequence = prompt + peer["tokens"]
  theirs = peer_logits(model, sequence)
  del model
  if device.startswith("cuda"):
    torch.cuda.empty_cache()
  _, params = glmjax.load_pretrained(_CHECKPOINT.value, dtype=jnp.dtype(dtype))
  with jax.default_matmul_precision("highest" if dtype == "float32" else None):
    ours = np.asarray(glmjax.forward(config, params, np.asarray([sequence])))[0]
    runs = [time_glmjax(config, params, prompt, _NEW_TOKENS.value, v, _REPEATS.value)
            for v in _GLMJAX.value]
  runs = [dict(r, **compare(peer, r, theirs, len(prompt))) for r in runs]
  logits = dict(rel_err=float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)),
                max_abs_err=float(np.max(np.abs(ours - theirs))),
                argmax_agreement=float(np.mean(ours.argmax(-1) == theirs.argmax(-1))))
  return dict(dtype=dtype, peer=peer, teacher_forced_logits=logits, glmjax=runs)


def format_rows(results: list[dict]) -> str:
  lines = [f"{'dtype':<9} {'side':<14} {'decode tok/s':>12} {'x peer':>7} {'identical':>9} {'mismatch at':>11} "
           f"{'margin':>8} {'accept':>6}"]
  for res in results:
    lines.append(f"{res['dtype']:<9} {'transformers':<14} {res['peer']['decode_tokens_per_s']:>12.1f} {1.0:>7.2f}")
    for r in res["glmjax"]:
      at = "" if r["first_mismatch"] is None else str(r["first_mismatch"])
      margin = "" if r["margin"] is None else f"{r['margin']:.3g}"
      accept = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
      lines.append(f"{res['dtype']:<9} {'glmjax ' + r['variant']:<14} {r['decode_tokens_per_s']:>12.1f} "
                   f"{r['speedup']:>7.2f} {'yes' if r['identical'] else 'no':>9} {at:>11} {margin:>8} {accept:>6}")
    lg = res["teacher_forced_logits"]
    lines.append(f"{'':<9} teacher-forced logits: rel err {lg['rel_err']:.2e}, max abs {lg['max_abs_err']:.2e}, "
                 f"argmax agreement {lg['argmax_agreement']:.2%}")
  return "\n".join(lines)


def main(_):
  import torch
  import transformers
  for name, values, allowed in (("dtype", _DTYPE.value, DTYPES), ("glmjax", _GLMJAX.value, VARIANTS)):
    if not values or set(values) - set(allowed):
      raise ValueError(f"--{name} must be a non-empty list of {allowed}, got {values}")
  device = _DEVICE.value or ("cuda" if torch.cuda.is_available() else "cpu")
  config = ModelConfig.from_hf(_CHECKPOINT.value)
  prompt = make_prompt(config, _CHECKPOINT.value, _PROMPT_TOKENS.value, _TEXT.value, _SEED.value)
  results = [run_dtype(config, prompt, dtype, device) for dtype in _DTYPE.value]
  print(f"\n{len(prompt)} prompt tokens, {_NEW_TOKENS.value} new; peer on {device} (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {_PEER_CACHE.value} cache), glmjax on "
        f"{jax.devices()[0].device_kind} (jax {jax.__version__})\n")
  print(format_rows(results))
  if _OUTPUT.value:
    report = dict(flags={f: flags.FLAGS[f].value for f in (
                      "checkpoint", "prompt_tokens", "new_tokens", "text", "dtype", "glmjax", "peer_cache",
                      "num_draft", "draft_threshold", "repeats", "seed")},
                  devices=dict(peer=device, glmjax=jax.devices()[0].device_kind),
                  versions=dict(torch=torch.__version__, transformers=transformers.__version__, jax=jax.__version__),
                  prompt=prompt, results=results)
    write_json(_OUTPUT.value, report)


if __name__ == "__main__":
  app.run(main)
