"""Resolving the device mesh and the ZeRO axes, and placing trees on them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

AxisName = str | tuple[str, ...]


def resolve_mesh(mesh: Mesh | None) -> Mesh:
  """Returns `mesh`, or the mesh set by `jax.set_mesh` when `mesh` is None.

  Raises:
    ValueError: if `mesh` is None and no mesh is set.
    TypeError: if `mesh` is not a `jax.sharding.Mesh`.
  """
  if mesh is None:
    try:
      current = jax.sharding.get_mesh()
    except ValueError:  # inside jax.jit only the abstract mesh is available
      current = jax.sharding.get_abstract_mesh()
    if current is None or current.empty:
      raise ValueError(
        '`mesh` was not given and no mesh is set. Pass `mesh=jax.make_mesh((8,),'
        ' ("data",))`, or call inside `with jax.set_mesh(mesh):`.'
      )
    return current
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(
      f'`mesh` must be a jax.sharding.Mesh (e.g. from jax.make_mesh), got'
      f' {type(mesh).__name__}: {mesh!r}.'
    )
  return mesh


def resolve_axes(mesh: Mesh, axis: AxisName) -> tuple[str, ...]:
  """Normalises `axis` (one name or a tuple of names) and checks it against `mesh`.

  Raises:
    ValueError: if an axis is not in the mesh, or an axis is named twice.
  """
  axes = (axis,) if isinstance(axis, str) else tuple(axis)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise TypeError(f'`axis` must be a mesh axis name or a tuple of names, got {axis!r}.')
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(
      f'`axis`={axis!r} names {missing} which is not an axis of the mesh'
      f' (its axes are {tuple(mesh.axis_names)}). Pass one of those names,'
      ' or build the mesh with that axis: jax.make_mesh((8,), ("data",)).'
    )
  if len(set(axes)) != len(axes):
    raise ValueError(f'`axis`={axis!r} names an axis more than once.')
  return axes


def axes_size(mesh: Mesh, axes: Sequence[str]) -> int:
  """Number of devices along `axes` of `mesh`."""
  return math.prod(mesh.shape[a] for a in axes)


def any_explicit(mesh: Mesh) -> bool:
  """Whether any axis of `mesh` has Explicit type (sharding in types)."""
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def auto_mesh(mesh: Mesh) -> Mesh:
  """The same devices and names as `mesh`, with every axis of Auto type."""
  if not any_explicit(mesh):
    return mesh
  # An AbstractMesh (what `jax.set_mesh` leaves visible inside `jax.jit`) has
  # no devices to rebuild a Mesh from; both kinds change their axis types.
  auto = (AxisType.Auto,) * len(mesh.axis_names)
  if isinstance(mesh, AbstractMesh):
    return mesh.update_axis_types(dict(zip(mesh.axis_names, auto)))
  return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def constrain(tree: Any, shardings: Any, mesh: Mesh) -> Any:
  """`with_sharding_constraint` against the Auto view of `mesh`.

  Called inside `jax.sharding.auto_axes` when the mesh has Explicit axes, so
  the constraint is legal on either kind of mesh.
  """
  amesh = auto_mesh(mesh)
  specs = jax.tree.map(
    lambda s: NamedSharding(amesh, s.spec, memory_kind=s.memory_kind),
    shardings,
    is_leaf=lambda s: isinstance(s, NamedSharding),
  )
  return jax.lax.with_sharding_constraint(tree, specs)


def run_in_layout(fn, mesh: Mesh, out_shardings: Any):
  """Wraps `fn` so its body may use Auto-axis constraints on any mesh.

  On a mesh with Explicit axes the body runs under `jax.sharding.auto_axes`,
  whose outputs are typed with `out_shardings`; on an Auto mesh it runs as is
  and the last constraint in the body fixes the output layouts.
  """
  if not any_explicit(mesh):
    return fn
  return jax.sharding.auto_axes(fn, out_sharding=out_shardings)


def replicated(mesh: Mesh) -> NamedSharding:
  """A fully replicated sharding on `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def device_slices(mesh: Mesh) -> Any:
  """Each mesh position's TPU slice (`Device.slice_index`) as an array shaped like the mesh,
  or None where the devices carry none (CPU, GPU, one slice's compile-only devices) or the
  mesh is abstract."""
  if isinstance(mesh, AbstractMesh) or not isinstance(mesh, Mesh):
    return None
  devices = mesh.devices
  flat = [getattr(d, 'slice_index', None) for d in np.asarray(devices).flat]
  if any(s is None for s in flat):
    return None
  return np.asarray(flat).reshape(np.shape(devices))


def dcn_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes whose devices lie in different TPU slices: their collectives cross the
  data-center network (DCN) between slices. () on one slice or where devices name none."""
  slices = device_slices(mesh)
  if slices is None or len(np.unique(slices)) < 2:
    return ()
  out = []
  for i, name in enumerate(mesh.axis_names):
    moved = np.moveaxis(slices, i, 0)
    if any((moved[k] != moved[0]).any() for k in range(1, moved.shape[0])):
      out.append(name)
  return tuple(out)


def check_slice_axes(mesh: Mesh, axes: Sequence[str]) -> None:
  """Raises unless `axes` (the axes across slices) lead the mesh and each slice is one block.

  Raises:
    ValueError: a slice axis after an axis inside the slices, or a mesh whose slices are
      not whole blocks of the inner axes.
  """
  names = tuple(mesh.axis_names)
  if tuple(names[: len(axes)]) != tuple(axes):
    raise ValueError(
      f'the mesh axes {tuple(axes)} run across TPU slices but the mesh is {names}: axes across'
      ' slices must come first (outermost), so each slice holds whole blocks of the others.'
      ' Build it with jax.experimental.mesh_utils.create_hybrid_device_mesh, or order the'
      f' axes as {tuple(axes) + tuple(a for a in names if a not in axes)}.'
    )
  slices = device_slices(mesh)
  if slices is None:
    return
  inner = slices.reshape(math.prod(slices.shape[: len(axes)]), -1)
  if any(len(np.unique(row)) != 1 for row in inner):
    raise ValueError(
      f'the mesh {dict(mesh.shape)} mixes TPU slices inside its inner axes: every position of'
      f' the axes {tuple(axes)} must hold one whole slice. Build the mesh with'
      ' jax.experimental.mesh_utils.create_hybrid_device_mesh.'
    )


def slice_ids(mesh: Mesh, replica_axes: Sequence[str] = ()) -> Any:
  """Each device's slice, in the mesh's device order (the partition ids of its programs):
  `Device.slice_index` where the devices carry one, else the position along `replica_axes`
  (a CPU or one-slice mesh standing in for several slices); None when neither applies."""
  slices = device_slices(mesh)
  if slices is not None and len(np.unique(slices)) > 1:
    return slices.reshape(-1)
  if not replica_axes:
    return None
  shape = tuple(mesh.shape[a] for a in mesh.axis_names)
  index = np.indices(shape)
  position = np.zeros(shape, int)
  for a in replica_axes:
    i = list(mesh.axis_names).index(a)
    position = position * shape[i] + index[i]
  return position.reshape(-1)
