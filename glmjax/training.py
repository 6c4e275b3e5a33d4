"""Training: next-token and MTP losses, DSA indexer distillation, expert balancing, evaluation.

On a window w [B, S+1] (inputs w[:, :S]):
- main loss: next-token cross-entropy of CausalLM's logits against w[:, 1:].
- MTP (DeepSeek-V3 / GLM-5): ONE MTP layer whose parameters are shared by D depths. Depth 1 joins
  the main model's final normed hidden at t with the embedding of w[t+1] and predicts w[t+2];
  depth d > 1 joins the MTP layer's own pre-norm output of depth d-1 with w[t+d] and predicts
  w[t+d+1]. Positions t >= S-d have no target in the window and are masked (`mtp_inputs`).
  Gradients of every depth reach the main model, as in DeepSeek-V3.
- indexer (DeepSeek-V3.2): the DSA top-k is discrete, so no LM gradient reaches the lightning
  indexer. Each running indexer learns KL(attention || softmax(index scores)) over the causal
  keys, against the head-mean dense attention (no top-k, stop-gradient) of the layers that use
  its selection: its own and the IndexShare layers that reuse it. Its inputs are detached, so
  this loss trains the indexer only.
- expert balance (DeepSeek-V3, auxiliary-loss-free): the routers' correction bias gets no
  gradient (it only steers the choice); after each step it moves by
  balance_rate * sign(mean load - expert load).

The indexer and router quantities live inside the model; a Flax method interceptor (`_Probe`)
reads them during the forward without changing the model code.

Precision: fp32 master weights and AdamW state; the loss runs on params cast to the compute dtype
(bf16), the model keeping fp32 where it does (residual stream, router, indexer, logits).
"""

import dataclasses
import functools
import inspect
import json
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import traverse_util
from tqdm import tqdm

from glmjax import dsa
from glmjax.attention import Indexer, MLAttention
from glmjax.config import ModelConfig
from glmjax.data import Corpus
from glmjax.model import CausalLM, abstract_params, init_params
from glmjax.moe import Router

DTYPES = ("bfloat16", "float32")


def split_mtp_weight(total: float, depths: int) -> tuple[float, ...]:
  """`total` spread evenly over the depths (DeepSeek-V3's lambda / D)."""
  return (total / depths,) * depths


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that decides the numbers a run produces (a resumed run must match it)."""
  steps: int = 3000
  batch_size: int = 64
  seq_len: int = 512
  lr: float = 2e-3
  warmup: int = 200
  final_lr_fraction: float = 0.1  # cosine decay ends at lr * this
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  mtp_weights: tuple[float, ...] = split_mtp_weight(0.3, 3)  # one per MTP depth
  indexer_weight: float = 1.0
  balance_rate: float = 1e-3
  compute_dtype: str = "bfloat16"
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if not 0 <= self.warmup < self.steps:
      raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")
    if self.seq_len <= self.mtp_depths:
      raise ValueError(f"seq_len {self.seq_len} leaves no MTP target for {self.mtp_depths} depths")
    if any(w < 0 for w in self.mtp_weights):
      raise ValueError(f"mtp_weights must be non-negative, got {self.mtp_weights}")
    if self.compute_dtype not in DTYPES:
      raise ValueError(f"compute_dtype must be one of {DTYPES}, got {self.compute_dtype!r}")
    object.__setattr__(self, "mtp_weights", tuple(float(w) for w in self.mtp_weights))

  @property
  def mtp_depths(self) -> int:
    return len(self.mtp_weights)


def check_model(config: ModelConfig, depths: int) -> None:
  if depths and not config.num_nextn_predict_layers:
    raise ValueError(f"{depths} MTP depths need an MTP layer, but num_nextn_predict_layers is 0")


# ---------------------------------------------------------------------------------------------
# Forward with the auxiliary quantities


def _shift(x: jax.Array, d: int, length: int) -> jax.Array:
  """x[:, d : d + length], zero-padded on the right to `length`."""
  part = x[:, d:d + length]
  return jnp.pad(part, ((0, 0), (0, length - part.shape[1])))


def mtp_inputs(window: jax.Array, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Depth d's (input tokens [B, S], targets [B, S], mask [1, S]) for window [B, S+1].

  Depth 0 is the main model: inputs w[t], targets w[t+1]. Depth d >= 1 is the MTP layer's d-th
  draft: at position t it embeds w[t+d] and predicts w[t+d+1]; positions t >= S-d fall past
  the window (padding, masked out).
  """
  s = window.shape[1] - 1
  mask = (jnp.arange(s) < s - depth)[None]
  return _shift(window, depth, s), _shift(window, depth + 1, s), mask


