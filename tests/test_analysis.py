"""Selection capture and overlap: the measurement behind IndexShare."""

import jax
import numpy as np
import pytest

from configs import get_model_config
from glmjax.analysis import layer_selections, overlap_matrix, selection_overlap
from glmjax.model import init_params


def test_overlap_counts_shared_tokens_and_ignores_empty_slots():
  a = np.array([[[0, 1, 2, 3], [4, 5, -1, -1]]])
  b = np.array([[[0, 1, 7, 8], [4, 9, -1, -1]]])
  assert selection_overlap(a, b) == (0.5 + 0.5) / 2
  assert selection_overlap(a, b, min_valid=3) == 0.5
  assert selection_overlap(a, a) == 1.0


def test_layer_selections_follow_the_indexshare_pattern():
  config = get_model_config("tiny")
  params = init_params(config, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(2, config.vocab_size, (1, 40))
  sel = layer_selections(config, params, tokens)
  assert list(sel) == list(range(config.num_hidden_layers))
  np.testing.assert_array_equal(sel[2], sel[1])          # layer 2 is shared: it reuses layer 1's
  assert sel[0].shape == (1, 40, config.index_topk)
  layers, m = overlap_matrix({i: sel[i] for i in config.full_indexer_layers}, min_valid=config.index_topk)
  assert layers == list(config.full_indexer_layers)
  np.testing.assert_allclose(np.diag(m), 1.0)
  assert np.all((m >= 0) & (m <= 1))


@pytest.mark.side_lane  # an entry point in its own process: beside the multi-device tests (Makefile)
def test_profile_flag_writes_a_trace(tmp_path):
  """--profile on an experiment writes an XProf/TensorBoard trace."""
  import subprocess
  import sys
  subprocess.run([sys.executable, "-m", "experiments.decode_bench", "--config=tiny2", "--contexts=40",
                  "--attention=dense", "--kv_dtype=bf16", "--new_tokens=2", "--page_size=8",
                  "--prefill_chunk=32", f"--profile={tmp_path}", f"--output={tmp_path / 'd.json'}"],
                 check=True, capture_output=True)
  assert list(tmp_path.glob("**/*.xplane.pb"))
