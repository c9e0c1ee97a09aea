"""The update of a zero-wrapped optimizer: its strategies (on the device, on the host, streamed
from the backward pass), mixed_precision's master step on the host, memory moves and padding.

`Core` is what `zero_optimizer`'s `init` and `update` run; every function here is a function of
its inputs (the config, the plan, the trees), and nothing is remembered between calls.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from zerojax._src import compat, placement, streaming, validation, variables
from zerojax._src import frozen as frozen_lib
from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib


def pad(tree: Any, plan: plan_lib.ZeroPlan) -> Any:
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


def unpad(tree: Any, plan: plan_lib.ZeroPlan, like: Any) -> Any:
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


def on_device(shardings: Any) -> Any:
  """The same layouts in device memory."""
  if not _offloaded(shardings):
    return shardings
  return jax.tree.map(lambda s: s.with_memory_kind('device'), shardings)


def to_memory(tree: Any, shardings: Any, *, host: bool) -> Any:
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


def split_extra_args(extra_args: dict, plan: plan_lib.ZeroPlan, mesh: Mesh) -> tuple[dict, dict]:
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


# What the streamed master step returns: the rounded new parameters, written to device memory;
# or, for parameters resting in host memory, the updates to them or the new parameters
# (`optax.apply_updates`'s sum), left there.
MASTER_RETURNS = ('rounded', 'updates', 'params')


def _host_master_step(step, grads, state, params, arrays, others, noted, returns='rounded'):
  """`update_on='stream'` with `mixed_precision`: its master step runs in host memory on the
  host, and only what `returns` names comes back (`MASTER_RETURNS`), in the parameters'
  compute dtype, one leaf at a time.

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
    return (optax.apply_updates(kept, updates) if returns == 'params' else updates), state

  # The new parameters are written straight to device memory. Parameters kept in host memory
  # are read there, and the updates to them are taken in this same computation: a second host
  # computation would hold its input in device memory.
  stay_on_host = returns != 'rounded'
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


