"""Quantized weights (NVFP4, block FP8) and the one matmul entry point the model uses.

  linear(x, w, *, impl)       x [..., in] @ w.T for w [out, in]: a plain array, NVFP4Weight or
                              FP8BlockWeight.
  linear_group(x, ws, *, impl)  the same for several weights sharing x (one launch for plain
                              bf16 weights under dense="pallas_grouped").
  moe_experts(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj, *, impl)
                              sum_s w[t,s] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,s],
                              over stacked expert weights ([E, I, D] gate/up, [E, D, I] down).
  param(module, name, init_fn, shape, dtype)
                              a Flax module's weight, which may be a quantized leaf.
  quantize_nvfp4 / quantize_fp8_block / quantize_params(params, policy) / quantize_leaf
  arrange_params(params, fragments) / to_fragments / from_fragments
                              2-D NVFP4 weights in or out of the fragment kernel's order.

impl="xla" dequantizes and runs XLA's einsum (x.dtype inputs, fp32 accumulation); impl="pallas"
runs the weight-only kernels in pallas_kernels/ on decode-sized bf16 inputs (at most
nvfp4_matmul.MAX_ROWS rows), else the XLA path: more rows are compute-bound, and the kernels take
bf16 only (not the fp32 indexer or fp32 models). impl="pallas_ptx" is "pallas" with the NVFP4
tiles decoded by inline PTX (MatmulConfig / MoEConfig decode="ptx"; on the H200 the GEMV
[1, 8192] x [8192, 28672] takes 97 us against 124 us, BENCHMARKS.md run 10); "pallas_ptx_f16" is
"pallas_ptx" with fp16 tensor-core operands for the quantized weights (MatmulConfig / MoEConfig
operands="float16": no fp16 -> bf16 conversion of the decoded weights; activations scaled per
row into fp16 by a power of two, pallas_kernels/nvfp4_matmul.f16_rows); "pallas_hfma2" is
"pallas_ptx_f16" with NVFP4 linears of at most nvfp4_matmul.HFMA2_MAX_ROWS rows on the CUDA
cores' fp16x2 FMAs instead of the tensor cores (MatmulConfig.dot="hfma2",
pallas_kernels/nvfp4_hfma2.py); "pallas_fragments" is "pallas_hfma2" with the 2-D NVFP4 weights
in mma.sync's fragment order (FragmentWeight, glmjax.quant.fragments; `arrange_params` moves
them once, as the Engine does when it is given this impl; MLA's kv_b stays, read whole) on
pallas_kernels/nvfp4_fragments.py, eight rows a launch: [5, 8192] x [8192, 28672] takes 50 us
against the tensor cores' 86 (BENCHMARKS.md run 28), 47.7 with run 31's default tiles (XLA's
bf16: 114); `tep8_shard`'s step with every linear NVFP4, 17.91 ms against 18.21 (run 29); with
fragment_operands="bfloat16" (Runtime) the weights' K order lets the kernel read x itself; for the
epilogue folds (linear_partials, linear_group_partials) the kernel scales its K splits itself, so
they read them with no XLA epilogue between. Plain
arrays always take the plain einsum, unless dense="pallas": then decode-sized bf16 x against a
bf16 weight runs the split-K GEMV of pallas_kernels/bf16_matmul.py (XLA's bf16 GEMV reaches copy
speed only for wide outputs: 0.9-1.4 TB/s at a GLM-5 rank's 25 MB projections, BENCHMARKS.md
runs 5 and 10);
dense="pallas_grouped" is "pallas" with the projections that share their input in one launch
each (linear_group).
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from glmjax.quant.fp8_block import FP8BlockWeight, quantize_fp8_block
from glmjax.quant.fragments import OPERAND_CHOICES as FRAGMENT_OPERAND_CHOICES
from glmjax.quant.fragments import OPERANDS as FRAGMENT_OPERANDS
from glmjax.quant.fragments import FragmentWeight, arrange_params, from_fragments, to_fragments
from glmjax.quant.nvfp4 import NVFP4Weight, quantize_nvfp4
from glmjax.quant.policy import POLICIES, quantize_leaf, quantize_params, quantizes

IMPLS = ("xla", "pallas", "pallas_ptx", "pallas_ptx_f16", "pallas_hfma2", "pallas_fragments")
# The impls that run the NVFP4 experts' CUDA-core pairs (PAIR_ROUTINGS) and the one-row hfma2 dot.
HFMA2_IMPLS = ("pallas_hfma2", "pallas_fragments")
# Plain bf16 weights: XLA's einsum, the split-K Pallas GEMV, or that with weights sharing their
# input in one launch (linear_group).
DENSE_IMPLS = ("xla", "pallas", "pallas_grouped")
# The NVFP4 experts on the CUDA cores, a (token, expert) pair at a time: the activations' fp16
# planes from XLA's glue, or built in one launch each (pallas_kernels/hfma2_planes.py).
PAIR_ROUTINGS = ("pairs", "pairs_fused")
# The NVFP4 experts in fragment order, each chosen one read once for all tokens on the fragment
# GEMV (pallas_kernels/moe_fragments.py), under FRAGMENT_IMPL only.
FRAGMENT_ROUTING, FRAGMENT_IMPL = "fragments", "pallas_fragments"
QuantizedWeight = NVFP4Weight | FP8BlockWeight | FragmentWeight

__all__ = ["DENSE_IMPLS", "FP8BlockWeight", "FRAGMENT_IMPL", "FRAGMENT_OPERAND_CHOICES", "FRAGMENT_OPERANDS",
           "FRAGMENT_ROUTING", "FragmentWeight", "IMPLS", "NVFP4Weight", "PAIR_ROUTINGS", "POLICIES", "QuantizedWeight",
           "arrange_params", "decode_sized", "from_fragments", "linear", "linear_group", "linear_group_partials",
           "linear_partials", "moe_experts", "param", "quantize_fp8_block", "quantize_leaf", "quantize_nvfp4",
           "quantize_params", "quantizes", "to_fragments"]


def _check_impl(impl: str, dense: str = "xla") -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if dense not in DENSE_IMPLS:
    raise ValueError(f"dense must be one of {DENSE_IMPLS}, got {dense!r}")


def _decode(impl: str) -> str:
  """The NVFP4 tile decode of a Pallas impl."""
  return "ptx" if impl in ("pallas_ptx", "pallas_ptx_f16", *HFMA2_IMPLS) else "jnp"


def _operands(impl: str) -> str:
  """The tensor cores' operand dtype for quantized weights under a Pallas impl."""
  return "float16" if impl in ("pallas_ptx_f16", *HFMA2_IMPLS) else "bfloat16"


