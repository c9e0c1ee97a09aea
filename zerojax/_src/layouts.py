"""Where each parameter is split over the mesh's non-ZeRO axes, resolved in one place.

`resolve(config, params, recorded)` chooses among the sources a layout can come from, in this
order, and says which it used: the `param_specs` the optimizer was given; the arrays themselves
(placed, or typed on Explicit axes); a record (`Layouts`) that `tx.init` left in the state or a
train state left in its `tx`; the Flax Variables' sharding metadata; and where none can say it
(traced on Auto axes beside another axis), a refusal naming the fixes. The plan is then
`plan.build_plan(config, params, layouts)`. This module alone asks whether an array is traced.

Layouts that travel with the optimizer state: what `tx.init` saw, for every traced update.

On a mesh with Auto axes a traced array carries no layout, so inside `jax.jit` (or
`nnx.jit`) an update cannot read where the model splits each parameter over a
tensor-parallel axis. `tx.init` usually sees the placed parameters (`nnx.Optimizer` calls it
eagerly on the model's state): the layouts it reads there are recorded in the state it
returns, as static data (no leaves), and every later update reads them from the state it is
given. Nothing is remembered between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zerojax._src import frozen as frozen_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import rules, validation, variables
from zerojax._src.variables import values_of


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Layouts:
  """The parameters' layouts over the mesh's non-ZeRO axes, one per leaf in tree order.

  A static pytree node: it has no leaves, so it passes through `jax.jit`, `nnx.jit`,
  `jax.tree.map` and checkpoints as part of the tree's structure.

  Attributes:
    specs: per parameter leaf (in `jax.tree.leaves` order), its `PartitionSpec` with the
      ZeRO axes left out (`P()` where the leaf is whole over every other axis).
  """

  specs: tuple[PartitionSpec, ...]

  def __repr__(self) -> str:
    split = sum(1 for s in self.specs if any(e is not None for e in s))
    return f'Layouts({len(self.specs)} leaves, {split} split over other mesh axes)'

  @classmethod
  def of(cls, specs: Any) -> Layouts:
    """The record of a tree of `PartitionSpec`s (a leaf each)."""
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return cls(tuple(leaves))

  def tree_like(self, params: Any, name: str) -> Any:
    """The specs as a tree of `params`' structure.

    Raises:
      ValueError: `params` has another number of leaves than the parameters `tx.init` saw.
    """
    treedef = jax.tree.structure(params)
    if treedef.num_leaves != len(self.specs):
      raise ValueError(
        f'the optimizer state was made by tx.init for {len(self.specs)} parameter leaves,'
        f' and this update got {treedef.num_leaves} leaves of `{name}`: an optimizer state'
        ' belongs to the parameters it was initialised for. Call tx.init on these'
        ' parameters.'
      )
    return jax.tree.unflatten(treedef, self.specs)


class ZeroState(NamedTuple):
  """The state of a zero-wrapped optimizer that records its parameters' layouts.

  `tx.init` returns it in place of the wrapped optimizer's own state when the mesh has Auto
  axes beside the ZeRO axes (tensor parallelism), no `param_specs` were given, and the
  parameters it got were placed: traced updates could not read their layouts otherwise.
  Elsewhere `tx.init` returns the wrapped optimizer's state as it is.

  Attributes:
    inner: the wrapped optax transformation's state.
    layouts: the parameters' layouts over the other mesh axes (static, no leaves).
  """

  inner: optax.OptState
  layouts: Layouts


def specs_of(tree: Any) -> Any:
  """The `PartitionSpec` of each placed leaf of `tree`, for `zero_stage(param_specs=...)`.

  Takes what models hold their parameters in: arrays, an NNX state or its `nnx.Param`s
  (`nnx.state(model, nnx.Param)`), a linen tree with boxed `nn.Partitioned` leaves. A leaf
  that carries no mesh layout (a single-device array, a NumPy array) is whole over every
  mesh axis: `P()`.

  Args:
    tree: the placed parameters (outside `jax.jit`, or on Explicit axes inside it).

  Returns:
    A tree of `PartitionSpec`s of `tree`'s structure, Variables and boxes unwrapped.

  Raises:
    ValueError: a leaf is traced on Auto axes, where no layout can be read.

  >>> import jax, zerojax
  >>> zerojax.specs_of({'w': jax.numpy.ones((2, 2))}) == {'w': jax.sharding.PartitionSpec()}
  True
  """
  from flax.core import meta  # linen's boxes (`nn.Partitioned`); flax is loaded on use only

  tree = meta.unbox(values_of(tree))
  hidden = []

  def one(path, x):
    if is_traced(x) and not mesh_lib.any_explicit(jax.typeof(x).sharding.mesh):
      hidden.append(f'params{jax.tree_util.keystr(path)}')
    spec = spec_of(x)
    return PartitionSpec() if spec is None else spec

  specs = jax.tree_util.tree_map_with_path(one, tree)
  if hidden:
    shown = validation.listed(hidden)
    raise ValueError(
      f'zerojax.specs_of: {shown} are traced on Auto mesh axes, where arrays carry no layout.'
      ' Call it on the placed parameters outside jax.jit (or nnx.jit).'
    )
  return specs


def is_traced(x: Any) -> bool:
  """Whether `x` is traced (inside `jax.jit`, `nnx.jit`, a scan...): the one trace-state test."""
  return isinstance(x, jax.core.Tracer)


def any_traced(tree: Any) -> bool:
  return any(is_traced(x) for x in jax.tree.leaves(tree))


def spec_of(x: Any) -> PartitionSpec | None:
  """The PartitionSpec a leaf carries, if any: a placed array's, or a traced one's type's (on
  Auto axes a traced array's type carries none)."""
  sharding = jax.typeof(x).sharding if is_traced(x) else getattr(x, 'sharding', None)
  return sharding.spec if isinstance(sharding, NamedSharding) else None


