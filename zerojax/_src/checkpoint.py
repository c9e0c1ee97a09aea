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

This module is the `Checkpointer` (save and restore) and the data iterator's state; the
on-disk form is `codec`, the checksums and checks `integrity`, the notice `preemption`.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from zerojax._src import codec, distributed, integrity, preemption, runtime, transform
from zerojax._src import mesh as mesh_lib
from zerojax._src import train_state as train_state_lib

_TMP_SUFFIX = '.orbax-checkpoint-tmp'

PREEMPTED_EXIT_CODE = preemption.PREEMPTED_EXIT_CODE
Preempted = preemption.Preempted
_version_tuple = integrity.version_tuple  # read by the tests of the version check


def _version() -> str:
  """The version a save records (`integrity.version`)."""
  return integrity.version()


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
      self._notice = preemption.SigtermNotice(self.directory)
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
    with preemption.interrupts_held() as held:
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
    structure = codec.structure(extra, "['extra']")
    state_tree = codec.state_tree(state)
    if 'opt_state' in state_tree:
      # The layout on disk is logical: leaves padded for the optimizer
      # (policy='pad') are saved at their true size.
      pads = codec.state_padding(state, codec.plan_of(state))
      leaves, treedef = jax.tree.flatten(state_tree['opt_state'])
      state_tree['opt_state'] = treedef.unflatten(codec.to_logical(leaves, pads))
    tree = {'state': state_tree, 'extra': jax.tree.map(codec.as_array, extra)}
    tree, key_impls = codec.encode_keys(tree)
    tree = codec.global_leaves(tree, codec.replicated_on_target(state))
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
      'leaves': codec.leaf_table(tree),
      'extra_structure': structure,
      'checksums': integrity.checksums(tree),
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
    integrity.check_version(meta, self.directory, step)
    if global_batch is not None:
      integrity.check_global_batch(meta, global_batch, self.directory, step)
    data_state = None
    if data_iterator is not None:
      data_state = _saved_iterator_state(meta, data_iterator, self.directory, step)
    state_tree = codec.state_tree(target)
    rep = codec.replicated_on_target(target)
    if extra is None:
      extra_target = codec.saved_extra(meta, rep)
    else:
      extra_target = codec.abstract(codec.encode_keys(extra)[0])
    abstract_state = codec.abstract(state_tree)
    pads = []
    if 'opt_state' in abstract_state:
      # Leaves the target pads for the optimizer are read at their logical size
      # (replicated), then padded into the target's layout below.
      pads = codec.state_padding(target, codec.plan_of(target))
      leaves, treedef = jax.tree.flatten(abstract_state['opt_state'])
      abstract_state['opt_state'] = treedef.unflatten(codec.to_logical(leaves, pads, rep))
    wanted = {'state': abstract_state, 'extra': extra_target}
    wanted = jax.tree.map(lambda x: codec.with_default_sharding(x, rep), wanted)
    integrity.check_against(meta, wanted, self.directory, step)
    try:
      out = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(wanted)),
      )['state']
    except Exception as e:  # TensorStore: truncated, missing or undecodable data files
      raise integrity.unreadable(self.directory, step, wanted, self.all_steps()) from e
    integrity.verify(meta, out, self.directory, step)
    out = codec.decode_keys(out, meta['prng_keys'])
    restored = out['state']
    if 'opt_state' in restored and any(p is not None for p in pads):
      targets = jax.tree.leaves(codec.abstract(state_tree['opt_state']))
      leaves, treedef = jax.tree.flatten(restored['opt_state'])
      restored['opt_state'] = treedef.unflatten(codec.from_logical(leaves, pads, targets))
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


def _finish(manager: Any, notice: preemption.SigtermNotice | None = None) -> None:
  try:
    manager.wait_until_finished()
    manager.close()
  finally:
    if notice is not None:
      notice.uninstall()


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
