"""What `tx.init` and `tx.update` say of where the parameters and state they got rest: whole at
stage 3, split over the ZeRO axes by the program itself below it, kept whole as typed on Explicit
axes, or moved out of the plan's layout."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import rules, validation


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


def check_placement(params: Any, plan: plan_lib.ZeroPlan, config: Any) -> None:
  """What `tx.init` says of where the parameters it got are: whole at stage 3, or split over
  the ZeRO axes by the program itself below it."""
  _warn_if_whole_at_stage_3(params, plan, config)
  _check_split_below_stage_3(params, plan, config)


def _check_split_below_stage_3(params: Any, plan: plan_lib.ZeroPlan, config: Any) -> None:
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
    whole_kept = plan_lib.plan_of(dataclasses.replace(config, stage=3), params)
    kept = whole_kept.bytes_per_device()['opt_state']
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


def _warn_if_whole_at_stage_3(params: Any, plan: plan_lib.ZeroPlan, config: Any) -> None:
  """Stage 3 given parameters whole over the ZeRO axes: the first update splits them, and
  until then every device holds all of them. Says so, with the way to place them first."""
  if config.stage != 3:
    return
  whole = []
  for (path, x), want in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(plan.params)
  ):
    sharding = getattr(x, 'sharding', None)
    has = mesh_axes(sharding.spec) if isinstance(sharding, NamedSharding) else set()
    if set(config.axes) & mesh_axes(want.spec) - has:
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


def kept_as_typed(
  plan: plan_lib.ZeroPlan, params: Any, grads: Any, config: Any
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
    have, got = layouts_lib.visible_spec(x, config.mesh), layouts_lib.visible_spec(g, config.mesh)
    split = set(config.axes) & mesh_axes(want.spec)
    whole = have is not None and got is not None
    whole = whole and bool(split - mesh_axes(have)) and bool(split - mesh_axes(got))
    kept.append(NamedSharding(want.mesh, have, memory_kind=want.memory_kind) if whole else want)
  if kept == shardings:
    return plan
  return dataclasses.replace(plan, params=treedef.unflatten(kept))


def mesh_axes(spec: PartitionSpec) -> set[str]:
  return {a for entry in spec for a in rules.spec_axes(entry)}


def check_state_not_replicated(state: Any, plan: plan_lib.ZeroPlan, mesh: Mesh) -> None:
  """Refuses optimizer state that was moved to whole copies on every device.

  The data-parallel recipe (`jax.device_put(state, NamedSharding(mesh, P()))`)
  does that to the sharded state of a model and its optimizer: each device
  then holds all of it, which is what ZeRO exists to avoid.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  bad = []
  for (path, x), want in zip(flat, jax.tree.leaves(plan.opt_state)):
    spec = layouts_lib.visible_spec(x, mesh)
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
