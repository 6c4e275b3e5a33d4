"""NVFP4 weights rearranged into mma.sync's fragment order: the layout that
pallas_kernels/nvfp4_fragments.py reads (its docstring describes every word), as a pytree leaf.

The same 4.5 bits a weight as the ModelOpt NVFP4Weight it comes from, moved once when the params
are loaded (`arrange_params`), never per call, and moved back exactly (`from_fragments`: the
checkpoint and every non-kernel path see ModelOpt's tensors).

  words   u32 [Kc, 2, Nt * 128]  tile T (16 rows), chunk c (128 inputs): each lane's A fragments
  scales  u32 [Kc, Nt * 32]      the e4m3 block scales of rows g and g + 8, four a word
N and K are zero-padded to whole tiles and chunks (zero codes and scales add nothing). Stacked
experts [E, N, K] hold each expert's arrays behind an expert axis (words [E, Kc, 2, Nt * 128]).
"""

import dataclasses
import functools
import math
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
# Per operand dtype of the kernel's MMA (FragmentWeight.operands): the codes' dims past [T, rh, g,
# c], the nibble's axis among them, the axes that take the packed bytes to the words' order [c, h,
# T, g, t, j, rh, cb], the scale bytes' dims past [T, rh, g, c] and the axes to the scale words'.
# float16: codes [T, rh, g, c, h, j, ch, t, cb] (row 16 T + g + 8 rh, column 128 c + 16 (4h + j) +
#   8 ch + 2t + cb, ch the nibble); scale bytes [T, rh, g, c, j, q] (block 8 c + 2 j + q) ->
#   [c, T, g, j, q, rh].
# bfloat16 (K permuted inside each half-chunk, so a lane's activations are contiguous in x's row):
#   codes [T, rh, g, c, h, t, j, ch, cb] (column 128 c + 64 h + 16 t + 4 j + 2 ch + cb); scale
#   bytes [T, rh, g, c, h, t] (block 8 c + 4 h + t) -> [c, T, g, t, h, rh].
OPERANDS = ("float16", "bfloat16")
# arrange_params' choices: an operand dtype for every weight, or "auto": each weight's own by its
# size. bf16 operands save the activations launch, fp16 ones decode in fewer instructions; on the
# H200 (BENCHMARKS.md run 33, M = 5, one call each) bf16 won at 12.6M weights (5.6 against 7.4 us),
# tied at 25.2M (8.3-9.2 against 8.6-9.3) and lost from 75.5M up (22.0 against 17.1 at 75.5M,
# 54.4 against 46.8 at 235M).
OPERAND_CHOICES = (*OPERANDS, "auto")
AUTO_BF16_MAX_WEIGHTS = 1 << 25  # "auto": bf16 operands up to this many weights (N * K), fp16 above
_ORDERS = {"float16": ((2, 4, 2, 4, 2), 6, (3, 4, 0, 2, 6, 5, 1, 7), (4, 2), (3, 0, 2, 4, 5, 1)),
           "bfloat16": ((2, 4, 4, 2, 2), 7, (3, 4, 0, 2, 5, 6, 1, 7), (2, 4), (3, 0, 2, 5, 4, 1))}
# bfloat16 words also move their bits: a word in float16's bit order holds code k (< 4) in the low
# nibble of byte k and code 4 + k in its high nibble (bits s e1 e0 m); a bf16 half of the decode
# needs s and e1 at bits 7 and 0 of its high byte, e0 and m at 7 and 6 of its low byte. Moved, code
# k's s, e1, e0, m sit at bits 8k + (7, 0, 6, 5) and code 4 + k's at 8k + (11 mod 32, 4, 2, 1),
# so the PTX takes the four codes' high bytes and their low bytes each with one rotation and one
# mask (nvfp4_fragments' bf16 decode). (bits of the plain word, their left rotation):
_BF16_MOVES = ((0x03030303, 5), (0x44444444, 30), (0x88888888, 4), (0x30303030, 29))
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
  """An NVFP4 weight of logical shape [N, K], or stacked experts [E, N, K], in fragment order
  (module docstring) for an MMA on `operands` (OPERANDS: the orders differ in which columns a
  word's codes hold)."""
  words: jax.Array         # u32 [(E,) Kc, 2, Nt * 128]
  scales: jax.Array        # u32 [(E,) Kc, Nt * 32]
  global_scale: jax.Array  # f32 [(E)]
  input_scale: jax.Array   # f32 [(E)] (ModelOpt's, kept for the checkpoint)
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  operands: str = dataclasses.field(default="float16", metadata=dict(static=True))
  format: ClassVar[str] = NVFP4Weight.format
  bits_per_weight: ClassVar[float] = NVFP4Weight.bits_per_weight

  @property
  def tiles(self) -> int:
    return self.scales.shape[-1] // LANES

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    """[(E,) N, K] in `dtype`, as the NVFP4Weight it came from dequantizes."""
    return from_fragments(self).dequantize(dtype)


