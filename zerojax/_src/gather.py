"""Gathering sharded parameters where they are used."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import rules


def gather_params(params: Any, plan: plan_lib.ZeroPlan) -> Any:
  """All-gathers ZeRO-sharded parameters over the plan's axes, for use.

  The result keeps any tensor-parallel sharding; only the ZeRO axes are
  gathered. Its gradient is a reduce-scatter back into the shards. This gathers
  every parameter at once: simple, but the whole model is then live on each
  device; per-layer gathering keeps the peak lower.

  Args:
    params: the parameters, laid out as `plan.params` (or any layout).
    plan: the `ZeroPlan` (e.g. `zerojax.plan_for(state.tx, state.params)`).

  Returns:
    `params` laid out without the ZeRO axes.
  """
  mesh = plan.mesh
  full = jax.tree.map(
    lambda s: NamedSharding(mesh, rules.normalize_spec(s.spec, len(s.spec), mesh, plan.axes)),
    plan.params,
  )
  return mesh_lib.run_in_layout(lambda p: mesh_lib.constrain(p, full, mesh), mesh, full)(params)
