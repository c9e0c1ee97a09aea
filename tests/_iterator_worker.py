"""Each process saves its own data iterator state, then gets it back (tests/test_preemption.py).

python _iterator_worker.py save|restore DIR PROCESS_ID NUM_PROCESSES PORT
"""

import json
import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
mode, folder, pid, count, port = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zerojax  # noqa: E402

if count > 1:
  zerojax.distributed.initialize(f'127.0.0.1:{port}', count, pid, local_device_count=2)
else:
  jax.config.update('jax_num_cpu_devices', 2)


class Position:
  def __init__(self, seed):
    self.seed, self.next = seed, 0

  def get_state(self):
    return {'seed': self.seed, 'next': self.next}

  def set_state(self, state):
    self.seed, self.next = state['seed'], state['next']


mesh = jax.make_mesh((jax.device_count(),), ('data',))
state = {
  'w': jax.device_put(
    jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
}
with zerojax.checkpoint.Checkpointer(folder, async_save=False) as ckpt:
  if mode == 'save':
    data = Position(seed=10 + pid)
    data.next = 3 + pid  # each process has read its own share
    ckpt.save(1, state, data_iterator=data)
    print('SAVED', flush=True)
  else:
    data = Position(seed=0)
    try:
      ckpt.restore(state, data_iterator=data)
    except ValueError as e:
      print('REFUSED', e, flush=True)
    else:
      print('STATE', json.dumps(data.get_state()), flush=True)
