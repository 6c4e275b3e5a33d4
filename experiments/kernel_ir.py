"""A kernel's Triton IR and what ptxas makes of it for sm_90, without a GPU: the pieces behind
`python -m experiments.kernel_registers` (its docstring says why and how), importable without
its flags."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp

from experiments.triton_ptx import TRITON_VERSION

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel lowers to
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TRITON_VENV = os.path.join(ROOT, ".venv-triton")
REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32  # sm_90


def programs_per_sm(registers: int, num_warps: int) -> int:
  """Programs of num_warps warps an sm_90 SM holds for their registers (allocated a warp at a
  time, in units of 8 a thread), at most 32 and 64 warps."""
  per_warp = -(-registers // 8) * 8 * 32
  return min(REGISTERS_PER_SM // (per_warp * num_warps), MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM // num_warps)


def lower_for_h200(fn, *args) -> jax.stages.Lowered:
  """jit(fn)(*args) (ShapeDtypeStructs) lowered for an H200, traced under an abstract mesh: no
  GPU needed."""
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
  with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_kernels(fn, *args) -> list[tuple[dict, str]]:
  """(name, num_warps, num_stages, grid) and Triton IR text of each Pallas-Triton kernel in
  jit(fn)(*args) (ShapeDtypeStructs) lowered for an H200."""
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import lowering
  module = lower_for_h200(fn, *args).compiler_ir("stablehlo")
  configs = []

  def walk(op):
    if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL:
      configs.append(ir.DictAttr(op.attributes["mhlo.backend_config"]))
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          walk(child.operation)

  walk(module.operation)
  kernels, context = [], lowering._new_ir_context()
  for config in configs:
    meta = {"name": ir.StringAttr(config["name"]).value,
            **{key: ir.IntegerAttr(config[key]).value for key in ("num_warps", "num_stages", "grid_x", "grid_y",
                                                                   "grid_z")}}
    with context, ir.Location.unknown():
      kernels.append((meta, ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()))
  return kernels


def _dsa_case():
  """The DSA path of one TEP=8 rank's layer as `rank_fastest` runs it (bf16 queries, FP8 keys and
  latents): the indexer's scores and top-k of 2048 over 81,920 keys, then sparse MLA, 5 query
  tokens (experiments.bench_dsa's cases)."""
  from experiments.bench_dsa import FULL, SOFTMAX_SCALE, _indexer_cases, _mla_case
  from pallas_kernels.indexer_topk import indexer_topk
  from pallas_kernels.sparse_mla import sparse_mla_decode
  context, tokens = 81920, 5
  index_args, _ = _indexer_cases(FULL, context, tokens, True, jax.random.key(0))
  mla_args, _ = _mla_case(FULL, context, tokens, True, jax.random.key(1))
  bf16 = lambda a: a.astype(jnp.bfloat16)
  args = (bf16(index_args[0]), *index_args[1:], bf16(mla_args[0]), bf16(mla_args[1]), *mla_args[2:])

  def dsa(q, weights, index_k, index_scale, page_table, positions, *mla):
    picks = indexer_topk(q, weights, index_k, index_scale, page_table, positions, num_keys=context, k=FULL["k"],
                         interpret=False)
    return picks, sparse_mla_decode(*mla, softmax_scale=SOFTMAX_SCALE, interpret=False)
  return dsa, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)


def case(name: str, *, m: int, n: int, k: int, operands: str):
  """(fn, ShapeDtypeStructs) of a case (the flags')."""
  if name == "dsa":
    return _dsa_case()
  from glmjax.quant import quantize_nvfp4, to_fragments
  frag = lambda shape: jax.eval_shape(lambda w: to_fragments(quantize_nvfp4(w), operands),
                                      jax.ShapeDtypeStruct(shape, jnp.bfloat16))
  if name == "gemv":
    from pallas_kernels.nvfp4_fragments import fragment_matmul
    return lambda x, w: fragment_matmul(x, w, interpret=False), (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                                                 frag((n, k)))
  from experiments.bench_quant import MOE_CASE
  from pallas_kernels.moe_fragments import moe_fragments
  tokens, top_k, experts, d, i = (MOE_CASE[key] for key in ("tokens", "top_k", "experts", "d", "i"))
  return (lambda *a: moe_fragments(*a, interpret=False),
          (jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
           jax.ShapeDtypeStruct((tokens, top_k), jnp.float32), frag((experts, i, d)), frag((experts, i, d)),
           frag((experts, d, i))))


def triton_python() -> str:
  """.venv-triton's python, the venv made (with pip's Triton, TRITON_VERSION) if missing."""
  python = os.path.join(TRITON_VENV, "bin", "python")
  if not os.path.exists(python):
    print(f"kernel_registers: making {TRITON_VENV} with triton=={TRITON_VERSION} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", TRITON_VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"triton=={TRITON_VERSION}"], check=True)
  return python


def compile_rows(kernels: list[tuple[dict, str]], work_dir: str) -> list[dict]:
  """What ptxas says of each kernel (experiments.triton_ptx in .venv-triton), and its programs an SM."""
  for index, (meta, text) in enumerate(kernels):
    stem = os.path.join(work_dir, f"{index:02d}_{meta['name']}")
    with open(stem + ".ttir", "w") as f:
      f.write(text)
    with open(stem + ".json", "w") as f:
      json.dump(meta, f)
  done = subprocess.run([triton_python(), "-m", "experiments.triton_ptx", work_dir], capture_output=True, text=True,
                        check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
  rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  return [dict(row, programs_per_sm=programs_per_sm(row["registers"], row["num_warps"])) for row in rows]
