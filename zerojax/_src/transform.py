"""`zero_optimizer`: an optax transformation rewritten for a ZeRO stage."""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax._src import compat, rules, streaming, validation, variables
from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import options as options_lib
from zerojax._src import plan as plan_lib


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


def _pad(tree: Any, plan: plan_lib.ZeroPlan) -> Any:
  """Zero-pads the leaves that the plan pads (policy='pad') to their padded size."""
  if not any(plan.padding):
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for x, pad in zip(leaves, plan.padding):
    if pad is not None:
      dim, size = pad
      widths = [(0, 0)] * x.ndim
      widths[dim] = (0, size - x.shape[dim])
      x = jnp.pad(x, widths)
    out.append(x)
  return jax.tree.unflatten(treedef, out)


def _unpad(tree: Any, plan: plan_lib.ZeroPlan, like: Any) -> Any:
  """Slices padded leaves back to the shapes of `like`."""
  if not any(plan.padding):
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  sizes = [x.shape for x in jax.tree.leaves(like)]
  out = [
    x if pad is None else jax.lax.slice_in_dim(x, 0, shape[pad[0]], axis=pad[0])
    for x, pad, shape in zip(leaves, plan.padding, sizes)
  ]
  return jax.tree.unflatten(treedef, out)


def _offloaded(shardings: Any) -> bool:
  return any(s.memory_kind == plan_lib.HOST for s in jax.tree.leaves(shardings))


def _on_device(shardings: Any) -> Any:
  """The same layouts in device memory."""
  if not _offloaded(shardings):
    return shardings
  return jax.tree.map(lambda s: s.with_memory_kind('device'), shardings)


def _to_memory(tree: Any, shardings: Any, *, host: bool) -> Any:
  """Moves the leaves that `shardings` offloads to host (or device) memory, inside jit."""
  if not _offloaded(shardings):
    return tree

  def one(x, s):
    if s.memory_kind != plan_lib.HOST:
      return x
    # Runs where Auto-axis constraints are legal (see mesh.run_in_layout).
    target = NamedSharding(
      mesh_lib.auto_mesh(s.mesh), s.spec, memory_kind=plan_lib.HOST if host else 'device'
    )
    return jax.device_put(x, target)

  return jax.tree.map(one, tree, shardings)


def _move(tree: Any, space: Any) -> Any:
  return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def _split_extra_args(extra_args: dict, plan: plan_lib.ZeroPlan, mesh: Mesh) -> tuple[dict, dict]:
  """Extra args as (array trees, the rest), ready for the update's layout region.

  On a mesh with Explicit axes the update body runs under `auto_axes`: array
  extras (`value`, `grad`) enter it as arguments, so their types follow, and a
  callable extra (`value_fn` of line searches) is called back in Explicit
  mode on parameters laid out as at rest, as the caller wrote it.
  """
  arrays, others = {}, {}
  for name, value in extra_args.items():
    leaves = jax.tree.leaves(value)
    if leaves and all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves):
      arrays[name] = value
    elif callable(value) and mesh_lib.any_explicit(mesh):
      others[name] = _explicit_callback(value, plan)
    else:
      others[name] = value
  return arrays, others


def _explicit_callback(fn: Any, plan: plan_lib.ZeroPlan) -> Any:
  specs = jax.tree.map(lambda s: s.spec, plan.params)

  def call(params, *args, **kwargs):
    return jax.sharding.explicit_axes(lambda p: fn(p, *args, **kwargs), in_sharding=(specs,))(
      params
    )

  return call


def _update_on_host(inner, grads, state, params, extra_args, applied=False):
  """Runs `inner.update` in host memory on the host (`compute_type='device_host'`); with
  `applied`, the new parameters (`optax.apply_updates`) in the same computation, left in
  host memory (a second host computation would hold its input in device memory)."""
  host = jax.memory.Space.Host

  def update(grads, state, params):
    updates, state = inner.update(grads, state, params, **extra_args)
    return (optax.apply_updates(params, updates) if applied else updates), state

  run = compat.compute_on_host(update, out_memory_spaces=host)
  out, state = run(_move(grads, host), _move(state, host), _move(params, host))
  return (out if applied else _move(out, jax.memory.Space.Device)), state


