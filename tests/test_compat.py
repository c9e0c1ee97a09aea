"""zerojax/_src/compat.py: the one API that moved between the JAX releases zerojax supports."""

import jax
import jax.numpy as jnp
import pytest

from zerojax._src import compat


def test_the_form_is_chosen_by_version_and_exists():
  from jax.experimental import compute_on

  assert compat.COMPUTE_ON_RENAMED == (jax.__version_info__ >= (0, 11, 1))
  # The function form zerojax calls is the one this JAX has.
  name = 'compute_on' if compat.COMPUTE_ON_RENAMED else 'compute_on2'
  assert callable(getattr(compute_on, name))


def test_compute_on_host_runs_on_the_host():
  device = jax.devices()[0]
  try:
    host = jax.memory.Space.Host
  except AttributeError:
    pytest.skip('this jax has no jax.memory.Space')
  fn = compat.compute_on_host(lambda x: x * 2.0, out_memory_spaces=host)
  x = jnp.arange(4.0)
  pinned = jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host')
  out = jax.jit(fn)(jax.device_put(x, pinned))  # test_offload runs this path in a whole step
  assert jnp.array_equal(jax.device_get(out), x * 2.0)
