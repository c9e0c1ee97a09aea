"""Gathering ZeRO-sharded parameters where they are used."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import rules


def _without_zero_axes(sharding: NamedSharding, axes, *, drop_leading: bool) -> NamedSharding:
  entries = list(sharding.spec)
  if drop_leading:
    entries = entries[1:]
  mesh = sharding.mesh
  return NamedSharding(
    mesh, rules.normalize_spec(PartitionSpec(*entries), len(entries), mesh, axes)
  )


def gather_params(
  params: Any,
  plan: plan_lib.ZeroPlan,
  *,
  layouts: Any = None,
  scanned: bool = False,
  dtype: jnp.dtype | None = None,
) -> Any:
  """All-gathers ZeRO-sharded parameters over the plan's axes, for use.

  Only the ZeRO axes are gathered; tensor-parallel axes stay. The gradient of
  the gather is a reduce-scatter back into the shards. Called on the whole
  parameter tree it gathers everything at once: simple, but then the full
  model is live on every device. For ZeRO-3 memory savings, call it per layer
  inside the layer loop instead (`scanned=True`), under `jax.checkpoint`, so
  each layer's parameters are gathered just before use and dropped after (and
  gathered again in the backward pass).

  Args:
    params: the parameters to gather (a whole tree, or one layer's slice).
    plan: the `ZeroPlan` (e.g. `zerojax.plan_for(state.tx, state.params)`).
    layouts: the plan's NamedShardings for `params` when `params` is a subtree,
      e.g. `plan.params['layers']`; defaults to `plan.params`.
    scanned: `params` is one layer of arrays stacked along a leading layer
      axis (as `jax.lax.scan` slices them); `layouts` describe the stack.
    dtype: cast floating leaves to this compute dtype *before* gathering, so
      the all-gather moves the smaller type (e.g. `jnp.bfloat16`).

  Returns:
    `params` laid out without the ZeRO axes.

  >>> import jax, jax.numpy as jnp, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> params = {'w': jnp.ones((64, 16))}
  >>> plan = zerojax.make_plan(params, optax.adam(1e-3), stage=3, mesh=mesh)
  >>> full = zerojax.gather_params(jax.device_put(params, plan.params), plan)
  >>> full['w'].sharding.is_fully_replicated
  True
  """
  mesh = plan.mesh
  layouts = plan.params if layouts is None else layouts
  full = jax.tree.map(
    lambda s: _without_zero_axes(s, plan.axes, drop_leading=scanned),
    layouts,
    is_leaf=lambda s: isinstance(s, NamedSharding),
  )
  return gather_to(params, full, mesh, dtype)


def gather_to(tree: Any, shardings: Any, mesh, dtype: Any = None) -> Any:
  """Casts floating leaves to `dtype` (if given), then lays `tree` out as `shardings`.

  The cast comes first so the all-gather moves the smaller type; the layout is
  applied under `run_in_layout`, so it works on Explicit and Auto meshes.
  """
  if dtype is not None:
    tree = jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )
  return mesh_lib.run_in_layout(lambda t: mesh_lib.constrain(t, shardings, mesh), mesh, shardings)(
    tree
  )
