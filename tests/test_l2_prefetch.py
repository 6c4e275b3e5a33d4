"""L2 prefetches (pallas_kernels/l2_prefetch.py) in the fragment GEMV (FragmentConfig.l2_ahead):
they change no bit, each covers whole chunks inside its array at the alignment the PTX asks, the
chunks of a split each once; the lowered kernel keeps them (not pure) in and before its loop. And
the sparse MLA launch warming a later launch's arrays (`warm`, prefetch_share): no value changes,
the programs' shares cover each array's 16-byte units once, the lowered kernel carries them."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.kernel_ir import triton_kernels
from glmjax.quant import quantize_nvfp4, to_fragments
from pallas_kernels import l2_prefetch, nvfp4_fragments
from pallas_kernels.l2_prefetch import prefetch_items
from pallas_kernels.nvfp4_fragments import FragmentConfig, fragment_matmul
from pallas_kernels.sparse_mla import SparseMLAConfig, sparse_mla_decode, sparse_mla_decode_values
from tests.fragment_checks import assert_same_product, fragment_case
from tests.test_dsa_kernels import _mla_inputs, _value_weights

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
# A prefetch's inline asm in Triton IR; group 1: its attributes (pure = false expected).
PREFETCH_ASM = r"elementwise_inline_asm \"[^\"]*cp\.async\.bulk\.prefetch\.L2\.global[^\"]*\" \{([^}]*)\}"


@pytest.mark.parametrize("m, n, k, config, operands, ahead", [
    (3, 200, 1152, FragmentConfig(tiles=4, num_warps=2, unroll=2, tile_groups=2, rows_out=True), "bfloat16", 3),
    (8, 136, 640, FragmentConfig(tiles=2, split_k=2, num_warps=1, unroll=2), "float16", 1),  # a left-over chunk
    (5, 48, 256, FragmentConfig(tiles=2, split_k=3, num_warps=2, prefetch=True), "bfloat16", 2),  # a split with none
])
def test_l2_ahead_changes_no_bit(m, n, k, config, operands, ahead):
  assert_same_product(*fragment_case(m, n, k, operands, m * 1000 + k), dataclasses.replace(config, l2_ahead=ahead),
                      config)


@pytest.mark.parametrize("n, k, config", [
    (200, 1024, FragmentConfig(tiles=4, num_warps=2, unroll=2, tile_groups=2, split_k=2, l2_ahead=1)),  # 13 tiles
    (96, 2048, FragmentConfig(tiles=2, num_warps=1, unroll=4, split_k=4, l2_ahead=2)),
    (64, 768, FragmentConfig(tiles=2, num_warps=2, unroll=1, l2_ahead=8)),  # further ahead than the split
])
def test_prefetches_cover_each_chunk_once_inside_its_array(monkeypatch, n, k, config):
  """Every program's prefetches, recorded in the interpreter: whole 16-byte units from 16-byte
  aligned words, never past the words or scales array; over the grid each word of both arrays
  prefetched exactly once (the splits here hold whole loop steps)."""
  issued = []

  def record(ref, address, *, num_warps):
    jax.debug.callback(lambda o, b, size=ref.shape[0]: issued.append((size, np.asarray(o), np.asarray(b))),
                       *prefetch_items(address, num_warps=num_warps))

  monkeypatch.setattr(nvfp4_fragments, "prefetch_l2", record)
  x, f = fragment_case(2, n, k, "bfloat16", n + k)
  jax.block_until_ready(fragment_matmul(x, f, config=config))
  for size in (f.words.size, f.scales.size):
    counts = np.zeros(size, np.int64)
    for array_size, offsets, nbytes in issued:
      if array_size != size:
        continue
      for offset, bytes_ in zip(offsets[nbytes > 0], nbytes[nbytes > 0]):
        assert bytes_ % 16 == 0 and offset * 4 % 16 == 0 and 0 <= offset and offset + bytes_ // 4 <= size
        counts[offset:offset + bytes_ // 4] += 1
    np.testing.assert_array_equal(counts, 1)


def test_lowered_kernel_keeps_its_prefetches():
  """l2_ahead's kernel carries the prefetch PTX, not pure (so no pass drops it), for the words and
  the scales, before the loop and in it; without it, none."""
  w = jax.eval_shape(lambda a: to_fragments(quantize_nvfp4(a), "bfloat16"), jax.ShapeDtypeStruct((200, 1024),
                                                                                                   jnp.float32))
  x = jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16)
  texts = {}
  for ahead in (0, 2):
    config = FragmentConfig(tiles=4, num_warps=2, unroll=2, tile_groups=2, rows_out=True, l2_ahead=ahead)
    [(_, text)] = triton_kernels(functools.partial(fragment_matmul, config=config, interpret=False), x, w)
    texts[ahead] = text
  asm = re.findall(PREFETCH_ASM, texts[2])
  assert len(asm) == 4 and all("pure = false" in attrs for attrs in asm)
  loop = texts[2][texts[2].index("scf.for"):]
  assert loop.count("cp.async.bulk.prefetch") == 2
  assert "cp.async.bulk.prefetch" not in texts[0]


def test_l2_ahead_bad_values_are_named():
  with pytest.raises(ValueError, match="l2_ahead must be >= 0, got -1"):
    FragmentConfig(l2_ahead=-1)
  FragmentConfig(tiles=2, num_warps=1, l2_ahead=16)  # two items a chunk, 32 threads
  with pytest.raises(ValueError, match="1 warps reach 16 chunks a call; got l2_ahead=17"):
    FragmentConfig(tiles=2, num_warps=1, l2_ahead=17)


def _warm_arrays():
  """Arrays as a layer's o_proj weight may be: bf16 (odd shape), NVFP4 codes (uint8), e4m3 scales,
  and an fp32 per-tensor scale under 16 bytes (nothing to prefetch)."""
  rng = np.random.default_rng(3)
  return (jnp.asarray(rng.standard_normal((37, 70)), jnp.bfloat16),
          jnp.asarray(rng.integers(0, 256, (29, 35)), jnp.uint8),
          jnp.asarray(rng.standard_normal((29, 5)), jnp.float8_e4m3fn), jnp.float32(0.5))


def test_warming_changes_no_value():
  """The sparse MLA launch with arrays to warm (inputs between its caches and its outputs) computes
  what it computes without them, bit for bit: the states, and the merge with kv_b's value half."""
  args = _mla_inputs(91, 3, True, k=96)
  kv_b = _value_weights(92, 4, 16, 24, 64, jnp.bfloat16)
  config = SparseMLAConfig(block_n=16)
  plain = sparse_mla_decode(*args, softmax_scale=0.1, config=config)
  warmed = sparse_mla_decode(*args, softmax_scale=0.1, config=config, warm=_warm_arrays())
  np.testing.assert_array_equal(np.asarray(warmed), np.asarray(plain))
  values = functools.partial(sparse_mla_decode_values, *args, kv_b, nope=16, softmax_scale=0.1, config=config)
  np.testing.assert_array_equal(np.asarray(values(warm=_warm_arrays()[:1])), np.asarray(values()))