def cast_params(config: ModelConfig, params, dtype):
  """params in `dtype` with the leaf dtypes the model creates (the routers' bias stays fp32)."""
  like = nn.unbox(abstract_params(config, param_dtype=jnp.dtype(dtype)))
  return jax.tree.map(lambda x, a: x.astype(a.dtype), params, like)


def attention_target(config: ModelConfig, q_nope, q_pe, latent, k_pe, kv_b, positions) -> jax.Array:
  """Head-mean causal attention probabilities [B, T, S] over every key (no top-k), stop-gradient:
  the ranking the indexer should learn. Inputs as MLAttention's reference path takes them; the
  scores are formed in latent space (kv_b's key half folded into q), in fp32 at the default
  matmul precision (TF32 on the GPU: a target needs no more)."""
  c = config
  f32 = lambda x: jax.lax.stop_gradient(x).astype(jnp.float32)
  w_uk = f32(kv_b).reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)[:, :c.qk_nope_head_dim]
  q_latent = jnp.einsum("bthn,hnr->bthr", f32(q_nope), w_uk)
  logits = (jnp.einsum("bthr,bsr->bhts", q_latent, f32(latent))
            + jnp.einsum("bthp,bsp->bhts", f32(q_pe), f32(k_pe))) * c.softmax_scale
  valid = dsa.causal_valid(positions, latent.shape[1])
  return jnp.mean(jax.nn.softmax(jnp.where(valid[:, None], logits, -jnp.inf), axis=-1), axis=1)


_REFERENCE_SIGNATURE = inspect.signature(MLAttention._reference)


