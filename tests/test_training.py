"""Training the mini model: tokenizer, corpus split, MTP targets, losses, resume, output folder."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import glmjax
from configs import get_model_config
from experiments import train_mini
from glmjax import data, footprint, training
from glmjax.model import CausalLM
from glmjax.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
CONFIG = TOKENIZER.configure(get_model_config("tiny"))
# Two depths: depth 2 exercises the chaining of the MTP layer's own output.
TC = training.TrainConfig(steps=20, batch_size=4, seq_len=48, lr=3e-3, warmup=4, mtp_weights=(0.15, 0.15))
# Every feature of tiny (dense and MoE layers, a full and an IndexShare layer, MTP) in two layers:
# quicker to compile for the tests that only need the model's structure.
SMALL = TOKENIZER.configure(get_model_config("tiny2"))
EMAIL = data.stdlib_root() / "email"  # 29 real source files: a small corpus with both splits
# In the second process beside the multi-device tests (Makefile), which is the shorter of the two.
pytestmark = pytest.mark.side_lane


@pytest.fixture(scope="module")
def corpus():
  return data.load_corpus(EMAIL, val_fraction=0.25)


@pytest.fixture(scope="module")
def eval_windows(corpus):
  return corpus.validation_windows(TC.seq_len, 4)


@pytest.fixture(scope="module")
def full_run(corpus, eval_windows, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("full_run")
  result = training.fit(CONFIG, TC, corpus, workdir=str(workdir), checkpoint_every=10, eval_windows=eval_windows,
                        eval_every=0, log_every=1, progress=False)
  return result, workdir


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokenizer_round_trip(seed):
  rng = np.random.default_rng(seed)
  alphabet = list("abc xyz\n\t{}()=_") + ["é", "ß", "中", "文", "🙂", "\u0000"]
  text = "".join(rng.choice(alphabet, 200))
  ids = TOKENIZER.encode(text, bos=True, eos=True)
  assert ids[0] == TOKENIZER.bos_id and ids[-1] == TOKENIZER.eos_id
  assert all(0 <= i < 256 for i in ids[1:-1]) and len(ids) == len(text.encode("utf-8")) + 2
  assert TOKENIZER.decode(ids) == text
  assert TOKENIZER.decode(TOKENIZER.encode_document(text.encode("utf-8"))) == text
  assert ByteTokenizer.from_json(TOKENIZER.to_json()) == TOKENIZER


def test_tokenizer_matches_mini_and_rejects_bad_input():
  mini = get_model_config("mini")
  assert (mini.bos_token_id, mini.eos_token_id, mini.pad_token_id, mini.vocab_size) == (
      TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.pad_id, TOKENIZER.vocab_size)
  assert TOKENIZER.configure(mini) == mini
  assert TOKENIZER.decode([0xE4, 0xB8]) == "\ufffd"  # a cut-off UTF-8 sequence is replaced, not raised
  with pytest.raises(ValueError, match="outside the vocabulary"):
    TOKENIZER.decode([65, 260])
  with pytest.raises(ValueError, match="ids below 256 are bytes"):
    ByteTokenizer(bos_id=10)
  with pytest.raises(ValueError, match="smaller than the byte tokenizer"):
    TOKENIZER.configure(dataclasses.replace(mini, vocab_size=258, pad_token_id=None))
  with pytest.raises(ValueError, match="type must be"):
    ByteTokenizer.from_json('{"type": "bpe"}')


def _write_tree(root, rng, n):
  contents = {}
  for i in range(n):
    rel = f"pkg{i % 7}/mod_{i}.py" if i % 3 else f"top_{i}.py"
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    contents[rel] = rng.integers(0, 256, rng.integers(0, 300), dtype=np.uint8).tobytes()
    path.write_bytes(contents[rel])
  (root / "site-packages" / "x").mkdir(parents=True)
  (root / "site-packages" / "x" / "skip.py").write_bytes(b"not corpus")
  (root / "notes.txt").write_bytes(b"not python")
  return contents


@pytest.mark.parametrize("seed,fraction", [(0, 0.1), (1, 0.3)])
def test_split_is_by_file_disjoint_and_deterministic(tmp_path, seed, fraction):
  contents = _write_tree(tmp_path, np.random.default_rng(seed), 120)
  corpus = data.load_corpus(tmp_path, val_fraction=fraction)
  again = data.load_corpus(tmp_path, val_fraction=fraction)
  assert set(corpus.train_files) | set(corpus.val_files) == set(contents)  # site-packages, .txt left out
  assert not set(corpus.train_files) & set(corpus.val_files)
  assert corpus.val_files == again.val_files and np.array_equal(corpus.train, again.train)
  assert all(data.is_validation(rel, fraction) for rel in corpus.val_files)
  for files, stream in ((corpus.train_files, corpus.train), (corpus.val_files, corpus.val)):
    docs = [TOKENIZER.encode_document(contents[rel]) for rel in files]  # whole files, in path order
    assert np.array_equal(stream, np.concatenate(docs))
  sizes = [len(contents[rel]) + 2 for rel in corpus.val_files]
  assert np.array_equal(corpus.val_doc_starts, np.cumsum([0] + sizes[:-1]))
  share = np.mean([data.is_validation(f"m{i}.py", fraction) for i in range(4000)])
  assert abs(share - fraction) < 0.03


def test_batches_and_validation_text(corpus):
  b = corpus.train_batch(3, batch_size=4, seq_len=32, seed=7)
  assert b.shape == (4, 33) and b.dtype == np.int32
  assert np.array_equal(b, corpus.train_batch(3, batch_size=4, seq_len=32, seed=7))
  assert not np.array_equal(b, corpus.train_batch(4, batch_size=4, seq_len=32, seed=7))
  windows = corpus.validation_windows(32, 5)
  assert np.array_equal(windows, corpus.validation_windows(32, 5))
  val = corpus.val.astype(np.int64)
  for w in windows:  # every window is a slice of the validation stream
    start = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(val, 33) == w, axis=1))
    assert len(start) >= 1
  rng = np.random.default_rng(0)
  text = corpus.sample_validation_text(rng, 500)
  assert len(text) == 500 and text[0] == TOKENIZER.bos_id
  assert any(val[s:s + 500].tolist() == text for s in corpus.val_doc_starts)  # held out, from a file's start
  with pytest.raises(ValueError, match="n_tokens"):
    corpus.sample_validation_text(rng, len(corpus.val) + 1)


def test_mtp_inputs_hand_built():
  window = jnp.array([[10, 11, 12, 13, 14, 15]])  # S = 5
  expected = {  # depth: (inputs, targets, mask)
    0: ([10, 11, 12, 13, 14], [11, 12, 13, 14, 15], [1, 1, 1, 1, 1]),
    1: ([11, 12, 13, 14, 15], [12, 13, 14, 15, 0], [1, 1, 1, 1, 0]),
    2: ([12, 13, 14, 15, 0], [13, 14, 15, 0, 0], [1, 1, 1, 0, 0]),
    3: ([13, 14, 15, 0, 0], [14, 15, 0, 0, 0], [1, 1, 0, 0, 0]),
  }
  for depth, (inputs, targets, mask) in expected.items():
    got = training.mtp_inputs(window, depth)
    assert got[0].tolist() == [inputs] and got[1].tolist() == [targets]
    assert got[2].astype(int).tolist() == [mask]


def _ce(logits, targets):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


PERTURBED = 9  # window index changed in `small`'s second window


@pytest.fixture(scope="module")
def small(corpus):
  """One compiled pass over SMALL (fp32, 2 MTP depths) giving the loss's metrics, the same
  losses computed independently on truncated sequences (causality makes the truncation exact),
  the gradient of the indexer KL, and every head's logits for a window and for a copy with
  token PERTURBED changed."""
  tc = dataclasses.replace(TC, compute_dtype="float32", seed=3)
  params = training.init_state(SMALL, tc)["params"]
  w = jnp.asarray(corpus.train_batch(0, batch_size=2, seq_len=16, seed=3))
  s = w.shape[1] - 1
  model = CausalLM(SMALL)
  metrics_of = lambda p: training.loss_fn(p, w, SMALL, tc)[1][0]
  heads = lambda p, window: training.forward_with_mtp(p, window, config=SMALL, depths=2, dtype="float32")[0]

  def by_hand(p):
    pos = jnp.broadcast_to(jnp.arange(s), (2, s))
    logits, h = model.apply({"params": p}, w[:, :s])[:2]
    losses = [_ce(logits, w[:, 1:])]
    for d in (1, 2):  # depth d feeds w[t + d] with the previous depth's hidden, predicts w[t + d + 1]
      n = s - d + 1   # positions whose input token is inside the window
      lg, h = model.apply({"params": p}, w[:, d:], h[:, :n], pos[:, :n], method=CausalLM.mtp_step)[:2]
      losses.append(_ce(lg[:, :n - 1], w[:, d + 1:]))
    return losses

  @jax.jit
  def run(p):
    kl_grads, metrics = jax.grad(lambda q: (lambda m: (m["indexer_kl"], m))(metrics_of(q)), has_aux=True)(p)
    perturbed = w.at[:, PERTURBED].set((w[:, PERTURBED] + 1) % 256)
    return dict(metrics=metrics, by_hand=by_hand(p), kl_grads=kl_grads, heads=heads(p, w),
                perturbed_heads=heads(p, perturbed))

  return run(params)


def test_mtp_losses_equal_manual_chaining(small):
  np.testing.assert_allclose(small["metrics"]["main_loss"], small["by_hand"][0], rtol=1e-5)
  np.testing.assert_allclose(small["metrics"]["mtp_loss"], small["by_hand"][1:], rtol=1e-5)


def test_heads_never_see_their_targets(small):
  """Depth d at position t reads w[0 .. t+d] only (it predicts w[t+d+1]): changing w[j] leaves
  positions t < j - d unchanged and changes position j - d, whose input token it is."""
  for d, (a, b) in enumerate(zip(small["heads"], small["perturbed_heads"])):
    np.testing.assert_allclose(a[:, :PERTURBED - d], b[:, :PERTURBED - d], atol=1e-6, err_msg=f"depth {d}")
    assert np.abs(a[:, PERTURBED - d] - b[:, PERTURBED - d]).max() > 1e-3, d


def test_indexer_loss_trains_only_the_indexer(small):
  """The KL reaches the indexers' weights and nothing else: their inputs are detached and the
  attention target is stop-gradient. (The LM losses cannot reach the indexers: top-k is discrete.)"""
  flat = traverse_util.flatten_dict(small["kl_grads"])
  indexer = [k for k in flat if "indexer" in k]
  assert len(indexer) == 2 * 5  # layer 0's and the MTP layer's: wq_b, wk, k_norm weight and bias, weights_proj
  assert all(np.any(np.asarray(flat[k])) for k in indexer)
  assert not any(np.any(np.asarray(flat[k])) for k in flat if k not in indexer)


def test_rebalance_moves_bias_against_the_load():
  params = {"layers_1": {"mlp": {"gate": {"e_score_correction_bias": jnp.zeros(4), "weight": jnp.ones((4, 2))}}}}
  loads = {("layers_1", "mlp", "gate"): jnp.array([9, 1, 2, 4])}  # mean 4
  out = training.rebalance(params, loads, 0.01)
  np.testing.assert_allclose(out["layers_1"]["mlp"]["gate"]["e_score_correction_bias"], [-0.01, 0.01, 0.01, 0.0])
  assert out["layers_1"]["mlp"]["gate"]["weight"] is params["layers_1"]["mlp"]["gate"]["weight"]


def test_loss_decreases(full_run):
  result, _ = full_run
  losses = [h["main_loss"] for h in result.history["train"]]
  assert len(losses) == TC.steps and int(result.state["step"]) == TC.steps
  assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
  ev = result.history["eval"][-1]
  assert ev["step"] == TC.steps and ev["loss"] < losses[0] - 1.0
  assert 1.0 <= ev["accept_length"] <= 1 + TC.mtp_depths and 0.0 <= ev["indexer_coverage"] <= 1.0
  assert len(ev["mtp_accuracy"]) == TC.mtp_depths and np.isfinite(ev["indexer_kl"])


def test_resume_continues_identically(full_run, corpus, eval_windows, tmp_path):
  result, full_workdir = full_run
  first = training.fit(CONFIG, TC, corpus, workdir=str(tmp_path), until=10, eval_windows=eval_windows,
                       eval_every=0, progress=False)
  assert int(first.state["step"]) == 10 and first.stopped_early
  second = training.fit(CONFIG, TC, corpus, workdir=str(tmp_path), eval_windows=eval_windows, eval_every=0,
                        log_every=1, progress=False)
  assert second.resumed_from == 10 and not second.stopped_early
  assert [h["step"] for h in second.history["train"]][-10:] == list(range(11, 21))
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), second.state["params"], result.state["params"])
  assert all(jax.tree.leaves(same))
  with pytest.raises(ValueError, match="lr="):
    training.Checkpoints(full_workdir).restore(result.state, dataclasses.replace(TC, lr=1e-3))


def test_output_dir_loads_and_has_the_card(full_run, corpus, tmp_path):
  result, _ = full_run
  facts = train_mini.run_facts(CONFIG, result, TC, corpus, TOKENIZER, command="python -m experiments.train_mini --x=1",
                               config_name="tiny", run_wall_s=1.0, log_every=1, val_fraction=0.25)
  train_mini.write_outputs(str(tmp_path), CONFIG, TOKENIZER, result, facts)
  config, loaded = glmjax.load_pretrained(tmp_path, dtype=jnp.bfloat16)
  assert config == CONFIG
  ids = np.random.default_rng(5).integers(0, 256, (2, 24))
  trained = training.cast_params(CONFIG, result.state["params"], jnp.bfloat16)
  np.testing.assert_array_equal(glmjax.forward(config, loaded, ids), glmjax.forward(CONFIG, trained, ids))
  with open(tmp_path / "tokenizer.json") as f:
    assert ByteTokenizer.from_json(f.read()) == TOKENIZER
  assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  card = (tmp_path / "README.md").read_text()
  ev = result.history["eval"][-1]
  for field in ("python -m experiments.train_mini --x=1", "| seed | 0 |", f"| steps | {TC.steps} of {TC.steps}",
                "| wall time |", f"| device | {train_mini.device_name()} |", "main-head loss",
                f"{result.history['train'][-1]['main_loss']:.4f}", f"{ev['loss']:.4f}",
                f"| 1 | {ev['mtp_loss'][0]:.4f} | {ev['mtp_accuracy'][0]:.4f}", f"| 2 | {ev['mtp_loss'][1]:.4f}",
                "accepted length"):
    assert field in card, field


def test_mini_checkpoint_fits_the_budget():
  assert footprint.checkpoint_bytes(get_model_config("mini")) <= 25e6


def test_train_config_rejects_bad_values():
  with pytest.raises(ValueError, match="warmup"):
    training.TrainConfig(steps=10, warmup=10)
  with pytest.raises(ValueError, match="seq_len"):
    training.TrainConfig(seq_len=3, mtp_weights=(0.1, 0.1, 0.1))
  with pytest.raises(ValueError, match="MTP layer"):
    training.init_state(dataclasses.replace(CONFIG, num_nextn_predict_layers=0), TC)
