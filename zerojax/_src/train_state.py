"""Flax train states laid out for a ZeRO stage."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import optax
from flax.training import train_state as flax_train_state

from zerojax._src import mesh as mesh_lib
from zerojax._src import precision, transform, validation

State = TypeVar('State', bound=flax_train_state.TrainState)


def is_train_state(obj: Any) -> bool:
  """Whether `obj` looks like a flax TrainState (params, opt_state and tx fields)."""
  return isinstance(obj, flax_train_state.TrainState) or all(
    hasattr(obj, f) for f in ('params', 'opt_state', 'tx', 'replace')
  )


def guard_apply_fn(apply_fn: Callable[..., Any] | None, stage: int) -> Callable[..., Any] | None:
  """At stage 3, `apply_fn` whose sharding errors name the fix (gathering the parameters).

  Parameters rest split over the ZeRO axes at stage 3. On an Explicit mesh,
  applying the model to them directly is a sharding type error inside jax
  (e.g. `dot_general ... produces an illegally sharded result`); the wrapper
  re-raises it saying how to gather them. Anything else passes through.
  """
  if apply_fn is None or stage < 3 or getattr(apply_fn, '_zerojax_guarded', False):
    return apply_fn

  @functools.wraps(apply_fn)
  def apply(*args, **kwargs):
    try:
      return apply_fn(*args, **kwargs)
    except Exception as e:
      # jax does not export the class; its name is stable and public in messages.
      if type(e).__name__ != 'ShardingTypeError':
        raise
      raise ValueError(
        f'apply_fn failed on ZeRO stage-3 parameters, which rest split over the mesh: {e}\n'
        'Gather them where they are used: the whole model at once with'
        " state.apply_fn({'params': zerojax.gather_params(state.params,"
        ' zerojax.plan_for(state.tx, state.params))}, x), or layer by layer (less memory)'
        ' by wrapping the scanned block in zerojax.gathered_linen (Flax linen),'
        ' zerojax.gathered_nnx (NNX) or zerojax.gather_leaves (a parameter pytree).'
      ) from e

  apply._zerojax_guarded = True
  return apply


def zero_train_state(state: State, stage: int, **options: Any) -> State:
  """Re-lays out a train state for ZeRO `stage`; see `zerojax.zero_stage`."""
  if not transform.is_transformation(state.tx):
    raise TypeError(
      f'`train_state.tx` must be an optax GradientTransformation, got'
      f' {type(state.tx).__name__}: {state.tx!r:.80}. Create the state with'
      ' TrainState.create(apply_fn=..., params=..., tx=optax.adam(1e-3)).'
    )
  tx = transform.zero_optimizer(state.tx, stage, **options)
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
  params, opt_state = jax.device_put((state.params, state.opt_state), (plan.params, plan.opt_state))
  replace = dict(tx=tx, params=params, opt_state=opt_state)
  if hasattr(state, 'apply_fn'):
    replace['apply_fn'] = guard_apply_fn(state.apply_fn, stage)
  return state.replace(**replace)


# `stage` and the ZeRO options: the parameters of the one function that checks them.


def require_zero_tx(tx: Any, fields: dict, where: str) -> transform.ZeroConfig:
  """The ZeroConfig of `tx`; the options live there, not in the builder's arguments.

  Raises:
    TypeError: `tx` was not made by `zero_stage`, or ZeRO options were passed
      to the builder.
  """
  misplaced = [name for name in ('stage', *transform.OPTION_NAMES) if name in fields]
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
  state_class: type[State] = flax_train_state.TrainState,
  param_dtype: Any = None,
  **fields: Any,
):
  """The jittable builder of a zero train state, and the state's shardings.

  Its keyword arguments are those of `create_train_state` (documented there).
  """
  config = require_zero_tx(tx, fields, 'create_train_state/abstract_train_state')
  abstract_params = jax.eval_shape(init_fn, *init_args)
  if param_dtype is not None:  # the plan's accounting uses the dtype the state will hold
    abstract_params = precision.cast(abstract_params, param_dtype)
  plan = config.plan(abstract_params)
  stage = config.stage

  def build(*args):
    params = init_fn(*args)
    params = mesh_lib.run_in_layout(
      lambda p: mesh_lib.constrain(p, plan.params, config.mesh), config.mesh, plan.params
    )(params)
    state = state_class.create(
      apply_fn=guard_apply_fn(apply_fn, stage), params=params, tx=tx, **fields
    )
    if param_dtype is not None:  # mixed precision: tx.init saw the full-precision values
      state = state.replace(params=precision.cast(state.params, param_dtype))
    return state

  abstract_state = jax.eval_shape(build, *init_args)
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
  state_class: type[State] = flax_train_state.TrainState,
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
    state_class: a TrainState class or subclass.
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
  """
  build, _, shardings = _layout(
    init_fn,
    init_args,
    tx=tx,
    apply_fn=apply_fn,
    state_class=state_class,
    param_dtype=param_dtype,
    **fields,
  )
  return jax.jit(build, out_shardings=shardings)(*init_args)


def abstract_train_state(
  init_fn: Callable[..., optax.Params], *init_args: Any, **options: Any
) -> State:
  """Like `create_train_state`, but allocates nothing.

  Every array leaf is a `jax.ShapeDtypeStruct` carrying its planned sharding,
  ready for `jax.jit(step).lower(state, batch).compile()`: check memory and
  collectives of a model of any size, or for a TPU topology with no TPU. Arguments
  as for `create_train_state`; `init_args` may be ShapeDtypeStructs.

  >>> import jax, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> state = zerojax.abstract_train_state(
  ...     lambda k: {'w': jax.random.normal(k, (1 << 16, 1 << 14))}, jax.random.key(0),
  ...     tx=zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=mesh))
  >>> state.params['w'].sharding.spec, state.params['w'].dtype
  (P('data', None), dtype('float32'))
  """
  _, abstract_state, shardings = _layout(init_fn, init_args, **options)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings
  )


# One signature for both builders: abstract_train_state takes what create_train_state takes.
abstract_train_state.__signature__ = inspect.signature(create_train_state)
