"""glmjax: a JAX/XLA research framework for fast GLM-5-class inference."""

# Imported for its side effect, before anything compiles: this module defines a config that is part
# of every jit cache key (pallas_fuser_disable_nested_fuse). Pallas imports it lazily, on the
# process's first pallas_call, and the longer key then misses every program compiled before: the
# first jitted step holding a Pallas kernel, called twice, compiled twice.
import jax.experimental.pallas.fuser  # noqa: F401

from glmjax.api import forward, generate
from glmjax.checkpoint import load_pretrained, save_pretrained
from glmjax.config import ModelConfig

__all__ = ["ModelConfig", "forward", "generate", "load_pretrained", "save_pretrained"]
