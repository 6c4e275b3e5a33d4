"""Grouped routed-expert MLP for decode: two launches that read only the chosen experts' weights.

  out[t] = sum_s w[t,s] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t,s] in [0, E)

x [T, D] bf16 (T = a decode step's tokens, up to ~16); stacked weights gate / up [E, I, D],
down [E, D, I], each bf16, NVFP4Weight or FP8BlockWeight (formats may differ per projection).
Ids outside [0, E) (experts on other ranks) contribute zero.

Why grouped: at decode every chosen expert's weights are read once and the bytes are the cost
(GLM-5, one TEP=8 rank: 32 local experts, top-8 of 5 tokens touches about 23 of them, 21 MB
each in NVFP4). Gathering per (token, slot) in XLA reads an expert once per slot that chose it
and dequantizes through HBM; here each chosen expert is read once, by one launch per projection.

Routing table (XLA, a few hundred bytes): `experts` [U] = the sorted distinct local ids, padded
with -1 (U = min(T*k, E)); `count` = how many are real; `route` [U, Tp] fp32 = the summed routing
weight of token t for slot u (0 for tokens that did not choose it). Triton has no scalar prefetch,
so the kernels read `experts` with a scalar load at program start and offset the weight pointer by
the expert id: a program only ever touches its expert's rows.

  gate_up: grid (U, I / block_n). Program (u, j) computes rows j of gate and up of expert
           experts[u] for all Tp tokens (the tensor-core tile is 16 rows anyway), writes
           h[u] = silu(g) * u in bf16; padding slots (-1) return at once.
  down:    grid (D / block_n, down_split). Program (j, s) loops over slots u = s, s + S, ... <
           count, computes h[u] @ down_e[rows j].T and accumulates route[u, t] * that in fp32;
           XLA sums the S partials [S, Tp, D] (fp32, ~0.5 MB at GLM-5 size) over s.
routing="scan" (MoEConfig) builds no table: the gate_up grid runs over all E local experts, and
each program scans the step's T*k ids (a few hundred bytes, read whole) for its own, returning at
once if no token chose it; each down program walks the experts of its interleave, scanning the
same way, and forms route[:, e] from the ids and weights itself. That removes the table's XLA
kernels (about five launches a MoE layer and step) for a scan of T*k ids per program: alone,
loop-timed, 118.6 us against 108.0 with the table at one rank's case (BENCHMARKS.md run 15); in
the step it is part of run 11's switches (-13 launches a layer together).
Both K loops, tile decoders and numerics are those of nvfp4_matmul.py / fp8_matmul.py, including
its inline-PTX NVFP4 decode (MoEConfig.decode="ptx"): 350 us against 431 us for the jnp decode at
the GLM-5 rank shape above, 5 tokens, 24 experts (BENCHMARKS.md run 10), and their fp16 operands
(MoEConfig.operands): at one rank's 6 of 32 experts 96.8 us against 108.0 for NVFP4, 116.1
against 204.4 for FP8 (run 15); in the rank's step gate/up 43 us against 55 (runs 12, 14).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.moe import experts_reference
from glmjax.quant.fp8_block import BLOCK as FP8_BLOCK, FP8BlockWeight
from glmjax.quant.nvfp4 import BLOCK as NVFP4_BLOCK, NVFP4Weight
from pallas_kernels.fp8_matmul import load_fp8_tile
from pallas_kernels.checks import check_at_least, check_choice, check_launch, check_tile, resolve_interpret
from pallas_kernels.nvfp4_matmul import (DECODE_SCALE, DECODES, NUM_SMS, OPERANDS, column_halves, dot_halves,
                                         dot_t, load_column_halves, load_nvfp4_halves,
                                         load_nvfp4_tile, load_tile, operand_refs, operand_rows,
                                         range_mask, row_inverse_scale, scale_rows, store_tile)


ROUTINGS = ("table", "scan")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """block_n: weight rows per program; block_k: inputs per K step (<= 128 with FP8 weights);
  down_split: programs sharing one down row block (slots interleaved); num_warps, num_stages:
  Triton's warps per program and K-loop pipeline depth; decode: how NVFP4 tiles decode, as
  nvfp4_matmul.MatmulConfig.decode ("ptx": into even/odd column halves by inline PTX, against
  the activations' even and odd columns, which XLA splits before each launch); routing:
  "table" (XLA's routing table of the chosen experts) or "scan" (none: the programs scan the
  ids; module docstring); operands: the tensor cores' operand dtype, as
  nvfp4_matmul.MatmulConfig.operands, for launches whose weights are all quantized (a plain bf16
  projection keeps bf16)."""
  block_n: int = 64
  block_k: int = 128
  down_split: int = 4
  num_warps: int = 4
  num_stages: int = 3
  decode: str = "jnp"
  routing: str = "table"
  operands: str = "bfloat16"

  def __post_init__(self):
    check_tile("MoEConfig", "block_n", self.block_n)
    check_tile("MoEConfig", "block_k", self.block_k)
    check_at_least("MoEConfig", "down_split", self.down_split)
    check_launch("MoEConfig", self.num_warps, self.num_stages)
    check_choice("MoEConfig", "decode", self.decode, DECODES)
    check_choice("MoEConfig", "routing", self.routing, ROUTINGS)
    check_choice("MoEConfig", "operands", self.operands, OPERANDS)


def default_moe_config(weights, *, decode: str = "jnp", routing: str = "table",
                       chosen: float | None = None, operands: str = "bfloat16") -> MoEConfig:
  """The H200 tiles for these (gate, up, down) weights: MoEConfig's, except NVFP4-only weights
  under decode="ptx". Those take block_k=256 (GLM-5 rank shape, 5 tokens, 24 of 32 experts
  chosen: 362 us against 448 us at block_k=128; BENCHMARKS.md run 10), or, where the step is
  expected to choose so few experts (`chosen`, e.g. one TEP rank's share of the routed ones)
  that 64-row blocks would give the gate/up launch under two working programs per SM,
  32 x 512 tiles: twice the programs (about 5 of 32 chosen: 107 us against 146 us, run 11)."""
  if decode == "ptx" and all(_kind(w) == "nvfp4" for w in weights):
    rows = weights[0].shape[1]  # gate's I
    if chosen is not None and chosen * pl.cdiv(rows, 64) < 2 * NUM_SMS:
      return MoEConfig(block_n=32, block_k=512, decode=decode, routing=routing, operands=operands)
    return MoEConfig(block_k=256, decode=decode, routing=routing, operands=operands)
  return MoEConfig(decode=decode, routing=routing, operands=operands)


# Per-format plumbing: the kernel operands of a stacked weight, their BlockSpecs, a tile.

def _kind(w) -> str:
  if isinstance(w, NVFP4Weight):
    return "nvfp4"
  if isinstance(w, FP8BlockWeight):
    return "fp8"
  return "bf16"


def _operands(w) -> tuple[jax.Array, ...]:
  if isinstance(w, NVFP4Weight):
    return w.packed, w.block_scale, w.global_scale
  if isinstance(w, FP8BlockWeight):
    return w.weight, w.scale_inv
  return (w,)


def _whole(a: jax.Array) -> pl.BlockSpec:
  return pl.BlockSpec(a.shape, lambda *grid: (0,) * a.ndim)


def _specs(w, block_n: int, kp: int, row_block) -> list[pl.BlockSpec]:
  """BlockSpecs of `_operands(w)`: all experts (the kernel picks one), rows `row_block(*grid)`."""
  num_experts = w.shape[0]
  rows = lambda width: pl.BlockSpec((num_experts, block_n, width), lambda *g: (0, row_block(*g), 0))
  if isinstance(w, NVFP4Weight):
    return [rows(kp // 2), rows(kp // NVFP4_BLOCK), _whole(w.global_scale)]
  if isinstance(w, FP8BlockWeight):
    return [rows(kp), _whole(w.scale_inv)]
  return [rows(kp)]


def _halves(kind: str, config: MoEConfig) -> bool:
  """Whether a `kind` weight decodes into even/odd column halves."""
  return kind == "nvfp4" and config.decode == "ptx"


def _activation_forms(kinds, config: MoEConfig) -> tuple[bool, bool]:
  """Whether a launch over weights of these kinds reads its activations whole, and by column
  parity (both, for mixed formats under decode="ptx")."""
  halves = [_halves(kind, config) for kind in kinds]
  return not all(halves), any(halves)


def _f16(kinds, config: MoEConfig) -> bool:
  """Whether a launch over weights of these kinds takes fp16 operands (all quantized)."""
  return config.operands == "float16" and "bf16" not in kinds


def _activations(a: jax.Array, kinds, config: MoEConfig) -> list[jax.Array]:
  """The activation arrays a launch reads: `a` [..., K] for weights decoded whole, its even and
  odd columns for weights decoded into halves; under fp16 operands (`_f16`) those of f16_rows'
  fp16 `a`, then its rows' largest magnitudes [...]."""
  whole, halves = _activation_forms(kinds, config)
  a, *row_amax = operand_rows(a, _f16(kinds, config))
  return ([a] if whole else []) + (column_halves(a) if halves else []) + row_amax


def _activation_loader(refs, kinds, lead: tuple, rows_ok, *, k: int, config: MoEConfig):
  """step -> (the [block_m, block_k] activation tile or None, its even/odd [block_m, block_k/2]
  halves or None), from the refs of `_activations`' arrays; `lead` indexes leading dims."""
  bk = config.block_k
  whole, halves = _activation_forms(kinds, config)

  def load(step):
    x = (load_tile(refs[0].at[(*lead, slice(None), pl.ds(step * bk, bk))], rows_ok, range_mask(step * bk, bk, k))
         if whole else None)
    return x, load_column_halves(refs[int(whole):], lead, rows_ok, step, block_k=bk, k=k) if halves else None

  return load


def _tile(kind: str, refs, e, n_block, step, *, n: int, k: int, config: MoEConfig, interpret: bool,
          dtype):
  """([block_n, block_k] weight tile of expert e in `dtype` (the activations': bf16 or fp16), or
  its even/odd column halves; scale for its dot or None)."""
  bn, bk = config.block_n, config.block_k
  rows_ok = range_mask(n_block * bn, bn, n)
  if _halves(kind, config):  # the interpreter runs the PTX's jnp twin
    return load_nvfp4_halves(refs[0], refs[1], (e,), step, block_k=bk, k=k, rows_ok=rows_ok,
                             ptx=not interpret, dtype=dtype), None
  if kind == "nvfp4":
    return load_nvfp4_tile(refs[0], refs[1], (e,), step, block_k=bk, k=k, rows_ok=rows_ok, dtype=dtype), None
  if kind == "fp8":
    return load_fp8_tile(refs[0], refs[1], (e,), n_block, step, block_n=bn, block_k=bk, k=k,
                         rows_ok=rows_ok, dtype=dtype)
  return load_tile(refs[0].at[e, :, pl.ds(step * bk, bk)], rows_ok, range_mask(step * bk, bk, k)), None


def _expert_matmul(x_tile, weights, e, n_block, *, n: int, k: int, block_m: int,
                   config: MoEConfig, interpret: bool, dtype) -> list[jax.Array]:
  """fp32 [block_m, bn] = x @ W_e[rows of n_block].T for each (kind, refs) in `weights`, one K
  loop sharing the x tiles `x_tile(step)` (see _activation_loader; `dtype`: theirs)."""
  def body(step, accs):
    x, x_halves = x_tile(step)
    out = []
    for (kind, refs), acc in zip(weights, accs):
      w, scale = _tile(kind, refs, e, n_block, step, n=n, k=k, config=config, interpret=interpret,
                       dtype=dtype)
      part = dot_halves(x_halves, w) if isinstance(w, tuple) else dot_t(x, w)
      out.append(acc + (part if scale is None else part * scale))
    return tuple(out)

  zeros = jnp.zeros((block_m, config.block_n), jnp.float32)
  accs = lax.fori_loop(0, pl.cdiv(k, config.block_k), body, (zeros,) * len(weights))
  return [acc * (refs[2][e] * DECODE_SCALE) if kind == "nvfp4" else acc
          for (kind, refs), acc in zip(weights, accs)]


def _step_ids(ids_ref, weights_ref, rows: int, cols: int) -> tuple[jax.Array, jax.Array | None]:
  """The step's routing, read whole: ids i32 and (weights_ref given) weights f32 of the [T, k]
  choice as [block_m, kw] tiles of ids_ref / weights_ref (masked: id -1, weight 0 outside)."""
  ok = (jnp.arange(ids_ref.shape[0])[:, None] < rows) & (jnp.arange(ids_ref.shape[1])[None, :] < cols)
  ids = pltriton.load(ids_ref, mask=ok, other=-1)
  return ids, None if weights_ref is None else pltriton.load(weights_ref, mask=ok, other=0.0)


def _is_chosen(ids: jax.Array, e) -> jax.Array:
  """Whether any token chose expert e (scalar bool). One axis per reduction: Pallas-Triton's
  lowering of a reduction over both axes of a tile raises a sharding error under an abstract
  mesh (jax 0.11.2)."""
  return jnp.sum(jnp.sum((ids == e).astype(jnp.int32), axis=1)) > 0


def _gate_up_kernel(route_ref, *refs, kinds: tuple[str, str], num_x_refs: int, num_gate_refs: int,
                    t: int, k: int, d: int, i: int, block_m: int, config: MoEConfig, interpret: bool):
  # route_ref: i32 [U] experts (routing "table"), or the ids [block_m, kw] of [T, k] ("scan");
  # x refs: [block_m, Dp or Dp/2] of x [T, D], bf16 or fp16, and the rows' largest magnitudes
  # [block_m] of [T] for fp16 x (_activations); then gate's and up's operands as [E, bn, Dp/...] row blocks (see
  # _specs); h_ref: bf16 [block_m, bn] of [U, block_m, I] (U = E under "scan").
  x_refs, (*w_refs, h_ref) = refs[:num_x_refs], refs[num_x_refs:]
  x_refs, row_amax = operand_refs(x_refs, _f16(kinds, config))
  gate_refs, up_refs = w_refs[:num_gate_refs], w_refs[num_gate_refs:]
  if config.routing == "scan":
    e = pl.program_id(0)
    chosen = _is_chosen(_step_ids(route_ref, None, t, k)[0], e)
  else:
    e = route_ref[pl.program_id(0)]
    chosen = e >= 0
  n_block = pl.program_id(1)

  @pl.when(chosen)
  def _():
    x_tile = _activation_loader(x_refs, kinds, (), range_mask(0, block_m, t), k=d, config=config)
    g, u = (scale_rows(acc, row_amax, range_mask(0, block_m, t)) for acc in _expert_matmul(
        x_tile, [(kinds[0], gate_refs), (kinds[1], up_refs)], e, n_block, n=i, k=d, block_m=block_m,
        config=config, interpret=interpret, dtype=x_refs[0].dtype))
    store_tile(h_ref, (jax.nn.silu(g) * u).astype(h_ref.dtype), None,
               range_mask(n_block * config.block_n, config.block_n, i))


def _down_kernel(*refs, kind: str, num_h_refs: int, t: int, k: int, d: int, i: int, block_m: int,
                 config: MoEConfig, interpret: bool):
  # Routing "table": experts_ref i32 [U], count_ref i32 [1], route_ref f32 [U, block_m]; "scan":
  # ids_ref i32 and weights_ref f32 [block_m, kw] of the [T, k] choice. Then h refs:
  # [U, block_m, Ip or Ip/2] of h [U, block_m, I], bf16 or fp16 with its rows' largest [U, block_m]
  # (_activations); down's operands as [E, bn, Ip/...] row blocks; o_ref: f32 [block_m, bn] of
  # the [down_split, block_m, D] partials.
  scan = config.routing == "scan"
  first_h = 2 if scan else 3
  routing, h_refs = refs[:first_h], refs[first_h:first_h + num_h_refs]
  h_refs, row_amax = operand_refs(h_refs, _f16((kind,), config))
  *w_refs, o_ref = refs[first_h + num_h_refs:]
  splits = config.down_split
  n_block, split = pl.program_id(0), pl.program_id(1)
  zeros = jnp.zeros((block_m, config.block_n), jnp.float32)

  def expert_out(u, e, weight):
    x_tile = _activation_loader(h_refs, (kind,), (u,), None, k=i, config=config)
    (y,) = _expert_matmul(x_tile, [(kind, w_refs)], e, n_block, n=d, k=i, block_m=block_m, config=config,
                          interpret=interpret, dtype=h_refs[0].dtype)
    if row_amax is not None:
      weight = weight * row_inverse_scale(row_amax[u, :])
    return weight[:, None] * y

  if scan:
    ids, weights = _step_ids(*routing, t, k)
    num_experts = w_refs[0].shape[0]

    def per_expert(it, total):
      e = split + it * splits
      route = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=1)  # [block_m]
      return lax.cond(_is_chosen(ids, e), lambda: total + expert_out(e, e, route), lambda: total)

    total = lax.fori_loop(0, (num_experts - split + splits - 1) // splits, per_expert, zeros)
  else:
    experts_ref, count_ref, route_ref = routing

    def per_slot(it, total):
      u = split + it * splits
      return total + expert_out(u, experts_ref[u], route_ref[u, :])

    trips = (jnp.maximum(count_ref[0] - split, 0) + splits - 1) // splits
    total = lax.fori_loop(0, trips, per_slot, zeros)
  store_tile(o_ref, total, None, range_mask(n_block * config.block_n, config.block_n, d))


def routing_table(topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int,
                  block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(experts i32 [U], count i32 [1], route f32 [U, block_m]), see the module docstring."""
  t, k = topk_ids.shape
  slots = min(t * k, num_experts)
  valid = (topk_ids >= 0) & (topk_ids < num_experts)
  used = jnp.zeros(num_experts, jnp.bool_).at[jnp.where(valid, topk_ids, num_experts)].set(
      True, mode="drop")
  experts = jnp.nonzero(used, size=slots, fill_value=-1)[0].astype(jnp.int32)
  hit = valid[:, :, None] & (topk_ids[:, :, None] == experts)                     # [T, k, U]
  route = jnp.sum(jnp.where(hit, topk_weights.astype(jnp.float32)[:, :, None], 0.0), axis=1).T
  return experts, jnp.sum(used, dtype=jnp.int32).reshape(1), jnp.pad(route, ((0, 0), (0, block_m - t)))


def check_moe_inputs(kernel: str, x, topk_ids, topk_weights, gate_proj, up_proj, down_proj) -> dict:
  """The routed-expert kernels' shared input checks (bf16 x [T, D], int32 ids [T, k] and their
  weights, stacked [E, I, D] / [E, D, I] expert weights); returns {name: weight}."""
  if x.ndim != 2 or x.dtype != jnp.bfloat16:
    raise ValueError(f"{kernel}: x must be bf16 [T, D], got {x.dtype} {x.shape}")
  t, d = x.shape
  if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_ids.dtype != jnp.int32:
    raise ValueError(f"{kernel}: topk_ids must be int32 [T={t}, k], got {topk_ids.dtype} {topk_ids.shape}")
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(f"{kernel}: topk_weights {topk_weights.shape} must match topk_ids {topk_ids.shape}")
  e, i = gate_proj.shape[:2]
  for name, w, layout, shape in (("gate_proj", gate_proj, "E, I, D", (e, i, d)),
                                 ("up_proj", up_proj, "E, I, D", (e, i, d)),
                                 ("down_proj", down_proj, "E, D, I", (e, d, i))):
    if tuple(w.shape) != shape:
      raise ValueError(f"{kernel}: {name} must be [{layout}] = {shape}, got {tuple(w.shape)}")
  return dict(gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj)


def _check_inputs(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
                  config: MoEConfig) -> None:
  weights = check_moe_inputs("moe_grouped_matmul", x, topk_ids, topk_weights, gate_proj, up_proj, down_proj)
  for name, w in weights.items():
    if _kind(w) == "bf16" and w.dtype != jnp.bfloat16:
      raise ValueError(f"moe_grouped_matmul: plain {name} must be bf16, got {w.dtype}")
    if _kind(w) == "fp8" and (config.block_n > FP8_BLOCK or config.block_k > FP8_BLOCK):
      raise ValueError(f"moe_grouped_matmul: FP8 {name} needs block_n, block_k <= {FP8_BLOCK}, "
                       f"got {config.block_n}, {config.block_k}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def moe_grouped_matmul(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, gate_proj,
                       up_proj, down_proj, *, config: MoEConfig | None = None,
                       interpret: bool | None = None) -> jax.Array:
  """Routed-expert MLP of a decode step, reading each chosen expert's weights once.

  Args:
    x: bf16 [T, D].
    topk_ids: int32 [T, k] expert ids; outside [0, E) contributes zero.
    topk_weights: [T, k] routing weights (applied in fp32).
    gate_proj, up_proj: [E, I, D]; down_proj: [E, D, I]; bf16 arrays, NVFP4Weight or FP8BlockWeight.
    config: tiling; default MoEConfig().
    interpret: run the Pallas interpreter; default: on the CPU backend.
  Returns:
    bf16 [T, D].
  """
  config = MoEConfig() if config is None else config
  _check_inputs(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj, config)
  interpret = resolve_interpret(interpret)
  (t, d), (e, i) = x.shape, gate_proj.shape[:2]
  bn, bk, splits = config.block_n, config.block_k, config.down_split
  block_m = max(16, pl.next_power_of_2(t))
  dp, ip = pl.cdiv(d, bk) * bk, pl.cdiv(i, bk) * bk  # blocks may overhang: the overhang is masked
  if config.routing == "scan":  # the kernels read the choice itself (module docstring)
    slots = e
    ids_spec = pl.BlockSpec((block_m, pl.next_power_of_2(topk_ids.shape[1])), lambda *grid: (0, 0))
    up_routing, up_specs = (topk_ids,), [ids_spec]
    down_routing, down_specs = (topk_ids, topk_weights.astype(jnp.float32)), [ids_spec, ids_spec]
  else:
    experts, count, route = routing_table(topk_ids, topk_weights, e, block_m)
    slots = experts.shape[0]
    up_routing, up_specs = (experts,), [_whole(experts)]
    down_routing, down_specs = (experts, count, route), [_whole(experts), _whole(count), _whole(route)]
  params = pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  sizes = dict(t=t, k=topk_ids.shape[1], d=d, i=i, block_m=block_m, config=config, interpret=interpret)

  kinds = (_kind(gate_proj), _kind(up_proj))
  xs = _activations(x, kinds, config)
  x_specs = [pl.BlockSpec((block_m, dp * a.shape[-1] // d), lambda u, j: (0, 0)) if a.ndim == 2
             else pl.BlockSpec((block_m,), lambda u, j: (0,)) for a in xs]
  h = pl.pallas_call(
      functools.partial(_gate_up_kernel, kinds=kinds, num_x_refs=len(xs),
                        num_gate_refs=len(_operands(gate_proj)), **sizes),
      out_shape=jax.ShapeDtypeStruct((slots, block_m, i), x.dtype),
      grid=(slots, pl.cdiv(i, bn)),
      in_specs=[*up_specs,
                *x_specs,
                *_specs(gate_proj, bn, dp, lambda u, j: j), *_specs(up_proj, bn, dp, lambda u, j: j)],
      out_specs=pl.BlockSpec((None, block_m, bn), lambda u, j: (u, 0, j)),
      compiler_params=params, interpret=interpret, name="moe_gate_up",
  )(*up_routing, *xs, *_operands(gate_proj), *_operands(up_proj))

  hs = _activations(h, (_kind(down_proj),), config)
  h_specs = [pl.BlockSpec((slots, block_m, ip * a.shape[-1] // i), lambda j, s: (0, 0, 0)) if a.ndim == 3
             else _whole(a) for a in hs]
  partials = pl.pallas_call(
      functools.partial(_down_kernel, kind=_kind(down_proj), num_h_refs=len(hs), **sizes),
      out_shape=jax.ShapeDtypeStruct((splits, block_m, d), jnp.float32),
      grid=(pl.cdiv(d, bn), splits),
      in_specs=[*down_specs,
                *h_specs,
                *_specs(down_proj, bn, ip, lambda j, s: j)],
      out_specs=pl.BlockSpec((None, block_m, bn), lambda j, s: (s, 0, j)),
      compiler_params=params, interpret=interpret, name="moe_down",
  )(*down_routing, *hs, *_operands(down_proj))
  return partials.sum(0)[:t].astype(x.dtype)


def moe_grouped_matmul_reference(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                                 gate_proj, up_proj, down_proj) -> jax.Array:
  """fp32 reference: the model's expert MLP (glmjax.moe.experts_reference) on fp32 inputs and
  fp32-dequantized weights, cast to x.dtype."""
  f32 = lambda w: w.astype(jnp.float32) if _kind(w) == "bf16" else w.dequantize(jnp.float32)
  with jax.default_matmul_precision("highest"):
    out = experts_reference(x.astype(jnp.float32), topk_ids, topk_weights, f32(gate_proj),
                            f32(up_proj), f32(down_proj))
  return out.astype(x.dtype)
