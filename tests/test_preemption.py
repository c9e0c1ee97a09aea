"""Preempted and resumed elsewhere: save on SIGTERM, resume on another device count, same run.

The subprocess tests send real signals to `examples/gpt.py` (one process) and
`examples/multiprocess.py` (two processes joined by `jax.distributed`), then
resume on four devices and compare every step's loss with an uninterrupted run.
The in-process tests check the library's contract: the batch split, the loss
scale and the random keys carry over, and bad input is refused with the fix.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import child_env, mlp_apply, mlp_params
from _tolerance import EPSBF16
from jax.sharding import AxisType

import zerojax
from zerojax._src import checkpoint as checkpoint_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, 'examples', 'gpt.py')
MULTI = os.path.join(ROOT, 'examples', 'multiprocess.py')
HERE = os.path.dirname(os.path.abspath(__file__))
# A resume on another device count sums each step's gradient in another order.
# With fp32 parameters the losses after it agree to 1e-6 relative (measured:
# 2.1e-7 at most). With bf16 parameters (mixed_precision) the fp32 master
# copies differ at that level too, and where one straddles a bf16 rounding
# boundary the parameter moves by one bf16 step: the losses agree to within
# one bf16 rounding of the parameters (measured: 3.3e-4 on jax 0.10.2, 7.1e-4 on 0.12).
RESUME_RTOL = 1e-6
RESUME_RTOL_BF16 = EPSBF16


# --- In-process: the library's contract ---------------------------------------------------


def mesh_of(n):
  return jax.make_mesh((n,), ('data',), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


ROWS = 32


def batch_at(step):
  rng = np.random.default_rng((0, step))
  x = rng.standard_normal((ROWS, 16)).astype(np.float32)
  return {'x': jnp.asarray(x), 'y': jnp.asarray(np.tanh(x[:, :8]))}


def noisy_loss(params, batch, key):
  # Dropout on the inputs: each micro-batch part draws its own mask from its fold of `key`.
  keep = jax.random.bernoulli(key, 0.9, batch['x'].shape)
  x = jnp.where(keep, batch['x'] / 0.9, 0.0)
  out = mlp_apply(params, x.astype(params['dense1']['kernel'].dtype)).astype(jnp.float32)
  return jnp.mean((out - batch['y']) ** 2)


def make_tx(stage, n):
  inner = zerojax.mixed_precision(
    optax.adamw(1e-2),
    loss_scale=zerojax.DynamicLossScale(initial=2.0**8, growth_interval=2),
  )
  return zerojax.zero_stage(inner, stage, mesh=mesh_of(n))


def train(state, rng, steps, micro_batches):
  grad_fn = zerojax.value_and_grad(noisy_loss, state.tx, micro_batches=micro_batches)

  @jax.jit
  def step(state, batch, rng):
    rng, key = jax.random.split(rng)
    loss, grads = grad_fn(state.params, batch, key, loss_scale=zerojax.loss_scale(state.opt_state))
    return state.apply_gradients(grads=grads), loss, rng

  losses = []
  for s in steps:
    state, loss, rng = step(state, batch_at(s), rng)
    losses.append(float(loss))
  return state, rng, losses


def fresh(stage, n, dtype=jnp.bfloat16):
  return zerojax.create_train_state(
    lambda k: mlp_params(), jax.random.key(0), tx=make_tx(stage, n), param_dtype=dtype
  )


def scale_state(state):
  found = [
    x
    for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, 'good_steps'))
    if hasattr(x, 'good_steps')
  ]
  return float(found[0].scale), int(found[0].good_steps)


@pytest.mark.parametrize(
  'stage,n,dtype',
  [(2, 8, 'bfloat16'), (3, 8, 'bfloat16'), (3, 4, 'bfloat16'), (3, 4, 'float32')],
  ids=['stage2-8dev-bf16', 'stage3-8dev-bf16', 'stage3-4dev-bf16', 'stage3-4dev-fp32'],
)
def test_resume_carries_loss_scale_keys_and_micro_batch_split(tmp_path, stage, n, dtype):
  # Saved from stage 2 on 8 devices: parameters in `dtype` with an fp32 master
  # (mixed_precision) and a dynamic loss scale that doubles every 2 good steps; a key
  # chain split every step, folded per micro-batch part; 2 micro-batches per device.
  whole, _, want = train(fresh(2, 8, dtype), jax.random.key(7), range(8), micro_batches=2)
  state, rng, first = train(fresh(2, 8, dtype), jax.random.key(7), range(3), micro_batches=2)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, state, extra={'rng': rng}, global_batch=ROWS, micro_batches=2)
  assert first == want[:3]  # the same program on the same data: bit for bit

  target = zerojax.inspect.abstract_train_state(
    lambda k: mlp_params(), jax.random.key(0), tx=make_tx(stage, n), param_dtype=dtype
  )
  with zerojax.checkpoint.Checkpointer(tmp_path) as ckpt:
    restored, extra = ckpt.restore(target, global_batch=ROWS)
    micro_batches = ckpt.micro_batches_for(restored.tx)
  assert micro_batches == 2 * 8 // n  # 2 rows per micro-batch part, as saved
  assert scale_state(restored) == scale_state(state)
  resumed, _, after = train(restored, extra['rng'], range(3, 8), micro_batches)
  # The loss scale went on doubling where the uninterrupted run's did.
  assert scale_state(resumed) == scale_state(whole) == (2.0**12, 0)
  if n == 8:
    # Same devices, same reduction order (stage 2 and 3 reduce-scatter alike): bit for bit.
    assert after == want[3:]
  else:
    rel = np.abs(np.array(after) - want[3:]) / np.abs(want[3:])
    print(f'{dtype}: max relative loss difference {rel.max():.3g}')  # pytest -s
    assert rel.max() <= (RESUME_RTOL if dtype == 'float32' else RESUME_RTOL_BF16), rel


def test_another_global_batch_is_refused(tmp_path):
  state = fresh(2, 8)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, state, global_batch=32, micro_batches=2)
    with pytest.raises(ValueError) as e:
      ckpt.restore(state, global_batch=64)
  assert str(e.value) == (
    f'checkpoint step 3 in {tmp_path} was trained with a global batch of 32 rows per step;'
    ' this run has 64. A resumed run keeps the global batch (the device count may change):'
    ' resume with a global batch of 32, or start a new run in another folder.'
  )


def test_another_model_is_refused_naming_the_leaf(tmp_path):
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, fresh(2, 8), global_batch=32)
  wider = zerojax.create_train_state(
    lambda k: {**mlp_params(), 'dense2': {'kernel': jnp.zeros((64, 16)), 'bias': jnp.zeros(16)}},
    jax.random.key(0),
    tx=make_tx(2, 8),
    param_dtype=jnp.bfloat16,
  )
  with zerojax.checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(ValueError) as e:
      ckpt.restore(wider, global_batch=32)
  assert str(e.value).startswith(
    f"checkpoint step 3 in {tmp_path}: ['state']['params']['dense2']['bias'] has shape (8,) in"
    ' the checkpoint but (16,) in the target; restore into the model that was saved.'
  )


def test_a_newer_zerojax_checkpoint_is_refused(tmp_path, monkeypatch):
  state = fresh(2, 8)
  with monkeypatch.context() as m:
    m.setattr(checkpoint_lib, '_version', lambda: '9.1.0')
    with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
      ckpt.save(3, state)
  with zerojax.checkpoint.Checkpointer(tmp_path) as ckpt:
    assert ckpt.metadata()['zerojax_version'] == '9.1.0'  # still described (inspect)
    with pytest.raises(ValueError) as e:
      ckpt.restore(state)
  assert str(e.value) == (
    f'checkpoint step 3 in {tmp_path} was written by zerojax 9.1.0, newer than this zerojax'
    f' {zerojax.__version__}; its layout may hold what this version cannot read. Upgrade'
    ' zerojax to 9.1.0 or later (pip install -U . in a checkout of it) to restore it.'
  )


def test_version_order_is_numeric():
  v = checkpoint_lib._version_tuple
  assert v('0.10.0') > v('0.9.9') and v('1.0.0rc1') == (1, 0, 0) and v('0.2.0+local') == (0, 2, 0)


def test_batch_split_errors(tmp_path):
  state = fresh(2, 8)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(ValueError) as e:
      ckpt.save(1, state, global_batch=20, micro_batches=2)
    assert str(e.value) == (
      'Checkpointer.save(global_batch=20, micro_batches=2): the global batch does not split'
      ' into 8 devices x 2 micro-batches; pass the rows of one whole step and the'
      ' micro_batches given to value_and_grad.'
    )
    assert ckpt.all_steps() == []  # nothing half-done
    ckpt.save(1, state)  # no batch recorded
    with pytest.raises(ValueError, match='records no batch split: save with'):
      ckpt.micro_batches_for(state.tx)
    with pytest.warns(UserWarning, match='records no global batch'):
      ckpt.restore(state, global_batch=32)
    ckpt.save(2, state, global_batch=8)  # 8 parts of 1 row
    tx3 = zerojax.zero_stage(optax.sgd(0.1), 1, mesh=mesh_of(3), policy='replicate')
    with pytest.raises(ValueError) as e:
      ckpt.micro_batches_for(tx3)
  assert str(e.value) == (
    f'checkpoint step 2 in {tmp_path} splits its global batch of 8 rows into 8 micro-batch'
    ' parts of 1 rows (8 devices x 1), which do not divide over 3 devices. Resume on a device'
    ' count that divides 8; any other split draws different random numbers per row.'
  )


def test_preemption_handler_needs_the_main_thread(tmp_path):
  errors = []

  def make():
    try:
      zerojax.checkpoint.Checkpointer(tmp_path, save_on_preemption=True)
    except ValueError as e:
      errors.append(str(e))

  t = threading.Thread(target=make)
  t.start()
  t.join()
  assert errors == [
    'Checkpointer(save_on_preemption=True) installs a SIGTERM handler, which Python allows'
    ' only in the main thread: create the Checkpointer there.'
  ]


def test_handler_is_removed_on_close(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  ckpt = zerojax.checkpoint.Checkpointer(tmp_path, save_on_preemption=True)
  assert signal.getsignal(signal.SIGTERM) != before
  assert not ckpt.reached_preemption(1)
  ckpt.close()
  assert signal.getsignal(signal.SIGTERM) == before
  assert not zerojax.checkpoint.Checkpointer(tmp_path).reached_preemption(1)  # not asked for


# --- Subprocesses and real signals ---------------------------------------------------------


def env():
  out = child_env()  # the script fakes its own devices
  out['JAX_PLATFORMS'] = 'cpu'
  return out


SMALL = ['--d-model', '64', '--layers', '2', '--dropout', '0.1', '--micro-batches', '2']
STEPS = 24


def gpt(args, log, **kwargs):
  cmd = [sys.executable, GPT, *SMALL, '--steps', str(STEPS), *args]
  return subprocess.Popen(
    cmd, stdout=open(log, 'w'), stderr=subprocess.STDOUT, env=env(), cwd=ROOT, **kwargs
  )


def wait_for(path, text, procs, timeout=240):
  """Waits until `text` is in the file at `path` (while every process is alive)."""
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    if os.path.exists(path) and text in open(path).read():
      return
    for p in procs:
      if p.poll() is not None:
        raise AssertionError(f'exited {p.returncode} before {text!r}:\n{open(path).read()[-3000:]}')
    time.sleep(0.2)
  raise AssertionError(f'no {text!r} after {timeout} s:\n{open(path).read()[-3000:]}')


def finish(p, log, timeout=300):
  p.wait(timeout=timeout)
  return p.returncode, open(log).read()


def losses(path):
  return {r['step']: r for r in map(json.loads, open(path))}


def compare(resumed: dict, whole: dict, *, exact: bool):
  assert sorted(resumed) == sorted(whole)
  got = np.array([resumed[s]['loss'] for s in sorted(whole)])
  want = np.array([whole[s]['loss'] for s in sorted(whole)])
  if exact:
    np.testing.assert_array_equal(got, want)
  else:
    rel = np.abs(got - want) / np.abs(want)
    print(f'{len(rel)} steps: max relative loss difference {rel.max():.3g}')  # pytest -s
    assert rel.max() <= RESUME_RTOL, rel


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """The reference: stage 2 on 8 devices, every step's loss."""
  folder = tmp_path_factory.mktemp('whole')
  log = str(folder / 'log')
  code, out = finish(gpt(['--stage', '2', '--losses', str(folder / 'l.jsonl')], log), log)
  assert code == 0, out[-3000:]
  return losses(folder / 'l.jsonl')


