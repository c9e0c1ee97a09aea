"""`ZeroConfig`: what a zero-wrapped optimizer was built with, as data; and `ZeroUpdate`, the
`update` that carries it. Below the plan: `plan.py` and everything above it import this module,
and it imports nothing of theirs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax
from jax.sharding import Mesh

from zerojax._src import layouts as layouts_lib
from zerojax._src import options as options_lib


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroConfig:
  """What a zero-wrapped optimizer was built with: `zerojax.config_of(tx)`.

  Data only: what the user gave (checked), nothing computed from parameters. The plan of a
  parameter tree is `zerojax.plan_for(tx, params)`.

  Attributes:
    inner: the optax transformation that was wrapped.
    stage: the ZeRO stage.
    mesh: the device mesh.
    options: the `zerojax.Options` it was built with, as given.
    axes: the ZeRO mesh axes, checked against `mesh` (hpZ's parameter axes first).
    replica_axes: the data-parallel axes beside them (`Options.replica_axis`, or by
      default the mesh's axes across TPU slices that are not ZeRO axes).
    recorded: the parameters' layouts over the other mesh axes that a train state's `tx` holds
      for its traced steps (`zero_stage(train_state, ...)`, `create_train_state`), where traced
      arrays cannot show them; else None.
  """

  inner: optax.GradientTransformation
  stage: int
  mesh: Mesh
  options: options_lib.Options
  axes: tuple[str, ...]
  replica_axes: tuple[str, ...] = ()
  recorded: layouts_lib.Layouts | None = None

  def plan(self, params: Any, opt_state: Any = None) -> Any:
    """Moved: a config is data, and the plan is the planner's (`zerojax.plan_for`).

    Raises:
      AttributeError: always, with the new spelling.
    """
    del params, opt_state
    raise AttributeError(
      'ZeroConfig.plan(params) moved: a ZeroConfig holds only what the optimizer was built with.'
      ' Call zerojax.plan_for(tx, params) on the optimizer instead.'
    )

  @property
  def updates_params_on_host(self) -> bool:
    """Offloaded stage-3 parameters: updated in host memory, in the shards they rest in
    (`zerojax.apply_gradients` makes the new ones there)."""
    return bool(self.options.offload_params) and self.stage == 3


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroUpdate:
  """The `update` of a transformation made by `zero_stage`: a callable with its data.

  `zero_stage` returns `optax.GradientTransformationExtraArgs(init, ZeroUpdate(...))`, so
  optax and flax take it as any transformation (and rebuild it keeping this object), and the
  `ZeroConfig` it was built from is a field here, not an attribute set on a function.

  Attributes:
    config: the `ZeroConfig`.
    fn: `(updates, state, params=None, **extra_args) -> (updates, state)`.
    fused: `(grads, state, params, **extra_args) -> (new_params, state)`, the new parameters
      made inside the update's own computation (see `apply_gradients`).
  """

  config: ZeroConfig
  fn: Callable[..., tuple[optax.Updates, optax.OptState]]
  fused: Callable[..., tuple[optax.Params, optax.OptState]]

  def __call__(
    self,
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, optax.OptState]:
    return self.fn(updates, state, params, **extra_args)

  @property
  def fuses(self) -> bool:
    """Whether `apply_gradients` makes the new parameters inside the update itself (offloaded
    stage-3 parameters); elsewhere it is `tx.update` and `optax.apply_updates`."""
    return self.config.updates_params_on_host

  def apply_gradients(self, grads, state, params, **extra_args):
    """`(new_params, new_state)`: this update and `optax.apply_updates` in one call.

    The same arithmetic as `updates, state = tx.update(grads, state, params)` followed by
    `optax.apply_updates(params, updates)`. With `offload_params` at stage 3 and the update
    on the host (`update_on='host'` or `'stream'`) the new parameters are made in the
    update's own host computation, where they rest: the updates never come to the device
    (compiled into one computation, the add may be contracted with the update: values a
    rounding step apart can occur). Called by `zerojax.apply_gradients(tx, grads, opt_state,
    params)`.

    Raises:
      TypeError: `params` is None (the new parameters are made from them).
    """
    if params is None:
      raise TypeError(
        'apply_gradients(grads, state, params): params is None; pass the parameters the'
        ' gradients are of (the new ones are made from them).'
      )
    if not self.fuses:
      updates, state = self.fn(grads, state, params, **extra_args)
      return optax.apply_updates(params, updates), state
    return self.fused(grads, state, params, **extra_args)


def config_of(tx: Any) -> ZeroConfig | None:
  """The `ZeroConfig` of a transformation made by `zero_stage`, else None."""
  update = getattr(tx, 'update', None)
  return update.config if isinstance(update, ZeroUpdate) else None


def require_config(tx: Any) -> ZeroConfig:
  """The `ZeroConfig` of a transformation made by `zero_stage`.

  Raises:
    TypeError: if `tx` was not made by `zero_stage`.
  """
  config = config_of(tx)
  if config is None:
    raise TypeError(
      '`tx` was not made by zerojax.zero_stage; wrap it first:'
      ' tx = zerojax.zero_stage(tx, stage, mesh=mesh).'
    )
  return config
