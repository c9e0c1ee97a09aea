"""A checkpoint's integrity: checksums recorded at save and checked at restore, the version
that wrote it, and the target checked against what was saved, each refusal naming the step,
the leaf and the fix.

Every array's checksum is two 32-bit sums of its bytes (one position-weighted), computed where
the array lives, so bytes changed on disk after the save raise an error instead of restoring
garbage.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zerojax._src import codec

# --- Checksums: two 32-bit sums over an array's bytes (plain, and weighted by
# odd position-dependent factors, so any one changed word changes it), exact
# in any reduction order, computed where the array lives.


def _words(x: jax.Array) -> jax.Array:
  """The array's bytes as uint32 values (one per element or per 4 bytes), same leading shape."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    small = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, small).astype(jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # a trailing dimension of 2
  raise TypeError(f'no checksum for dtype {x.dtype}')


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
  words = _words(x)
  index = jnp.zeros(words.shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(words.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim) * jnp.uint32(stride)
    stride = (stride * words.shape[dim]) % (1 << 32)
  weights = index * jnp.uint32(2654435761) | jnp.uint32(1)
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


def checksums(tree: Any) -> dict[str, list[int]]:
  """keystr path -> checksum of each array leaf (every process computes the same)."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    value = _checksum(x)
    local = value.addressable_shards[0].data if isinstance(value, jax.Array) else value
    out[jax.tree_util.keystr(path)] = [int(v) for v in np.asarray(local)]
  return out


def verify(meta: dict, restored: Any, directory: str, step: int) -> None:
  """Compares each restored array with the checksum recorded at save."""
  recorded = meta.get('checksums')
  if recorded is None:  # written by zerojax before checksums were recorded
    return
  got = checksums(restored)
  for path, value in got.items():
    want = recorded.get(path)
    if want is not None and list(want) != value:
      raise ValueError(
        f'checkpoint step {step} in {directory}: {path} does not match the checksum recorded'
        f' when it was saved (its bytes changed on disk afterwards); it is stored in'
        f' {os.path.join(directory, str(step), "state")}. Restore another step (committed:'
        f' {sorted(int(d) for d in os.listdir(directory) if d.isdigit())}) or save it again.'
      )


def version() -> str:
  from zerojax._src import version

  return version.__version__


def version_tuple(version: str) -> tuple[int, ...]:
  """'0.2.0' -> (0, 2, 0); the release's numbers, local and pre-release parts dropped."""
  match = re.match(r'\d+(\.\d+)*', version)
  return tuple(int(x) for x in match.group(0).split('.')) if match else ()


def check_version(meta: dict, directory: str, step: int) -> None:
  saved = str(meta.get('zerojax_version', ''))
  if version_tuple(saved) > version_tuple(version()):
    raise ValueError(
      f'checkpoint step {step} in {directory} was written by zerojax {saved}, newer than'
      f' this zerojax {version()}; its layout may hold what this version cannot read.'
      f' Upgrade zerojax to {saved} or later (pip install -U . in a checkout of it) to restore it.'
    )


def check_global_batch(meta: dict, global_batch: int, directory: str, step: int) -> None:
  run = meta.get('run') or {}
  saved = run.get('global_batch')
  if saved is None:
    warnings.warn(
      f'checkpoint step {step} in {directory} records no global batch (it was saved without'
      ' Checkpointer.save(global_batch=...)); the global batch of this run was not checked.',
      stacklevel=3,
    )
    return
  if int(global_batch) != saved:
    raise ValueError(
      f'checkpoint step {step} in {directory} was trained with a global batch of {saved} rows'
      f' per step; this run has {global_batch}. A resumed run keeps the global batch (the'
      f' device count may change): resume with a global batch of {saved}, or start a new run'
      ' in another folder.'
    )


def check_against(meta: dict, wanted: Any, directory: str, step: int) -> None:
  saved = meta['leaves']
  target = codec.leaf_table(wanted)
  # Parameters first: their paths say most about which model differs.
  for path, leaf in sorted(target.items(), key=lambda item: "['params']" not in item[0]):
    if path not in saved:
      raise ValueError(
        f'checkpoint step {step} in {directory} has no leaf {path} (the target has shape'
        f' {tuple(leaf["shape"])}); the model or optimizer differs from the one saved.'
        f' Saved leaves include: {", ".join(list(saved)[:5])}'
      )
    if list(leaf['shape']) != list(saved[path]['shape']):
      raise ValueError(
        f'checkpoint step {step} in {directory}: {path} has shape {tuple(saved[path]["shape"])}'
        f' in the checkpoint but {tuple(leaf["shape"])} in the target; restore into the model'
        ' that was saved.'
      )
    if leaf['dtype'] != saved[path]['dtype']:
      raise ValueError(
        f'checkpoint step {step} in {directory}: {path} is {saved[path]["dtype"]} in the'
        f' checkpoint but {leaf["dtype"]} in the target. Restore into a target of the saved'
        ' dtype (e.g. build it with the same param_dtype) and cast afterwards.'
      )
  missing = [p for p in saved if p not in target and not p.startswith("['extra']")]
  if missing:
    raise ValueError(
      f'checkpoint step {step} in {directory} has leaves the target lacks, first {missing[0]}'
      f' with shape {tuple(saved[missing[0]]["shape"])}; the model or optimizer differs.'
    )


def unreadable(directory: str, step: int, wanted: Any, committed: list[int]) -> ValueError:
  """The error for a step orbax could not read: which array, found by reading each alone.

  Only on this failure path: every array is restored on its own (orbax's partial
  restore) until one fails, so the message names it rather than TensorStore's
  array index. The caller chains TensorStore's error as the cause.
  """
  where = os.path.join(directory, str(step), 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  damaged = None
  for path, leaf in jax.tree_util.tree_flatten_with_path(wanted)[0]:
    one = _single_leaf(path, leaf)
    try:
      checkpointer.restore(
        where,
        args=ocp.args.PyTreeRestore(
          item=one,
          restore_args=ocp.checkpoint_utils.construct_restore_args(one),
          partial_restore=True,
        ),
      )
    except Exception:  # noqa: BLE001 - any failure to read this array names it
      damaged = jax.tree_util.keystr(path)
      break
  what = (
    f'{damaged} cannot be read'
    if damaged is not None
    else 'its arrays cannot be read together, though each reads alone'
  )
  return ValueError(
    f'checkpoint step {step} in {directory}: {what} from {where} (its files are damaged or'
    " truncated, or it was not written by this model and optimizer; TensorStore's error is"
    f' the cause above). Restore another step (committed: {committed}) or save it again.'
  )


def _single_leaf(path: tuple, leaf: Any) -> dict:
  """The nested dicts of `path` (dict keys only, as orbax saves them) around `leaf`."""
  out = leaf
  for key in reversed(path):
    out = {getattr(key, 'key', getattr(key, 'idx', getattr(key, 'name', None))): out}
  return out
