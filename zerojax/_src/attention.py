"""The decoder's attention in plain JAX (XLA): causal, optionally within a sliding window, and
for packed rows (several examples in one row, told apart by segment ids) never across an
example; all queries at once or a chunk of them at a time.

Packed rows follow the convention of MaxText and Hugging Face's packing collators: a row's
`segment_ids` number its examples (equal ids: one example), a position attends only to earlier
positions of its own example, and its rotary position counts from its example's first token
(`positions_of`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def positions_of(segment_ids: jax.Array) -> jax.Array:
  """Each position's index within its example (batch, seq): 0 at every example's first token,
  where the segment id changes from the position before.

  >>> import jax.numpy as jnp
  >>> positions_of(jnp.array([[1, 1, 1, 2, 2, 3]])).tolist()
  [[0, 1, 2, 0, 1, 0]]
  """
  t = segment_ids.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
  starts = jnp.concatenate(
    [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]],
    axis=-1,
  )
  first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=segment_ids.ndim - 1)
  return idx - first


def _same_example(seg_q: jax.Array, seg_k: jax.Array) -> jax.Array:
  """(batch, 1, queries, keys): whether each query and key belong to one example."""
  return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def chunked_attention(q, k, v, chunk: int, window: int | None = None, segment_ids=None):
  """Causal attention computed `chunk` queries at a time, each chunk rematerialised.

  The same arithmetic as `jax.nn.dot_product_attention(q, k, v, is_causal=True)`
  (every chunk scores against all keys, masked), but only one chunk's scores
  (batch, heads, chunk, keys) are live at a time, forward and backward: a
  memory-efficient formulation in plain JAX, as flash attention kernels are in
  fused form. `window`: each query attends to that many positions, itself included.
  `segment_ids` (batch, seq): packed rows, attention kept within each example.
  """
  b, t, h, d = q.shape
  if t % chunk:
    raise ValueError(f'attention_chunk={chunk} does not divide the sequence length {t}.')
  keys = jnp.arange(k.shape[1])

  @jax.checkpoint
  def one(args):
    i, qi = args
    rows = i * chunk + jnp.arange(chunk)
    mask = (rows[:, None] >= keys[None, :])[None, None]
    if window is not None:
      mask &= (rows[:, None] - keys[None, :] < window)[None, None]
    if segment_ids is not None:
      seg_q = jax.lax.dynamic_slice_in_dim(segment_ids, i * chunk, chunk, axis=1)
      mask = mask & _same_example(seg_q, segment_ids)
    return jax.nn.dot_product_attention(qi, k, v, mask=mask)

  chunks = q.reshape(b, t // chunk, chunk, h, d).swapaxes(0, 1)
  out = jax.lax.map(one, (jnp.arange(t // chunk), chunks))
  return out.swapaxes(0, 1).reshape(b, t, h, d)


def xla_attention(chunk: int | None, window: int | None = None, segment_ids=None):
  """`attend(q, k, v)`: causal attention (within `window`, within each example of packed
  rows), all queries at once or `chunk` at a time."""

  def attend(q, k, v):
    local = window if window is not None and window < q.shape[1] else None
    if chunk and chunk < q.shape[1]:
      return chunked_attention(q, k, v, chunk, local, segment_ids)
    mask = None if segment_ids is None else _same_example(segment_ids, segment_ids)
    if local is not None:  # positions i - window < j <= i
      return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=(local - 1, 0)
      )
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

  return attend
