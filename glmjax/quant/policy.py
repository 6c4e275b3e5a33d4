"""Which parameters a quantization policy compresses, and the tree rewrite that does it.

Params are nested dicts mirroring HF names, e.g. params["layers"][i]["self_attn"]["q_a_proj"]
["weight"] [out, in] and params["layers"][i]["mlp"]["experts"]["gate_proj"] [E, i, d].

Qualifying leaves (`quantizes`):
  routed experts  gate_proj / up_proj / down_proj directly under an "experts" dict, 3-D stacked
                  [E, out, in]: every policy but "none" ("nvfp4_experts" takes only these; the
                  shared expert lives under "shared_experts" and is not a routed expert).
  linear weights  a 2-D leaf named "weight" ("nvfp4", "fp8"), except under lm_head,
                  embed_tokens, the router "gate" (and its e_score_correction_bias), the
                  indexer's weights_proj (its fp32 score weights flip near-tied top-k picks in
                  low precision, NOTES.md) and any norm (names containing "norm", e.g. k_norm).
"""

from typing import Any

import jax

from glmjax.quant.fp8_block import quantize_fp8_block
from glmjax.quant.leaf import QuantizedWeight
from glmjax.quant.nvfp4 import quantize_nvfp4

POLICIES = ("none", "fp8", "nvfp4_experts", "nvfp4")
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")
KEPT = ("lm_head", "embed_tokens", "gate", "e_score_correction_bias", "weights_proj")


def quantizes(path: tuple[str, ...], ndim: int, policy: str) -> bool:
  """Whether `policy` compresses the leaf at `path` (dict keys / list indices as strings)."""
  if policy not in POLICIES:
    raise ValueError(f"quantization policy must be one of {POLICIES}, got {policy!r}")
  if policy == "none" or len(path) < 2:
    return False
  if path[-2] == "experts" and path[-1] in EXPERT_LEAVES:
    return ndim == 3
  if policy == "nvfp4_experts":
    return False
  kept = any(name in KEPT or "norm" in name for name in path)
  return path[-1] == "weight" and ndim == 2 and not kept


def _names(path) -> tuple[str, ...]:
  """Dict keys and sequence indices of a tree path; attribute keys (e.g. a Flax box's .value)
  are skipped so boxed and unboxed params read the same."""
  names = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      names.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      names.append(str(key.idx))
  return tuple(names)


def quantize_leaf(path: tuple[str, ...], leaf: Any, policy: str) -> Any:
  """`leaf` in the policy's format if `quantizes` selects it, else unchanged (a leaf that is
  already quantized stays as it is: re-quantizing its dequantized values would only lose more)."""
  if isinstance(leaf, QuantizedWeight) or not quantizes(path, leaf.ndim, policy):
    return leaf
  return quantize_fp8_block(leaf) if policy == "fp8" else quantize_nvfp4(leaf)


def quantize_params(params: Any, policy: str) -> Any:
  """Replace every leaf `policy` selects by its NVFP4Weight / FP8BlockWeight (jnp, jit-able)."""
  if policy not in POLICIES:
    raise ValueError(f"quantization policy must be one of {POLICIES}, got {policy!r}")
  return jax.tree_util.tree_map_with_path(lambda path, leaf: quantize_leaf(_names(path), leaf, policy),
                                          params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