@pytest.mark.slow
def test_sigterm_saves_the_next_step_and_resumes_on_four_devices(tmp_path, uninterrupted):
  ckpt, log, record = str(tmp_path / 'ckpt'), str(tmp_path / 'log'), str(tmp_path / 'l.jsonl')
  args = ['--stage', '2', '--checkpoint-dir', ckpt, '--save-every', '10', '--losses', record]
  p = gpt([*args, '--save-on-preemption'], log)
  wait_for(log, 'SIGTERM saves the next step and exits', [p])
  wait_for(record, '"step": 2,', [p])  # a few steps in
  p.send_signal(signal.SIGTERM)
  p.send_signal(signal.SIGTERM)  # a second notice changes nothing
  code, out = finish(p, log)
  assert code == zerojax.checkpoint.PREEMPTED_EXIT_CODE == 143, out[-3000:]
  done = losses(record)
  saved = max(done) + 1  # the step after the last one trained
  assert saved < STEPS
  assert f'zerojax: preemption notice: checkpoint step {saved} committed in {ckpt} in' in out, out[
    -3000:
  ]
  assert 'Restart with the same folder to resume.' in out
  with zerojax.checkpoint.Checkpointer(ckpt, clean_incomplete=False) as c:
    assert c.latest_step() == saved and c.incomplete() == []
    assert c.metadata()['reason'] == 'preemption'
  inspect = subprocess.run(
    [sys.executable, '-m', 'zerojax', 'inspect', ckpt], capture_output=True, text=True, env=env()
  )
  assert f'step {saved}: train_state, ZeRO stage 2, mesh ' in inspect.stdout
  assert ', saved on a preemption notice' in inspect.stdout
  assert 'batch: 16 rows per step = 8 devices x 2 micro-batches x 1 rows' in inspect.stdout
  # Up to the notice it is the uninterrupted run itself.
  compare(done, {s: uninterrupted[s] for s in done}, exact=True)

  same = str(tmp_path / 'same')
  shutil.copytree(ckpt, same)
  # Resumed on 4 devices at stage 3 (4 micro-batches of the same rows each).
  log4 = str(tmp_path / 'log4')
  record4 = str(tmp_path / 'l4.jsonl')
  cmd = ['--stage', '3', '--devices', '4', '--checkpoint-dir', ckpt, '--losses', record4]
  code, out = finish(gpt(cmd, log4), log4)
  assert code == 0, out[-3000:]
  assert f'resumed from {ckpt} at step {saved}, 4 micro-batch(es) per device on 4 devices' in out
  after = losses(record4)
  assert all(r['devices'] == 4 for r in after.values())
  compare(after, {s: r for s, r in uninterrupted.items() if s >= saved}, exact=False)
  # Resumed on the same 8 devices and stage: bit for bit.
  log8 = str(tmp_path / 'log8')
  record8 = str(tmp_path / 'l8.jsonl')
  args8 = ['--stage', '2', '--checkpoint-dir', same, '--losses', record8]
  code, out = finish(gpt(args8, log8), log8)
  assert code == 0, out[-3000:]
  compare(losses(record8), {s: r for s, r in uninterrupted.items() if s >= saved}, exact=True)


