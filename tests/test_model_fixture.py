"""The model against transformers' GlmMoeDsaForCausalLM on the shared tiny checkpoint."""

import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.engine import steps
from glmjax.runtime import Runtime
from tests.conftest import rel_err

TORCH_TIES = Runtime(attention="dense", topk_ties="torch_cpu")


def test_fp32_logits_match_transformers(fixture_fp32, reference):
  config, params = fixture_fp32
  logits = glmjax.forward(config, params, reference["input_ids"], runtime=TORCH_TIES)
  assert logits.dtype == jnp.float32 and logits.shape == reference["logits"].shape
  assert rel_err(logits, reference["logits"]) <= 1e-5


def test_bf16_logits_close_per_position(fixture_bf16, reference):
  """bf16 compute: the median position is within 2e-2 of the fp32 reference.

  Not the whole tensor: in this random model, bf16 rounding flips discrete choices (the routed
  experts of some tokens, indexer selections among scores that tie at exactly 0 after ReLU), and a
  flipped choice moves that position's logits by 0.1-0.5. The median bounds the arithmetic.
  """
  config, params = fixture_bf16
  logits = np.asarray(glmjax.forward(config, params, reference["input_ids"], runtime=TORCH_TIES))
  errors = [rel_err(logits[b, t], reference["logits"][b, t]) for b in range(2) for t in range(logits.shape[1])]
  assert np.median(errors) <= 2e-2


def test_glmjax_tie_rule_differs_only_at_ties(fixture_fp32, reference):
  """With the default tie rule (lower position wins) positions without ties still agree."""
  config, params = fixture_fp32
  logits = np.asarray(glmjax.forward(config, params, reference["input_ids"]))
  assert rel_err(logits[:, :config.index_topk], reference["logits"][:, :config.index_topk]) <= 1e-5


def test_generate_reproduces_transformers_greedy(fixture_fp32, reference):
  """Prefill then on-device decode through fp32 pages gives transformers' tokens exactly."""
  config, params = fixture_fp32
  out = glmjax.generate(config, params, reference["prompt"], 12, ignore_eos=True, runtime=TORCH_TIES)
  np.testing.assert_array_equal(out, reference["greedy"])


@pytest.mark.parametrize("attention", ["dense"])
def test_generate_matches_teacher_forced_forward(fixture_fp32, reference, attention):
  """Incremental decode through the paged cache equals the no-cache forward on its own output."""
  config, params = fixture_fp32
  out = glmjax.generate(config, params, reference["prompt"], 12, ignore_eos=True,
                        runtime=Runtime(attention=attention), page_size=8)
  assert out.shape == (2, 24) and out.dtype == np.int32
  np.testing.assert_array_equal(out[:, :12], reference["prompt"])
  logits = np.asarray(glmjax.forward(config, params, out))
  np.testing.assert_array_equal(np.argmax(logits[:, 11:-1], -1), out[:, 12:])


def test_generate_reuses_its_programs_across_lengths(fixture_fp32, reference):
  """Prompts of 9 and 12 tokens with 3 and 4 new ones fall in one bucket (a 16-token prefill
  chunk, 2 pages of 8, 4 decode steps): the second call compiles nothing, and each call's tokens
  are the forward pass's greedy choices on its own output."""
  config, params = fixture_fp32
  programs = lambda: (steps.prefill_chunk._cache_size(), steps.decode_loop._cache_size())
  for length, new in ((9, 3), (12, 4)):
    out = glmjax.generate(config, params, reference["prompt"][:, :length], new, ignore_eos=True, page_size=8)
    assert out.shape == (2, length + new)
    logits = np.asarray(glmjax.forward(config, params, out))
    np.testing.assert_array_equal(np.argmax(logits[:, length - 1:-1], -1), out[:, length:])
    if length == 9:
      compiled = programs()
  assert programs() == compiled


def test_bad_tokens_and_context_are_refused(fixture_fp32):
  config, params = fixture_fp32
  with pytest.raises(ValueError, match="outside the vocabulary"):
    glmjax.forward(config, params, np.array([[1, config.vocab_size]]))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    glmjax.generate(config, params, np.array([[-1, 2]]), 2)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    glmjax.generate(config, params, np.ones((1, 8), np.int32), config.max_position_embeddings)
