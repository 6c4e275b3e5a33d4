"""HF safetensors checkpoints <-> glmjax params, and orbax save/restore.

HF tensor names appear only here. Params mirror the HF module tree (`layers_3/self_attn/q_a_proj/
weight` is `model.layers.3.self_attn.q_a_proj.weight`), except that routed experts are stacked
into one [E, out, in] array per projection and the MTP layer (`model.layers.<L>.*`, L =
num_hidden_layers) lives under `mtp/`. Tensors are read one at a time from memory-mapped files;
with a target sharding, each device reads only its slice (`jax.make_array_from_callback`).
"""

import json
import os
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from safetensors.numpy import save_file

from glmjax.config import ModelConfig
from glmjax.model import abstract_params

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The MTP layer of GLM-5 checkpoints may repeat the shared embedding and head; they are the same
# tensors as the main model's, so they are accepted and skipped.
_MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")
_MTP_RENAMES = {"shared_head_norm": "shared_head.norm"}


ShardingFn = Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding]


class CheckpointError(ValueError):
  """A checkpoint that does not match the config: missing, unexpected or mis-shaped tensors."""


def _path_str(path) -> list[str]:
  return [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]


def hf_names(config: ModelConfig, path: list[str]) -> tuple[list[str], bool]:
  """HF tensor names making up one param leaf, and whether they stack along a new expert axis."""
  head, rest = path[0], path[1:]
  if head == "mtp":
    prefix = f"model.layers.{config.num_hidden_layers}."
    rest = rest[1:] if rest[0] == "block" else [_MTP_RENAMES.get(rest[0], rest[0])] + rest[1:]
  elif head.startswith("layers_"):
    prefix = f"model.layers.{head[len('layers_'):]}."
  elif head == "lm_head":
    prefix = "lm_head."
  else:
    prefix = f"model.{head}."
  if len(rest) >= 3 and rest[-2] == "experts":          # mlp/experts/gate_proj -> per-expert tensors
    stem = prefix + ".".join(rest[:-1])
    return [f"{stem}.{e}.{rest[-1]}.weight" for e in range(config.num_local_experts)], True
  return [prefix + ".".join(rest)], False


class TensorFiles:
  """Lazy, memory-mapped access to the tensors of one HF checkpoint directory."""

  def __init__(self, directory: str | os.PathLike):
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      self._file_of = {k: os.path.join(directory, v) for k, v in weight_map.items()}
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
      path = os.path.join(directory, SINGLE_FILE)
      with safe_open(path, framework="numpy") as f:
        self._file_of = {k: path for k in f.keys()}
    else:
      raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._handles: dict[str, Any] = {}
    self.bytes_read = 0

  def names(self) -> set[str]:
    return set(self._file_of)

  def _handle(self, name: str):
    path = self._file_of[name]
    if path not in self._handles:
      self._handles[path] = safe_open(path, framework="numpy")
    return self._handles[path]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handle(name).get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
    """The tensor, or only `index` of it (a slice read touches only those bytes of the file)."""
    part = self._handle(name).get_slice(name)[index] if index else self._handle(name).get_tensor(name)
    self.bytes_read += part.nbytes
    return part


def _leaf_reader(files: TensorFiles, names: list[str], stacked: bool) -> Callable[[tuple], np.ndarray]:
  def read(index: tuple[slice, ...]) -> np.ndarray:
    if not stacked:
      return files.read(names[0], index)
    experts = range(len(names))[index[0]] if index else range(len(names))
    return np.stack([files.read(names[e], tuple(index[1:])) for e in experts])
  return read


def _cast(array: np.ndarray, dtype) -> np.ndarray:
  return array if array.dtype == dtype else array.astype(dtype)


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16, shardings: ShardingFn | None = None,
                    config: ModelConfig | None = None) -> tuple[ModelConfig, dict]:
  """Read a HF `glm_moe_dsa` directory -> (config, params).

  dtype: floating params are cast to it (the router's correction bias stays fp32, as in
  transformers). shardings: optional function (param path, shape) -> Sharding; each device then
  reads only its own slice of each tensor. Raises CheckpointError naming any missing, unexpected
  or mis-shaped tensor.
  """
  config = config or ModelConfig.from_hf(path)
  return config, load_params(TensorFiles(path), config, dtype=dtype, shardings=shardings)


def load_params(files: TensorFiles, config: ModelConfig, *, dtype=jnp.bfloat16,
                shardings: ShardingFn | None = None) -> dict:
  """The params of `config` from `files` (see load_pretrained); files.bytes_read counts the reads."""
  abstract = abstract_params(config, param_dtype=dtype)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract))
  available, used, problems, plan = files.names(), set(), [], []
  for keypath, leaf in leaves:
    path = _path_str(keypath)
    names, stacked = hf_names(config, path)
    want = tuple(leaf.shape[1:] if stacked else leaf.shape)
    missing = [n for n in names if n not in available]
    if missing:
      more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
      problems.append(f"missing tensor {missing[0]} (expected shape {want}){more}")
      continue
    problems += [f"tensor {n} has shape {files.shape(n)}, expected {want}" for n in names if files.shape(n) != want]
    used.update(names)
    plan.append((tuple(path), leaf, _leaf_reader(files, names, stacked)))
  mtp_prefix = f"model.layers.{config.num_hidden_layers}."
  unexpected = sorted(n for n in available - used
                      if not (n.startswith(mtp_prefix) and n[len(mtp_prefix):] in _MTP_DUPLICATES))
  problems += [f"unexpected tensor {n} with shape {files.shape(n)}" for n in unexpected]
  if problems:
    raise CheckpointError(f"checkpoint does not match the config ({len(problems)} problems):\n  "
                          + "\n  ".join(problems[:20]))
  arrays = []
  for path, leaf, read in plan:
    if shardings is None:
      arrays.append(jnp.asarray(_cast(read(()), leaf.dtype)))
    else:
      arrays.append(jax.make_array_from_callback(
          leaf.shape, shardings(path, leaf.shape), lambda idx, r=read, d=leaf.dtype: _cast(r(idx), d)))
  return jax.tree_util.tree_unflatten(treedef, arrays)


def hf_state_dict(config: ModelConfig, params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, numpy tensor) pairs of params, experts unstacked, in the checkpoint's layout."""
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names, stacked = hf_names(config, _path_str(keypath))
    array = np.asarray(jax.device_get(leaf))
    if stacked:
      yield from ((n, array[e]) for e, n in enumerate(names))
    else:
      yield names[0], array


def save_pretrained(config: ModelConfig, params: dict, path: str | os.PathLike, *,
                    max_shard_bytes: int = 4 << 30) -> None:
  """Write config.json and safetensors (sharded with an index past max_shard_bytes), HF layout."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config.to_hf_dict(), f, indent=2)
  shards, current, size = [], {}, 0
  for name, array in hf_state_dict(config, params):
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = np.ascontiguousarray(array)
    size += array.nbytes
  shards.append(current)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in shard})
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": sum(a.nbytes for s in shards for a in s.values())},
               "weight_map": weight_map}, f, indent=2)


def save_orbax(params: dict, path: str | os.PathLike) -> None:
  """Save params with orbax (for training checkpoints and fast restore)."""
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.abspath(path), params)


def restore_orbax(path: str | os.PathLike, like: dict) -> dict:
  """Restore params saved by save_orbax; `like` gives the tree, shapes, dtypes (and shardings)."""
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(os.path.abspath(path), jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
