"""Several processes on one machine: JAX's distributed runtime, gloo collectives, loopback only.

Each run is `examples/multiprocess.py` in fresh processes (2 x 4 faked CPU
devices, or 1 x 8), so the suite's own 8-device backend is not involved.
"""

import fcntl
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from _models import child_env
from _tolerance import reordered

import zerojax
from zerojax._src import distributed as distributed_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'multiprocess.py')
STEPS = 10
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('distributed')]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def env():
  out = child_env()  # without the 8-device flag
  out['JAX_PLATFORMS'] = 'cpu'
  return out


def launch(processes: int, args: list[str], *, timeout: float = 300, devices=None):
  """Runs the example as `processes` processes; returns [(returncode, output)]."""
  devices = devices or [8 // processes] * processes
  port = free_port()
  procs = []
  for i in range(processes):
    cmd = [sys.executable, EXAMPLE, '--local-devices', str(devices[i]), *args]
    if processes > 1:
      cmd += ['--coordinator', f'127.0.0.1:{port}', '--num-processes', str(processes)]
      cmd += ['--process-id', str(i)]
    procs.append(
      subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=ROOT
      )
    )
  results = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    results.append((p.returncode, out))
  return results


def ok(results):
  for code, out in results:
    assert code == 0, out[-3000:]
  return results


def load(path):
  with np.load(path) as f:
    return dict(f)


def train(processes, stage, folder, *, checkpoint=None, steps=STEPS, slices=1):
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f'p{processes}_s{stage}_{steps}_x{slices}.npz')
  args = ['--stage', str(stage), '--steps', str(steps), '--optimizer', 'sgd']
  args += ['--export-state', path, '--slices', str(slices)]
  args += ['--losses', path + '.losses']
  if checkpoint:
    args += ['--checkpoint-dir', checkpoint, '--save-every', '5']
  return ok(launch(processes, args)), load(path)


def losses(path):
  with open(path + '.losses') as f:
    return [json.loads(line)['loss'] for line in f]


@pytest.fixture(scope='session')
def runs(tmp_path_factory):
  """Stage 1 and 3 runs on 2 x 4 and 1 x 8 devices; stage 3 also checkpoints, and its two
  processes are two slices (a 'slice' mesh axis across them, hierarchical ZeRO).

  Made once per test run: the results sit in a folder shared by the xdist
  workers, under a lock, so a second worker reads them instead of training again.
  """
  base = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):  # basetemp is per worker; its parent per run
    base = base.parent
  folder = str(base / 'distributed_runs')
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = os.path.join(folder, 'runs.pkl')
    if os.path.exists(done):
      with open(done, 'rb') as f:
        return pickle.load(f)
    out = {}
    for stage in (1, 3):
      for processes in (2, 1):
        ckpt = os.path.join(folder, f'ckpt_p{processes}') if stage == 3 else None
        slices = 2 if stage == 3 and processes == 2 else 1
        logs, state = train(processes, stage, folder, checkpoint=ckpt, slices=slices)
        path = os.path.join(folder, f'p{processes}_s{stage}_{STEPS}_x{slices}.npz')
        out[processes, stage] = {
          'logs': logs,
          'state': state,
          'checkpoint': ckpt,
          'losses': losses(path),
        }
    out['folder'] = folder
    with open(done, 'wb') as f:
      pickle.dump(out, f)
    return out


def close(a: dict, b: dict, rtol: float) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    scale = max(float(np.abs(b[k]).max()), 1e-12)
    err = float(np.abs(a[k] - b[k]).max()) / scale
    assert err <= rtol, f'{k}: {err:.3g} > {rtol}'


