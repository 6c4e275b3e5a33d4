"""HF safetensors checkpoints <-> glmjax params, and orbax save/restore.

HF tensor names appear only here. Params mirror the HF module tree (`layers_3/self_attn/q_a_proj/
weight` is `model.layers.3.self_attn.q_a_proj.weight`), except that routed experts are stacked
into one [E, out, in] array per projection and the MTP layer (`model.layers.<L>.*`, L =
num_hidden_layers) lives under `mtp/`. Tensors are read one at a time from memory-mapped files;
with a target sharding, each device reads only its slice (`jax.make_array_from_callback`).

Quantized weights are detected per tensor from the names beside `<module>.weight`, and become one
leaf (glmjax.quant), per-expert tensors stacked like plain experts:
  ModelOpt NVFP4  weight uint8 [out, in/2], weight_scale e4m3 [out, in/16], weight_scale_2 and
                  input_scale fp32 scalars                                    -> NVFP4Weight
  block FP8       weight e4m3 [out, in], weight_scale_inv fp32 [ceil(out/128), ceil(in/128)]
                  (GLM-5-FP8 / DeepSeek-V3)                                   -> FP8BlockWeight
save_pretrained writes them back in the same layouts, and config.json's `quantization_config`
describes them (`quantization_config` / `read_quantization_config`; ModelConfig ignores it).
"""

import json
import os
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from safetensors.numpy import save_file

from glmjax.config import ModelConfig
from glmjax.model import abstract_params
from glmjax.quant import (POLICIES, FP8BlockWeight, NVFP4Weight, QuantizedWeight, arrange_params, quantize_leaf,
                          quantizes)
from glmjax.quant import fp8_block, nvfp4
from glmjax.quant.leaf import field_spec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The MTP layer of GLM-5 checkpoints may repeat the shared embedding and head; they are the same
# tensors as the main model's, so they are accepted and skipped.
_MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")
_MTP_RENAMES = {"shared_head_norm": "shared_head.norm"}
# Quantized leaves as checkpoints store them: leaf field -> the name suffix replacing "weight".
# The second entry is the format's marker: its presence beside a weight says the format.
QUANT_TENSORS: dict[type, dict[str, str]] = {
    NVFP4Weight: {"packed": "weight", "block_scale": "weight_scale", "global_scale": "weight_scale_2",
                  "input_scale": "input_scale"},
    FP8BlockWeight: {"weight": "weight", "scale_inv": "weight_scale_inv"},
}
# safetensors' numpy backend cannot build these dtypes: such tensors are read through a memmap.
_MEMMAP_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}
_SAFETENSORS_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
                       np.dtype(np.float32): "F32"}


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
    self._headers: dict[str, tuple[int, dict]] = {}
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

  def dtype(self, name: str) -> str:
    """The safetensors dtype name: F32, BF16, U8, F8_E4M3, ..."""
    return self._handle(name).get_slice(name).get_dtype()

  def _memmap(self, name: str) -> np.memmap:
    """The tensor as a read-only memmap of its bytes (header: u64 size, then json)."""
    path = self._file_of[name]
    if path not in self._headers:
      with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        self._headers[path] = size, json.loads(f.read(size))
    size, header = self._headers[path]
    entry = header[name]
    return np.memmap(path, _MEMMAP_DTYPES[entry["dtype"]], "r", offset=8 + size + entry["data_offsets"][0],
                     shape=tuple(entry["shape"]))

  def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
    """The tensor, or only `index` of it (a slice read touches only those bytes of the file)."""
    if self.dtype(name) in _MEMMAP_DTYPES:
      part = np.array(self._memmap(name)[index])
    else:
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


def _renamed(name: str, suffix: str) -> str:
  """`<module>.weight` -> `<module>.<suffix>`."""
  return name[:-len("weight")] + suffix


def _stored_format(names: list[str], available: set[str]) -> tuple[type | None, str | None]:
  """(quantized format the checkpoint stores these weight tensors in or None for plain, problem)."""
  if not names[0].endswith(".weight"):
    return None, None
  formats = [next((fmt for fmt, fields in QUANT_TENSORS.items()
                   if _renamed(n, list(fields.values())[1]) in available), None) for n in names]
  if len(set(formats)) > 1:
    k = next(i for i, f in enumerate(formats) if f != formats[0])
    describe = lambda f: "plain" if f is None else f.format
    return None, (f"tensors {names[0]} ({describe(formats[0])}) and {names[k]} ({describe(formats[k])}) "
                  "are stacked into one leaf but stored in different formats")
  return formats[0], None