def _dot(impl: str, rows: int) -> str:
  """Where an NVFP4 linear of `rows` rows multiplies under a Pallas impl (MatmulConfig.dot)."""
  from pallas_kernels.nvfp4_matmul import HFMA2_MAX_ROWS
  return "hfma2" if impl in HFMA2_IMPLS and rows <= HFMA2_MAX_ROWS else "mma"


def decode_sized(x: jax.Array) -> bool:
  """Whether x [..., in] is decode-sized bf16 (1 to nvfp4_matmul.MAX_ROWS rows): where the Pallas
  matmuls run their kernels (see the module docstring) and the fused epilogues that read them."""
  from pallas_kernels.nvfp4_matmul import MAX_ROWS  # the kernels import the formats
  return x.dtype == jnp.bfloat16 and 1 <= math.prod(x.shape[:-1]) <= MAX_ROWS


def takes_bf16_gemv(x: jax.Array, w, dense: str, dtype) -> bool:
  """Whether x @ w.T in `dtype` runs the split-K bf16 GEMV: a plain bf16 w under a Pallas dense
  impl, decode-sized x, a bf16 or fp32 result (see `linear`)."""
  return (dense != "xla" and not isinstance(w, QuantizedWeight) and w.dtype == jnp.bfloat16
          and dtype in (jnp.bfloat16, jnp.float32) and decode_sized(x))


def param(module: nn.Module, name: str, init_fn, shape: tuple[int, ...], dtype):
  """`module.param(name, init_fn, shape, dtype)`, or the quantized leaf the params hold there.

  Flax checks a given param against init_fn's shape leaf by leaf, and a quantized leaf's first
  array is not of the logical shape (NVFP4 packs [out, in/2]); this checks the logical shape.
  """
  if module.has_variable("params", name):
    value = module.get_variable("params", name)
    if isinstance(value, QuantizedWeight):
      if value.shape != tuple(shape):
        raise ValueError(f"quantized param {'/'.join(module.scope.path)}/{name} has logical shape "
                         f"{value.shape}, the module expects {tuple(shape)}")
      return value
  return module.param(name, init_fn, shape, dtype)