class _Probe:
  """Method interceptor for one traced forward (`nn.intercept_methods`).

  Detaches the indexers' inputs, records per running indexer its (q, weights, k) and the
  attention targets of the layers using its selection, and counts each router's choices.
  Everything it holds is a tracer of the function that ran the forward; use it there.
  """

  def __init__(self, config: ModelConfig):
    self.config = config
    self.groups: list[tuple[tuple, jax.Array, list[jax.Array]]] = []  # ((q, w, k), positions, targets)
    self.loads: dict[tuple[str, ...], jax.Array] = {}                   # router path -> counts [E]

  def __call__(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if isinstance(module, Indexer) and method == "__call__":
      return next_fun(*jax.lax.stop_gradient(args), **kwargs)
    if isinstance(module, Router) and method == "__call__":
      choice = next_fun(*args, **kwargs)
      counts = jnp.bincount(choice.ids.ravel(), length=self.config.n_routed_experts)
      self.loads[module.path] = self.loads.get(module.path, 0) + counts
      return choice
    if isinstance(module, MLAttention) and method == "_reference":
      a = _REFERENCE_SIGNATURE.bind(module, *args, **kwargs).arguments
      target = attention_target(self.config, a["q_nope"], a["q_pe"], a["latent"], a["k_pe"], a["kv_b"],
                                a["positions"])
      if a["idx"] is not None:
        self.groups.append((a["idx"], a["positions"], [target]))
      else:  # an IndexShare layer: it attends over the last running indexer's selection
        self.groups[-1][2].append(target)
    return next_fun(*args, **kwargs)

  def indexer_terms(self, row_weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(KL(target || indexer) per query, share of the target's mass inside the top-k), each a
    row_weight-weighted mean over rows and positions, averaged over the indexers."""
    kl, coverage = [], []
    row_weight = row_weight / jnp.sum(row_weight)
    for (q, w, k), positions, targets in self.groups:
      valid = dsa.causal_valid(positions, k.shape[1])
      p = jnp.mean(jnp.stack(targets), axis=0)
      scores = dsa.index_scores(q, w, k, valid)
      log_q = jnp.where(valid, jax.nn.log_softmax(scores, axis=-1), 0.0)
      per_query = jnp.sum(jax.scipy.special.xlogy(p, p) - p * log_q, axis=-1)        # [B, T]
      kl.append(jnp.sum(jnp.mean(per_query, axis=1) * row_weight))
      chosen = dsa.selection_mask(jax.lax.stop_gradient(dsa.select_topk(scores, self.config.index_topk)),
                                  k.shape[1])
      coverage.append(jnp.sum(jnp.mean(jnp.sum(jnp.where(chosen, p, 0.0), -1), axis=1) * row_weight))
    if not kl:
      return jnp.zeros(()), jnp.ones(())
    return jnp.mean(jnp.stack(kl)), jnp.mean(jnp.stack(coverage))


def forward_with_mtp(params, window: jax.Array, *, config: ModelConfig, depths: int, dtype) -> tuple[list, _Probe]:
  """Logits of the main head and of MTP depths 1..depths for window [B, S+1] (fp32 [B, S, V]
  each), and the probe holding the indexer and router quantities of all these passes."""
  model = CausalLM(config, dtype=jnp.dtype(dtype))
  variables = {"params": cast_params(config, params, dtype)}
  tokens, _, _ = mtp_inputs(window, 0)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  probe = _Probe(config)
  with nn.intercept_methods(probe):
    logits, hidden = model.apply(variables, tokens)[:2]
    out = [logits]
    for depth in range(1, depths + 1):
      next_tokens, _, _ = mtp_inputs(window, depth)
      logits, hidden = model.apply(variables, next_tokens, hidden, positions, method=CausalLM.mtp_step)[:2]
      out.append(logits)
  return out, probe


# ---------------------------------------------------------------------------------------------
# Loss, optimizer, train step


def _token_losses(logits: jax.Array, window: jax.Array, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(cross-entropy [B, S], targets [B, S], mask [1, S]) of one head."""
  _, targets, mask = mtp_inputs(window, depth)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets), targets, mask


def loss_fn(params, window: jax.Array, config: ModelConfig, tc: TrainConfig):
  """Total loss and (metrics, router loads) for one batch of windows [B, S+1]."""
  logits, probe = forward_with_mtp(params, window, config=config, depths=tc.mtp_depths, dtype=tc.compute_dtype)
  losses = []
  for depth, lg in enumerate(logits):
    ce, _, mask = _token_losses(lg, window, depth)
    mask = jnp.broadcast_to(mask, ce.shape)
    losses.append(jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.sum(mask))
  kl, _ = probe.indexer_terms(jnp.ones(window.shape[:1]))
  total = losses[0] + sum(w * l for w, l in zip(tc.mtp_weights, losses[1:])) + tc.indexer_weight * kl
  mtp = jnp.stack(losses[1:]) if tc.mtp_depths else jnp.zeros((0,))
  return total, ({"loss": total, "main_loss": losses[0], "mtp_loss": mtp, "indexer_kl": kl}, probe.loads)


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warmup to tc.lr, then cosine decay to tc.lr * final_lr_fraction at tc.steps."""
  return optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps, tc.lr * tc.final_lr_fraction)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW; weight decay on matrices only (not norms or biases)."""
  decay = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                     optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay))


def init_state(config: ModelConfig, tc: TrainConfig) -> dict:
  """{"step", "params" (fp32), "opt_state"} at step 0, params drawn from tc.seed. Committed to the
  first device, as a state restored from a checkpoint is, so that both run one compiled step."""
  check_model(config, tc.mtp_depths)
  params = init_params(config, jax.random.key(tc.seed), param_dtype=jnp.float32)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": make_optimizer(tc).init(params)}
  return jax.device_put(state, jax.devices()[0])


def rebalance(params, loads: dict, rate: float):
  """Auxiliary-loss-free balancing: each router's bias += rate * sign(mean load - load)."""
  flat = traverse_util.flatten_dict(params)
  for path, counts in loads.items():
    key = path + ("e_score_correction_bias",)
    counts = counts.astype(jnp.float32)
    flat[key] = flat[key] + rate * jnp.sign(jnp.mean(counts) - counts)
  return traverse_util.unflatten_dict(flat)


@functools.partial(jax.jit, static_argnames=("config", "tc"), donate_argnums=0)
def train_step(state: dict, window: jax.Array, *, config: ModelConfig, tc: TrainConfig) -> tuple[dict, dict]:
  """One AdamW step on window [B, S+1]; the state is donated."""
  grads, (metrics, loads) = jax.grad(loss_fn, has_aux=True)(state["params"], window, config, tc)
  updates, opt_state = make_optimizer(tc).update(grads, state["opt_state"], state["params"])
  params = rebalance(optax.apply_updates(state["params"], updates), loads, tc.balance_rate)
  imbalance = [jnp.max(c) / jnp.mean(c.astype(jnp.float32)) for c in loads.values()]
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=lr_schedule(tc)(state["step"]),
                 expert_load_max=jnp.max(jnp.stack(imbalance)) if imbalance else jnp.ones(()))
  return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


