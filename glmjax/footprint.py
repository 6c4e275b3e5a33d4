"""Parameter, weight-byte and KV-cache accounting of a ModelConfig, in plain Python (no arrays).

Everything derives from `checkpoint_tensors`, the HF checkpoint's tensors (names and shapes), so
counts can be checked against a real safetensors header. Conventions:
- Main model = embedding, the `num_hidden_layers` decoder layers, final norm, lm_head. MTP layers
  (stored as layers L, L+1, ...) are counted apart; they share the embedding and lm_head.
- Parameter totals follow transformers' count, which leaves out the routers'
  `e_score_correction_bias` (a buffer there, not trained); stored bytes include it.
- With `rank_local_experts` set, only the local routed experts are listed; the router still
  scores all n_routed_experts. With `rank_shared_intermediate` set, the shared expert is that slice.
- A decode step verifies `num_tokens` tokens at once. Weights read per step: every tensor once,
  except the embedding (only the rows of those tokens) and the routed experts (only the distinct
  experts the tokens touch, `expected_distinct_experts` under uniform routing). The lm_head is
  read in full. Active parameters per token = the same sum for one token.
- An MTP pass (mtp=True) reads the MTP layers plus the shared lm_head and embedding rows.
- Weight policies compress only `linear` tensors (projections; not the embedding, lm_head, router
  or indexer weights_proj, which FP8 checkpoints keep in high precision): "fp8" = e4m3 + one fp32
  per 128x128 block; "nvfp4" = 4 bits + one e4m3 per 16 weights + one fp32 per tensor (4.5
  bits/weight); "nvfp4_experts" = NVFP4 routed experts, the rest bf16. Other tensors are bf16.
"""

import dataclasses
import functools
import math

from glmjax.cache.kv_fp8 import fp8_block_size
from glmjax.config import ModelConfig

H200_BANDWIDTH = 4.22e12  # B/s, H200 copy speed measured (NOTES.md).
POLICIES = ("bf16", "fp8", "nvfp4_experts", "nvfp4")
KV_DTYPES = ("bf16", "fp8")
# Main-model groups; MTP layers also have "mtp_proj" (eh_proj).
GROUPS = ("embedding", "attention", "indexer", "dense_mlp", "routed_experts", "shared_experts",
          "router", "norms", "lm_head")