@pytest.mark.slow
def test_two_processes_save_the_same_step_and_resume_as_one(tmp_path, uninterrupted):
  import socket

  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  ckpt, record = str(tmp_path / 'ckpt'), str(tmp_path / 'l.jsonl')
  common = [*SMALL, '--steps', str(STEPS), '--batch', '16', '--stage', '2', '--timeout', '120']
  common += ['--checkpoint-dir', ckpt, '--save-every', '10', '--save-on-preemption']
  common += ['--optimizer', 'adamw', '--losses', record, '--local-devices', '4']
  logs = [str(tmp_path / f'log{i}') for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, MULTI, *common, '--coordinator', f'127.0.0.1:{port}']
      + ['--num-processes', '2', '--process-id', str(i)],
      stdout=open(logs[i], 'w'),
      stderr=subprocess.STDOUT,
      env=env(),
      cwd=ROOT,
    )
    for i in range(2)
  ]
  try:
    wait_for(logs[0], 'SIGTERM saves the next step and exits', procs)
    wait_for(record, '"step": 2,', procs)
    procs[1].send_signal(signal.SIGTERM)  # only one host gets the notice
    results = [finish(p, log) for p, log in zip(procs, logs)]
  finally:
    for p in procs:
      p.kill() if p.poll() is None else None
  steps = set()
  for i, (code, out) in enumerate(results):
    assert code == 143, out[-3000:]
    found = [
      line for line in out.splitlines() if line.startswith(f'zerojax: process {i}: preemption')
    ]
    assert len(found) == 1, out[-3000:]
    steps.add(int(found[0].split('checkpoint step ')[1].split()[0]))
  assert len(steps) == 1  # both processes saved the same step
  saved = steps.pop()
  done = losses(record)
  assert max(done) + 1 == saved
  compare(done, {s: uninterrupted[s] for s in done}, exact=False)  # 2 x 4 against 1 x 8
  # Resumed as one process with 4 devices, without jax.distributed.
  record1 = str(tmp_path / 'l1.jsonl')
  cmd = [sys.executable, MULTI, *SMALL, '--steps', str(STEPS), '--batch', '16', '--stage', '3']
  cmd += ['--optimizer', 'adamw', '--checkpoint-dir', ckpt, '--losses', record1]
  cmd += ['--local-devices', '4']
  p = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
  assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
  assert f'resumed from {ckpt} at step {saved}, 4 micro-batch(es) per device' in p.stdout
  compare(losses(record1), {s: r for s, r in uninterrupted.items() if s >= saved}, exact=False)


