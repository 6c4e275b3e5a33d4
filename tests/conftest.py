"""Shared fixtures: the transformers-made tiny checkpoint and its reference outputs.

The suite compiles with XLA's CPU backend at optimization level 0 and with its MLIR fusion
emitters off (set before JAX starts its backend; child processes inherit both): compiling, not
running, is most of the suite's time, and both change how fast the code runs, not what it
computes beyond fp32 rounding (the other emitter rounded one interpreted kernel's fp32 norm apart
from another's: test_mla_epilogue's cache-write test). Level 0 cut the Pallas engine and
speculative tests from 220 s to 136 s on 2 cores.
The fusion emitters (`xla_cpu_disable_new_fusion_emitters`, a backend extra option: the
elemental LLVM emitter instead) spent most of each compile canonicalising the symbolic tiles of
the interpreted kernels' reshapes and transposes (perf: 33% of a kernel test's samples in
`SymbolicExpr::Canonicalize`); without them test_dsa_kernels.py took 70 s against 116, the
fragment GEMV's cases 14 against 37, test_speculative.py 35 against 50.
"""

import gc
import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                           " --xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters").strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax

FIXTURE = pathlib.Path(os.environ.get("GLMJAX_FIXTURES", pathlib.Path(__file__).resolve().parents[1].parent
                                      / "shared" / "fixtures")) / "hf_glm_moe_dsa_tiny"


def _memory_maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after a test module once the process holds many memory
  mappings. Every XLA CPU executable keeps a few; the main suite's one process compiles enough
  programs to reach the kernel's limit (vm.max_map_count, 65,530 here), and the next compile then
  segfaults inside XLA (seen twice in CI near the suite's end). Below the mark the programs stay:
  later modules reuse them (the eager ops above all)."""
  yield
  if _memory_maps() > 20_000:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def fixture_dir() -> pathlib.Path:
  if not FIXTURE.exists():
    pytest.fail(f"fixture checkpoint not found at {FIXTURE} (set GLMJAX_FIXTURES)")
  return FIXTURE


@pytest.fixture(scope="session")
def reference(fixture_dir):
  return dict(np.load(fixture_dir / "reference.npz"))


@pytest.fixture(scope="session")
def fixture_fp32(fixture_dir):
  return glmjax.load_pretrained(fixture_dir, dtype=jnp.float32)


@pytest.fixture(scope="session")
def fixture_bf16(fixture_dir):
  return glmjax.load_pretrained(fixture_dir, dtype=jnp.bfloat16)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))
