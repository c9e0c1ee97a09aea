"""Packed rows for supervised fine-tuning: several examples in one row of fixed length, told
apart by segment ids (1, 2, ... within a row; 0 for padding), each trained on its completion's
tokens only.

`pack` builds the rows; the decoder reads `segment_ids` (attention within each example, rotary
positions restarting at each: `attention.positions_of`) and `loss_weights` (each token's weight
as a target), and `decoder_loss` returns their `WeightedMean`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from zerojax._src.attention import positions_of as positions_of
from zerojax._src.reduction import WeightedMean


def target_weights(tokens: Any, segment_ids: Any, loss_weights: Any) -> Any:
  """Each target's weight (batch, seq) for next-token `tokens` (batch, seq + 1): the target
  token's `loss_weights`, and 0 where it begins another example than its input's (or is
  padding, segment 0). None when neither is given (a plain mean)."""
  if segment_ids is None and loss_weights is None:
    return None
  w = jnp.ones(tokens[:, 1:].shape, jnp.float32)
  if loss_weights is not None:
    _check_like(loss_weights, tokens, 'loss_weights')
    w = w * jnp.asarray(loss_weights)[:, 1:].astype(jnp.float32)
  if segment_ids is not None:
    _check_like(segment_ids, tokens, 'segment_ids')
    seg = jnp.asarray(segment_ids)
    w = w * ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)).astype(jnp.float32)
  return w


def _check_like(x: Any, tokens: Any, name: str) -> None:
  if tuple(x.shape) != tuple(tokens.shape):
    raise ValueError(
      f'decoder_loss: {name} has shape {tuple(x.shape)}; it is per token, shaped like tokens'
      f' {tuple(tokens.shape)} (inputs and the last target).'
    )


def mean_of(nll: Any, weights: Any) -> Any:
  """The mean of per-target losses (batch, seq), or with `weights` their `WeightedMean`."""
  if weights is None:
    return jnp.mean(nll)
  return WeightedMean(jnp.sum(nll * weights), jnp.sum(weights))


def _example(item: Any) -> tuple[Sequence[int], Sequence[int]]:
  if isinstance(item, dict):
    return list(item.get('prompt', ())), list(item['completion'])
  prompt, completion = item
  return list(prompt), list(completion)


def pack(
  examples: Iterable[Any], seq_len: int, *, pad_id: int = 0, truncate: bool = True
) -> dict[str, np.ndarray]:
  """Examples packed into rows of `seq_len + 1` tokens (inputs and the last target), first fit
  in the order given.

  Args:
    examples: (prompt ids, completion ids) pairs, or dicts with 'prompt' (optional) and
      'completion'; the loss is on the completion's tokens.
    seq_len: the model's sequence length; rows hold `seq_len + 1` tokens.
    pad_id: the token that fills the rest of a row (segment 0, weight 0).
    truncate: cut an example longer than a row to the row (warned with the count); False
      refuses it.

  Returns:
    {'tokens', 'segment_ids', 'loss_weights'}, each (rows, seq_len + 1): int32, int32 and
    float32, for `zerojax.llama.loss(params, tokens, cfg, segment_ids=..., loss_weights=...)`.

  Raises:
    ValueError: an example longer than a row with `truncate=False`; an empty completion.

  >>> rows = pack([([5, 6], [7, 8]), ([9], [10])], seq_len=6)
  >>> rows['tokens'].tolist(), rows['segment_ids'].tolist()
  ([[5, 6, 7, 8, 9, 10, 0]], [[1, 1, 1, 1, 2, 2, 0]])
  >>> rows['loss_weights'].tolist()
  [[0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]]
  """
  width = seq_len + 1
  rows: list[list[tuple[list[int], list[float]]]] = []
  room: list[int] = []
  cut = 0
  for i, item in enumerate(examples):
    prompt, completion = _example(item)
    if not completion:
      raise ValueError(f'pack: example {i} has no completion tokens to train on.')
    ids, weights = prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion)
    if len(ids) > width:
      if not truncate:
        raise ValueError(f'pack: example {i} has {len(ids)} tokens, more than a row of {width}.')
      ids, weights, cut = ids[:width], weights[:width], cut + 1
    fit = next((r for r, left in enumerate(room) if left >= len(ids)), None)
    if fit is None:
      rows.append([])
      room.append(width)
      fit = len(rows) - 1
    rows[fit].append((ids, weights))
    room[fit] -= len(ids)
  if cut:
    warnings.warn(
      f'pack: {cut} example(s) longer than a row of {width} tokens were cut to it.', stacklevel=2
    )
  tokens = np.full((len(rows), width), pad_id, np.int32)
  segments = np.zeros((len(rows), width), np.int32)
  loss_weights = np.zeros((len(rows), width), np.float32)
  for r, parts in enumerate(rows):
    at = 0
    for s, (ids, weights) in enumerate(parts, start=1):
      tokens[r, at : at + len(ids)] = ids
      segments[r, at : at + len(ids)] = s
      loss_weights[r, at : at + len(ids)] = weights
      at += len(ids)
  return {'tokens': tokens, 'segment_ids': segments, 'loss_weights': loss_weights}
