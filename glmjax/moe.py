"""GLM-5 mixture of experts: sigmoid routing with a choice-only bias, group-limited top-k.

Einsum letters: n tokens, e experts, k chosen slots, d hidden, i expert intermediate.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from glmjax import quant
from glmjax.config import ModelConfig
from glmjax.footprint import expected_distinct_experts
from glmjax.layers import MLP, init_normal
from glmjax.runtime import Runtime


def route(logits: jax.Array, bias: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Router logits [n, E] fp32 -> (expert ids [n, k] int32, weights [n, k] fp32).

  The correction bias only steers the choice; weights are the unbiased sigmoid scores of the
  chosen experts, renormalised (+1e-20) and scaled by routed_scaling_factor. With n_group > 1,
  experts are chosen only inside the topk_group groups whose two best biased scores sum highest.
  """
  c = config
  scores = jax.nn.sigmoid(logits)
  choice = scores + bias.astype(jnp.float32)
  n, e = choice.shape
  if c.topk_group < c.n_group:  # else every group is kept (GLM-5: one group): no masking kernels
    grouped = choice.reshape(n, c.n_group, e // c.n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)               # [n, G]
    _, groups = jax.lax.top_k(group_scores, c.topk_group)
    group_mask = jnp.any(groups[..., None] == jnp.arange(c.n_group), axis=-2)    # [n, G]
    choice = jnp.where(jnp.repeat(group_mask, e // c.n_group, axis=-1), choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, c.num_experts_per_tok)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if c.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), weights * c.routed_scaling_factor


def _dense(w, dtype) -> jax.Array:
  """A stacked expert weight as a plain array (quantized leaves are dequantized)."""
  return w if isinstance(w, jax.Array) else w.dequantize(dtype)


def experts_reference(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                      down: jax.Array) -> jax.Array:
  """sum_k w[n,k] * down_e(silu(gate_e x) * up_e x) for e = ids[n, k]; ids outside [0, E) add nothing.

  x [n, d]; gate, up [E, i, d]; down [E, d, i] (dense or quantized leaves). Few tokens (decode):
  gather only the chosen experts' weights. Many tokens (prefill): run every local expert on every
  token and combine with a [n, E] weight matrix, which keeps shapes static without a gather.
  """
  num_experts = gate.shape[0]
  local = (ids >= 0) & (ids < num_experts)
  weights = jnp.where(local, weights, 0.0)
  if ids.size < num_experts:
    safe = jnp.where(local, ids, 0)
    take = lambda w: _dense(jax.tree.map(lambda a: a[safe], w), x.dtype)  # [n, k, out, in]
    g = jnp.einsum("nd,nkid->nki", x, take(gate))
    u = jnp.einsum("nd,nkid->nki", x, take(up))
    y = jnp.einsum("nki,nkdi->nkd", nn.silu(g) * u, take(down))
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), weights).astype(x.dtype)
  combine = jnp.zeros((x.shape[0], num_experts), jnp.float32)
  combine = combine.at[jnp.arange(x.shape[0])[:, None], jnp.where(local, ids, 0)].add(weights)
  g = jnp.einsum("nd,eid->nei", x, _dense(gate, x.dtype))
  u = jnp.einsum("nd,eid->nei", x, _dense(up, x.dtype))
  y = jnp.einsum("nei,edi->ned", nn.silu(g) * u, _dense(down, x.dtype))
  return jnp.einsum("ned,ne->nd", y.astype(jnp.float32), combine).astype(x.dtype)


def expected_local_experts(config: ModelConfig, tokens: int) -> float:
  """Distinct local experts `tokens` tokens are expected to choose under uniform routing: a TEP
  rank's share of those touched among all routed experts (about 5 of 32 at 5 tokens, GLM-5)."""
  c = config
  touched = expected_distinct_experts(tokens, c.num_experts_per_tok, c.n_routed_experts)
  return touched * c.num_local_experts / c.n_routed_experts


class Routing(NamedTuple):
  """A step's expert choice, and what the router's launch built beside it (Runtime.route_planes,
  Runtime.shared_swiglu; None where it did not)."""
  ids: jax.Array  # int32 [T, k]
  weights: jax.Array  # f32 [T, k]
  x_planes: tuple[jax.Array, jax.Array] | None = None  # the routed experts' fp16 planes of x, their row maxima
  gate_up: tuple[jax.Array, jax.Array] | None = None  # the shared expert's gate/up partials (router_group)
  shared_hidden: jax.Array | None = None  # its silu(gate) * up, bf16 [T, I]


class Router(nn.Module):
  """Router weight [E, D] and the choice-only correction bias [E], kept in fp32 -> Routing.
  select="pallas" chooses in one kernel from the GEMV's partial logits (pallas_kernels/moe_route.py),
  else `route`; given planes_of (Runtime.route_planes), that launch also builds those rows' fp16
  planes for the routed experts (`select_route`)."""
  config: ModelConfig
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array, *, dense: str = "xla", select: str = "xla",
               planes_of: jax.Array | None = None) -> Routing:
    c = self.config
    weight = self.param("weight", nn.with_logical_partitioning(init_normal(0.02), (None, "embed")),
                        (c.n_routed_experts, c.hidden_size), self.param_dtype)
    bias = self.param("e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                      (c.n_routed_experts,), jnp.float32)
    if select == "pallas":
      return select_route(quant.linear_partials(x, weight, dense=dense), bias, c, planes_of)
    return Routing(*route(quant.linear(x, weight, dense=dense, dtype=jnp.float32), bias, c))


def select_route(partials: jax.Array, bias: jax.Array, config: ModelConfig, planes_of: jax.Array | None,
                 gate_up: tuple[jax.Array, jax.Array] | None = None, shared_hidden: bool = False) -> Routing:
  """The router's choice from its GEMV's partials in one launch (moe_route.route_select); with
  planes_of, planes_of's fp16 planes from that launch (route_select_planes), and with
  shared_hidden too, the shared expert's silu(gate) * up from its gate_up partials."""
  from pallas_kernels import moe_route  # the kernels import the model
  if planes_of is None:
    return Routing(*moe_route.route_select(partials, bias, config), gate_up=gate_up)
  ids, weights, planes, amax, *hidden = moe_route.route_select_planes(partials, bias, config, planes_of,
                                                                      shared=gate_up if shared_hidden else None)
  return Routing(ids, weights, (planes, amax), None if hidden else gate_up, hidden[0] if hidden else None)


def _router_group(router: dict, shared: dict) -> list:
  """The weights of Runtime.router_group's launch: the router's, the shared expert's gate and up."""
  return [router["weight"], shared["gate_proj"]["weight"], shared["up_proj"]["weight"]]


def groups_router(x: jax.Array, router: dict, shared: dict, dense: str) -> bool:
  """Whether the router's GEMV can join the shared expert's gate/up launch (shared_route) for
  tokens x, given the Router's and the shared expert's (MLP) params: all three plain bf16 under
  dense="pallas_grouped", x decode-sized."""
  return dense == "pallas_grouped" and all(quant.takes_bf16_gemv(x, w, dense, jnp.float32)
                                           for w in _router_group(router, shared))


def shared_route(x: jax.Array, router: dict, shared: dict, config: ModelConfig, dense: str,
                 planes_of: jax.Array | None = None, shared_hidden: bool = False) -> Routing:
  """Runtime.router_group (where groups_router): the router's choice and the shared expert's
  gate/up partials from one split-K launch, the three weights reading the same x (for
  MLP(partials=...)); with planes_of and shared_hidden, as select_route gives them. At GLM-5's
  TEP=8 shapes the launch takes each weight's own split count (8), so every output is the
  separate launches' bit for bit."""
  logits, gate, up = quant.linear_group_partials(x, _router_group(router, shared), dense=dense)
  return select_route(logits, router["e_score_correction_bias"], config, planes_of, (gate, up), shared_hidden)


class Experts(nn.Module):
  """This rank's routed experts, stacked: gate/up [E, i, d], down [E, d, i]."""
  config: ModelConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array, *, matmul: str = "xla",
               routing: str = "table", partials: bool = False, x_planes=None, shared_down=None,
               wide_words: bool = False):
    """[T, D] in dtype, or with partials fp32 terms [S, T, D] that sum to it (quant.moe_experts;
    x_planes: x's fp16 planes where the router's launch built them; shared_down: the shared
    expert's hidden and down weight, its GEMV in the experts' launch: (that, its output);
    wide_words: Runtime.pairs_wide_words)."""
    c = self.config
    e, i, d = c.num_local_experts, c.moe_intermediate_size, c.hidden_size
    make = lambda name, shape, axes: quant.param(
        self, name, nn.with_logical_partitioning(init_normal(0.02), ("experts",) + axes), shape, self.param_dtype)
    gate = make("gate_proj", (e, i, d), ("expert_mlp", "embed"))
    up = make("up_proj", (e, i, d), ("expert_mlp", "embed"))
    down = make("down_proj", (e, d, i), ("embed", "expert_mlp"))
    return quant.moe_experts(x.astype(self.dtype), ids, weights, gate, up, down, impl=matmul, routing=routing,
                             chosen=expected_local_experts(c, ids.shape[0]), partials=partials,
                             x_planes=x_planes, shared_down=shared_down, wide_words=wide_words)


