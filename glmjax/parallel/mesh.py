"""The TEP device mesh: one axis over which attention heads, experts, MLP intermediates and the
vocabulary are all split (tensor + expert parallel, SGLang's TP8 + EP8 layout for GLM-5).

`use_mesh(mesh)` makes a mesh the context of the code traced inside it. It is JAX's own mesh
context (`jax.set_mesh`), so the mesh is part of jit's cache key: a step traced on one device is
never reused under a mesh, or the other way round. `active_mesh()` reads it at trace time (the
MoE layer switches to its expert-parallel shard_map there).
"""

import contextlib
from typing import Iterator, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

TEP = "tep"  # the one mesh axis


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
  """Join a multi-host run (one process per host); call before any other JAX call. Afterwards
  `jax.devices()` lists every host's devices, and `make_mesh` spans them."""
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got "
                     f"num_processes={num_processes}, process_id={process_id}")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id)


def make_mesh(tep: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh ("tep",) over the first `tep` of `devices` (default: every process's devices,
  `jax.devices()`). Axis type Auto: ops outside shard_map are partitioned by GSPMD."""
  devices = list(jax.devices() if devices is None else devices)
  if not 1 <= tep <= len(devices):
    raise ValueError(f"tep={tep} needs 1..{len(devices)} devices; {len(devices)} available")
  return jax.make_mesh((tep,), (TEP,), axis_types=(AxisType.Auto,), devices=devices[:tep])


def abstract_mesh(tep: int) -> AbstractMesh:
  """The TEP mesh without devices: shardings and shard shapes for accounting on any machine."""
  if tep < 1:
    raise ValueError(f"tep must be >= 1, got {tep}")
  return AbstractMesh((tep,), (TEP,), axis_types=(AxisType.Auto,))


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
  """Trace and run the model under `mesh` (see the module docstring)."""
  if TEP not in mesh.axis_names:
    raise ValueError(f"the mesh must have a {TEP!r} axis, got axes {mesh.axis_names}")
  with jax.set_mesh(mesh):
    yield mesh


def active_mesh() -> jax.sharding.AbstractMesh | None:
  """The mesh of the enclosing `use_mesh` when it splits "tep" over more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or TEP not in mesh.axis_names or mesh.shape[TEP] == 1:
    return None
  return mesh
