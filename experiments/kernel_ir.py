"""A kernel's Triton IR and what ptxas makes of it for sm_90, without a GPU: the pieces behind
`python -m experiments.kernel_registers` (its docstring says why and how), and the cases it and
`experiments.kernel_launch` take; importable without defining their flags."""

import ast
import dataclasses
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
from absl import flags

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


def _dsa_case(concrete: bool, interpret: bool | None):
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
                         interpret=interpret)
    return picks, sparse_mla_decode(*mla, softmax_scale=SOFTMAX_SCALE, interpret=interpret)
  return dsa, args if concrete else tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)


def _moe_step(concrete: bool, routed: int = 0):
  """x, (ids, routing weights) and bf16 (gate, up, down) of bench_quant's MOE_CASE: arrays (a
  routed step, `routed` as _moe_case's) or their ShapeDtypeStructs."""
  from experiments.bench_quant import MOE_CASE, _moe_case
  if concrete:
    x, routing, weights, _ = _moe_case(**MOE_CASE, routed=routed)
    return x, routing, weights
  tokens, top_k, experts, d, i = (MOE_CASE[key] for key in ("tokens", "top_k", "experts", "d", "i"))
  routing = (jax.ShapeDtypeStruct((tokens, top_k), jnp.int32), jax.ShapeDtypeStruct((tokens, top_k), jnp.float32))
  weights = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((experts, i, d),) * 2 + ((experts, d, i),))
  return jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16), routing, weights


def _pairs_case(concrete: bool, interpret: bool | None, shared_down: bool, wide_words: bool):
  """rank_fastest's routed experts (moe_hfma2, pairs_fused: x's planes from the router's launch
  are here its own) at one TEP=8 rank's view of MOE_CASE: 5 tokens, top-8 of 256 routed experts,
  32 of them local; with shared_down, tep8_shard's shared expert's down GEMV ([5, 256] -> 6144)
  as more programs of the gate/up launch (Runtime.shared_down); wide_words: PairsConfig's."""
  from configs import get_model_config
  from glmjax.quant import quantize_nvfp4
  from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
  rank = get_model_config("tep8_shard")
  x, routing, weights = _moe_step(concrete, routed=rank.n_routed_experts)
  shape = (rank.hidden_size, rank.shared_intermediate)
  if concrete:
    keys = jax.random.split(jax.random.key(1))
    shared = (jax.random.normal(keys[0], (x.shape[0], shape[1]), jnp.bfloat16),
              jax.random.normal(keys[1], shape, jnp.bfloat16) * 0.02)
  else:
    shared = (jax.ShapeDtypeStruct((x.shape[0], shape[1]), jnp.bfloat16), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
  experts = tuple(quantize_nvfp4(w) if concrete else jax.eval_shape(quantize_nvfp4, w) for w in weights)
  config = PairsConfig(fused_planes=True, wide_words=wide_words)

  def pairs(x, ids, weights, *rest):
    return moe_hfma2(x, ids, weights, *rest[:3], config=config, shared_down=tuple(rest[3:]) or None,
                     interpret=interpret)
  return pairs, (x, *routing, *experts, *(shared if shared_down else ()))


def case(name: str, *, m: int, n: int, k: int, operands: str, config=None, concrete: bool = False,
         shared_down: bool = False, wide_words: bool = False):
  """(fn, args) of a case (`define_case_flags`' flags): args as ShapeDtypeStructs, or with
  `concrete` as arrays to launch it on a GPU (random activations, weights quantized from random
  bf16 ones, the MoE a routed step; the kernels compiled on a GPU, interpreted on the CPU).
  config: the gemv case's FragmentConfig (None: the default); shared_down, wide_words: the pairs
  case's."""
  interpret = None if concrete else False  # abstract: always Triton's lowering (for an H200)
  if name == "dsa":
    return _dsa_case(concrete, interpret)
  if name == "pairs":
    return _pairs_case(concrete, interpret, shared_down, wide_words)
  from glmjax.quant import quantize_nvfp4, to_fragments
  quantized = lambda w: to_fragments(quantize_nvfp4(w), operands)
  frag = lambda w: quantized(w) if concrete else jax.eval_shape(quantized, w)
  if name == "gemv":
    from pallas_kernels.nvfp4_fragments import fragment_matmul
    from experiments.bench_quant import gemv_inputs
    x, w = (gemv_inputs(m, n, k) if concrete
            else (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16)))
    return lambda x, w: fragment_matmul(x, w, config=config, interpret=interpret), (x, frag(w))
  from pallas_kernels.moe_fragments import moe_fragments
  x, routing, weights = _moe_step(concrete)
  return lambda *a: moe_fragments(*a, interpret=interpret), (x, *routing, *(frag(w) for w in weights))


def define_case_flags() -> None:
  """The flags of a case, for the entry points that take one (kernel_registers, kernel_launch)."""
  flags.DEFINE_enum("case", "gemv", ["gemv", "moe", "pairs", "dsa"], "gemv: fragment_matmul [m, k] x [n, k]; moe: "
                    "moe_fragments at issue 6's case (5 tokens, top-8, 32 experts, 6144 -> 2048); pairs: "
                    "rank_fastest's moe_hfma2 there, ids among 256 experts (a TEP=8 rank's view); dsa: a rank's "
                    "indexer top-k and sparse MLA at 80K FP8 keys, 5 query tokens")
  flags.DEFINE_bool("shared_down", False, "pairs: the rank's shared expert's down GEMV in the gate/up launch "
                    "(Runtime.shared_down)")
  flags.DEFINE_bool("wide_words", False, "pairs: PairsConfig.wide_words (the code words loaded 32 bytes a thread)")
  flags.DEFINE_integer("m", 1, "gemv: rows of x")
  flags.DEFINE_integer("n", 28672, "gemv: the weight's rows")
  flags.DEFINE_integer("k", 8192, "gemv: the weight's columns")
  flags.DEFINE_enum("operands", "bfloat16", ["bfloat16", "float16"], "the fragment weights' MMA operands")
  flags.DEFINE_list("vary", [], "gemv: FragmentConfig fields changed from default_fragment_config's, as "
                    "field=value (e.g. unroll=8,prefetch=True)")


def case_from_flags(concrete: bool = False):
  """case(...) of `define_case_flags`' flags."""
  from pallas_kernels.nvfp4_fragments import FragmentConfig, default_fragment_config
  f = flags.FLAGS
  changes = dict(item.split("=", 1) if "=" in item else (item, "") for item in f.vary)
  known = [field.name for field in dataclasses.fields(FragmentConfig)]
  if changes and f.case != "gemv" or set(changes) - set(known) or "" in changes.values():
    raise flags.ValidationError(f"--vary takes field=value pairs of the gemv case's FragmentConfig ({known}), "
                                f"got {f.vary} for --case={f.case}")
  if (f.shared_down or f.wide_words) and f.case != "pairs":
    raise flags.ValidationError(f"--shared_down and --wide_words are the pairs case's, got --case={f.case}")
  config = dataclasses.replace(default_fragment_config(f.n, f.k, f.m, f.operands),
                               **{key: ast.literal_eval(value) for key, value in changes.items()}) if changes else None
  return case(f.case, m=f.m, n=f.n, k=f.k, operands=f.operands, config=config, concrete=concrete,
              shared_down=f.shared_down, wide_words=f.wide_words)


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
