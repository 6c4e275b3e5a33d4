"""tiny in two decoder layers: the smallest model with every layer kind (a dense layer running its
indexer, then an MoE layer reusing its top-k) and the MTP layer; the smoke tests' entry points
compile it in about half tiny's time.

  python -m experiments.describe --config=tiny2
"""

import dataclasses

from configs import tiny
from glmjax.config import ModelConfig


def get_config() -> ModelConfig:
  return dataclasses.replace(tiny.get_config(), num_hidden_layers=2, indexer_types=("full", "shared"),
                             mlp_layer_types=("dense", "sparse"))
