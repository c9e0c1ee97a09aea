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

Preemption (`save_on_preemption=True`): the notice is SIGTERM. In one process
a handler notes it and the next `save` writes that step; with several
processes JAX's own preemption service (started by `jax.distributed`) catches
SIGTERM on whichever host gets it and picks the step every process reaches
next, so all save the same step. The save commits before `save` raises
`Preempted`, a SystemExit with code 143 (128 + SIGTERM, what a job scheduler
reads as terminated by SIGTERM).
"""

from __future__ import annotations

import base64
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import warnings
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

# What a preempted process exits with: 128 + SIGTERM, as if the signal had ended it.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(SystemExit):
  """Raised by `Checkpointer.save` once the checkpoint of a preemption notice is committed.

  A `SystemExit` with code 143 (`PREEMPTED_EXIT_CODE`): uncaught, the process
  ends with that code after `finally` blocks and `with` exits have run. Catch
  it to exit with another code, or to do more before exiting.

  Attributes:
    step: the step saved.
    directory: the checkpoint folder.
  """

  def __init__(self, step: int, directory: str):
    super().__init__(PREEMPTED_EXIT_CODE)
    self.step = step
    self.directory = directory

  def __str__(self) -> str:
    return (
      f'preempted: checkpoint step {self.step} is committed in {self.directory}; exiting'
      f' with code {PREEMPTED_EXIT_CODE}'
    )


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


class _SigtermNotice:
  """One process's preemption notice: SIGTERM noted by a handler instead of ending the process.

  The previous handler comes back on `uninstall`; a notice no save acted on is
  then delivered to it, so the process still ends as it was asked to.
  """

  def __init__(self, directory: str):
    if threading.current_thread() is not threading.main_thread():
      raise ValueError(
        'Checkpointer(save_on_preemption=True) installs a SIGTERM handler, which Python allows'
        ' only in the main thread: create the Checkpointer there.'
      )
    self.directory = directory
    self.received: float | None = None  # time.monotonic() of the first SIGTERM
    self.repeats = 0
    self.acted = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum: int, frame: Any) -> None:
    del signum, frame
    if self.received is not None:
      self.repeats += 1  # a second notice changes nothing: the save is already due
      return
    self.received = time.monotonic()
    print(
      f'zerojax: SIGTERM received; the next Checkpointer.save saves that step in'
      f' {self.directory}, then the process exits with code {PREEMPTED_EXIT_CODE}',
      file=sys.stderr,
      flush=True,
    )

  def uninstall(self) -> None:
    if signal.getsignal(signal.SIGTERM) == self._handle:
      signal.signal(signal.SIGTERM, self._previous)
    if self.received is not None and not self.acted:
      print(
        'zerojax: SIGTERM arrived but no Checkpointer.save came after it; passing it on',
        file=sys.stderr,
        flush=True,
      )
      os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _interrupts_held():
  """Holds Ctrl-C (SIGINT) while a preemption save commits (the process exits after it)."""
  if threading.current_thread() is not threading.main_thread():
    yield []
    return
  held: list[int] = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
  try:
    yield held
  finally:
    signal.signal(signal.SIGINT, previous)


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
    save_on_preemption: on a preemption notice (SIGTERM), the next `save`
      writes its step whatever the interval, waits until it is committed and
      raises `Preempted` (exit code 143). Call `save` every step for this. In
      one process a SIGTERM handler notes the notice (created in the main
      thread; the previous handler returns on `close`). With several
      processes JAX's preemption service catches SIGTERM on any host and
      every process saves the same step (`jax.distributed` starts it; it
      needs `jax_enable_preemption_service`, on by default). A second SIGTERM
      changes nothing and Ctrl-C is held while that save commits; SIGKILL
      cannot be caught: the last committed step stays the latest.

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
    save_on_preemption: bool = False,
  ):
    self.directory = os.path.abspath(os.fspath(directory))
    self._notice = None
    if save_on_preemption and jax.process_count() > 1:
      if not jax.config.jax_enable_preemption_service:
        raise ValueError(
          "Checkpointer(save_on_preemption=True) with several processes needs JAX's"
          ' preemption service, which picks the step every process saves; it is off'
          ' (jax_enable_preemption_service=False). Turn it on before'
          ' zerojax.distributed.initialize.'
        )
    elif save_on_preemption:
      self._notice = _SigtermNotice(self.directory)
    self.save_on_preemption = bool(save_on_preemption)
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
    self._finalizer = weakref.finalize(self, _finish, self._manager, self._notice)
    # At exit, before the thread pools shut down: orbax commits a background
    # save on them, and interpreter shutdown stops them before any atexit
    # hook runs (the save would stay `N.orbax-checkpoint-tmp`). This is the
    # hook concurrent.futures itself uses; hooks run newest first.
    runtime.before_thread_pools_stop(self._finalizer)

  # --- Writing.
  def save(
    self,
    step: int,
    state: Any,
    *,
    extra: dict | None = None,
    global_batch: int | None = None,
    micro_batches: int = 1,
    data_iterator: Any = None,
    force: bool = False,
  ) -> bool:
    """Saves `state` (a train state or any pytree of arrays) at `step`.

    Args:
      step: the training step; names the checkpoint.
      state: a flax TrainState (its step, params and opt_state are saved) or
        any pytree of arrays (e.g. NNX `nnx.state(model)`).
      extra: more arrays to resume exactly: RNG keys (typed keys are fine),
        the data position, ...; nested dicts, lists and tuples of them too.
      global_batch: the rows of one step, all devices together. Recorded, so
        that `restore(..., global_batch=...)` refuses another one and
        `micro_batches_for` can keep the micro-batch size on another mesh.
      micro_batches: the `micro_batches` of `zerojax.value_and_grad` in this
        run (recorded with `global_batch`).
      data_iterator: a data pipeline that zerojax does not own, with
        `get_state()` and `set_state(state)` (grain's iterators have them):
        each process's state (JSON-serialisable, or bytes) is saved with the
        step, for `restore(..., data_iterator=...)`. Every process passes its own.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a checkpoint was started.

    Raises:
      Preempted: with `save_on_preemption`, after a preemption notice, once
        this step's checkpoint is committed.
      TypeError: `extra` holds something other than arrays in dicts, lists
        and tuples; `data_iterator` has no `get_state`, or its state is
        neither JSON-serialisable nor bytes.
      ValueError: `global_batch` does not split into the devices and
        `micro_batches`.
    """
    run = self._run_record(state, global_batch, micro_batches)
    if self.reached_preemption(step):
      self._save_and_exit(step, state, extra, run, data_iterator)
    return self._save(step, state, extra, run, data_iterator, force=force)

  def reached_preemption(self, step: int) -> bool:
    """Whether a preemption notice came and `step` is the one to save (False without
    `save_on_preemption`). With several processes every process must ask at every step."""
    if not self.save_on_preemption:
      return False
    if self._notice is not None:
      return self._notice.received is not None
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(int(step)))

  def _save_and_exit(
    self, step: int, state: Any, extra: dict | None, run: dict | None, data_iterator: Any
  ) -> None:
    """Saves `step` and waits for it (a second signal changes nothing); raises Preempted."""
    t0 = time.monotonic()
    with _interrupts_held() as held:
      if self._notice is not None:
        self._notice.acted = True
      if step not in self.all_steps():
        self._save(step, state, extra, run, data_iterator, force=True, reason='preemption')
      self._manager.wait_until_finished()
    who = f'process {jax.process_index()}: ' if jax.process_count() > 1 else ''
    repeats = 0 if self._notice is None else self._notice.repeats
    more = [f'{repeats} more SIGTERM ignored'] * bool(repeats) + ['Ctrl-C held'] * bool(held)
    print(
      f'zerojax: {who}preemption notice: checkpoint step {step} committed in {self.directory}'
      f' in {time.monotonic() - t0:.1f} s'
      + (f' ({", ".join(more)})' if more else '')
      + f'; exiting with code {PREEMPTED_EXIT_CODE}. Restart with the same folder to resume.',
      file=sys.stderr,
      flush=True,
    )
    raise Preempted(step, self.directory)

  def _run_record(self, state: Any, global_batch: int | None, micro_batches: int) -> dict | None:
    """The batch split to carry over: global rows, micro-batches, rows per micro-batch part."""
    if global_batch is None:
      return None
    for name, value, low in (
      ('global_batch', global_batch, 1),
      ('micro_batches', micro_batches, 1),
    ):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f'Checkpointer.save({name}=...) must be a positive int, got {value!r}.')
    config = transform.config_of(getattr(state, 'tx', None))
    # The devices the rows split over: the data-parallel replica axes and the ZeRO axes.
    devices = (
      mesh_lib.axes_size(config.mesh, config.replica_axes + config.axes)
      if config is not None
      else jax.device_count()
    )
    if global_batch % (devices * micro_batches):
      raise ValueError(
        f'Checkpointer.save(global_batch={global_batch}, micro_batches={micro_batches}): the'
        f' global batch does not split into {devices} devices x {micro_batches} micro-batches;'
        ' pass the rows of one whole step and the micro_batches given to value_and_grad.'
      )
    return {
      'global_batch': int(global_batch),
      'micro_batches': int(micro_batches),
      'devices': int(devices),
      'micro_batch_rows': int(global_batch) // (devices * int(micro_batches)),
    }

  def _save(
    self,
    step: int,
    state: Any,
    extra: dict | None,
    run: dict | None,
    data_iterator: Any,
    *,
    force: bool,
    reason: str | None = None,
  ) -> bool:
    if not force and not self._manager.should_save(step):
      return False  # nothing to gather or checksum off the interval
    data_states = None
    if data_iterator is not None:
      data_states = _gather_process_states(_iterator_state(data_iterator))
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
      'replica_axes': None if config is None else list(config.replica_axes),
      'kind': 'train_state' if 'step' in tree['state'] else 'pytree',
      'prng_keys': key_impls,
      'leaves': _leaf_table(tree),
      'extra_structure': structure,
      'checksums': _checksums(tree),
      'run': run,
      'reason': reason,
      'data_iterator': data_states,
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

  def micro_batches_for(self, tx: optax.GradientTransformation, step: int | None = None) -> int:
    """The `micro_batches` for `zerojax.value_and_grad` that resume `step`'s run on `tx`'s mesh.

    It keeps the rows of each micro-batch part as saved, so every part holds
    the same rows and folds the same index into the loss's random keys as in
    the saved run, on any device count that divides its parts.

    Raises:
      ValueError: the checkpoint records no batch split (saved without
        `global_batch`), or its parts do not divide over `tx`'s devices.
    """
    step = self._step_or_latest(step)
    run = self.metadata(step).get('run')
    if not run:
      raise ValueError(
        f'checkpoint step {step} in {self.directory} records no batch split: save with'
        ' Checkpointer.save(..., global_batch=..., micro_batches=...) to carry it over.'
      )
    config = transform.require_config(tx)
    devices = mesh_lib.axes_size(config.mesh, config.replica_axes + config.axes)
    parts = run['global_batch'] // run['micro_batch_rows']
    if parts % devices:
      raise ValueError(
        f'checkpoint step {step} in {self.directory} splits its global batch of'
        f' {run["global_batch"]} rows into {parts} micro-batch parts of'
        f' {run["micro_batch_rows"]} rows ({run["devices"]} devices x {run["micro_batches"]}),'
        f' which do not divide over {devices} devices. Resume on a device count that divides'
        f' {parts}; any other split draws different random numbers per row.'
      )
    return parts // devices

  def metadata(self, step: int | None = None) -> dict:
    """What was saved at `step` (default: latest): stage, mesh, version, leaves."""
    step = self._step_or_latest(step)
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def restore(
    self,
    target: Any,
    step: int | None = None,
    *,
    extra: Any = None,
    global_batch: int | None = None,
    data_iterator: Any = None,
  ) -> tuple[Any, dict]:
    """Restores the checkpoint at `step` (default: latest) into `target`'s layout.

    Args:
      target: a train state or pytree laid out as wanted: arrays, or
        ShapeDtypeStructs with shardings (e.g. `zerojax.inspect.abstract_train_state`
        on another mesh or stage). Each device reads only its own shards.
      step: which checkpoint; default the latest committed one.
      extra: the structure of the saved `extra` (arrays or ShapeDtypeStructs);
        default: what was saved, replicated.
      global_batch: this run's rows per step, checked against the one saved
        (a different global batch is a different run).
      data_iterator: gets this process's saved state (`set_state`), after
        the arrays are restored. Only on the process count it was saved
        from: an iterator's state is its process's share of the data.

    Returns:
      (restored state, restored extra).

    Raises:
      FileNotFoundError: no such committed step.
      ValueError: the checkpoint was written by a newer zerojax; the global
        batch differs from the one saved; the target's tree, shapes or dtypes
        differ from the checkpoint's (naming the first mismatching path and
        both); an array's bytes differ from the checksum recorded at save
        (naming the step, the path and where it is stored); or orbax cannot
        read an array (a truncated, missing or undecodable data file: naming the step and
        the first array that cannot be read, with TensorStore's error chained
        as the cause).
    """
    step = self._step_or_latest(step)
    meta = self.metadata(step)
    _check_version(meta, self.directory, step)
    if global_batch is not None:
      _check_global_batch(meta, global_batch, self.directory, step)
    data_state = None
    if data_iterator is not None:
      data_state = _saved_iterator_state(meta, data_iterator, self.directory, step)
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
    except Exception as e:  # TensorStore: truncated, missing or undecodable data files
      raise _unreadable(self.directory, step, wanted, self.all_steps()) from e
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
    if data_iterator is not None:  # last: nothing is changed if the arrays fail to restore
      data_iterator.set_state(data_state)
    return state, out['extra']


def _iterator_state(iterator: Any) -> dict:
  """`iterator.get_state()` as JSON: {'json': value} or {'bytes': base64 text}."""
  if not callable(getattr(iterator, 'get_state', None)) or not callable(
    getattr(iterator, 'set_state', None)
  ):
    raise TypeError(
      f'Checkpointer.save(data_iterator=...) takes an object with get_state() and'
      f" set_state(state) (as grain's iterators have); got a {type(iterator).__name__}. For a"
      ' pipeline that is a function of the step, save the step in `extra` instead.'
    )
  value = iterator.get_state()
  if isinstance(value, (bytes, bytearray)):
    return {'bytes': base64.b64encode(bytes(value)).decode('ascii')}
  try:
    json.dumps(value)
  except (TypeError, ValueError) as e:
    raise TypeError(
      f'Checkpointer.save(data_iterator=...): {type(iterator).__name__}.get_state() returned'
      f' a {type(value).__name__} that is neither bytes nor JSON-serialisable ({e}); return'
      ' numbers, strings, lists and dicts of them, or bytes.'
    ) from None
  return {'json': value}


def _gather_process_states(state: dict) -> list[dict]:
  """Every process's iterator state, in process order (one per process; a collective)."""
  if jax.process_count() == 1:
    return [state]
  from jax.experimental import multihost_utils

  data = np.frombuffer(json.dumps(state).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([data.size], np.int64))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[: data.size] = data
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(rows, np.ravel(lengths))]


