"""Named configs: each `configs/<name>.py` defines `get_config()`.

Look model presets up with `get_model_config(name)`, e.g. `--config=glm5` in experiments.
"""

import dataclasses
import importlib

from glmjax.config import ModelConfig

MODEL_CONFIGS = ("glm5", "glm5_2", "tiny", "tiny2", "mini", "tep8_shard")


def get_model_config(name: str) -> ModelConfig:
  """The ModelConfig preset `configs.<name>.get_config()`."""
  if name not in MODEL_CONFIGS:
    raise ValueError(f"config: unknown model config {name!r}; known: {', '.join(MODEL_CONFIGS)}")
  return importlib.import_module(f"configs.{name}").get_config()


def with_indexer_types_of(config: ModelConfig, name: str) -> ModelConfig:
  """config with preset `name`'s per-layer IndexShare schedule (its shared layers hold no indexer
  weights and reuse the nearest preceding full layer's top-k), e.g. a tep8_shard rank with
  glm5_2's; name "": config as it is."""
  if not name:
    return config
  types = get_model_config(name).indexer_types
  if len(types) != config.num_hidden_layers:
    raise ValueError(f"indexer_types_of={name}: its {len(types)} layers' schedule does not fit the rank's "
                     f"{config.num_hidden_layers} layers")
  return dataclasses.replace(config, indexer_types=types)
