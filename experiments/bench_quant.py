"""Skinny matmuls on GLM-5 shapes: the NVFP4 / block-FP8 / bf16 Pallas kernels against XLA.

`quant_rows(quick=False)` yields one dict per (case, implementation), each case as it is
measured; experiments/kernels_bench.py prints them. Every case times, in the same run, XLA's bf16
matmul of the same shape (the `speedup_vs_bf16` reference) and XLA's dequantize-then-matmul of
the quantized weight.

Timing: `glmjax.bench.time_device` (many calls in one on-device loop, median). Bytes: the
weights (+ scales) an implementation must read plus the activations in and out; for the MoE,
only the distinct experts the step's tokens chose (an implementation that reads more is charged the
same, so its TB/s is an effective rate). NVFP4 cases also time the inline-PTX decode
(`pallas_ptx`: decode="ptx" with its default tiles, `default_config` / `default_moe_config`;
`pallas_hfma2`, at M <= HFMA2_MAX_ROWS (1): the GEMV on the CUDA cores' fp16x2 FMAs,
pallas_kernels/nvfp4_hfma2.py),
the Mosaic GPU GEMV (`pallas_mgpu`, pallas_kernels/nvfp4_matmul_mgpu.py, where its TMA shapes
allow: N a multiple of 8, K of 256; not at the quick shapes), the fragment-order GEMV
(`pallas_fragments`, pallas_kernels/nvfp4_fragments.py, M <= 8, default tiles; its weight
rearranged once, outside the timing, bytes counted as it stores them; `pallas_fragments_bf16`:
that on bf16 operands, reading x itself; `pallas_fragments_bf16_final`: that at one K split,
storing the finished result, one launch a call; `*_prefetch`: with FragmentConfig.prefetch), and
for the MoE `pallas_ptx_scan`, the PTX decode with the kernels scanning the ids (MoEConfig.routing), and
`pallas_hfma2_pairs`, each (token, local expert) pair a one-row product on the CUDA cores
(pallas_kernels/moe_hfma2.py, `--moe_routing=pairs` in the model), and `pallas_hfma2_pairs_fused`,
that with the activations' fp16 planes built in one launch each (`--moe_routing=pairs_fused`), and
`pallas_fragments`, each chosen expert read once for all tokens on the fragment GEMV (bf16
operands; pallas_kernels/moe_fragments.py), `pallas_fragments_f16`, that on fp16 operands, and
`pallas_fragments_prefetch`, its default tiles with FragmentConfig.prefetch, and
`pallas_fragments_stream`, that with each program's experts in one K loop (ExpertsConfig.stream). The
`*_f16` rows run fp16 tensor-core operands (MatmulConfig / MoEConfig operands="float16"): NVFP4
with the PTX decode, FP8 with its default tiles.
The bf16 weight itself also runs the split-K Pallas GEMV (`bf16` / `pallas` rows:
pallas_kernels/bf16_matmul.py, `--dense_matmul=pallas` in the model). Both entry points first
time this device's streaming read (`glmjax.bench.read_tbs`, 1 GB, the `read` row), and every
row's `frac_of_read` is against that speed, not one card's figure.

The projections of one TEP=8 rank that share an input also run as a group (`group_rows`:
the GEMV once per weight against bf16_matmul_group's one launch, `pallas_grouped`), and the
router's choice of 8 among 256 experts from its GEMV's partials, XLA's against one launch
(`router_rows`, 1 and 5 tokens), and so do the epilogues of MLA's and the indexer's projections
(`epilogue_rows`: the absorbed query, the indexer's keys, MLA's norms; 5 tokens), and each of the
five bf16 GEMV launches of a tep8_shard rank's MoE layer under rank_fastest, at its shapes and
split count, its weights cold (`rank_dense_rows`, the `rank_dense` case), and the last of them,
the shared expert's down GEMV, beside the routed experts' launches or folded into their gate/up
launch (`shared_down_rows`, the `shared_down` case: `Runtime.shared_down`).

Cases: GEMV [M, 8192] x [8192, 28672]; one GLM-5 expert's gate/up [2048, 6144] and down
[6144, 2048] (the shapes of a TEP=8 rank's q_a_proj and o_proj too); each at M = 1, 5, 8; the
routed-expert MLP twice: ids among the 32 local experts (about 24 chosen), and, as one TEP=8
rank sees them, among all 256 (about 5 local ones chosen); 5 tokens, top-8, D = 6144, I = 2048.
`quick=True`: tiny shapes for a CPU (interpret) smoke test.
"""

import dataclasses
import functools
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from configs import get_model_config
from glmjax.bench import agreement, bandwidth_tbs, read_tbs, time_device, time_own_kernels
from glmjax.config import ModelConfig
from glmjax.moe import route
from glmjax.quant import (FRAGMENT_OPERANDS, from_fragments, linear, moe_experts, quantize_fp8_block, quantize_nvfp4,
                          to_fragments)
from pallas_kernels.bf16_matmul import (bf16_matmul, bf16_matmul_group, bf16_matmul_partials, default_bf16_config,
                                       fold_config)
from pallas_kernels.fp8_matmul import default_fp8_config, fp8_matmul
from pallas_kernels.indexer_keys import indexer_keys, indexer_keys_reference
from pallas_kernels.mla_epilogue import mla_epilogue, mla_epilogue_reference
from pallas_kernels.mla_query import absorbed_query, absorbed_query_reference
from pallas_kernels.moe_fragments import DOWN, GATE_UP, ExpertsConfig, moe_fragments
from pallas_kernels.moe_grouped_matmul import MoEConfig, default_moe_config, moe_grouped_matmul
from pallas_kernels.moe_hfma2 import PairsConfig, moe_hfma2
from pallas_kernels.moe_route import route_select
from pallas_kernels.nvfp4_matmul import (HFMA2_FIELDS, HFMA2_MAX_ROWS, OPERANDS, MatmulConfig, default_config,
                                         nvfp4_matmul)
from pallas_kernels.nvfp4_fragments import TOKENS as FRAGMENT_TOKENS
from pallas_kernels.nvfp4_fragments import (FragmentConfig, default_fragment_config, fragment_matmul,
                                            fragment_matmul_partials)
