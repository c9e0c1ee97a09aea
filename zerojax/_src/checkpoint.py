"""Sharded checkpoints with orbax: save on any layout, restore onto any other.

Arrays are saved in their logical (global, unpadded) shapes: orbax writes each
device's own shards, and restoring reads straight into the target's shardings,
so a checkpoint taken on 8 devices at stage 3 restores on 4 devices at stage 1,
or on 1 device for evaluation, in one call. Saves are atomic (orbax writes to a
temporary folder and commits it), so a process killed while saving leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding

from zerojax._src import distributed, transform
from zerojax._src import mesh as mesh_lib
from zerojax._src import train_state as train_state_lib

_KEY_PREFIX = 'prng_key:'


def _version() -> str:
  import zerojax

  return zerojax.__version__


def _state_tree(state: Any) -> dict:
  """The arrays to save: a train state's step, params and opt_state, or any pytree."""
  if train_state_lib.is_train_state(state):
    return {'step': state.step, 'params': state.params, 'opt_state': state.opt_state}
  return {'tree': state}


def _encode_keys(tree: Any) -> tuple[Any, dict[str, str]]:
  """Typed PRNG keys become their raw data (orbax saves plain arrays)."""
  impls = {}

  def encode(path, x):
    if hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
      return jax.random.key_data(x)
    return x

  return jax.tree_util.tree_map_with_path(encode, tree), impls