FP8_BLOCK = 128  # Weight scales: one fp32 per 128x128 block (GLM-5-FP8 / DeepSeek style).
NVFP4_BLOCK = 16  # One e4m3 scale per 16 weights along the input dimension, plus fp32 per tensor.


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One checkpoint tensor. `linear`: a projection weight quantized policies may compress;
  `buffer`: not a trained parameter (left out of parameter totals)."""
  name: str
  shape: tuple[int, ...]
  group: str
  linear: bool = False
  mtp: bool = False
  buffer: bool = False

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def _decoder_layer(c: ModelConfig, prefix: str, *, moe: bool, indexer: bool,
                   mtp: bool) -> list[Tensor]:
  """Tensors of one decoder layer (MLA + optional indexer + dense MLP or MoE)."""
  h, heads, v = c.hidden_size, c.num_attention_heads, c.v_head_dim

  def t(name, shape, group, linear=False, buffer=False):
    return Tensor(prefix + name, tuple(shape), group, linear, mtp, buffer)

  out = [
    t("input_layernorm.weight", [h], "norms"),
    t("post_attention_layernorm.weight", [h], "norms"),
    t("self_attn.q_a_proj.weight", [c.q_lora_rank, h], "attention", True),
    t("self_attn.q_a_layernorm.weight", [c.q_lora_rank], "attention"),
    t("self_attn.q_b_proj.weight", [heads * c.qk_head_dim, c.q_lora_rank], "attention", True),
    t("self_attn.kv_a_proj_with_mqa.weight", [c.kv_lora_rank + c.qk_rope_head_dim, h],
      "attention", True),
    t("self_attn.kv_a_layernorm.weight", [c.kv_lora_rank], "attention"),
    t("self_attn.kv_b_proj.weight", [heads * (c.qk_nope_head_dim + v), c.kv_lora_rank],
      "attention", True),
    t("self_attn.o_proj.weight", [h, heads * v], "attention", True),
  ]
  if indexer:
    d = c.index_head_dim
    out += [
      t("self_attn.indexer.wq_b.weight", [c.index_n_heads * d, c.q_lora_rank], "indexer", True),
      t("self_attn.indexer.wk.weight", [d, h], "indexer", True),
      t("self_attn.indexer.k_norm.weight", [d], "indexer"),
      t("self_attn.indexer.k_norm.bias", [d], "indexer"),
      # Kept in high precision by the FP8 checkpoints (transformers' _keep_in_fp32_modules).
      t("self_attn.indexer.weights_proj.weight", [c.index_n_heads, h], "indexer"),
    ]

  def mlp(name, inter, group):
    return [t(f"{name}.gate_proj.weight", [inter, h], group, True),
            t(f"{name}.up_proj.weight", [inter, h], group, True),
            t(f"{name}.down_proj.weight", [h, inter], group, True)]

  if not moe:
    return out + mlp("mlp", c.intermediate_size, "dense_mlp")
  for e in range(c.num_local_experts):
    out += mlp(f"mlp.experts.{e}", c.moe_intermediate_size, "routed_experts")
  if c.n_shared_experts:
    out += mlp("mlp.shared_experts", c.shared_intermediate,
               "shared_experts")
  return out + [t("mlp.gate.weight", [c.n_routed_experts, h], "router"),
                t("mlp.gate.e_score_correction_bias", [c.n_routed_experts], "router",
                  buffer=True)]


@functools.lru_cache(maxsize=16)
def checkpoint_tensors(config: ModelConfig) -> tuple[Tensor, ...]:
  """The HF checkpoint's tensors: main model, then the MTP layers (`mtp=True`)."""
  c, h = config, config.hidden_size
  out = [Tensor("model.embed_tokens.weight", (c.vocab_size, h), "embedding")]
  for i in range(c.num_hidden_layers):
    out += _decoder_layer(c, f"model.layers.{i}.", moe=c.mlp_layer_types[i] == "sparse",
                          indexer=c.indexer_types[i] == "full", mtp=False)
  out.append(Tensor("model.norm.weight", (h,), "norms"))
  if not c.tie_word_embeddings:
    out.append(Tensor("lm_head.weight", (c.vocab_size, h), "lm_head"))
  for j in range(c.num_nextn_predict_layers):
    prefix = f"model.layers.{c.num_hidden_layers + j}."
    out += [Tensor(prefix + "enorm.weight", (h,), "norms", mtp=True),
            Tensor(prefix + "hnorm.weight", (h,), "norms", mtp=True),
            Tensor(prefix + "eh_proj.weight", (h, 2 * h), "mtp_proj", True, True),
            Tensor(prefix + "shared_head.norm.weight", (h,), "norms", mtp=True)]
    out += _decoder_layer(c, prefix, moe=True, indexer=True, mtp=True)
  return tuple(out)


def param_counts(config: ModelConfig) -> dict[str, int]:
  """Element counts: per group in GROUPS (main model, every stored tensor), 'checkpoint' (their
  sum), 'total' (main-model parameters, buffers left out) and 'mtp' (MTP-layer parameters)."""
  counts = dict.fromkeys(GROUPS, 0) | {"checkpoint": 0, "total": 0, "mtp": 0}
  for t in checkpoint_tensors(config):
    if t.mtp:
      counts["mtp"] += 0 if t.buffer else t.size
      continue
    counts[t.group] += t.size
    counts["checkpoint"] += t.size
    counts["total"] += 0 if t.buffer else t.size
  return counts


def checkpoint_bytes(config: ModelConfig, policy: str = "bf16") -> float:
  """Bytes of every stored tensor (main model and MTP layers) under `policy`."""
  return sum(tensor_bytes(t, policy) for t in checkpoint_tensors(config))


def expected_distinct_experts(num_tokens: int, top_k: int, n_experts: int) -> float:
  """Expected distinct experts `num_tokens` tokens touch, each picking `top_k` of `n_experts`.

  Assumes uniform, independent routing: an expert is missed by one token with probability
  1 - k/n, so it is touched with probability 1 - (1 - k/n)^t. Real routing is skewed and
  correlated across neighbouring tokens, so this is an upper bound on typical traffic.
  """
  return n_experts * (1.0 - (1.0 - top_k / n_experts) ** num_tokens)


def _format(tensor: Tensor, policy: str) -> str:
  """Storage format ("bf16", "fp8" or "nvfp4") of `tensor` under a weight `policy`."""
  if policy not in POLICIES:
    raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
  if not tensor.linear or policy == "bf16":
    return "bf16"
  if policy == "fp8":
    return "fp8"
  if policy == "nvfp4" or tensor.group == "routed_experts":
    return "nvfp4"
  return "bf16"


