"""Exact emulation of `torch.topk` on the CPU, for bit-exact comparison with transformers.

DSA's indexer scores tie often in small random models (ReLU zeroes every head of a key), and the
reference fixtures were made by transformers on the CPU, where torch's top-k keeps whichever tied
entries libstdc++'s `std::nth_element` (introselect) happens to leave in front (for
k * 64 > n; `std::partial_sort` otherwise). glmjax's own rule is well defined instead (lower
position wins, as `lax.top_k`); this module reproduces torch's choice so that the fixture test can
demand 1e-5 agreement. It runs on the host (a `jax.pure_callback`) and is meant for tests only.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def _select_nth(keys: list[tuple[float, int]], nth: int) -> None:
  """libstdc++ std::nth_element(first, first + nth, last) with comp(x, y) = x.value > y.value."""
  comp = lambda x, y: x[0] > y[0]
  first, last = 0, len(keys)
  depth = 2 * int(math.log2(last)) if last > 0 else 0
  while last - first > 3:
    if depth == 0:  # libstdc++ falls back to a heap select here; not emulated
      raise NotImplementedError("torch.topk emulation: introselect depth limit reached")
    depth -= 1
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1           # move the median of (a, b, c) to first
    if comp(keys[a], keys[b]):
      m = b if comp(keys[b], keys[c]) else (c if comp(keys[a], keys[c]) else a)
    elif comp(keys[a], keys[c]):
      m = a
    else:
      m = c if comp(keys[b], keys[c]) else b
    keys[first], keys[m] = keys[m], keys[first]
    lo, hi = first + 1, last                     # unguarded partition around keys[first]
    while True:
      while comp(keys[lo], keys[first]):
        lo += 1
      hi -= 1
      while comp(keys[first], keys[hi]):
        hi -= 1
      if not lo < hi:
        break
      keys[lo], keys[hi] = keys[hi], keys[lo]
      lo += 1
    if lo <= nth:
      first = lo
    else:
      last = lo
  _insertion_sort(keys, first, last, comp)


def _insertion_sort(keys, first, last, comp) -> None:
  for i in range(first + 1, last):
    val = keys[i]
    if comp(val, keys[first]):
      keys[first + 1:i + 1] = keys[first:i]
      keys[first] = val
    else:
      j = i
      while comp(val, keys[j - 1]):
        keys[j] = keys[j - 1]
        j -= 1
      keys[j] = val


def _sorted_prefix(keys: list[tuple[float, int]], k: int) -> None:
  """std::partial_sort's kept set, which is unambiguous unless a tie straddles position k."""
  keys.sort(key=lambda kv: -kv[0])
  if k < len(keys) and keys[k - 1][0] == keys[k][0]:
    raise NotImplementedError("torch.topk emulation: a tie straddles k on the partial_sort path")
  del keys[k:]


def torch_topk_rows(scores: np.ndarray, k: int) -> np.ndarray:
  """Indices [..., k] torch.topk(scores, k).indices would return (as a set) for each row."""
  flat = scores.reshape(-1, scores.shape[-1])
  out = np.empty((flat.shape[0], k), np.int32)
  for r, row in enumerate(flat):
    keys = [(float(v), j) for j, v in enumerate(row)]
    if k * 64 <= len(keys):
      _sorted_prefix(keys, k)
    else:
      _select_nth(keys, k - 1)
    out[r] = [j for _, j in keys[:k]]
  return out.reshape(scores.shape[:-1] + (k,))


def torch_cpu_topk(scores: jax.Array, k: int, lengths: jax.Array) -> jax.Array:
  """torch.topk over each row's first `lengths[b]` entries, as transformers' indexer sees them.

  scores [B, T, S] fp32 with -inf where masked; transformers adds a float32-min causal mask
  instead, so -inf is replaced by that value. Indices of masked entries come back as -1.
  """
  def host(scores_np, lengths_np):
    b, t, s = scores_np.shape
    out = np.full((b, t, k), -1, np.int32)
    for i in range(b):
      n = int(lengths_np[i])
      row = np.where(np.isneginf(scores_np[i, :, :n]), np.finfo(np.float32).min, scores_np[i, :, :n])
      kk = min(k, n)
      idx = torch_topk_rows(row, kk)
      valid = np.take_along_axis(np.isfinite(scores_np[i, :, :n]), idx, axis=-1)
      out[i, :, :kk] = np.where(valid, idx, -1)
    return out
  shape = jax.ShapeDtypeStruct(scores.shape[:2] + (k,), jnp.int32)
  return jax.pure_callback(host, shape, scores, lengths)
