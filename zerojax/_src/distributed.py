"""Several processes, one mesh: start-up checks around `jax.distributed` and global batches.

zerojax has no launcher and no transport of its own: every process runs the same
script, `jax.distributed.initialize` joins them (gloo collectives on CPU), and
the mesh spans every process's devices. This module only adds what a researcher
needs on top: start-up that fails with a message instead of hanging, and helpers
that give each process its rows of the global batch.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax._src import mesh as mesh_lib
from zerojax._src import runtime

# Exit status of a process whose start-up timed out (the message is on stderr).
TIMEOUT_EXIT_CODE = 75


def _parse_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
      f'`coordinator_address`={address!r} is not HOST:PORT. Pass the address of the'
      ' machine that runs process 0 and a free port, e.g. "10.0.0.1:1234" (or'
      ' "127.0.0.1:1234" for several processes on one machine).'
    )
  return host, int(port)


def _wait_for_coordinator(host: str, port: int, deadline: float) -> bool:
  """Polls until something listens at host:port, or the deadline passes."""
  while True:
    try:
      with socket.create_connection((host, port), timeout=1.0):
        return True
    except OSError:
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.2)


def _backend_started() -> bool:
  """Whether jax has started a backend in this process, through public APIs only.

  jax refuses any change of `jax_num_cpu_devices` once a backend exists (a
  RuntimeError); before that, changing it and changing it back has no effect.
  """
  current = jax.config.jax_num_cpu_devices
  try:
    jax.config.update('jax_num_cpu_devices', current + 1 if current > 0 else 1)
  except RuntimeError:
    return True
  jax.config.update('jax_num_cpu_devices', current)
  return False


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  local_device_count: int | None = None,
  timeout_s: int = 300,
) -> None:
  """Joins this process to the others with `jax.distributed.initialize`, or fails fast.

  Call it first, before any other jax call, in every process. On TPU pods and
  SLURM/Open MPI clusters JAX finds the coordinator itself: call it with no
  arguments. Elsewhere (GPU hosts, or several processes on one machine for
  testing) pass the same `coordinator_address` and `num_processes` to every
  process and a distinct `process_id` in 0..num_processes-1; process 0 hosts the
  coordinator.

  What it adds to `jax.distributed.initialize`:
  - on CPU, JAX's gloo collectives are switched on, and `local_device_count`
    fakes that many devices per process;
  - the arguments are checked before anything starts;
  - a process that does not reach the coordinator, or whose peers do not all
    join, stops after `timeout_s` with a message saying which (exit status 75)
    instead of waiting forever or aborting with a C++ stack trace;
  - afterwards, every process must have the same number of devices.

  Args:
    coordinator_address: "HOST:PORT" of process 0; None to let JAX detect it.
    num_processes: how many processes take part.
    process_id: this process's index.
    local_device_count: CPU only: fake this many devices in this process.
    timeout_s: how long start-up may take, in seconds.

  Raises:
    ValueError: bad arguments, or processes with different device counts.
    RuntimeError: jax already started its backend, or no coordinator is
      listening at `coordinator_address` within `timeout_s`.
  """
  explicit = coordinator_address is not None
  _check_arguments(coordinator_address, num_processes, process_id, timeout_s)
  _set_up_backend(local_device_count)
  who = f'process {process_id} of {num_processes}' if explicit else 'this process'
  deadline = time.monotonic() + timeout_s
  if explicit and process_id != 0:
    _wait_or_fail(coordinator_address, deadline, who, timeout_s)
  done = threading.Event()
  where = f' at {coordinator_address}' if explicit else ''
  watchdog = functools.partial(_watchdog, done, deadline, who, where, num_processes, timeout_s)
  threading.Thread(target=watchdog, name='zerojax-init-watchdog', daemon=True).start()
  try:
    _join(coordinator_address, num_processes, process_id, timeout_s)
  finally:
    done.set()
  _check_device_counts()


def _check_arguments(coordinator_address, num_processes, process_id, timeout_s) -> None:
  """Raises ValueError on a bad launch, RuntimeError where jax's backend already started."""
  if coordinator_address is not None:
    _parse_address(coordinator_address)
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
      raise ValueError(
        f'`num_processes` must be a positive int when `coordinator_address` is given,'
        f' got {num_processes!r}. Pass the number of processes you launch.'
      )
    if (
      not isinstance(process_id, int)
      or isinstance(process_id, bool)
      or not 0 <= process_id < num_processes
    ):
      raise ValueError(
        f'`process_id` must be an int in 0..{num_processes - 1} (num_processes='
        f'{num_processes}), got {process_id!r}. Give each process its own index.'
      )
  if not isinstance(timeout_s, int) or timeout_s < 1:
    raise ValueError(f'`timeout_s` must be a positive int (seconds), got {timeout_s!r}.')
  if _backend_started():
    raise RuntimeError(
      'jax has already started its backend in this process, so it can no longer join'
      ' other processes. Call zerojax.distributed.initialize(...) before any other jax'
      ' call (jax.devices(), creating arrays, jit).'
    )


