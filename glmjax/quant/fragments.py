"""NVFP4 weights rearranged into mma.sync's fragment order: the layout that
pallas_kernels/nvfp4_fragments.py reads (its docstring describes every word), as a pytree leaf.

The same 4.5 bits a weight as the ModelOpt NVFP4Weight it comes from, moved once when the params
are loaded (`arrange_params`), never per call, and moved back exactly (`from_fragments`: the
checkpoint and every non-kernel path see ModelOpt's tensors).

  words   u32 [Kc, 2, Nt * 128]  tile T (16 rows), chunk c (128 inputs): each lane's A fragments
  scales  u32 [Kc, Nt * 32]      the e4m3 block scales of rows g and g + 8, four a word
N and K are zero-padded to whole tiles and chunks (zero codes and scales add nothing).
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from glmjax.quant.leaf import QuantizedWeight
from glmjax.quant.nvfp4 import BLOCK, NVFP4Weight, pack_e2m1, unpack_e2m1

TILE = 16          # weight rows a tile: mma m16n8k16's M
STEPS = 8          # k-steps of 16 a chunk
CHUNK = STEPS * BLOCK
LANES = 32
WORDS = 4 * LANES  # u32 a tile holds per array: four per lane
# codes [T, rh, g, c, h, j, t, cb] (row 16 T + g + 8 rh, column 128 c + 16 (4h + j) + 2t + cb, and
# + 8 in the high nibble) <-> words [c, h, T, g, t, j, rh, cb]; scale bytes [T, rh, g, c, j, q]
# (block 8 c + 2 j + q) <-> [c, T, g, j, q, rh].
_WORD_AXES = (3, 4, 0, 2, 6, 5, 1, 7)
_SCALE_AXES = (3, 0, 2, 4, 5, 1)
# Weights kept in ModelOpt's order: MLA's kv_b, which the model reads whole (absorbed into the
# decode query and the values, glmjax/attention.py: in fragment order each step would first move
# it back), and the shared expert, which the expert-parallel shard_map slices array by array
# (a FragmentWeight's static shape is the whole weight's). So do weights split over a mesh (the
# TEP shard_maps slice them the same way; `arrange_params`).
RAW = ("kv_b_proj", "shared_experts")


def _inverse(axes: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(axes.index(i) for i in range(len(axes)))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FragmentWeight(QuantizedWeight):
  """An NVFP4 weight of logical shape [N, K] in fragment order (module docstring)."""
  words: jax.Array         # u32 [Kc, 2, Nt * 128]
  scales: jax.Array        # u32 [Kc, Nt * 32]
  global_scale: jax.Array  # f32 []
  input_scale: jax.Array   # f32 [] (ModelOpt's, kept for the checkpoint)
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
  format: ClassVar[str] = NVFP4Weight.format
  bits_per_weight: ClassVar[float] = NVFP4Weight.bits_per_weight

  @property
  def tiles(self) -> int:
    return self.scales.shape[1] // LANES

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    """[N, K] in `dtype`, as the NVFP4Weight it came from dequantizes."""
    return from_fragments(self).dequantize(dtype)


def _words(b: jax.Array) -> jax.Array:
  """uint8 [..., 2, 2] -> u32 [...], little-endian (byte 2 i + j from [..., i, j])."""
  return lax.bitcast_convert_type(b.reshape(*b.shape[:-2], 4), jnp.uint32)


def _bytes(w: jax.Array) -> jax.Array:
  """Inverse of `_words`: u32 [...] -> uint8 [..., 2, 2]."""
  return lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape, 2, 2)


def to_fragments(w: NVFP4Weight) -> FragmentWeight:
  """A 2-D NVFP4Weight rearranged into fragment order (a copy of its 4.5 bits a weight)."""
  if w.ndim != 2:
    raise ValueError(f"to_fragments: one [N, K] weight, got shape {w.shape}")
  n, k = w.shape
  nt, kc = _cdiv(n, TILE), _cdiv(k, CHUNK)
  codes = jnp.pad(unpack_e2m1(w.packed), ((0, nt * TILE - n), (0, kc * CHUNK - k)))
  # [T, rh, g, c, h, j, ch, t, cb]: ch picks the nibble (columns + 0 / + 8)
  codes = codes.reshape(nt, 2, 8, kc, 2, 4, 2, 4, 2)
  packed = codes[..., 0, :, :] | (codes[..., 1, :, :] << 4)
  words = _words(packed.transpose(_WORD_AXES)).reshape(kc, 2, nt * WORDS)
  bits = lax.bitcast_convert_type(w.block_scale, jnp.uint8)
  bits = jnp.pad(bits, ((0, nt * TILE - n), (0, kc * STEPS - k // BLOCK)))
  scales = _words(bits.reshape(nt, 2, 8, kc, 4, 2).transpose(_SCALE_AXES)).reshape(kc, nt * LANES)
  return FragmentWeight(words, scales, w.global_scale.astype(jnp.float32), w.input_scale, (n, k))


def from_fragments(f: FragmentWeight) -> NVFP4Weight:
  """Inverse of `to_fragments`, bit for bit: the padding dropped, ModelOpt's arrays back."""
  (n, k), kc, nt = f.shape, f.scales.shape[0], f.tiles
  packed = _bytes(f.words.reshape(kc, 2, nt, 8, 4, 4)).transpose(_inverse(_WORD_AXES))
  codes = jnp.stack([packed & 0xF, packed >> 4], axis=6).reshape(nt * TILE, kc * CHUNK)
  bits = _bytes(f.scales.reshape(kc, nt, 8, 4)).transpose(_inverse(_SCALE_AXES)).reshape(nt * TILE, kc * STEPS)
  block_scale = lax.bitcast_convert_type(bits[:n, :k // BLOCK], jnp.float8_e4m3fn)
  return NVFP4Weight(pack_e2m1(codes[:n, :k]), block_scale, f.global_scale, f.input_scale)


def _is_leaf(x) -> bool:
  return isinstance(x, QuantizedWeight)


def _split(leaf: QuantizedWeight) -> bool:
  """Whether any of the leaf's concrete arrays is split over devices (not whole on each); traced
  params (arranged inside a jitted function) are taken as whole."""
  concrete = lambda a: isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
  return any(concrete(a) and not a.sharding.is_fully_replicated for a in jax.tree.leaves(leaf))


def arrange_params(params: Any, fragments: bool) -> Any:
  """Params with every 2-D NVFP4 weight that the model multiplies through `linear` in fragment
  order (fragments=True: what the fragment kernel reads), or all in ModelOpt's order (False);
  other leaves, NVFP4 experts (3-D), the RAW weights and weights split over devices as they are.
  Each moved weight is one jitted call on its device; params with nothing to move come back as
  they are (the same object)."""
  def moves(path, leaf) -> bool:
    if fragments:
      names = {getattr(key, "key", None) for key in path}
      return isinstance(leaf, NVFP4Weight) and leaf.ndim == 2 and not names & set(RAW) and not _split(leaf)
    return isinstance(leaf, FragmentWeight)
  found = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)[0]
  if not any(moves(path, leaf) for path, leaf in found):
    return params
  move = jax.jit(to_fragments if fragments else from_fragments)
  return jax.tree_util.tree_map_with_path(lambda path, leaf: move(leaf) if moves(path, leaf) else leaf, params,
                                          is_leaf=_is_leaf)
