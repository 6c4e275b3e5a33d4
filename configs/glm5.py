"""GLM-5 (zai-org/GLM-5): 744B parameters, 78 layers, every layer runs its DSA indexer, 1 MTP layer.

All architecture values are transformers' GlmMoeDsaConfig defaults (= /work/shared/configs/
glm5_config.json), except RoPE: that json carries transformers' default theta 10000, while the
released checkpoint uses 1e6 (NOTES.md).

  python -m experiments.describe --config=glm5
"""

from glmjax.config import ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(rope_theta=1e6, num_nextn_predict_layers=1)