def _host_master_step(
  step, grads, state, params, arrays, others, noted, stay_on_host=False, applied=False
):
  """`update_on='stream'` with `mixed_precision`: its master step runs in host memory on the
  host, and only the new parameters come back, in their compute dtype, one leaf at a time
  (`stay_on_host`: the updates to `params`, which are in host memory, stay there instead;
  with `applied` too, `params` plus those updates, as `optax.apply_updates` adds them).

  Streamed gradients that `value_and_grad` noted (`noted`, per leaf) are finished
  from their micro-batch parts in this same host computation: an output of a
  host computation that another one reads is kept in device memory. The master
  step does not read the compute-dtype parameters, so they never go down; the
  updates are taken from them on the device.
  """
  host = jax.memory.Space.Host
  dtypes = jax.tree.map(lambda p: p.dtype, params)
  leaves, treedef = jax.tree.flatten(grads)
  hows = [n for n in noted if n is not None]
  sources = [g if n is None else None for g, n in zip(leaves, noted)]

  def update(sources, parts, weights, state, arrays, kept):
    found = iter(zip(hows, parts, weights))
    flat = [streaming.finish(*next(found)) if g is None else g for g in sources]
    rounded, state = step(jax.tree.unflatten(treedef, flat), state, dtypes, **others, **arrays)
    if kept is None:
      return rounded, state
    updates = updates_to(rounded, kept)
    return (optax.apply_updates(kept, updates) if applied else updates), state

  # The new parameters are written straight to device memory. Parameters kept in host memory
  # (`stay_on_host`) are read there, and the updates to them are taken in this same
  # computation: a second host computation would hold its input in device memory.
  space = host if stay_on_host else jax.memory.Space.Device
  run = compat.compute_on_host(update, out_memory_spaces=(space, host))
  return run(
    _move(sources, host),
    [n.parts for n in hows],
    [n.weight for n in hows],
    _move(state, host),
    _move(arrays, host),
    params if stay_on_host else None,
  )


def updates_to(rounded: Any, params: Any) -> Any:
  """The updates that turn `params` into `rounded` (mixed_precision's master in their dtype).

  In the compute dtype, so stages 1-2 all-gather 2 bytes per parameter:
  `params + updates` is `rounded` exactly when a value moved by less than 2x
  (Sterbenz), else to within a rounding step of the old value (values
  crossing or near zero). `mixed_precision`'s update and the streamed one
  both take them so.
  """
  return jax.tree.map(lambda r, p: (r - p).astype(p.dtype), rounded, params)


def _warn_if_not_streamed(grads: Any, params: Any, master_step: Any, stacklevel: int) -> None:
  """update_on='stream' given what cannot stream: says what runs instead, and the fix."""
  if master_step is None or params is None:
    warnings.warn(
      "update_on='stream' sends back only the new parameters through the master step of"
      ' zerojax.mixed_precision, which this optimizer does not have'
      + (' (or update() was called without params)' if master_step is not None else '')
      + ". The update runs as with update_on='host': updates come back in full. Wrap the"
      ' optimizer as zero_stage(zerojax.mixed_precision(tx), ...) and pass params to update().',
      stacklevel=stacklevel,
    )
  elif not any(in_host_memory(g) for g in jax.tree.leaves(grads)):
    warnings.warn(
      "update_on='stream': every gradient arrived in device memory, so none was streamed"
      " during the backward pass; they go to host memory at once, as with update_on='host'."
      ' Take them with zerojax.value_and_grad(loss_fn, tx, per_layer=True) at stage 2 or 3'
      ' to stream them layer by layer.',
      stacklevel=stacklevel,
    )


def _warn_if_update_leaves_host(config: ZeroConfig, stacklevel: int) -> None:
  """Offloaded stage-3 parameters updated through `tx.update`: the caller's
  `optax.apply_updates` is a second host computation, so the compiler holds the updates, whole
  layer stacks, in device memory for it; says so, and the call that avoids it."""
  if not config.updates_params_on_host:
    return
  warnings.warn(
    'offload_params=True at stage 3: tx.update returns the updates for optax.apply_updates,'
    ' and the compiler holds them, every layer at once, in device memory for that add; the'
    " device's peak then grows with the layer count. Take the new parameters in the update's"
    ' own host computation instead: params, opt_state = tx.update.apply_gradients(grads,'
    ' opt_state, params) (a train state from zerojax.create_train_state does this in'
    ' state.apply_gradients; for Flax NNX, zerojax.nnx.Optimizer in place of nnx.Optimizer).',
    stacklevel=stacklevel,
  )


