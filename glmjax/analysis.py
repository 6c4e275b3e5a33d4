"""Model introspection for studies and notebooks: per-layer DSA selections and their overlap.

IndexShare rests on adjacent layers selecting mostly the same tokens (IndexCache reports 70-100%
overlap). `layer_selections` captures what each layer's indexer picks on a forward pass (Flax
method interception: no change to the model), `selection_overlap` compares them.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from glmjax.api import params_dtype
from glmjax.config import ModelConfig
from glmjax.model import CausalLM
from glmjax.runtime import Runtime


def layer_selections(config: ModelConfig, params, tokens, *, runtime: Runtime = Runtime()) -> dict[int, np.ndarray]:
  """Top-k positions [B, S, k] (-1 empty) used by each decoder layer on a no-cache forward."""
  seen = _selections(runtime.arrange(params), jnp.asarray(tokens), config=config, runtime=runtime,
                     dtype=params_dtype(params))
  return {layer: np.asarray(sel) for layer, sel in seen.items()}


@functools.partial(jax.jit, static_argnames=("config", "runtime", "dtype"))
def _selections(params, tokens, *, config: ModelConfig, runtime: Runtime, dtype) -> dict[int, jax.Array]:
  """The forward as one program (run eagerly, each op compiled on its own: about 170 compiles for
  tiny), returning what each MLAttention call gave as its selection while it was traced. Its own
  jit, not api's forward: the interception sees only a trace, which a cached program skips."""
  seen: dict[int, jax.Array] = {}

  def capture(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if type(context.module).__name__ == "MLAttention" and context.method_name == "__call__":
      seen[kwargs["layer_id"]] = out[1]
    return out

  with nn.intercept_methods(capture):
    CausalLM(config, dtype=dtype, param_dtype=dtype).apply({"params": params}, tokens, runtime=runtime)
  return dict(sorted(seen.items()))


def selection_overlap(a: np.ndarray, b: np.ndarray, *, min_valid: int = 1) -> float:
  """Mean |A ∩ B| / |A| over query positions, ignoring -1 slots and positions whose selection has
  fewer than `min_valid` tokens (early positions select everything and would inflate it)."""
  ratios = []
  for row_a, row_b in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
    set_a, set_b = set(row_a[row_a >= 0].tolist()), set(row_b[row_b >= 0].tolist())
    if len(set_a) >= min_valid:
      ratios.append(len(set_a & set_b) / len(set_a))
  return float(np.mean(ratios)) if ratios else float("nan")


def overlap_matrix(selections: dict[int, np.ndarray], *, min_valid: int = 1) -> tuple[list[int], np.ndarray]:
  """(layer ids, [L, L] overlap of layer i's selection with layer j's) for layers that ran indexers."""
  layers = list(selections)
  m = np.array([[selection_overlap(selections[i], selections[j], min_valid=min_valid) for j in layers]
                for i in layers])
  return layers, m