def linear(x: jax.Array, w, *, impl: str = "xla", dense: str = "xla", dtype=None) -> jax.Array:
  """x [..., in] @ w.T for w of logical shape [out, in] -> [..., out], computed in `dtype`
  (default x.dtype; x is cast to it).

  Plain array: `jnp.einsum('...k,nk->...n', x, w)`, untouched, unless dense="pallas": the split-K
  bf16 GEMV for decode-sized bf16 x and w, with a bf16 result, or with an fp32 one under an
  fp32 `dtype` (the indexer's projections, the router): the same products as casting first, a
  bf16 product being exact in fp32, and no fp32 copy of the weight. Quantized, impl="xla":
  dequantize to `dtype`, einsum with fp32 accumulation. impl="pallas": the NVFP4 / FP8 skinny
  kernel for decode-sized bf16 x, its bf16 result cast to another `dtype` (the indexer's fp32
  projections), else the XLA path (see the module docstring). A FragmentWeight
  under any Pallas impl: the fragment kernel, a launch per 8 rows (each reads the weight); an
  NVFP4Weight under "pallas_fragments" (not arranged, or RAW): "pallas_hfma2"'s kernels.
  """
  _check_impl(impl, dense)
  dtype = x.dtype if dtype is None else jnp.dtype(dtype)
  rows = math.prod(x.shape[:-1])
  if not isinstance(w, QuantizedWeight):
    if not takes_bf16_gemv(x, w, dense, dtype):
      return jnp.einsum("...k,nk->...n", x.astype(dtype), w)
    from pallas_kernels.bf16_matmul import bf16_matmul
    out = bf16_matmul(x.reshape(rows, x.shape[-1]), w, out_dtype=dtype)
    return out.reshape(*x.shape[:-1], w.shape[0])
  if impl != "xla" and dtype != x.dtype and decode_sized(x):  # the kernel's result cast (an fp32 x would
    return linear(x, w, impl=impl, dense=dense).astype(dtype)  # miss it: the weight dequantized every step)
  x = x.astype(dtype)
  if w.ndim != 2 or w.shape[1] != x.shape[-1]:
    raise ValueError(f"linear: weight must be [out, in={x.shape[-1]}], got logical shape {w.shape}")
  if impl != "xla" and decode_sized(x):
    from pallas_kernels import fp8_matmul, nvfp4_matmul  # the kernels import the formats
    x2 = x.reshape(rows, x.shape[-1])
    if isinstance(w, FragmentWeight):
      from pallas_kernels.nvfp4_fragments import TOKENS, fragment_matmul
      out = jnp.concatenate([fragment_matmul(x2[i:i + TOKENS], w) for i in range(0, rows, TOKENS)])
    elif isinstance(w, NVFP4Weight):
      config = nvfp4_matmul.default_config(rows, *w.shape, decode=_decode(impl), operands=_operands(impl),
                                           dot=_dot(impl, rows))
      out = nvfp4_matmul.nvfp4_matmul(x2, w, config=config)
    else:
      config = fp8_matmul.default_fp8_config(rows, *w.shape, operands=_operands(impl))
      out = fp8_matmul.fp8_matmul(x2, w, config=config)
    return out.reshape(*x.shape[:-1], w.shape[0])
  return jnp.einsum("...k,nk->...n", x, w.dequantize(x.dtype),
                    preferred_element_type=jnp.float32).astype(x.dtype)


def _fragment_launch(x: jax.Array, w, impl: str) -> bool:
  """Whether x @ w.T is one launch of the fragment kernel: a FragmentWeight under a Pallas impl,
  decode-sized x of at most its eight rows."""
  from pallas_kernels.nvfp4_fragments import TOKENS  # the kernels import the formats
  return isinstance(w, FragmentWeight) and impl != "xla" and decode_sized(x) and math.prod(x.shape[:-1]) <= TOKENS


