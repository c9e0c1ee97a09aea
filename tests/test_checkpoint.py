"""Checkpoints: reshard across device counts and stages, exact resume, kills, corruption."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import batch, loss_fn, mlp_params
from flax import nnx
from jax.sharding import AxisType

import zerojax

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(*args, timeout=300):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(
    [sys.executable, os.path.join(HERE, '_checkpoint_worker.py'), *map(str, args)],
    capture_output=True,
    text=True,
    env=env,
    cwd=HERE,
    timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))


def init(key):
  del key
  return mlp_params()


@pytest.mark.slow
def test_reshard_matrix(tmp_path):
  # Saved on {8, 2} devices at stage {1, 3}; restored on {8, 4, 1} devices at
  # stage {0, 2, 3}: every leaf exact, in the target layout.
  for n in (8, 2):
    worker('save', n, tmp_path, 1, 3)
  results = []
  for n in (8, 4, 1):
    results += json.loads(worker('restore', n, tmp_path, 0, 2, 3).strip().splitlines()[-1])
  assert len(results) == 4 * 3 * 3
  assert {(r['saved'], r['devices'], r['stage']) for r in results} == {
    (f'n{n}_s{s}', d, t) for n in (8, 2) for s in (1, 3) for d in (8, 4, 1) for t in (0, 2, 3)
  }
  assert all(r['equal'] and r['layout'] for r in results), [
    r for r in results if not (r['equal'] and r['layout'])
  ]
  assert all(r['step'] == 1 and r['data_position'] == 7 for r in results)


def _train(state, steps, start, key):
  x, y = batch()

  @jax.jit
  def step(state, key, i):
    noise = 0.01 * jax.random.normal(
      jax.random.fold_in(key, i), x.shape
    )  # data depends on RNG and position
    grads = jax.grad(lambda p: loss_fn(p, x + noise, y))(state.params)
    return state.apply_gradients(grads=grads)

  for i in range(start, start + steps):
    state = step(state, key, i)
  return state


def test_resume_is_bitwise_exact(tmp_path, mesh):
  make = lambda: zerojax.create_train_state(
    init, jax.random.key(0), tx=optax.adamw(1e-2), stage=3, mesh=mesh
  )
  key = jax.random.key(42)
  uninterrupted = _train(make(), 10, 0, key)

  first = _train(make(), 5, 0, key)
  with zerojax.Checkpointer(tmp_path) as ckpt:  # asynchronous save
    ckpt.save(5, first, extra={'rng': key, 'data_position': jnp.array(5)})
  del first
  resumed, extra = zerojax.restore_train_state(
    tmp_path, init, jax.random.key(0), tx=optax.adamw(1e-2), stage=3, mesh=mesh
  )
  assert int(resumed.step) == 5 and int(extra['data_position']) == 5
  assert jax.random.key_impl(extra['rng']) == jax.random.key_impl(key)
  resumed = _train(resumed, 5, int(extra['data_position']), extra['rng'])
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(uninterrupted.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_retention(tmp_path):
  with zerojax.Checkpointer(tmp_path, max_to_keep=2, keep_every=4, async_save=False) as ckpt:
    for step in range(1, 10):
      ckpt.save(step, {'w': jnp.full((8,), step, jnp.float32)})
    assert ckpt.all_steps() == [4, 8, 9]
    restored, _ = ckpt.restore({'w': jax.ShapeDtypeStruct((8,), jnp.float32)}, step=8)
    assert float(restored['w'][0]) == 8.0


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.Popen(
    [sys.executable, os.path.join(HERE, '_checkpoint_worker.py'), 'kill', str(tmp_path)],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
    env=env,
    cwd=HERE,
  )
  for line in proc.stdout:
    if line.startswith('SAVING 2'):
      time.sleep(0.3)
      proc.send_signal(signal.SIGKILL)
      break
  assert proc.wait(timeout=60) == -signal.SIGKILL
  assert glob.glob(str(tmp_path / '2*tmp*'))  # the partial save is there...
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1  # ...and ignored
    restored, _ = ckpt.restore({'w': jax.ShapeDtypeStruct((8, 8), jnp.float32)})
    assert np.array_equal(np.asarray(restored['w']), np.ones((8, 8)))


def test_corrupted_checkpoint_names_step_and_file(tmp_path):
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, {'w': jnp.full((64, 64), float(step))})
  # Truncate every data file of step 2 (OCDBT data files live under a 'd' folder).
  files = [
    f
    for f in glob.glob(str(tmp_path / '2' / 'state' / '**' / 'd' / '*'), recursive=True)
    if os.path.isfile(f)
  ]
  assert files, sorted(glob.glob(str(tmp_path / '2' / '**'), recursive=True))
  for f in files:
    with open(f, 'r+b') as fh:
      fh.truncate(os.path.getsize(f) // 2)
  target = {'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)}
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(
      ValueError, match=re.escape(f'checkpoint step 2 in {tmp_path} could not be read')
    ) as err:
      ckpt.restore(target, step=2)
    assert str(tmp_path / '2') in str(err.value)
    restored, _ = ckpt.restore(target, step=1)  # earlier steps still restore
    assert float(restored['w'][0, 0]) == 1.0


def test_mismatched_target_names_path_and_shapes(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=optax.adam(1e-2), stage=1, mesh=mesh
  )
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, state)
  wider = lambda k: {
    **mlp_params(),
    'dense2': {'kernel': jnp.zeros((64, 16)), 'bias': jnp.zeros((16,))},
  }
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"checkpoint step 3 in {tmp_path}: ['state']['params']['dense2']['bias'] has shape (8,) in the"
      ' checkpoint but (16,) in the target'
    ),
  ):
    zerojax.restore_train_state(
      tmp_path, wider, jax.random.key(0), tx=optax.adam(1e-2), stage=1, mesh=mesh
    )
  with pytest.raises(
    FileNotFoundError,
    match=re.escape(f'no committed checkpoint for step 9 in {tmp_path}; committed steps: [3]'),
  ):
    zerojax.restore_train_state(
      tmp_path, init, jax.random.key(0), tx=optax.adam(1e-2), stage=1, mesh=mesh, step=9
    )


def test_device_count_that_cannot_hold_the_layout(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=optax.adam(1e-2), stage=3, mesh=mesh
  )
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state)
  three = jax.make_mesh((3,), ('data',), axis_types=(AxisType.Auto,), devices=jax.devices()[:3])
  with pytest.raises(
    ValueError, match=re.escape("cannot be split over mesh axis 'data' of size 3 for ZeRO stage 3")
  ):
    zerojax.restore_train_state(
      tmp_path,
      lambda k: {'big': jnp.zeros((256, 512)), **mlp_params()},
      jax.random.key(0),
      tx=optax.adam(1e-2),
      stage=3,
      mesh=three,
    )


def test_export_params_loads_without_zerojax(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=optax.adam(1e-2), stage=3, mesh=mesh
  )
  path = zerojax.export_params(state.params, tmp_path / 'model')
  assert path.endswith('model.npz')
  loaded = np.load(path)
  assert sorted(loaded.files) == [
    "['dense1']['bias']",
    "['dense1']['kernel']",
    "['dense2']['bias']",
    "['dense2']['kernel']",
  ]
  assert np.array_equal(
    loaded["['dense1']['kernel']"], np.asarray(state.params['dense1']['kernel'])
  )


def test_inspect_command(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=optax.adam(1e-2), stage=2, mesh=mesh
  )
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(4, state, extra={'data_position': jnp.array(4)})
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(
    [sys.executable, '-m', 'zerojax', 'inspect', str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == f'{tmp_path}: steps [4]'
  assert lines[1].startswith(
    "step 4: train_state, ZeRO stage 2, mesh {'data': 8}, axes ['data'], zerojax "
  )
  row = next(line for line in lines if "['state']['params']['dense1']['kernel']" in line)
  assert row.split()[-1] == f'{16 * 64 * 4:,}'
  missing = subprocess.run(
    [sys.executable, '-m', 'zerojax', 'inspect', str(tmp_path / 'nope')],
    capture_output=True,
    text=True,
    env=env,
  )
  assert 'no committed checkpoints' in missing.stdout


def test_nnx_state_round_trip(tmp_path, mesh):
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(16, 64, rngs=rngs)

  model = zerojax.create_nnx_model(lambda: Model(nnx.Rngs(0)), stage=3, mesh=mesh)
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, nnx.state(model, nnx.Param))
    target = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1))), nnx.Param)
    plan = zerojax.nnx_plan(model, stage=1, mesh=mesh)
    target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, plan.params
    )
    restored, _ = ckpt.restore(target)
  assert np.array_equal(np.asarray(restored['fc']['kernel'][...]), np.asarray(model.fc.kernel[...]))
  assert restored['fc']['kernel'][
    ...
  ].sharding.is_fully_replicated  # restored at stage 1: replicated


def test_nnx_model_and_optimizer_restore_at_another_stage(tmp_path, mesh):
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(16, 64, rngs=rngs)

    def __call__(self, x):
      return self.fc(x)

  def trained(stage):
    model = zerojax.create_nnx_model(lambda: Model(nnx.Rngs(0)), stage=stage, mesh=mesh)
    opt = nnx.Optimizer(
      model, zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh), wrt=nnx.Param
    )
    return model, opt

  model, opt = trained(3)
  x = jnp.ones((8, 16))

  @nnx.jit
  def step(model, opt):
    opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

  for _ in range(3):
    step(model, opt)
  with zerojax.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, {'model': nnx.state(model), 'opt': nnx.state(opt)})
    new_model, new_opt = trained(1)  # the target: stage 1, so optimizer state sharded, params not
    restored, _ = ckpt.restore({'model': nnx.state(new_model), 'opt': nnx.state(new_opt)})
  nnx.update(new_model, restored['model'])
  nnx.update(new_opt, restored['opt'])
  for a, b in zip(jax.tree.leaves(nnx.state(new_model)), jax.tree.leaves(nnx.state(model))):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(nnx.state(new_opt)), jax.tree.leaves(nnx.state(opt))):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert new_model.fc.kernel[...].sharding.is_fully_replicated
  assert not new_opt.opt_state[0].mu['fc']['kernel'][...].sharding.is_fully_replicated