def _set_up_backend(local_device_count: int | None) -> None:
  """On CPU: gloo collectives, and `local_device_count` faked devices."""
  platforms = os.environ.get('JAX_PLATFORMS', '') or str(jax.config.jax_platforms or '')
  on_cpu = platforms.split(',')[0] == 'cpu'
  if local_device_count is not None:
    if not on_cpu:
      raise ValueError(
        '`local_device_count` fakes CPU devices and needs JAX_PLATFORMS=cpu; on'
        ' GPUs and TPUs every process uses the accelerators it sees.'
      )
    jax.config.update('jax_num_cpu_devices', int(local_device_count))
  if on_cpu:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def _wait_or_fail(coordinator_address: str, deadline: float, who: str, timeout_s: int) -> None:
  """Waits for the coordinator to listen, or raises RuntimeError at the deadline."""
  host, port = _parse_address(coordinator_address)
  if not _wait_for_coordinator(host, port, deadline):
    raise RuntimeError(
      f'{who}: no coordinator is listening at {coordinator_address} after'
      f' {timeout_s} s. Start process 0 with the same coordinator address (it'
      ' hosts the coordinator), and check the host and port are reachable from here.'
    )


def _watchdog(done, deadline, who, where, num_processes, timeout_s) -> None:
  """Ends the process (the main thread is blocked inside JAX's runtime) where the processes
  have not all joined by the deadline."""
  if done.wait(max(deadline - time.monotonic(), 0.0)):
    return
  runtime.exit_from_watchdog(
    f'zerojax: {who}: not all processes joined the coordinator{where} within'
    f' {timeout_s} s. Check that {num_processes or "all"} processes were launched,'
    ' each with the same num_processes and coordinator address and its own'
    ' process_id, and that none of them failed at start-up.\n',
    TIMEOUT_EXIT_CODE,
  )


def _join(coordinator_address, num_processes, process_id, timeout_s) -> None:
  """`jax.distributed.initialize`; without a launch to detect, the error says what to pass."""
  try:
    jax.distributed.initialize(
      coordinator_address,
      num_processes,
      process_id,
      # The runtime's own deadlines sit past ours, so our message comes first.
      initialization_timeout=timeout_s + 30,
      shutdown_timeout_seconds=min(timeout_s, 300),
    )
  except ValueError as e:
    if coordinator_address is None:
      # JAX found no TPU pod, SLURM or Open MPI environment to read the launch from.
      e.add_note(
        'zerojax.distributed.initialize() was called without a launch: JAX detects TPU pods,'
        ' SLURM and Open MPI launches by itself. Elsewhere pass the launch explicitly, the same'
        ' address and count in every process and a distinct id each (process 0 hosts the'
        " coordinator): zerojax.distributed.initialize('HOST:PORT', num_processes=N,"
        ' process_id=i). For one process, do not call it.'
      )
    raise