# ---------------------------------------------------------------------------------------------
# Evaluation


@functools.partial(jax.jit, static_argnames=("config", "depths", "dtype"))
def _eval_sums(params, windows, row_weight, *, config, depths, dtype) -> dict:
  """Per-batch sums behind `evaluate` (rows of weight 0 are padding)."""
  logits, probe = forward_with_mtp(params, windows, config=config, depths=depths, dtype=dtype)
  main_pred = jnp.argmax(logits[0], axis=-1)
  sums = {"loss": [], "correct": [], "agree": [], "tokens": []}
  chained, running = [], jnp.ones(main_pred.shape, bool)
  for depth, lg in enumerate(logits):
    ce, targets, mask = _token_losses(lg, windows, depth)
    w = mask * row_weight[:, None]
    pred = jnp.argmax(lg, axis=-1)
    # The main model's greedy choice for the token this head guesses: its prediction at t+depth.
    agree = pred == _shift(main_pred, depth, main_pred.shape[1])
    sums["loss"].append(jnp.sum(ce * w))
    sums["correct"].append(jnp.sum((pred == targets) * w))
    sums["agree"].append(jnp.sum(agree * w))
    sums["tokens"].append(jnp.sum(w))
    if depth:
      running = running & agree
      chained.append(running)
  sums = {k: jnp.stack(v) for k, v in sums.items()}
  # Drafts 1..d are all accepted where each agrees with the main model; counted where every
  # depth has a target.
  w_all = mtp_inputs(windows, depths)[2] * row_weight[:, None]
  sums["accepted"] = sum((jnp.sum(c * w_all) for c in chained), jnp.zeros(()))
  sums["chain_tokens"] = jnp.sum(w_all)
  kl, coverage = probe.indexer_terms(row_weight)
  sums["indexer_kl"], sums["indexer_coverage"] = kl * jnp.sum(row_weight), coverage * jnp.sum(row_weight)
  return sums


def evaluate(config: ModelConfig, params, windows, *, mtp_depths: int, batch_size: int = 64,
             compute_dtype: str = "bfloat16") -> dict[str, Any]:
  """Held-out metrics of windows [N, S+1], per token.

  loss / accuracy / bits_per_byte: the main head. Per MTP depth: mtp_loss, mtp_accuracy (draft
  top-1 == the true token) and mtp_agreement (draft top-1 == the main model's greedy token
  there, what greedy verification accepts). accept_length: 1 + sum over d of the share of
  positions where drafts 1..d all agree, the tokens per verification step of greedy speculative
  decoding, estimated with teacher forcing (drafts condition on the true tokens). indexer_kl and
  indexer_coverage: the indexers' KL to the dense attention, and the share of that attention's
  mass inside their top-k.
  """
  check_model(config, mtp_depths)
  windows = np.asarray(windows, np.int32)
  batch_size = min(batch_size, len(windows))
  totals = None
  for i in range(0, len(windows), batch_size):
    batch = windows[i:i + batch_size]
    weight = (np.arange(batch_size) < len(batch)).astype(np.float32)
    batch = np.concatenate([batch, np.repeat(batch[:1], batch_size - len(batch), axis=0)])
    sums = jax.device_get(_eval_sums(params, batch, weight, config=config, depths=mtp_depths, dtype=compute_dtype))
    totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
  per_token = lambda key: (totals[key] / totals["tokens"]).tolist()
  loss = per_token("loss")
  return {"loss": loss[0], "accuracy": per_token("correct")[0], "bits_per_byte": float(loss[0] / np.log(2)),
          "mtp_loss": loss[1:], "mtp_accuracy": per_token("correct")[1:], "mtp_agreement": per_token("agree")[1:],
          "accept_length": 1.0 + float(totals["accepted"] / totals["chain_tokens"]),
          "indexer_kl": float(totals["indexer_kl"] / len(windows)),
          "indexer_coverage": float(totals["indexer_coverage"] / len(windows)),
          "tokens": int(totals["tokens"][0])}


# ---------------------------------------------------------------------------------------------
# Checkpoints and the training loop


def _jsonable(tc: TrainConfig) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(tc)))


