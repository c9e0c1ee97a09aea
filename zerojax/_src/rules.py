"""Leaf rules: which dimension of an array carries the ZeRO axes.

One rule serves every leaf, parameter or optimizer state: keep whatever the leaf
is already sharded over (tensor parallelism), and put the ZeRO axes on the
largest *free* dimension that divides by their size. A leaf with no such
dimension is replicated when small, and otherwise handled by the user's policy.
The leading dimension of a stacked leaf is the axis a layer loop walks, and is
never split (`zerojax.Options.stacked`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

Policy = Literal['error', 'replicate', 'pad']
POLICIES: tuple[str, ...] = ('error', 'replicate', 'pad')

# Leaves below this size that cannot be split evenly are replicated without
# complaint: biases and norms of odd width cost little, and splitting them would
# cost a collective each.
DEFAULT_REPLICATE_BELOW_BYTES = 1 << 18


@dataclasses.dataclass(frozen=True)
class LeafRule:
  """How one array leaf is laid out.

  Attributes:
    shape: the leaf's global shape.
    dtype: the leaf's dtype.
    base: its layout without the ZeRO axes (tensor-parallel axes, if any).
    sharded: its layout with the ZeRO axes added, or `base` if it could not be
      split.
    dim: the dimension carrying the ZeRO axes, or None.
    reason: why the leaf is not split over the ZeRO axes, or None.
    indivisible: True when the leaf is large and no free dimension divides.
    padded_shape: under policy 'pad', the shape the optimizer sees (`dim`
      rounded up to a multiple of the axis size); `sharded` applies to it.
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  base: PartitionSpec
  sharded: PartitionSpec
  dim: int | None
  reason: str | None
  indivisible: bool
  padded_shape: tuple[int, ...] | None = None


def normalize_spec(
  spec: PartitionSpec | None, ndim: int, mesh: Mesh, drop: Sequence[str]
) -> PartitionSpec:
  """A spec with one entry per dimension, without the axes in `drop`.

  Axes not in `mesh` are dropped too: a spec from another mesh cannot be kept.
  """
  entries = list(spec) if spec is not None else []
  entries = (entries + [None] * ndim)[:ndim]
  out = []
  for entry in entries:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    names = tuple(n for n in names if n in mesh.axis_names and n not in drop)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return PartitionSpec(*out)


