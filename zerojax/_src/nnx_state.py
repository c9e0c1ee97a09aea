"""Flax NNX models laid out for ZeRO."""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import rules, transform


def nnx_plan(
  model: nnx.Module,
  tx: optax.GradientTransformation | None = None,
  *,
  stage: int = 3,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  policy: rules.Policy = 'error',
) -> plan_lib.ZeroPlan:
  """The `ZeroPlan` of an NNX model's `nnx.Param`s (and of `tx`'s state, if given)."""
  return transform.make_plan(
    nnx.state(model, nnx.Param), tx, stage=stage, mesh=mesh, axis=axis, policy=policy
  )


def shard_nnx(
  model: nnx.Module,
  *,
  stage: int = 3,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  policy: rules.Policy = 'error',
) -> nnx.Module:
  """Places an existing NNX model's parameters in their ZeRO layout, in place.

  At stage 3 the `nnx.Param`s are split over `axis`; below stage 3 they are
  replicated (their other axes kept). Returns `model`.
  """
  plan = nnx_plan(model, stage=stage, mesh=mesh, axis=axis, policy=policy)
  nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), plan.params))
  return model


def create_nnx_model(
  make_model: Callable[[], nnx.Module],
  *,
  stage: int = 3,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  policy: rules.Policy = 'error',
) -> nnx.Module:
  """Creates an NNX model directly in its ZeRO layout.

  The model is first created abstractly (`nnx.eval_shape`: nothing
  allocated), its plan computed, and then created for real inside one jitted
  program whose parameter outputs are already sharded: no device ever holds
  the whole model.

  Args:
    make_model: builds the model, e.g. `lambda: GPT(cfg, rngs=nnx.Rngs(0))`.
    stage: the ZeRO stage (3 splits the parameters).
    mesh: the device mesh; defaults to the one set by `jax.set_mesh`.
    axis: the ZeRO mesh axis or axes.
    policy: see `zerojax.zero_stage`.

  Returns:
    The model, with `nnx.Param`s carrying the plan's shardings.
  """
  abstract = nnx.eval_shape(make_model)
  plan = nnx_plan(abstract, stage=stage, mesh=mesh, axis=axis, policy=policy)
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  rest_shardings = jax.tree.map(lambda _: mesh_lib.replicated(plan.mesh), rest)

  def create():
    model = make_model()
    _, p, r = nnx.split(model, nnx.Param, ...)
    p = mesh_lib.run_in_layout(
      lambda t: mesh_lib.constrain(t, plan.params, plan.mesh), plan.mesh, plan.params
    )(p)
    return p, r

  del params
  p, r = jax.jit(create, out_shardings=(plan.params, rest_shardings))()
  return nnx.merge(graphdef, p, r)