def visible_spec(x: Any, mesh: Any) -> PartitionSpec | None:
  """The layout of `x` where it can be seen: a placed array, or a traced one whose type
  carries it (Explicit axes). Traced on Auto axes, the layout is not known yet."""
  if is_traced(x):
    return jax.typeof(x).sharding.spec if mesh_lib.any_explicit(mesh) else None
  sharding = getattr(x, 'sharding', None)
  return sharding.spec if isinstance(sharding, NamedSharding) else None


def other_axes(config: Any) -> list[str]:
  """The mesh axes of size > 1 that are neither ZeRO nor data-parallel (replica) axes."""
  skip = set(config.axes) | set(config.replica_axes)
  return [a for a in config.mesh.axis_names if a not in skip and config.mesh.shape[a] > 1]


def needs_record(config: Any) -> bool:
  """Whether layouts over the other mesh axes can be read only from placed arrays: no
  `param_specs` nor record in the config, Auto axes (traced arrays carry no layout), and other
  axes to split over. Then
  `tx.init` records them in the state (`ZeroState`), and a train state in its `tx`."""
  given = config.options.param_specs is not None or config.recorded is not None
  return not given and not mesh_lib.any_explicit(config.mesh) and bool(other_axes(config))


@dataclasses.dataclass(frozen=True)
class Resolved:
  """The layouts a plan is built from, and where they came from.

  Attributes:
    specs: a tree of `PartitionSpec`s, a prefix of the parameters' values; None: read each
      leaf's own (`spec_of`).
    source: 'param_specs', 'arrays', 'record' or 'metadata' (for error messages).
    frozen: per parameter leaf, whether it is frozen (`Options.trainable`); None: all train.
  """

  specs: Any
  source: str
  frozen: tuple[bool, ...] | None = None


def resolve(config: Any, params: Any, recorded: Layouts | None = None, name: str = 'params'):
  """The layouts of `params` over the mesh's other axes, from the first source that has them
  (see the module's docstring), and which leaves are frozen (`Options.trainable`). `params` may
  hold Flax Variables; `recorded` is the record of the state being updated
  (`ZeroState.layouts`), if any.

  Raises:
    ValueError: traced on Auto mesh axes beside another axis, with nothing that says the
      layouts; a record for another number of leaves; metadata for another mesh; a
      `trainable` that does not fit the parameters (see `frozen.trainable_leaves`).
  """
  found = _layouts(config, params, recorded, name)
  frozen = frozen_lib.trainable_leaves(config.options.trainable, params)
  if frozen is None:
    return found
  return Resolved(found.specs, found.source, tuple(not t for t in frozen))


def _layouts(config: Any, params: Any, recorded: Layouts | None, name: str) -> Resolved:
  if config.options.param_specs is not None:
    return Resolved(config.options.param_specs, 'param_specs')
  values = values_of(params)
  if config.recorded is not None:  # a train state's `tx`
    return Resolved(config.recorded.tree_like(values, name), 'record')
  if not needs_record(config):
    return Resolved(None, 'arrays')
  if recorded is not None:  # the state's (`ZeroState`)
    return Resolved(recorded.tree_like(values, name), 'record')
  leaves = jax.tree.leaves(values)
  shown = all(
    not is_traced(x) and isinstance(getattr(x, 'sharding', None), NamedSharding) for x in leaves
  )
  if not shown and variables.has_variables(params):
    specs = variables.declared_specs(params, config.mesh)
    if specs is not None:
      return Resolved(specs, 'metadata')
  if any(is_traced(x) for x in leaves):
    raise ValueError(
      'zerojax: these parameters are traced on Auto mesh axes, where arrays carry no'
      f' layout, and the mesh splits them over {other_axes(config)} too (tensor parallelism), so'
      ' where each is split cannot be read. Give tx.init the placed parameters outside'
      ' jit (nnx.Optimizer(model, tx, wrt=nnx.Param) does), and the state it returns'
      ' carries their layouts to every update; or give them to the optimizer:'
      ' zero_stage(..., param_specs=zerojax.specs_of(params)) on the placed parameters'
      ' (arrays, nnx.state(model, nnx.Param), or a boxed linen tree); or build the state'
      ' with zerojax.create_train_state or zero_stage(train_state, ...), which record them'
      ' in state.tx.'
    )
  return Resolved(None, 'arrays')


def record_of(config: Any, plan: Any) -> Layouts | None:
  """What `tx.init` records in the state (and a train state in its `tx`) for traced updates to
  read: `plan`'s layouts over the other mesh axes, where traced parameters could not show them
  (`needs_record`); else None."""
  if not needs_record(config):
    return None
  drop = config.axes
  specs = jax.tree.map(
    lambda s: rules.normalize_spec(s.spec, len(s.spec), config.mesh, drop=drop), plan.params
  )
  return Layouts.of(specs)
