"""Sharded checkpoints with orbax: save on any layout, restore onto any other.

Arrays are saved in their logical (global, unpadded) shapes: orbax writes each
device's own shards, and restoring reads straight into the target's shardings,
so a checkpoint taken on 8 devices at stage 3 restores on 4 devices at stage 1,
or on 1 device for evaluation, in one call. Saves are atomic (orbax writes to a
temporary folder and commits it), so a process killed while saving leaves the
previous checkpoint as the latest. A background save still pending when the
script ends is finished before the process exits.

Every array's checksum is recorded at save (two 32-bit sums of its bytes, one
position-weighted, computed where the array lives) and checked at restore, so
bytes changed on disk after the save raise an error instead of restoring
garbage. Leaves padded under policy='pad' are saved unpadded.
"""

from __future__ import annotations

import glob
import os
import shutil
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from zerojax._src import distributed, runtime, transform
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import train_state as train_state_lib

_KEY_PREFIX = 'prng_key:'


_TMP_SUFFIX = '.orbax-checkpoint-tmp'


def _version() -> str:
  from zerojax._src import version

  return version.__version__


def _as_array(x: Any) -> Any:
  """Python scalars (a fresh TrainState's `step=0`) as arrays; arrays as they are."""
  if isinstance(x, (int, float, bool, np.number)) and not isinstance(x, jax.Array):
    return jnp.asarray(x)
  return x


def _state_tree(state: Any) -> dict:
  """The arrays to save: a train state's step, params and opt_state, or any pytree."""
  if train_state_lib.is_train_state(state):
    return {
      'step': _as_array(state.step),
      'params': state.params,
      'opt_state': state.opt_state,
    }
  return {'tree': jax.tree.map(_as_array, state)}


def _plan_of(state: Any) -> plan_lib.ZeroPlan | None:
  """The plan of a zero-wrapped train state, if `state` is one."""
  config = transform.config_of(getattr(state, 'tx', None))
  if config is None or not train_state_lib.is_train_state(state):
    return None
  return config.plan(state.params)


def _state_padding(state: Any, plan: plan_lib.ZeroPlan | None) -> list:
  """Per opt_state leaf: None or (dim, logical size) when it is padded in `state`."""
  leaves = jax.tree.leaves(state.opt_state) if plan is not None else []
  if plan is None or len(plan.state_padding) != len(leaves):
    return [None] * len(leaves)
  out = []
  for x, pad in zip(leaves, plan.state_padding):
    out.append(pad if pad is not None and x.shape[pad[0]] != pad[1] else None)
  return out


def _unpad_leaf(x: Any, pad: tuple[int, int] | None) -> Any:
  if pad is None:
    return x
  dim, size = pad
  return jax.lax.slice_in_dim(x, 0, size, axis=dim)


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


