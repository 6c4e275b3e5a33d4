"""What one rank of GLM-5 holds under TEP=8 (tensor parallel attention, expert parallel MoE),
exactly as glmjax.parallel.rules lays the model out over 8 devices (tests/test_config.py checks
every parameter's shape against that layout).

Split 8 ways: attention heads (64 -> 8: q_b_proj, kv_b_proj rows and o_proj columns), the dense
MLPs' and the shared expert's intermediates (12288 -> 1536 and 2048 -> 256: gate/up rows, down
columns), the vocabulary (154880 -> 19360 rows of embedding and lm_head) and the routed experts
(256 -> 32 local). Replicated: the q/kv latent projections and their norms, the DSA indexer (all
32 heads: its scores sum over heads before the top-k), the router (every rank scores all 256
experts) and all norms. All 78 layers and the MTP layer are kept, so one GPU runs exactly one
rank's work (collectives aside).

Until 2026-12-04 this preset split the indexer's heads (32 -> 4) and kept the MLPs whole, unlike
the layout: runs 8-25 timed that rank, which reads 5.2 GB more weights a speculative step at 80K
with the full stack (study.step_bytes: 23.0 against 17.8 GB; floor 5.79 -> 4.56 ms).

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
    intermediate_size=full.intermediate_size // TEP,
    vocab_size=full.vocab_size // TEP,
    rank_local_experts=full.n_routed_experts // TEP,
    rank_shared_intermediate=full.moe_intermediate_size * full.n_shared_experts // TEP,
  )
