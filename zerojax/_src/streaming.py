"""Streamed gradients (`update_on='stream'`): the last step of their reduction, done
where the optimizer update runs.

`zerojax.value_and_grad` writes each layer's gradient to host memory during the
backward pass, one part per micro-batch. What is left is to add the parts and
divide by the batch's weight. The TPU compiler keeps the outputs of a host
computation in device memory unless they leave the program, so finishing them
in a host computation of their own would bring every streamed gradient back to
the device whole, between that computation and the update's. Instead:

- `value_and_grad` returns the finished gradients (computed on the host, correct
  for any use) and notes how each was made (`note`);
- the streamed update (`zerojax.zero_stage(..., update_on='stream')`) takes the
  parts of those it is given (`take`) and finishes them inside its own host
  computation (`finish`), with the same arithmetic. The separate finish is then
  unused and the compiler drops it.

Gradients changed between the two (a user's own clipping, say) are not the noted
arrays: the update takes them as they are, and the separate finish runs. The record is
per context (`contextvars`), so traces built at once in several threads do not mix.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Parts:
  """How a streamed gradient is finished from what the backward pass left in host memory.

  Attributes:
    parts: its micro-batch parts, in host memory.
    weight: the divisor (the batch's count of rows or summed weights), an fp32 scalar.
    dtype: the accumulator's dtype: parts are added and divided in it.
    weighted: whether `weight` is a `WeightedMean`'s summed weight (divided by as
      fp32) or a count (cast to `dtype` first, as the device does).
  """

  parts: tuple[jax.Array, ...]
  weight: jax.Array
  dtype: Any = dataclasses.field(metadata={'static': True})
  weighted: bool = dataclasses.field(metadata={'static': True})


def finish(p: Parts, parts: tuple[jax.Array, ...], weight: jax.Array) -> jax.Array:
  """The gradient from its parts: summed in order, then divided, in `p.dtype`.

  `parts` and `weight` are `p`'s, passed separately so that a host computation
  can take them as its inputs.
  """
  acc = parts[0].astype(p.dtype)
  for part in parts[1:]:
    acc = acc + part.astype(p.dtype)
  return (acc / (weight if p.weighted else weight.astype(p.dtype))).astype(p.dtype)


class Noted:
  """The gradients one streamed `value_and_grad` trace returned, with the parts of each.

  Matched by identity (`is`): a traced array has no value to compare, and another array
  (a gradient the user changed) is not the one finished from these parts.
  """

  def __init__(self) -> None:
    self._pairs: list[tuple[jax.Array, Parts]] = []

  def note(self, grad: jax.Array, parts: Parts) -> jax.Array:
    """Records that `grad` was finished from `parts`; returns `grad`."""
    self._pairs.append((grad, parts))
    return grad

  def parts_of(self, grad: Any) -> Parts | None:
    return next((p for g, p in self._pairs if g is grad), None)


# The streamed value_and_grad trace being built in this context (a thread or task), if any.
_CURRENT: contextvars.ContextVar[Noted | None] = contextvars.ContextVar('streamed', default=None)


def start() -> Noted:
  """A fresh record for a streamed value_and_grad trace, replacing an earlier trace's."""
  noted = Noted()
  _CURRENT.set(noted)
  return noted


def take(grads: list[Any]) -> list[Parts | None]:
  """For each of `grads`, the parts it was finished from, if value_and_grad noted it."""
  noted = _CURRENT.get()
  return [None if noted is None else noted.parts_of(g) for g in grads]
