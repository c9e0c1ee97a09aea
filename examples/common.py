"""Shared set-up for the examples: faked devices, the mesh, logging, the memory table."""

from __future__ import annotations

import os
import sys


def setup_devices(n: int = 8) -> None:
  """Fakes `n` CPU devices unless real accelerators are asked for (JAX_PLATFORMS).

  Must run before jax initialises its backend.
  """
  if os.environ.get('JAX_PLATFORMS', 'cpu') == 'cpu':
    os.environ['JAX_PLATFORMS'] = 'cpu'
    flag = f'--xla_force_host_platform_device_count={n}'
    if flag not in os.environ.get('XLA_FLAGS', ''):
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()


def make_mesh():
  import jax
  from jax.sharding import AxisType

  return jax.make_mesh((len(jax.devices()),), ('data',), axis_types=(AxisType.Auto,))


def memory_table(plan, compiled) -> str:
  """Per-device bytes: the plan's model states and the compiled step's memory."""
  import zerojax

  sizes = plan.bytes_per_device()
  mem = zerojax.memory_stats(compiled)
  mib = lambda n: f'{n / 2**20:10.2f} MiB'
  rows = [
    ('params at rest', sizes['params']),
    ('grads (reduced)', sizes['grads']),
    ('optimizer state', sizes['opt_state']),
    ('step arguments', mem.argument),
    ('step temporaries', mem.temp),
    ('step peak (est.)', mem.peak),
  ]
  return '\n'.join(f'  {name:<18}{mib(value)}' for name, value in rows)


def progress(iterable, **kwargs):
  from tqdm import tqdm

  return tqdm(iterable, file=sys.stdout, dynamic_ncols=True, **kwargs)