def _abstract(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) for a tree of arrays or ShapeDtypeStructs."""

  def one(x):
    if hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, 'sharding', None))

  return jax.tree.map(one, tree)


def _leaf_table(tree: Any) -> dict[str, dict]:
  return {
    jax.tree_util.keystr(path): {'shape': list(np.shape(x)), 'dtype': str(x.dtype)}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


class Checkpointer:
  """Saves and restores zero-sharded training state in a folder, one sub-folder per step.

  Args:
    directory: where checkpoints live (created if missing).
    max_to_keep: keep only the newest this many (None: all).
    keep_every: also keep every step divisible by this, beyond `max_to_keep`.
    save_interval_steps: `save` writes only at multiples of this (unless forced).
    async_save: write in the background while training continues; call
      `wait_until_finished()` (or `close()`) before reading what was written.

  >>> import tempfile, jax, jax.numpy as jnp, zerojax
  >>> with zerojax.Checkpointer(tempfile.mkdtemp(), async_save=False) as ckpt:
  ...   _ = ckpt.save(3, {'w': jnp.ones((8, 4))})
  ...   restored, _ = ckpt.restore({'w': jax.ShapeDtypeStruct((8, 4), jnp.float32)})
  >>> float(restored['w'].sum())
  32.0
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = None,
    keep_every: int | None = None,
    save_interval_steps: int = 1,
    async_save: bool = True,
  ):
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      keep_period=keep_every,
      save_interval_steps=save_interval_steps,
      enable_async_checkpointing=async_save,
      create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  # --- Writing.
  def save(self, step: int, state: Any, *, extra: dict | None = None, force: bool = False) -> bool:
    """Saves `state` (a train state or any pytree of arrays) at `step`.

    Args:
      step: the training step; names the checkpoint.
      state: a flax TrainState (its step, params and opt_state are saved) or
        any pytree of arrays (e.g. NNX `nnx.state(model)`).
      extra: more arrays to resume exactly: RNG keys (typed keys are fine),
        the data position, ...
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a checkpoint was started.
    """
    tree = {'state': _state_tree(state), 'extra': extra or {}}
    tree, key_impls = _encode_keys(tree)
    tree = _global_leaves(tree, _replicated_on_target(state))
    config = transform.config_of(getattr(state, 'tx', None))
    meta = {
      'zerojax_version': _version(),
      'step': int(step),
      'stage': None if config is None else config.stage,
      'mesh': None if config is None else dict(config.mesh.shape),
      'axes': None if config is None else list(config.axes),
      'kind': 'train_state' if 'step' in tree['state'] else 'pytree',
      'prng_keys': key_impls,
      'leaves': _leaf_table(tree),
    }
    return self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
      force=force,
    )

  def wait_until_finished(self) -> None:
    """Blocks until background saves are committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --- Reading.
  def all_steps(self) -> list[int]:
    """Committed steps, oldest first (partial saves are never listed)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def _step_or_latest(self, step: int | None) -> int:
    step = self.latest_step() if step is None else step
    if step is None or step not in self.all_steps():
      raise FileNotFoundError(
        f'no committed checkpoint {"" if step is None else f"for step {step} "}in'
        f' {self.directory}; committed steps: {self.all_steps()}'
      )
    return step

  def metadata(self, step: int | None = None) -> dict:
    """What was saved at `step` (default: latest): stage, mesh, version, leaves."""
    step = self._step_or_latest(step)
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def restore(self, target: Any, step: int | None = None, *, extra: Any = None) -> tuple[Any, dict]:
    """Restores the checkpoint at `step` (default: latest) into `target`'s layout.

    Args:
      target: a train state or pytree laid out as wanted: arrays, or
        ShapeDtypeStructs with shardings (e.g. `zerojax.abstract_train_state`
        on another mesh or stage). Each device reads only its own shards.
      step: which checkpoint; default the latest committed one.
      extra: the structure of the saved `extra` (arrays or ShapeDtypeStructs);
        default: what was saved, replicated.

    Returns:
      (restored state, restored extra).

    Raises:
      FileNotFoundError: no such committed step.
      ValueError: the target's tree or shapes differ from the checkpoint's
        (naming the first mismatching path and both shapes), or a file of the
        checkpoint is unreadable (naming the step and the error, with its file).
    """
    step = self._step_or_latest(step)
    meta = self.metadata(step)
    state_tree = _state_tree(target)
    if extra is None:
      extra_target = _saved_extra(meta, _replicated_on_target(target))
    else:
      extra_target = _abstract(_encode_keys(extra)[0])
    wanted = {'state': _abstract(state_tree), 'extra': extra_target}
    _check_against(meta, wanted, self.directory, step)
    try:
      out = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(wanted)),
      )['state']
    except Exception as e:  # orbax/tensorstore: truncated or corrupted files
      raise ValueError(
        f'checkpoint step {step} in {self.directory} could not be read: {type(e).__name__}: {e}'
      ) from e
    restored_extra = _decode_keys(out['extra'], meta['prng_keys'], "['extra']")
    restored = out['state']
    if 'step' in restored:
      state = target.replace(
        step=restored['step'], params=restored['params'], opt_state=restored['opt_state']
      )
    else:
      state = restored['tree']
    return state, restored_extra


def _replicated_on_target(target: Any) -> Any:
  """A replicated sharding on the target's mesh, so extras sit beside the state."""
  config = transform.config_of(getattr(target, 'tx', None))
  if config is not None:
    return mesh_lib.replicated(config.mesh)
  for x in jax.tree.leaves(target):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return mesh_lib.replicated(sharding.mesh)
  return None


def _global_leaves(tree: Any, sharding: Any) -> Any:
  """With several processes, host-local leaves (a step counter, extras) become global.

  Every process saves together, so each leaf must be one global array; a value
  that lives on one local device (or in numpy) is placed replicated on the
  state's mesh. It must be the same in every process.
  """
  if jax.process_count() == 1 or sharding is None:
    return tree

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    return jax.device_put(np.asarray(jax.device_get(x)), sharding)

  return jax.tree.map(one, tree)


def _saved_extra(meta: dict, sharding: Any) -> Any:
  """ShapeDtypeStructs for the saved `extra`, rebuilt from the metadata (flat dicts only)."""
  out = {}
  for path, leaf in meta['leaves'].items():
    if path.startswith("['extra']"):
      name = path[len("['extra']['") : -2]
      out[name] = jax.ShapeDtypeStruct(
        tuple(leaf['shape']), np.dtype(leaf['dtype']), sharding=sharding
      )
  return out


