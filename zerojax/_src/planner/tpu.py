"""TPUs: is this machine a TPU VM (answered before jax starts), and the devices of a
topology to compile for ahead of time, here or anywhere libtpu is installed."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from collections.abc import Mapping

import jax

# The TPU-node runtime (TPU chips behind a gRPC address) that Colab retired:
# jax has not supported it since 0.4, so a notebook cannot use it.
_RETIRED_NODE = 'COLAB_TPU_ADDR'


def local_tpu() -> str | None:
  """Describes the TPU chips attached to this machine, or returns None when there are none.

  It looks only at what a TPU VM exposes before any TPU software starts (so a
  notebook can decide whether to fake CPU devices before jax initialises): the
  `TPU_ACCELERATOR_TYPE` variable that TPU VMs set (Colab's v2-8, v5e-1 and
  v6e-1 runtimes are TPU VMs), the `/dev/accel*` devices of TPU v2-v4 and v5p,
  and the `/dev/vfio/<n>` devices of v5e and v6e when libtpu is installed.

  Raises:
    RuntimeError: on Colab's retired TPU-node runtime (`COLAB_TPU_ADDR`),
      which current jax cannot use; the message names the runtimes to pick.

  >>> found = local_tpu()  # e.g. 'TPU VM v5litepod-1: 1 chip(s) at /dev/vfio'
  >>> found is None or found.startswith('TPU VM')
  True
  """
  return _probe(os.environ, '/dev', importlib.util.find_spec('libtpu') is not None)


def _probe(environ: Mapping[str, str], dev: str, has_libtpu: bool) -> str | None:
  accel = _entries(dev, lambda name: name.startswith('accel') and name[5:].isdigit())
  vfio = _entries(os.path.join(dev, 'vfio'), str.isdigit) if has_libtpu else []
  kind = environ.get('TPU_ACCELERATOR_TYPE')
  chips = len(accel) or len(vfio)
  if kind or chips:
    where = (
      f'{len(accel)} chip(s) at {dev}/accel*'
      if accel
      else f'{len(vfio)} chip(s) at {dev}/vfio'
      if vfio
      else 'chips not listed'
    )
    return f'TPU VM {kind or "(type not set)"}: {where}'
  if _RETIRED_NODE in environ:
    raise RuntimeError(
      f'{_RETIRED_NODE} is set: this is the retired TPU-node runtime, which current jax'
      ' cannot use. Pick a TPU VM runtime instead (in Colab: Runtime > Change runtime'
      ' type > v5e-1, v6e-1 or v2-8).'
    )
  return None


def _entries(folder: str, keep) -> list[str]:
  try:
    return sorted(name for name in os.listdir(folder) if keep(name))
  except OSError:  # no such folder, or not readable: no chips there
    return []


# The TPU compilers the supported jax versions pair with (libtpu 0.0.42 and 0.0.50) end the
# process when they compile for this many slices or more (a failed check in their
# cross-slice rewrites, "NumSlices() < kMaxNumSlices (512 vs. 512)"), which no caller can
# catch; the planner refuses such a count first.
MAX_TPU_SLICES = 512


def topology_devices(topology: str, slices: int = 1) -> list:
  """The devices of `slices` slices of `topology`: 'cpu:N' (faked CPU devices, N per
  slice) or a TPU name like 'v5e:2x4', slice by slice.

  TPU devices come from `jax.experimental.topologies` (libtpu compiles for them
  ahead of time; no TPU is needed); over several slices each carries its
  `slice_index`, and collectives between slices cross the data-center network.

  Raises:
    ValueError: too few CPU devices, a slice count below 1 (or, for TPU, at or above
      `MAX_TPU_SLICES`), or a TPU topology libtpu cannot describe (naming the install
      and the form of the name).
  """
  if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
    raise ValueError(f'the number of slices must be a whole number >= 1, got {slices!r}.')
  if topology.startswith('cpu:'):
    n = int(topology.split(':', 1)[1]) * slices
    devices = jax.devices('cpu')
    if len(devices) < n:
      raise ValueError(
        f'--topology {topology} needs {n} CPU devices but jax has {len(devices)};'
        ' it must be set before jax starts (python -m zerojax sets it when nothing else'
        ' has initialised jax first).'
      )
    return devices[:n]
  if slices >= MAX_TPU_SLICES:
    raise ValueError(
      f'{slices} slices of {topology}: the TPU compiler stops the process when it compiles for'
      f' {MAX_TPU_SLICES} slices or more (libtpu 0.0.42 and 0.0.50); plan at most'
      f' {MAX_TPU_SLICES - 1}, or fewer, larger slices.'
    )
  from jax.experimental import topologies

  extra = {'num_slices': slices} if slices > 1 else {}
  extra |= _one_host_bounds(topology)
  try:
    with quiet_libtpu():
      desc = topologies.get_topology_desc(topology_name=topology, platform='tpu', **extra)
  except Exception as e:  # libtpu missing or an unknown topology name
    if importlib.util.find_spec('libtpu') is None:
      fix = (
        "the TPU compiler is not installed: `pip install 'jax[tpu]'` (libtpu; zerojax's tpu extra)."
      )
    else:
      fix = (
        f'libtpu {importlib.metadata.version("libtpu")} cannot form that slice; name one it'
        ' can, like v5e:2x4, v5e:4x4, v5e:16x16, v5p:2x2x1, v5p:4x4x4 or v4:2x2x1.'
      )
    raise ValueError(f'cannot compile for TPU topology {topology!r}: {e}\n{fix}') from None
  devices = list(desc.devices)
  # Slice by slice, each in the order libtpu lists it.
  return sorted(devices, key=lambda d: getattr(d, 'slice_index', 0) or 0)


# The chips one host of v5e and v6e holds by default (libtpu's chips_per_host_bounds), the
# least slice libtpu forms unless told the host holds fewer: Colab's one-chip runtimes, v5e-1
# and v6e-1, are hosts of one chip.
_HOST_CHIPS = 4


def _one_host_bounds(topology: str) -> dict:
  """libtpu's `chips_per_host_bounds` for a v5e or v6e slice of fewer chips than one host
  holds by default (v5e:1x1, v6e:1x1, v5e:1x2): the whole slice on one host; else nothing."""
  chip, _, dims = topology.partition(':')
  try:
    shape = [int(d) for d in dims.lower().split('x')]
  except ValueError:
    return {}
  if chip not in ('v5e', 'v6e') or len(shape) != 2 or shape[0] * shape[1] >= _HOST_CHIPS:
    return {}
  return {'chips_per_host_bounds': [*shape, 1]}


# What libtpu prints to stderr when it starts on a machine without a TPU: it
# looks for the TPU VM it runs on, which ahead-of-time compilation does not need.
_LIBTPU_NOISE = (
  'TPU_ACCELERATOR_TYPE',
  'TPU_WORKER_HOSTNAMES',
  'Logging before InitGoogle',
  'Source Location Trace',
  'libtpu_init_utils',
)


@contextlib.contextmanager
def quiet_libtpu():
  """Drops libtpu's start-up complaints from stderr (C++ writes them to fd 2); keeps the rest."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode='w+b') as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors='replace').splitlines(keepends=True):
        if not any(noise in line for noise in _LIBTPU_NOISE):
          sys.stderr.write(line)