@pytest.mark.slow
def test_a_second_signal_during_the_save_does_not_corrupt_it(tmp_path):
  # A 256 MiB state, so the save takes long enough to be signalled during it.
  log = str(tmp_path / 'log')
  p = subprocess.Popen(
    [sys.executable, os.path.join(HERE, '_checkpoint_worker.py'), 'preempt', str(tmp_path / 'c')],
    stdout=open(log, 'w'),
    stderr=subprocess.STDOUT,
    env=env(),
  )
  wait_for(log, 'TRAINING', [p])
  p.send_signal(signal.SIGTERM)
  wait_for(log, 'SIGTERM received', [p])
  t0 = time.monotonic()
  while not glob_tmp(tmp_path / 'c') and time.monotonic() - t0 < 60:
    time.sleep(0.01)
  assert glob_tmp(tmp_path / 'c'), 'the save never started'
  p.send_signal(signal.SIGTERM)
  p.send_signal(signal.SIGINT)
  code, out = finish(p, log)
  assert code == 143, out[-3000:]
  assert '(1 more SIGTERM ignored, Ctrl-C held); exiting with code 143' in out
  saved = int(out.split('checkpoint step ')[1].split()[0])
  with zerojax.checkpoint.Checkpointer(tmp_path / 'c') as c:
    assert c.latest_step() == saved > 1 and c.incomplete() == []
    restored, extra = c.restore({'w': jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32)})
  # Checksums verified on restore; the worker's state after step s is s everywhere.
  assert int(extra['step']) == saved
  assert float(restored['w'].min()) == float(restored['w'].max()) == saved


