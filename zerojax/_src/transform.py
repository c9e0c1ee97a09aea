"""`zero_optimizer`: an optax transformation rewritten for a ZeRO stage."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import options as options_lib
from zerojax._src import plan as plan_lib
from zerojax._src import rules, variables
from zerojax._src import update as update_lib


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroConfig:
  """What a zero-wrapped optimizer was built with: `zerojax.config_of(tx)`.

  Attributes:
    inner: the optax transformation that was wrapped.
    stage: the ZeRO stage.
    mesh: the device mesh.
    options: the `zerojax.Options` it was built with.
    axes: the ZeRO mesh axes, checked against `mesh` (hpZ's parameter axes first).
    replica_axes: the data-parallel axes beside them (`Options.replica_axis`, or by
      default the mesh's axes across TPU slices that are not ZeRO axes).
  """

  inner: optax.GradientTransformation
  stage: int
  mesh: Mesh
  options: options_lib.Options
  axes: tuple[str, ...]
  replica_axes: tuple[str, ...] = ()
  # A memo of `plan`, a pure function of the parameters' signature (`_signature`): the
  # least recently used entries are dropped past `_PLAN_CACHE_SIZE`.
  _plans: collections.OrderedDict = dataclasses.field(
    default_factory=collections.OrderedDict, init=False, repr=False
  )

  def plan(
    self, params: optax.Params, opt_state: optax.OptState | None = None
  ) -> plan_lib.ZeroPlan:
    """The `ZeroPlan` of this optimizer for `params`.

    A function of the parameters' tree, shapes, dtypes and layouts over the mesh's other
    axes (tensor parallelism), read from `param_specs` or from the arrays.

    Raises:
      ValueError: `params` are traced on Auto mesh axes, where arrays carry no layout, the
        mesh has other axes a layout could use, and no `param_specs` say it.
    """
    if self._layouts_hidden(params):
      others = self._other_axes()
      raise ValueError(
        'zerojax: these parameters are traced on Auto mesh axes, where arrays carry no'
        f' layout, and the mesh splits them over {others} too (tensor parallelism), so'
        ' where each is split cannot be read. Give tx.init the placed parameters outside'
        ' jit (nnx.Optimizer(model, tx, wrt=nnx.Param) does), and the state it returns'
        ' carries their layouts to every update; or give them to the optimizer:'
        ' zero_stage(..., param_specs=zerojax.specs_of(params)) on the placed parameters'
        ' (arrays, nnx.state(model, nnx.Param), or a boxed linen tree); or build the state'
        ' with zerojax.create_train_state or zero_stage(train_state, ...), which record them'
        ' in state.tx.'
      )
    key = self._signature(params)
    cached = self._plans.get(key)
    if cached is not None:
      self._plans.move_to_end(key)
      return cached
    plan = plan_lib.build_plan(params, self, opt_state)
    if not _has_tracers(params):
      self._plans[key] = plan
      while len(self._plans) > _PLAN_CACHE_SIZE:
        self._plans.popitem(last=False)
    return plan

  @property
  def updates_params_on_host(self) -> bool:
    """Offloaded stage-3 parameters: updated in host memory, in the shards they rest in
    (`ZeroUpdate.apply_gradients` makes the new ones there)."""
    return bool(self.options.offload_params) and self.stage == 3

  def _other_axes(self) -> list[str]:
    """The mesh axes of size > 1 that are neither ZeRO nor data-parallel (replica) axes."""
    skip = set(self.axes) | set(self.replica_axes)
    return [a for a in self.mesh.axis_names if a not in skip and self.mesh.shape[a] > 1]

  def _layouts_only_on_arrays(self) -> bool:
    """Whether layouts over other mesh axes can be read only from placed arrays: no
    `param_specs`, Auto axes (traced arrays carry no layout), and other axes to split over."""
    no_types = self.options.param_specs is None and not mesh_lib.any_explicit(self.mesh)
    return no_types and bool(self._other_axes())

  def _layouts_hidden(self, params: Any) -> bool:
    """Whether layouts over other mesh axes may exist but cannot be seen on `params`."""
    return self._layouts_only_on_arrays() and _has_tracers(params)

  def recorded_layouts(self, plan: plan_lib.ZeroPlan) -> layouts_lib.Layouts | None:
    """What `tx.init` records in the state for traced updates to read (`layouts.ZeroState`):
    `plan`'s layouts over the other mesh axes where traced parameters could not show them
    (Auto axes, no `param_specs`, other axes); else None."""
    bound = self.with_layouts_of(plan)
    if bound is self:
      return None
    return layouts_lib.Layouts.of(bound.options.param_specs)

  def with_param_specs(self, specs: Any) -> ZeroConfig:
    """This config with `specs` as its `param_specs` where traced or abstract parameters
    could not show their layouts (Auto axes, no `param_specs`, other axes); else itself."""
    if not self._layouts_only_on_arrays():
      return self
    return dataclasses.replace(self, options=dataclasses.replace(self.options, param_specs=specs))

  def with_declared_layouts(self, params: Any) -> ZeroConfig:
    """This config with the layouts the Flax Variables of `params` declare (their sharding
    metadata) as its `param_specs`, where their arrays cannot show them (traced or unplaced on
    Auto axes beside another axis, no `param_specs`); else itself."""
    if not self._layouts_only_on_arrays():
      return self
    shown = lambda x: (
      not isinstance(x, jax.core.Tracer) and isinstance(getattr(x, 'sharding', None), NamedSharding)
    )
    if all(shown(x) for x in jax.tree.leaves(variables.values_of(params))):
      return self
    specs = variables.declared_specs(params, self.mesh)
    return self if specs is None else self.with_param_specs(specs)

  def with_recorded(self, layouts: layouts_lib.Layouts, params: Any, name: str) -> ZeroConfig:
    """This config with the layouts a state recorded as its `param_specs`, for `params`."""
    return self.with_param_specs(layouts.tree_like(params, name))

  def with_layouts_of(self, plan: plan_lib.ZeroPlan) -> ZeroConfig:
    """This config, with `plan`'s layouts over the other mesh axes as its `param_specs`
    where traced parameters could not show them (Auto axes, no `param_specs`); else itself."""
    if not self._layouts_only_on_arrays():
      return self
    specs = jax.tree.map(
      lambda s: rules.normalize_spec(s.spec, len(s.spec), self.mesh, drop=self.axes), plan.params
    )
    return dataclasses.replace(self, options=dataclasses.replace(self.options, param_specs=specs))

  def _signature(self, tree: Any) -> tuple:
    """(tree structure, (shape, dtype) per leaf, layout per leaf): what a plan depends on.

    Layouts are those over the other mesh axes (tensor parallelism): where the
    ZeRO axes split a leaf is the plan's own output, not an input.
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(
      (tuple(getattr(x, 'shape', ())), str(getattr(x, 'dtype', type(x).__name__))) for x in leaves
    )
    specs = tuple(
      rules.normalize_spec(plan_lib.spec_of(x), len(shape), self.mesh, drop=self.axes)
      for x, (shape, _) in zip(leaves, shapes)
    )
    return treedef, shapes, specs


_PLAN_CACHE_SIZE = 16


def _has_tracers(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


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
    rounding step apart can occur). Called as `tx.update.apply_gradients(grads, opt_state,
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


def plan_for(tx: optax.GradientTransformation, params: optax.Params) -> plan_lib.ZeroPlan:
  """The plan a zero-wrapped optimizer uses for `params`.

  Args:
    tx: a transformation returned by `zerojax.zero_stage`.
    params: the parameters (arrays or ShapeDtypeStructs).

  Raises:
    TypeError: if `tx` was not made by `zero_stage`.
  """
  config = require_config(tx)
  return config.with_declared_layouts(params).plan(params)


def with_layouts(tx: optax.GradientTransformation, plan: plan_lib.ZeroPlan) -> Any:
  """`tx`, holding `plan`'s tensor-parallel layouts as its `param_specs` where traced
  parameters could not show them (`ZeroConfig.with_layouts_of`): what a train state keeps as
  its `tx`, so that its traced steps get the plan that laid it out."""
  config = require_config(tx)
  bound = config.with_layouts_of(plan)
  return tx if bound is config else zero_optimizer(bound)


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