def warn_if_update_leaves_host(config: Any, stacklevel: int) -> None:
  """Offloaded stage-3 parameters updated through `tx.update`: the caller's
  `optax.apply_updates` is a second host computation, so the compiler holds the updates, whole
  layer stacks, in device memory for it; says so, and the call that avoids it."""
  if not config.updates_params_on_host:
    return
  warnings.warn(
    'offload_params=True at stage 3: tx.update returns the updates for optax.apply_updates,'
    ' and the compiler holds them, every layer at once, in device memory for that add; the'
    " device's peak then grows with the layer count. Take the new parameters in the update's"
    ' own host computation instead: params, opt_state = zerojax.apply_gradients(tx, grads,'
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


@dataclasses.dataclass(frozen=True)
class Step:
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

  config: Any
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
    _warn_if_not_streamed(grads, params, self.master_step, stacklevel=7)
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
      grads = _constrain_on_device(pad(grads, plan), plan.param_shards, mesh)
      # The optimizer gets a copy of the parameters pinned to their layout at rest: the
      # constraint stops the sharded arithmetic of the update (e.g. weight decay) from
      # propagating back onto the caller's parameters, which would make `params + updates`
      # come out sharded at stage 1-2. The compiler slices what each shard needs from it.
      if params is not None:
        params = mesh_lib.constrain(params, plan.params, mesh)
        if any(plan.padding):
          params = mesh_lib.constrain(pad(params, plan), plan.param_shards, mesh)
    return grads, params

  def gathered(self, updates: Any, like: Any) -> Any:
    """Updates from their shards to the parameters' layout: stages 1-2 all-gather them."""
    mesh = self.config.mesh
    updates = mesh_lib.constrain(updates, self.plan.param_shards, mesh)
    return mesh_lib.constrain(unpad(updates, self.plan, like), on_device(self.plan.params), mesh)


def device_update(step: Step, grads, state, params, arrays, noted):
  """The update on the device; offloaded state streams through device memory for it."""
  plan, mesh = step.plan, step.config.mesh
  state = to_memory(state, plan.opt_state, host=False)
  like = grads
  grads, params = step.to_layout(grads, params)
  updates, state = step.inner.update(grads, state, params, **step.others, **arrays)
  # Stages 1-2 all-gather the updated shards; stage 3 keeps them sharded.
  updates = mesh_lib.constrain(unpad(updates, plan, like), plan.params, mesh)
  state = mesh_lib.constrain(state, on_device(plan.opt_state), mesh)
  return updates, to_memory(state, plan.opt_state, host=True)


def host_update(step: Step, grads, state, params, arrays, noted):
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
  updates = to_memory(step.gathered(updates, like), step.plan.params, host=True)
  return updates, _to_plan_memory(state, step.plan.opt_state)


def streamed_update(step: Step, grads, state, params, arrays, noted):
  """ZeRO-Offload's streamed update: mixed_precision's master step on the host, from gradients
  streamed during the backward pass; the rounded new parameters come back in their shards,
  stages 1-2 all-gather them (in the compute dtype), and the updates are taken on the device.
  Without a master step or `params` it runs as `host_update` (`Step.streamed_parts` says so)."""
  if step.master_step is None or params is None:
    return host_update(step, grads, state, params, arrays, noted)
  plan, mesh = step.plan, step.config.mesh
  grads, params = step.to_layout(grads, params)
  # Offloaded stage-3 parameters are updated where they live: the new ones stay in host
  # memory, in the shards the host computed them in (stages 1-2 gather them on the device).
  stay = step.config.updates_params_on_host
  returns = ('params' if step.applied else 'updates') if stay else 'rounded'
  new, state = _host_master_step(
    step.master_step, grads, state, params, arrays, step.others, noted, returns
  )
  if stay:  # `new`: the updates themselves (or the new parameters), in host memory
    return new, _to_plan_memory(state, plan.opt_state)
  rounded = mesh_lib.constrain(new, plan.param_shards, mesh)
  rounded = mesh_lib.constrain(rounded, on_device(plan.params), mesh)
  rounded = to_memory(rounded, plan.params, host=True)
  return updates_to(rounded, params), _to_plan_memory(state, plan.opt_state)


def frozen_update(
  strategy, full: plan_lib.ZeroPlan, step: Step, grads, state, params, arrays, noted
):
  """`strategy` on the trainable leaves alone (`step.plan` is `full.trainable_part()`): the
  frozen leaves' gradients are not read, so a jitted step neither computes nor reduces them, and
  their update is zero (or, with `applied`, their new parameters are the old ones)."""
  frozen = full.frozen
  prune = functools.partial(frozen_lib.prune, frozen=frozen)
  kept = None if noted is None else frozen_lib.trained(noted, frozen)
  out, state = strategy(step, prune(grads), state, prune(params), arrays, kept)
  if step.applied:
    return frozen_lib.fill(out, params, frozen, frozen_lib.frozen_of(params, frozen)), state
  mesh = step.config.mesh
  zeros = [
    to_memory(mesh_lib.constrain(jnp.zeros(g.shape, g.dtype), on_device(s), mesh), s, host=True)
    for g, s in zip(frozen_lib.frozen_of(grads, frozen), frozen_lib.frozen_of(full.params, frozen))
  ]
  return frozen_lib.fill(out, grads, frozen, zeros), state


@dataclasses.dataclass(frozen=True)
class Core:
  """What a zero-wrapped optimizer's `init` and `update` run: the config, the wrapped optax
  transformation (with extra-args support), mixed_precision's master step (or None), and where
  the update runs (`STRATEGIES[options.update_on]`, chosen once)."""

  config: Any
  inner: optax.GradientTransformationExtraArgs
  master_step: Any

  @classmethod
  def of(cls, config: Any) -> Core:
    # mixed_precision's update up to the rounded new parameters, for update_on='stream'
    # (a field of its update, `precision.MixedPrecisionUpdate`).
    master_step = getattr(getattr(config.inner, 'update', None), 'master_step', None)
    return cls(config, optax.with_extra_args_support(config.inner), master_step)

  def init(self, params: optax.Params) -> optax.OptState:
    config, mesh = self.config, self.config.mesh
    given = params
    params = variables.checked_values(params)
    validation.abstract_arrays(params, 'params')
    plan = plan_lib.plan_of(config, params, layouts=layouts_lib.resolve(config, given))
    # Frozen leaves (`Options.trainable`) are pruned: the wrapped optimizer's state is of the
    # trainable ones alone.
    part, frozen = plan.trainable_part(), plan.frozen or None

    def body(p):
      state = self.inner.init(pad(frozen_lib.prune(p, frozen), part))
      state = mesh_lib.constrain(state, on_device(plan.opt_state), mesh)
      return to_memory(state, plan.opt_state, host=True)

    body = mesh_lib.run_in_layout(body, mesh, plan.opt_state)
    traced = layouts_lib.any_traced(params)
    if traced:
      state = body(params)
    else:
      placement.check_placement(params, plan, config)
      # Created directly in its layout: each device computes only its shards.
      state = jax.jit(body, out_shardings=plan.opt_state)(params)
    if variables.has_variables(given):
      # Given Flax Variables, the state is made of them, its layout in their metadata; at stage 3
      # the parameters' own metadata is told their split (see `variables`).
      if config.stage == 3 and not traced:
        variables.record_layouts(given, plan.params)
      state = variables.state_in_variables(state, plan.opt_state)
    # Placed parameters show their layouts over a tensor-parallel axis; traced ones on Auto
    # axes do not, so the state carries them to every update (`layouts.ZeroState`).
    recorded = layouts_lib.record_of(config, plan)
    return state if recorded is None else layouts_lib.ZeroState(state, recorded)

  def update(self, updates, state, params, extra_args: dict, *, applied: bool):
    """One update: `(updates, state)`, or with `applied` `(new_params, state)`. The layouts are
    resolved once, here, from the caller's trees (Flax Variables included); the update runs on
    their values and answers in the caller's form."""
    pure = [variables.values_of(t) for t in (updates, state, params)]
    validation.abstract_arrays(pure[0], 'grads')
    if params is not None:
      validation.check_like_params(pure[0], pure[2], 'grads')
    like, name = (params, 'params') if params is not None else (updates, 'grads')
    record = state.layouts if isinstance(state, layouts_lib.ZeroState) else None
    layouts = layouts_lib.resolve(self.config, like, record, name)
    out, new_state = self.pure_update(layouts, *pure, extra_args, applied)
    if not variables.has_variables(updates, state, params):
      return out, new_state
    out = variables.wrapped_like(out, params if applied else updates)
    return out, variables.wrapped_like(new_state, state)

  def pure_update(self, layouts, updates, state, params, extra_args, applied):
    """The update on arrays (no Flax Variables), the inputs checked and the layouts resolved."""
    if not isinstance(state, layouts_lib.ZeroState):
      return self.run(layouts, updates, state, params, extra_args, applied)
    # A state that carries its parameters' layouts: the record is passed on unchanged.
    if self.config.stage == 0 and self.config.options.offload is None:
      # Stage 0 splits nothing over the ZeRO axes: the wrapped optimizer as it is, so the
      # compiler lays the state out over the other axes as it would without zerojax (pinned
      # whole there, an unannotated embedding's moments would hold more).
      frozen = layouts.frozen
      pruned = [frozen_lib.prune(t, frozen) for t in (updates, params)]
      out, inner = self.inner.update(pruned[0], state.inner, pruned[1], **extra_args)
      zeros = [jnp.zeros_like(g) for g in frozen_lib.frozen_of(updates, frozen)]
      out = frozen_lib.fill(out, updates, frozen, zeros)
    else:
      out, inner = self.run(layouts, updates, state.inner, params, extra_args, applied)
    return out, layouts_lib.ZeroState(inner, state.layouts)

  def run(self, layouts, updates, state, params, extra_args, applied=False):
    config, mesh = self.config, self.config.mesh
    tree = params if params is not None else updates
    plan = plan_lib.plan_of(config, tree, layouts=layouts, opt_state=state)
    plan = placement.kept_as_typed(plan, params, updates, config)
    part = plan.trainable_part()
    placement.check_state_not_replicated(state, part, mesh)
    arrays, others = split_extra_args(extra_args, part, mesh)
    step = Step(config, self.inner, self.master_step, part, others, applied)
    noted = step.streamed_parts(updates, params)
    strategy = STRATEGIES[config.options.update_on]
    if part is not plan:  # frozen leaves: the strategy runs on the trainable ones
      strategy = functools.partial(frozen_update, strategy, plan)
    body = mesh_lib.run_in_layout(
      functools.partial(strategy, step), mesh, (plan.params, plan.opt_state)
    )
    return body(updates, state, params, arrays, noted)


# Where the update runs: on the device, on the host, or on the host from gradients streamed
# during the backward pass.
STRATEGIES = {'device': device_update, 'host': host_update, 'stream': streamed_update}