def _checksums(tree: Any) -> dict[str, list[int]]:
  """keystr path -> checksum of each array leaf (every process computes the same)."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    value = _checksum(x)
    local = value.addressable_shards[0].data if isinstance(value, jax.Array) else value
    out[jax.tree_util.keystr(path)] = [int(v) for v in np.asarray(local)]
  return out


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
    x = _as_array(x)
    sharding = getattr(x, 'sharding', None)
    if hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

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
    async_save: write in the background while training continues. Pending
      saves finish on `wait_until_finished()`, `close()`, leaving a `with`
      block, or at the latest when the process exits normally.
    clean_incomplete: remove the temporary folders (`*.orbax-checkpoint-tmp`)
      of saves that were killed before they committed. Pass False while
      another job may be saving into `directory`.

  >>> import tempfile, jax, jax.numpy as jnp, zerojax
  >>> with zerojax.checkpoint.Checkpointer(tempfile.mkdtemp(), async_save=False) as ckpt:
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
    clean_incomplete: bool = True,
  ):
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      keep_period=keep_every,
      save_interval_steps=save_interval_steps,
      enable_async_checkpointing=async_save,
      create=True,
    )
    if clean_incomplete and jax.process_index() == 0:
      for folder in self.incomplete():
        shutil.rmtree(folder, ignore_errors=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    # A script that ends without close() must not lose its last save: finish
    # pending writes when this object goes away or the interpreter exits.
    self._finalizer = weakref.finalize(self, _finish, self._manager)
    # At exit, before the thread pools shut down: orbax commits a background
    # save on them, and interpreter shutdown stops them before any atexit
    # hook runs (the save would stay `N.orbax-checkpoint-tmp`). This is the
    # hook concurrent.futures itself uses; hooks run newest first.
    runtime.before_thread_pools_stop(self._finalizer)

  # --- Writing.
  def save(self, step: int, state: Any, *, extra: dict | None = None, force: bool = False) -> bool:
    """Saves `state` (a train state or any pytree of arrays) at `step`.

    Args:
      step: the training step; names the checkpoint.
      state: a flax TrainState (its step, params and opt_state are saved) or
        any pytree of arrays (e.g. NNX `nnx.state(model)`).
      extra: more arrays to resume exactly: RNG keys (typed keys are fine),
        the data position, ...; nested dicts, lists and tuples of them too.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a checkpoint was started.

    Raises:
      TypeError: `extra` holds something other than arrays in dicts, lists
        and tuples.
    """
    extra = extra or {}
    structure = _structure(extra, "['extra']")
    state_tree = _state_tree(state)
    if 'opt_state' in state_tree:
      # The layout on disk is logical: leaves padded for the optimizer
      # (policy='pad') are saved at their true size.
      pads = _state_padding(state, _plan_of(state))
      leaves, treedef = jax.tree.flatten(state_tree['opt_state'])
      state_tree['opt_state'] = jax.tree.unflatten(
        treedef, [_unpad_leaf(x, pad) for x, pad in zip(leaves, pads)]
      )
    tree = {'state': state_tree, 'extra': jax.tree.map(_as_array, extra)}
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
      'extra_structure': structure,
      'checksums': _checksums(tree),
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
    """Finishes pending saves and releases the folder."""
    self._finalizer()

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

  def incomplete(self) -> list[str]:
    """Folders of saves that never committed (killed mid-save), oldest name first."""
    return sorted(glob.glob(os.path.join(self.directory, '*' + _TMP_SUFFIX)))

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
        ShapeDtypeStructs with shardings (e.g. `zerojax.inspect.abstract_train_state`
        on another mesh or stage). Each device reads only its own shards.
      step: which checkpoint; default the latest committed one.
      extra: the structure of the saved `extra` (arrays or ShapeDtypeStructs);
        default: what was saved, replicated.

    Returns:
      (restored state, restored extra).

    Raises:
      FileNotFoundError: no such committed step, or a file of it is missing.
      ValueError: the target's tree, shapes or dtypes differ from the
        checkpoint's (naming the first mismatching path and both); an array's
        bytes differ from the checksum recorded at save (naming the step, the
        path and where it is stored); or orbax cannot decode a file.
    """
    step = self._step_or_latest(step)
    meta = self.metadata(step)
    state_tree = _state_tree(target)
    rep = _replicated_on_target(target)
    if extra is None:
      extra_target = _saved_extra(meta, rep)
    else:
      extra_target = _abstract(_encode_keys(extra)[0])
    abstract_state = _abstract(state_tree)
    pads = []
    if 'opt_state' in abstract_state:
      # Leaves the target pads for the optimizer are read at their logical size
      # (replicated), then padded into the target's layout below.
      pads = _state_padding(target, _plan_of(target))
      leaves, treedef = jax.tree.flatten(abstract_state['opt_state'])
      abstract_state['opt_state'] = jax.tree.unflatten(
        treedef,
        [x if pad is None else _logical_struct(x, pad, rep) for x, pad in zip(leaves, pads)],
      )
    wanted = {'state': abstract_state, 'extra': extra_target}
    wanted = jax.tree.map(lambda x: _with_default_sharding(x, rep), wanted)
    _check_against(meta, wanted, self.directory, step)
    try:
      out = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(wanted)),
      )['state']
    except Exception as e:  # TensorStore: truncated, missing or undecodable files
      e.add_note(
        f'zerojax: checkpoint step {step} in {self.directory} could not be read from'
        f' {os.path.join(self.directory, str(step), "state")} (its files are damaged, or it'
        f' was not written by this model and optimizer). Restore another step (committed:'
        f' {self.all_steps()}) or save it again.'
      )
      raise
    _verify(meta, out, self.directory, step)
    out = _decode_keys(out, meta['prng_keys'])
    restored = out['state']
    if 'opt_state' in restored and any(p is not None for p in pads):
      target_leaves = jax.tree.leaves(_abstract(state_tree['opt_state']))
      leaves, treedef = jax.tree.flatten(restored['opt_state'])
      restored['opt_state'] = jax.tree.unflatten(
        treedef,
        [
          x if pad is None else _pad_into(x, pad, t)
          for x, pad, t in zip(leaves, pads, target_leaves)
        ],
      )
    if 'step' in restored:
      state = target.replace(
        step=restored['step'], params=restored['params'], opt_state=restored['opt_state']
      )
    else:
      state = restored['tree']
    return state, out['extra']


def _finish(manager: Any) -> None:
  manager.wait_until_finished()
  manager.close()


def _logical_struct(x: jax.ShapeDtypeStruct, pad: tuple[int, int], rep: Any):
  shape = list(x.shape)
  shape[pad[0]] = pad[1]
  return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=rep)


def _pad_into(x: jax.Array, pad: tuple[int, int], target: jax.ShapeDtypeStruct) -> jax.Array:
  """A logical leaf zero-padded to the target's padded shape, in the target's layout."""
  dim = pad[0]
  widths = [(0, 0)] * x.ndim
  widths[dim] = (0, target.shape[dim] - x.shape[dim])
  return jax.jit(lambda v: jnp.pad(v, widths), out_shardings=target.sharding)(x)


