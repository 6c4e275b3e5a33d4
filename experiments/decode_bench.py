"""Decode speed against context length, per attention implementation and KV storage.

  python -m experiments.decode_bench --config=mini --contexts=8192,32768,81920 --attention=dense,sparse

For each case (`experiments.study.measure` with warmup) a first engine compiles every program
(prefill chunk, decode loop); a second, fresh engine then prefills a random prompt of the context
length cold (timed: time to first token), and a next round adds one token to it, so its time to
first token is served from the prefix cache, and decodes `--new_tokens` tokens in one on-device
loop (timed). Prints decode tokens/s, step time, both TTFTs, KV bytes per token (footprint) and
writes JSON.
"""


import jax
from absl import app, flags
from tqdm import tqdm

from experiments import study, write_json
from glmjax import footprint
from glmjax.bench import maybe_profile

_CONFIG = flags.DEFINE_string("config", "mini", "model preset")
_CONTEXTS = flags.DEFINE_list("contexts", ["8192", "32768", "81920"], "context lengths")
_ATTENTION = flags.DEFINE_list("attention", ["dense", "sparse"], "attention implementations")
_KV = flags.DEFINE_list("kv_dtype", ["bf16", "fp8"], "KV storage dtypes")
_NEW = flags.DEFINE_integer("new_tokens", 128, "decode tokens timed per case")
_PAGE = flags.DEFINE_integer("page_size", 64, "tokens per page")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 1024, "prefill chunk")
_PROFILE = flags.DEFINE_string("profile", "", "write a jax.profiler trace (TensorBoard/XProf) here")
_OUTPUT = flags.DEFINE_string("output", "", "JSON output path")


def measure(model: study.Model, context: int, attention: str, kv_dtype: str) -> dict:
  switches = study.Switches(prefix_cache=True, attention=attention, kv_dtype=kv_dtype, device_loop=True)
  workload = study.Workload(context=context, new_tokens=_NEW.value, append=1, page_size=_PAGE.value,
                            prefill_chunk=_CHUNK.value, seed=context)
  m = study.measure(model, switches, workload, warmup=True)
  return dict(context=context, attention=attention, kv_dtype=kv_dtype,
              cold_prefill_ttft_s=m["cold_ttft_s"], cached_ttft_s=m["ttft_s"],
              decode_tokens=m["decode_tokens"], decode_tokens_per_s=m["decode_tokens_per_s"],
              step_ms=1e3 * m["decode_s"] / max(m["decode_tokens"] + 1, 1),
              kv_bytes_per_token=footprint.kv_bytes_per_token(model.config, kv_dtype if kv_dtype != "fp32" else "bf16"))


def main(_):
  model = study.load_model(_CONFIG.value, "", dtype="bfloat16")
  cases = [(int(c), a, k) for c in _CONTEXTS.value for a in _ATTENTION.value for k in _KV.value]
  rows = []
  for case in tqdm(cases, desc="cases"):
    with maybe_profile(_PROFILE.value and f"{_PROFILE.value}/{'_'.join(map(str, case))}"):
      rows.append(measure(model, *case))
    r = rows[-1]
    print(f"ctx {r['context']:>7} {r['attention']:>6} {r['kv_dtype']:>4}: {r['decode_tokens_per_s']:8.1f} tok/s, "
          f"{r['step_ms']:.2f} ms/step, cold TTFT {r['cold_prefill_ttft_s'] * 1e3:.0f} ms, "
          f"cached TTFT {r['cached_ttft_s'] * 1e3:.1f} ms", flush=True)
  write_json(_OUTPUT.value, dict(config=_CONFIG.value, device=str(jax.devices()[0].device_kind), rows=rows))


if __name__ == "__main__":
  app.run(main)
