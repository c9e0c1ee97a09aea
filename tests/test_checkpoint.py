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
from _models import batch, child_env, loss_fn, mlp_params
from flax import nnx
from jax.sharding import AxisType

import zerojax

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(*args, timeout=300):
  env = child_env()
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
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adamw(1e-2), 3, mesh=mesh)
  )
  key = jax.random.key(42)
  uninterrupted = _train(make(), 10, 0, key)

  first = _train(make(), 5, 0, key)
  with zerojax.checkpoint.Checkpointer(tmp_path) as ckpt:  # asynchronous save
    ckpt.save(5, first, extra={'rng': key, 'data_position': jnp.array(5)})
  del first
  resumed, extra = zerojax.checkpoint.restore_train_state(
    tmp_path, init, jax.random.key(0), tx=zerojax.zero_stage(optax.adamw(1e-2), 3, mesh=mesh)
  )
  assert int(resumed.step) == 5 and int(extra['data_position']) == 5
  assert jax.random.key_impl(extra['rng']) == jax.random.key_impl(key)
  resumed = _train(resumed, 5, int(extra['data_position']), extra['rng'])
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(uninterrupted.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_retention(tmp_path):
  with zerojax.checkpoint.Checkpointer(
    tmp_path, max_to_keep=2, keep_every=4, async_save=False
  ) as ckpt:
    for step in range(1, 10):
      ckpt.save(step, {'w': jnp.full((8,), step, jnp.float32)})
    assert ckpt.all_steps() == [4, 8, 9]
    restored, _ = ckpt.restore({'w': jax.ShapeDtypeStruct((8,), jnp.float32)}, step=8)
    assert float(restored['w'][0]) == 8.0


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint(tmp_path):
  env = child_env()
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
      break
  # Kill it while step 2 is being written (its temporary folder exists).
  deadline = time.time() + 60
  while not glob.glob(str(tmp_path / '2*tmp*')) and time.time() < deadline:
    time.sleep(0.05)
  time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL
  tmp = glob.glob(str(tmp_path / '2*tmp*'))
  assert tmp  # the partial save is there...
  text = zerojax.checkpoint.format_checkpoint(tmp_path)  # ...shown, not removed, by inspect...
  lines = text.splitlines()
  assert lines[0] == f'{tmp_path}: steps [1]'
  assert lines[-2] == (
    'incomplete saves (never restored; removed when a Checkpointer next opens the folder):'
  )
  # Which step, how far it got, when, and what restores instead.
  written = sum(
    os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(tmp[0]) for f in names
  )
  assert lines[-1].startswith(f'  {os.path.basename(tmp[0])}: step 2, ')
  assert f' files, {written:,} bytes written, last written ' in lines[-1]
  assert lines[-1].endswith(
    '; killed mid-save, or still being written by a running job; step 1 restores instead'
  )
  assert glob.glob(str(tmp_path / '2*tmp*'))
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1  # ...never restored...
    assert ckpt.incomplete() == []  # ...and cleaned when a Checkpointer opens the folder
    restored, _ = ckpt.restore({'w': jax.ShapeDtypeStruct((8, 8), jnp.float32)})
    assert np.array_equal(np.asarray(restored['w']), np.ones((8, 8)))


def test_corrupted_checkpoint_names_step_and_file(tmp_path):
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
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
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(
      ValueError, match=re.escape(f"checkpoint step 2 in {tmp_path}: ['state']['tree']['w']")
    ) as err:
      ckpt.restore(target, step=2)
    assert str(tmp_path / '2') in str(err.value)
    restored, _ = ckpt.restore(target, step=1)  # earlier steps still restore
    assert float(restored['w'][0, 0]) == 1.0


def test_mismatched_target_names_path_and_shapes(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 1, mesh=mesh)
  )
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
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
    zerojax.checkpoint.restore_train_state(
      tmp_path, wider, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 1, mesh=mesh)
    )
  with pytest.raises(
    FileNotFoundError,
    match=re.escape(f'no committed checkpoint for step 9 in {tmp_path}; committed steps: [3]'),
  ):
    zerojax.checkpoint.restore_train_state(
      tmp_path,
      init,
      jax.random.key(0),
      tx=zerojax.zero_stage(optax.adam(1e-2), 1, mesh=mesh),
      step=9,
    )


def test_device_count_that_cannot_hold_the_layout(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh)
  )
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state)
  three = jax.make_mesh((3,), ('data',), axis_types=(AxisType.Auto,), devices=jax.devices()[:3])
  with pytest.raises(
    ValueError, match=re.escape("cannot be split over mesh axis 'data' of size 3 for ZeRO stage 3")
  ):
    zerojax.checkpoint.restore_train_state(
      tmp_path,
      lambda k: {'big': jnp.zeros((256, 512)), **mlp_params()},
      jax.random.key(0),
      tx=zerojax.zero_stage(optax.adam(1e-2), 3, mesh=three),
    )