@pytest.mark.parametrize('stage', [1, 3])
def test_two_processes_equal_one(runs, stage):
  two, one = runs[2, stage], runs[1, stage]
  first = two['logs'][0][1]
  assert '2 process(es) x 4 device(s): one mesh of 8' in first
  assert '1 process(es) x 8 device(s): one mesh of 8' in one['logs'][0][1]
  assert 'per process (2 x 4 devices): arguments' in first
  # Only process 0 reports.
  assert 'per device (8 devices)' in first and 'per device' not in two['logs'][1][1]
  # Same seed and data, 10 SGD steps: equal up to the collectives' summation order.
  assert len(two['state']) == len(one['state']) > 10
  # examples/multiprocess.py's GPT (16 x 64 token rows, 2 blocks of 64-wide
  # attention over 64 keys and a 256-wide MLP, a 256-way vocabulary), 10 steps.
  close(two['state'], one['state'], rtol=reordered(16 * 64 + 2 * (64 + 64 + 256) + 256, steps=10))
  assert len(two['losses']) == len(one['losses']) == STEPS
  assert np.allclose(two['losses'], one['losses'], rtol=1e-6, atol=0)


def test_two_slices_across_processes_move_the_dcn_floor_between_them(runs):
  # Stage 3's two processes are two slices: the bytes that cross between the processes,
  # counted in the compiled program, are each device's gradient shard all-reduced once.
  first = runs[2, 3]['logs'][0][1]
  assert 'networks (2 slices): ICI' in first
  dcn = re.search(r'DCN floor \(.*S=2\): ([\d,]+) bytes; measured/floor = ([\d.]+)', first)
  assert dcn is not None, first[-3000:]
  psi = int(re.search(r'Ψ=([\d,]+)', first).group(1).replace(',', ''))
  assert int(dcn.group(1).replace(',', '')) == 2 * (4 * psi // 4) // 2  # fp32 shard, S = 2
  assert dcn.group(2) == '1.000'


def test_checkpoint_from_two_processes_restores_in_one(runs):
  saved = runs[2, 3]
  assert sorted(os.listdir(saved['checkpoint'])) == ['1', '10', '5']
  _, restored = train(1, 3, runs['folder'] + '/r1', checkpoint=saved['checkpoint'])
  for k, v in saved['state'].items():
    assert np.array_equal(restored[k], v), k  # bit for bit


def test_checkpoint_from_two_slices_restores_on_four(runs):
  saved = runs[2, 3]
  logs, restored = train(1, 3, runs['folder'] + '/r4', checkpoint=saved['checkpoint'], slices=4)
  assert 'networks (4 slices)' in logs[0][1]
  for k, v in saved['state'].items():
    assert np.array_equal(restored[k], v), k


def test_checkpoint_from_one_process_restores_in_two(runs):
  saved = runs[1, 3]
  logs, restored = train(2, 3, runs['folder'] + '/r2', checkpoint=saved['checkpoint'])
  assert 'nothing to train (resumed at the last step)' in logs[0][1]
  for k, v in saved['state'].items():
    assert np.array_equal(restored[k], v), k


def test_missing_coordinator_fails_fast(tmp_path):
  # Process 1 of 2, and nobody started process 0.
  port = free_port()
  cmd = [sys.executable, EXAMPLE, '--coordinator', f'127.0.0.1:{port}', '--num-processes', '2']
  cmd += ['--process-id', '1', '--timeout', '5']
  t0 = time.monotonic()
  p = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
  assert time.monotonic() - t0 < 40
  assert p.returncode != 0
  assert (
    f'RuntimeError: process 1 of 2: no coordinator is listening at 127.0.0.1:{port} after 5 s.'
    ' Start process 0 with the same coordinator address' in p.stderr
  )


def test_too_few_processes_fail_within_the_timeout():
  # Process 0 waits for a second process that never comes.
  port = free_port()
  cmd = [sys.executable, EXAMPLE, '--coordinator', f'127.0.0.1:{port}', '--num-processes', '2']
  cmd += ['--process-id', '0', '--timeout', '5']
  t0 = time.monotonic()
  p = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
  assert time.monotonic() - t0 < 40
  assert p.returncode == distributed_lib.TIMEOUT_EXIT_CODE
  assert (
    f'zerojax: process 0 of 2: not all processes joined the coordinator at 127.0.0.1:{port}'
    ' within 5 s. Check that 2 processes were launched' in p.stderr
  )


def test_processes_with_different_device_counts_fail():
  t0 = time.monotonic()
  results = launch(2, ['--steps', '1', '--timeout', '30'], devices=[4, 2], timeout=120)
  assert time.monotonic() - t0 < 100
  for code, out in results:
    assert code != 0
    assert (
      'ValueError: processes have different numbers of devices: process 0: 4, process 1: 2.'
      ' Give every process the same number of devices' in out
    )


# In-process checks (this suite's 8 faked devices, one process).
def test_initialize_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r"`coordinator_address`='localhost' is not HOST:PORT"):
    zerojax.distributed.initialize('localhost', 2, 0)
  with pytest.raises(ValueError, match=r'`num_processes` must be a positive int .* got 0'):
    zerojax.distributed.initialize('127.0.0.1:1234', 0, 0)
  with pytest.raises(ValueError, match=r'`process_id` must be an int in 0..1 .* got 2'):
    zerojax.distributed.initialize('127.0.0.1:1234', 2, 2)
  with pytest.raises(RuntimeError, match='jax has already started its backend in this process'):
    zerojax.distributed.initialize('127.0.0.1:1234', 2, 0)