def in_host_memory(x: Any) -> bool:
  """Whether traced `x` lives in host memory (a streamed gradient)."""
  return getattr(jax.typeof(x), 'memory_space', None) == jax.memory.Space.Host


def _constrain_on_device(tree: Any, shardings: Any, mesh: Mesh) -> Any:
  """`mesh_lib.constrain` for the leaves in device memory; streamed ones (in host memory,
  already in their shards' layout) are left where they are."""
  leaves, treedef = jax.tree.flatten(tree)
  if not any(in_host_memory(x) for x in leaves):
    return mesh_lib.constrain(tree, shardings, mesh)
  out = [
    x if in_host_memory(x) else mesh_lib.constrain(x, s, mesh)
    for x, s in zip(leaves, jax.tree.leaves(shardings))
  ]
  return jax.tree.unflatten(treedef, out)


def _to_plan_memory(tree: Any, shardings: Any) -> Any:
  """Leaves computed in host memory go back to device memory unless the plan offloads them."""
  return jax.tree.map(
    lambda x, s: (
      x if s.memory_kind == plan_lib.HOST else jax.device_put(x, jax.memory.Space.Device)
    ),
    tree,
    shardings,
  )


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
  """

  config: ZeroConfig
  fn: Callable[..., tuple[optax.Updates, optax.OptState]]

  def __call__(self, updates, state, params=None, **extra_args):
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
    return self.fn(grads, state, params, _applied=True, **extra_args)


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
  return config.plan(params)


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
  """Rewrites `config.inner` for its ZeRO stage; see `zerojax.zero_stage`."""
  inner = optax.with_extra_args_support(config.inner)
  # mixed_precision's update up to the rounded new parameters, for update_on='stream'
  # (a field of its update, `precision.MixedPrecisionUpdate`).
  master_step = getattr(getattr(config.inner, 'update', None), 'master_step', None)
  # Where the update runs is chosen once: on the device, on the host, or on the host from
  # gradients streamed during the backward pass.
  strategy = {'device': _device_update, 'host': _host_update, 'stream': _streamed_update}[
    config.options.update_on
  ]
  mesh = config.mesh

  def init(params: optax.Params) -> optax.OptState:
    given = params
    params = variables.checked_values(params)
    validation.abstract_arrays(params, 'params')
    wrapped = variables.has_variables(given)
    bound = config.with_declared_layouts(given) if wrapped else config
    plan = bound.plan(params)

    def body(p):
      state = mesh_lib.constrain(inner.init(_pad(p, plan)), _on_device(plan.opt_state), mesh)
      return _to_memory(state, plan.opt_state, host=True)

    body = mesh_lib.run_in_layout(body, mesh, plan.opt_state)
    traced = _has_tracers(params)
    if traced:
      state = body(params)
    else:
      _check_placement(params, plan, config)
      # Created directly in its layout: each device computes only its shards.
      state = jax.jit(body, out_shardings=plan.opt_state)(params)
    if wrapped:
      # Given Flax Variables, the state is made of them, its layout in their metadata; at stage 3
      # the parameters' own metadata is told their split (see `variables`).
      if config.stage == 3 and not traced:
        variables.record_layouts(given, plan.params)
      state = variables.state_in_variables(state, plan.opt_state)
    # Placed parameters show their layouts over a tensor-parallel axis; traced ones on Auto
    # axes do not, so the state carries them to every update (`layouts.ZeroState`).
    recorded = bound.recorded_layouts(plan)
    return state if recorded is None else layouts_lib.ZeroState(state, recorded)

  def update(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    _applied: bool = False,
    **extra_args: Any,
  ) -> tuple[optax.Updates, optax.OptState]:
    if not _applied:
      _warn_if_update_leaves_host(config, stacklevel=3)
    if not variables.has_variables(updates, state, params):
      return pure_update(config, updates, state, params, extra_args, _applied)
    # Flax Variables: the update runs on their values, and answers in the caller's form.
    bound = config.with_declared_layouts(params if params is not None else updates)
    out, new_state = pure_update(
      bound,
      variables.values_of(updates),
      variables.values_of(state),
      variables.values_of(params),
      extra_args,
      _applied,
    )
    out = variables.wrapped_like(out, params if _applied else updates)
    return out, variables.wrapped_like(new_state, state)

  def pure_update(bound, updates, state, params, extra_args, applied):
    validation.abstract_arrays(updates, 'grads')
    if params is not None:
      validation.check_like_params(updates, params, 'grads')
    if isinstance(state, layouts_lib.ZeroState):
      return _recorded_update(bound, inner, run, updates, state, params, extra_args, applied)
    return run(bound, updates, state, params, extra_args, applied)

  def run(bound, updates, state, params, extra_args, applied=False):
    plan = bound.plan(params if params is not None else updates, opt_state=state)
    plan = _kept_as_typed(plan, params, updates, bound)
    _check_state_not_replicated(state, plan, mesh)
    arrays, others = _split_extra_args(extra_args, plan, mesh)
    step = _Step(bound, inner, master_step, plan, others, applied)
    noted = step.streamed_parts(updates, params)
    body = mesh_lib.run_in_layout(
      functools.partial(strategy, step), mesh, (plan.params, plan.opt_state)
    )
    return body(updates, state, params, arrays, noted)

  return optax.GradientTransformationExtraArgs(init, ZeroUpdate(config, update))


@dataclasses.dataclass(frozen=True)
class _Step:
  """What one update of a zero-wrapped optimizer runs with (the strategies' first argument).

  Attributes:
    config: the optimizer's `ZeroConfig`.
    inner: the wrapped optax transformation (with extra-args support).
    master_step: `mixed_precision`'s master step, or None.
    plan: the plan of these parameters.
    others: the extra args that are not arrays (callables, numbers).
    applied: return the new parameters, not the updates (`ZeroUpdate.apply_gradients`, where
      it `fuses`).
  """

  config: ZeroConfig
  inner: optax.GradientTransformationExtraArgs
  master_step: Any
  plan: plan_lib.ZeroPlan
  others: dict
  applied: bool = False

  def streamed_parts(self, grads: Any, params: Any) -> list | None:
    """With update_on='stream': the parts each gradient was finished from (per leaf, None
    where it was not streamed), after warning where nothing can stream."""
    if self.config.options.update_on != 'stream':
      return None
    _warn_if_not_streamed(grads, params, self.master_step, stacklevel=5)
    return streaming.take(jax.tree.leaves(grads))

  def to_layout(self, grads: Any, params: Any) -> tuple[Any, Any]:
    """Gradients reduced into the stage's layout, then into the shards each device updates;
    parameters pinned to their layout at rest (padded where the plan pads)."""
    plan, mesh, stage = self.plan, self.config.mesh, self.config.stage
    # From stage 2 the compiler emits a reduce-scatter here (XLA:CPU: all-reduce +
    # dynamic-slice). Stage 1 goes straight to the shards its update reads: gradients that
    # arrive reduce-scattered (zerojax.value_and_grad) stay so, and ones that arrive
    # unreduced are reduced into shards, not first into whole copies.
    if stage != 1:
      grads = _constrain_on_device(grads, plan.grads, mesh)
    if stage >= 1:
      grads = _constrain_on_device(_pad(grads, plan), plan.param_shards, mesh)
      # The optimizer gets a copy of the parameters pinned to their layout at rest: the
      # constraint stops the sharded arithmetic of the update (e.g. weight decay) from
      # propagating back onto the caller's parameters, which would make `params + updates`
      # come out sharded at stage 1-2. The compiler slices what each shard needs from it.
      if params is not None:
        params = mesh_lib.constrain(params, plan.params, mesh)
        if any(plan.padding):
          params = mesh_lib.constrain(_pad(params, plan), plan.param_shards, mesh)
    return grads, params

  def gathered(self, updates: Any, like: Any) -> Any:
    """Updates from their shards to the parameters' layout: stages 1-2 all-gather them."""
    mesh = self.config.mesh
    updates = mesh_lib.constrain(updates, self.plan.param_shards, mesh)
    return mesh_lib.constrain(_unpad(updates, self.plan, like), _on_device(self.plan.params), mesh)


def _device_update(step: _Step, grads, state, params, arrays, noted):
  """The update on the device; offloaded state streams through device memory for it."""
  plan, mesh = step.plan, step.config.mesh
  state = _to_memory(state, plan.opt_state, host=False)
  like = grads
  grads, params = step.to_layout(grads, params)
  updates, state = step.inner.update(grads, state, params, **step.others, **arrays)
  # Stages 1-2 all-gather the updated shards; stage 3 keeps them sharded.
  updates = mesh_lib.constrain(_unpad(updates, plan, like), plan.params, mesh)
  state = mesh_lib.constrain(state, _on_device(plan.opt_state), mesh)
  return updates, _to_memory(state, plan.opt_state, host=True)


def _host_update(step: _Step, grads, state, params, arrays, noted):
  """ZeRO-Offload's CPU update: gradient shards go to host memory, the optimizer runs there
  on the offloaded state, and only the updates come back; the state never occupies device
  memory. The updates are pinned to the shards they were computed in, so the all-gather of
  stages 1-2 runs on the device, not inside the host computation."""
  like = grads
  grads, params = step.to_layout(grads, params)
  extra_args = {**step.others, **arrays}
  if step.applied and step.config.updates_params_on_host:
    # The new parameters are made where they rest, in the host computation itself.
    new, state = _update_on_host(step.inner, grads, state, params, extra_args, applied=True)
    return new, _to_plan_memory(state, step.plan.opt_state)
  updates, state = _update_on_host(step.inner, grads, state, params, extra_args)
  updates = _to_memory(step.gathered(updates, like), step.plan.params, host=True)
  return updates, _to_plan_memory(state, step.plan.opt_state)


def _streamed_update(step: _Step, grads, state, params, arrays, noted):
  """ZeRO-Offload's streamed update: mixed_precision's master step on the host, from gradients
  streamed during the backward pass; the rounded new parameters come back in their shards,
  stages 1-2 all-gather them (in the compute dtype), and the updates are taken on the device.
  Without a master step or `params` it runs as `_host_update` (`_Step.streamed_parts` says so)."""
  if step.master_step is None or params is None:
    return _host_update(step, grads, state, params, arrays, noted)
  plan, mesh = step.plan, step.config.mesh
  grads, params = step.to_layout(grads, params)
  # Offloaded stage-3 parameters are updated where they live: the new ones stay in host
  # memory, in the shards the host computed them in (stages 1-2 gather them on the device).
  stay = step.config.updates_params_on_host
  new, state = _host_master_step(
    step.master_step,
    grads,
    state,
    params,
    arrays,
    step.others,
    noted,
    stay_on_host=stay,
    applied=step.applied,
  )
  if stay:  # `new`: the updates themselves (or the new parameters), in host memory
    return new, _to_plan_memory(state, plan.opt_state)
  rounded = mesh_lib.constrain(new, plan.param_shards, mesh)
  rounded = mesh_lib.constrain(rounded, _on_device(plan.params), mesh)
  rounded = _to_memory(rounded, plan.params, host=True)
  return updates_to(rounded, params), _to_plan_memory(state, plan.opt_state)


def _recorded_update(config, inner, run, updates, state, params, extra_args, applied=False):
  """The update of a state that carries its parameters' layouts (`layouts.ZeroState`): `run`
  (the update's body) with the config told those layouts, the record passed on unchanged
  (`applied`: the new parameters in place of the updates, at stage 3)."""
  if config.stage == 0 and config.options.offload is None:
    # Stage 0 splits nothing over the ZeRO axes: the wrapped optimizer as it is, so the
    # compiler lays the state out over the other axes as it would without zerojax (pinned
    # whole there, an unannotated embedding's moments would hold more).
    updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
  else:
    like, name = (params, 'params') if params is not None else (updates, 'grads')
    bound = config.with_recorded(state.layouts, like, name)
    updates, inner_state = run(bound, updates, state.inner, params, extra_args, applied)
  return updates, layouts_lib.ZeroState(inner_state, state.layouts)


def split_by_the_program(params: Any, plan: plan_lib.ZeroPlan) -> list[tuple]:
  """(path, leaf, its spec, the plan's NamedSharding) of each placed leaf that rests split over
  the plan's ZeRO axes where the plan keeps it whole over them (a program's own FSDP)."""
  axes = set(plan.axes)
  splits = lambda spec: any(axes & set(rules.spec_axes(e)) for e in spec)
  found = []
  for (path, x), target in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(plan.params)
  ):
    spec = getattr(getattr(x, 'sharding', None), 'spec', None)
    if spec is not None and splits(spec) and not splits(target.spec):
      found.append((f'params{jax.tree_util.keystr(path)}', x, spec, target))
  return found


