"""Rotary position embeddings (RoPE) as transformers computes them: default, linear and Llama 3.1 scaling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary position embeddings as transformers computes them: the two halves of each head's
  dimensions rotate together by position x inv_freq, inv_freq_i = theta^(-2i / head_dim).

  Attributes:
    theta: the base (`rope_theta`).
    kind: 'default'; 'linear' (every frequency divided by `factor`); 'llama3' (Llama 3.1's:
      frequencies whose wavelength exceeds original / low_freq_factor divided by `factor`,
      those under original / high_freq_factor kept, those between blended).
    factor, low_freq_factor, high_freq_factor, original: the scaling's figures.
  """

  theta: float = 10000.0
  kind: str = 'default'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original: int = 8192

  def __post_init__(self):
    if self.kind not in ('default', 'linear', 'llama3'):
      raise ValueError(f"Rope.kind={self.kind!r}: choose 'default', 'linear' or 'llama3'.")

  def inverse_frequencies(self, head_dim: int) -> np.ndarray:
    """inv_freq (head_dim / 2,), float32 as transformers keeps it, the scaling applied."""
    inv = 1.0 / self.theta ** (
      np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    )
    inv = inv.astype(np.float32)
    if self.kind == 'linear':
      return (inv / self.factor).astype(np.float32)
    if self.kind == 'default':
      return inv
    wavelength = 2 * math.pi / inv
    low, high = self.original / self.low_freq_factor, self.original / self.high_freq_factor
    scaled = np.where(wavelength > low, inv / self.factor, inv)
    smooth = (self.original / wavelength - self.low_freq_factor) / (
      self.high_freq_factor - self.low_freq_factor
    )
    blended = (1 - smooth) * scaled / self.factor + smooth * scaled
    between = (wavelength >= high) & (wavelength <= low)
    return np.where(between, blended, scaled).astype(np.float32)


def rotate(x: jax.Array, rope: Rope, offset: int = 0, positions=None) -> jax.Array:
  """`x` (batch, seq, heads, head_dim) rotated by its positions (offset, offset + 1, ...; or
  `positions` (batch, seq), a packed row's per example) as transformers rotates it: the angles'
  cosines and sines computed in float32 and cast to x's dtype, then x * cos + flip(x) * sin in
  that dtype, flip(x) = (-x2, x1) of x's two halves.

  flip is a product with a fixed signed permutation of the head's dimensions, exact in any
  dtype (one nonzero term per output), which a TPU runs on its matrix unit rather than by
  moving halves of its 128-lane registers."""
  t, d = x.shape[1], x.shape[-1]
  inv = jnp.asarray(rope.inverse_frequencies(d))
  if positions is None:
    angles = jnp.arange(offset, offset + t, dtype=jnp.float32)[:, None] * inv[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  else:
    angles = (positions + offset).astype(jnp.float32)[:, :, None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = np.arange(d // 2)
  flip = np.zeros((d, d), np.float32)
  flip[half + d // 2, half], flip[half, half + d // 2] = -1.0, 1.0
  flipped = jnp.einsum(
    'bthd,de->bthe', x, jnp.asarray(flip, x.dtype), precision=jax.lax.Precision.HIGHEST
  )
  return x * cos + flipped * sin