def linear_partials(x: jax.Array, w, *, impl: str = "xla", dense: str = "xla", dtype=jnp.float32,
                    splits: int | None = None, gemv_splits: str | int = "rule") -> jax.Array:
  """x [..., in] @ w.T as fp32 terms [S, rows, out] that sum to it: the split-K GEMV's partials,
  unsummed, where `linear` in `dtype` would run that kernel (its output: their sum rounded to
  dtype; as many as `gemv_splits` gives, bf16_matmul.fold_config's choice: "rule", "fill" or a cap),
  and the fragment kernel's (FragmentWeight: its K splits scaled in the program, `splits`
  of them, default its config's; nvfp4_fragments.fragment_matmul_partials), else [1, rows, out]
  (`linear` in dtype, as fp32). Another quantized weight: `linear` in x's dtype, as fp32: its
  kernel at decode, rounded as the unfused path rounds it (in fp32, x would miss the kernels and
  dequantize the whole weight every step). For a consumer that sums them in its own launch
  (pallas_kernels/moe_route.py, mla_query.py, residual_norm.py)."""
  rows = math.prod(x.shape[:-1])
  if _fragment_launch(x, w, impl):
    from pallas_kernels.nvfp4_fragments import fragment_matmul_partials
    return fragment_matmul_partials(x.reshape(rows, x.shape[-1]), w, split_k=splits)
  if not takes_bf16_gemv(x, w, dense, jnp.dtype(dtype)):
    out = linear(x, w, impl=impl, dense=dense, dtype=x.dtype if isinstance(w, QuantizedWeight) else dtype)
    return out.astype(jnp.float32).reshape(1, rows, w.shape[0])
  from pallas_kernels.bf16_matmul import bf16_matmul_partials, fold_config
  return bf16_matmul_partials(x.reshape(rows, x.shape[-1]), w, config=fold_config(*w.shape, gemv_splits))


def _grouped(x: jax.Array, weights, dense: str, dtype) -> bool:
  """Whether x @ w.T for the weights runs as one split-K launch (see linear_group)."""
  return dense == "pallas_grouped" and len(weights) > 1 and all(takes_bf16_gemv(x, w, dense, dtype) for w in weights)


def _fragment_group(fragments: list, dense: str) -> bool:
  """Whether these fragment launches (`_fragment_launch` weights sharing x) run as one: under
  dense="pallas_grouped", two or more, one operand dtype."""
  return dense == "pallas_grouped" and len(fragments) > 1 and len({w.operands for w in fragments}) == 1


def linear_group(x: jax.Array, weights, *, impl: str = "xla", dense: str = "xla", dtype=None) -> list[jax.Array]:
  """[linear(x, w, ...) for w in weights], with plain bf16 weights under dense="pallas_grouped"
  in one split-K launch (pallas_kernels/bf16_matmul.bf16_matmul_group) where x is decode-sized: the
  projections that share their input (q_a and kv_a, the indexer's wk and weights_proj, an MLP's
  gate and up) cost one launch, not two. So do FragmentWeights (their partials' launch, each
  summed by XLA as fragment_matmul's epilogue would)."""
  _check_impl(impl, dense)
  dtype = x.dtype if dtype is None else jnp.dtype(dtype)
  if dtype == x.dtype and all(_fragment_launch(x, w, impl) for w in weights) and _fragment_group(weights, dense):
    from pallas_kernels.nvfp4_fragments import fragment_matmul_partials  # the kernels import the formats
    partials = fragment_matmul_partials(x.reshape(-1, x.shape[-1]), tuple(weights))
    return [p.sum(0).astype(dtype).reshape(*x.shape[:-1], w.shape[0]) for p, w in zip(partials, weights)]
  if not _grouped(x, weights, dense, dtype):
    return [linear(x, w, impl=impl, dense=dense, dtype=dtype) for w in weights]
  from pallas_kernels.bf16_matmul import bf16_matmul_group
  outs = bf16_matmul_group(x.reshape(-1, x.shape[-1]), tuple(weights), out_dtype=dtype)
  return [out.reshape(*x.shape[:-1], w.shape[0]) for out, w in zip(outs, weights)]


