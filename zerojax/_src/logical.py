"""Tensor parallelism declared with Flax logical partitioning, as `param_specs` for zerojax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import PartitionSpec

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def logical_param_specs(tree: Any, rules: Rules) -> Any:
  """Mesh PartitionSpecs from Flax logical axis names, for `zero_stage(param_specs=...)`.

  Args:
    tree: linen parameters made with `nn.with_logical_partitioning` (boxed,
      as `model.init` or `jax.eval_shape(model.init, ...)` return them). NNX
      needs no conversion: its variables are sharded when created (under
      `jax.set_mesh` with logical rules), and zerojax keeps the
      tensor-parallel axes that arrays already carry.
    rules: logical name -> mesh axis (or None), e.g.
      `(('embed', None), ('mlp', 'model'), ('heads', 'model'))`.

  Returns:
    The same tree with a `PartitionSpec` over mesh axes at each leaf (`P()`
    for leaves without names). ZeRO then splits each leaf over its own axes on
    a dimension the tensor-parallel axes leave free.

  Raises:
    ValueError: a logical name has no rule.

  >>> import jax, jax.numpy as jnp, zerojax
  >>> from flax import linen as nn
  >>> dense = nn.Dense(64, kernel_init=nn.with_logical_partitioning(
  ...     nn.initializers.lecun_normal(), ('embed', 'mlp')))
  >>> params = jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((1, 16)))['params']
  >>> zerojax.logical_param_specs(params, [('embed', None), ('mlp', 'model')])['kernel']
  P(None, 'model')
  """
  logical = nn.get_partition_spec(tree)
  known = {name for name, _ in rules}

  def to_mesh(path, spec):
    if not isinstance(spec, PartitionSpec):
      spec = PartitionSpec(*spec) if isinstance(spec, tuple) else PartitionSpec()
    missing = [n for n in spec if n is not None and not isinstance(n, tuple) and n not in known]
    if missing:
      raise ValueError(
        f'params{jax.tree_util.keystr(path)}: logical axis {missing[0]!r} has no rule in'
        f' `rules` (known: {sorted(known)}). Add ({missing[0]!r}, MESH_AXIS_OR_None).'
      )
    return nn.logical_to_mesh_axes(tuple(spec), rules)

  return jax.tree_util.tree_map_with_path(
    to_mesh, logical, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
  )
