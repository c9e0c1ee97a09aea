"""Flax train states laid out for a ZeRO stage."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import optax

from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import options as options_lib
from zerojax._src import placement, precision, rules, transform, validation
from zerojax._src import plan as plan_lib

State = TypeVar('State')


@functools.cache
def fused_train_state() -> type:
  """flax's `TrainState` whose `apply_gradients` takes offloaded stage-3 parameters from their
  zero-wrapped optimizer in one call (`zerojax.apply_gradients`), made where they rest, in
  host memory; any other state updates as flax's does. The default class of
  `create_train_state`."""
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
  from flax.training import train_state as flax_train_state

  class TrainState(flax_train_state.TrainState):
    """flax's `TrainState`; `apply_gradients` updates offloaded stage-3 parameters in one
    call (`zerojax.apply_gradients`), so they never come to the device whole."""

    def apply_gradients(self, *, grads, **kwargs):
      update = getattr(self.tx, 'update', None)
      # fp8's overwritten values (flax's OVERWRITE_WITH_GRADIENT) take flax's own path.
      fp8 = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
      if not isinstance(update, transform.ZeroUpdate) or fp8 or not update.fuses:
        return super().apply_gradients(grads=grads, **kwargs)
      params, opt_state = transform.apply_gradients(self.tx, grads, self.opt_state, self.params)
      return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)

  return TrainState


def is_train_state(obj: Any) -> bool:
  """Whether `obj` looks like a flax TrainState (params, opt_state and tx fields)."""
  return all(hasattr(obj, f) for f in ('params', 'opt_state', 'tx', 'replace'))


def checked_tx(state: Any) -> Any:
  """The optimizer of a train state, checked to be an optax transformation.

  Raises:
    TypeError: `state.tx` is not an optax transformation.
  """
  if not transform.is_transformation(state.tx):
    raise TypeError(
      f'`train_state.tx` must be an optax GradientTransformation, got'
      f' {type(state.tx).__name__}: {state.tx!r:.80}. Create the state with'
      ' TrainState.create(apply_fn=..., params=..., tx=optax.adam(1e-3)).'
    )
  return state.tx


def zero_train_state(state: State, tx: optax.GradientTransformation) -> State:
  """`state` re-laid out for `tx`, its optimizer wrapped by zero_stage; see `zerojax.zero_stage`."""
  plan = transform.plan_for(tx, state.params)
  # Every check runs before anything is placed, so a failure leaves no
  # half-placed state behind.
  validation.abstract_arrays(state.opt_state, 'train_state.opt_state')
  if jax.tree.structure(state.opt_state) != jax.tree.structure(plan.opt_state):
    raise ValueError(
      '`train_state.opt_state` does not have the structure of'
      ' `train_state.tx.init(train_state.params)`: got'
      f' {jax.tree.structure(state.opt_state)}, expected'
      f' {jax.tree.structure(plan.opt_state)}. Build the state with'
      ' TrainState.create, or pass the optimizer that made opt_state.'
    )
  _refuse_regathering(state.params, plan)
  params, opt_state = jax.device_put((state.params, state.opt_state), (plan.params, plan.opt_state))
  state = state.replace(tx=transform.with_layouts(tx, plan), params=params, opt_state=opt_state)
  return _guarded(state, plan.stage, plan.axes)


def _guarded(state: State, stage: int, axes: tuple[str, ...]) -> State:
  """At stage 3, the state with its `apply_fn` refusing split parameters in zerojax's words
  (`zerojax.linen` `guard_split_params`); `replace` sets it, as for any field."""
  apply_fn = getattr(state, 'apply_fn', None)
  guarded = _guarded_apply(apply_fn, stage, axes)
  return state if guarded is apply_fn else state.replace(apply_fn=guarded)


def _guarded_apply(apply_fn: Any, stage: int, axes: tuple[str, ...]) -> Any:
  """`apply_fn` as a stage-3 train state holds it: under `guard_split_params` (linen)."""
  if stage < 3 or apply_fn is None:
    return apply_fn
  from zerojax._src import linen  # flax linen only where a train state is made

  return linen.guard_split_params(apply_fn, axes)


def _refuse_regathering(params: Any, plan: Any) -> None:
  """Refuses to make whole, below stage 3, parameters that already rest split over the ZeRO
  axes (an FSDP layout): that would raise their memory per device without a word."""
  if plan.stage == 3:
    return
  split, now, after = [], 0, 0
  for path, x, spec, target in placement.split_by_the_program(params, plan):
    split.append(path)
    now += rules.bytes_per_device(x.shape, x.dtype, spec, plan.mesh)
    after += rules.bytes_per_device(x.shape, x.dtype, target.spec, plan.mesh)
  if split:
    raise ValueError(
      f'zerojax.zero_stage(state, {plan.stage}): {validation.count(len(split), "parameter", "parameters")}'
      f' already rest split over {plan.axes[0] if len(plan.axes) == 1 else plan.axes!r}'
      f' ({", ".join(split[:3])}{", ..." if len(split) > 3 else ""}), as FSDP lays them out;'
      f' stage {plan.stage} keeps parameters whole on every device, which would raise them from'
      f' {plan_lib.fmt_bytes(now)} to {plan_lib.fmt_bytes(after)} per device. Use stage 3, which keeps them'
      ' split and gathers them where they are used; or, to hold them whole on purpose,'
      ' place them replicated (jax.device_put(params, NamedSharding(mesh, P()))) first.'
    )


# `stage` and the ZeRO options: the parameters of the one function that checks them.


def require_zero_tx(tx: Any, fields: dict, where: str) -> transform.ZeroConfig:
  """The ZeroConfig of `tx`; the options live there, not in the builder's arguments.

  Raises:
    TypeError: `tx` was not made by `zero_stage`, or ZeRO options were passed
      to the builder.
  """
  misplaced = [name for name in ('stage', 'mesh', *options_lib.NAMES) if name in fields]
  config = transform.config_of(tx)
  if config is None or misplaced:
    got = f' (got {", ".join(f"{n}=" for n in misplaced)})' if misplaced else ''
    raise TypeError(
      f'{where} takes the optimizer already wrapped by zerojax.zero_stage, which holds the'
      f' ZeRO stage and options{got}: tx=zerojax.zero_stage(optax.adam(1e-3), stage=3,'
      ' mesh=mesh).'
    )
  return config


def _layout(
  init_fn,
  init_args,
  *,
  tx: optax.GradientTransformation | None = None,
  apply_fn: Callable[..., Any] | None = None,
  state_class: type[State] | None = None,
  param_dtype: Any = None,
  where: str,
  **fields: Any,
):
  """The jittable builder of a zero train state, and the state's shardings.

  Its keyword arguments are those of `create_train_state` (documented there).
  """
  config = require_zero_tx(tx, fields, where)
  if state_class is None:
    state_class = fused_train_state()
  initial = jax.eval_shape(init_fn, *init_args)  # the parameters init_fn gives, abstractly
  abstract_params = initial
  if param_dtype is not None:  # the plan's accounting uses the dtype the state will hold
    abstract_params = precision.cast(initial, param_dtype)
  plan = plan_lib.plan_of(config, abstract_params)
  tx = transform.with_layouts(tx, plan)
  # One object for every trace of the state, so that their pytree metadata are equal.
  guarded_apply = _guarded_apply(apply_fn, config.stage, config.axes)

  def finish(params):
    """The state from its parameters, laid out: everything `build` does after `init_fn`."""
    params = mesh_lib.run_in_layout(
      lambda p: mesh_lib.constrain(p, plan.params, config.mesh), config.mesh, plan.params
    )(params)
    state = state_class.create(apply_fn=guarded_apply, params=params, tx=tx, **fields)
    if param_dtype is not None:  # mixed precision: tx.init saw the full-precision values
      state = state.replace(params=precision.cast(state.params, param_dtype))
    return state

  def build(*args):
    return finish(init_fn(*args))

  # Abstractly from the parameters' shapes: `init_fn` is traced once here, once by the caller.
  abstract_state = jax.eval_shape(finish, initial)
  rep = mesh_lib.replicated(config.mesh)
  shardings = jax.tree.map(lambda _: rep, abstract_state).replace(
    params=plan.params, opt_state=plan.opt_state
  )
  return build, abstract_state, shardings


def create_train_state(
  init_fn: Callable[..., optax.Params],
  *init_args: Any,
  tx: optax.GradientTransformation,
  apply_fn: Callable[..., Any] | None = None,
  state_class: type[State] | None = None,
  param_dtype: Any = None,
  **fields: Any,
) -> State:
  """Builds a train state directly in its ZeRO layout.

  The parameters are created by `init_fn(*init_args)` inside one jitted program
  whose outputs are already sharded, so no device ever holds a full copy of a
  sharded part: the way to initialise models too large for one device. The
  stage and every ZeRO option come from `tx`, the optimizer wrapped by
  `zerojax.zero_stage`.

  Args:
    init_fn: returns the parameter tree, e.g.
      `lambda rng: model.init(rng, x)['params']`.
    *init_args: arguments of `init_fn` (e.g. a PRNG key).
    tx: the optimizer from `zerojax.zero_stage(optax_tx, stage, mesh=..., ...)`.
    apply_fn: the model's apply function, stored in the state.
    state_class: a TrainState class or subclass; default flax's `TrainState` with an
      `apply_gradients` that takes the new parameters in one call
      (`zerojax.apply_gradients`: offloaded stage-3 parameters never come to the device).
    param_dtype: if given (e.g. `jnp.bfloat16`), the state's parameters are
      cast to it after `tx.init` has seen them at full precision: with
      `zerojax.mixed_precision(tx)` the fp32 master copy lives in the
      (sharded) optimizer state and the model computes in `param_dtype`.
    **fields: extra fields of `state_class`, passed to its `create`; their
      array leaves are replicated.

  Returns:
    A `state_class` whose params and opt_state carry the plan's shardings.

  Raises:
    TypeError: `tx` is not from `zero_stage`, or ZeRO options were passed here.

  >>> import jax, jax.numpy as jnp, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> state = zerojax.create_train_state(
  ...     lambda k: {'w': jax.random.normal(k, (64, 8))}, jax.random.key(0),
  ...     tx=zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=mesh))
  >>> state.params['w'].sharding.spec
  P('data', None)

  `zerojax.inspect.abstract_train_state` takes the same arguments and
  allocates nothing.
  """
  build, _, shardings = _layout(
    init_fn,
    init_args,
    tx=tx,
    apply_fn=apply_fn,
    state_class=state_class,
    param_dtype=param_dtype,
    where='zerojax.create_train_state',
    **fields,
  )
  return jax.jit(build, out_shardings=shardings)(*init_args)


def abstract_train_state(
  init_fn: Callable[..., optax.Params],
  *init_args: Any,
  tx: optax.GradientTransformation,
  apply_fn: Callable[..., Any] | None = None,
  state_class: type[State] | None = None,
  param_dtype: Any = None,
  **fields: Any,
) -> State:
  """`zerojax.create_train_state`, allocating nothing.

  Every array leaf is a `jax.ShapeDtypeStruct` carrying its planned sharding
  on the optimizer's mesh, ready for `jax.jit(step).lower(state,
  batch).compile()`: check the memory and collectives of a model of any size,
  or for a TPU topology with no TPU. Arguments as for `create_train_state`;
  `init_args` may be ShapeDtypeStructs.

  >>> import jax, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> state = zerojax.inspect.abstract_train_state(
  ...     lambda k: {'w': jax.random.normal(k, (1 << 16, 1 << 14))}, jax.random.key(0),
  ...     tx=zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=mesh))
  >>> state.params['w'].sharding.spec, state.params['w'].dtype
  (P('data', None), dtype('float32'))
  """
  _, abstract_state, shardings = _layout(
    init_fn,
    init_args,
    tx=tx,
    apply_fn=apply_fn,
    state_class=state_class,
    param_dtype=param_dtype,
    where='zerojax.inspect.abstract_train_state',
    **fields,
  )
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
  )


def jit_shardings(state: Any) -> Any:
  """The sharding of each array of `state`, in `state`'s own pytree structure: what
  `jax.jit(step, in_shardings=..., out_shardings=...)` takes for it.

  Take it from the state `zero_stage` (or `create_train_state`) returned: the wrap changes the
  optimizer, which is part of a train state's pytree metadata, and the layouts, so shardings
  taken before it fit neither (`check_jit_shardings` says which). Leaves that are not placed
  arrays get None (jit's "any layout").

  Args:
    state: a train state, or any tree of placed arrays (an optimizer state, parameters).

  Raises:
    ValueError: called on traced arrays (inside `jax.jit`), where no layout is placed.

  >>> import jax, jax.numpy as jnp, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> tx = zerojax.zero_stage(optax.adam(1e-3), stage=1, mesh=mesh)
  >>> shardings = zerojax.inspect.jit_shardings(tx.init({'w': jnp.ones((64, 16))}))
  >>> shardings[0].mu['w'].spec
  P('data', None)
  """
  traced = []

  def one(path, x):
    if layouts_lib.is_traced(x):
      traced.append(f'state{jax.tree_util.keystr(path)}')
      return None
    return x.sharding if isinstance(x, jax.Array) else None

  shardings = jax.tree_util.tree_map_with_path(one, state)
  if traced:
    raise ValueError(
      f'zerojax.inspect.jit_shardings: {validation.listed(traced)} are traced; call it outside jax.jit,'
      ' on the placed state, and pass the result to jax.jit(in_shardings=...).'
    )
  return shardings


def check_jit_shardings(shardings: Any, state: Any, name: str = 'in_shardings') -> None:
  """Raises a ValueError, in zerojax's words, where `shardings` cannot be `state`'s
  `jax.jit(in_shardings=...)` (or `out_shardings`) entry as the plan lays it out.

  For the two mistakes jit reports only as "different pytree metadata", with the state's
  whole GraphDef: shardings taken from the state before `zero_stage` wrapped it (its
  optimizer differs), or of another state; and, where the structures agree, shardings that
  would move placed leaves out of their ZeRO layout (jit would reshard them into it every
  call). Returns None where `shardings` fit.

  Args:
    shardings: the tree given to jit for `state` (None leaves: any layout).
    state: the state as it is passed to the jitted step.
    name: how the message names `shardings`.
  """
  is_sharding = _is_sharding_or_none
  fix = f' Take them from the state that is passed: {name}=zerojax.inspect.jit_shardings(state).'
  given, want = jax.tree.structure(shardings, is_leaf=is_sharding), jax.tree.structure(state)
  if given != want:
    wrapped = lambda s: transform.config_of(getattr(s, 'tx', None)) is not None
    if is_train_state(state) and wrapped(state) and not wrapped(shardings):
      raise ValueError(
        f'{name}: these shardings were taken from the train state before zerojax.zero_stage'
        ' wrapped it: its tx is the plain optimizer, a part of the pytree metadata that jit'
        " compares, and its layouts are not the plan's." + fix
      )
    fields = _differing_fields(shardings, state)
    where = f' (they differ at {validation.listed(fields)})' if fields else ''
    raise ValueError(
      f'{name}: these shardings do not have the structure of the state passed{where}, so'
      ' jax.jit refuses them for different pytree metadata.' + fix
    )
  moved = []
  for (path, s), x in zip(
    jax.tree_util.tree_flatten_with_path(shardings, is_leaf=is_sharding)[0], jax.tree.leaves(state)
  ):
    held = getattr(x, 'sharding', None)
    if s is not None and isinstance(x, jax.Array) and not _same_layout(s, held, x.ndim):
      moved.append(f'state{jax.tree_util.keystr(path)} ({s.spec} where it is {held.spec})')
  if moved:
    raise ValueError(
      f'{name}: these shardings would move {validation.listed(moved)} out of the layout'
      ' zerojax placed them in (jit reshards them on every call).' + fix
    )


def _is_sharding_or_none(x: Any) -> bool:
  """A leaf of a tree of jit shardings (None: any layout)."""
  return x is None or isinstance(x, jax.sharding.Sharding)


def _same_layout(a: Any, b: Any, ndim: int) -> bool:
  """Whether two shardings place an array of `ndim` dimensions alike (memory kind included)."""
  if b is None:
    return False
  same = a.is_equivalent_to(b, ndim)
  return same and getattr(a, 'memory_kind', None) == getattr(b, 'memory_kind', None)


def _differing_fields(a: Any, b: Any) -> list[str]:
  """The top-level fields (of a dataclass, or keys of a mapping) where two trees' structures
  differ, for a message; [] where they cannot be compared field by field."""
  differs = lambda x, y: (
    jax.tree.structure(x, is_leaf=_is_sharding_or_none) != (jax.tree.structure(y))
  )
  if dataclasses.is_dataclass(a) and type(a) is type(b):
    out = []
    for f in dataclasses.fields(a):
      x, y = getattr(a, f.name), getattr(b, f.name)
      static = not f.metadata.get('pytree_node', True)  # flax.struct: in the tree's metadata
      if (x is not y and x != y) if static else differs(x, y):
        out.append(f.name)
    return out
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    return [str(k) for k in sorted(set(a) | set(b), key=str) if differs(a.get(k), b.get(k))]
  return []
