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

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.typing import ArrayLike


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


def is_weighted_mean(x: Any) -> bool:
  return isinstance(x, WeightedMean)


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
  """For each aux leaf: 'rows' (per-row values) or 'mean' (a WeightedMean).

  Raises:
    ValueError: naming every leaf that is neither, with the fix.
  """
  flat = jax.tree_util.tree_flatten_with_path(aux, is_leaf=is_weighted_mean)[0]
  kinds, bad = [], []
  for path, x in flat:
    shape = tuple(getattr(x, 'shape', np.shape(x)))
    if is_weighted_mean(x):
      kinds.append('mean')
    elif shape and shape[0] == rows:
      kinds.append('rows')
    else:
      kinds.append('')
      bad.append(f'aux{jax.tree_util.keystr(path)} (shape {shape})')
  if bad:
    raise ValueError(
      'zerojax.value_and_grad(has_aux=True): the loss runs per device on'
      f' {rows} rows at a time, and these aux values are not per-row, so they cannot be'
      f" combined into the global batch's: {', '.join(bad)}. Return per-row values"
      f' (leading dimension {rows}, e.g. the correct predictions, not their mean; they'
      ' come back with every row of the batch), or a zerojax.WeightedMean(total, weight)'
      ' of sums over the rows (WeightedMean(x, 1.0) for a mean over the rows).'
    )
  return kinds


def stack_aux(aux: Any, kinds: list[str]) -> Any:
  """One part's aux as arrays to carry through the micro-batch loop."""
  flat, treedef = jax.tree.flatten(aux, is_leaf=is_weighted_mean)
  out = []
  for x, kind in zip(flat, kinds):
    if kind == 'mean':
      out.append((jnp.asarray(x.total, jnp.float32), jnp.asarray(x.weight, jnp.float32)))
    else:
      out.append(x)
  return jax.tree.unflatten(treedef, out)


def finish_aux(stacked: Any, treedef: Any, kinds: list[str], axes: Any) -> tuple[list, list]:
  """Per-device aux outputs after the loop: (values, is-per-row flags).

  Per-row leaves are the micro-batches' rows in order (shard_map concatenates
  the devices'); WeightedMeans are summed over micro-batches and devices, then
  divided.
  """
  flat = treedef.flatten_up_to(stacked)
  out = []
  for x, kind in zip(flat, kinds):
    if kind == 'mean':
      total, weight = (jax.lax.psum(jnp.sum(v, axis=0), axes) for v in x)
      out.append(total / weight)
    else:
      out.append(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))
  return out, [k == 'rows' for k in kinds]


# -- randomness ---------------------------------------------------------------


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, 'dtype', None), jax.dtypes.prng_key)


def warn_raw_keys(args: Any) -> None:
  """Warns about leaves that look like legacy uint32 keys: they cannot be told from data."""
  for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
    if getattr(x, 'dtype', None) == jnp.uint32 and np.shape(x) == (2,):
      warnings.warn(
        f'zerojax.value_and_grad: args{jax.tree_util.keystr(path)} looks like a raw uint32 PRNG'
        ' key (jax.random.PRNGKey). It is passed to every device and micro-batch unchanged,'
        ' so they would all draw the same numbers. Pass a typed key (jax.random.key, or'
        " jax.random.wrap_key_data(key)) and value_and_grad folds in each part's index.",
        stacklevel=4,
      )


def fold_keys(args: Any, index: jax.Array) -> Any:
  """`args` with every typed PRNG key folded with this part's index."""
  return jax.tree.map(lambda x: jax.random.fold_in(x, index) if is_key(x) else x, args)


# -- batch-dependent normalisation ----------------------------------------------

_PARAMS, _BATCH = 1, 2


def _sub_jaxpr(eqn: Any) -> Any:
  """The inner jaxpr of a call whose operands map one to one onto its inputs."""
  inner = eqn.params.get('jaxpr', eqn.params.get('call_jaxpr'))
  inner = getattr(inner, 'jaxpr', inner)
  if inner is not None and len(inner.invars) == len(eqn.invars):
    return inner
  return None


