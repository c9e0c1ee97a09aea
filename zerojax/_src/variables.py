"""Flax Variables at the optimizer's edge: taken off on the way in, put back on the way out, and
the ZeRO layout written where Flax programs read layouts (a Variable's `out_sharding`).

A program that keeps its parameters as Flax Variables (an `nnx.State` in a flax `TrainState`, as
Flax's lm1b_nnx and MaxText-derived programs do, or `nnx.Optimizer`'s `nnx.state(model, wrt)`)
hands them to `tx.init` and `tx.update`. The wrapped optax optimizer runs on their values. What
comes back is in the caller's form: updates wrapped as the gradients were, the state as the state
that came in, and a state made by `tx.init` from Variables is itself made of `nnx.OptVariable`s
whose `out_sharding` is the plan's layout: `nnx.get_partition_spec`, `nnx.get_named_sharding`
and `jax.tree.map(lambda x: x.sharding, ...)` all read the same layout.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from zerojax._src import rules, validation


def _nnx() -> Any:
  """`flax.nnx`, where it was imported; else None. `import zerojax` loads no flax, and no Flax
  Variable can exist before `flax.nnx` is imported, so a tree holds none then: this one check
  stands for every function below, which import it only where Variables were found."""
  return sys.modules.get('flax.nnx')


def is_variable(x: Any) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Variable)


def has_variables(*trees: Any) -> bool:
  """Whether any of `trees` holds a Flax Variable."""
  if _nnx() is None:
    return False
  return any(any(map(is_variable, jax.tree.leaves(t, is_leaf=is_variable))) for t in trees)


def values_of(tree: Any) -> Any:
  """`tree` with Flax Variables replaced by their values (`nnx.as_pure`)."""
  return tree if not has_variables(tree) else _nnx().as_pure(tree)


def wrapped_like(values: Any, like: Any) -> Any:
  """`values` (a pure tree of `like`'s values' structure) in `like`'s form: each value where
  `like` holds a Variable is put in that Variable's type, with its metadata."""
  if not has_variables(like):
    return values
  return jax.tree.map(
    lambda old, new: old.replace(new) if is_variable(old) else new,
    like,
    values,
    is_leaf=is_variable,
  )


def checked_values(params: Any) -> Any:
  """`params` without Variables, refusing a Variable that asks for its own optimizer-state layout.

  Raises:
    ValueError: a Variable has `optimizer_sharding` metadata (its paths, and the fix).
  """
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]
  fighting = [
    f'params{jax.tree_util.keystr(path)}'
    for path, x in flat
    if is_variable(x) and x.get_metadata().get('optimizer_sharding') is not None
  ]
  if fighting:
    raise ValueError(
      f'{validation.listed(fighting)}: nnx.Param(..., optimizer_sharding=...) lays out its'
      ' optimizer state itself, and zero_stage lays out the optimizer state over its ZeRO axes:'
      ' the two would fight. Drop optimizer_sharding from these parameters and let zero_stage'
      ' split the state (stage 1 and up), or leave zero_stage out for them.'
    )
  return values_of(params)


def _axes_of(sharding: NamedSharding, ndim: int) -> tuple:
  """A NamedSharding's spec as `out_sharding` metadata: one entry per dimension."""
  spec = tuple(sharding.spec)
  return spec + (None,) * (ndim - len(spec))


def state_in_variables(state: Any, shardings: Any) -> Any:
  """The state `tx.init` made, each array an `nnx.OptVariable` whose `out_sharding` is its
  layout in the plan (`shardings`, a NamedSharding per leaf): what Flax reads layouts from.

  Made without Flax's eager sharding (the arrays are in that layout already)."""
  return jax.tree.map(
    lambda x, s: _nnx().OptVariable(x, eager_sharding=False, out_sharding=_axes_of(s, x.ndim)),
    state,
    shardings,
  )


def record_layouts(params: Any, shardings: Any) -> None:
  """Writes the plan's layout (`shardings`) into the `out_sharding` metadata of each Variable of
  `params` that declares a layout (`nnx.with_partitioning`) other than the plan's, in place: at
  stage 3 the plan splits the parameters over the ZeRO axes too, and a program that lays its
  state out from Flax's metadata (`nnx.get_named_sharding`) then keeps them split. The metadata
  is written in mesh axes. A Variable that declares no layout, or whose array rests in the
  plan's layout already (placed by `zerojax.nnx.shard` or `create_model`), is left as it is."""
  flat = jax.tree.leaves(params, is_leaf=is_variable)
  for var, target in zip(flat, jax.tree.leaves(shardings)):
    declared = var.get_metadata().get('out_sharding', None) if is_variable(var) else None
    if declared is None or _rests_in(var.get_value(), target):
      continue
    axes = _axes_of(target, len(var.get_value().shape))
    if PartitionSpec(*_as_entries(declared)) != PartitionSpec(*axes):
      changes = {'out_sharding': axes}
      if var.get_metadata().get('sharding_rules') is not None:  # mesh axes need no rules
        changes['sharding_rules'] = None
      var.set_metadata(**changes)


