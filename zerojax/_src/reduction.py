"""What a per-device loss means for the global batch.

`zerojax.value_and_grad` runs the loss once per device and micro-batch, on that
part of the batch's rows. To return what `jax.value_and_grad` returns on the
whole batch, every value the loss hands back must say how its parts combine:

- a scalar loss is the mean over its rows, every row weighing the same: the
  global value is the mean of the parts (each part has as many rows);
- `WeightedMean(total, weight)`: `total / weight`, with both summed over the
  rows; the global value sums both over every part before dividing (a
  padding-weighted cross-entropy, a mean over the tokens that are not padding);
- an aux leaf whose leading dimension is the part's rows: per-row values,
  returned with the rows of every part, in the batch's order.

A scalar loss that divides by something it computed from its batch (a count
of tokens, `jnp.mean(..., where=mask)`) is not a mean over rows: it is found
in the loss's jaxpr and refused, naming the fix (`check_normalisation`).
Random keys passed to the loss are folded with the part's index, so every
device and micro-batch draws its own numbers (`fold_keys`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.typing import ArrayLike

from zerojax._src import jaxprs


class WeightedMean(NamedTuple):
  """`total / weight`, where both are sums over the rows of the batch given.

  Return it from a loss for `zerojax.value_and_grad` (or as an aux leaf) when
  the loss is not a plain mean over rows: `value_and_grad` sums `total` and
  `weight` over every device and micro-batch and then divides, which is what
  the same loss computes on the whole batch. `weight` must not depend on the
  parameters. `WeightedMean(x, 1.0)` is the mean of `x` over the parts, which
  is the global mean when `x` is a mean over its rows.

  >>> import jax.numpy as jnp, zerojax
  >>> losses, mask = jnp.array([1.0, 2.0, 9.0]), jnp.array([1.0, 1.0, 0.0])
  >>> zerojax.WeightedMean(jnp.sum(losses * mask), jnp.sum(mask)).value
  Array(1.5, dtype=float32)
  """

  total: ArrayLike
  weight: ArrayLike = 1.0

  @property
  def value(self) -> jax.Array:
    """`total / weight`: the loss on this batch alone (for an unwrapped step)."""
    return jnp.asarray(self.total) / jnp.asarray(self.weight)


class Sum(NamedTuple):
  """A sum over the rows of the batch given, such as a count of tokens.

  Return it as an aux leaf from a loss for `zerojax.value_and_grad`: the
  result is `total` summed over every device and micro-batch, which is what
  the same sum is on the whole batch.

  >>> import jax.numpy as jnp, zerojax
  >>> mask = jnp.array([1.0, 1.0, 0.0])
  >>> zerojax.Sum(jnp.sum(mask)).value
  Array(2., dtype=float32)
  """

  total: ArrayLike

  @property
  def value(self) -> jax.Array:
    """`total`: the sum on this batch alone (for an unwrapped step)."""
    return jnp.asarray(self.total)


def is_weighted_mean(x: Any) -> bool:
  return isinstance(x, WeightedMean)


def is_combined(x: Any) -> bool:
  """A leaf that says how its parts combine (`WeightedMean` or `Sum`)."""
  return isinstance(x, (WeightedMean, Sum))


def as_weighted(loss: Any) -> tuple[jax.Array, jax.Array | None]:
  """(total, weight) of a loss; weight None for a plain mean (each part counts once)."""
  if is_weighted_mean(loss):
    total, weight = jnp.asarray(loss.total), jnp.asarray(loss.weight, jnp.float32)
  else:
    total, weight = jnp.asarray(loss), None
  if total.shape != () or (weight is not None and weight.shape != ()):
    raise ValueError(
      'zerojax.value_and_grad: the loss must be a scalar or a zerojax.WeightedMean of'
      f' scalars, got shape {total.shape}'
      + ('' if weight is None else f' and weight shape {weight.shape}')
      + '.'
    )
  return total, weight


# -- aux ----------------------------------------------------------------------


def aux_kinds(aux: Any, rows: int) -> list[str]:
  """For each aux leaf, how its parts combine.

  'rows' (leading dimension the rows: concatenated), 'mean' (a WeightedMean),
  'sum' (a Sum), or 'scalar' (a plain scalar: a mean over the rows, under the
  same rule as a scalar loss, and checked for the same division).

  Raises:
    ValueError: naming every leaf that is none of these, with the fix.
  """
  flat = jax.tree_util.tree_flatten_with_path(aux, is_leaf=is_combined)[0]
  kinds, bad = [], []
  for path, x in flat:
    shape = tuple(getattr(x, 'shape', np.shape(x)))
    if is_weighted_mean(x):
      kinds.append('mean')
    elif isinstance(x, Sum):
      kinds.append('sum')
    elif not shape:
      kinds.append('scalar')
    elif shape[0] == rows:
      kinds.append('rows')
    else:
      kinds.append('')
      bad.append(f'aux{jax.tree_util.keystr(path)} (shape {shape})')
  if bad:
    raise ValueError(
      'zerojax.value_and_grad(has_aux=True): the loss runs per device on'
      f' {rows} rows at a time, and these aux values are neither per-row nor scalars, so'
      f" they cannot be combined into the global batch's: {', '.join(bad)}. Return per-row"
      f' values (leading dimension {rows}; they come back with every row of the batch), a'
      ' scalar mean over the rows, a zerojax.Sum(total) of a sum over the rows, or a'
      ' zerojax.WeightedMean(total, weight) of sums over the rows.'
    )
  return kinds


def stack_aux(aux: Any, kinds: list[str]) -> Any:
  """One part's aux as arrays to carry through the micro-batch loop."""
  flat, treedef = jax.tree.flatten(aux, is_leaf=is_combined)
  out = []
  for x, kind in zip(flat, kinds):
    if kind == 'mean':
      out.append((jnp.asarray(x.total, jnp.float32), jnp.asarray(x.weight, jnp.float32)))
    elif kind == 'scalar':
      out.append((jnp.asarray(x, jnp.float32), jnp.ones((), jnp.float32)))
    elif kind == 'sum':
      out.append(jnp.asarray(x.total))
    else:
      out.append(x)
  return jax.tree.unflatten(treedef, out)


