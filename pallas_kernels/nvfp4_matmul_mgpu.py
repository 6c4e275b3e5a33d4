"""Weight-only NVFP4 skinny matmul, Mosaic GPU (Hopper): y [M, N] = x [M, K] @ dequant(w [N, K]).T.

Same contract, decode and numerics as `nvfp4_matmul` (Triton; read its docstring first); this is
the experiment its Nsight Compute finding asked for. There the decoded tile goes to mma.sync's
operand layout through shared memory (L1/TEX at 81%, DRAM at 25-32%, 1.36 TB/s). Here:
- TMA (`plgpu.emit_pipeline`, `max_concurrent_steps` steps in flight) brings each step's packed
  uint8 tile, its e4m3 scales and x's column halves into SMEM; no thread issues HBM loads;
- the packed tile goes from SMEM to registers once (half a byte a weight), loaded directly in
  wgmma's A-operand layout (WGMMA_LAYOUT), so the decode is elementwise and moves no data
  between threads;
- wgmma takes A from registers: the decoded bf16 weights (2 bytes a weight) never touch SMEM.
Why Mosaic GPU and not Triton: in Triton the register layouts are the compiler's choice, and it
chose to convert the decoded tile to the MMA operand layout through SMEM (the ncu finding). In
Mosaic GPU the kernel states the layouts (layout inference around wgmma's operand) and TMA and
wgmma are explicit, so the trip through SMEM is simply not in the program.

Operands swapped, because wgmma's M is 64 rows per warpgroup and decode has 1-16 tokens:
  y^T [N, Mp] = W [N, K] @ x^T [K, Mp]
with the weight rows as wgmma's M (block_n rows per warpgroup, a multiple of 64; `warpgroups`
of them a CTA) and the tokens as its N, padded to Mp = 8 (M <= 8) or 16 (wgmma's N is a
multiple of 8, and the x tile's SMEM tiling (8, 64) needs 8 rows). x^T is the B operand as a
transposed view of x's [Mp, block_k / 2] SMEM tile (K contiguous, as x is in HBM).

Layouts (what layout inference picks at block_k = 256, MLIR after inference): packed uint8
[64, 128] SMEM tile tiled (8, 128) with the 128-byte swizzle, loaded into WGMMA_LAYOUT; x halves
[Mp, 128] bf16 tiled (8, 64), 128-byte swizzle; scales [64, 16] e4m3 untiled, their transposed
view [16, 64] loaded in WGMMA_ROW_LAYOUT (a thread holds its 2 rows of each of the 16 columns);
the broadcast scales, decoded halves and the f32 [64, Mp] accumulator in WGMMA_LAYOUT.

Decode (exact, see nvfp4_matmul): `decode_halves` turns the packed tile into the even columns'
and the odd columns' fp16 tiles (E2M1 * 2^-14), each with the packed tile's shape and layout;
they are dotted against x's even and odd columns (split in XLA, `column_halves`), so no
interleave is needed. Scales: one e4m3 per row per 8 packed columns, and 8 columns are exactly
one (64, 8) tile of WGMMA_LAYOUT. The [block_n, block_k / 16] scale tile is read through a
transposed SMEM view into registers in WGMMA_ROW_LAYOUT (each thread gets the scales of its
own rows), row c of that view is broadcast over one 8-column slice of each half, and the
slices are concatenated back: all register-local. What Mosaic GPU rejects and why this form:
a scale column `s_smem[:, c]` is a strided SMEM view, and layout inference refuses to assign
transforms to refs whose minor stride is not 1; loading the whole [block_n, block_k / 16] tile
and slicing columns in registers finds no layout; broadcasting to [block_n, block_k / 16, 8]
and reshaping to [block_n, block_k / 2] changes the minor tiled dims, which register reshapes
do not support. The transposed view has minor stride 1 and its rows are the needed vectors.
2^14 and the per-tensor scale multiply the fp32 result in XLA (fused with the un-transpose).

Bytes and FLOPs at [1, 8192] x [8192, 28672]: weights 117.4 MB + scales 14.7 MB = 132.1 MB
(4.5 bits a weight), x 16 KB; 0.47 GFLOP useful (8x that on the tensor cores with Mp = 8).
At 4.22 TB/s that is 31.3 us; the target (80%) is 39 us, against 97 us for the Triton kernel.

Shapes: N a multiple of 8 (the SMEM tiles are tiled (8, .), and TMA then wants whole 8-row
tiles in HBM: Mosaic GPU rejects N = 130 when it lowers); the last row block may overhang N
(TMA zero-fills what it reads past N; the fp32 output is padded to whole blocks and sliced). K a
multiple of 256 and of block_k * split_k: TMA needs every operand's HBM rows 16-byte aligned,
and a scale row is K/16 bytes. Padding N or K would copy the whole weight, so the wrapper raises.

On the CPU the tests run this kernel in Mosaic GPU's interpreter (InterpretGPUParams), with one
difference: the interpreter's wgmma reads A only from SMEM (it treats the operand as an SMEM
allocation handle), so interpret mode stores the decoded tiles to an SMEM scratch first
(`a_operand="smem"`, also a switch on the GPU, for the ablation). The lowering for an H200 runs
Mosaic GPU's layout inference and its TMA checks on this CPU machine, so the register-A path is
checked there. The interpreter runs each warpgroup as a host thread that blocks in barrier
waits; with warpgroups=3 (4 threads) it hung on a 2-core machine in 5 of 7 runs (3 threads in
barrier waits, the others inside XLA's CPU runtime), with 2 it never did, and on the H200 the
same warpgroups=3 config ran and matched: an interpreter limit, so the tests interpret <= 2.

Measured on the H200 (2026-12-01, one helper session, no profiler): all configs match the fp32
reference on the GPU (rel. error <= 2e-5; M = 1..16, N = 136..1000, split K, 1-3 warpgroups,
A from registers or SMEM). Speed, [M, 8192] x [8192, 28672], a jit of 20 calls on different x
(min of 5, wrapper's XLA ops included):
  M = 1:  Triton decode="ptx" 92 us; this kernel 125 us (1.06 TB/s on weights + scales); block_k
          512: 122; warpgroups=2: 127, 3: 163; max_concurrent_steps=8: 131; A through SMEM: 153.
  M = 16: Triton decode="ptx" 104 us; this kernel 143 us; warpgroups=2: 138; A through SMEM: 144.
Ablations at M = 1 (wrong results, timing only): without the scale multiply 112 us; with the
decode replaced by a bare uint8 -> bf16 convert 83 us. So the decode is not the only limit: the
TMA -> SMEM -> registers -> wgmma skeleton itself ran at 1.6 TB/s. Suspects, unprofiled: the
packed tile's SMEM loads (WGMMA_LAYOUT on uint8 is 2 bytes a thread a load; a wider layout such
as WGMMA_LAYOUT_UPCAST_2X plus a relayout is the fix to try), the 1-byte scale loads,
`wgmma_wait(0)` every step with one warpgroup a CTA (decode, 16 dependent m64n8k16 wgmmas and
the next step's wait do not overlap; keeping a wgmma in flight needs `delay_release`), and
the XLA ops around the kernel (x split and pad before; the [split_k, Np, Mp] fp32 sum,
un-transpose and scale after: a stand-in of that size timed 11 us), which an in-kernel bf16
epilogue would remove. Not the first limit: x re-read from L2 by every 64-row CTA (58 MB at
Mp = 8; warpgroups=2 halves it and was no faster).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from glmjax.quant.nvfp4 import BLOCK, NVFP4Weight
from pallas_kernels.checks import check_at_least, check_choice, resolve_interpret
from pallas_kernels.nvfp4_matmul import (DECODE_SCALE, NUM_SMS, check_skinny_input, column_halves,
                                         decode_halves, nvfp4_matmul_reference)

__all__ = ["MgpuMatmulConfig", "default_mgpu_config", "nvfp4_matmul_mgpu", "nvfp4_matmul_reference"]

WGMMA_M = 64          # rows of one wgmma (and of one warpgroup's accumulator slab)
TMA_ROW_BYTES = 16    # TMA: every HBM row stride a multiple of 16 bytes
TMA_ROW_TILE = 8      # SMEM tiles are (8, swizzle) tiled; TMA wants whole row tiles in HBM
K_MULTIPLE = BLOCK * TMA_ROW_BYTES  # a scale row is K/16 bytes
A_OPERANDS = ("registers", "smem")
MAX_WARPGROUPS = 3    # compute warpgroups a CTA, next to the TMA warpgroup (4 x 128 threads)
MEMORY_REGISTERS = 40  # a thread of the TMA-only warpgroup (the value JAX's Hopper matmuls use)


@dataclasses.dataclass(frozen=True)
class MgpuMatmulConfig:
  """Tiling of the Mosaic GPU NVFP4 matmul.

  block_n: weight rows per warpgroup, wgmma's M (a multiple of 64: block_n / 64 M-groups).
  warpgroups: compute warpgroups a CTA (block_n rows each); above 1 the pipeline is
  warp-specialized (one more warpgroup issues the TMA copies), so a CTA fetches each x tile
  once for warpgroups * block_n rows. block_k: logical inputs per pipeline step (the packed
  tile is block_k / 2 bytes a row, the scale tile block_k / 16; a multiple of 256 so that the
  scale tile's rows are 16 bytes, TMA's minimum).
  max_concurrent_steps: pipeline depth (TMA steps in flight; SMEM per CTA is about that times
  (rows * block_k * 9/16 + Mp * block_k * 2) bytes, plus rows * block_k * 2 for a_operand="smem";
  Mosaic GPU rejects more than 227 KB when it lowers). split_k: CTAs sharing one row
  block along K (fp32 partials summed in XLA). a_operand: "registers" (the point of this kernel)
  or "smem" (decoded tile stored to SMEM first; what the interpreter runs).
  """
  block_n: int = 64
  warpgroups: int = 1
  block_k: int = 256
  max_concurrent_steps: int = 4
  split_k: int = 1
  a_operand: str = "registers"

  def __post_init__(self):
    if self.block_n < WGMMA_M or self.block_n % WGMMA_M:
      raise ValueError(f"MgpuMatmulConfig.block_n must be a positive multiple of {WGMMA_M} "
                       f"(wgmma M), got {self.block_n}")
    if not 1 <= self.warpgroups <= MAX_WARPGROUPS:
      raise ValueError(f"MgpuMatmulConfig.warpgroups must be 1..{MAX_WARPGROUPS}, "
                       f"got {self.warpgroups}")
    if self.block_k < K_MULTIPLE or self.block_k % K_MULTIPLE:
      raise ValueError(f"MgpuMatmulConfig.block_k must be a positive multiple of {K_MULTIPLE} "
                       f"(its scale tile, block_k/16 bytes a row, must be 16-byte TMA rows), "
                       f"got {self.block_k}")
    check_at_least("MgpuMatmulConfig", "max_concurrent_steps", self.max_concurrent_steps)
    check_at_least("MgpuMatmulConfig", "split_k", self.split_k)
    check_choice("MgpuMatmulConfig", "a_operand", self.a_operand, A_OPERANDS)


def default_mgpu_config(m: int, n: int, k: int) -> MgpuMatmulConfig:
  """Unmeasured first guess: one warpgroup of 64 rows a CTA (448 CTAs at N = 28672, several per
  SM), block_k 256 (the two decoded bf16 halves of a step are 32 registers a thread each; 512
  doubles that), 4 steps in flight; then split K while there are fewer than 2 CTAs per SM and
  each split keeps >= 4 steps."""
  del m
  blocks, steps = pl.cdiv(n, WGMMA_M), k // K_MULTIPLE
  split = 1
  while blocks * split < 2 * NUM_SMS and steps % (2 * split) == 0 and steps // (2 * split) >= 4:
    split *= 2
  return MgpuMatmulConfig(split_k=split)


def padded_rows(m: int) -> int:
  """Tokens as wgmma's N: a multiple of 8 (the x tile's SMEM tiling is (8, swizzle))."""
  return 8 if m <= 8 else 16


def _scaled_halves(packed: jax.Array, scale_t: jax.Array) -> list[jax.Array]:
  """uint8 [bn, kh] codes and e4m3 [kh/8, bn] scales (transposed view) -> the even and the odd
  columns' bf16 [bn, kh] tiles, E2M1 * scale * 2^-14 (exact, see nvfp4_matmul).

  One scale per row per 8 packed columns = one (64, 8) tile of WGMMA_LAYOUT: each 8-column slice
  is scaled by a row vector broadcast along its columns, then the slices are joined again, all
  without moving data between threads (module docstring).
  """
  bn, kh = packed.shape
  scale = scale_t.astype(jnp.float16)  # [kh/8, bn]
  per = BLOCK // 2
  out = []
  for half in decode_halves(packed):
    cols = [half[:, c * per:(c + 1) * per] * jnp.broadcast_to(scale[c][:, None], (bn, per))
            for c in range(kh // per)]
    out.append(jnp.concatenate(cols, axis=1).astype(jnp.bfloat16))
  return out


def _step(w_smem, s_smem, xe_smem, xo_smem, acc, a_smem) -> None:
  """acc [64 * g, Mp] += decoded w_smem [64 * g, kh] @ [xe_smem | xo_smem].T, one pipeline step.

  w_smem: uint8 [rows, kh]; s_smem: e4m3 [rows, kh/8]; xe_smem, xo_smem: bf16 [Mp, kh];
  a_smem: None (A from registers) or bf16 [2, rows, kh] (A through SMEM, a_operand="smem").
  """
  halves = _scaled_halves(w_smem[...], s_smem.T[...])
  if a_smem is not None:
    for i, h in enumerate(halves):
      a_smem[i] = h
    plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma's async proxy
    halves = [a_smem.at[0], a_smem.at[1]]
  for a, x_smem in zip(halves, (xe_smem, xo_smem)):
    plgpu.wgmma(acc, a, x_smem.T)
  plgpu.wgmma_wait(0)


def _in_specs(rows: int, config: MgpuMatmulConfig, mp: int, j, first) -> list[plgpu.BlockSpec]:
  """Per step: the packed [rows, kh] and scale [rows, kh/8] tiles of row block j, and x's halves."""
  kh, ks = config.block_k // 2, config.block_k // BLOCK
  return [plgpu.BlockSpec((rows, kh), lambda k: (j, first + k)),
          plgpu.BlockSpec((rows, ks), lambda k: (j, first + k)),
          plgpu.BlockSpec((mp, kh), lambda k: (0, first + k)),
          plgpu.BlockSpec((mp, kh), lambda k: (0, first + k))]


