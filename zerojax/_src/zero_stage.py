"""`zero_stage`: the one entry point, for optax optimizers and train states."""

from __future__ import annotations

import inspect
from typing import Any

import optax

from zerojax._src import train_state, transform


def zero_stage(target: Any, stage: int, **options: Any) -> Any:
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
    axis: the mesh axis, or tuple of axes, that ZeRO partitions over.
    policy: what to do with a large leaf that has no dimension divisible by the
      axis size: 'error' (default), 'replicate' (keep it whole on every
      device), or 'pad' (its gradient and optimizer state are zero-padded to a
      multiple of the axis size along its largest free dimension and split;
      the parameter itself stays whole). Padding is exact for optimizers that
      act elementwise or through norms (Adam, SGD, LAMB, clipping), not for
      ones that average over a dimension (Adafactor's factored statistics).
    replicate_below_bytes: such leaves below this size are replicated under any
      policy; the plan lists them.
    param_specs: optional PartitionSpecs (a prefix tree of the params) for
      tensor-parallel layouts, overriding those the params carry (see
      `zerojax.logical_param_specs` for Flax logical partitioning).
    param_axis: hierarchical partitioning (ZeRO++ hpZ): at stage 3 split the
      parameters over only these axes (a subset of `axis`, e.g. the devices of
      one host) so their all-gathers stay inside that group; gradients and
      optimizer state are still split over all of `axis`.
    offload: ZeRO-Offload: 'opt_state' keeps the optimizer state in host
      memory (`memory_kind='pinned_host'`) and streams it through the device
      for the update; 'opt_state+master' also the fp32 master copy of
      `zerojax.mixed_precision`. Default None: all on device.
    update_on: with `offload`, where the optimizer update runs: 'device'
      (stream the offloaded state through device memory) or 'host' (run it on
      the host with `compute_on('device_host')`: only gradient shards go down
      and updates come up, so the state never takes device memory).
    quantize: ZeRO++ quantized collectives, a `zerojax.Quantize`: int8
      stage-3 weight all-gathers (qwZ) and int8/int4 gradient reduce-scatters
      through an all-to-all, summed in float32 (qgZ), in block-quantized form.
      They apply where zerojax places the collectives, in
      `zerojax.value_and_grad`; the plan lists the leaves left full precision
      (unsplit, integer, or below `Quantize.min_size`). Default None.

  These options are given here and only here: `create_train_state`,
  `abstract_train_state`, `restore_train_state`, `plan_for` and
  `value_and_grad` read them from the wrapped optimizer (`zerojax.config_of`).

  Returns:
    For an optimizer: an `optax.GradientTransformationExtraArgs` whose `init`
    returns the state already sharded and whose `update` lays gradients,
    updates and state out for the stage, inside or outside `jax.jit`. For a
    train state: the same class with `tx` wrapped and `params` and `opt_state`
    placed per the plan.

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
  # The options are named, defaulted and checked in one place: transform.make_config.
  transform.check_option_names(options, 'zero_stage')
  kwargs = options
  if isinstance(target, optax.GradientTransformation):
    return transform.zero_optimizer(target, stage, **kwargs)
  if train_state.is_train_state(target):
    return train_state.zero_train_state(target, stage, **kwargs)
  if transform.is_transformation(target):
    # Objects with optax's init/update protocol, such as optax.MultiSteps.
    return transform.zero_optimizer(target, stage, **kwargs)
  raise TypeError(
    '`target` must be an optax GradientTransformation or a flax TrainState, got'
    f' {type(target).__name__}. Wrap the optimizer: zero_stage(optax.adam(1e-3),'
    ' stage, mesh=mesh).'
  )


# What help() and IDEs show: the options' names and defaults, from their one home.
zero_stage.__signature__ = inspect.Signature(
  [
    inspect.Parameter('target', inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Any),
    *list(inspect.signature(transform.make_config).parameters.values())[1:],
  ],
  return_annotation=Any,
)
