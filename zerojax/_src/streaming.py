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
arrays: the update takes them as they are, and the separate finish runs. The table is
module-level: traces of streamed steps built at once in several threads could mix entries.
"""

from __future__ import annotations

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


# The gradients value_and_grad returned in the trace being built: id -> (array, parts).
# The array is held so that its id stays its own; a new streamed value_and_grad
# trace starts the table afresh, so it holds at most one step's arrays.
_NOTED: dict[int, tuple[jax.Array, Parts]] = {}


def start() -> None:
  """Forgets what earlier traces noted (called when a streamed value_and_grad is traced)."""
  _NOTED.clear()


def note(grad: jax.Array, parts: Parts) -> jax.Array:
  """Records that `grad` was finished from `parts`; returns `grad`."""
  _NOTED[id(grad)] = (grad, parts)
  return grad


def take(grads: list[Any]) -> list[Parts | None]:
  """For each of `grads`, the parts it was finished from, if value_and_grad noted it."""
  out = []
  for g in grads:
    found = _NOTED.get(id(g))
    out.append(found[1] if found is not None and found[0] is g else None)
  return out
