"""experiments.kernel_registers' pieces that run without pip's Triton: a kernel's Triton IR taken
from its lowering, the PTX load widths, and the programs an SM holds for their registers. (The
compile itself runs in .venv-triton; BENCHMARKS.md run 49 checks its registers against Nsight.)"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from experiments.kernel_ir import programs_per_sm, triton_kernels
from experiments.triton_ptx import load_widths, loop_mix
from glmjax.quant import quantize_nvfp4, to_fragments
from pallas_kernels.nvfp4_fragments import FragmentConfig, fragment_matmul


@pytest.mark.parametrize("registers, warps, programs", [
    (72, 2, 14), (122, 2, 8), (96, 2, 10), (166, 2, 6), (156, 1, 12),  # Nsight's block limits (runs 47-48)
    (40, 1, 32), (32, 8, 8)])  # capped at 32 programs, and at 64 warps
def test_programs_per_sm(registers, warps, programs):
  assert programs_per_sm(registers, warps) == programs


def test_load_widths():
  ptx = """ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
  @%p3 ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd2 + 0 ];
  @%p4 ld.global.b32 { %r7 }, [ %rd3 + 0 ];
  ld.global.b32 { %r8 }, [ %rd4 + 0 ];
  ld.global.b16 { %rs1 }, [ %rd5 + 0 ];
  st.global.b32 [ %rd6 + 0 ], { %r9 };
  cp.async.cg.shared.global [ %r9 + 0 ], [ %rd12 + 0 ], 0x10, %r10;
  cp.async.ca.shared.global [ %r11 + 0 ], [ %rd13 + 0 ], 4;
  cp.async.commit_group;"""
  assert load_widths(ptx) == {"16B": 1, "8B": 1, "4B": 2, "2B": 1, "16B async": 1, "4B async": 1}


def test_loop_mix_takes_the_longest_loop():
  """The span the longest backward branch closes, opcodes without predicates or modifiers; a
  shorter loop and the closing branch to itself are not it."""
  sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P4 BRA 0x80 ;
        /*0020*/                   LOP3.LUT R2, R3, 0x81818181, RZ, 0xc0, !PT ;
        /*0030*/                   PRMT R4, R2, 0x1504, R5 ;
        /*0040*/              @!P0 LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0050*/                   LOP3.LUT R2, R2, 0xc0c0c0c0, RZ, 0xc0, !PT ;
        /*0060*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*0070*/              @!P4 BRA 0x20 ;
        /*0080*/                   SHF.R.U32.HI R2, RZ, 0x4, R3 ;
        /*0090*/               @P1 BRA 0x80 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;"""
  loops = [[6, 0], [2, 0]]
  assert loop_mix(sass) == dict(loops=loops, loop=6, loop_ops={"LOP3": 2, "PRMT": 1, "LDG": 1, "HMMA": 1, "BRA": 1})
  assert loop_mix(sass, top=1) == dict(loops=loops, loop=6, loop_ops={"LOP3": 2})
  assert loop_mix("/*0000*/ EXIT ;\n/*0010*/ BRA 0x10;") == {}


def test_loop_mix_counts_each_loops_barriers():
  """Every loop, an outer one before the loop nested in it, with its barriers (BAR.SYNC and the
  like; a predicated one too): here 2 in the inner loop, 3 in the outer one that holds it."""
  sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/                   LDS R2, [R3] ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/              @!P0 BAR.ARV 0x1, 0x40 ;
        /*0050*/              @!P1 BRA 0x20 ;
        /*0060*/               @P2 BRA 0x10 ;
        /*0070*/                   EXIT ;"""
  assert loop_mix(sass)["loops"] == [[6, 3], [4, 2]]


def test_triton_kernels_of_a_gemv():
  """One Pallas launch, its name, warps and grid as configured, its Triton IR as text; the two
  spellings of FragmentConfig.wide_x give two programs."""
  w = jax.eval_shape(lambda a: to_fragments(quantize_nvfp4(a), "bfloat16"),
                     jax.ShapeDtypeStruct((200, 512), jnp.bfloat16))
  x = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16)
  config = FragmentConfig(tiles=4, split_k=2, num_warps=2, unroll=2, tile_groups=2, rows_out=True)
  texts = []
  for wide in (True, False):
    fn = lambda x, w, wide=wide: fragment_matmul(x, w, config=dataclasses.replace(config, wide_x=wide), interpret=False)
    [(meta, text)] = triton_kernels(fn, x, w)
    assert meta == dict(name="nvfp4_fragments", num_warps=2, num_stages=1, grid_x=4, grid_y=2, grid_z=1)
    assert "tt.func public @nvfp4_fragments" in text and text.count("tt.load") >= 4
    texts.append(text)
  assert texts[0] != texts[1]


def test_dsa_case_lowers_the_rank_path():
  """--case=dsa: the indexer's scores and top-k, then sparse MLA, each a Pallas-Triton launch."""
  from experiments.kernel_ir import case
  fn, args = case("dsa", m=1, n=1, k=1, operands="bfloat16")
  names = [meta["name"] for meta, _ in triton_kernels(fn, *args)]
  assert names[0] == "indexer_scores" and names[-1] == "sparse_mla_decode" and len(names) >= 3
  assert all(name.startswith("topk") for name in names[1:-1])


