"""Decode speed against context length, per attention implementation and KV storage.

  python -m experiments.decode_bench --config=mini --contexts=8192,32768,81920 --attention=dense,sparse

For each case a first engine compiles every program (prefill chunk, decode loop); a second,
fresh engine then prefills a random prompt of the context length cold (timed: time to first
token), and a next round adds one token to it, so its time to first token is served from the
prefix cache, and decodes `--new_tokens` tokens in one on-device loop (timed). Prints decode
tokens/s, step time, both TTFTs, KV bytes per token (footprint) and writes JSON.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from configs import get_model_config
from glmjax import footprint
from glmjax.bench import maybe_profile
from glmjax.engine.engine import Engine
from glmjax.model import init_params
from glmjax.runtime import make_runtime

_CONFIG = flags.DEFINE_string("config", "mini", "model preset")
_CONTEXTS = flags.DEFINE_list("contexts", ["8192", "32768", "81920"], "context lengths")
_ATTENTION = flags.DEFINE_list("attention", ["dense", "sparse"], "attention implementations")
_KV = flags.DEFINE_list("kv_dtype", ["bf16", "fp8"], "KV storage dtypes")
_NEW = flags.DEFINE_integer("new_tokens", 128, "decode tokens timed per case")
_PAGE = flags.DEFINE_integer("page_size", 64, "tokens per page")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 1024, "prefill chunk")
_PROFILE = flags.DEFINE_string("profile", "", "write a jax.profiler trace (TensorBoard/XProf) here")
_OUTPUT = flags.DEFINE_string("output", "", "JSON output path")


def measure(config, params, context: int, attention: str, kv_dtype: str) -> dict:
  pages = -(-(context + 2 * _NEW.value) // _PAGE.value) + 2
  rng = np.random.default_rng(context)
  def rounds():
    engine = Engine(config, params, runtime=make_runtime(config, attention=attention), num_pages=pages + 1,
                    page_size=_PAGE.value, max_seq_len=pages * _PAGE.value, kv_dtype=kv_dtype,
                    prefill_chunk=_CHUNK.value)
    session = engine.open_session()
    prompt = rng.integers(2, config.vocab_size, context).tolist()
    first = engine.run_round([session], [prompt], _NEW.value, ignore_eos=True)[0]
    return first, engine.run_round([session], [[5]], _NEW.value, ignore_eos=True)[0]
  rounds()                      # compiles every program of this case
  first, second = rounds()      # timed
  return dict(context=context, attention=attention, kv_dtype=kv_dtype,
              cold_prefill_ttft_s=first.ttft_s, cached_ttft_s=second.ttft_s,
              decode_tokens=second.decode_tokens, decode_tokens_per_s=second.decode_tokens_per_s,
              step_ms=1e3 * second.decode_s / max(second.decode_tokens + 1, 1),
              kv_bytes_per_token=footprint.kv_bytes_per_token(config, kv_dtype if kv_dtype != "fp32" else "bf16"))


def main(_):
  config = get_model_config(_CONFIG.value)
  params = init_params(config, jax.random.key(0), param_dtype=jnp.bfloat16)
  cases = [(int(c), a, k) for c in _CONTEXTS.value for a in _ATTENTION.value for k in _KV.value]
  rows = []
  for case in tqdm(cases, desc="cases"):
    with maybe_profile(_PROFILE.value and f"{_PROFILE.value}/{'_'.join(map(str, case))}"):
      rows.append(measure(config, params, *case))
    r = rows[-1]
    print(f"ctx {r['context']:>7} {r['attention']:>6} {r['kv_dtype']:>4}: {r['decode_tokens_per_s']:8.1f} tok/s, "
          f"{r['step_ms']:.2f} ms/step, cold TTFT {r['cold_prefill_ttft_s'] * 1e3:.0f} ms, "
          f"cached TTFT {r['cached_ttft_s'] * 1e3:.1f} ms", flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump(dict(config=_CONFIG.value, device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