def _kernel(xe_gmem, xo_gmem, w_gmem, s_gmem, o_gmem, *scratch, config: MgpuMatmulConfig, mp: int,
            steps: int):
  # xe_gmem, xo_gmem: bf16 [Mp, K/2] (x's even and odd columns); w_gmem: uint8 [N, K/2];
  # s_gmem: e4m3 [N, K/16]; o_gmem: f32 [split_k, Np, Mp] (y^T partials, times 2^-14 / global);
  # scratch (a_operand="smem"): bf16 [2, block_n, block_k/2]. One warpgroup: all rows of the
  # block, TMA issued from the same warpgroup by emit_pipeline.
  bn = config.block_n
  j, split = lax.axis_index("n"), lax.axis_index("k")
  a_smem = scratch[0] if scratch else None

  def scope(acc):  # acc: f32 [bn, Mp]
    plgpu.emit_pipeline(
        lambda _, *refs: _step(*refs, acc, a_smem), grid=(steps,),
        max_concurrent_steps=config.max_concurrent_steps,
        in_specs=_in_specs(bn, config, mp, j, split * steps))(w_gmem, s_gmem, xe_gmem, xo_gmem)
    o_gmem[split, pl.ds(j * bn, bn), :] = acc[...]

  pl.run_scoped(scope, plgpu.ACC((bn, mp), jnp.float32))


