"""Mixed precision as in the ZeRO paper: compute-dtype params, an fp32 master copy in the optimizer.

`mixed_precision(tx)` is an optax transformation. Its state holds the fp32 master
parameters beside `tx`'s own state, so once wrapped by `zero_stage` the master
copy is sharded like the rest of the optimizer state (stage 1 and up). The model
keeps its parameters in the compute dtype (bf16 or fp16) and computes gradients
in it; the update runs in fp32 on the master copy, and the new parameters are
the master rounded to the compute dtype.

fp16 needs loss scaling: with `loss_scale='dynamic'` the loss is multiplied by
a scale before differentiation (see `loss_scale` and `zerojax.value_and_grad`),
the update divides it out, and a step whose gradients overflow is skipped and
halves the scale; after `growth_interval` good steps the scale doubles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from zerojax._src import transform
from zerojax._src import update as update_lib


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scaling for fp16.

  Attributes:
    initial: the scale at the first step.
    growth_interval: good steps in a row after which the scale is multiplied
      by `factor`.
    factor: growth factor, and the divisor on overflow.
    minimum: the scale never goes below this.
  """

  initial: float = 2.0**15
  growth_interval: int = 2000
  factor: float = 2.0
  minimum: float = 1.0


class LossScaleState(NamedTuple):
  """The loss scale and the number of good steps since it last changed."""

  scale: chex.Array
  good_steps: chex.Array


class MixedPrecisionState(NamedTuple):
  """State of `mixed_precision`: master parameters, the inner state, the loss scale."""

  master: optax.Params
  inner: optax.OptState
  loss_scale: LossScaleState | None


def _check_float(dtype: Any, name: str) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f'`{name}` must be a floating dtype, got {dtype}.')
  return dtype


@dataclasses.dataclass(frozen=True, eq=False)
class MixedPrecisionUpdate:
  """The `update` of `zerojax.mixed_precision`: a callable with its data.

  Attributes:
    master_step: the update up to the rounded new parameters, `(grads, state, dtypes,
      **extra_args) -> (rounded, new_state)`, which `Options(update_on='stream')` runs on
      the host.
    fn: `(grads, state, params, **extra_args) -> (updates, state)`.
  """

  master_step: Callable[..., Any]
  fn: Callable[..., Any]

  def __call__(self, grads, state, params=None, **extra_args):
    return self.fn(grads, state, params, **extra_args)


def mixed_precision(
  tx: optax.GradientTransformation,
  *,
  master_dtype: Any = jnp.float32,
  loss_scale: None | float | str | DynamicLossScale = None,
) -> optax.GradientTransformationExtraArgs:
  """Keeps an fp32 master copy of the parameters in `tx`'s state and updates it there.

  Wrap it with `zero_stage`, not the other way round:
  `zero_stage(mixed_precision(tx), stage, mesh=mesh)` shards the master copy
  with the rest of the optimizer state.

  Use with parameters in a compute dtype (e.g. `jnp.bfloat16`): `init` takes
  the parameters at full precision (or any dtype) and keeps them as the master
  copy; `update` casts the gradients to `master_dtype` (dividing out the loss
  scale), runs `tx` on the master copy, and returns updates that turn the
  compute-dtype parameters into the new master rounded to their dtype.

  Loss scaling is undone here and only here: with `loss_scale`, pass the
  gradients of `loss * zerojax.loss_scale(opt_state)` (as
  `zerojax.value_and_grad(..., loss_scale=...)` returns them, or from your own
  `jax.grad` of the scaled loss); `update` divides them by the scale in
  `master_dtype` before `tx` sees them, so clipping and the optimizer see true
  gradients.

  Args:
    tx: the optimizer (any optax transformation not yet wrapped by
      `zero_stage`).
    master_dtype: dtype of the master copy and of the update arithmetic.
    loss_scale: None (bf16 needs none); a number for a static scale; 'dynamic'
      or a `DynamicLossScale` for fp16.

  Returns:
    An optax transformation; wrap it with `zerojax.zero_stage` to shard the
    master copy with the optimizer state.

  Raises:
    ValueError: `tx` was already wrapped by `zero_stage` (the error shows the
      right nesting), or a bad `loss_scale`.

  Example:
  >>> import jax.numpy as jnp, optax, zerojax
  >>> tx = zerojax.mixed_precision(optax.adam(1e-3))
  >>> master = {'w': jnp.ones((2, 2))}
  >>> state = tx.init(master)
  >>> params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
  >>> grads = {'w': jnp.full((2, 2), 0.5, jnp.bfloat16)}
  >>> updates, state = tx.update(grads, state, params)
  >>> optax.apply_updates(params, updates)['w'].dtype
  dtype(bfloat16)
  """
  master_dtype = _check_float(master_dtype, 'master_dtype')
  loss_scale = _check_loss_scale(loss_scale)
  if transform.config_of(tx) is not None:
    raise ValueError(
      '`tx` is already wrapped by zero_stage, so the fp32 master copy that'
      ' mixed_precision adds would sit outside the sharded optimizer state, whole on'
      ' every device. Nest them the other way round:'
      ' zerojax.zero_stage(zerojax.mixed_precision(tx), stage, mesh=mesh).'
    )
  inner = optax.with_extra_args_support(tx)

  def init(params: optax.Params) -> MixedPrecisionState:
    master = jax.tree.map(lambda p: jnp.asarray(p, master_dtype), params)
    scale = None
    if loss_scale is not None:
      dynamic = isinstance(loss_scale, DynamicLossScale)
      initial = loss_scale.initial if dynamic else float(loss_scale)
      scale = LossScaleState(jnp.asarray(initial, jnp.float32), jnp.zeros((), jnp.int32))
    return MixedPrecisionState(master, inner.init(master), scale)

  step = functools.partial(_master_step, inner, master_dtype, loss_scale)

  def update(grads, state: MixedPrecisionState, params=None, **extra_args):
    if params is None:
      raise ValueError(
        'mixed_precision needs the parameters: call tx.update(grads, state, params)'
        ' (flax TrainState.apply_gradients does).'
      )
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    rounded, new_state = step(grads, state, dtypes, **extra_args)
    return update_lib.updates_to(rounded, params), new_state

  return optax.GradientTransformationExtraArgs(init, MixedPrecisionUpdate(step, update))


