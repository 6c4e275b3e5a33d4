"""Split-K bf16 matmul for decode: y [M, N] = x [M, K] @ w [N, K].T, M <= 16, plain bf16 weights.

Why, when XLA's bf16 GEMV already runs at copy speed: it does so only for wide outputs. On the
H200 the [1, 8192] x [8192, 28672] GEMV moves its 470 MB at 4.2 TB/s, but the 25 MB projections
of a GLM-5 TEP=8 rank's decode step, [1-5, 6144] -> 2048 (q_a_proj, the shared expert's gate and
up) and [1-5, 2048] -> 6144 (o_proj, the shared expert's down), take 18-27 us in XLA, 0.9-1.4
TB/s (docs/BENCHMARKS.md runs 5 and 10): too few row tiles of N to occupy 132 SMs. Five of them
run in every decoder layer, about 0.1 ms of the rank's 0.5 ms a layer, where the bytes ask for
about 30 us at copy speed. Here K is split too (`default_bf16_config`), and XLA sums the fp32
partials (a few KB).

The kernel is the weight-only matmuls' (nvfp4_matmul.py, fp8_matmul.py) with nothing to decode:
grid (N / block_n, split_k), a K loop of contiguous [block_n, block_k] weight tiles, the tensor
cores on x padded to 16 rows, fp32 accumulation; Triton lowering for the same reasons as theirs.
Switch: `Runtime.dense_matmul` ("xla" | "pallas"; --dense_matmul on the experiments).

Measured (H200, BENCHMARKS.md run 11, loop-timed with its launch gaps): at 5 rows, [6144] -> 2048
14.3 us with the default tiles against XLA's 20.1; [2048] -> 6144 14.8 against 18.9; the wide
[1, 8192] x [8192, 28672] 121 us, XLA's speed. In one TEP=8 rank's decode layer (profile, run
11) the dense projections' kernels take about as long as XLA's (68 us in 11 launches against
72 in 11): the 25 MB GEMVs are slower loop-timed than inside the step.

bf16_matmul_group runs weights that share their input in one launch, its grid over all their
row blocks (`--dense_matmul=pallas_grouped`: q_a with kv_a, the indexer's wk with
weights_proj, an MLP's gate with up): in the rank's layer 8 launches and 61 us against 11 and
71 (run 15 against run 14: two calls, not a same-call comparison).

swiglu_matmul is an MLP's down GEMV that builds its input itself, silu(gate) * up, from the
gate/up launch's split-K partials (`--swiglu=pallas`): XLA's kernel between the two GEMVs (the
sums, silu, the product: 1.2-1.9 us a layer in the rank's profile, run 26) folds into the
launch. For an MoE layer's shared expert (`--moe_sum=pallas`) the launch also ends the layer:
residual + routed experts + shared expert, XLA's last kernel of the layer (`layer_sum`).
Measured slower (H200, BENCHMARKS.md run 27): every program of the down GEMV sums all the
gate/up splits again (at a TEP=8 rank's shared expert 96 programs x [8, 5, 256] x 2 f32 from
L2, against 3.1 MB of weights), 17.3 us with the layer sum against 4.7 for XLA's steps; the
best of 20 tilings 11.1 without it. Both stay switches, off by default.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.checks import check_fold_splits, resolve_interpret
from pallas_kernels.partials import check_partials, split_tile_sum
from pallas_kernels.nvfp4_matmul import (NUM_SMS, MatmulConfig, check_skinny_input, check_tensor_core_config,
                                         dot_t, load_tile, local_block, range_mask, row_blocks, skinny_call,
                                         skinny_rows, split_k_loop, store_tile)

MAX_SPLIT = 8
SHARED_MEMORY = 232448  # bytes a program may take on an H200 (its opt-in maximum, as Triton reports it)


def default_bf16_config(n: int, k: int) -> MatmulConfig:
  """64 x 128 weight tiles, K split (up to 8 ways, >= 2 steps a program) until about four
  programs per SM: the best or within 6% of the best of six tilings at both of a rank's 25 MB
  shapes (run 11: 14.3 us at [5, 6144] -> 2048, 14.8 at [5, 2048] -> 6144, where the weight-only
  kernels' rule, 128 x 128 tiles split to two programs per SM, took 17.5 and 19.7)."""
  block_n, block_k = 64, 128
  blocks, steps = pl.cdiv(n, block_n), pl.cdiv(k, block_k)
  split = 1
  while split < MAX_SPLIT and blocks * split < 4 * NUM_SMS and steps >= 4 * split:
    split *= 2
  return MatmulConfig(block_n=block_n, block_k=block_k, split_k=split)


def fold_config(n: int, k: int, splits: str | int = "fill") -> MatmulConfig:
  """The split-K config of a GEMV whose partials a fold reads whole (bf16_matmul_partials: the
  residual norm, MLA's epilogue and absorbed query, the indexer's keys, a program per token or
  head reading every split). "rule": default_bf16_config's (about four programs per SM); "fill"
  (the default): its K split cut to the fewest splits whose programs still cover the SMs once,
  since each split more is one more read of every partial for the fold; an int >= 1: the rule's
  split, at most that many. Run 36 (H100, GEMV + fold, 3-4 weight sets in turn): o_proj 8 -> 2
  splits 17.5 -> 13.4 us (run 35), MLA's epilogue group 8 -> 4 17.6 -> 17.1, the absorbed query's
  8 -> 2 14.8 -> 14.2; one split fewer than "fill" slows each GEMV more than its fold gains."""
  check_fold_splits(splits)
  rule = default_bf16_config(n, k)
  if splits == "rule":
    return rule
  if splits == "fill":
    blocks, split = pl.cdiv(n, rule.block_n), 1
    while split < rule.split_k and blocks * split < NUM_SMS:
      split *= 2
    return dataclasses.replace(rule, split_k=split)
  return dataclasses.replace(rule, split_k=min(rule.split_k, splits))


def swiglu_stage_bytes(config: MatmulConfig, splits: int, m: int) -> int:
  """Shared memory swiglu_matmul's K loop takes for m rows: Triton pipelines every load that feeds
  the dot, here each split's gate and up tiles (f32 [skinny_rows(m), block_k]) and the weight
  tile, through num_stages - 1 buffers in shared memory."""
  step = 2 * splits * skinny_rows(m) * config.block_k * 4 + config.block_n * config.block_k * 2
  return (config.num_stages - 1) * step


def swiglu_config(n: int, k: int, splits: int, m: int) -> MatmulConfig:
  """swiglu_matmul's default: default_bf16_config's grid (its K split, which decides whether
  the layer sum fits), with block_k halved until the pipelined partial tiles fit in shared
  memory (8 splits at 128-wide steps asked 288 KB of the H200's 227 KB, run 27)."""
  config = default_bf16_config(n, k)
  while config.block_k > 16 and swiglu_stage_bytes(config, splits, m) > SHARED_MEMORY:
    config = dataclasses.replace(config, block_k=config.block_k // 2)
  return config


def _bf16(v: jax.Array) -> jax.Array:
  """fp32 v rounded to bf16, as fp32 (a bf16 op's result, as XLA rounds it)."""
  return v.astype(jnp.bfloat16).astype(jnp.float32)


def swiglu_tile(g_ref, u_ref, cols, rows_ok, cols_ok) -> jax.Array:
  """bf16 silu(gate) * up over a tile of columns, as the MLP computes it from its gate and up
  projections' split-K partials g_ref, u_ref f32 [S, rows, K]: each summed over the splits in
  order and rounded to bf16 (the projection's output), then JAX's bf16 silu, x / (1 + exp(-x))
  as x * (1 / (1 + exp(-x))) with each op's result rounded to bf16 (as XLA computes bf16 ops),
  and the product with up, rounded."""
  gate, up = (_bf16(split_tile_sum(ref, rows_ok, cols_ok, slice(None), cols)) for ref in (g_ref, u_ref))
  sigmoid = _bf16(1.0 / _bf16(1.0 + _bf16(jnp.exp(-gate))))
  return (_bf16(gate * sigmoid) * up).astype(jnp.bfloat16)


def layer_sum(residual_ref, routed_ref, acc, rows_ok, n_ok) -> jax.Array:
  """An MoE layer's new residual from the shared expert's output tile acc (fp32, the whole K): as
  the model adds it up, residual + (bf16(sum of the routed experts' partials) + bf16(acc))
  rounded to bf16, the sum in fp32 (rounded to the residual's dtype when stored). That is the
  model's sum op by op; XLA, allowed excess precision (its default), may fuse a bf16 stream's
  two additions without the intermediate rounding (a tiny model's tokens then differ, run 27)."""
  routed = _bf16(split_tile_sum(routed_ref, rows_ok, n_ok))
  return load_tile(residual_ref, rows_ok, n_ok).astype(jnp.float32) + _bf16(routed + _bf16(acc))


def split_gemv(load_x, w_ref, n_ok, *, k: int, block_m: int, config: MatmulConfig, split,
               rows=slice(None)) -> jax.Array:
  """fp32 [block_m, block_n]: this program's share (K split `split`) of x @ w.T over the row tile
  w_ref[rows] (block_n rows, `n_ok` their mask), load_x(cols, cols_ok) giving x's [block_m,
  block_k] tile: the split-K GEMV's K loop, for its own launch (w_ref its tile) and for a launch
  it rides in (moe_hfma2's, w_ref whole: Triton's loads take one indexer, so rows and columns
  are indexed together)."""
  bk = config.block_k

  def body(step, acc):
    cols, cols_ok = pl.ds(step * bk, bk), range_mask(step * bk, bk, k)
    return acc + dot_t(load_x(cols, cols_ok), load_tile(w_ref.at[rows, cols], n_ok, cols_ok))

  return split_k_loop(body, k=k, block_m=block_m, config=config, split=split)


def _bf16_matmul_kernel(*refs, m: int, ns: tuple[int, ...], k: int, block_m: int, config: MatmulConfig,
                        swiglu: bool, epilogue: bool):
  # x_ref: bf16 [block_m, Kp] of [M, K], or with swiglu g_ref, u_ref: f32 [S, block_m, Kp] of the
  # [S, M, K] partials x comes from (swiglu_tile); with epilogue then residual_ref f32 [block_m,
  # bn] of [M, N] and routed_ref f32 [S2, block_m, bn] of [S2, M, N] (swiglu_matmul's); then per
  # weight (ns: their rows) w_ref bf16 [bn, Kp]; then per weight o_ref [block_m, bn] of its
  # [split_k, M, N] output (fp32 or bf16). With several weights, grid row block j belongs to one
  # of them (row_blocks) and only that one is read.
  bn = config.block_n
  x_refs, refs = (refs[:2], refs[2:]) if swiglu else (refs[:1], refs[1:])
  epilogue_refs, refs = (refs[:2], refs[2:]) if epilogue else ((), refs)
  w_refs, o_refs = refs[:len(ns)], refs[len(ns):]
  rows_ok = range_mask(0, block_m, m)
  j, split = pl.program_id(0), pl.program_id(1)

  def load_x(cols, cols_ok):
    if swiglu:
      return swiglu_tile(*x_refs, cols, rows_ok, cols_ok)
    return load_tile(x_refs[0].at[:, cols], rows_ok, cols_ok)

  def matmul(w_ref, o_ref, n: int, block):
    n_ok = range_mask(block * bn, bn, n)
    acc = split_gemv(load_x, w_ref, n_ok, k=k, block_m=block_m, config=config, split=split)
    if epilogue:
      acc = layer_sum(*epilogue_refs, acc, rows_ok, n_ok)
    store_tile(o_ref, acc.astype(o_ref.dtype), rows_ok, n_ok)

  if len(ns) == 1:
    return matmul(w_refs[0], o_refs[0], ns[0], j)
  for (first, count), n, w_ref, o_ref in zip(row_blocks(ns, bn), ns, w_refs, o_refs):
    pl.when((j >= first) & (j < first + count))(functools.partial(matmul, w_ref, o_ref, n, j - first))


def _check(x: jax.Array, w, out_dtype, name: str) -> None:
  if not isinstance(w, jax.Array) or w.dtype != jnp.bfloat16:
    raise ValueError(f"{name} needs bf16 weight arrays, got {getattr(w, 'dtype', type(w).__name__)}")
  check_skinny_input(x, w.shape, name)
  if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"{name}: out_dtype must be bf16 or f32, got {jnp.dtype(out_dtype)}")


def _launch(xs: tuple[jax.Array, ...], ws: tuple[jax.Array, ...], out_dtype, config: MatmulConfig | None,
            interpret: bool | None, keep_splits: bool = False, epilogue: tuple[jax.Array, ...] = ()):
  """The one launch of bf16_matmul (one weight), bf16_matmul_group (several), bf16_matmul_partials
  and swiglu_matmul. xs: (x,), or swiglu_matmul's (g, u) partials; epilogue: its (residual,
  routed partials), which need the whole K in one program."""
  (m, k), ns, swiglu = xs[0].shape[-2:], tuple(w.shape[0] for w in ws), len(xs) == 2
  if config is None:
    config = swiglu_config(sum(ns), k, xs[0].shape[0], m) if swiglu else default_bf16_config(sum(ns), k)
  check_tensor_core_config(config, "bf16_matmul")
  if swiglu and (smem := swiglu_stage_bytes(config, xs[0].shape[0], m)) > SHARED_MEMORY:
    raise ValueError(f"swiglu_matmul: {config} pipelines {smem} bytes of shared memory, over the "
                     f"{SHARED_MEMORY} a program has: lower block_k or num_stages")
  interpret = resolve_interpret(interpret)
  block_m, kp = skinny_rows(m), pl.cdiv(k, config.block_k) * config.block_k  # overhangs are masked
  if epilogue and config.split_k != 1:
    raise ValueError(f"swiglu_matmul: the layer sum needs the whole K in one program, got split_k={config.split_k}")
  kernel = functools.partial(_bf16_matmul_kernel, m=m, ns=ns, k=k, block_m=block_m, config=config,
                             swiglu=swiglu, epilogue=bool(epilogue))
  w_spec = lambda first, count: pl.BlockSpec((config.block_n, kp), lambda j, s: (local_block(j, first, count), 0))
  x_spec = lambda x: pl.BlockSpec((*x.shape[:-2], block_m, kp), lambda j, s: (0,) * x.ndim)
  tile_spec = lambda a: pl.BlockSpec((*a.shape[:-2], block_m, config.block_n), lambda j, s: (0,) * (a.ndim - 1) + (j,))
  specs = [*map(x_spec, xs), *map(tile_spec, epilogue),
           *(w_spec(first, count) for first, count in row_blocks(ns, config.block_n))]
  return skinny_call(kernel, [*xs, *epilogue, *ws], specs, m=m, n=ns if len(ws) > 1 else ns[0],
                     dtype=jnp.dtype(out_dtype), config=config, interpret=interpret,
                     name="swiglu_matmul" if swiglu else "bf16_matmul", keep_splits=keep_splits)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def bf16_matmul(x: jax.Array, w: jax.Array, *, out_dtype=jnp.bfloat16, config: MatmulConfig | None = None,
                interpret: bool | None = None) -> jax.Array:
  """x @ w.T for decode-sized x, fp32 accumulation.

  Args:
    x: bf16 [M, K], 1 <= M <= 16.
    w: bf16 [N, K] (any N, K).
    out_dtype: bf16, or fp32 (the fp32 computations of bf16 operands: the indexer's
      projections, the router).
    config: tiling; default `default_bf16_config(N, K)`.
    interpret: run the Pallas interpreter; default: on the CPU backend.
  Returns:
    [M, N] in out_dtype.
  """
  _check(x, w, out_dtype, "bf16_matmul")
  return _launch((x,), (w,), out_dtype, config, interpret)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def bf16_matmul_group(x: jax.Array, ws: tuple[jax.Array, ...], *, out_dtype=jnp.bfloat16,
                      config: MatmulConfig | None = None, interpret: bool | None = None) -> tuple[jax.Array, ...]:
  """(x @ w.T for w in ws) in one launch: weights that share their input (gate and up, q_a and
  kv_a) read by one grid whose row blocks run over all of them; each output as bf16_matmul's.
  Default config: `default_bf16_config` of their rows together."""
  if not ws:
    raise ValueError("bf16_matmul_group needs at least one weight")
  for w in ws:
    _check(x, w, out_dtype, "bf16_matmul_group")
  return _launch((x,), tuple(ws), out_dtype, config, interpret)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def bf16_matmul_partials(x: jax.Array, w: jax.Array | tuple[jax.Array, ...], *, config: MatmulConfig | None = None,
                         interpret: bool | None = None) -> jax.Array | tuple[jax.Array, ...]:
  """bf16_matmul's fp32 split-K partials [split_k, M, N], unsummed: for a kernel that sums them
  itself in the same launch as its own work (pallas_kernels/moe_route.py), one XLA kernel fewer.
  A tuple of weights sharing x: bf16_matmul_group's launch, a tuple of partials."""
  for weight in w if isinstance(w, tuple) else (w,):
    _check(x, weight, jnp.float32, "bf16_matmul_partials")
  return _launch((x,), w if isinstance(w, tuple) else (w,), jnp.float32, config, interpret, keep_splits=True)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def swiglu_matmul(g: jax.Array, u: jax.Array, w: jax.Array, *, residual: jax.Array | None = None,
                  routed: jax.Array | None = None, config: MatmulConfig | None = None,
                  interpret: bool | None = None) -> jax.Array:
  """A SwiGLU MLP's down projection from its gate and up projections' split-K partials: bf16
  [M, N] = (silu(gate) * up) @ w.T with gate, up the partials' sums (`swiglu_tile`), in one
  launch where XLA sums the partials and multiplies in a kernel of its own before the down
  GEMV (glmjax.layers.MLP under `Runtime.swiglu`).

  With residual and routed (the shared expert of an MoE layer, `Runtime.moe_sum`), the launch
  also adds the layer up (`layer_sum`) and returns the new residual stream [M, N] in its dtype,
  where XLA's kernel of its own would (the routed partials' sum, the two additions).

  Args:
    g, u: f32 [S, M, K] (bf16_matmul_partials of the gate and up weights), 1 <= M <= 16.
    w: bf16 [N, K], the down projection.
    residual: f32 or bf16 [M, N], the layer's residual stream; routed: f32 [S2, M, N], the routed
      experts' partials (quant.moe_experts(partials=True)). Both or neither; they need the whole
      K in one program (config.split_k 1, the default for K <= 256 or so).
    config, interpret: as bf16_matmul's (default tiles: `swiglu_config`; a config whose pipelined
      tiles overflow shared memory is a ValueError).
  """
  for name, part in (("g", g), ("u", u)):
    check_partials("swiglu_matmul", name, part, "K")
  if u.shape != g.shape:
    raise ValueError(f"swiglu_matmul: u must be shaped as g {list(g.shape)}, got {list(u.shape)}")
  _check(jax.ShapeDtypeStruct(g.shape[1:], jnp.bfloat16), w, jnp.bfloat16, "swiglu_matmul")  # x's shape, as K
  if (residual is None) != (routed is None):
    raise ValueError("swiglu_matmul: residual and routed come together (the layer sum) or not at all")
  if residual is None:
    return _launch((g, u), (w,), jnp.bfloat16, config, interpret)
  rows_out = (g.shape[1], w.shape[0])
  if residual.shape != rows_out or residual.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"swiglu_matmul: residual must be f32 or bf16 {list(rows_out)}, got "
                     f"{residual.dtype}{list(residual.shape)}")
  check_partials("swiglu_matmul", "routed", routed, "N")
  if routed.shape[1:] != rows_out:
    raise ValueError(f"swiglu_matmul: routed must be f32 [S2, {rows_out[0]}, {rows_out[1]}], got {list(routed.shape)}")
  return _launch((g, u), (w,), residual.dtype, config, interpret, epilogue=(residual, routed))


def swiglu_matmul_reference(g: jax.Array, u: jax.Array, w: jax.Array, *, residual: jax.Array | None = None,
                            routed: jax.Array | None = None) -> jax.Array:
  """The model's XLA path from the same partials: sums rounded to bf16, silu(gate) * up in bf16,
  then the down projection in fp32, rounded to bf16; with residual and routed, the MoE layer's
  sum as the model adds it (MoE, then DecoderLayer)."""
  gate, up = (p.sum(0).astype(jnp.bfloat16) for p in (g, u))
  shared = bf16_matmul_reference(jax.nn.silu(gate) * up, w)
  if residual is None:
    return shared
  return residual + (routed.sum(0).astype(jnp.bfloat16) + shared).astype(residual.dtype)


def bf16_matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """fp32 reference: matmul in fp32, cast to out_dtype."""
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T, precision=lax.Precision.HIGHEST).astype(out_dtype)
