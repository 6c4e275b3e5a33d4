"""A kernel lowered for the H200 without one: traced under an abstract H200 mesh, for the tests
that check each Pallas kernel lowers to Triton there (no GPU needed)."""

from experiments.kernel_ir import TRITON_CALL, lower_for_h200  # noqa: F401 (TRITON_CALL: the tests' import)


def h200_text(fn, *args) -> str:
  """The text of fn(*args) (ShapeDtypeStructs) lowered for an H200."""
  return lower_for_h200(fn, *args).as_text()