def _check_placement(params: Any, plan: plan_lib.ZeroPlan, config: ZeroConfig) -> None:
  """What `tx.init` says of where the parameters it got are: whole at stage 3, or split over
  the ZeRO axes by the program itself below it."""
  _warn_if_whole_at_stage_3(params, plan, config)
  _check_split_below_stage_3(params, plan, config)


def _check_split_below_stage_3(params: Any, plan: plan_lib.ZeroPlan, config: ZeroConfig) -> None:
  """The optimizer line given parameters a program already splits over the ZeRO axes (its own
  FSDP). Stage 0 would make their optimizer state whole on every device: refused, as for a train
  state. Stages 1-2 split only what the program splits already: said once, with stage 3."""
  if config.stage == 3:
    return
  split = [path for path, *_ in split_by_the_program(params, plan)]
  if not split:
    return
  on = config.axes[0] if len(config.axes) == 1 else config.axes
  got = (
    f'zerojax.zero_stage(tx, {config.stage}): tx.init got'
    f' {validation.count(len(split), "parameter", "parameters")} already split over {on!r}'
    f' ({validation.listed(split)}), as FSDP lays them out'
  )
  if config.stage == 0:
    whole = plan.bytes_per_device()['opt_state']
    kept = dataclasses.replace(config, stage=3).plan(params).bytes_per_device()['opt_state']
    raise ValueError(
      f'{got}; stage 0 keeps the optimizer state whole on every device, which would raise it'
      f' from {plan_lib.fmt_bytes(kept)} (split as the parameters are) to'
      f' {plan_lib.fmt_bytes(whole)} per device. Use stage 3, which keeps parameters and state'
      ' split and gathers the parameters where they are used; or, to hold them whole on'
      ' purpose, place the parameters replicated (jax.device_put(params, NamedSharding(mesh,'
      ' P()))) first.'
    )
  grads = ' and the gradients' if config.stage == 2 else ''
  warnings.warn(
    f'{got}. Stage {config.stage} splits the optimizer state{grads} over it and leaves the'
    " parameters' layout to the program; on a layout already split so, stage 3 is its ZeRO"
    ' (parameters, gradients and state split, the parameters gathered where they are used).',
    stacklevel=4,
  )