def _kernel_ws(xe_gmem, xo_gmem, w_gmem, s_gmem, o_gmem, *scratch, config: MgpuMatmulConfig,
               mp: int, steps: int):
  # As _kernel, with `warpgroups` compute warpgroups of block_n rows each and one more that only
  # issues the TMA copies (warp specialization): the x tiles are fetched once for all of them.
  bn, wgs = config.block_n, config.warpgroups
  j, split, wg = lax.axis_index("n"), lax.axis_index("k"), lax.axis_index("wg")
  rows = pl.ds(wg * bn, bn)

  def body(_, w_smem, s_smem, xe_smem, xo_smem, acc):
    a_smem = scratch[0].at[wg] if scratch else None
    _step(w_smem.at[rows], s_smem.at[rows], xe_smem, xo_smem, acc, a_smem)
    return acc

  def compute_context(run):
    def scope(acc):  # acc: f32 [bn, Mp], this warpgroup's rows
      run(acc)
      o_gmem[split, pl.ds((j * wgs + wg) * bn, bn), :] = acc[...]
    pl.run_scoped(scope, plgpu.ACC((bn, mp), jnp.float32))

  plgpu.emit_pipeline_warp_specialized(
      body, grid=(steps,), memory_registers=MEMORY_REGISTERS, wg_axis="wg", num_compute_wgs=wgs,
      max_concurrent_steps=config.max_concurrent_steps, compute_context=compute_context,
      in_specs=_in_specs(wgs * bn, config, mp, j, split * steps))(w_gmem, s_gmem, xe_gmem, xo_gmem)


