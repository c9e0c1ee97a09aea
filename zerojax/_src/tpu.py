"""Is this machine a TPU VM? Answered before jax starts, from what the machine exposes."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

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
