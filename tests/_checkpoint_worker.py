"""Runs checkpoint jobs in a process of its own, with its own faked device count.

python _checkpoint_worker.py save N DIR STAGE [STAGE ...]   -> DIR/n{N}_s{STAGE}/
python _checkpoint_worker.py restore N DIR STAGE [...]      -> restores every DIR/n*_s*/
python _checkpoint_worker.py kill DIR                       -> saves step 1, then a big step 2
python _checkpoint_worker.py exit DIR                       -> starts an async save, then exits
python _checkpoint_worker.py exit-state DIR                 -> the same with a flax TrainState
python _checkpoint_worker.py preempt DIR                    -> trains a 256 MiB state until SIGTERM
"""

import json
import os
import sys

N = int(sys.argv[2]) if sys.argv[1] not in ('kill', 'exit', 'exit-state', 'preempt') else 2
os.environ['JAX_PLATFORMS'] = 'cpu'
# This process's devices, beside the flags the suite passes down (tests/_models.py child_env).
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={N}'
).strip()

import glob  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _models import mlp_params  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import zerojax  # noqa: E402


def mesh():
  return jax.make_mesh((N,), ('data',), axis_types=(AxisType.Auto,))


def init(key):
  del key
  return mlp_params()


def flat(tree):
  return {
    jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def save(folder, stages):
  for stage in stages:
    state = zerojax.create_train_state(
      init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh())
    )
    grads = jax.tree.map(lambda p: jnp.cos(p), state.params)
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)  # non-zero moments
    out = os.path.join(folder, f'n{N}_s{stage}')
    with zerojax.checkpoint.Checkpointer(out) as ckpt:
      ckpt.save(1, state, extra={'data_position': jnp.array(7)})
    np.savez(
      os.path.join(out, 'expected.npz'),
      **flat({'params': state.params, 'opt_state': state.opt_state}),
    )


def restore(folder, stages):
  results = []
  for path in sorted(glob.glob(os.path.join(folder, 'n*_s*'))):
    expected = dict(np.load(os.path.join(path, 'expected.npz')))
    for stage in stages:
      state, extra = zerojax.checkpoint.restore_train_state(
        path, init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh())
      )
      plan = zerojax.plan_for(state.tx, state.params)
      got = flat({'params': state.params, 'opt_state': state.opt_state})
      results.append(
        {
          'saved': os.path.basename(path),
          'devices': N,
          'stage': stage,
          'equal': sorted(got) == sorted(expected)
          and all(np.array_equal(got[k], expected[k]) for k in got),
          'layout': jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state))
          == (plan.params, plan.opt_state),
          'step': int(state.step),
          'data_position': int(extra['data_position']),
        }
      )
  print(json.dumps(results))


def kill(folder):
  with zerojax.checkpoint.Checkpointer(folder, async_save=False) as ckpt:
    ckpt.save(1, {'w': jnp.ones((8, 8))})
    print('SAVED 1', flush=True)
    # 512 MiB of random floats: incompressible, so the write takes a while.
    big = {'w': jnp.ones((8, 8)), 'big': jax.random.normal(jax.random.key(0), (128, 1024, 1024))}
    big['big'].block_until_ready()
    print('SAVING 2', flush=True)
    ckpt.save(2, big)
    print('SAVED 2', flush=True)


def exit_without_close(folder):
  # No close(), no `with`: the script just ends while the write is in flight.
  ckpt = zerojax.checkpoint.Checkpointer(folder)
  ckpt.save(1, {'w': jnp.arange(16 * 1024 * 1024, dtype=jnp.float32)})
  print('RETURNED', flush=True)


def exit_state_without_close(folder):
  # A flax TrainState with a step, laid out at stage 2: what a training script saves last.
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 2, mesh=mesh())
  )
  state = jax.jit(lambda s: s.apply_gradients(grads=jax.tree.map(jnp.cos, s.params)))(state)
  # Held by a module global, as in a script: it lives until the interpreter exits, after
  # the point where Python stops its thread pools (where orbax commits in the background).
  global CHECKPOINTER
  CHECKPOINTER = zerojax.checkpoint.Checkpointer(folder)
  CHECKPOINTER.save(1, state, extra={'data_position': jnp.array(7)})
  np.savez(os.path.join(folder, '..', 'expected.npz'), **flat({'params': state.params}))
  print('RETURNED', flush=True)


def preempt(folder):
  # Saves every step on a SIGTERM only (and the first step); a state big enough that the
  # preemption save takes a while, so the test can signal again while it runs.
  w = jnp.ones((64, 1024, 1024), jnp.float32)
  add = jax.jit(lambda w: w + 1, donate_argnums=0)
  ckpt = zerojax.checkpoint.Checkpointer(folder, save_interval_steps=10**6, save_on_preemption=True)
  ckpt.save(1, {'w': w}, extra={'step': jnp.array(1)})
  ckpt.wait_until_finished()
  print('TRAINING', flush=True)
  for step in range(2, 10**6):
    w = add(w)
    ckpt.save(step, {'w': w}, extra={'step': jnp.array(step)})


if __name__ == '__main__':
  mode, rest = sys.argv[1], sys.argv[2:]
  if mode == 'save':
    save(rest[1], [int(s) for s in rest[2:]])
  elif mode == 'restore':
    restore(rest[1], [int(s) for s in rest[2:]])
  elif mode == 'exit':
    exit_without_close(rest[0])
  elif mode == 'exit-state':
    exit_state_without_close(rest[0])
  elif mode == 'preempt':
    preempt(rest[0])
  else:
    kill(rest[0])