def operands_for(shape: tuple[int, ...], choice: str) -> str:
  """The operand dtype that arrange_params gives a [N, K] weight under `choice` (OPERAND_CHOICES)."""
  if choice not in OPERAND_CHOICES:
    raise ValueError(f"fragment operands must be one of {OPERAND_CHOICES}, got {choice!r}")
  if choice != "auto":
    return choice
  return "bfloat16" if math.prod(shape) <= AUTO_BF16_MAX_WEIGHTS else "float16"


def _rotl(w: jax.Array, r: int) -> jax.Array:
  """u32 w rotated left by r in [1, 31]."""
  return (w << r) | (w >> (32 - r))


def bf16_word_bits(words: jax.Array) -> jax.Array:
  """u32 code words in float16's bit order -> bfloat16's (_BF16_MOVES)."""
  return functools.reduce(jnp.bitwise_or, (_rotl(words & jnp.uint32(m), r) for m, r in _BF16_MOVES))


def plain_word_bits(words: jax.Array) -> jax.Array:
  """Inverse of `bf16_word_bits`."""
  # each mask's bits where they went, rotated back
  return functools.reduce(jnp.bitwise_or, (_rotl(words & _rotl(jnp.uint32(m), r), 32 - r) for m, r in _BF16_MOVES))


def _words(b: jax.Array) -> jax.Array:
  """uint8 [..., 2, 2] -> u32 [...], little-endian (byte 2 i + j from [..., i, j])."""
  return lax.bitcast_convert_type(b.reshape(*b.shape[:-2], 4), jnp.uint32)


def _bytes(w: jax.Array) -> jax.Array:
  """Inverse of `_words`: u32 [...] -> uint8 [..., 2, 2]."""
  return lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape, 2, 2)