def linear_group_partials(x: jax.Array, weights, *, impl: str = "xla", dense: str = "xla",
                          gemv_splits: str | int = "rule") -> list[jax.Array]:
  """[linear_partials(x, w, ...) for w in weights], in linear_group's one launch where it would
  group them: for a consumer that sums them in its own launch (pallas_kernels/indexer_keys.py).
  The fragment kernel's weights (FragmentWeights under pallas_fragments) share one launch too
  under dense="pallas_grouped" (one operand dtype). All with one split count: the fragment
  launches take the split-K kernels' (else their own default); where the counts still differ
  (another quantized weight or an XLA product beside split-K ones), each summed to [1, rows, out].
  gemv_splits: the split-K launch's split count, as linear_partials'."""
  _check_impl(impl, dense)
  if _grouped(x, weights, dense, jnp.float32):
    from pallas_kernels.bf16_matmul import bf16_matmul_partials, fold_config
    config = fold_config(sum(w.shape[0] for w in weights), x.shape[-1], gemv_splits)
    return list(bf16_matmul_partials(x.reshape(-1, x.shape[-1]), tuple(weights), config=config))
  partials = [None if _fragment_launch(x, w, impl) else linear_partials(x, w, impl=impl, dense=dense,
                                                                         gemv_splits=gemv_splits)
              for w in weights]
  fragments = [w for p, w in zip(partials, weights) if p is None]
  grouped = _fragment_group(fragments, dense)
  splits = max((p.shape[0] for p in partials if p is not None), default=1)
  if splits == 1 and fragments:  # no split-K kernel's count to follow: the fragment launches' default
    from pallas_kernels.nvfp4_fragments import default_fragment_config  # the kernels import the formats
    rows = sum(w.shape[0] for w in fragments) if grouped else fragments[0].shape[0]
    splits = default_fragment_config(rows, x.shape[-1]).split_k
  if grouped:
    from pallas_kernels.nvfp4_fragments import fragment_matmul_partials  # the kernels import the formats
    found = iter(fragment_matmul_partials(x.reshape(-1, x.shape[-1]), tuple(fragments), split_k=splits))
    partials = [next(found) if p is None else p for p in partials]
  partials = [linear_partials(x, w, impl=impl, dense=dense, splits=splits) if p is None else p
              for p, w in zip(partials, weights)]
  if len({p.shape[0] for p in partials}) > 1:
    partials = [p.sum(0, keepdims=True) for p in partials]
  return partials


def builds_x_planes(x: jax.Array, impl: str, routing: str) -> bool:
  """Whether moe_experts builds x's fp16 activation planes in a launch of their own
  (hfma2_planes.rows_planes, at PairsConfig's planes_chunk_lines): the pairs_fused routing's
  kernels at decode. A caller may build them in another launch and hand them over (x_planes)."""
  return routing == "pairs_fused" and impl != "xla" and decode_sized(x)


def _check_pairs(impl: str, routing: str, *weights) -> None:
  """The PAIR_ROUTINGS are the NVFP4 experts' CUDA-core path (moe_experts)."""
  if impl not in HFMA2_IMPLS:
    raise ValueError(f"moe_experts: routing={routing!r} runs on the CUDA cores' fp16x2 FMAs: it needs "
                     f"impl in {HFMA2_IMPLS}, got {impl!r}")
  from pallas_kernels.moe_hfma2 import check_nvfp4_experts  # the kernels import the formats
  check_nvfp4_experts(f"moe_experts: routing={routing!r}", dict(zip(("gate_proj", "up_proj", "down_proj"), weights)))