def glob_tmp(folder):
  return [n for n in os.listdir(folder) if 'orbax-checkpoint-tmp' in n] if folder.exists() else []


def test_a_notice_no_save_acted_on_ends_the_process_on_close(tmp_path):
  # SIGTERM came, but the script never called save again: close() passes the signal on.
  code = (
    'import os, signal, zerojax\n'
    f'ckpt = zerojax.checkpoint.Checkpointer({str(tmp_path)!r}, save_on_preemption=True)\n'
    'os.kill(os.getpid(), signal.SIGTERM)\n'
    'print("STILL HERE", flush=True)\n'
    'ckpt.close()\n'
    'print("NOT REACHED", flush=True)\n'
  )
  p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env())
  assert p.returncode == -signal.SIGTERM, p.stderr[-2000:]
  assert p.stdout == 'STILL HERE\n'
  assert (
    'zerojax: SIGTERM arrived but no Checkpointer.save came after it; passing it on' in p.stderr
  )


class Shuffled:
  """A pipeline zerojax does not own: its position lives inside it (as grain's iterators)."""

  def __init__(self, seed=0, as_bytes=False):
    self.seed, self.next, self.as_bytes = seed, 0, as_bytes

  def __next__(self):
    self.next += 1
    return np.random.default_rng((self.seed, self.next)).integers(0, 100, 4)

  def get_state(self):
    state = {'seed': self.seed, 'next': self.next}
    return json.dumps(state).encode() if self.as_bytes else state

  def set_state(self, state):
    state = json.loads(state) if isinstance(state, bytes) else state
    self.seed, self.next = state['seed'], state['next']


