"""glmjax: a JAX/XLA research framework for fast GLM-5-class inference."""

from glmjax.api import forward, generate
from glmjax.checkpoint import load_pretrained, save_pretrained
from glmjax.config import ModelConfig

__all__ = ["ModelConfig", "forward", "generate", "load_pretrained", "save_pretrained"]