def test_export_params_loads_without_zerojax(tmp_path, mesh):
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh)
  )
  path = zerojax.checkpoint.export_params(state.params, tmp_path / 'model')
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
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 2, mesh=mesh)
  )
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(4, state, extra={'data_position': jnp.array(4)})
  env = child_env()
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

  model = zerojax.nnx.create_model(
    lambda: Model(nnx.Rngs(0)), zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  )
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, nnx.state(model, nnx.Param))
    target = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1))), nnx.Param)
    tx1 = zerojax.zero_stage(optax.adam(1e-3), 1, mesh=mesh)
    plan = zerojax.plan_for(tx1, nnx.state(model, nnx.Param))
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
    tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh)
    model = zerojax.nnx.create_model(lambda: Model(nnx.Rngs(0)), tx)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, opt

  model, opt = trained(3)
  x = jnp.ones((8, 16))

  @nnx.jit
  def step(model, opt):
    opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

  for _ in range(3):
    step(model, opt)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
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


@pytest.mark.slow
def test_async_save_finishes_when_the_script_ends_without_close(tmp_path):
  out = worker('exit', tmp_path)
  assert 'RETURNED' in out
  assert not glob.glob(str(tmp_path / '*tmp*'))
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.all_steps() == [1]
    restored, _ = ckpt.restore({'w': jax.ShapeDtypeStruct((16 * 1024 * 1024,), jnp.float32)})
  assert np.array_equal(np.asarray(restored['w']), np.arange(16 * 1024 * 1024, dtype=np.float32))


@pytest.mark.slow
def test_async_save_of_a_train_state_is_committed_at_exit(tmp_path, mesh):
  # A script's last save, of a flax TrainState, with the Checkpointer still alive at exit.
  out = worker('exit-state', tmp_path / 'run')
  assert 'RETURNED' in out
  assert os.listdir(tmp_path / 'run') == ['1']  # committed: no '1.orbax-checkpoint-tmp'
  state, extra = zerojax.checkpoint.restore_train_state(
    tmp_path / 'run', init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 2, mesh=mesh)
  )
  expected = np.load(tmp_path / 'expected.npz')
  got = {
    jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
  }
  assert int(state.step) == 1 and int(extra['data_position']) == 7
  assert sorted(expected.files) == sorted(f"['params']{k}" for k in got)
  for k, x in got.items():
    assert np.array_equal(np.asarray(x), expected[f"['params']{k}"])


def test_a_truncated_array_file_names_the_step_and_the_array(tmp_path):
  tree = {'a': jnp.arange(4096.0).reshape(64, 64), 'b': jnp.ones((256, 256)), 'c': jnp.ones(8)}
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, tree)
    ckpt.save(2, tree)
  # The largest data file holds the one array that does not compress away: 'a'.
  path = max(_data_files(tmp_path / '2'), key=os.path.getsize)
  with open(path, 'r+b') as fh:
    fh.truncate(os.path.getsize(path) // 2)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(ValueError) as err:
      ckpt.restore(target, step=2)
    assert str(err.value) == (
      f"checkpoint step 2 in {tmp_path}: ['state']['tree']['a'] cannot be read from"
      f' {tmp_path / "2" / "state"} (its files are damaged or truncated, or it was not written'
      " by this model and optimizer; TensorStore's error is the cause above). Restore another"
      ' step (committed: [1, 2]) or save it again.'
    )
    # TensorStore's own words stay, as the cause.
    assert 'Encountered error while reading array' in str(err.value.__cause__)
    restored, _ = ckpt.restore(target, step=1)
  assert np.array_equal(np.asarray(restored['a']), np.asarray(tree['a']))


def test_fresh_train_state_saves_and_restores(tmp_path, mesh):
  from flax.training import train_state

  state = train_state.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.adam(1e-2))
  assert state.step == 0 and isinstance(state.step, int)  # a Python int, as flax makes it
  state = zerojax.zero_stage(state, 2, mesh=mesh)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(0, state)
    restored, _ = ckpt.restore(state)
  assert int(restored.step) == 0
  for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def _data_files(folder):
  return [
    f
    for f in glob.glob(str(folder / 'state' / '**' / 'd' / '*'), recursive=True)
    if os.path.isfile(f)
  ]