from pallas_kernels.nvfp4_matmul_mgpu import K_MULTIPLE, TMA_ROW_TILE, nvfp4_matmul_mgpu
from pallas_kernels.residual_norm import residual_norm, residual_norm_reference

TIMERS = {"loop": time_device, "own": time_own_kernels}
QUICK_TIMER = functools.partial(time_device, iters=2, repeats=1, warmup=1)  # the quick runs' (tests')
# Issue 6's MoE step (5 tokens, top-8 among 32 local experts of GLM-5's shapes) and the quick runs' stand-in.
MOE_CASE = dict(tokens=5, top_k=8, experts=32, d=6144, i=2048)
QUICK_MOE_CASE = dict(tokens=5, top_k=2, experts=4, d=64, i=32)
FORMATS = {"nvfp4": (quantize_nvfp4, nvfp4_matmul), "fp8": (quantize_fp8_block, fp8_matmul)}
SWEPT = FORMATS | {"bf16": (lambda w: w, bf16_matmul),  # config_sweep_rows' kernels
                   "nvfp4_fragments": (lambda w: to_fragments(quantize_nvfp4(w)), fragment_matmul),
                   "nvfp4_fragments_bf16": (lambda w: to_fragments(quantize_nvfp4(w), "bfloat16"), fragment_matmul)}


def _nbytes(tree) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _rate(seconds: float, nbytes: int) -> dict[str, float]:
  """A timed row's columns: us, bytes and achieved TB/s."""
  return dict(us=seconds * 1e6, bytes=nbytes, tbs=bandwidth_tbs(nbytes, seconds))


def with_read_fraction(rows: Iterable[dict[str, Any]], timer: Callable[..., float], *, quick: bool = False
                       ) -> Iterator[dict[str, Any]]:
  """A `read` row (this device's streaming read over 1 GB, 1 MB if quick, timed by `timer` as
  the rows are), then `rows`, each row that has a TB/s given its fraction of that speed."""
  nbytes = 1 << (20 if quick else 30)
  read = read_tbs(nbytes, timer)
  yield dict(name="read", impl="xla", us=nbytes / read / 1e6, bytes=nbytes, tbs=read, frac_of_read=1.0)
  for row in rows:
    yield dict(row, frac_of_read=row["tbs"] / read) if "tbs" in row else row


def _rows(case: dict[str, Any], timed: list[tuple]) -> list[dict[str, Any]]:
  """Rows for (format, impl, seconds, bytes[, agreement with the XLA path of the same weights]);
  the first entry is the XLA bf16 reference."""
  bf16_seconds = timed[0][2]
  return [dict(case, format=fmt, impl=impl, **_rate(seconds, nbytes), speedup_vs_bf16=bf16_seconds / seconds,
               **(check[0] if check else {}))
          for fmt, impl, seconds, nbytes, *check in timed]


def _kernel_entry(fmt: str, kernel: Callable, reference: Callable, args: tuple, nbytes: int,
                  timer: Callable[..., float], impl: str = "pallas") -> tuple:
  """A Pallas entry for _rows: its time and its output's agreement with the XLA path's."""
  return (fmt, impl, timer(kernel, *args), nbytes, agreement(kernel(*args), reference(*args)))


FRAGMENT_IMPLS = {"float16": "pallas_fragments", "bfloat16": "pallas_fragments_bf16"}  # by operands


def gemv_inputs(m: int, n: int, k: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """A GEMV case's x bf16 [m, k] (standard normal) and weight bf16 [n, k] (normal, 0.02 scale)."""
  kx, kw = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (m, k), jnp.bfloat16), jax.random.normal(kw, (n, k), jnp.bfloat16) * 0.02


def gemv_rows(m: int, n: int, k: int, *, name: str, timer: Callable[..., float], seed: int = 0):
  """x bf16 [m, k] @ w[n, k].T: XLA bf16 and the bf16 split-K kernel, then per format XLA
  dequant+matmul and the kernel."""
  x, w = gemv_inputs(m, n, k, seed)
  act_bytes = (m * k + m * n) * 2
  bf16 = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w))
  xla_dequant = jax.jit(functools.partial(linear, impl="xla"))
  timed = [("bf16", "xla", timer(bf16, x, w), n * k * 2 + act_bytes),
           _kernel_entry("bf16", bf16_matmul, bf16, (x, w), n * k * 2 + act_bytes, timer)]
  for fmt, (quantize, kernel) in FORMATS.items():
    q = quantize(w)
    nbytes = _nbytes(q) + act_bytes
    timed.append((fmt, "xla_dequant", timer(xla_dequant, x, q), nbytes))
    timed.append(_kernel_entry(fmt, kernel, xla_dequant, (x, q), nbytes, timer))
    # The inline-PTX NVFP4 decode (MatmulConfig.decode), fp16 operands (.operands) and, up to
    # HFMA2_MAX_ROWS rows, the CUDA cores' fp16x2 FMAs (.dot), default tiles.
    variants = ({"pallas_ptx": dict(decode="ptx"), "pallas_ptx_f16": dict(decode="ptx", operands="float16"),
                 **({"pallas_hfma2": dict(decode="ptx", operands="float16", dot="hfma2")}
                    if m <= HFMA2_MAX_ROWS else {})} if fmt == "nvfp4"
                else {"pallas_f16": dict(operands="float16")})
    for impl, options in variants.items():
      config = default_config(m, n, k, **options) if fmt == "nvfp4" else default_fp8_config(m, n, k, **options)
      variant = jax.jit(functools.partial(kernel, config=config))
      timed.append(_kernel_entry(fmt, variant, xla_dequant, (x, q), nbytes, timer, impl=impl))
    if fmt == "nvfp4":
      if n % TMA_ROW_TILE == 0 and k % K_MULTIPLE == 0:  # the Mosaic GPU kernel's TMA shapes
        timed.append(_kernel_entry(fmt, nvfp4_matmul_mgpu, xla_dequant, (x, q), nbytes, timer, impl="pallas_mgpu"))
      for operands in FRAGMENT_OPERANDS if m <= FRAGMENT_TOKENS else ():
        fragments, default = to_fragments(q, operands), default_fragment_config(n, k)
        configs = {FRAGMENT_IMPLS[operands]: None,  # and with the next step's loads carried over the MMAs
                   FRAGMENT_IMPLS[operands] + "_prefetch": dataclasses.replace(default, prefetch=True)}
        if operands == "bfloat16":  # also at one K split storing the finished result: one launch a call
          configs[FRAGMENT_IMPLS[operands] + "_final"] = dataclasses.replace(default, split_k=1, final_out=True)
        for impl, config in configs.items():
          timed.append(_kernel_entry(fmt, jax.jit(functools.partial(fragment_matmul, config=config)),
                                     lambda x, _: xla_dequant(x, q), (x, fragments), _nbytes(fragments) + act_bytes,
                                     timer, impl=impl))
  return _rows(dict(name=name, m=m, n=n, k=k), timed)


