"""Flax NNX models laid out for ZeRO, and differentiated with `zerojax.value_and_grad`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zerojax._src import grad as grad_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import reduction, transform


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
  return _guard_explicit_stage3(model, plan)


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
  return _guard_explicit_stage3(nnx.merge(graphdef, p, r), plan)


_GUARDED: dict[type, type] = {}


def _guard_explicit_stage3(model: nnx.Module, plan: plan_lib.ZeroPlan) -> nnx.Module:
  """At stage 3 on an Explicit mesh, calling the model names the fix for JAX's sharding
  type error (its parameters rest split, and each layer must gather its own)."""
  if plan.stage < 3 or not mesh_lib.any_explicit(plan.mesh):
    return model
  cls = type(model)
  if cls not in _GUARDED and not getattr(cls, '_zerojax_guarded', False):
    call = cls.__call__

    def guarded_call(self, *args, **kwargs):
      try:
        return call(self, *args, **kwargs)
      except Exception as e:
        # jax does not export the class; its name is stable and public in messages.
        if type(e).__name__ != 'ShardingTypeError':
          raise
        raise ValueError(
          f'{cls.__name__} failed on ZeRO stage-3 parameters, which rest split over the'
          f" Explicit mesh: {e}\nGather each layer's parameters where it runs, with"
          ' zerojax.gathered_nnx(layer) inside the (scanned, rematerialised) forward pass or'
          ' zerojax.gathered_nnx(model) for the whole model at once, and differentiate with'
          ' zerojax.nnx_value_and_grad(loss_fn, tx): its loss runs per device, where the batch'
          ' and the gathered parameters are local. Or use a mesh with Auto axes.'
        ) from e

    namespace = {'__call__': guarded_call, '_zerojax_guarded': True}
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    _GUARDED[cls] = type(cls)(cls.__name__, (cls,), namespace)
  model.__class__ = _GUARDED.get(cls, cls)
  return model


def nnx_value_and_grad(
  loss_fn: Callable[..., Any], tx: optax.GradientTransformation, *, has_aux: bool = False, **options
) -> Callable[..., Any]:
  """`zerojax.value_and_grad` for an NNX model: `loss_fn(model, batch, *args)`.

  The model's `nnx.Param`s are differentiated; its other state (BatchNorm's
  running statistics, RNG streams) is passed to every device and micro-batch,
  and what the forward pass writes to it comes back into `model` as its mean
  over them. Give `nnx.BatchNorm` `axis_name=` the ZeRO axis (e.g. 'data') so
  its statistics are the global batch's, as under `jax.jit` on the whole
  batch; then the mean is exact with `micro_batches=1`. RNG streams draw
  independently per device and micro-batch (their keys are folded with the
  part's index).

  Args:
    loss_fn: `loss_fn(model, batch, *args)` -> the loss (or `(loss, aux)`), with
      the meaning `zerojax.value_and_grad` gives it.
    tx: the optimizer from `zerojax.zero_stage`.
    has_aux: `loss_fn` returns `(loss, aux)`.
    **options: `zerojax.value_and_grad`'s (`micro_batches`, `reduce_dtype`,
      `per_layer`).

  Returns:
    `fn(model, batch, *args, loss_scale=None)` -> `(loss, grads)` (or
    `((loss, aux), grads)`), grads an `nnx.State` of the Params for
    `nnx.Optimizer.update(model, grads)`; to call inside `nnx.jit`.
  """

  def fn(model, batch, *args, loss_scale=None):
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngKey, ...)

    def state_loss(params, batch, keys, rest, *args):
      part = nnx.merge(graphdef, params, keys, rest, copy=True)
      out = loss_fn(part, batch, *args)
      _, _, _, written = nnx.split(part, nnx.Param, nnx.RngKey, ...)
      # Every part starts from the same state; what it writes is averaged over the parts.
      written = jax.tree.map(lambda x: reduction.WeightedMean(x.astype(jnp.float32)), written)
      return (out[0], (out[1], written)) if has_aux else (out, (None, written))

    grad_fn = grad_lib.value_and_grad(state_loss, tx, has_aux=True, **options)
    (loss, (aux, written)), grads = grad_fn(params, batch, keys, rest, *args, loss_scale=loss_scale)
    nnx.update(model, jax.tree.map(lambda new, old: new.astype(old.dtype), written, rest))
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return fn