def _warn_if_whole_at_stage_3(params: Any, plan: plan_lib.ZeroPlan, config: ZeroConfig) -> None:
  """Stage 3 given parameters whole over the ZeRO axes: the first update splits them, and
  until then every device holds all of them. Says so, with the way to place them first."""
  if config.stage != 3:
    return
  whole = []
  for (path, x), want in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(plan.params)
  ):
    sharding = getattr(x, 'sharding', None)
    has = _mesh_axes(sharding.spec) if isinstance(sharding, NamedSharding) else set()
    if set(config.axes) & _mesh_axes(want.spec) - has:
      whole.append(f'params{jax.tree_util.keystr(path)}')
  if not whole:
    return
  shown = validation.listed(whole)
  got = f'tx.init got {len(whole)} parameters whole over the ZeRO axes {config.axes} ({shown})'
  if mesh_lib.any_explicit(config.mesh):
    # On Explicit axes the split is in the parameters' types: a model that reads them as
    # they are would stop at its next step with JAX's own ShardingTypeError, so they stay so.
    message = (
      f'zero_stage(stage=3) on Explicit mesh axes: {got}. Updated with gradients that arrive'
      ' whole too (jax or nnx differentiating a model that reads them as typed), they stay'
      ' whole, the saving of stage 2: split, their types would say so and such a model would'
      " stop with JAX's ShardingTypeError. The optimizer state is split. For stage 3's saving,"
      ' place them split first (zerojax.nnx.shard(model, tx) or zerojax.nnx.create_model,'
      ' zerojax.create_train_state) and read them through zerojax.nnx.gathered(model, tx) (or'
      ' zerojax.gather(params, tx)) in the loss.'
    )
  else:
    message = (
      f'zero_stage(stage=3): {got}. The optimizer state is split from now on, and the first'
      ' update returns the parameters split, but until then every device holds all of them.'
      ' To hold 1/N from the start, place them first: zerojax.nnx.shard(model, tx) (or create'
      ' the model with zerojax.nnx.create_model), zerojax.create_train_state, or'
      ' jax.device_put(params, zerojax.plan_for(tx, params).params).'
    )
  warnings.warn(message, stacklevel=4)


