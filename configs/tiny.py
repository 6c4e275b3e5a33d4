"""Tiny GLM-MoE-DSA for tests (seconds on CPU), shaped as the HF fixture plus one MTP layer.

Same architecture as /work/shared/fixtures/hf_glm_moe_dsa_tiny/config.json: 4 layers (layer 0
dense, layer 2 shares layer 1's top-k), MLA with a DSA indexer (top-k 8), 8 routed experts (2 per
token) and 1 shared expert; `num_nextn_predict_layers=1` adds an MTP layer the fixture lacks, and
8 attention heads (the fixture has 4) let every TEP degree up to 8 split them.

  python -m experiments.describe --config=tiny
"""

from glmjax.config import ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
    indexer_types=("full", "full", "shared", "full"),
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    rope_theta=1e6,
    num_nextn_predict_layers=1,
  )