def router_rows(tokens: int, config: ModelConfig, *, timer: Callable[..., float], splits: int = 8, seed: int = 0):
  """The router's choice from its GEMV's split-K partials [splits, tokens, E]: XLA's (the sum,
  then glmjax.moe.route) against the one launch (pallas_kernels/moe_route.py, --router=pallas),
  checked by the [tokens, E] routing matrix both give (chosen ids and weights)."""
  kp, kb = jax.random.split(jax.random.key(seed))
  e = config.n_routed_experts
  partials = jax.random.normal(kp, (splits, tokens, e), jnp.float32)
  bias = 0.1 * jax.random.normal(kb, (e,), jnp.float32)
  xla = jax.jit(lambda p, b: route(p.sum(0), b, config))
  kernel = jax.jit(lambda p, b: route_select(p, b, config))
  matrix = lambda ids, weights: jnp.zeros((tokens, e), jnp.float32).at[jnp.arange(tokens)[:, None], ids].set(weights)
  nbytes = partials.size * 4 + e * 4 + tokens * config.num_experts_per_tok * 8
  check = agreement(matrix(*kernel(partials, bias)), matrix(*xla(partials, bias)))
  timed = [("fp32", "xla", timer(xla, partials, bias), nbytes),
           ("fp32", "pallas", timer(kernel, partials, bias), nbytes, check)]
  return _rows(dict(name="router", m=tokens, n=e, splits=splits), timed)


