"""Flax NNX models laid out for ZeRO."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import transform


def nnx_plan(
  model: nnx.Module,
  tx: optax.GradientTransformation | None = None,
  *,
  stage: int = 3,
  **options: Any,
) -> plan_lib.ZeroPlan:
  """The `ZeroPlan` of an NNX model's `nnx.Param`s (and of `tx`'s state, if given).

  `options` are `zerojax.zero_stage`'s (mesh, axis, policy, param_specs, ...).
  """
  transform.check_option_names(options, 'nnx_plan')
  return transform.make_plan(nnx.state(model, nnx.Param), tx, stage=stage, **options)


def shard_nnx(model: nnx.Module, *, stage: int = 3, **options: Any) -> nnx.Module:
  """Places an existing NNX model's parameters in their ZeRO layout, in place.

  At stage 3 the `nnx.Param`s are split over the ZeRO axes; below stage 3 they
  are replicated (their other axes kept). `options` are `zerojax.zero_stage`'s.
  Returns `model`.
  """
  transform.check_option_names(options, 'shard_nnx')
  plan = nnx_plan(model, stage=stage, **options)
  nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), plan.params))
  return model


def create_nnx_model(
  make_model: Callable[[], nnx.Module], *, stage: int = 3, **options: Any
) -> nnx.Module:
  """Creates an NNX model directly in its ZeRO layout.

  The model is first created abstractly (`nnx.eval_shape`: nothing
  allocated), its plan computed, and then created for real inside one jitted
  program whose parameter outputs are already sharded: no device ever holds
  the whole model.

  Args:
    make_model: builds the model, e.g. `lambda: GPT(cfg, rngs=nnx.Rngs(0))`.
    stage: the ZeRO stage (3 splits the parameters).
    **options: `zerojax.zero_stage`'s options (mesh, axis, policy, ...), named
      and checked in one place.

  Returns:
    The model, with `nnx.Param`s carrying the plan's shardings.
  """
  transform.check_option_names(options, 'create_nnx_model')
  abstract = nnx.eval_shape(make_model)
  plan = nnx_plan(abstract, stage=stage, **options)
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