@pytest.mark.parametrize('as_bytes', [False, True], ids=['json', 'bytes'])
def test_data_iterator_state_is_saved_with_the_step(tmp_path, as_bytes):
  state = fresh(2, 8)
  data = Shuffled(seed=5, as_bytes=as_bytes)
  for _ in range(3):
    next(data)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, state, data_iterator=data, global_batch=32)
  want = [next(data) for _ in range(4)]
  resumed = Shuffled(seed=0, as_bytes=as_bytes)
  with zerojax.checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.restore(state, data_iterator=resumed, global_batch=32)
    assert ckpt.metadata()['run']['global_batch'] == 32
  assert (resumed.seed, resumed.next) == (5, 3)
  text = zerojax.checkpoint.format_checkpoint(tmp_path)
  assert 'batch: 32 rows per step = 8 devices x 1 micro-batches x 4 rows' in text
  assert 'data iterator: the states of 1 process(es), restored only on as many' in text
  np.testing.assert_array_equal([next(resumed) for _ in range(4)], want)


def test_data_iterator_errors(tmp_path, monkeypatch):
  state = fresh(2, 8)

  class Opaque:
    def get_state(self):
      return object()

    def set_state(self, state):
      raise AssertionError('not called')

  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(TypeError) as e:
      ckpt.save(1, state, data_iterator=Opaque())
    assert str(e.value).startswith(
      'Checkpointer.save(data_iterator=...): Opaque.get_state() returned a object that is'
      ' neither bytes nor JSON-serialisable ('
    )
    with pytest.raises(TypeError, match=r'takes an object with get_state\(\) and set_state'):
      ckpt.save(1, state, data_iterator=iter([1, 2]))
    assert ckpt.all_steps() == []  # nothing was written
    ckpt.save(1, state)
    with pytest.raises(ValueError, match='holds no data iterator state'):
      ckpt.restore(state, data_iterator=Shuffled())
    # Saved by two processes (each one's share), restored by one: refused, iterator untouched.
    monkeypatch.setattr(checkpoint_lib, '_gather_process_states', lambda s: [s, s])
    ckpt.save(2, state, data_iterator=Shuffled(seed=9))
    resumed = Shuffled(seed=1)
    with pytest.raises(ValueError) as e:
      ckpt.restore(state, data_iterator=resumed)
  assert (resumed.seed, resumed.next) == (1, 0)
  assert str(e.value) == (
    f'checkpoint step 2 in {tmp_path} holds the data iterator states of 2 process(es); this run'
    " has 1. An iterator state is one process's share of the data and does not map onto"
    ' another process count: resume on 2 process(es), or make the pipeline a function of the'
    ' step (saved in `extra`) and restore without data_iterator=.'
  )


@pytest.mark.slow
def test_each_process_gets_its_own_data_iterator_state(tmp_path):
  import socket

  def launch(mode, count):
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    worker = os.path.join(HERE, '_iterator_worker.py')
    procs = [
      subprocess.Popen(
        [sys.executable, worker, mode, str(tmp_path), str(i), str(count), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
      )
      for i in range(count)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for p, out in zip(procs, outs):
      assert p.returncode == 0, out[-3000:]
    return [[line for line in out.splitlines() if line.isupper() or ' ' in line] for out in outs]

  assert all('SAVED' in out for out in launch('save', 2))
  restored = launch('restore', 2)
  for i, out in enumerate(restored):
    assert f'STATE {{"seed": {10 + i}, "next": {3 + i}}}' in out, out
  (one,) = launch('restore', 1)
  assert any(line.startswith('REFUSED checkpoint step 1 in') for line in one), one
  assert any('holds the data iterator states of 2 process(es); this run has 1.' in x for x in one)