def moe_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, gate_proj, up_proj,
                down_proj, *, impl: str = "xla", routing: str = "table", chosen: float | None = None,
                partials: bool = False, x_planes: tuple[jax.Array, jax.Array] | None = None,
                shared_down: tuple[jax.Array, jax.Array] | None = None, wide_words: bool = False):
  """Routed-expert MLP of a few tokens: x [T, D], topk_ids int32 [T, k], topk_weights fp32 [T, k];
  gate_proj / up_proj [E, I, D], down_proj [E, D, I] (plain, NVFP4 or FP8 stacked weights).
  Ids outside [0, E) (experts of other ranks) add nothing. Returns [T, D] in x.dtype.

  impl="xla": the model's jnp reference (glmjax.moe.experts_reference). impl="pallas": the
  grouped kernels, one launch per projection that reads only the chosen experts' weights, for
  decode-sized bf16 x (else the reference, as in `linear`); `routing`: how the kernels find the
  chosen experts (MoEConfig.routing: "table" from XLA, or "scan" in-kernel), or "pairs": each
  (token, local expert) pair a one-row product on the CUDA cores (pallas_kernels/moe_hfma2.py;
  NVFP4 weights under an impl of HFMA2_IMPLS only, else a clear error), "pairs_fused" that with
  the activations' fp16 planes built in one launch each (PairsConfig.fused_planes), or
  "fragments": each chosen expert read once for all tokens on the fragment GEMV
  (pallas_kernels/moe_fragments.py; impl FRAGMENT_IMPL and stacked experts in bf16 fragment order,
  `arrange_params(..., experts=True)`; up to 8 tokens, more take the reference on the weights
  moved back to ModelOpt's order); `chosen`: the distinct local experts a step is expected to
  read, which picks the kernels' tiles (default_moe_config, default_experts_config; None: all of
  them). partials: fp32 terms [S, T, D] whose sum rounded to x.dtype is the result (the pairs' or
  the fragments' down partials, unsummed; else [1, T, D]), for a kernel that sums them itself
  (bf16_matmul.swiglu_matmul's epilogue). x_planes: x's fp16 planes and row maxima where a
  caller built them (`builds_x_planes`; moe_route.route_select_planes). shared_down: the shared
  expert's hidden bf16 [T, Is] and down weight bf16 [D, Is], its GEMV in the pairs' gate/up launch
  (moe_hfma2's; `builds_x_planes` routings only): returns (the routed output, the shared
  expert's: bf16 [T, D], with partials its split-K partials, as linear_partials gives them).
  wide_words: the pairs' PairsConfig.wide_words (Runtime.pairs_wide_words).
  """
  _check_impl(impl)
  if x_planes is not None and not builds_x_planes(x, impl, routing):
    raise ValueError(f"moe_experts: x_planes are the pairs_fused kernels' at decode, not routing={routing!r}, "
                     f"impl={impl!r} for x {x.dtype}{list(x.shape)}")
  if shared_down is not None and not builds_x_planes(x, impl, routing):
    raise ValueError(f"moe_experts: shared_down rides in the pairs_fused kernels' gate/up launch at decode, not "
                     f"routing={routing!r}, impl={impl!r} for x {x.dtype}{list(x.shape)}")
  if wide_words and routing not in PAIR_ROUTINGS:
    raise ValueError(f"moe_experts: wide_words is the pairs kernels' layout hint (routing in {PAIR_ROUTINGS}), not "
                     f"routing={routing!r}")
  if routing in PAIR_ROUTINGS:
    _check_pairs(impl, routing, gate_proj, up_proj, down_proj)
  if routing == FRAGMENT_ROUTING:
    from pallas_kernels.moe_fragments import TOKENS, check_expert_fragments, default_experts_config, moe_fragments
    if impl != FRAGMENT_IMPL:
      raise ValueError(f"moe_experts: routing={routing!r} runs on the fragment GEMV: it needs impl="
                       f"{FRAGMENT_IMPL!r}, got {impl!r}")
    check_expert_fragments(gate_proj, up_proj, down_proj)
    if decode_sized(x) and x.shape[0] <= TOKENS:
      return moe_fragments(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj, keep_partials=partials,
                           config=default_experts_config(chosen))
    gate_proj, up_proj, down_proj = map(from_fragments, (gate_proj, up_proj, down_proj))
    impl = "xla"
  if impl != "xla" and decode_sized(x):
    if routing in PAIR_ROUTINGS:
      from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
      return moe_hfma2(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
                       config=PairsConfig(fused_planes=routing == "pairs_fused", wide_words=wide_words),
                       keep_partials=partials, x_planes=x_planes, shared_down=shared_down)
    from pallas_kernels.moe_grouped_matmul import default_moe_config, moe_grouped_matmul
    config = default_moe_config((gate_proj, up_proj, down_proj), decode=_decode(impl), routing=routing,
                                chosen=chosen, operands=_operands(impl))
    out = moe_grouped_matmul(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj, config=config)
  else:
    from glmjax.moe import experts_reference
    out = experts_reference(x, topk_ids, topk_weights, gate_proj, up_proj, down_proj)
  return out.astype(jnp.float32)[None] if partials else out