def _saved_iterator_state(meta: dict, iterator: Any, directory: str, step: int) -> Any:
  """This process's saved iterator state, decoded; raises if it cannot be this process's."""
  states = meta.get('data_iterator')
  if not states:
    raise ValueError(
      f'checkpoint step {step} in {directory} holds no data iterator state (it was saved'
      ' without Checkpointer.save(data_iterator=...)); restore without data_iterator= and'
      ' position the pipeline from `extra`.'
    )
  if len(states) != jax.process_count():
    raise ValueError(
      f'checkpoint step {step} in {directory} holds the data iterator states of'
      f' {len(states)} process(es); this run has {jax.process_count()}. An iterator state is one'
      " process's share of the data and does not map onto another process count: resume on"
      f' {len(states)} process(es), or make the pipeline a function of the step (saved in'
      ' `extra`) and restore without data_iterator=.'
    )
  if not callable(getattr(iterator, 'set_state', None)):
    raise TypeError(
      f'Checkpointer.restore(data_iterator=...) needs set_state(state); a'
      f' {type(iterator).__name__} has none.'
    )
  saved = states[jax.process_index()]
  return base64.b64decode(saved['bytes']) if 'bytes' in saved else saved['json']


def _version_tuple(version: str) -> tuple[int, ...]:
  """'0.2.0' -> (0, 2, 0); the release's numbers, local and pre-release parts dropped."""
  match = re.match(r'\d+(\.\d+)*', version)
  return tuple(int(x) for x in match.group(0).split('.')) if match else ()