def to_fragments(w: NVFP4Weight, operands: str = "float16") -> FragmentWeight:
  """An NVFP4Weight [N, K], or stacked experts [E, N, K] (each rearranged alone), in fragment
  order for an MMA on `operands` (a copy of its 4.5 bits a weight)."""
  if w.ndim not in (2, 3):
    raise ValueError(f"to_fragments: one [N, K] weight or stacked experts [E, N, K], got shape {w.shape}")
  if operands not in OPERANDS:
    raise ValueError(f"to_fragments: operands must be one of {OPERANDS}, got {operands!r}")
  if w.ndim == 3:
    return dataclasses.replace(jax.vmap(functools.partial(to_fragments, operands=operands))(w), shape=w.shape)
  code_dims, nibble, word_axes, scale_dims, scale_axes = _ORDERS[operands]
  n, k = w.shape
  nt, kc = _cdiv(n, TILE), _cdiv(k, CHUNK)
  codes = jnp.pad(unpack_e2m1(w.packed), ((0, nt * TILE - n), (0, kc * CHUNK - k)))
  codes = codes.reshape(nt, 2, 8, kc, *code_dims)
  packed = jnp.take(codes, 0, nibble) | (jnp.take(codes, 1, nibble) << 4)
  words = _words(packed.transpose(word_axes)).reshape(kc, 2, nt * WORDS)
  if operands == "bfloat16":
    words = bf16_word_bits(words)
  bits = lax.bitcast_convert_type(w.block_scale, jnp.uint8)
  bits = jnp.pad(bits, ((0, nt * TILE - n), (0, kc * STEPS - k // BLOCK)))
  scales = _words(bits.reshape(nt, 2, 8, kc, *scale_dims).transpose(scale_axes)).reshape(kc, nt * LANES)
  return FragmentWeight(words, scales, w.global_scale.astype(jnp.float32), w.input_scale, (n, k), operands)


def from_fragments(f: FragmentWeight) -> NVFP4Weight:
  """Inverse of `to_fragments`, bit for bit: the padding dropped, ModelOpt's arrays back."""
  if len(f.shape) == 3:
    return jax.vmap(from_fragments)(dataclasses.replace(f, shape=f.shape[1:]))
  (n, k), kc, nt = f.shape, f.scales.shape[0], f.tiles
  _, nibble, word_axes, _, scale_axes = _ORDERS[f.operands]
  words = plain_word_bits(f.words) if f.operands == "bfloat16" else f.words
  packed = _bytes(words.reshape(kc, 2, nt, 8, 4, 4)).transpose(_inverse(word_axes))
  codes = jnp.stack([packed & 0xF, packed >> 4], axis=nibble).reshape(nt * TILE, kc * CHUNK)
  bits = _bytes(f.scales.reshape(kc, nt, 8, 4)).transpose(_inverse(scale_axes)).reshape(nt * TILE, kc * STEPS)
  block_scale = lax.bitcast_convert_type(bits[:n, :k // BLOCK], jnp.float8_e4m3fn)
  return NVFP4Weight(pack_e2m1(codes[:n, :k]), block_scale, f.global_scale, f.input_scale)


def _is_leaf(x) -> bool:
  return isinstance(x, QuantizedWeight)


def _split(leaf: QuantizedWeight) -> bool:
  """Whether any of the leaf's concrete arrays is split over devices (not whole on each); traced
  params (arranged inside a jitted function) are taken as whole."""
  concrete = lambda a: isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
  return any(concrete(a) and not a.sharding.is_fully_replicated for a in jax.tree.leaves(leaf))


def arrange_params(params: Any, fragments: bool, operands: str = "auto", experts: bool = False,
                   expert_operands: str = "bfloat16") -> Any:
  """Params with every 2-D NVFP4 weight that the model multiplies through `linear` in fragment
  order for an MMA on `operands` (OPERAND_CHOICES; "auto": each weight's by `operands_for`)
  (fragments=True: what the fragment kernel reads), or all in ModelOpt's order (False); with
  experts too, the stacked routed experts (3-D NVFP4, under "experts") in fragment order on
  `expert_operands` (OPERANDS; what pallas_kernels/moe_fragments.py reads). Other leaves, the RAW
  weights and weights split over devices stay as they are. Each moved weight is one jitted call on its
  device; params with nothing to move come back as they are (the same object)."""
  operands_for((), operands)  # a clear error for a bad choice
  if expert_operands not in OPERANDS:
    raise ValueError(f"expert operands must be one of {OPERANDS}, got {expert_operands!r}")
  experts = fragments and experts

  def arranged(leaf) -> bool:  # whether a weight of its kind goes to fragment order
    return experts if leaf.ndim == 3 else fragments

  def wanted(leaf) -> str:  # the operands a weight to move takes
    return expert_operands if leaf.ndim == 3 else operands_for(leaf.shape, operands)

  def moves(path, leaf) -> bool:
    if isinstance(leaf, FragmentWeight):
      return not arranged(leaf) or leaf.operands != wanted(leaf)
    names = {getattr(key, "key", None) for key in path}
    takes = leaf.ndim == 2 and fragments or leaf.ndim == 3 and experts and "experts" in names
    return isinstance(leaf, NVFP4Weight) and takes and not names & set(RAW) and not _split(leaf)
  found = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)[0]
  if not any(moves(path, leaf) for path, leaf in found):
    return params
  to = {choice: jax.jit(functools.partial(to_fragments, operands=choice)) for choice in OPERANDS}
  back = jax.jit(from_fragments)

  def move(leaf):
    raw = back(leaf) if isinstance(leaf, FragmentWeight) else leaf
    return to[wanted(leaf)](raw) if arranged(leaf) else raw
  return jax.tree_util.tree_map_with_path(lambda path, leaf: move(leaf) if moves(path, leaf) else leaf, params,
                                          is_leaf=_is_leaf)