class MoE(nn.Module):
  """Routed experts (only this rank's local ones are stored) plus the shared expert.

  Traced under `glmjax.parallel.use_mesh(mesh)` with a TEP degree > 1, the experts run as one
  expert-parallel shard_map (glmjax.parallel.expert_parallel): the router stays replicated, the
  `experts` and `shared_experts` weights are read from this module's variables (their modules
  are not called there; they create the params at init), and one psum combines both.
  """
  config: ModelConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array, *, runtime=None, residual: jax.Array | None = None,
               terms: bool = False) -> jax.Array | tuple[jax.Array, jax.Array | None]:
    """The experts' output [..., D] in dtype; given the layer's residual stream (Runtime.moe_sum,
    on one device or one rank's program), the layer's new residual, residual + output, summed
    in the shared expert's launch (MLP). terms (Runtime.next_norm): the output unsummed, (the
    shared expert's down partials [S, rows, D], the routed experts' [S', rows, D]: each sum
    rounded to dtype, then added in dtype), or under a TEP mesh (the all-reduced output
    [1, rows, D], None). Runtime.shared_down: the shared expert's down GEMV in the routed
    experts' gate/up launch, where the router's launch built its hidden (shared_swiglu)."""
    from glmjax.parallel import expert_parallel, mesh  # the parallel package imports the model

    c = self.config
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    flat = x.reshape(-1, x.shape[-1])
    runtime = runtime or Runtime()
    impls, routing = runtime.linear_impls, runtime.moe_routing
    params = None if self.is_initializing() else self.variables["params"]
    router = None  # the Router's params where its GEMV joins the shared expert's (Runtime.router_group)
    if (params is not None and runtime.router_group == "pallas"
        and groups_router(flat, params["gate"], params["shared_experts"], impls["dense"])):
      router = params["gate"]
    tep_mesh = mesh.active_mesh()
    planes_of = None  # x, where the router's launch builds its fp16 planes for the experts (Runtime.route_planes)
    if (runtime.route_planes == "pallas" and params is not None and tep_mesh is None
        and quant.builds_x_planes(flat.astype(self.dtype), impls["matmul"], routing)):
      planes_of = flat.astype(self.dtype)
    choice = None
    if router is None:
      choice = Router(c, self.param_dtype, name="gate")(flat, dense=impls["dense"], select=runtime.router,
                                                        planes_of=planes_of)
    if tep_mesh is not None and params is not None:
      ids, weights = (None, None) if choice is None else choice[:2]  # None: the router runs in the shard_map
      out = expert_parallel.moe(flat, ids, weights, params["experts"], params["shared_experts"], config=c,
                                mesh=tep_mesh, routing=routing, swiglu=runtime.swiglu, router=router,
                                wide_words=runtime.pairs_wide_words, **impls, **kw)
      return (out.reshape(1, *flat.shape), None) if terms else out.reshape(x.shape)
    if router is not None:
      choice = shared_route(flat, router, params["shared_experts"], c, impls["dense"], planes_of,
                            runtime.shared_swiglu == "pallas")
    shared_down = None  # the shared expert's hidden and down weight where its GEMV rides in the experts' launch
    if (runtime.shared_down == "pallas" and choice.shared_hidden is not None and residual is None
        and self.dtype == jnp.bfloat16):
      down = params["shared_experts"]["down_proj"]["weight"]
      if quant.takes_bf16_gemv(choice.shared_hidden, down, impls["dense"], self.dtype):
        shared_down = (choice.shared_hidden, down)
    routed = Experts(c, name="experts", **kw)(flat, choice.ids, choice.weights, matmul=impls["matmul"],
                                              routing=routing, partials=residual is not None or terms,
                                              x_planes=choice.x_planes, shared_down=shared_down,
                                              wide_words=runtime.pairs_wide_words)
    if shared_down is not None:  # the shared expert's output, as MLP gives it from the hidden
      routed, shared = routed
      if terms:
        return shared, routed
      return routed.reshape(x.shape).astype(self.dtype) + shared.reshape(x.shape)
    shared_mlp = MLP(c.hidden_size, c.shared_intermediate, name="shared_experts", **kw)
    inputs = dict(partials=choice.gate_up, hidden=choice.shared_hidden)
    if residual is not None:
      return shared_mlp(x, **runtime.mlp_impls, residual=residual, routed=routed, **inputs)
    if terms:
      return shared_mlp(x, **runtime.mlp_impls, down_partials=True, **inputs), routed
    return routed.reshape(x.shape).astype(self.dtype) + shared_mlp(x, **runtime.mlp_impls, **inputs)
