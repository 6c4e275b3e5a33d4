"""experiments/hf_peer.py's own logic (no torch here): decode timing, token comparison, prompts."""

import pathlib

import numpy as np
import pytest

from experiments import hf_peer
from glmjax.config import ModelConfig

MINI = pathlib.Path(__file__).resolve().parents[1] / "checkpoints" / "mini"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_rate_counts_steps_between_first_and_last_token(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 50))
  start, steps = rng.uniform(0.1, 5.0), rng.uniform(1e-4, 1e-2, n - 1)  # prefill, then n - 1 steps
  times = np.concatenate([[start], start + np.cumsum(steps)]).tolist()
  assert hf_peer.decode_tokens_per_s(times) == pytest.approx((n - 1) / steps.sum(), rel=1e-9)


@pytest.mark.parametrize("times, match", [([1.0], ">= 2 tokens"), ([2.0, 2.0], "increase"),
                                          ([3.0, 1.0, 2.0], "increase")])
def test_decode_rate_refuses_unusable_times(times, match):
  with pytest.raises(ValueError, match=match):
    hf_peer.decode_tokens_per_s(times)


@pytest.mark.parametrize("seed", range(4))
def test_first_mismatch_finds_the_changed_position(seed):
  rng = np.random.default_rng(seed)
  reference = rng.integers(0, 260, 40).tolist()
  at = int(rng.integers(0, 40))
  changed = reference[:at] + [(reference[at] + 1 + int(rng.integers(0, 258))) % 260] + reference[at + 1:]
  assert hf_peer.first_mismatch(reference, list(reference)) is None
  assert hf_peer.first_mismatch(reference, changed) == at
  assert hf_peer.first_mismatch(reference, reference[:at]) == at   # a prefix parts where it ends
  assert hf_peer.first_mismatch(reference[:at], reference) == at


@pytest.mark.parametrize("seed", [0, 1])
def test_compare_reports_ratio_and_the_peer_margin_at_the_mismatch(seed):
  rng = np.random.default_rng(seed)
  prompt_len, new, vocab = 7, 9, 260
  logits = rng.normal(size=(prompt_len + new, vocab)).astype(np.float32)
  tokens = rng.integers(0, vocab, new).tolist()
  at = int(rng.integers(0, new))
  ours = tokens[:at] + [(tokens[at] + 1) % vocab] + tokens[at + 1:]
  peer = dict(decode_tokens_per_s=float(rng.uniform(1, 100)), tokens=tokens)
  mine = dict(decode_tokens_per_s=float(rng.uniform(100, 1000)), tokens=ours)
  got = hf_peer.compare(peer, mine, logits, prompt_len)
  row = logits[prompt_len - 1 + at]   # the logits that chose generated token `at`
  assert got == dict(speedup=pytest.approx(mine["decode_tokens_per_s"] / peer["decode_tokens_per_s"]),
                     identical=False, first_mismatch=at,
                     margin=pytest.approx(float(row[tokens[at]] - row[ours[at]])))
  same = hf_peer.compare(peer, dict(mine, tokens=list(tokens)), logits, prompt_len)
  assert same["identical"] and same["first_mismatch"] is None and same["margin"] is None


@pytest.mark.parametrize("seed", [0, 3])
def test_prompts_are_text_from_a_document_start_or_random_ids(seed):
  config = ModelConfig.from_hf(MINI)
  text = hf_peer.make_prompt(config, str(MINI), 50, "auto", seed)   # the checkpoint has a tokenizer.json
  assert len(text) == 50 and text[0] == config.bos_token_id
  assert text == hf_peer.make_prompt(config, str(MINI), 50, "validation", seed)
  ids = hf_peer.make_prompt(config, str(MINI), 50, "random", seed)
  assert len(ids) == 50 and min(ids) >= 2 and max(ids) < config.vocab_size
  assert ids != hf_peer.make_prompt(config, str(MINI), 50, "random", seed + 1)