def _kept_as_typed(
  plan: plan_lib.ZeroPlan, params: Any, grads: Any, config: ZeroConfig
) -> plan_lib.ZeroPlan:
  """`plan`, returning whole the stage-3 parameters typed whole over the ZeRO axes on Explicit
  axes whose gradients arrive whole too: the framework's own gradient of a model that reads
  its parameters as typed (the optimizer line alone, no `zerojax.nnx.shard`). Split, their
  types would say so and that model would stop at its next step with JAX's
  ShardingTypeError. Their state is split all the same; `tx.init` warned. Gradients that
  arrive split (`zerojax.value_and_grad`'s reduce-scatter) split them."""
  if config.stage != 3 or params is None or not mesh_lib.any_explicit(config.mesh):
    return plan
  is_sharding = lambda s: isinstance(s, NamedSharding)
  shardings, treedef = jax.tree.flatten(plan.params, is_leaf=is_sharding)
  kept = []
  for x, g, want in zip(jax.tree.leaves(params), jax.tree.leaves(grads), shardings):
    have, got = _visible_spec(x, config.mesh), _visible_spec(g, config.mesh)
    split = set(config.axes) & _mesh_axes(want.spec)
    whole = have is not None and got is not None
    whole = whole and bool(split - _mesh_axes(have)) and bool(split - _mesh_axes(got))
    kept.append(NamedSharding(want.mesh, have, memory_kind=want.memory_kind) if whole else want)
  if kept == shardings:
    return plan
  return dataclasses.replace(plan, params=treedef.unflatten(kept))