def _rests_in(x: Any, target: NamedSharding) -> bool:
  sharding = getattr(x, 'sharding', None)
  if not isinstance(sharding, NamedSharding):
    return False
  ndim = len(x.shape)
  return PartitionSpec(*_axes_of(sharding, ndim)) == PartitionSpec(*_axes_of(target, ndim))


def _as_entries(declared: Any) -> tuple:
  return tuple(declared.spec) if isinstance(declared, NamedSharding) else tuple(declared)


def metadata_specs(tree: Any, mesh: jax.sharding.Mesh | None = None) -> Any:
  """The PartitionSpec each Variable of `tree` declares, in every form Flax reads, as a pure
  tree (`nnx.as_pure`): `P()` for a Variable (or array) without an annotation.

  The forms of `nnx.with_partitioning(init, sharding)` (its `out_sharding` metadata): a tuple
  of mesh axis names or a `PartitionSpec`; logical names, under `nnx.logical_axis_rules` or
  the Variable's own `sharding_rules` (Flax's `nnx.get_partition_spec` reads these three);
  a `NamedSharding`, as the JAX AI Stack's tutorials write it (read here: Flax's reading of
  it fails); and none.

  Raises:
    ValueError: with `mesh`, a Variable's annotation is for another mesh (a `NamedSharding`'s
      own, or its `mesh` metadata): its path, both meshes, and the fix.
  """

  def one(path, x):
    if is_variable(x):
      return _variable_spec(x, f'params{jax.tree_util.keystr(path)}', mesh)
    return PartitionSpec() if hasattr(x, 'shape') else None

  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_variable)


def _variable_spec(var: Any, where: str, mesh: jax.sharding.Mesh | None) -> Any:
  meta = var.get_metadata()
  sharding = meta.get('out_sharding', None)
  declared = sharding.mesh if isinstance(sharding, NamedSharding) else meta.get('mesh', None)
  if mesh is not None and declared is not None and not same_mesh(declared, mesh):
    raise ValueError(
      f'{where}: its sharding metadata ({sharding}) is for the mesh {shown_mesh(declared)}, and'
      f' the optimizer was built on the mesh {shown_mesh(mesh)}: a layout means something on its'
      ' own mesh only. Build the optimizer on the mesh the model was annotated with'
      " (zero_stage(..., mesh=that_mesh)), or annotate the model on the optimizer's mesh."
    )
  if isinstance(sharding, NamedSharding):
    return PartitionSpec(*sharding.spec)
  nnx = _nnx()
  return nnx.as_pure(nnx.get_partition_spec(var))


def same_mesh(a: Any, b: Any) -> bool:
  """The same axis names and sizes, and the same devices where both are concrete meshes."""
  if tuple(a.axis_names) != tuple(b.axis_names) or tuple(a.axis_sizes) != tuple(b.axis_sizes):
    return False
  devices = [getattr(m, 'devices', None) for m in (a, b)]
  if any(d is None for d in devices):  # an abstract mesh (jax.set_mesh, inside jit)
    return True
  return [d.id for d in devices[0].flat] == [d.id for d in devices[1].flat]


def shown_mesh(mesh: Any) -> str:
  sizes = ', '.join(f'{n!r}: {s}' for n, s in zip(mesh.axis_names, mesh.axis_sizes))
  devices = getattr(mesh, 'devices', None)
  ids = '' if devices is None else f' over devices {[d.id for d in devices.flat]}'
  return f'{{{sizes}}}{ids}'


def check_metadata_axes(params: Any, specs: list, mesh: jax.sharding.Mesh) -> None:
  """Raises ValueError where a Param's metadata names an axis the mesh does not have: a
  logical name, read here where no `nnx.logical_axis_rules` turns it into a mesh axis."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(values_of(params))[0]]
  for path, spec in zip(paths, specs):
    named = [e for e in spec if isinstance(e, (str, tuple))]
    unknown = [a for e in named for a in rules.spec_axes(e) if a not in mesh.axis_names]
    if unknown:
      raise ValueError(
        f'params{jax.tree_util.keystr(path)}: its nnx.with_partitioning metadata reads {spec},'
        f' and {unknown[0]!r} is not an axis of the mesh {tuple(mesh.axis_names)}: a logical'
        ' name, and no nnx.logical_axis_rules is active here to turn it into one. Run this'
        ' under `with nnx.logical_axis_rules(rules):` as when the model was created, or give'
        ' the layouts once: zero_stage(..., param_specs=zerojax.nnx.logical_param_specs(model,'
        ' rules)).'
      )


def declared_specs(params: Any, mesh: jax.sharding.Mesh) -> Any | None:
  """The layouts that the Variables of `params` declare, a tree of `params`' values' structure;
  None where `params` holds no Variables or their metadata is not one spec per array.

  Raises:
    ValueError: a Variable is annotated for another mesh, or names an axis the mesh lacks.
  """
  if not has_variables(params):
    return None
  leaves = jax.tree.leaves(values_of(params))
  specs = jax.tree.leaves(
    metadata_specs(params, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec)
  )
  if len(specs) != len(leaves):
    return None
  check_metadata_axes(params, specs, mesh)
  return jax.tree.unflatten(jax.tree.structure(values_of(params)), specs)