def test_overwritten_bytes_are_caught_by_the_checksum(tmp_path):
  w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, {'w': jnp.asarray(w)})
    ckpt.save(2, {'w': jnp.asarray(w), 'b': jnp.ones((8,), jnp.float32)})
  # Overwrite bytes in the middle of the file holding w's values (the largest),
  # keeping its size: only a checksum can tell.
  path = max(_data_files(tmp_path / '2'), key=os.path.getsize)
  with open(path, 'r+b') as fh:
    data = bytearray(fh.read())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    fh.seek(0)
    fh.write(data)
  target = {
    'w': jax.ShapeDtypeStruct((64, 64), jnp.float32),
    'b': jax.ShapeDtypeStruct((8,), jnp.float32),
  }
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(ValueError) as err:
      ckpt.restore(target, step=2)
    assert str(err.value) == (
      f"checkpoint step 2 in {tmp_path}: ['state']['tree']['w'] does not match the checksum"
      ' recorded when it was saved (its bytes changed on disk afterwards); it is stored in'
      f' {tmp_path / "2" / "state"}. Restore another step (committed: [1, 2]) or save it again.'
    )
    restored, _ = ckpt.restore({'w': target['w']}, step=1)
    assert np.array_equal(np.asarray(restored['w']), w)


def test_a_missing_data_file_names_the_step_and_the_array(tmp_path):
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, {'w': jnp.ones((64, 64))})
  for f in _data_files(tmp_path / '1'):
    os.remove(f)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(ValueError) as err:
      ckpt.restore({'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)})
  assert str(err.value).startswith(
    f"checkpoint step 1 in {tmp_path}: ['state']['tree']['w'] cannot be read from"
    f' {tmp_path / "1" / "state"}'
  )
  assert str(err.value).endswith('Restore another step (committed: [1]) or save it again.')
  assert err.value.__cause__ is not None  # orbax's own error, chained


def test_padded_state_is_saved_logical_and_restores_on_another_device_count(tmp_path):
  # (265, 254) fp32 is above replicate_below_bytes and no dimension divides by
  # 8 or 4: under policy='pad' its Adam moments are padded to 272 rows on 8
  # devices and to 268 on 4 (and not at all on 1).
  def init_fn(key):
    return {'w': jax.random.normal(key, (265, 254)), 'b': jnp.zeros((8,))}

  def make(n):
    m = jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    return zerojax.create_train_state(
      init_fn, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-2), 1, mesh=m, policy='pad')
    )

  state = make(8)
  state = state.apply_gradients(grads=jax.tree.map(jnp.cos, state.params))
  assert state.opt_state[0].mu['w'].shape == (272, 254)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state)
    assert ckpt.metadata()['leaves']["['state']['opt_state'][0].mu['w']"]['shape'] == [265, 254]
  for n in (4, 1):
    target = make(n)
    with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
      restored, _ = ckpt.restore(target)
    mu, want = restored.opt_state[0].mu['w'], np.asarray(state.opt_state[0].mu['w'])[:265]
    assert mu.shape == target.opt_state[0].mu['w'].shape
    assert mu.sharding == target.opt_state[0].mu['w'].sharding
    assert np.array_equal(np.asarray(mu)[:265], want)
    assert not np.asarray(mu)[265:].any()  # the padding is zeros
    assert np.array_equal(np.asarray(restored.params['w']), np.asarray(state.params['w']))


def test_nested_extra_round_trips(tmp_path):
  key = jax.random.key(3)
  extra = {
    'rng': {'data': key, 'dropout': [jax.random.key(4), jax.random.key(5)]},
    'position': {'epoch': jnp.array(2), 'batch': (jnp.array(7), jnp.arange(3.0))},
  }
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, {'w': jnp.ones((8,))}, extra=extra)
    _, got = ckpt.restore({'w': jax.ShapeDtypeStruct((8,), jnp.float32)})
  assert jax.tree.structure(got) == jax.tree.structure(extra)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(extra)):
    if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
      assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    else:
      assert np.array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(TypeError, match=r"`extra`\['cfg'\] is a str; extra holds arrays"):
    with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
      ckpt.save(2, {'w': jnp.ones((8,))}, extra={'cfg': 'adam'})


def test_dtype_mismatch_is_refused(tmp_path):
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, {'w': jnp.ones((8,), jnp.float32)})
    with pytest.raises(ValueError) as err:
      ckpt.restore({'w': jax.ShapeDtypeStruct((8,), jnp.bfloat16)})
  assert str(err.value) == (
    f"checkpoint step 1 in {tmp_path}: ['state']['tree']['w'] is float32 in the checkpoint"
    ' but bfloat16 in the target. Restore into a target of the saved dtype (e.g. build it'
    ' with the same param_dtype) and cast afterwards.'
  )


def test_typed_keys_in_optimizer_state_come_back_typed(tmp_path, mesh):
  tx = optax.noisy_sgd(1e-2, key=jax.random.key(0))
  state = zerojax.create_train_state(
    init, jax.random.key(0), tx=zerojax.zero_stage(tx, 1, mesh=mesh)
  )
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state)
    restored, _ = ckpt.restore(state)
  keys = [
    x
    for x in jax.tree.leaves(restored.opt_state)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  assert keys
  want = [
    x
    for x in jax.tree.leaves(state.opt_state)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  assert all(
    np.array_equal(jax.random.key_data(a), jax.random.key_data(b)) for a, b in zip(keys, want)
  )
