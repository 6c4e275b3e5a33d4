"""Routed-expert MLP of a decode step on the CUDA cores: each (token, expert) pair a one-row product.

  out[t] = sum_s w[t,s] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t,s] in [0, E)

Why: one TEP=8 rank of GLM-5 holds 32 of 256 experts, so a step's 5 tokens choose about 5 of
its experts, nearly always for one token each. A one-row product is where nvfp4_hfma2's block
program (codes decoded in registers, fp16x2 FMAs, no shared memory) beats the tensor cores,
which the grouped kernel (moe_grouped_matmul) pads to 16 rows. Here every pair is such a row:
an expert two tokens chose is read once per pair (the second read may come from L2).

Pairs are found in-kernel, with no XLA routing table: each program loads the step's T*k ids
whole, marks the local ones (0 <= id < E) and ranks them in registers; pair p is the local slot
of rank p. Program (j, s, g) of a launch takes pairs g, g + G, ... < count, row block j, K split s.

  gate_up: rows j of gate and of up of the pair's expert against its token, summed over split s
           into fp32 partials [S, T*k, I] each (a pair's row p; rows >= count unwritten).
  XLA:     h = silu(sum_s g) * sum_s u per pair in bf16 (rows >= count zeroed), its fp16 rows
           (f16_rows) as activation planes (with PairsConfig.fused_planes: one launch,
           hfma2_planes.swiglu_planes, and likewise x's planes, rows_planes).
  down:    rows j of down against h[p], times the pair's routing weight, added into its
           token's row: fp32 partials [S * G, T, D], summed by XLA.
  With shared_down (Runtime.shared_down), the gate/up launch also runs the shared expert's
  down GEMV as more programs past its row blocks (bf16_matmul's; the two share no data).

Measured (H200, own kernel time, BENCHMARKS.md run 20): at one rank's view (5 tokens, 6 pairs
among 6 of 32 experts) 61.4 us against 85.8 for the grouped tensor-core kernel with fp16
operands and 566 for XLA's bf16 (2.08 TB/s on the chosen experts' bytes, 49% of copy; 11-12
us of it is XLA glue); one token with one local expert 20.1 against 45.5. In `tep8_shard`'s
step the MoE fell from 72.5 to about 52 us a layer and the step from 21.88 to 18.88 ms. Where
tokens share experts (ids among the 32 local ones: 40 pairs over 24 experts) the re-reads
lose: 348 us against 257, so this is a switch (`--moe_routing=pairs`), not the default.

Numerics are nvfp4_hfma2's (fp16 products exact, fp16 sums within a 16-weight block, fp32
beyond), and the interpreter runs its jnp twin. The reference is the grouped kernel's,
moe_grouped_matmul_reference (the model's expert MLP in fp32). Lowering: Triton, as nvfp4_hfma2.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from glmjax.quant.nvfp4 import BLOCK, NVFP4Weight
from pallas_kernels.bf16_matmul import default_bf16_config, split_gemv
from pallas_kernels.checks import check_at_least, check_tile, resolve_interpret
from pallas_kernels.hfma2_planes import rows_planes, swiglu_planes
from pallas_kernels.moe_grouped_matmul import check_moe_inputs
from pallas_kernels.nvfp4_hfma2 import (PLANES, activation_planes, block_fma, code_words, kernel_name, load_planes,
                                        load_weights, row_result, widen_word_loads, words_shape)
from pallas_kernels.nvfp4_matmul import (HFMA2_FIELDS, MatmulConfig, f16_rows, load_tile, local_block, range_mask,
                                         skinny_rows, split_k_loop, store_tile, summed_splits)

@dataclasses.dataclass(frozen=True)
class PairsConfig:
  """gate_up, down: each launch's tiles (block_n rows x block_k inputs), K splits and warps,
  as MatmulConfig(dot="hfma2"); groups: programs sharing a row block and K split, taking
  every groups-th pair. The defaults are the best of 20 configs at one TEP=8 rank's view of
  GLM-5 (5 tokens, 6-7 local pairs; BENCHMARKS.md run 20): fewer programs with more pairs
  each beat many short ones (8 or 16 groups, K split 3-12, 32-row tiles: 5-58% slower).
  fused_planes: x's and h's fp16 activation planes in one launch each (hfma2_planes.py)
  rather than XLA's glue (five kernels): one rank's experts 58.2 against 61.6 us (BENCHMARKS.md
  run 22); off by default, as every fold's switch (an ablation turns it on). planes_chunk_lines:
  x's planes kernel's lines a program (rows_planes' chunk_lines; None: whole rows; 128: 2.6 ->
  2.1 us at the rank's 5 x 6144, run 35). wide_words: both launches steer Triton into loading
  the code words 32 bytes a thread, so their K loops convert no layout through shared memory
  (nvfp4_hfma2.widen_word_loads; each launch one unused [block_n, block_k / 8] bf16 output
  more); the same bits; untimed (session 50, no GPU), off."""
  gate_up: MatmulConfig = MatmulConfig(block_n=16, block_k=512, split_k=2, **HFMA2_FIELDS)
  down: MatmulConfig = MatmulConfig(block_n=16, block_k=512, split_k=1, **HFMA2_FIELDS)
  groups: int = 4
  fused_planes: bool = False
  planes_chunk_lines: int | None = 128
  wide_words: bool = False

  def __post_init__(self):
    for name in ("gate_up", "down"):
      if getattr(self, name).dot != "hfma2":
        raise ValueError(f"PairsConfig.{name} must be a MatmulConfig(dot='hfma2'), got {getattr(self, name)}")
    check_at_least("PairsConfig", "groups", self.groups)
    if self.planes_chunk_lines is not None:
      check_tile("PairsConfig", "planes_chunk_lines", self.planes_chunk_lines, minimum=1)


@dataclasses.dataclass(frozen=True)
class SharedDown:
  """The shared expert's down GEMV as more programs of the gate/up launch (moe_hfma2's
  shared_down): its tiling and its inputs k. The grid's row blocks past gate/up's are its
  programs, each (row block, K split, group) one of its D / block_n x split_k (row tile, K
  split) programs, in that order."""
  config: MatmulConfig
  k: int


def _local_pairs(ids_ref, weights_ref, *, slots: int, experts: int):
  """(count, pick): the step's local slots and pick(p) -> (expert, slot, routing weight or
  None) of the one of rank p, from the [T*k] ids (and weights) read whole."""
  s = jnp.arange(ids_ref.shape[0])
  in_range = s < slots
  ids = pltriton.load(ids_ref, mask=in_range, other=-1)
  weights = None if weights_ref is None else pltriton.load(weights_ref, mask=in_range, other=0.0)
  local = (ids >= 0) & (ids < experts)
  rank = jnp.cumsum(local.astype(jnp.int32)) - local.astype(jnp.int32)  # local slots before s

  def pick(p):
    chosen = local & (rank == p)
    weight = None if weights is None else jnp.sum(jnp.where(chosen, weights, 0.0))
    return jnp.sum(jnp.where(chosen, ids, 0)), jnp.sum(jnp.where(chosen, s, 0)), weight

  return jnp.sum(local.astype(jnp.int32)), pick


def strided_share(count, group, groups: int):
  """This program's share of [0, count), the p = group, group + groups, ... < count: (how many,
  p_of(j) -> the j-th of them)."""
  return jnp.maximum(count - group + groups - 1, 0) // groups, lambda j: group + j * groups


def strided_loop(count, body, init, *, group, groups: int):
  """body(p, carry) folded over this program's share p = group, group + groups, ... < count (of
  pairs here, of chosen experts in moe_fragments)."""
  trips, p_of = strided_share(count, group, groups)
  return lax.fori_loop(0, trips, lambda j, carry: body(p_of(j), carry), init)


def _pair_sums(planes_ref, weights, e, row, *, split, rows_ok, k: int, config: MatmulConfig,
               interpret: bool) -> tuple[jax.Array, ...]:
  """fp32 [bn, blocks] block sums of this program's rows (`rows_ok` their mask) of each weight
  (its words and scales refs) of expert e against activation row `row`, over K split `split`."""
  bn, blocks = config.block_n, config.block_k // BLOCK

  def step(st, accs):
    cols_ok = range_mask(st * blocks, blocks, k // BLOCK)
    planes = load_planes(planes_ref, row, st, blocks=blocks, cols_ok=cols_ok, shape=(bn, blocks))
    out = []
    for (words, scales), acc in zip(weights, accs):
      word0, word1, scale = load_weights(words, scales, (e,), st, blocks=blocks, rows_ok=rows_ok, cols_ok=cols_ok)
      out.append(block_fma(acc, word0, word1, planes, scale, ptx=not interpret))
    return tuple(out)

  return split_k_loop(step, k=k, block_m=1, config=config, split=split,
                      init=tuple(jnp.zeros((bn, blocks), jnp.float32) for _ in weights))


def _gate_up_kernel(ids_ref, planes_ref, amax_ref, gate_words, gate_scales, gate_global, up_words, up_scales,
                    up_global, *refs, top_k: int, slots: int, experts: int, d: int, i: int, config: PairsConfig,
                    shared: SharedDown | None, interpret: bool):
  # ids_ref: i32 [Sp] of the [T*k] ids; planes_ref: u32 [T * 8, Dp/16] (x's activation_planes);
  # amax_ref: f32 [T] (f16_rows' row maxima); gate / up: words u32 [E, bn, Dp/8], scales e4m3
  # [E, bn, Dp/16], global f32 [E]; with shared, then its hidden bf16 [Tp, Ip] and down weight
  # bf16 [Dp, Ip], whole; g_ref, u_ref: f32 [Pp, bn] of the [S, T*k, I] partials; with shared,
  # then its output [S', Tp, Dp], whole; with config.wide_words, last, widen_word_loads' hint_ref.
  # Row blocks j >= first (gate/up's row blocks) are the shared GEMV's.
  if config.wide_words:
    *refs, hint_ref = refs
  hidden_ref, w_ref, g_ref, u_ref, s_ref = refs if shared else (None, None, *refs, None)
  cfg = config.gate_up
  j, split, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  def pairs():
    rows_ok = range_mask(j * cfg.block_n, cfg.block_n, i)
    count, pick = _local_pairs(ids_ref, None, slots=slots, experts=experts)

    def pair(p, carry):
      e, slot, _ = pick(p)
      token = slot // top_k
      sums = _pair_sums(planes_ref, ((gate_words, gate_scales), (up_words, up_scales)), e, token, split=split,
                        rows_ok=rows_ok, k=d, config=cfg, interpret=interpret)
      for acc, global_ref, o_ref in zip(sums, (gate_global, up_global), (g_ref, u_ref)):
        store_tile(o_ref.at[pl.ds(p, 1)], row_result(acc, global_ref[e], amax_ref[token])[None], None, rows_ok)
      return carry

    strided_loop(count, pair, 0, group=group, groups=config.groups)
    if config.wide_words:
      widen_word_loads(hint_ref, count < 0)

  if shared is None:
    return pairs()
  first, bn = pl.cdiv(i, cfg.block_n), shared.config.block_n
  pl.when(j < first)(pairs)
  q = (j - first) * cfg.split_k * config.groups + split * config.groups + group  # its program of the GEMV
  block, gemv_split = q % pl.cdiv(d, bn), q // pl.cdiv(d, bn)

  @pl.when((j >= first) & (gemv_split < shared.config.split_k))
  def _():
    rows_ok, n_ok = range_mask(0, hidden_ref.shape[0], slots // top_k), range_mask(block * bn, bn, d)
    load_x = lambda cols, cols_ok: load_tile(hidden_ref.at[:, cols], rows_ok, cols_ok)
    acc = split_gemv(load_x, w_ref, n_ok, k=shared.k, block_m=hidden_ref.shape[0], config=shared.config,
                     split=gemv_split, rows=pl.ds(block * bn, bn))
    store_tile(s_ref.at[gemv_split, :, pl.ds(block * bn, bn)], acc.astype(s_ref.dtype), rows_ok, n_ok)


def _down_kernel(ids_ref, weights_ref, planes_ref, amax_ref, words_ref, scales_ref, global_ref, o_ref, *hint_ref,
                 t: int, top_k: int, slots: int, experts: int, d: int, i: int, config: PairsConfig,
                 interpret: bool):
  # ids_ref, weights_ref: i32 / f32 [Sp] of the [T*k] choice; planes_ref: u32 [T*k * 8, Ip/16]
  # (h's activation_planes, a row per pair); amax_ref: f32 [T*k]; down: words u32 [E, bn, Ip/8],
  # scales e4m3 [E, bn, Ip/16], global f32 [E]; o_ref: f32 [Tp, bn] of the [S * G, T, D] partials;
  # with config.wide_words, hint_ref (widen_word_loads').
  cfg = config.down
  j, split, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows_ok = range_mask(j * cfg.block_n, cfg.block_n, d)
  count, pick = _local_pairs(ids_ref, weights_ref, slots=slots, experts=experts)
  tokens = jnp.arange(o_ref.shape[0])

  def pair(p, total):
    e, slot, weight = pick(p)
    (acc,) = _pair_sums(planes_ref, ((words_ref, scales_ref),), e, p, split=split, rows_ok=rows_ok, k=i,
                        config=cfg, interpret=interpret)
    y = row_result(acc, global_ref[e], amax_ref[p]) * weight
    return total + jnp.where(tokens[:, None] == slot // top_k, y[None, :], 0.0)

  total = strided_loop(count, pair, jnp.zeros((o_ref.shape[0], cfg.block_n), jnp.float32), group=group,
                       groups=config.groups)
  store_tile(o_ref, total, range_mask(0, o_ref.shape[0], t), rows_ok)
  if config.wide_words:
    widen_word_loads(hint_ref[0], count < 0)


def _operands(w: NVFP4Weight) -> list[jax.Array]:
  return [code_words(w.packed), w.block_scale, w.global_scale]


def _weight_specs(w: NVFP4Weight, config: MatmulConfig) -> list[pl.BlockSpec]:
  """BlockSpecs of `_operands(w)`: every expert (the kernel picks one), rows of program axis 0
  (clipped into the weight: a launch's shared_down programs lie past its rows)."""
  e, n, k = w.shape
  kp = pl.cdiv(k, config.block_k) * config.block_k  # blocks may overhang: the overhang is masked
  blocks = pl.cdiv(n, config.block_n)
  rows = lambda width: pl.BlockSpec((e, config.block_n, width), lambda j, s, g: (0, local_block(j, 0, blocks), 0))
  return [rows(kp // 8), rows(kp // BLOCK), pl.BlockSpec((e,), lambda j, s, g: (0,))]


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
  return pl.BlockSpec(shape, lambda j, s, g: (0,) * len(shape))


def check_nvfp4_experts(owner: str, weights: dict) -> None:
  """The pairs run NVFP4 expert weights only: a clear error naming any other."""
  for name, w in weights.items():
    if not isinstance(w, NVFP4Weight):
      raise ValueError(f"{owner}: the CUDA-core pairs need NVFP4 expert weights (e.g. --weights=nvfp4_experts); "
                       f"{name} is {type(w).__name__}")


def check_given_planes(x_planes: tuple[jax.Array, jax.Array], x: jax.Array, config: PairsConfig) -> None:
  """ValueError unless x_planes are rows_planes' outputs for x [T, D], where config builds x's
  planes in one launch (fused_planes)."""
  if not config.fused_planes:
    raise ValueError("moe_hfma2: x_planes replace the fused planes launch: they need PairsConfig.fused_planes")
  (t, d), (planes, amax) = x.shape, x_planes
  want = ((t * PLANES, d // BLOCK), jnp.uint32), ((t,), jnp.float32)
  if ((planes.shape, planes.dtype), (amax.shape, amax.dtype)) != want:
    raise ValueError(f"moe_hfma2: x_planes must be u32 [{t * PLANES}, {d // BLOCK}] and f32 [{t}], got "
                     f"{planes.dtype}{list(planes.shape)} and {amax.dtype}{list(amax.shape)}")


def check_shared_down(shared_down: tuple[jax.Array, jax.Array], t: int, d: int) -> None:
  """ValueError unless shared_down is (hidden bf16 [t, Is], down weight bf16 [d, Is])."""
  hidden, w = shared_down
  if (hidden.ndim, w.ndim, hidden.shape[0], w.shape[0], hidden.shape[1]) != (2, 2, t, d, w.shape[1]) or {
      hidden.dtype, w.dtype} != {jnp.dtype(jnp.bfloat16)}:
    raise ValueError(f"moe_hfma2: shared_down must be the shared expert's hidden bf16 [{t}, Is] and down weight bf16 "
                     f"[{d}, Is], got {hidden.dtype}{list(hidden.shape)} and {w.dtype}{list(w.shape)}")


@functools.partial(jax.jit, static_argnames=("config", "keep_partials", "interpret"))
def moe_hfma2(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, gate_proj: NVFP4Weight,
              up_proj: NVFP4Weight, down_proj: NVFP4Weight, *, config: PairsConfig | None = None,
              keep_partials: bool = False, x_planes: tuple[jax.Array, jax.Array] | None = None,
              shared_down: tuple[jax.Array, jax.Array] | None = None,
              interpret: bool | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Routed-expert MLP of a decode step, each (token, local expert) pair on the CUDA cores.

  Args:
    x: bf16 [T, D].
    topk_ids: int32 [T, k] expert ids; outside [0, E) contributes zero.
    topk_weights: [T, k] routing weights (applied in fp32).
    gate_proj, up_proj: NVFP4Weight [E, I, D]; down_proj: NVFP4Weight [E, D, I].
    config: tiling; default PairsConfig().
    keep_partials: return the down launch's fp32 partials [S, T, D] unsummed (their sum rounded
      to bf16 is the result), for a kernel that sums them itself (bf16_matmul.swiglu_matmul).
    x_planes: x's planes and row maxima as rows_planes(x, chunk_lines=config.planes_chunk_lines)
      gives them, built in another launch (moe_route.route_select_planes); with
      config.fused_planes only.
    shared_down: the shared expert's hidden bf16 [T, Is] and down weight bf16 [D, Is]: its down
      GEMV as more programs of the gate/up launch (`Runtime.shared_down`), which needs neither's
      output, so the two run side by side, one launch fewer. The programs are bf16_matmul's at
      default_bf16_config(D, Is) (split_gemv), so its output is bf16_matmul's bit for bit, or
      with keep_partials bf16_matmul_partials' [S', T, D]; they run at the launch's warps and
      stages (config.gate_up's: 4 and 1, so their K loop is not software-pipelined; the GEMV's
      own launch takes 3 stages, for 2 K steps at GLM-5's rank shape).
    interpret: run the Pallas interpreter; default: on the CPU backend.
  Returns:
    bf16 [T, D], or the partials; with shared_down, (that, the shared expert's output).
  """
  config = PairsConfig() if config is None else config
  check_nvfp4_experts("moe_hfma2", check_moe_inputs("moe_hfma2", x, topk_ids, topk_weights, gate_proj, up_proj,
                                                    down_proj))
  interpret = resolve_interpret(interpret)
  (t, d), (e, i), top_k = x.shape, gate_proj.shape[:2], topk_ids.shape[1]
  slots = t * top_k
  ids, weights = topk_ids.reshape(slots), topk_weights.astype(jnp.float32).reshape(slots)
  choice_spec = _whole((pl.next_power_of_2(slots),))
  sizes = dict(top_k=top_k, slots=slots, experts=e, d=d, i=i, config=config, interpret=interpret)

  def launch(kernel, inputs, specs, outs, out_specs, cfg: MatmulConfig, n: int, name: str, extra_rows: int = 0,
             **extra):
    """The launch's outputs (a list), without widen_word_loads' hint (config.wide_words)."""
    hint = [jax.ShapeDtypeStruct(words_shape(cfg), jnp.bfloat16)] if config.wide_words else []
    out = pl.pallas_call(
        functools.partial(kernel, **sizes, **extra), out_shape=[*outs, *hint],
        grid=(pl.cdiv(n, cfg.block_n) + extra_rows, cfg.split_k, config.groups),
        in_specs=specs, out_specs=[*out_specs, *(_whole(h.shape) for h in hint)], interpret=interpret,
        name=kernel_name(name, cfg),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))(*inputs)
    return out[:len(outs)]

  up_cfg = config.gate_up
  if x_planes is not None:
    check_given_planes(x_planes, x, config)
    x_planes, x_amax = x_planes
  elif config.fused_planes:
    x_planes, x_amax = rows_planes(x, chunk_lines=config.planes_chunk_lines, interpret=interpret)
  else:
    x16, x_amax = f16_rows(x)
    x_planes = activation_planes(x16).reshape(t * PLANES, d // BLOCK)
  partial = jax.ShapeDtypeStruct((up_cfg.split_k, slots, i), jnp.float32)
  blocks = pl.cdiv(i, up_cfg.block_n)
  partial_spec = pl.BlockSpec((None, pl.next_power_of_2(slots), up_cfg.block_n),
                              lambda j, s, g: (s, 0, local_block(j, 0, blocks)))
  inputs = [ids, x_planes, x_amax, *_operands(gate_proj), *_operands(up_proj)]
  specs = [choice_spec, _whole((t * PLANES, pl.cdiv(d, up_cfg.block_k) * up_cfg.block_k // BLOCK)), _whole((t,)),
           *_weight_specs(gate_proj, up_cfg), *_weight_specs(up_proj, up_cfg)]
  outs, out_specs, shared, extra_rows = [partial, partial], [partial_spec, partial_spec], None, 0
  if shared_down is not None:
    check_shared_down(shared_down, t, d)
    k_shared = shared_down[1].shape[1]
    gemv = default_bf16_config(d, k_shared)
    shared, dp = SharedDown(gemv, k_shared), pl.cdiv(d, gemv.block_n) * gemv.block_n
    extra_rows = pl.cdiv(dp // gemv.block_n * gemv.split_k, up_cfg.split_k * config.groups)
    rows, kp = skinny_rows(t), pl.cdiv(k_shared, gemv.block_k) * gemv.block_k  # overhangs are masked
    inputs += list(shared_down)
    specs += [_whole((rows, kp)), _whole((dp, kp))]
    split_out = gemv.split_k > 1 or keep_partials
    outs.append(jax.ShapeDtypeStruct((gemv.split_k, t, d), jnp.float32 if split_out else jnp.bfloat16))
    out_specs.append(_whole((gemv.split_k, rows, dp)))
  g, u, *shared_out = launch(_gate_up_kernel, inputs, specs, outs, out_specs, up_cfg, i, "moe_hfma2_gate_up",
                             extra_rows=extra_rows, shared=shared)

  if config.fused_planes:
    h_planes, h_amax = swiglu_planes(g, u, ids, experts=e, interpret=interpret)
  else:
    local = jnp.sum((ids >= 0) & (ids < e))
    h = jnp.where(jnp.arange(slots)[:, None] < local, jax.nn.silu(g.sum(0)) * u.sum(0), 0.0).astype(x.dtype)
    h16, h_amax = f16_rows(h)
    h_planes = activation_planes(h16).reshape(slots * PLANES, i // BLOCK)
  down_cfg = config.down
  tp = pl.next_power_of_2(t)
  [partials] = launch(_down_kernel,
                      [ids, weights, h_planes, h_amax,
                       *_operands(down_proj)],
                      [choice_spec, choice_spec,
                       _whole((slots * PLANES, pl.cdiv(i, down_cfg.block_k) * down_cfg.block_k // BLOCK)),
                       _whole((slots,)), *_weight_specs(down_proj, down_cfg)],
                      [jax.ShapeDtypeStruct((down_cfg.split_k * config.groups, t, d), jnp.float32)],
                      [pl.BlockSpec((None, tp, down_cfg.block_n), lambda j, s, g: (s * config.groups + g, 0, j))],
                      down_cfg, d, "moe_hfma2_down", t=t)
  routed = partials if keep_partials else partials.sum(0).astype(x.dtype)
  if shared_down is None:
    return routed
  return routed, shared_out[0] if keep_partials else summed_splits(shared_out[0], jnp.bfloat16)
