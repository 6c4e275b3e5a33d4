"""Mini GLM-MoE-DSA with every GLM-5 feature, trainable on one H200 in minutes (16 MB in bf16).

Byte-level vocabulary: ids 0-255 are bytes, then bos 256, eos 257, pad 258 and one spare (259).
6 layers: layer 0 dense, layers 1-5 MoE (16 routed experts, 4 per token, group-limited routing
over 4 groups picking 2, plus 1 shared expert). MLA (8 heads, q/kv latents 128) with a DSA indexer
(4 heads x 64, top-k 64, so contexts beyond 64 tokens attend sparsely) and IndexShare freq 2 offset
2: layers 2 and 4 reuse the top-k of layers 1 and 3. One MTP layer. moe_intermediate_size 64 (not
128) keeps the bf16 checkpoint at 16.1 MB, under the 20 MB budget.

  python -m experiments.describe --config=mini
"""

from glmjax.config import ModelConfig, derive_indexer_types

LAYERS = 6


def get_config() -> ModelConfig:
  return ModelConfig(
    vocab_size=260,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=64,
    indexer_types=derive_indexer_types(LAYERS, freq=2, offset=2),
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    max_position_embeddings=131072,  # RoPE only: long-context benchmarks (80K-128K) run on it
    rope_theta=1e6,
    num_nextn_predict_layers=1,
  )
