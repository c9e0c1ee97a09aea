"""`zero_stage`: the one entry point, for optax optimizers and train states."""

from __future__ import annotations

from typing import Any

import optax
from jax.sharding import Mesh

from zerojax._src import options as options_lib
from zerojax._src import train_state, transform


def zero_stage(target: Any, stage: int, *, mesh: Mesh | None = None, **options: Any) -> Any:
  """Applies ZeRO `stage` to an optax optimizer or a flax train state.

  Stage 0 is plain data parallelism; stage 1 shards the optimizer state over
  `axis`; stage 2 also reduce-scatters the gradients into shards; stage 3 also
  keeps the parameters sharded at rest. Each leaf is split along its largest
  dimension that divides by the axis size, keeping any sharding it already has
  over other axes (tensor parallelism).

  Args:
    target: an optax `GradientTransformation` (or an object with its
      `init`/`update` methods, such as `optax.MultiSteps`), or a
      `flax.training.train_state.TrainState` (or subclass).
    stage: the ZeRO stage, 0, 1, 2 or 3.
    mesh: the device mesh (Explicit or Auto axes); defaults to the one set by
      `jax.set_mesh`.
    **options: the fields of `zerojax.Options`, which names, defaults and
      checks them: `axis` ('data'), `policy`, `replicate_below_bytes`,
      `param_specs`, `param_axis`, `offload`, `update_on`, `quantize`, `replica_axis`.

  These options are given here and only here: `create_train_state`,
  `zerojax.checkpoint.restore_train_state`, `plan_for` and `value_and_grad`
  read them from the wrapped optimizer (`zerojax.config_of(tx).options`).

  Returns:
    For an optimizer: an `optax.GradientTransformationExtraArgs` whose `init`
    returns the state already sharded and whose `update` lays gradients,
    updates and state out for the stage, inside or outside `jax.jit`. For a
    train state: the same class with `tx` wrapped and `params` and `opt_state`
    placed per the plan; at stage 3 its `apply_fn` (linen) also refuses, with a
    ValueError naming the parameter and the gather to use, a module run on
    parameters still split on an Explicit mesh (`state.replace(apply_fn=...)`
    sets another, unchecked).

  Raises:
    ValueError: `stage` not in 0-3; `axis` not in the mesh; no mesh; a large
      leaf that cannot be split under policy='error'; `target` already wrapped;
      `quantize` at stage 0, or quantized weights below stage 3.
    TypeError: `target` is neither; a train state whose `tx` is not optax.

  >>> import jax, jax.numpy as jnp, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> tx = zerojax.zero_stage(optax.adam(1e-3), stage=2, mesh=mesh)
  >>> params = {'w': jnp.ones((64, 16))}
  >>> state = tx.init(params)
  >>> state[0].mu['w'].sharding.spec
  P('data', None)
  >>> updates, state = jax.jit(tx.update)(params, state, params)
  >>> updates['w'].sharding.spec
  P(None, None)
  """
  state = None
  if not isinstance(target, optax.GradientTransformation) and train_state.is_train_state(target):
    state, target = target, train_state.checked_tx(target)
  elif not transform.is_transformation(target):
    # Objects with optax's init/update protocol, such as optax.MultiSteps, are optimizers.
    raise TypeError(
      '`target` must be an optax GradientTransformation or a flax TrainState, got'
      f' {type(target).__name__}. Wrap the optimizer: zero_stage(optax.adam(1e-3),'
      ' stage, mesh=mesh).'
    )
  options = options_lib.from_keywords(options, 'zerojax.zero_stage')
  tx = transform.zero_optimizer(transform.make_config(target, stage, mesh, options))
  return tx if state is None else train_state.zero_train_state(state, tx)