def test_pairs_case_puts_the_shared_gemv_in_the_gate_up_launch():
  """--case=pairs (rank_fastest's routed experts at a rank's view): the same four launches with
  --shared_down or without; with it the gate/up grid has 12 row blocks more, the shared GEMV's 96
  row tiles of 64 (6144 rows) over its 8 programs a grid row. --wide_words changes no grid."""
  from experiments.kernel_ir import case
  grids = {}
  for shared, wide in ((False, False), (True, False), (False, True)):
    fn, args = case("pairs", m=1, n=1, k=1, operands="bfloat16", shared_down=shared, wide_words=wide)
    grids[shared, wide] = {meta["name"]: (meta["grid_x"], meta["grid_y"], meta["grid_z"])
                           for meta, _ in triton_kernels(fn, *args)}
  assert grids[False, True] == grids[False, False]
  grids = {shared: grids[shared, False] for shared in (False, True)}
  assert set(grids[False]) == set(grids[True]) == {"hfma2_rows_planes", "moe_hfma2_gate_up", "hfma2_swiglu_planes",
                                                   "moe_hfma2_down"}
  assert grids[False]["moe_hfma2_gate_up"] == (128, 2, 4) and grids[True]["moe_hfma2_gate_up"] == (140, 2, 4)
  assert {name: grid for name, grid in grids[True].items() if name != "moe_hfma2_gate_up"} == {
      name: grid for name, grid in grids[False].items() if name != "moe_hfma2_gate_up"}


def test_concrete_case_is_its_abstract_one_with_data():
  """kernel_launch's inputs: the gemv case's arrays have the abstract case's shapes and dtypes,
  carry data (not zeros), and the case's function on them (interpreted on the CPU) gives XLA's
  product of the same quantized weight; a FragmentConfig reaches the kernel's launch."""
  from experiments.kernel_ir import case
  from glmjax.quant import from_fragments, linear
  from pallas_kernels.nvfp4_fragments import default_fragment_config
  shape = dict(m=3, n=48, k=160, operands="bfloat16")
  fn, args = case("gemv", **shape, concrete=True)
  _, abstract = case("gemv", **shape)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), args) == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
  x, w = args
  assert float(jnp.abs(x).min()) > 0 and int(jnp.count_nonzero(w.words)) > w.words.size // 2
  want = linear(x, from_fragments(w), impl="xla").astype(jnp.float32)
  got = jax.jit(fn)(x, w).astype(jnp.float32)
  assert float(jnp.max(jnp.abs(got - want))) <= 1e-2 * float(jnp.max(jnp.abs(want)))
  split = dataclasses.replace(default_fragment_config(2048, 1024, 1), split_k=2)
  for config, splits in ((None, default_fragment_config(2048, 1024, 1).split_k), (split, 2)):
    fn, args = case("gemv", m=1, n=2048, k=1024, operands="bfloat16", config=config)
    [(meta, _)] = triton_kernels(fn, *args)
    assert meta["grid_y"] == splits


def test_kernel_launch_names_a_bad_vary():
  """--vary outside the gemv case's FragmentConfig fields is refused, naming them, before any launch;
  so is --shared_down outside the pairs case."""
  import subprocess
  import sys
  vary = ("--vary takes field=value pairs", "'unroll'")
  for args, said in ((["--vary=bogus=1"], vary), (["--vary=unroll"], vary), (["--case=moe", "--vary=unroll=2"], vary),
                     (["--case=moe", "--shared_down"], ("--shared_down and --wide_words are the pairs case's",)),
                     (["--wide_words"], ("are the pairs case's, got --case=gemv",))):
    done = subprocess.run([sys.executable, "-m", "experiments.kernel_launch", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and all(part in done.stderr for part in said), args