def finish_aux(stacked: Any, treedef: Any, kinds: list[str], axes: Any) -> tuple[list, list]:
  """Per-device aux outputs after the loop: (values, is-per-row flags).

  Per-row leaves are the micro-batches' rows in order (shard_map concatenates
  the devices'); WeightedMeans and scalars are summed over micro-batches and
  devices, then divided; Sums are summed.
  """
  flat = treedef.flatten_up_to(stacked)
  out = []
  for x, kind in zip(flat, kinds):
    if kind in ('mean', 'scalar'):
      total, weight = (jax.lax.psum(jnp.sum(v, axis=0), axes) for v in x)
      out.append(total / weight)
    elif kind == 'sum':
      out.append(jax.lax.psum(jnp.sum(x, axis=0), axes))
    else:
      out.append(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))
  return out, [k == 'rows' for k in kinds]


# -- randomness ---------------------------------------------------------------


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, 'dtype', None), jax.dtypes.prng_key)


def check_raw_keys(args: Any) -> None:
  """Refuses leaves that look like legacy uint32 keys: they cannot be told from data, and
  passed unchanged they would give every device and micro-batch the same numbers."""
  found = [
    f'args{jax.tree_util.keystr(path)}'
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]
    if getattr(x, 'dtype', None) == jnp.uint32 and np.shape(x) == (2,)
  ]
  if found:
    raise TypeError(
      f'zerojax.value_and_grad: {", ".join(found)} is a uint32[2] array, the form of a legacy'
      ' jax.random.PRNGKey. The loss runs once per device and micro-batch, and value_and_grad'
      " folds each part's index into typed keys only: a legacy key cannot be told from data,"
      ' and passed unchanged it would give every part the same numbers (the same dropout'
      ' mask). Pass jax.random.key(seed), or jax.random.wrap_key_data(key) for a key you'
      ' already have. If it is data, not a key, give it another dtype or shape.'
    )


