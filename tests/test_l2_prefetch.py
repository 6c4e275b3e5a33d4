"""L2 prefetches (pallas_kernels/l2_prefetch.py) in the fragment GEMV (FragmentConfig.l2_ahead):
they change no bit, each covers whole chunks inside its array at the alignment the PTX asks, the
chunks of a split each once; the lowered kernel keeps them (not pure) in and before its loop."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.kernel_ir import triton_kernels
from glmjax.quant import quantize_nvfp4, to_fragments
from pallas_kernels import nvfp4_fragments
from pallas_kernels.l2_prefetch import prefetch_items
from pallas_kernels.nvfp4_fragments import FragmentConfig, fragment_matmul
from tests.fragment_checks import assert_same_product, fragment_case

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


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
  prefetch_asm = r"elementwise_inline_asm \"[^\"]*cp\.async\.bulk\.prefetch\.L2\.global[^\"]*\" \{([^}]*)\}"
  asm = re.findall(prefetch_asm, texts[2])
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
