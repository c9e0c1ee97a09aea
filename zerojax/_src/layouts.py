"""Layouts that travel with the optimizer state: what `tx.init` saw, for every traced update.

On a mesh with Auto axes a traced array carries no layout, so inside `jax.jit` (or
`nnx.jit`) an update cannot read where the model splits each parameter over a
tensor-parallel axis. `tx.init` usually sees the placed parameters (`nnx.Optimizer` calls it
eagerly on the model's state): the layouts it reads there are recorded in the state it
returns, as static data (no leaves), and every later update reads them from the state it is
given. Nothing is remembered between calls.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec

from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import validation
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
  tree = values_of(tree)
  meta = sys.modules.get('flax.core.meta')
  if meta is not None:
    tree = meta.unbox(tree)
  hidden = []

  def one(path, x):
    if isinstance(x, jax.core.Tracer) and not mesh_lib.any_explicit(jax.typeof(x).sharding.mesh):
      hidden.append(f'params{jax.tree_util.keystr(path)}')
    spec = plan_lib.spec_of(x)
    return PartitionSpec() if spec is None else spec

  specs = jax.tree_util.tree_map_with_path(one, tree)
  if hidden:
    shown = validation.listed(hidden)
    raise ValueError(
      f'zerojax.specs_of: {shown} are traced on Auto mesh axes, where arrays carry no layout.'
      ' Call it on the placed parameters outside jax.jit (or nnx.jit).'
    )
  return specs