def _deps(jaxpr: Any, in_deps: list[int]) -> dict:
  """Forward pass: for each variable, which of params/batch it depends on (bit flags)."""
  env = dict(zip(jaxpr.invars, in_deps))
  read = lambda v: 0 if isinstance(v, core.Literal) else env.get(v, 0)
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _sub_jaxpr(eqn)
    if inner is not None:
      inner_env = _deps(inner, ins)
      outs = [0 if isinstance(v, core.Literal) else inner_env.get(v, 0) for v in inner.outvars]
    else:
      outs = [int(np.bitwise_or.reduce(ins)) if ins else 0] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return env


def _live(jaxpr: Any, live_out: list[bool]) -> set:
  """Backward pass: the variables some live output is computed from."""
  live = {v for v, keep in zip(jaxpr.outvars, live_out) if keep and not isinstance(v, core.Literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, core.Literal))
  return live


def _find_divisions(jaxpr: Any, in_deps: list[int], live_out: list[bool]) -> list[str]:
  env, live = _deps(jaxpr, in_deps), _live(jaxpr, live_out)
  read = lambda v: 0 if isinstance(v, core.Literal) else env.get(v, 0)
  found = []
  for eqn in jaxpr.eqns:
    if not any(v in live for v in eqn.outvars):
      continue
    if eqn.primitive.name == 'div':
      divisor = eqn.invars[1]
      if read(divisor) == _BATCH and int(np.prod(divisor.aval.shape)) == 1:
        found.append(
          f'{eqn.invars[0].aval.str_short(short_dtypes=True)} / {divisor.aval.str_short(short_dtypes=True)}'
        )
    inner = _sub_jaxpr(eqn)
    if inner is not None:
      inner_live = [v in live for v in eqn.outvars]
      found += _find_divisions(inner, [read(v) for v in eqn.invars], inner_live)
  return found


def check_normalisation(closed: Any, num_params: int, num_batch: int, outputs: list[bool]) -> None:
  """Refuses a loss that divides by a count it computed from its batch.

  Per device, such a loss normalises by that device's count, and the mean of
  the parts is not the loss of the whole batch (off by the spread of the
  counts). Divisions by values computed from the parameters (softmax, layer
  norms) or by constants (`jnp.mean`) are per-row or exact, and pass.

  Args:
    closed: the jaxpr of `loss(params, batch, ...)`, params' leaves first.
    num_params: how many inputs are parameter leaves, followed by
    num_batch: batch leaves (the rest are other arguments).
    outputs: which outputs to check (the scalar loss; aux is checked by shape).
  """
  jaxpr = closed.jaxpr
  rest = len(jaxpr.invars) - num_params - num_batch
  in_deps = [_PARAMS] * num_params + [_BATCH] * num_batch + [0] * rest
  found = _find_divisions(jaxpr, in_deps, outputs)
  if found:
    raise ValueError(
      'zerojax.value_and_grad: the loss divides by a value computed from its batch'
      f' ({"; ".join(found)}), such as a count of tokens that are not padding. The loss runs'
      " per device, on part of the batch, so it would be normalised by that part's count,"
      " not the whole batch's. Return zerojax.WeightedMean(total, count) (the sums before"
      ' dividing) and value_and_grad divides the global sums, as jax.value_and_grad on the'
      ' whole batch would.'
    )


def output_deps(closed: Any, num_params: int, num_batch: int) -> list[int]:
  """For each output of `closed`: whether it depends on the parameters (bit 1) and batch (bit 2)."""
  jaxpr = closed.jaxpr
  rest = len(jaxpr.invars) - num_params - num_batch
  env = _deps(jaxpr, [_PARAMS] * num_params + [_BATCH] * num_batch + [0] * rest)
  return [0 if isinstance(v, core.Literal) else env.get(v, 0) for v in jaxpr.outvars]


def depends_on_params(deps: int) -> bool:
  return bool(deps & _PARAMS)