def _field_sharding(sharding: jax.sharding.Sharding, logical: tuple[int, ...],
                    shape: tuple[int, ...]) -> jax.sharding.Sharding:
  """The sharding of one array of a param leaf: the param's own for the weight itself, else
  glmjax.quant.leaf.field_spec's for a quantized leaf's arrays."""
  if shape == logical or sharding.is_fully_replicated:
    return sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise ValueError(f"quantized leaves need a NamedSharding (or a replicated one) to shard their "
                     f"packed and scale arrays, got {sharding}")
  return jax.sharding.NamedSharding(sharding.mesh, field_spec(sharding.spec, len(logical), shape, sharding.mesh.shape))


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16, shardings: ShardingFn | None = None,
                    config: ModelConfig | None = None, quantize: str | None = None) -> tuple[ModelConfig, dict]:
  """Read a HF `glm_moe_dsa` directory -> (config, params).

  dtype: floating params are cast to it (the router's correction bias stays fp32, as in
  transformers); weights stored quantized (NVFP4, block FP8) load as they are stored, into
  NVFP4Weight / FP8BlockWeight leaves. quantize: a glmjax.quant policy ("fp8", "nvfp4_experts",
  "nvfp4") applied to the plain weights it selects as they are read (after the cast to dtype,
  so the result is quantize_params of the dtype params). shardings: optional function
  (param path, shape) -> Sharding; each device then reads only its own slice of each tensor. A
  quantized leaf's arrays take the param's NamedSharding along the dims they share with the
  weight (packed codes and block scales: all; per-tensor scales: the expert dim), replicated
  where the mesh does not divide them. Raises CheckpointError naming any missing, unexpected,
  mis-shaped or (for quantized tensors) mis-typed tensor, scales included.
  """
  config = config or ModelConfig.from_hf(path)
  return config, load_params(TensorFiles(path), config, dtype=dtype, shardings=shardings, quantize=quantize)


def _leaf_tensors(fmt: type | None, names: list[str], want: tuple[int, ...],
                  dtype) -> dict[str | None, tuple[list[str], jax.ShapeDtypeStruct]]:
  """field -> (its tensor names, the storage of one of them); a plain weight is one field, None."""
  if fmt is None:
    return {None: (names, jax.ShapeDtypeStruct(want, dtype))}
  return {field: ([_renamed(n, QUANT_TENSORS[fmt][field]) for n in names], spec)
          for field, spec in fmt.storage(want).items()}


def _tensor_problems(files: TensorFiles, names: list[str], spec: jax.ShapeDtypeStruct, fmt: type | None,
                     want: tuple[int, ...]) -> list[str]:
  """What is wrong with present tensors: shapes; for quantized ones also dtypes (exact: they say
  how the bits read)."""
  of_weight = "" if fmt is None else f" (for a {fmt.format} weight of shape {want})"
  problems = [f"tensor {n} has shape {files.shape(n)}, expected {spec.shape}{of_weight}"
              for n in names if files.shape(n) != spec.shape]
  if fmt is not None:
    expected = _SAFETENSORS_DTYPES[spec.dtype]
    problems += [f"tensor {n} has dtype {files.dtype(n)}, expected {expected}{of_weight}"
                 for n in names if files.dtype(n) != expected]
  return problems


def load_params(files: TensorFiles, config: ModelConfig, *, dtype=jnp.bfloat16,
                shardings: ShardingFn | None = None, quantize: str | None = None) -> dict:
  """The params of `config` from `files` (see load_pretrained); files.bytes_read counts the reads."""
  if quantize is not None and quantize not in POLICIES:
    raise ValueError(f"quantize must be None or a policy in {POLICIES}, got {quantize!r}")
  abstract = abstract_params(config, param_dtype=dtype)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract))
  available, used, problems, plan = files.names(), set(), [], []
  for keypath, leaf in leaves:
    path = tuple(_path_str(keypath))
    names, stacked = hf_names(config, list(path))
    want = tuple(leaf.shape[1:] if stacked else leaf.shape)
    fmt, problem = _stored_format(names, available)
    if fmt is not None and not quantizes(path, leaf.ndim, "nvfp4"):
      problem = f"tensor {names[0]} is stored as {fmt.format}, but glmjax runs this weight unquantized"
      used.update(_renamed(n, suffix) for n in names for suffix in QUANT_TENSORS[fmt].values())
    if problem:
      problems.append(problem)
      continue
    fields, targets, readers = _leaf_tensors(fmt, names, want, leaf.dtype), {}, {}
    for field, (tensor_names, spec) in fields.items():
      missing = [n for n in tensor_names if n not in available]
      if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        problems.append(f"missing tensor {missing[0]} (expected shape {spec.shape}){more}")
        continue
      problems += _tensor_problems(files, tensor_names, spec, fmt, want)
      used.update(tensor_names)
      targets[field] = jax.ShapeDtypeStruct((len(names), *spec.shape) if stacked else spec.shape, spec.dtype)
      readers[field] = _leaf_reader(files, tensor_names, stacked)
    if len(targets) == len(fields):  # every tensor present
      target, reader = (targets[None], readers[None]) if fmt is None else (fmt(**targets), fmt(**readers))
      plan.append((path, leaf.shape, target, reader))
  mtp_prefix = f"model.layers.{config.num_hidden_layers}."
  unexpected = sorted(n for n in available - used
                      if not (n.startswith(mtp_prefix) and n[len(mtp_prefix):] in _MTP_DUPLICATES))
  problems += [f"unexpected tensor {n} with shape {files.shape(n)}" for n in unexpected]
  if problems:
    raise CheckpointError(f"checkpoint does not match the config ({len(problems)} problems):\n  "
                          + "\n  ".join(problems[:20]))
  values = []
  for path, logical, target, reader in plan:
    sharding = None if shardings is None else shardings(path, logical)

    def make(struct: jax.ShapeDtypeStruct, read) -> jax.Array:
      if sharding is None:
        return jnp.asarray(_cast(read(()), struct.dtype))
      return jax.make_array_from_callback(struct.shape, _field_sharding(sharding, logical, struct.shape),
                                          lambda idx: _cast(read(idx), struct.dtype))

    # target / reader: one ShapeDtypeStruct / reader, or a quantized leaf of them (one per field).
    value = jax.tree.map(make, target, reader)
    values.append(value if quantize is None else quantize_leaf(path, value, quantize))
  return jax.tree_util.tree_unflatten(treedef, values)