def _with_default_sharding(x: jax.ShapeDtypeStruct, rep: Any) -> jax.ShapeDtypeStruct:
  """Leaves that carry no sharding (Python scalars, numpy) are read replicated."""
  if x.sharding is not None:
    return x
  sharding = rep or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _verify(meta: dict, restored: Any, directory: str, step: int) -> None:
  """Compares each restored array with the checksum recorded at save."""
  recorded = meta.get('checksums')
  if recorded is None:  # written by zerojax before checksums were recorded
    return
  got = _checksums(restored)
  for path, value in got.items():
    want = recorded.get(path)
    if want is not None and list(want) != value:
      raise ValueError(
        f'checkpoint step {step} in {directory}: {path} does not match the checksum recorded'
        f' when it was saved (its bytes changed on disk afterwards); it is stored in'
        f' {os.path.join(directory, str(step), "state")}. Restore another step (committed:'
        f' {sorted(int(d) for d in os.listdir(directory) if d.isdigit())}) or save it again.'
      )


def _structure(tree: Any, where: str) -> Any:
  """A JSON description of `extra`'s containers, to rebuild it at restore.

  Raises:
    TypeError: a node that is not a dict, list, tuple, None or array.
  """
  if isinstance(tree, dict):
    bad = [k for k in tree if not isinstance(k, str)]
    if bad:
      raise TypeError(f'`extra`{where[9:]} has a key {bad[0]!r} that is not a string.')
    return {'dict': {k: _structure(v, f'{where}[{k!r}]') for k, v in tree.items()}}
  if isinstance(tree, (list, tuple)):
    kind = 'list' if isinstance(tree, list) else 'tuple'
    return {kind: [_structure(v, f'{where}[{i}]') for i, v in enumerate(tree)]}
  if tree is None:
    return {'none': None}
  if hasattr(tree, 'shape') and hasattr(tree, 'dtype') or isinstance(tree, (int, float, bool)):
    return {'leaf': where}
  raise TypeError(
    f'`extra`{where[9:]} is a {type(tree).__name__}; extra holds arrays (or Python numbers)'
    ' in dicts, lists and tuples.'
  )


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
  """ShapeDtypeStructs for the saved `extra`, in its saved structure, rebuilt from the metadata."""
  leaves = meta['leaves']

  def build(node):
    kind, value = next(iter(node.items()))
    if kind == 'dict':
      return {k: build(v) for k, v in value.items()}
    if kind in ('list', 'tuple'):
      items = [build(v) for v in value]
      return items if kind == 'list' else tuple(items)
    if kind == 'none':
      return None
    leaf = leaves[value]
    return jax.ShapeDtypeStruct(tuple(leaf['shape']), np.dtype(leaf['dtype']), sharding=sharding)

  structure = meta.get('extra_structure')
  if structure is not None:
    return build(structure)
  # Checkpoints written before the structure was recorded: flat dicts.
  out = {}
  for path, leaf in leaves.items():
    if path.startswith("['extra']"):
      out[path[len("['extra']['") : -2]] = jax.ShapeDtypeStruct(
        tuple(leaf['shape']), np.dtype(leaf['dtype']), sharding=sharding
      )
  return out


def _decode_keys(tree: Any, impls: dict) -> Any:
  """Raw key data back into typed PRNG keys, wherever they were in the saved tree."""

  def decode(path, x):
    impl = impls.get(jax.tree_util.keystr(path))
    return jax.random.wrap_key_data(x, impl=impl) if impl else x

  return jax.tree_util.tree_map_with_path(decode, tree)


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


def restore_train_state(
  directory: str | os.PathLike,
  init_fn: Callable[..., optax.Params],
  *init_args: Any,
  tx: optax.GradientTransformation,
  step: int | None = None,
  **kwargs: Any,
) -> tuple[Any, dict]:
  """Restores a train state into `tx`'s stage and mesh, whatever it was saved on.

  Builds the target abstractly (`zerojax.inspect.abstract_train_state`), then reads each
  device's shards straight into it. `tx` is the optimizer wrapped by
  `zerojax.zero_stage` for the new layout; `kwargs` (`apply_fn`, `param_dtype`,
  ...) are as for `create_train_state`.

  Returns:
    (train state, extra).
  """
  target = train_state_lib.abstract_train_state(init_fn, *init_args, tx=tx, **kwargs)
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
  """A description of a checkpoint folder: steps, stage, mesh, per-leaf shapes and bytes.

  Folders of saves killed before they committed are listed, not removed.
  """
  with Checkpointer(directory, async_save=False, clean_incomplete=False) as ckpt:
    steps = ckpt.all_steps()
    incomplete = [os.path.basename(p) for p in ckpt.incomplete()]
    note = (
      f'incomplete saves (killed before committing; never restored, removed when a'
      f' Checkpointer next opens the folder): {", ".join(incomplete)}'
    )
    if not steps:
      return '\n'.join(
        [f'{ckpt.directory}: no committed checkpoints'] + ([note] if incomplete else [])
      )
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
  if incomplete:
    lines.append(note)
  return '\n'.join(lines)
