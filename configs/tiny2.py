"""tiny in two decoder layers: the smallest model with every layer kind (a dense layer running its
indexer, then an MoE layer reusing its top-k) and the MTP layer. The smoke tests run the entry
points on it: fewer layers to compile (the ablation chain and sweeps: 75 -> 62 s on 2 cores).

  python -m experiments.describe --config=tiny2
"""

import dataclasses

from configs import tiny
from glmjax.config import ModelConfig


def get_config() -> ModelConfig:
  return dataclasses.replace(tiny.get_config(), num_hidden_layers=2, indexer_types=("full", "shared"),
                             mlp_layer_types=("dense", "sparse"))