@pytest.mark.parametrize("programs, num_warps", [(7, 1), (160, 4), (1, 2)])
def test_program_shares_cover_each_unit_once(monkeypatch, programs, num_warps):
  """prefetch_share over a grid's programs, recorded: each item whole 16-byte units from a 16-byte
  aligned element inside its array; over the programs every unit of the array's whole 16-byte
  units prefetched exactly once (a tail past them, and an array under 16 bytes, not at all)."""
  for array in _warm_arrays():
    issued = []

    def record(ref, address, *, num_warps):
      issued.append(tuple(np.asarray(a) for a in prefetch_items(address, num_warps=num_warps)))

    monkeypatch.setattr(l2_prefetch, "prefetch_l2", record)
    for program in range(programs):
      l2_prefetch.prefetch_share(array, program=jnp.int32(program), programs=programs, num_warps=num_warps)
    size = array.size * array.dtype.itemsize
    counts = np.zeros(size, np.int64)
    for offsets, nbytes in issued:
      for offset, bytes_ in zip(offsets[nbytes > 0], nbytes[nbytes > 0]):
        start = offset * array.dtype.itemsize
        assert bytes_ % 16 == 0 and start % 16 == 0 and start + bytes_ <= size
        counts[start:start + bytes_] += 1
    np.testing.assert_array_equal(counts[:size // 16 * 16], 1)
    np.testing.assert_array_equal(counts[size // 16 * 16:], 0)


def test_lowered_attention_carries_the_warming():
  """The sparse MLA launch lowered for an H200 with an array to warm issues the prefetch PTX (not
  pure); without one, none."""
  s = jax.ShapeDtypeStruct
  pages, page, rank = 65, 64, 512
  args = (s((1, 5, 8, rank), jnp.bfloat16), s((1, 5, 8, 64), jnp.bfloat16), s((pages, page, rank), jnp.float8_e4m3fn),
          s((pages, page, rank // 128), jnp.float32), s((pages, page, 64), jnp.bfloat16), s((1, 64), jnp.int32),
          s((1, 5, 2048), jnp.int32))
  w = s((6144, 2048), jnp.bfloat16)
  text = lambda *warm: "".join(t for _, t in triton_kernels(
      lambda *a: sparse_mla_decode(*a[:7], softmax_scale=0.1, interpret=False, warm=a[7:]), *args, *warm))
  asm = re.findall(PREFETCH_ASM, text(w))
  assert len(asm) == 1 and "pure = false" in asm[0]
  assert "cp.async.bulk.prefetch" not in text()