def _check_version(meta: dict, directory: str, step: int) -> None:
  saved = str(meta.get('zerojax_version', ''))
  if _version_tuple(saved) > _version_tuple(_version()):
    raise ValueError(
      f'checkpoint step {step} in {directory} was written by zerojax {saved}, newer than'
      f' this zerojax {_version()}; its layout may hold what this version cannot read.'
      f' Upgrade zerojax to {saved} or later (pip install -U zerojax) to restore it.'
    )


def _check_global_batch(meta: dict, global_batch: int, directory: str, step: int) -> None:
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


def _finish(manager: Any, notice: _SigtermNotice | None = None) -> None:
  try:
    manager.wait_until_finished()
    manager.close()
  finally:
    if notice is not None:
      notice.uninstall()


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


def _unreadable(directory: str, step: int, wanted: Any, committed: list[int]) -> ValueError:
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
  global_batch: int | None = None,
  **kwargs: Any,
) -> tuple[Any, dict]:
  """Restores a train state into `tx`'s stage and mesh, whatever it was saved on.

  Builds the target abstractly (`zerojax.inspect.abstract_train_state`), then reads each
  device's shards straight into it. `tx` is the optimizer wrapped by
  `zerojax.zero_stage` for the new layout; `global_batch` is checked as in
  `Checkpointer.restore`; `kwargs` (`apply_fn`, `param_dtype`, ...) are as for
  `create_train_state`.

  Returns:
    (train state, extra).
  """
  target = train_state_lib.abstract_train_state(init_fn, *init_args, tx=tx, **kwargs)
  with Checkpointer(directory, async_save=False) as ckpt:
    return ckpt.restore(target, step, global_batch=global_batch)


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
    incomplete = ckpt.incomplete()
    note = [
      'incomplete saves (never restored; removed when a Checkpointer next opens the folder):'
    ] + [f'  {_describe_incomplete(path, steps)}' for path in incomplete]
    if not steps:
      return '\n'.join(
        [f'{ckpt.directory}: no committed checkpoints'] + (note if incomplete else [])
      )
    meta = ckpt.metadata(step)
  why = ', saved on a preemption notice' if meta.get('reason') == 'preemption' else ''
  lines = [
    f'{os.path.abspath(os.fspath(directory))}: steps {steps}',
    f'step {meta["step"]}: {meta["kind"]}, ZeRO stage {meta["stage"]}, mesh {meta["mesh"]},'
    f' axes {meta["axes"]}, zerojax {meta["zerojax_version"]}{why}',
  ]
  run = meta.get('run')
  if run:
    lines.append(
      f'batch: {run["global_batch"]} rows per step = {run["devices"]} devices x'
      f' {run["micro_batches"]} micro-batches x {run["micro_batch_rows"]} rows'
    )
  if meta.get('data_iterator'):
    lines.append(
      f'data iterator: the states of {len(meta["data_iterator"])} process(es), restored only on'
      ' as many'
    )
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
    lines.extend(note)
  return '\n'.join(lines)


def _describe_incomplete(path: str, committed: list[int]) -> str:
  """One save that never committed: its step, what it wrote, when, and what restores instead."""
  name = os.path.basename(path)
  step = name.split('.')[0]
  files, written, last = 0, 0, os.path.getmtime(path)
  for folder, _, names in os.walk(path):
    for f in names:
      info = os.stat(os.path.join(folder, f))
      files, written, last = files + 1, written + info.st_size, max(last, info.st_mtime)
  older = [s for s in committed if not step.isdigit() or s < int(step)]
  instead = f'step {older[-1]} restores instead' if older else 'no earlier step to restore'
  return (
    f'{name}: step {step}, {files} files, {written:,} bytes written, last written'
    f' {time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last))}; killed mid-save, or still'
    f' being written by a running job; {instead}'
  )
