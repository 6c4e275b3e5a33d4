"""The shipped trained mini model: loadable, documented, and its MTP head drafts well."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.data import load_corpus
from glmjax.engine.engine import Engine
from glmjax.engine.speculative import SpecConfig
from glmjax.runtime import make_runtime

CHECKPOINT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints" / "mini"


def test_card_and_size():
  card = (CHECKPOINT / "README.md").read_text()
  assert "python -m experiments.train_mini" in card and "validation" in card and "seed" in card
  assert (CHECKPOINT / "model.safetensors").stat().st_size <= 25e6
  assert (CHECKPOINT / "tokenizer.json").exists()


@pytest.mark.side_lane  # 20 s on 2 cores: beside the multi-device tests (Makefile)
def test_mtp_acceptance_on_held_out_text():
  """Greedy, k = 4 drafts, held-out stdlib text within the trained context (512): at least 3.0
  tokens per verify step (measured 3.55 when written), and exactly the plain greedy tokens."""
  config, params = glmjax.load_pretrained(CHECKPOINT, dtype=jnp.bfloat16)
  prompt = load_corpus().sample_validation_text(np.random.default_rng(1), 200)
  def run(spec):
    engine = Engine(config, params, runtime=make_runtime(config, attention="sparse"), num_pages=64,
                    page_size=16, max_seq_len=512, mtp_cache=spec is not None)
    return engine.run_round([engine.open_session()], [prompt], 40, ignore_eos=True, spec=spec)[0]
  spec = run(SpecConfig(num_draft=4, threshold=0.0))
  assert spec.output == run(None).output
  assert spec.acceptance_length >= 3.0
