"""Size, traffic and bandwidth-bound decode speed of a model config (accounting only, no device).

  python -m experiments.describe --config=glm5 [--json] [--context=80000] [--verify_tokens=5]

The step estimate is the main model's verification pass over `verify_tokens` tokens, reading
weights and KV cache once at `bandwidth`; tokens/s assumes every verified token is accepted (an
upper bound) and leaves out the MTP draft passes, whose bytes are listed separately.
"""

import json
from typing import Any

from absl import app, flags

from configs import get_model_config
from glmjax import footprint
from glmjax.config import ModelConfig

_CONFIG = flags.DEFINE_string("config", "glm5", "Model preset name in configs/.")
_JSON = flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
_CONTEXT = flags.DEFINE_integer("context", 80_000, "Cached tokens the decode step attends to.")
_VERIFY_TOKENS = flags.DEFINE_integer("verify_tokens", 5, "Tokens verified per decode step.")
_BANDWIDTH = flags.DEFINE_float("bandwidth", footprint.H200_BANDWIDTH, "Memory bandwidth, B/s.")


def describe(config: ModelConfig, *, context: int = 80_000, verify_tokens: int = 5,
             bandwidth: float = footprint.H200_BANDWIDTH) -> dict[str, Any]:
  """Parameter counts, bytes per decode step and bandwidth-bound step times of `config`."""
  step = {policy: {kv: footprint.decode_step(config, policy=policy, kv_dtype=kv, context=context,
                                             num_tokens=verify_tokens, bandwidth=bandwidth)
                   for kv in footprint.KV_DTYPES}
          for policy in footprint.POLICIES}
  return {
    "context": context,
    "verify_tokens": verify_tokens,
    "bandwidth": bandwidth,
    "params": footprint.param_counts(config),
    "active_params_per_token": footprint.active_params_per_token(config),
    "checkpoint_bytes": {p: footprint.checkpoint_bytes(config, p) for p in footprint.POLICIES},
    "weight_bytes_per_step": {p: step[p]["bf16"]["weight_bytes"] for p in footprint.POLICIES},
    "mtp_weight_bytes_per_pass": {
      p: footprint.weight_bytes_per_step(config, p, 1, mtp=True) for p in footprint.POLICIES},
    "kv_bytes_per_token": {kv: footprint.kv_bytes_per_token(config, kv)
                           for kv in footprint.KV_DTYPES},
    "kv_bytes_per_step": {kv: step["bf16"][kv]["kv_bytes"] for kv in footprint.KV_DTYPES},
    "step": {p: {kv: {"seconds": s["seconds"], "tokens_per_s": s["tokens_per_s"]}
                 for kv, s in by_kv.items()} for p, by_kv in step.items()},
  }


def format_table(d: dict[str, Any]) -> str:
  """Readable text form of a `describe` result."""
  params = d["params"]
  rows = [
    ("parameters, main model", f"{params['total'] / 1e9:,.3f} B"),
    ("parameters, MTP layers", f"{params['mtp'] / 1e9:,.3f} B"),
    ("active parameters / token", f"{d['active_params_per_token'] / 1e9:,.3f} B"),
  ]
  rows += [(f"checkpoint, {p}", f"{b / 1e9:,.3f} GB") for p, b in d["checkpoint_bytes"].items()]
  rows += [(f"weights / step ({d['verify_tokens']} tok), {p}", f"{b / 1e9:,.3f} GB")
           for p, b in d["weight_bytes_per_step"].items()]
  rows += [(f"MTP pass weights (1 tok), {p}", f"{b / 1e9:,.3f} GB")
           for p, b in d["mtp_weight_bytes_per_pass"].items()]
  for kv, per_token in d["kv_bytes_per_token"].items():
    rows.append((f"KV / token, {kv}", f"{per_token['main']:,} B ({per_token['latent']} latent "
                 f"per layer, {per_token['indexer']} indexer per full layer)"))
  rows += [(f"KV / step at {d['context']:,} ctx, {kv}", f"{b / 1e6:,.3f} MB")
           for kv, b in d["kv_bytes_per_step"].items()]
  width = max(len(name) for name, _ in rows)
  lines = [f"{name:<{width}}  {value}" for name, value in rows]
  lines += ["", f"bandwidth-bound step at {d['bandwidth'] / 1e12:.2f} TB/s "
            "(all verified tokens accepted):", f"{'weights':<14}{'KV':<6}{'ms/step':>10}"
            f"{'tokens/s':>12}"]
  for policy, by_kv in d["step"].items():
    for kv, s in by_kv.items():
      lines.append(f"{policy:<14}{kv:<6}{s['seconds'] * 1e3:>10.3f}{s['tokens_per_s']:>12.1f}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  result = describe(get_model_config(_CONFIG.value), context=_CONTEXT.value,
                    verify_tokens=_VERIFY_TOKENS.value, bandwidth=_BANDWIDTH.value)
  print(json.dumps(result, indent=2) if _JSON.value else format_table(result))


if __name__ == "__main__":
  app.run(main)