def _nvfp4_matmul_mgpu(x: jax.Array, w: NVFP4Weight, config: MgpuMatmulConfig, interpret: bool):
  (m, k), n = x.shape, w.shape[0]
  if interpret and config.a_operand == "registers":
    config = dataclasses.replace(config, a_operand="smem")  # the interpreter's wgmma: A in SMEM
  bn, wgs, kh = config.block_n, config.warpgroups, config.block_k // 2
  mp = padded_rows(m)
  blocks = pl.cdiv(n, wgs * bn)
  steps = k // config.block_k // config.split_k
  xe, xo = (jnp.pad(h, ((0, mp - m), (0, 0))) for h in column_halves(x))
  scratch = [plgpu.SMEM((wgs, 2, bn, kh) if wgs > 1 else (2, bn, kh), jnp.bfloat16)
             ] if config.a_operand == "smem" else []
  threads = dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}
  call = plgpu.kernel(
      functools.partial(_kernel_ws if wgs > 1 else _kernel, config=config, mp=mp, steps=steps),
      out_type=jax.ShapeDtypeStruct((config.split_k, blocks * wgs * bn, mp), jnp.float32),
      grid=(blocks, config.split_k), grid_names=("n", "k"), **threads,
      scratch_types=scratch,
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  yt = call(xe, xo, w.packed, w.block_scale).sum(0)  # f32 [Np, Mp]
  return (yt[:n, :m].T * (w.global_scale * DECODE_SCALE)).astype(x.dtype)


def check_mgpu_shapes(n: int, k: int, config: MgpuMatmulConfig) -> None:
  """N and K constraints of the TMA tiles (module docstring: Shapes)."""
  if n % TMA_ROW_TILE:
    raise ValueError(f"nvfp4_matmul_mgpu: N must be a multiple of {TMA_ROW_TILE} (the weight and "
                     f"scale tiles are tiled (8, .) in SMEM and TMA then needs whole row tiles "
                     f"in HBM), got N={n}")
  if k % K_MULTIPLE:
    raise ValueError(f"nvfp4_matmul_mgpu: K must be a multiple of {K_MULTIPLE} (TMA needs the "
                     f"e4m3 scale rows, K/16 bytes, 16-byte aligned), got K={k}")
  if k % (config.block_k * config.split_k):
    raise ValueError(f"nvfp4_matmul_mgpu: K={k} must be a multiple of block_k * split_k = "
                     f"{config.block_k} * {config.split_k}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def nvfp4_matmul_mgpu(x: jax.Array, w: NVFP4Weight, *, config: MgpuMatmulConfig | None = None,
                      interpret: bool | None = None) -> jax.Array:
  """x @ dequant(w).T: NVFP4 weights TMA-pipelined, decoded in registers into wgmma's A operand.

  Args:
    x: bf16 [M, K], 1 <= M <= 16.
    w: NVFP4Weight of logical shape [N, K]; N a multiple of 8; K a multiple of 256 and of
      block_k * split_k.
    config: tiling; default `default_mgpu_config(M, N, K)`.
    interpret: run Mosaic GPU's interpreter (A operand through SMEM); default: on the CPU backend.
  Returns:
    bf16 [M, N].
  """
  if not isinstance(w, NVFP4Weight):
    raise ValueError(f"nvfp4_matmul_mgpu needs an NVFP4Weight, got {type(w).__name__}")
  check_skinny_input(x, w.shape, "nvfp4_matmul_mgpu")
  config = default_mgpu_config(x.shape[0], *w.shape) if config is None else config
  check_mgpu_shapes(w.shape[0], x.shape[1], config)
  interpret = resolve_interpret(interpret)
  return _nvfp4_matmul_mgpu(x, w, config, interpret)