def fold_keys(args: Any, index: jax.Array) -> Any:
  """`args` with every typed PRNG key folded with this part's index."""
  return jax.tree.map(lambda x: jax.random.fold_in(x, index) if is_key(x) else x, args)


# -- batch-dependent normalisation ----------------------------------------------

_PARAMS, _BATCH = jaxprs.PARAMS, jaxprs.BATCH


def check_normalisation(closed: Any, num_params: int, num_batch: int, outputs: list) -> None:
  """Refuses a loss, or a scalar aux value, that divides by a count computed from its batch.

  Per device, such a value is normalised by that device's count, and the mean
  of the parts is not the value on the whole batch (off by the spread of the
  counts). Divisions by values computed from the parameters (softmax, layer
  norms) or by constants (`jnp.mean`) are per-row or exact, and pass.

  Args:
    closed: the jaxpr of `loss(params, batch, ...)`, params' leaves first.
    num_params: how many inputs are parameter leaves, followed by
    num_batch: batch leaves (the rest are other arguments).
    outputs: per output, its name to check it under ('loss', or an aux path such
      as "aux['log_perplexity']"), or None not to check it.
  """
  jaxpr = closed.jaxpr
  rest = len(jaxpr.invars) - num_params - num_batch
  in_deps = [_PARAMS] * num_params + [_BATCH] * num_batch + [0] * rest
  checked = [name is not None for name in outputs]
  if not jaxprs.divisions_by(jaxpr, in_deps, checked, _BATCH):
    return  # one walk over every checked output: the common case
  for i, name in enumerate(outputs):  # found one: which output, to name it
    if name is None:
      continue
    live = [j == i for j in range(len(outputs))]
    found = jaxprs.divisions_by(jaxpr, in_deps, live, _BATCH)
    if found and name == 'loss':
      raise ValueError(
        'zerojax.value_and_grad: the loss divides by a value computed from its batch'
        f' ({"; ".join(found)}), such as a count of tokens that are not padding. The loss runs'
        " per device, on part of the batch, so it would be normalised by that part's count,"
        " not the whole batch's. Return zerojax.WeightedMean(total, count) (the sums before"
        ' dividing) and value_and_grad divides the global sums, as jax.value_and_grad on the'
        ' whole batch would.'
      )
    if found:
      raise ValueError(
        f'zerojax.value_and_grad: {name}, a scalar aux output, divides by a value computed'
        f' from its batch ({"; ".join(found)}), such as a count of tokens that are not'
        ' padding. A scalar aux value is averaged over the parts of the batch as the loss is,'
        " so it would be normalised by each part's count, not the whole batch's. Return"
        f' {name} as zerojax.WeightedMean(total, count) (the sums before dividing) and'
        ' value_and_grad divides the global sums.'
      )


def aux_output_names(aux: Any, kinds: list[str]) -> list:
  """Per flattened aux output (a WeightedMean is two), its path if it is a plain scalar (a
  mean over the rows, checked for a division by a batch count as the loss is), else None."""
  flat = jax.tree_util.tree_flatten_with_path(aux, is_leaf=is_combined)[0]
  names = []
  for (path, _), kind in zip(flat, kinds):
    name = f'aux{jax.tree_util.keystr(path)}'
    names += [None, None] if kind == 'mean' else [name if kind == 'scalar' else None]
  return names


def output_deps(closed: Any, num_params: int, num_batch: int) -> list[int]:
  """For each output of `closed`: whether it depends on the parameters (bit 1) and batch (bit 2)."""
  jaxpr = closed.jaxpr
  rest = len(jaxpr.invars) - num_params - num_batch
  env = jaxprs.dependencies(jaxpr, [_PARAMS] * num_params + [_BATCH] * num_batch + [0] * rest)
  return [0 if isinstance(v, core.Literal) else env.get(v, 0) for v in jaxpr.outvars]


def depends_on_batch(deps: int) -> bool:
  return bool(deps & _BATCH)


def depends_on_params(deps: int) -> bool:
  return bool(deps & _PARAMS)