def _decode_keys(tree: dict, impls: dict, prefix: str) -> dict:
  out = {}
  for name, value in tree.items():
    impl = impls.get(f"{prefix}['{name}']")
    out[name] = jax.random.wrap_key_data(value, impl=impl) if impl else value
  return out


def _check_against(meta: dict, wanted: Any, directory: str, step: int) -> None:
  saved = meta['leaves']
  target = _leaf_table(wanted)
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
  missing = [p for p in saved if p not in target and not p.startswith("['extra']")]
  if missing:
    raise ValueError(
      f'checkpoint step {step} in {directory} has leaves the target lacks, first {missing[0]}'
      f' with shape {tuple(saved[missing[0]]["shape"])}; the model or optimizer differs.'
    )


def restore_train_state(
  directory: str | os.PathLike,
  init_fn: Callable[..., optax.Params],
  *init_args: Any,
  tx: optax.GradientTransformation,
  stage: int,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  step: int | None = None,
  apply_fn: Callable[..., Any] | None = None,
  **kwargs: Any,
) -> tuple[Any, dict]:
  """Restores a train state onto `mesh` at `stage`, whatever it was saved on.

  Builds the target abstractly (`zerojax.abstract_train_state`), then reads each
  device's shards straight into it. Arguments as for `create_train_state`.

  Returns:
    (train state, extra).
  """
  target = train_state_lib.abstract_train_state(
    init_fn, *init_args, tx=tx, stage=stage, mesh=mesh, axis=axis, apply_fn=apply_fn, **kwargs
  )
  with Checkpointer(directory, async_save=False) as ckpt:
    return ckpt.restore(target, step)


def export_params(params: Any, path: str | os.PathLike) -> str:
  """Writes the parameters, consolidated, to a NumPy `.npz` for inference.

  Keys are the parameters' pytree paths (e.g. "['dense1']['kernel']"); load with
  `numpy.load(path)` alone, no zerojax or jax needed. In a multi-process run
  every process must call it (leaves split over processes are gathered);
  process 0 writes the file.

  Returns:
    The path written.
  """
  path = os.fspath(path)
  if not path.endswith('.npz'):
    path += '.npz'
  # Every process takes part in gathering leaves split over processes; one writes.
  arrays = {
    jax.tree_util.keystr(p): x
    for p, x in jax.tree_util.tree_flatten_with_path(distributed.to_numpy(params))[0]
  }
  if jax.process_index() != 0:
    return path
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp.npz'
  np.savez(tmp, **arrays)
  os.replace(tmp, path)  # never a half-written export under the final name
  return path


def format_checkpoint(directory: str | os.PathLike, step: int | None = None) -> str:
  """A description of a checkpoint folder: steps, stage, mesh, per-leaf shapes and bytes."""
  with Checkpointer(directory, async_save=False) as ckpt:
    steps = ckpt.all_steps()
    if not steps:
      return f'{ckpt.directory}: no committed checkpoints'
    meta = ckpt.metadata(step)
  lines = [
    f'{os.path.abspath(os.fspath(directory))}: steps {steps}',
    f'step {meta["step"]}: {meta["kind"]}, ZeRO stage {meta["stage"]}, mesh {meta["mesh"]},'
    f' axes {meta["axes"]}, zerojax {meta["zerojax_version"]}',
  ]
  total = 0
  width = max(len(p) for p in meta['leaves'])
  for path, leaf in meta['leaves'].items():
    nbytes = int(np.prod(leaf['shape'])) * np.dtype(leaf['dtype']).itemsize
    total += nbytes
    lines.append(
      f'  {path:<{width}}  {str(tuple(leaf["shape"])):<18} {leaf["dtype"]:<8} {nbytes:>14,}'
    )
  lines.append(f'  total {total:,} bytes (logical, all devices together)')
  return '\n'.join(lines)