def test_check_mesh_names_both_counts():
  mesh = jax.make_mesh((4,), ('data',), devices=jax.devices()[:4])
  with pytest.raises(ValueError) as e:
    zerojax.distributed.check_mesh(mesh)
  assert str(e.value).startswith(
    "the mesh {'data': 4} has 4 devices but this launch has 8 (1 process(es) x 8 device(s))."
  )
  full = jax.make_mesh((8,), ('data',))
  assert zerojax.distributed.check_mesh(full) is full


def test_batch_helpers_one_process():
  mesh = jax.make_mesh((8,), ('data',))
  assert zerojax.distributed.process_batch_slice(32, mesh) == slice(0, 32)
  with pytest.raises(ValueError, match='the global batch of 30 rows does not divide over the 8'):
    zerojax.distributed.process_batch_slice(30, mesh)
  x = np.arange(32 * 3).reshape(32, 3)
  g = zerojax.distributed.global_batch({'x': x}, mesh)['x']
  assert g.sharding.spec == jax.sharding.PartitionSpec('data')
  np.testing.assert_array_equal(zerojax.distributed.to_numpy(g), x)


def test_step_report_scales_to_processes_and_mesh():
  import optax
  from _models import batch, loss_fn, mlp_params, shard_batch

  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  params = jax.device_put(mlp_params(), zerojax.plan_for(tx, mlp_params()).params)
  state = tx.init(params)

  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step).lower(params, state, *shard_batch(mesh, *batch())).compile()
  report = zerojax.inspect.step_report(compiled, plan=zerojax.plan_for(tx, params))
  assert report.process_devices == {0: 8}
  assert report.per_process().argument == 8 * report.memory.argument
  assert report.whole_mesh().peak == 8 * report.memory.peak
  assert 'per process' not in str(report)  # one process: nothing more to say


def test_no_private_jax_modules_are_used():
  # zerojax relies on public jax APIs only (jax._src moves between releases).
  root = os.path.join(os.path.dirname(__file__), '..', 'zerojax')
  offenders = []
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        with open(path) as f:
          if re.search(r'(?<!zero)jax\._src', f.read()):
            offenders.append(os.path.relpath(path, root))
  assert offenders == []


@pytest.mark.slow
def test_initialize_without_a_cluster_says_what_to_pass():
  env = child_env()
  env['JAX_PLATFORMS'] = 'cpu'
  code = (
    'import zerojax\n'
    'try:\n'
    '  zerojax.distributed.initialize(timeout_s=20)\n'
    'except ValueError as e:\n'
    '  print("NOTE", *[n for n in e.__notes__ if n.startswith("zerojax")])\n'
  )
  proc = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=120
  )
  assert proc.returncode == 0, proc.stderr
  # JAX's own ValueError arrives, with a note from zerojax on what to pass.
  assert proc.stdout.strip() == (
    'NOTE zerojax.distributed.initialize() was called without a launch: JAX detects TPU pods,'
    ' SLURM and Open MPI launches by itself. Elsewhere pass the launch explicitly, the same'
    ' address and count in every process and a distinct id each (process 0 hosts the'
    " coordinator): zerojax.distributed.initialize('HOST:PORT', num_processes=N,"
    ' process_id=i). For one process, do not call it.'
  )
