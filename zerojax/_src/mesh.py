"""Resolving the device mesh and the ZeRO axes, and placing trees on them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
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