def _is_quantized(x) -> bool:
  return isinstance(x, QuantizedWeight)


def _stored_arrays(names: list[str], leaf) -> Iterator[tuple[list[str], Any]]:
  """(HF names, array) for each array of a param leaf: the leaf itself, or each field of a
  quantized leaf under its own names."""
  if not isinstance(leaf, QuantizedWeight):
    yield names, leaf
    return
  for field, suffix in QUANT_TENSORS[type(leaf)].items():
    yield [_renamed(n, suffix) for n in names], getattr(leaf, field)


def hf_state_dict(config: ModelConfig, params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, numpy tensor) pairs of params, experts unstacked, in the checkpoint's layout."""
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_quantized)[0]:
    names, stacked = hf_names(config, _path_str(keypath))
    for tensor_names, value in _stored_arrays(names, leaf):
      array = np.asarray(jax.device_get(value))
      if stacked:
        yield from ((n, np.asarray(array[e])) for e, n in enumerate(tensor_names))
      else:
        yield tensor_names[0], array


def quantization_config(config: ModelConfig, params: dict) -> dict[str, Any] | None:
  """config.json's `quantization_config` for params with quantized leaves (None without any).

  All NVFP4: ModelOpt's entry ("quant_method": "modelopt", "quant_algo": "NVFP4"). All block
  FP8: the entry GLM-5-FP8 / DeepSeek-V3 ship ("quant_method": "fp8", "weight_block_size").
  Both: ModelOpt's MIXED_PRECISION with each module's format. Plain linear modules are listed
  as excluded; routed experts by pattern (`...mlp.experts.*.gate_proj`).
  """
  formats, plain = {}, []
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_quantized)[0]:
    names, stacked = hf_names(config, _path_str(keypath))
    if not names[0].endswith(".weight") or leaf.ndim < 2:
      continue
    module = names[0][:-len(".weight")]
    if stacked:
      module = ".".join(module.split(".")[:-2] + ["*", module.split(".")[-1]])
    if isinstance(leaf, QuantizedWeight):
      formats[module] = leaf.format
    else:
      plain.append(module)
  if not formats:
    return None
  algos = {"nvfp4": {"quant_algo": "NVFP4", "group_size": nvfp4.BLOCK},
           "fp8_block": {"quant_algo": "FP8", "weight_block_size": [fp8_block.BLOCK] * 2}}
  kinds = set(formats.values())
  if kinds == {"fp8_block"}:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [fp8_block.BLOCK] * 2, "modules_to_not_convert": sorted(plain)}
  if kinds == {"nvfp4"}:
    return {"quant_method": "modelopt", **algos["nvfp4"], "kv_cache_quant_algo": None,
            "exclude_modules": sorted(plain)}
  return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
          "quantized_layers": {m: algos[f] for m, f in sorted(formats.items())}, "exclude_modules": sorted(plain)}


def read_quantization_config(path: str | os.PathLike) -> dict[str, Any] | None:
  """The `quantization_config` entry of a checkpoint directory's config.json, if any."""
  with open(os.path.join(path, "config.json")) as f:
    return json.load(f).get("quantization_config")


def save_pretrained(config: ModelConfig, params: dict, path: str | os.PathLike, *,
                    max_shard_bytes: int = 4 << 30) -> None:
  """Write config.json and safetensors (sharded with an index past max_shard_bytes), HF layout;
  quantized leaves as their checkpoint tensors, described by config.json's quantization_config
  (NVFP4 weights in the fragment kernel's order back in ModelOpt's first)."""
  os.makedirs(path, exist_ok=True)
  params = arrange_params(params, fragments=False)
  hf = config.to_hf_dict()
  quant_config = quantization_config(config, params)
  if quant_config is not None:
    hf["quantization_config"] = quant_config
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  shards, current, size = [], {}, 0
  for name, array in hf_state_dict(config, params):
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = np.asarray(array, order="C")  # (ascontiguousarray would make scalars 1-D)
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