def _check_device_counts() -> None:
  counts = np.bincount([d.process_index for d in jax.devices()], minlength=jax.process_count())
  if len(set(counts.tolist())) != 1:
    raise ValueError(
      'processes have different numbers of devices: '
      + ', '.join(f'process {i}: {c}' for i, c in enumerate(counts.tolist()))
      + '. Give every process the same number of devices (local_device_count on CPU).'
    )


def check_mesh(mesh: Mesh) -> Mesh:
  """Checks that `mesh` uses every device of every process, each once.

  A mesh built for another launch (another process count, or another number of
  devices per process) fails here, naming both counts, before anything is
  placed on it.

  Raises:
    ValueError: the mesh does not cover exactly `jax.devices()`.
  """
  mesh = mesh_lib.resolve_mesh(mesh)
  have = sorted(d.id for d in mesh.devices.flat)
  want = sorted(d.id for d in jax.devices())
  if have != want:
    raise ValueError(
      f'the mesh {dict(mesh.shape)} has {len(have)} devices but this launch has'
      f' {len(want)} ({jax.process_count()} process(es) x {jax.local_device_count()}'
      ' device(s)). Build the mesh from jax.devices() (e.g. jax.make_mesh((jax.device_count(),),'
      ' ("data",))), or launch the process count the mesh was made for.'
    )
  return mesh


def _batch_sharding(mesh: Mesh, axis: mesh_lib.AxisName) -> NamedSharding:
  axes = mesh_lib.resolve_axes(mesh, axis)
  return NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))


def process_batch_slice(
  global_batch_size: int, mesh: Mesh | None = None, *, axis: mesh_lib.AxisName = 'data'
) -> slice:
  """The rows of a global batch that this process loads, for `global_batch`.

  The batch's leading dimension is split over `axis`; this process's devices
  hold a contiguous run of rows (`jax.make_mesh` orders devices by process).

  Raises:
    ValueError: the batch size does not divide over `axis`, or this process's
      rows are not contiguous in the mesh.
  """
  mesh = mesh_lib.resolve_mesh(mesh)
  sharding = _batch_sharding(mesh, axis)
  n = mesh_lib.axes_size(mesh, mesh_lib.resolve_axes(mesh, axis))
  if global_batch_size % n:
    raise ValueError(
      f'the global batch of {global_batch_size} rows does not divide over the {n}'
      f' devices of axis {axis!r}. Use a multiple of {n}.'
    )
  rows = sorted(
    {
      (idx[0].start or 0, idx[0].stop or global_batch_size)
      for idx in sharding.addressable_devices_indices_map((global_batch_size,)).values()
    }
  )
  start, stop = rows[0][0], rows[-1][1]
  if any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
    raise ValueError(
      f'process {jax.process_index()} holds rows {rows} of the batch, which are not'
      " contiguous. Build the mesh with jax.make_mesh, which keeps each process's"
      ' devices together.'
    )
  return slice(start, stop)


def global_batch(local_batch: Any, mesh: Mesh | None = None, *, axis: mesh_lib.AxisName = 'data'):
  """Assembles each process's rows into global arrays split over `axis`.

  `local_batch` is a pytree of host arrays holding this process's rows (see
  `process_batch_slice`), the same tree in every process. With one process it
  is `jax.device_put(batch, NamedSharding(mesh, P(axis)))`.
  """
  mesh = mesh_lib.resolve_mesh(mesh)
  sharding = _batch_sharding(mesh, axis)

  def one(x):
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  return jax.tree.map(one, local_batch)


def to_numpy(tree: Any) -> Any:
  """The full value of every array in `tree` as numpy, in every process.

  Arrays split over several processes are gathered with
  `multihost_utils.process_allgather` (a collective: every process must call).
  """

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(one, tree)