def epilogue_rows(tokens: int, config: ModelConfig, *, timer: Callable[..., float], splits: int = 8, seed: int = 0):
  """The one-launch epilogues of MLA's and the indexer's projections (pallas_kernels/mla_query.py,
  indexer_keys.py, mla_epilogue.py: --query_absorb, --indexer_keys, --mla_epilogue; the last two
  in one launch: --index_epilogue; the indexer's query in the first's: --index_query) and of
  o_proj (residual_norm.py: --residual_norm) against their XLA paths (the kernels' references)
  on random split-K partials of `config`'s projections (one TEP=8 rank's: tep8_shard); each
  output compared, the row reporting the worst."""
  c, bf16 = config, jnp.bfloat16
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  normal = lambda shape, dtype=jnp.float32, scale=1.0: (scale * jax.random.normal(next(keys), shape)).astype(dtype)
  norm = lambda width: (1 + normal((width,), scale=0.1)).astype(bf16)
  angles = normal((tokens, c.qk_rope_head_dim // 2), scale=3.0)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  heads, nope = c.num_attention_heads, c.qk_nope_head_dim
  cases = {
      "absorbed_query": (functools.partial(absorbed_query, nope=nope, out_dtype=bf16),
                         functools.partial(absorbed_query_reference, nope=nope, out_dtype=bf16),
                         (normal((splits, tokens, heads * c.qk_head_dim)),
                          normal((heads, nope + c.v_head_dim, c.kv_lora_rank), bf16, 0.05), cos, sin)),
      "indexer_keys": (indexer_keys, indexer_keys_reference,
                       (normal((splits, tokens, c.index_head_dim)), normal((splits, tokens, c.index_n_heads)),
                        norm(c.index_head_dim), normal((c.index_head_dim,), bf16, 0.1), cos, sin)),
      "mla_epilogue": (mla_epilogue, mla_epilogue_reference,
                       (normal((splits, tokens, c.q_lora_rank)),
                        normal((splits, tokens, c.kv_lora_rank + c.qk_rope_head_dim)),
                        norm(c.q_lora_rank), norm(c.kv_lora_rank), cos, sin)),
  }
  # --index_epilogue: the indexer's keys in mla_epilogue's launch (args: mla_epilogue's, then the indexer's four);
  # --index_query: the indexer's query in the absorbed query's (args: absorbed_query's, then wq_b's partials)
  with_keys = lambda fn: lambda *args: fn(*args[:6], index_keys=args[6:])
  cases["mla_index_epilogue"] = (with_keys(mla_epilogue), with_keys(mla_epilogue_reference),
                                 cases["mla_epilogue"][2] + cases["indexer_keys"][2][:4])
  with_query = lambda fn: lambda *args: fn(*args[:4], index_partials=args[4], index_heads=c.index_n_heads,
                                           index_dtype=bf16)
  wq_b_partials = normal((splits, tokens, c.index_n_heads * c.index_head_dim))
  cases["absorbed_index_query"] = (with_query(cases["absorbed_query"][0]), with_query(cases["absorbed_query"][1]),
                                   cases["absorbed_query"][2] + (wq_b_partials,))
  # --residual_norm: o_proj's partials added to the residual stream (fp32), post_attention_layernorm
  eps = c.rms_norm_eps
  cases["residual_norm"] = (functools.partial(residual_norm, eps=eps),
                            functools.partial(residual_norm_reference, eps=eps),
                            (normal((tokens, c.hidden_size), scale=30.0), normal((splits, tokens, c.hidden_size)),
                             norm(c.hidden_size)))
  for name, (kernel, reference, args) in cases.items():
    kernel, reference = jax.jit(kernel), jax.jit(reference)
    outputs = jax.eval_shape(reference, *args)
    nbytes = sum(a.size * a.dtype.itemsize for a in (*args, *outputs))
    check = max((agreement(g, w) for g, w in zip(kernel(*args), reference(*args), strict=True)),
                key=lambda a: a["max_rel_err"])
    yield from _rows(dict(name=name, m=tokens, splits=splits), [("fp32", "xla", timer(reference, *args), nbytes),
                                                              ("fp32", "pallas", timer(kernel, *args), nbytes, check)])


def _moe_case(tokens: int, top_k: int, experts: int, d: int, i: int, seed: int = 0, routed: int = 0):
  """(x, (ids, routing weights), bf16 (gate, up, down), number of distinct local experts chosen).
  routed: the experts the ids choose among (0: the `experts` local ones); more (one TEP rank's
  view: 256 routed experts, 32 of them local) puts most ids on other ranks (outside [0, experts))."""
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
  stacked = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16) * 0.02
  weights = (stacked(keys[1], (experts, i, d)), stacked(keys[2], (experts, i, d)),
             stacked(keys[3], (experts, d, i)))
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.choice(routed or experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
  routing = (jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32))
  return x, routing, weights, len(np.unique(ids[ids < experts]))


def _moe_bytes(weights, chosen: float, x: jax.Array, ids: jax.Array) -> int:
  """Bytes a routed-expert step must move: the chosen share of the stacked weights, x in and
  out (bf16), the routing ids and weights."""
  return int(_nbytes(weights) * chosen) + x.size * 2 * 2 + ids.size * 8


def moe_rows(tokens: int, top_k: int, experts: int, d: int, i: int, *, timer: Callable[..., float],
             seed: int = 0, routed: int = 0):
  """Routed-expert MLP: XLA bf16 (the model's reference path), then per format (and bf16) the
  grouped kernel, plus XLA dequant for the quantized formats."""
  x, routing, weights, chosen_experts = _moe_case(tokens, top_k, experts, d, i, seed, routed)
  chosen = chosen_experts / experts  # fraction of the stacked weights the step must read
  xla = jax.jit(functools.partial(moe_experts, impl="xla"))
  bf16_bytes = _moe_bytes(weights, chosen, x, routing[0])
  timed = [("bf16", "xla", timer(xla, x, *routing, *weights), bf16_bytes),
           _kernel_entry("bf16", moe_grouped_matmul, xla, (x, *routing, *weights), bf16_bytes, timer)]
  for fmt, (quantize, _) in FORMATS.items():
    q = tuple(quantize(w) for w in weights)
    nbytes = _moe_bytes(q, chosen, x, routing[0])
    timed.append((fmt, "xla_dequant", timer(xla, x, *routing, *q), nbytes))
    timed.append(_kernel_entry(fmt, moe_grouped_matmul, xla, (x, *routing, *q), nbytes, timer))
    # The PTX decode, with XLA's routing table and with the kernels' scan, and with fp16 operands.
    variants = ({"pallas_ptx": ("ptx", "table", "bfloat16"), "pallas_ptx_scan": ("ptx", "scan", "bfloat16"),
                 "pallas_ptx_f16": ("ptx", "table", "float16")} if fmt == "nvfp4"
                else {"pallas_f16": ("jnp", "table", "float16")})
    for impl, (decode, routing_impl, operands) in variants.items():
      config = default_moe_config(q, decode=decode, routing=routing_impl, operands=operands,
                                  chosen=chosen_experts)
      variant = jax.jit(functools.partial(moe_grouped_matmul, config=config))
      timed.append(_kernel_entry(fmt, variant, xla, (x, *routing, *q), nbytes, timer, impl=impl))
    if fmt == "nvfp4":  # each (token, local expert) pair a one-row product on the CUDA cores
      timed.append(_kernel_entry(fmt, moe_hfma2, xla, (x, *routing, *q), nbytes, timer, impl="pallas_hfma2_pairs"))
      fused = jax.jit(functools.partial(moe_hfma2, config=PairsConfig(fused_planes=True)))  # planes in one launch
      timed.append(_kernel_entry(fmt, fused, xla, (x, *routing, *q), nbytes, timer, impl="pallas_hfma2_pairs_fused"))
      # each chosen expert once for all tokens on the fragment GEMV (either operands), against XLA on q
      reference = lambda x, ids, weights, *_: xla(x, ids, weights, *q)
      prefetched = ExpertsConfig(*(dataclasses.replace(c, prefetch=True) for c in ExpertsConfig().resolved()))
      streamed = dataclasses.replace(prefetched, stream=True)
      for operands, impl, config in (("bfloat16", "pallas_fragments", None), ("float16", "pallas_fragments_f16", None),
                                     ("bfloat16", "pallas_fragments_prefetch", prefetched),
                                     ("bfloat16", "pallas_fragments_stream", streamed)):
        fragments = tuple(to_fragments(w, operands) for w in q)
        kernel = jax.jit(functools.partial(moe_fragments, config=config))
        timed.append(_kernel_entry(fmt, kernel, reference, (x, *routing, *fragments), nbytes, timer, impl=impl))
  return _rows(dict(name="moe_experts", m=tokens, n=d, k=i, experts=experts, routed=routed or experts, top_k=top_k,
                    chosen_experts=chosen_experts), timed)


def group_rows(m: int, k: int, ns: tuple[int, ...], *, name: str, timer: Callable[..., float], seed: int = 0):
  """bf16 weights sharing x: XLA's einsums, the split-K GEMV once per weight, and all of them in
  one launch (bf16_matmul_group, `--dense_matmul=pallas_grouped`), checked against the lone
  launches' outputs concatenated; then in NVFP4 the fragment kernel's partials, a launch per
  weight and one for all (timed without a sum: the folds sum them)."""
  keys = jax.random.split(jax.random.key(seed), len(ns) + 1)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  ws = tuple(jax.random.normal(key, (n, k), jnp.bfloat16) * 0.02 for key, n in zip(keys[1:], ns))
  nbytes = sum(n * k * 2 for n in ns) + (m * k + m * sum(ns)) * 2
  joined = lambda fn: jax.jit(lambda x, ws: jnp.concatenate(fn(x, ws), axis=-1))
  xla = joined(lambda x, ws: [jnp.einsum("mk,nk->mn", x, w) for w in ws])
  alone = joined(lambda x, ws: [bf16_matmul(x, w) for w in ws])
  grouped = joined(lambda x, ws: list(bf16_matmul_group(x, ws)))
  timed = [("bf16", "xla", timer(xla, x, ws), nbytes), _kernel_entry("bf16", alone, xla, (x, ws), nbytes, timer),
           _kernel_entry("bf16", grouped, alone, (x, ws), nbytes, timer, impl="pallas_grouped")]
  # The same weights in NVFP4, fragment order, bf16 operands, as the folds read them (K splits
  # scaled by the programs, one split count): a launch per weight, then one for all; each checked
  # by its splits' sum against XLA's dequantized products.
  fragments = tuple(to_fragments(quantize_nvfp4(w), "bfloat16") for w in ws)
  splits = default_fragment_config(sum(ns), k).split_k
  reference = joined(lambda x, fs: [linear(x, from_fragments(f), impl="xla") for f in fs])
  partials = {"pallas_fragments_bf16_partials": lambda x, fs: [fragment_matmul_partials(x, f, split_k=splits)
                                                               for f in fs],
              "pallas_fragments_bf16_grouped": lambda x, fs: list(fragment_matmul_partials(x, fs, split_k=splits))}
  for impl, launches in partials.items():
    summed = joined(lambda x, fs, launches=launches: [p.sum(0).astype(x.dtype) for p in launches(x, fs)])
    timed.append(("nvfp4", impl, timer(jax.jit(launches), x, fragments), _nbytes(fragments) + (m * k + m * sum(ns)) * 2,
                  agreement(summed(x, fragments), reference(x, fragments))))
  return _rows(dict(name=name, m=m, n="+".join(map(str, ns)), k=k), timed)


# Past the H100's and H200's 50 MB of L2: a row cycles its launch over this many bytes of weight copies, so each
# launch reads its weights cold, as a decode step does (a 3 MB weight timed alone would stay in L2).
COLD_BYTES = 128 << 20
QUICK_COLD_BYTES = 1 << 16  # the quick runs' (a CPU's)


def cold_sets(arrays: tuple, nbytes: int, cold_bytes: int) -> list[tuple]:
  """Distinct copies of `arrays` (the same values, other buffers), enough that their `nbytes`
  each pass cold_bytes, the originals last: a row cycles its launch over them (COLD_BYTES)."""
  copies = max(1, -(-cold_bytes // nbytes))
  return [tuple(a + 0 for a in arrays) for _ in range(copies - 1)] + [arrays]


def rank_dense_launches(c: ModelConfig) -> list[tuple[str, int, tuple[int, ...], str | None]]:
  """The bf16 GEMV launches of one MoE decoder layer on a TEP rank (config: tep8_shard) under
  configs/runs.py's rank_fastest, in order: (name, K, the rows of the weights sharing the launch,
  the split count of the split-K partials a fold reads, bf16_matmul.fold_config's "fill" or
  "rule", or None for a GEMV run whole). The MLA epilogue reads q_a's, kv_a's and the indexer's
  wk's and weights_proj's; the absorbed query q_b's and wq_b's; the residual norm o_proj's (those
  three at Runtime.fold_splits' default); the router's launch the router's and the shared
  expert's gate's and up's (glmjax.moe.shared_route); the shared expert's down GEMV runs whole."""
  shared = c.shared_intermediate
  return [("q_a+kv_a+wk+weights_proj", c.hidden_size,
           (c.q_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim, c.index_n_heads), "fill"),
          ("q_b+wq_b", c.q_lora_rank, (c.num_attention_heads * c.qk_head_dim, c.index_n_heads * c.index_head_dim),
           "fill"),
          ("o_proj", c.num_attention_heads * c.v_head_dim, (c.hidden_size,), "fill"),
          ("router+shared gate+up", c.hidden_size, (c.n_routed_experts, shared, shared), "rule"),
          ("shared down", shared, (c.hidden_size,), None)]


def rank_dense_rows(config: ModelConfig, *, timer: Callable[..., float], tokens: int = 5, cold_bytes: int = COLD_BYTES,
                    seed: int = 0, around: Callable[[MatmulConfig], list[MatmulConfig]] | None = None
                    ) -> list[dict[str, Any]]:
  """Each of `rank_dense_launches(config)` at `tokens` rows, as the stack runs it (the partials at
  its split count, or the whole GEMV), against XLA's einsums of the same weights: time per
  launch with its weights cold (copies cycled over `cold_bytes`), bytes, and the agreement of the
  partials' sum with XLA's products. Where a layer's 5 bf16 launches (46 us on an H100,
  BENCHMARKS.md run 53) stand against their weights' bytes, launch by launch. around: the
  configs to time each launch at, from its own (the rank_dense sweep, `around_bf16`); default
  its own alone."""
  rows = []
  for i, (name, k, ns, splits) in enumerate(rank_dense_launches(config)):
    partials = splits is not None
    keys = jax.random.split(jax.random.key(seed + i), len(ns) + 1)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    ws = tuple(jax.random.normal(key, (n, k), jnp.bfloat16) * 0.02 for key, n in zip(keys[1:], ns))
    weight_bytes = _nbytes(ws)
    sets = cold_sets(ws, weight_bytes, cold_bytes)
    copies = len(sets)
    nbytes = weight_bytes + (tokens * k + tokens * sum(ns)) * 2
    base = fold_config(sum(ns), k, splits) if partials else default_bf16_config(sum(ns), k)
    per_set = lambda fn: jax.jit(lambda x, sets: [fn(x, ws) for ws in sets])
    xla = lambda x, ws: jnp.concatenate([jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)
                                         for w in ws], -1)
    timed = [("bf16", "xla", timer(per_set(xla), x, sets) / copies, nbytes)]
    tilings = (around or (lambda c: [c]))(base)
    for tiling in tilings:
      launch = ((lambda x, ws, c=tiling: bf16_matmul_partials(x, ws, config=c)) if partials
                else (lambda x, ws, c=tiling: bf16_matmul(x, ws[0], config=c)))
      # in fp32, beside XLA's products: each weight's partials [S, M, N] summed (one weight's come bare, not in a
      # tuple: tree.leaves takes both), or the whole GEMV's [M, N]
      summed = lambda x, ws, launch=launch: jnp.concatenate([p.sum(0) if partials else p.astype(jnp.float32)
                                                             for p in jax.tree.leaves(launch(x, ws))], -1)
      timed.append(("bf16", "pallas_partials" if partials else "pallas", timer(per_set(launch), x, sets) / copies,
                    nbytes, agreement(jax.jit(summed)(x, ws), jax.jit(xla)(x, ws))))
    case = dict(name="rank_dense", launch=name, m=tokens, n="+".join(map(str, ns)), k=k, cold_copies=copies)
    rows += [dict(row, splits=c.split_k if c and partials else None, config=str(c) if c else None)
             for row, c in zip(_rows(case, timed), [None, *tilings])]
  return rows


def shared_down_rows(tokens: int, top_k: int, experts: int, d: int, i: int, *, shared: int, routed: int,
                     timer: Callable[..., float], cold_bytes: int = COLD_BYTES, seed: int = 0) -> list[dict[str, Any]]:
  """Runtime.shared_down at a TEP rank's view of a MoE step (ids among `routed` experts, `experts`
  of them local; the shared expert's down GEMV [tokens, shared] -> d): the routed experts as
  rank_fastest runs them (moe_hfma2, fused planes) and that GEMV in launches of their own
  (`separate`, the baseline), the same with PairsConfig.wide_words (`separate_wide_words`: the
  fold's barrier-free K loops without the fold, so the two effects part), then the GEMV as more
  programs of the experts' gate/up launch (`folded`); each checked against the baseline's
  outputs. Each call cycles over copies of the
  GEMV's weight and hidden past cold_bytes, as rank_dense_rows does, so its 3 MB come from DRAM as
  in a step; the chosen experts (about 100 MB at GLM-5's shapes) pass the L2 by themselves."""
  x, routing, weights, chosen_experts = _moe_case(tokens, top_k, experts, d, i, seed, routed)
  q = tuple(quantize_nvfp4(w) for w in weights)
  keys = jax.random.split(jax.random.key(seed + 1))
  down = (jax.random.normal(keys[0], (tokens, shared), jnp.bfloat16),
          jax.random.normal(keys[1], (d, shared), jnp.bfloat16) * 0.02)
  sets = cold_sets(down, _nbytes(down[1]), cold_bytes)  # the weight's bytes decide, the hidden goes along
  copies, config = len(sets), PairsConfig(fused_planes=True)

  def separate(x, ids, w, hidden, down, config=config):
    return moe_hfma2(x, ids, w, *q, config=config), bf16_matmul(hidden, down)

  wide = functools.partial(separate, config=dataclasses.replace(config, wide_words=True))
  folded = lambda x, ids, w, hidden, down: moe_hfma2(x, ids, w, *q, config=config, shared_down=(hidden, down))
  per_set = lambda fn: jax.jit(lambda x, ids, w, sets: [fn(x, ids, w, *down) for down in sets])
  joined = lambda fn: jax.jit(lambda *a: jnp.concatenate(fn(*a), -1))  # routed | shared, for agreement
  nbytes = _moe_bytes(q, chosen_experts / experts, x, routing[0]) + _nbytes(down) + tokens * d * 2
  timed = [("nvfp4+bf16", "separate", timer(per_set(separate), x, *routing, sets) / copies, nbytes)]
  for impl, fn in (("separate_wide_words", wide), ("folded", folded)):
    timed.append(("nvfp4+bf16", impl, timer(per_set(fn), x, *routing, sets) / copies, nbytes,
                  agreement(joined(fn)(x, *routing, *down), joined(separate)(x, *routing, *down))))
  return _rows(dict(name="shared_down", m=tokens, n=d, k=i, shared=shared, experts=experts, routed=routed,
                    top_k=top_k, chosen_experts=chosen_experts, cold_copies=copies), timed)


def _rank_dense(quick: bool, timer: Callable[..., float], **kwargs) -> list[dict[str, Any]]:
  """rank_dense_rows of tep8_shard, or of mini with 64 KB of weight copies if quick (the rows and the sweep)."""
  return rank_dense_rows(get_model_config("mini" if quick else "tep8_shard"), timer=timer,
                         cold_bytes=QUICK_COLD_BYTES if quick else COLD_BYTES, **kwargs)


def around_bf16(base: MatmulConfig) -> list[MatmulConfig]:
  """base, then one field at a time: 32- or 128-row tiles, 64- or 256-wide K steps, half or twice
  the K splits, 2 or 8 warps, 2, 4 or 5 pipeline stages: the rank_dense sweep's tilings of a
  bf16 launch (Triton's knobs on the bytes in flight and the programs per SM)."""
  vary = functools.partial(dataclasses.replace, base)
  return [base, *(vary(block_n=b) for b in (32, 128) if b != base.block_n),
          *(vary(block_k=b) for b in (64, 256) if b != base.block_k),
          *(vary(split_k=s) for s in (base.split_k // 2, 2 * base.split_k) if s),
          *(vary(num_warps=w) for w in (2, 8) if w != base.num_warps),
          *(vary(num_stages=s) for s in (2, 4, 5) if s != base.num_stages)]


def config_sweep_rows(fmt: str, m: int, n: int, k: int, configs: list[MatmulConfig] | None = None, *,
                      timer: Callable[..., float] = time_device, seed: int = 0) -> list[dict[str, Any]]:
  """Tuning aid (not part of quant_rows): the `fmt` kernel at one shape under several configs."""
  configs = configs or [MatmulConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w)
                        for bn, bk in ((32, 128), (64, 128), (64, 256), (128, 128))
                        for s in (1, 4) for w in (4, 8) if fmt != "fp8" or bk <= 128]
  quantize, kernel = SWEPT[fmt]
  x, w = gemv_inputs(m, n, k, seed)
  q = quantize(w)
  nbytes = _nbytes(q) + (m * k + m * n) * 2
  rows = []
  for config in configs:
    seconds = timer(jax.jit(functools.partial(kernel, config=config)), x, q)
    rows.append(dict(name="sweep", m=m, n=n, k=k, format=fmt, impl="pallas", config=config,
                     **_rate(seconds, nbytes)))
  return rows


def moe_sweep_rows(fmt: str, configs: list[MoEConfig] | list[PairsConfig] | list[ExpertsConfig], *,
                   kernel=moe_grouped_matmul, timer: Callable[..., float] = time_device, **case
                   ) -> list[dict[str, Any]]:
  """Tuning aid: an MoE kernel (the grouped tensor-core one, moe_hfma2 with PairsConfigs, or
  moe_fragments with ExpertsConfigs and fmt "nvfp4_fragments_bf16") with `fmt` (SWEPT) weights
  under each config (case: moe_rows')."""
  x, routing, weights, chosen_experts = _moe_case(**case)
  q = tuple(SWEPT[fmt][0](w) for w in weights)
  nbytes = _moe_bytes(q, chosen_experts / case["experts"], x, routing[0])
  rows = []
  for config in configs:
    seconds = timer(jax.jit(functools.partial(kernel, config=config)), x, *routing, *q)
    rows.append(dict(name="moe_sweep", format=fmt, config=str(config), routed=case.get("routed") or case["experts"],
                     chosen_experts=chosen_experts, **_rate(seconds, nbytes)))
  return rows


SWEEP_CASES = ("hfma2", "fp8", "bf16", "fragments", "l2", "pairs", "experts", "rank_dense")  # quant_sweep_rows' groups


def quant_sweep_rows(*, quick: bool = False, cases: tuple[str, ...] = SWEEP_CASES) -> Iterator[dict[str, Any]]:
  """Tile sweeps (kernels_bench --sweep) of the quantized and bf16 kernels a TEP=8 rank's stack
  runs, by own kernel time off the CPU (the time that carries into the step, BENCHMARKS.md run
  26), in groups (`cases`, SWEEP_CASES): hfma2, the one-row NVFP4 GEMV on the CUDA cores
  (dot="hfma2") at [1, 8192] x [8192, 28672] over row tiles, K steps, K splits and warps, with the
  tensor-core kernel's default beside it; fp8, the FP8 GEMV over row tiles and K splits with
  either operand dtype; bf16, the split-K GEMV at a rank's 25 MB [5, 6144] -> 2048 over K
  splits; fragments, the fragment-order NVFP4 GEMV (nvfp4_fragments) at M = 1 and 8 on either
  operand dtype, its default and one field at a time around it (`around_default`), and on bf16
  operands one split storing the finished result; l2, the same GEMVs with L2 prefetches ahead of
  their loads (`l2_arms`); pairs, the routed experts as (token, expert)
  pairs (moe_hfma2, fused planes) at the rank's view (5 tokens, top-8 of 256 routed experts, 32
  local) over both launches' tiles and the groups; experts, the routed experts on the fragment
  GEMV (moe_fragments) at the rank's view over program groups and either launch's tiles, K
  splits and chunks a loop step; rank_dense, a TEP=8 rank's five bf16 launches (rank_dense_rows,
  weights cold) each at `around_bf16` of its own tiling. First the `read` row (with_read_fraction)."""
  unknown = set(cases) - set(SWEEP_CASES)
  if unknown:
    raise ValueError(f"unknown sweep cases {sorted(unknown)}; known: {list(SWEEP_CASES)}")
  timer = QUICK_TIMER if quick else time_own_kernels
  yield from with_read_fraction(_sweeps(quick, timer, cases), timer, quick=quick)


def around_default(base: FragmentConfig, operands: str = "bfloat16") -> list[FragmentConfig]:
  """base, then one field at a time: 2 or 8 chunks a loop step, half or twice the K splits, the
  next step's loads carried (prefetch), x's loads the other width (wide_x), on float16 operands
  the padding tokens' activation loads masked or not (token_mask), and 2- or 8-tile programs of
  a warp per two tiles. Where a launch is bound by its loads in flight, not by its bytes (the H200,
  BENCHMARKS.md run 45), these are the fields that move them."""
  vary = functools.partial(dataclasses.replace, base)
  return [base, *(vary(unroll=u) for u in (2, 8) if u != base.unroll),
          *(vary(split_k=s) for s in (base.split_k // 2, 2 * base.split_k) if s),
          vary(prefetch=not base.prefetch), vary(wide_x=not base.wide_x),
          *([vary(token_mask=not base.token_mask)] if operands == "float16" else []),
          *(vary(tiles=t, num_warps=t // 2) for t in (2, 8) if t != base.tiles)]


def l2_arms(base: FragmentConfig) -> list[FragmentConfig]:
  """base, then its programs bulk-prefetching into L2 1, 2, 4 or 8 chunks ahead of their loads
  (FragmentConfig.l2_ahead), and 4 ahead over half the K splits (fewer programs, each with more
  bytes in flight)."""
  vary = functools.partial(dataclasses.replace, base)
  return [base, *(vary(l2_ahead=a) for a in (1, 2, 4, 8)),
          *([vary(l2_ahead=4, split_k=base.split_k // 2)] if base.split_k > 1 else [])]


def _sweeps(quick: bool, timer: Callable[..., float], cases: tuple[str, ...]) -> Iterator[dict[str, Any]]:
  """quant_sweep_rows' rows, without the read row."""
  gemv = (1, 128, 64) if quick else (1, 28672, 8192)
  dense = (5, 96, 128) if quick else (5, 2048, 6144)
  hfma2 = lambda bn, bk, s, w=4: MatmulConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w, **HFMA2_FIELDS)
  gemv_configs = ([hfma2(bn, bk, s, w) for bn, bk in ((32, 512), (16, 512), (32, 256), (64, 256), (16, 1024))
                   for s in (2, 4, 8) for w in (2, 4, 8)]
                  + [default_config(*gemv, decode="ptx", operands="float16")])  # the tensor cores' default
  fp8_configs = [MatmulConfig(block_n=bn, block_k=128, split_k=s, operands=operands)
                 for operands in OPERANDS for bn, s in ((128, 1), (64, 1), (64, 2), (64, 4), (32, 1), (32, 2))]
  bf16_configs = [MatmulConfig(block_n=bn, block_k=bk, split_k=s)
                  for bn, bk, s in ((64, 256, 8), (64, 256, 4), (64, 256, 16), (32, 256, 8), (128, 128, 4))]
  # the pairs' defaults with and without wide_words' layout hint, then tiles, K splits and groups
  pairs_configs = [PairsConfig(fused_planes=True, wide_words=w) for w in (False, True)]
  pairs_configs += [PairsConfig(gate_up=hfma2(bn, 512, gs), down=hfma2(bn, 512, ds), groups=g, fused_planes=True)
                    for bn in (16, 32) for gs, ds in ((2, 1), (4, 2), (1, 1)) for g in (2, 4, 8)]
  # bf16 operands also at one split storing the finished result (final_out: the call one launch)
  # over tiles and chunks a loop step.
  final_configs = [FragmentConfig(tiles=t, num_warps=w, unroll=u, tile_groups=2, final_out=True)
                   for t, w in ((2, 1), (4, 2), (8, 4)) for u in (1, 2, 4)]
  # The fragment MoE (each chosen expert once): the defaults (12 gate/up groups, 8 down), then the
  # chosen experts over 8, 1, 4 and 24 program groups in both launches, with h from its own launch
  # or from gate/up's (fused_swiglu), then either launch's tiles, K splits and chunks a loop step,
  # the other launch at its default (each varied from its default, so down keeps 4-byte loads);
  # then, for the rank's few chosen experts (about 5 of 12 groups busy by default), 6 or 8 groups
  # with gate/up over 4 K splits and down over 1 or 2.
  vary = lambda base, t, s, u: dataclasses.replace(base, tiles=t, num_warps=max(1, t // 2), split_k=s, unroll=u)
  experts_configs = [ExpertsConfig()] + [ExpertsConfig(groups=g, down_groups=g, fused_swiglu=f)
                                         for f in (False, True) for g in (8, 1, 4, 24)]
  experts_configs += [ExpertsConfig(gate_up=vary(GATE_UP, t, s, u))
                      for t in (2, 4) for s in (2, 4, 8, 16) for u in (1, 2)]
  experts_configs += [ExpertsConfig(down=vary(DOWN, t, s, u)) for t in (2, 4) for s in (2, 4, 8) for u in (1, 2)]
  experts_configs += [ExpertsConfig(gate_up=vary(GATE_UP, 4, 4, 2), down=vary(DOWN, 2, s, 2), groups=g, down_groups=g)
                      for g in (6, 8) for s in (1, 2)]
  first = (lambda configs: configs[:1]) if quick else (lambda configs: configs)
  if quick:
    gemv_configs = gemv_configs[:1] + gemv_configs[-1:]
  grid = [("hfma2", "nvfp4", gemv, gemv_configs), ("fp8", "fp8", gemv, first(fp8_configs)),
          ("bf16", "bf16", dense, first(bf16_configs))]
  for operands, fmt in (("float16", "nvfp4_fragments"), ("bfloat16", "nvfp4_fragments_bf16")):
    for m in (1, 8):
      base, finals = default_fragment_config(*gemv[1:], m, operands), final_configs if operands == "bfloat16" else []
      grid += [("fragments", fmt, (m, *gemv[1:]), first(around_default(base, operands) + finals)),
               ("l2", fmt, (m, *gemv[1:]), l2_arms(base)[1:2] if quick else l2_arms(base))]  # quick: one arm
  for case, fmt, shape, configs in grid:
    for row in config_sweep_rows(fmt, *shape, configs, timer=timer) if case in cases else ():
      yield dict(row, config=str(row["config"]))
  # One TEP rank's step: ids over all routed experts, so only about 5 of the 32 local ones are
  # chosen, nearly each by one token: the pairs the stack runs (--moe_routing=pairs_fused).
  rank = dict(QUICK_MOE_CASE, routed=16) if quick else dict(MOE_CASE, routed=256)
  if "pairs" in cases:
    yield from moe_sweep_rows("nvfp4", first(pairs_configs), kernel=moe_hfma2, timer=timer, **rank)
  if "experts" in cases:
    yield from moe_sweep_rows("nvfp4_fragments_bf16", first(experts_configs), kernel=moe_fragments, timer=timer, **rank)
  if "rank_dense" in cases:
    yield from _rank_dense(quick, timer, around=lambda c: first(around_bf16(c)))


QUANT_CASES = ("gemv", "expert_gate_up", "expert_down", "moe", "groups", "router", "epilogues", "rank_dense",
               "shared_down")


def quant_rows(*, quick: bool = False, timer: str = "loop", cases: tuple[str, ...] = QUANT_CASES
               ) -> Iterator[dict[str, Any]]:
  """Benchmark rows (see the module docstring) of `cases` (QUANT_CASES), each implementation
  timed by `timer`: "loop" (time_device: many calls in one program, launch gaps included) or
  "own" (its own kernels' device time from a profile); quick: tiny shapes, few iterations. First
  the `read` row (with_read_fraction)."""
  timer = QUICK_TIMER if quick else TIMERS[timer]
  yield from with_read_fraction(_cases(quick, timer, cases), timer, quick=quick)


def _cases(quick: bool, timer: Callable[..., float], cases: tuple[str, ...]) -> Iterator[dict[str, Any]]:
  """quant_rows' rows, without the read row."""
  if quick:
    gemv, moe = [("gemv", 64, 128), ("expert_gate_up", 32, 96), ("expert_down", 96, 32)], QUICK_MOE_CASE
  else:
    gemv, moe = [("gemv", 28672, 8192), ("expert_gate_up", 2048, 6144), ("expert_down", 6144, 2048)], MOE_CASE
  for name, n, k in gemv:
    for m in (1, 5, 8) if name in cases else ():
      yield from gemv_rows(m, n, k, name=name, timer=timer)
  if "moe" in cases:
    yield from moe_rows(**moe, timer=timer)
    yield from moe_rows(**moe, timer=timer, routed=4 * moe["experts"] if quick else 256)  # one TEP=8 rank's view
  # One TEP=8 rank's projections that share an input: q_a with kv_a, the indexer's wk with
  # weights_proj, the shared expert's gate with up.
  groups = ((("q_a+kv_a", (48, 16)),) if quick else
            (("q_a+kv_a", (2048, 576)), ("wk+weights_proj", (128, 4)), ("gate+up", (2048, 2048))))
  for name, ns in groups if "groups" in cases else ():
    yield from group_rows(5, 64 if quick else 6144, ns, name=name, timer=timer)
  for tokens in (1, 5) if "router" in cases else ():  # mini's group-limited routing at the quick shapes
    yield from router_rows(tokens, get_model_config("mini" if quick else "glm5"), timer=timer)
  if "epilogues" in cases:
    yield from epilogue_rows(5, get_model_config("mini" if quick else "tep8_shard"), timer=timer)
  if "rank_dense" in cases:
    yield from _rank_dense(quick, timer)
  if "shared_down" in cases:  # tep8_shard's rank: 256 routed experts, its shared expert's 256-wide slice
    yield from shared_down_rows(**moe, shared=48 if quick else get_model_config("tep8_shard").shared_intermediate,
                                routed=4 * moe["experts"] if quick else 256, timer=timer,
                                cold_bytes=QUICK_COLD_BYTES if quick else COLD_BYTES)
