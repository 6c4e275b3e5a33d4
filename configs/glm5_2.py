"""GLM-5.2: GLM-5's weights layout with IndexShare (arXiv 2603.12201) and a 1M context.

Same shapes as GLM-5, but only 21 of the 78 layers run their own indexer (freq 4, offset 3:
layers 0, 1, 2, 6, 10, ..., 74; the others reuse the top-k of the nearest preceding full layer and
ship no indexer weights), RoPE theta 8e6, max_position_embeddings 1,048,576, 1 MTP layer.

  python -m experiments.describe --config=glm5_2
"""

from glmjax.config import ModelConfig, derive_indexer_types


def get_config() -> ModelConfig:
  layers = 78
  return ModelConfig(
    num_hidden_layers=layers,
    rope_theta=8e6,
    max_position_embeddings=1_048_576,
    indexer_types=derive_indexer_types(layers, freq=4, offset=3),
    num_nextn_predict_layers=1,
  )
