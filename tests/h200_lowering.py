"""A kernel lowered for the H200 without one: traced under an abstract H200 mesh, for the tests
that check each Pallas kernel lowers to Triton there (no GPU needed)."""

import warnings

import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel lowers to


def h200_text(fn, *args) -> str:
  """The text of fn(*args) (ShapeDtypeStructs) lowered for an H200."""
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
  with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
