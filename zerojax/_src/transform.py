"""`zero_optimizer`: an optax transformation rewritten for a ZeRO stage."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import optax
from jax.sharding import Mesh

from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import options as options_lib
from zerojax._src import plan as plan_lib
from zerojax._src import update as update_lib
from zerojax._src.config import ZeroConfig, ZeroUpdate, config_of, require_config

__all__ = ['ZeroConfig', 'ZeroUpdate', 'config_of', 'require_config']


def is_transformation(tx: Any) -> bool:
  """Whether `tx` is an optax transformation or has its `init`/`update` protocol."""
  return isinstance(tx, optax.GradientTransformation) or (
    callable(getattr(tx, 'init', None)) and callable(getattr(tx, 'update', None))
  )


def as_transformation(tx: Any, name: str) -> optax.GradientTransformation:
  """`tx` as an optax transformation: objects with optax's `init`/`update`
  protocol (such as `optax.MultiSteps`) are accepted as they are.

  Raises:
    TypeError: `tx` has no `init` and `update` methods.
  """
  if isinstance(tx, optax.GradientTransformation):
    return tx
  if is_transformation(tx):
    return optax.GradientTransformationExtraArgs(tx.init, tx.update)
  raise TypeError(
    f'{name} must be an optax GradientTransformation (or have its init/update methods,'
    f' like optax.MultiSteps), got {type(tx).__name__}: {tx!r:.80}.'
  )


def apply_gradients(
  tx: optax.GradientTransformation,
  grads: optax.Updates,
  opt_state: optax.OptState,
  params: optax.Params,
  **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
  """`(new_params, new_opt_state)`: `tx.update` and `optax.apply_updates` in one call.

  A sibling of `optax.apply_updates`, for any optax transformation. For one made by
  `zerojax.zero_stage` with offloaded stage-3 parameters (`offload_params=True`, the update on
  the host), the new parameters are made inside the update's own host computation, where they
  rest, so the updates never come to the device and its peak stays flat in the layer count
  (`create_train_state`'s `apply_gradients` and `zerojax.nnx.Optimizer` call it). Elsewhere it
  is exactly `updates, opt_state = tx.update(grads, opt_state, params, **extra_args)` followed by
  `optax.apply_updates(params, updates)`.

  An optimizer that wraps a zerojax one (`optax.chain(zero_tx, ...)`) has no such fused step:
  its update runs the zerojax one's `tx.update`, which warns where that costs device memory.

  Raises:
    TypeError: `params` is None (the new parameters are made from them).

  >>> import jax.numpy as jnp, optax, zerojax
  >>> tx = optax.sgd(0.5)
  >>> params = {'w': jnp.ones(2)}
  >>> new, _ = zerojax.apply_gradients(tx, {'w': jnp.ones(2)}, tx.init(params), params)
  >>> new['w'].tolist()
  [0.5, 0.5]
  """
  update = getattr(tx, 'update', None)
  if isinstance(update, ZeroUpdate):
    return update.apply_gradients(grads, opt_state, params, **extra_args)
  if params is None:
    raise TypeError(
      'zerojax.apply_gradients(tx, grads, opt_state, params): params is None; pass the'
      ' parameters the gradients are of (the new ones are made from them).'
    )
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state


def plan_for(tx: optax.GradientTransformation, params: optax.Params) -> plan_lib.ZeroPlan:
  """The plan a zero-wrapped optimizer uses for `params`.

  Args:
    tx: a transformation returned by `zerojax.zero_stage`.
    params: the parameters (arrays, ShapeDtypeStructs, or Flax Variables of them, whose
      sharding metadata says their layouts where traced arrays cannot).

  Raises:
    TypeError: if `tx` was not made by `zero_stage`.
  """
  return plan_lib.plan_of(require_config(tx), params)


def with_layouts(tx: optax.GradientTransformation, plan: plan_lib.ZeroPlan) -> Any:
  """`tx`, holding `plan`'s tensor-parallel layouts as its record where traced parameters
  could not show them (`layouts.record_of`): what a train state keeps as its `tx`, so that its
  traced steps get the plan that laid it out. The options stay as the user gave them."""
  config = require_config(tx)
  record = layouts_lib.record_of(config, plan)
  if record is None:
    return tx
  return zero_optimizer(dataclasses.replace(config, recorded=record))


def make_config(
  tx: Any, stage: Any, mesh: Mesh | None, options: options_lib.Options, *, warn: bool = True
) -> ZeroConfig:
  """The `ZeroConfig` of `tx` wrapped for `stage` on `mesh` (default: `jax.set_mesh`'s).

  With `warn`, a ZeRO stage over axes of one device on a larger mesh warns (the planner,
  which prices such candidates on purpose, says False).

  Raises:
    ValueError: a bad stage; an axis not in the mesh; no mesh; `tx` already wrapped.
    TypeError: `tx` is not an optax transformation.
  """
  stage = options.check_stage(stage)
  tx = as_transformation(tx, '`tx`')
  inner_config = config_of(tx)
  if inner_config is not None:
    raise ValueError(
      f'`tx` is already wrapped by zero_stage (stage {inner_config.stage}); wrapping'
      ' twice would shard twice. Wrap the original optimizer once, or take it back with'
      ' zerojax.config_of(tx).inner.'
    )
  mesh = mesh_lib.resolve_mesh(mesh)
  axes = mesh_lib.resolve_axes(mesh, options.axis)
  axes, _ = plan_lib.order_axes(mesh, axes, options.param_axis)
  replica = _replica_axes(mesh, axes, stage, options)
  if warn:
    _warn_if_nothing_split(mesh, axes, stage)
  return ZeroConfig(
    inner=tx, stage=stage, mesh=mesh, options=options, axes=axes, replica_axes=replica
  )


def _warn_if_nothing_split(mesh: Mesh, axes: tuple[str, ...], stage: int) -> None:
  """Warns where stages 1-3 split over ZeRO axes of one device in all, on a mesh of more:
  nothing would be split, and the step is stage 0's."""
  if stage == 0 or mesh.size == 1 or mesh_lib.axes_size(mesh, axes) > 1:
    return
  sized = ', '.join(f'{a!r} (size {mesh.shape[a]})' for a in axes)
  others = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
  shown = ', '.join(f'{a!r} (size {mesh.shape[a]})' for a in others)
  warnings.warn(
    f'zerojax.zero_stage: ZeRO stage {stage} over {sized} splits nothing: that is one device,'
    ' so every device keeps whole parameters, gradients and optimizer state, as at stage 0,'
    f' and they stay replicated over {shown} (unless a layout splits them there). Name an axis'
    f' of more than one device: axis={others[0]!r} (or axis={(*axes, others[0])!r}), or make'
    f' {axes[0]!r} larger in the mesh.',
    stacklevel=4,
  )


def _replica_axes(
  mesh: Mesh, axes: tuple[str, ...], stage: int, options: options_lib.Options
) -> tuple[str, ...]:
  """The data-parallel axes beside the ZeRO axes, checked against the mesh's slices.

  Raises:
    ValueError: axes across TPU slices that do not lead the mesh, or that are neither
      ZeRO nor data-parallel axes; a stage-3 ZeRO axis across slices with no
      `param_axis` (every parameter gather would cross the data-center network).
  """
  dcn = mesh_lib.dcn_axes(mesh)
  if dcn:
    mesh_lib.check_slice_axes(mesh, dcn)
  if options.replica_axis is None:
    replica = tuple(a for a in dcn if a not in axes)
  else:
    replica = mesh_lib.resolve_axes(mesh, options.replica_axis)
  stray = [a for a in dcn if a not in axes and a not in replica]
  if stray:
    raise ValueError(
      f'the mesh axes {stray} run across TPU slices but are neither ZeRO axes (axis={axes})'
      f' nor data-parallel ones (replica_axis={replica}): anything split over them would'
      f' cross the data-center network every step. Add them to replica_axis.'
    )
  over_dcn = [a for a in axes if a in dcn]
  if stage == 3 and over_dcn and options.param_axis is None:
    inner = tuple(a for a in axes if a not in dcn)
    keep = (
      f'param_axis={inner!r} (ZeRO++ hpZ)'
      if inner
      else 'a ZeRO axis inside the slices and param_axis= that axis (ZeRO++ hpZ)'
    )
    raise ValueError(
      f'stage 3 with ZeRO over {over_dcn}, which runs across TPU slices, would all-gather'
      ' every parameter over the data-center network in each forward and backward pass.'
      f' Keep the parameters inside a slice with {keep}, or'
      f' leave {over_dcn} out of `axis` (hierarchical ZeRO: one DCN all-reduce of each'
      f' gradient shard per step), or say param_axis={axes!r} to gather over DCN on purpose.'
    )
  return replica


def zero_optimizer(config: ZeroConfig) -> optax.GradientTransformationExtraArgs:
  """Rewrites `config.inner` for its ZeRO stage; see `zerojax.zero_stage`. The update's work is
  `update.Core`'s; `update` here is optax's, and `apply_gradients` its fused sibling."""
  core = update_lib.Core.of(config)

  def update(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, optax.OptState]:
    update_lib.warn_if_update_leaves_host(config, stacklevel=3)
    return core.update(updates, state, params, extra_args, applied=False)

  def apply(grads, state, params, **extra_args):
    """The new parameters made inside the update itself (`ZeroUpdate.apply_gradients`)."""
    return core.update(grads, state, params, extra_args, applied=True)

  return optax.GradientTransformationExtraArgs(core.init, ZeroUpdate(config, update, apply))