class Checkpoints:
  """Orbax checkpoints of the train state, with the TrainConfig and the metric history, in
  `workdir`. Saves are synchronous: the next train step donates the state's buffers."""

  def __init__(self, workdir: str | os.PathLike, max_to_keep: int = 2):
    self.manager = ocp.CheckpointManager(
        os.path.abspath(workdir),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False))

  def save(self, state: dict, tc: TrainConfig, history: dict) -> None:
    step = int(state["step"])
    if self.manager.latest_step() == step:
      return
    meta = {"train_config": _jsonable(tc), "history": history}
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def restore(self, like: dict, tc: TrainConfig) -> tuple[dict, dict] | None:
    """(state, history) of the latest checkpoint, None when there is none. Raises ValueError
    when it was written under another TrainConfig."""
    step = self.manager.latest_step()
    if step is None:
      return None
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, like)),
        meta=ocp.args.JsonRestore()))
    saved, wanted = out["meta"]["train_config"], _jsonable(tc)
    differ = sorted(k for k in wanted if saved.get(k) != wanted[k])
    if differ:
      raise ValueError(f"checkpoint at step {step} was trained with another config: "
                       + ", ".join(f"{k}={saved.get(k)!r} (now {wanted[k]!r})" for k in differ))
    return out["state"], out["meta"]["history"]


@dataclasses.dataclass
class FitResult:
  state: dict
  history: dict       # {"train": [per log interval], "eval": [per evaluation]}
  resumed_from: int   # step the run started at (0: fresh)
  stopped_early: bool  # the time budget (or `until`) ended it before tc.steps
  wall_s: float       # this run's wall time


def _mean_metrics(pending: list[dict]) -> dict:
  host = jax.device_get(pending)
  return {k: np.mean([m[k] for m in host], axis=0).tolist() for k in host[0]}


def fit(config: ModelConfig, tc: TrainConfig, corpus: Corpus, *, workdir: str | None = None,
        checkpoint_every: int = 500, eval_windows: np.ndarray | None = None, eval_every: int = 500,
        log_every: int = 50, time_budget_s: float | None = None, until: int | None = None,
        start_time: float | None = None, progress: bool = True) -> FitResult:
  """Train to tc.steps (or `until`), resuming from the latest checkpoint in `workdir`.

  Checkpoints every checkpoint_every steps and at the end. Evaluates on eval_windows every
  eval_every steps and at the end. Stops cleanly, checkpointed, once time_budget_s has passed
  since start_time (default: now). Batches depend only on (tc.seed, step), so a resumed run
  reproduces the uninterrupted one.
  """
  start_time = time.monotonic() if start_time is None else start_time
  state, history = init_state(config, tc), {"train": [], "eval": []}
  checkpoints = Checkpoints(workdir) if workdir else None
  restored = checkpoints.restore(state, tc) if checkpoints else None
  if restored:
    state, history = restored
  first = int(state["step"])
  prior_s = history["train"][-1]["elapsed_s"] if history["train"] else 0.0
  last = tc.steps if until is None else min(until, tc.steps)
  elapsed = lambda: prior_s + time.monotonic() - start_time

  def run_eval(step):
    if eval_windows is not None and (not history["eval"] or history["eval"][-1]["step"] != step):
      history["eval"].append({"step": step, **evaluate(config, state["params"], eval_windows,
                                                       mtp_depths=tc.mtp_depths, compute_dtype=tc.compute_dtype)})

  pending, step = [], first
  bar = tqdm(total=tc.steps, initial=first, disable=not progress, desc="train", unit="step")
  while step < last:
    if time_budget_s is not None and time.monotonic() - start_time > time_budget_s:
      break
    window = corpus.train_batch(step, batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed)
    state, metrics = train_step(state, window, config=config, tc=tc)
    pending.append(metrics)
    step += 1
    bar.update(1)
    if step % log_every == 0 or step == last:
      history["train"].append({"step": step, **_mean_metrics(pending), "elapsed_s": elapsed()})
      pending = []
      bar.set_postfix(loss=f"{history['train'][-1]['main_loss']:.3f}")
    if eval_every and step % eval_every == 0:
      run_eval(step)
    if checkpoints and step % checkpoint_every == 0 and step < last:
      checkpoints.save(state, tc, history)
  bar.close()
  if pending:
    history["train"].append({"step": step, **_mean_metrics(pending), "elapsed_s": elapsed()})
  run_eval(step)
  if checkpoints:
    checkpoints.save(state, tc, history)
  return FitResult(state, history, first, step < tc.steps, time.monotonic() - start_time)
