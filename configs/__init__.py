"""Named configs: each `configs/<name>.py` defines `get_config()`.

Look model presets up with `get_model_config(name)`, e.g. `--config=glm5` in experiments.
"""

import importlib

from glmjax.config import ModelConfig

MODEL_CONFIGS = ("glm5", "glm5_2", "tiny", "mini", "tep8_shard")


def get_model_config(name: str) -> ModelConfig:
  """The ModelConfig preset `configs.<name>.get_config()`."""
  if name not in MODEL_CONFIGS:
    raise ValueError(f"config: unknown model config {name!r}; known: {', '.join(MODEL_CONFIGS)}")
  return importlib.import_module(f"configs.{name}").get_config()