def _check_loss_scale(loss_scale: Any) -> None | float | DynamicLossScale:
  """`loss_scale` checked, 'dynamic' as a `DynamicLossScale`.

  Raises:
    ValueError: not None, a positive number, 'dynamic' or a `DynamicLossScale`.
  """
  if loss_scale == 'dynamic':
    loss_scale = DynamicLossScale()
  if isinstance(loss_scale, str) or (
    loss_scale is not None and not isinstance(loss_scale, (int, float, DynamicLossScale))
  ):
    raise ValueError(
      f'`loss_scale` must be None, a number, "dynamic" or a DynamicLossScale, got {loss_scale!r}.'
    )
  if isinstance(loss_scale, (int, float)) and not loss_scale > 0:
    raise ValueError(f'`loss_scale` must be positive, got {loss_scale!r}.')
  return loss_scale


def _master_step(inner, master_dtype, loss_scale, grads, state, dtypes, **extra_args):
  """`mixed_precision`'s update up to the new parameters: (their master rounded to `dtypes`,
  new state).

  It never reads the compute-dtype parameters, so it can run where the state lives (host
  memory, `update_on='stream'`) and send back only the new parameters in their compute dtype.
  """
  grads = jax.tree.map(lambda g: g.astype(master_dtype), grads)
  scale = state.loss_scale
  if scale is not None:
    grads = jax.tree.map(lambda g: g / scale.scale.astype(master_dtype), grads)
  new_updates, new_inner = inner.update(grads, state.inner, state.master, **extra_args)
  new_master = optax.apply_updates(state.master, new_updates)
  new_state = MixedPrecisionState(new_master, new_inner, scale)
  if isinstance(loss_scale, DynamicLossScale):
    new_state = _if_finite(grads, new_state, state, loss_scale)
  rounded = jax.tree.map(lambda m, d: m.astype(d), new_state.master, dtypes)
  return rounded, new_state


def _if_finite(grads, new_state, state, loss_scale: DynamicLossScale) -> MixedPrecisionState:
  """Dynamic loss scaling, in the manner of `optax.apply_if_finite`: `new_state` where every
  gradient is finite (one global answer, however they are sharded), else `state` kept; the
  scale moves either way."""
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  kept = jax.tree.map(
    lambda new, old: jnp.where(finite, new, old),
    new_state._replace(loss_scale=None),
    state._replace(loss_scale=None),
  )
  return kept._replace(loss_scale=_next_scale(state.loss_scale, finite, loss_scale))


def _next_scale(state: LossScaleState, finite, cfg: DynamicLossScale) -> LossScaleState:
  grown = state.good_steps + 1 >= cfg.growth_interval
  scale = jnp.where(
    finite,
    jnp.where(grown, state.scale * cfg.factor, state.scale),
    jnp.maximum(state.scale / cfg.factor, cfg.minimum),
  )
  good = jnp.where(finite & ~grown, state.good_steps + 1, 0)
  return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale in `opt_state` (1.0 when there is no `mixed_precision` scale).

  Multiply the loss by it before differentiating; `mixed_precision` divides the
  gradients by it.
  """
  found = [
    x
    for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))
    if isinstance(x, LossScaleState)
  ]
  if not found:
    return jnp.ones((), jnp.float32)
  return found[0].scale


def cast(tree: Any, dtype: Any) -> Any:
  """Casts the floating-point leaves of `tree` to `dtype` (e.g. params to bf16)."""
  dtype = _check_float(dtype, 'dtype')

  def one(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)

  return jax.tree.map(one, tree)