def _mesh_axes(spec: PartitionSpec) -> set[str]:
  return {a for entry in spec for a in rules.spec_axes(entry)}


def _visible_spec(x: Any, mesh: Mesh) -> PartitionSpec | None:
  """The layout of `x` where it can be seen: a placed array, or a traced one whose type
  carries it (Explicit axes). Traced on Auto axes, the layout is not known yet."""
  if isinstance(x, jax.core.Tracer):
    return jax.typeof(x).sharding.spec if mesh_lib.any_explicit(mesh) else None
  sharding = getattr(x, 'sharding', None)
  return sharding.spec if isinstance(sharding, NamedSharding) else None


def _check_state_not_replicated(state: Any, plan: plan_lib.ZeroPlan, mesh: Mesh) -> None:
  """Refuses optimizer state that was moved to whole copies on every device.

  The data-parallel recipe (`jax.device_put(state, NamedSharding(mesh, P()))`)
  does that to the sharded state of a model and its optimizer: each device
  then holds all of it, which is what ZeRO exists to avoid.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  bad = []
  for (path, x), want in zip(flat, jax.tree.leaves(plan.opt_state)):
    spec = _visible_spec(x, mesh)
    if spec is not None and not any(spec) and any(want.spec):
      bad.append(f'opt_state{jax.tree_util.keystr(path)}')
  if bad:
    shown = validation.listed(bad, most=4)
    raise ValueError(
      f'The optimizer state is replicated on every device ({shown}), where stage'
      f' {plan.stage} splits it over {plan.axes}: it was moved out of its ZeRO layout, e.g. by'
      ' jax.device_put(state, NamedSharding(mesh, P())) as in the plain data-parallel recipe.'
      ' Leave the model and optimizer state where zerojax placed them, and device_put only'
      ' the batch.'
    )
