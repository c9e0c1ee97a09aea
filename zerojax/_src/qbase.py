"""Frozen base weights stored quantized (QLoRA): NF4 as bitsandbytes stores it, and int8.

A weight W, used as (in, out), is quantized as PyTorch holds it: its (out, in) transpose
flattened row-major, in blocks of 64 consecutive values, each block scaled by its absolute
maximum (absmax). NF4 (QLoRA's 4-bit NormalFloat, Dettmers et al. 2023) stores each value as
the index of the nearest of its 16 levels, two indices a byte (the first in the high nibble),
exactly as bitsandbytes' `quantize_4bit(quant_type='nf4', blocksize=64)` does, so a weight
quantized either way dequantizes to the same values. int8 stores round(127 * x / absmax).

The stored form is a `QuantizedWeight` of integer arrays only (the scales as the bits of their
float32 values), so the compute-dtype casts of the gathers leave it exact, and ZeRO-3 splits and
all-gathers it as stored: an NF4 weight moves 0.5 + 4/64 bytes per value, against bf16's 2
(28%). It is dequantized where the layer uses it, on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64
KINDS = ('nf4', 'int8')
# The 16 NF4 levels (QLoRA, Appendix E; bitsandbytes' `get_4bit_type('nf4')`): quantiles of a
# standard normal, normalised to [-1, 1], with an exact zero.
NF4_LEVELS = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A weight in its stored form (see the module's docstring); leading dimensions of `codes` and
  `scales` are a stack's (layers).

  Attributes:
    codes: NF4: uint8 (..., n // 2), two level indices a byte; int8: int8 (..., n).
    scales: uint32 (..., n // 64), each block's absmax as the bits of a float32.
    kind: 'nf4' or 'int8'.
    shape: one weight's shape as used, (in, out); n = in * out.
  """

  codes: jax.Array
  scales: jax.Array
  kind: str = dataclasses.field(metadata={'static': True})
  shape: tuple[int, int] = dataclasses.field(metadata={'static': True})

  @property
  def nbytes_per_value(self) -> float:
    return (0.5 if self.kind == 'nf4' else 1.0) + 4 / BLOCK


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedWeight)


def check(kind: str, shape: tuple[int, ...], where: str) -> None:
  """Refuses a kind or a weight this storage cannot hold, naming it."""
  if kind not in KINDS:
    raise ValueError(
      f'{where}: base_dtype must be one of {KINDS} (or None: unquantized), got {kind!r}.'
    )
  n = shape[-1] * shape[-2]
  if n % BLOCK:
    raise ValueError(
      f'{where}: a weight of {shape[-2:]} holds {n} values, not a whole number of blocks of'
      f' {BLOCK}: keep it unquantized.'
    )


def quantize(w: jax.Array, kind: str = 'nf4') -> QuantizedWeight:
  """`w` (..., in, out) quantized as bitsandbytes quantizes PyTorch's (out, in) weight."""
  check(kind, w.shape, 'quantize')
  lead, (din, dout) = w.shape[:-2], w.shape[-2:]
  x = jnp.swapaxes(w, -1, -2).astype(jnp.float32).reshape(*lead, -1, BLOCK)
  absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  scaled = x / jnp.where(absmax == 0, 1, absmax)
  if kind == 'nf4':
    levels = jnp.asarray(NF4_LEVELS)
    # The nearest level (the lower one on a tie): the count of midpoints below the value.
    mids = (levels[1:] + levels[:-1]) / 2
    idx = jnp.searchsorted(mids, scaled.reshape(-1), side='left').astype(jnp.uint8)
    idx = idx.reshape(*lead, -1)
    codes = (idx[..., 0::2] << 4) | idx[..., 1::2]
  else:
    codes = jnp.round(scaled * 127).astype(jnp.int8).reshape(*lead, -1)
  scales = jax.lax.bitcast_convert_type(absmax[..., 0], jnp.uint32)
  return QuantizedWeight(codes, scales, kind, (din, dout))


def dequantize(q: QuantizedWeight, dtype: Any = jnp.float32) -> jax.Array:
  """The weight (..., in, out) in `dtype`, computed in float32 from the stored form."""
  lead = q.codes.shape[:-1]
  if q.kind == 'nf4':
    levels = jnp.asarray(NF4_LEVELS)
    idx = jnp.stack([q.codes >> 4, q.codes & 15], axis=-1).reshape(*lead, -1)
    values = levels[idx.astype(jnp.int32)]
  else:
    values = q.codes.astype(jnp.float32) / 127
  absmax = jax.lax.bitcast_convert_type(q.scales, jnp.float32)
  values = values.reshape(*lead, -1, BLOCK) * absmax[..., None]
  din, dout = q.shape
  return jnp.swapaxes(values.reshape(*lead, dout, din), -1, -2).astype(dtype)


def _nf4_levels(nibbles: jax.Array) -> jax.Array:
  """float32 NF4 levels of 4-bit indices, by a tree of 15 selects on the index's bits (a
  table lookup would be a gather, which TPUs run slowly and lay out padded)."""
  values = [jnp.float32(v) for v in NF4_LEVELS]
  for bit in range(4):
    on = ((nibbles >> bit) & 1).astype(bool)
    values = [jnp.where(on, values[2 * k + 1], values[2 * k]) for k in range(len(values) // 2)]
  return values[0]


def matmul(h: jax.Array, w: Any) -> jax.Array:
  """`h (..., in) @ w (in, out)` in `h`'s dtype, a stored quantized `w` of one layer
  dequantized on the fly in its stored (out, in) order: each value computed in float32 as
  `dequantize` computes it and rounded to `h`'s dtype, NF4's two values of a byte multiplied
  with the even and the odd inputs apart, so no weight is interleaved or transposed."""
  if not is_quantized(w):
    return h @ w
  din, dout = w.shape
  if w.codes.ndim != 1 or din % BLOCK:  # a stack, or blocks that cross the rows
    return h @ dequantize(w, h.dtype)
  scales = jax.lax.bitcast_convert_type(w.scales, jnp.float32).reshape(dout, din // BLOCK)
  dot = lambda x, v: jnp.einsum('...i,oi->...o', x, v, preferred_element_type=jnp.float32)
  if w.kind == 'int8':
    values = w.codes.reshape(dout, din).astype(jnp.float32) / 127
    return dot(h, (values * jnp.repeat(scales, BLOCK, axis=-1)).astype(h.dtype)).astype(h.dtype)
  codes, scales = w.codes.reshape(dout, din // 2), jnp.repeat(scales, BLOCK // 2, axis=-1)
  high = (_nf4_levels(codes >> 4) * scales).astype(h.dtype)
  low = (_nf4_levels(codes & 15) * scales).astype(h.dtype)
  return (dot(h[..., 0::2], high) + dot(h[..., 1::2], low)).astype(h.dtype)


def weight(w: Any, dtype: Any) -> jax.Array:
  """A weight ready for a matrix multiply in `dtype`: dequantized if stored quantized."""
  return dequantize(w, dtype) if is_quantized(w) else w


def floating_cast(tree: Any, dtype: Any) -> Any:
  """`tree` with its floating leaves cast to `dtype`; stored quantized weights untouched."""
  one = lambda x: (
    x if is_quantized(x) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)
  )
  return jax.tree.map(one, tree, is_leaf=is_quantized)
