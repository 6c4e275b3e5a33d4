"""What one rank of GLM-5 holds under TEP=8 (tensor parallel attention, expert parallel MoE).

Split 8 ways: attention heads (64 -> 8: q_b_proj, kv_b_proj rows and o_proj columns), indexer
heads (32 -> 4: wq_b rows, weights_proj rows), the vocabulary (154880 -> 19360 rows of embedding
and lm_head) and the routed experts (256 -> 32 local). Replicated: q_a/kv_a projections and their
norms, the indexer's wk and k_norm, dense MLPs, the shared expert, the router (every rank scores
all 256 experts) and all norms. All 78 layers and the MTP layer are kept, so one GPU runs exactly
one rank's work (collectives aside).

  python -m experiments.describe --config=tep8_shard
"""

import dataclasses

from configs import glm5
from glmjax.config import ModelConfig

TEP = 8


def get_config() -> ModelConfig:
  full = glm5.get_config()
  return dataclasses.replace(
    full,
    num_attention_heads=full.num_attention_heads // TEP,
    num_key_value_heads=full.num_key_value_heads // TEP,
    index_n_heads=full.index_n_heads // TEP,
    vocab_size=full.vocab_size // TEP,
    rank_local_experts=full.n_routed_experts // TEP,
  )