def tensor_bytes(tensor: Tensor, policy: str = "bf16") -> float:
  """Stored bytes of `tensor` under `policy`, scales included."""
  fmt = _format(tensor, policy)
  if fmt == "bf16":
    return 2.0 * tensor.size
  rows, cols = tensor.shape
  if fmt == "fp8":
    return rows * cols + 4.0 * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
  return 0.5 * rows * cols + rows * math.ceil(cols / NVFP4_BLOCK) + 4.0


def _read_fraction(config: ModelConfig, tensor: Tensor, num_tokens: int) -> float:
  """Expected fraction of `tensor` that a step over `num_tokens` tokens reads."""
  if tensor.group == "embedding":
    return min(num_tokens, config.vocab_size) / config.vocab_size
  if tensor.group == "routed_experts":
    n = config.n_routed_experts
    return expected_distinct_experts(num_tokens, config.num_experts_per_tok, n) / n
  return 1.0


def _step_sum(config: ModelConfig, num_tokens: int, mtp: bool, per_tensor) -> float:
  """Sum of `per_tensor(t) * read fraction` over the tensors a main (or MTP) pass reads."""
  total = 0.0
  for t in checkpoint_tensors(config):
    if t.mtp == mtp or (mtp and t.group in ("embedding", "lm_head")):
      total += per_tensor(t) * _read_fraction(config, t, num_tokens)
  return total


def active_params_per_token(config: ModelConfig, *, mtp: bool = False) -> float:
  """Parameters one token reads: all dense parts, top-k routed experts, one embedding row."""
  return _step_sum(config, 1, mtp, lambda t: t.size)


def weight_bytes_per_step(config: ModelConfig, policy: str = "bf16", num_tokens: int = 1, *,
                          mtp: bool = False) -> float:
  """Expected weight bytes read by one pass over `num_tokens` tokens (see module conventions)."""
  return _step_sum(config, num_tokens, mtp, lambda t: tensor_bytes(t, policy))


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str = "bf16") -> dict[str, int]:
  """Cache bytes per token: 'latent' (per layer), 'indexer' (per full-indexer layer), and the
  totals over the 'main' model's layers and over the 'mtp' layers (each with its own indexer)."""
  c = config
  if kv_dtype == "bf16":
    latent = 2 * (c.kv_lora_rank + c.qk_rope_head_dim)
    indexer = 2 * c.index_head_dim
  elif kv_dtype == "fp8":
    # e4m3 codes + one fp32 scale per block; the RoPE part stays bf16 (FlashMLA layout).
    latent = (c.kv_lora_rank + 4 * (c.kv_lora_rank // fp8_block_size(c.kv_lora_rank))
              + 2 * c.qk_rope_head_dim)
    indexer = c.index_head_dim + 4 * (c.index_head_dim // fp8_block_size(c.index_head_dim))
  else:
    raise ValueError(f"kv_dtype: expected one of {KV_DTYPES}, got {kv_dtype!r}")
  return {
    "latent": latent,
    "indexer": indexer,
    "main": latent * c.num_hidden_layers + indexer * len(c.full_indexer_layers),
    "mtp": (latent + indexer) * c.num_nextn_predict_layers,
  }


def kv_bytes_per_step(config: ModelConfig, context: int, num_tokens: int = 1,
                      kv_dtype: str = "bf16", *, mtp: bool = False) -> float:
  """Cache bytes one pass over `num_tokens` tokens reads at `context` cached tokens.

  Sparse attention reads the selected tokens' latent + RoPE key in every layer; each query token
  selects min(context, index_topk) and the union over the pass's tokens is taken as their sum
  capped by the context (selections overlap, so this is an upper bound). Each full-indexer layer
  scores all `context` indexer keys once per pass.
  """
  per_token = kv_bytes_per_token(config, kv_dtype)
  selected = min(min(context, config.index_topk) * num_tokens, context)
  if mtp:
    layers = full = config.num_nextn_predict_layers
  else:
    layers, full = config.num_hidden_layers, len(config.full_indexer_layers)
  return float(layers * selected * per_token["latent"] + full * context * per_token["indexer"])


def decode_step(config: ModelConfig, *, policy: str = "bf16", kv_dtype: str = "bf16",
                context: int = 0, num_tokens: int = 1,
                bandwidth: float = H200_BANDWIDTH) -> dict[str, float]:
  """Bandwidth-bound main-model step: bytes read, seconds, and tokens/s if all tokens count."""
  weights = weight_bytes_per_step(config, policy, num_tokens)
  kv = kv_bytes_per_step(config, context, num_tokens, kv_dtype)
  seconds = (weights + kv) / bandwidth
  return {"weight_bytes": weights, "kv_bytes": kv, "seconds": seconds,
          "tokens_per_s": num_tokens / seconds}