def spec_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def is_key(dtype) -> bool:
  """Whether `dtype` is a typed PRNG key dtype (`jax.random.key`)."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def as_dtype(dtype):
  """`np.dtype(dtype)`, except that typed PRNG key dtypes are kept as they are."""
  return dtype if is_key(dtype) else np.dtype(dtype)


def bytes_per_device(shape: Sequence[int], dtype, spec: PartitionSpec, mesh: Mesh) -> int:
  """Bytes one device holds of an array of `shape` laid out as `spec`."""
  size = as_dtype(dtype).itemsize
  for d, entry in zip(shape, list(spec) + [None] * (len(shape) - len(spec))):
    parts = math.prod(mesh.shape[a] for a in spec_axes(entry))
    size *= -(-d // parts)
  return size


# The width TPU tiles an array's minor dimension across.
LANES = 128
# The minor-dimension shard TPU's reduce-scatter keeps a reduce-scatter: bf16 gradients (the
# usual compute dtype) pack two values per 32-bit lane, and a scatter into shards of an odd
# number of 128-value tiles is lowered to an all-reduce and a slice (measured with libtpu
# 0.0.42 on v5e:4x8: shards of 256, 512, 768, 1024 and 1280 values stay reduce-scatters;
# 128, 384, 640, 896 and 1152 do not).
MINOR_SHARD = 2 * LANES


def _breaks_lanes(shape: tuple[int, ...], i: int, n: int) -> bool:
  """Whether splitting dimension `i` of `shape` `n` ways leaves minor-dimension shards that
  TPU's reduce-scatter does not keep (see MINOR_SHARD)."""
  return (
    len(shape) >= 2
    and i == len(shape) - 1
    and shape[i] % LANES == 0
    and (shape[i] // n) % MINOR_SHARD != 0
  )


def _choose(shape: tuple[int, ...], dims: list[int], n: int, stacked: bool | None) -> int:
  """Which of the divisible dimensions `dims` carries the ZeRO axes.

  Largest first, ties to the earliest; the minor dimension comes last when its shards would
  not be whole MINOR_SHARDs (TPU tiles it across 128 lanes, bf16 two to a lane, pads a
  narrower shard and lowers its reduce-scatter to an all-reduce and a slice). The leading
  dimension of a leaf of two or more dimensions may be the layer axis a loop walks
  (`stacked`): True never splits it, None splits it only where it is the largest (lane
  alignment never promotes it), False treats it like any other dimension.
  """
  key = lambda i: (not _breaks_lanes(shape, i, n), shape[i], -i)
  if len(shape) < 2 or stacked is False:
    return max(dims, key=key)
  rest = [i for i in dims if i != 0]
  if stacked is None and 0 in dims and all(shape[0] >= shape[i] for i in rest):
    return 0
  return max(rest, key=key)


def leaf_rule(
  shape: Sequence[int],
  dtype,
  base: PartitionSpec | None,
  *,
  mesh: Mesh,
  axes: tuple[str, ...],
  replicate_below_bytes: int,
  pad: bool = False,
  stacked: bool | None = None,
) -> LeafRule:
  """Decides the layout of one leaf; see the module docstring.

  With `pad`, a large leaf that no free dimension divides is split along its
  largest free dimension after padding it to a multiple of the axis size.
  `stacked` says whether the leaf's leading dimension is a stack of layers that a
  layer loop walks (`zerojax.Options.stacked`): True keeps it whole, None (not known)
  splits it only where no larger dimension divides.
  """
  shape = tuple(int(d) for d in shape)
  dtype = as_dtype(dtype)
  base = normalize_spec(base, len(shape), mesh, drop=axes)
  if is_key(dtype):
    # Typed PRNG keys (e.g. optax.noisy_sgd's) stay whole: every device draws
    # the same noise as plain optax does, and a key is a few bytes.
    return LeafRule(shape, dtype, base, base, None, 'PRNG key (kept whole)', False)
  n = math.prod(mesh.shape[a] for a in axes)
  zero_entry = axes[0] if len(axes) == 1 else axes
  # A layer axis is never split: scanning over it would hand each device other layers.
  walked = stacked is True and len(shape) >= 2

  free = [i for i, entry in enumerate(base) if entry is None and not (walked and i == 0)]
  divisible = [i for i in free if shape[i] % n == 0 and shape[i] >= n]
  if n == 1 and free:
    divisible = free
  if divisible:
    dim = _choose(shape, divisible, n, stacked)
    entries = list(base)
    entries[dim] = zero_entry
    return LeafRule(shape, dtype, base, PartitionSpec(*entries), dim, None, False)

  # No free dimension divides: split a tensor-parallel dimension further, its
  # ZeRO part minor, so gathering over the ZeRO axes gives back the TP shard.
  taken = [
    i
    for i, entry in enumerate(base)
    if entry is not None
    and not (walked and i == 0)
    and shape[i] % (n * math.prod(mesh.shape[a] for a in spec_axes(entry))) == 0
  ]
  if taken and n > 1:
    dim = max(taken, key=lambda i: (shape[i], -i))
    entries = list(base)
    entries[dim] = spec_axes(base[dim]) + tuple(axes)
    return LeafRule(shape, dtype, base, PartitionSpec(*entries), dim, None, False)

  nbytes = bytes_per_device(shape, dtype, base, mesh)
  if not shape:
    reason = 'scalar'
  elif not free:
    reason = 'every dimension is already sharded over other axes' + (
      ' or is the layer axis' if walked else ''
    )
  else:
    reason = f'no free dimension of {shape} divides by {n}'
    if walked:
      reason += ' (its leading dimension is a layer axis, never split)'
  indivisible = nbytes >= replicate_below_bytes and bool(shape)
  if indivisible and pad and free:
    dim = max(free, key=lambda i: (shape[i], -i))
    padded = list(shape)
    padded[dim] = -(-shape[dim] // n) * n
    entries = list(base)
    entries[dim] = zero_entry
    reason = f'{reason}; padded to {tuple(padded)} for the optimizer'
    return LeafRule(shape, dtype, base, PartitionSpec(*entries), dim, reason, True, tuple(padded))
  if not indivisible and shape:
    reason += f' (small: {nbytes} B < replicate_below_bytes={replicate_below_bytes})'
  return LeafRule(shape, dtype, base, base, None, reason, indivisible)
