"""Estimates against measured bytes; report bytes against hand counts; the plan command."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import SCALARS, compile_step, init_fn, run_cli
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import presets


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_estimate_equals_measured_argument_bytes(stage, mesh):
  params = jax.eval_shape(init_fn, jax.random.key(0))
  (estimate,) = zerojax.inspect.estimate_memory(
    params, optax.adam(1e-3), num_devices=8, stages=[stage]
  )
  compiled, batch_bytes = compile_step(mesh, stage)
  measured = zerojax.inspect.memory_stats(compiled).argument - batch_bytes - SCALARS
  # Model states at rest; Adam's step count (4 bytes) is part of the estimate.
  assert estimate.at_rest == measured + 4


@pytest.mark.parametrize(
  'optimizer, per_param', [(optax.adam(1e-3), 8), (optax.sgd(1e-3), 0), (optax.lion(1e-3), 4)]
)
def test_estimate_from_a_count_follows_the_formulas(optimizer, per_param):
  psi, n = 64 * 10**6, 64
  est = {e.stage: e for e in zerojax.inspect.estimate_memory(psi, optimizer, num_devices=n)}
  count_bytes = est[0].opt_state - per_param * psi  # scalar counters, if any
  assert count_bytes in (0, 4)
  assert est[0].total == (8 + per_param) * psi + count_bytes
  assert est[1].total == 8 * psi + per_param * psi // n + count_bytes
  assert est[2].total == 4 * psi + (4 + per_param) * psi // n + count_bytes
  assert est[3].total == (8 + per_param) * psi // n + count_bytes


def test_estimate_counts_factored_state_as_it_is():
  # Adafactor keeps row and column statistics, not a full second moment.
  params = {'w': jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
  (est,) = zerojax.inspect.estimate_memory(params, optax.adafactor(1e-3), num_devices=8, stages=[1])
  assert est.opt_state < 4096 * 1024  # far below one fp32 copy (16 MiB)
  assert est.opt_state >= (4096 + 1024) * 4 // 8


def test_report_bytes_equal_hand_count_for_scanned_model():
  mesh = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  cfg = presets.PRESETS['tiny']  # 4 layers, d 128, d_ff 512, vocab 256
  spec = presets.decoder_spec('tiny', presets.ModelSettings(compute_dtype=jnp.float32))
  state = zerojax.inspect.abstract_train_state(
    spec.init_fn, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  )
  plan = zerojax.plan_for(state.tx, state.params)
  tokens = jax.ShapeDtypeStruct(
    (16, 65), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )

  def step(state, tokens):
    grads = jax.grad(lambda p: spec.loss_fn(p, tokens, plan))(state.params)
    return state.apply_gradients(grads=grads)

  report = zerojax.inspect.step_report(jax.jit(step).lower(state, tokens).compile(), plan=plan)
  d, f, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab
  per_layer = 4 * d * d + 2 * d * f + 2 * d  # eight leaves per block
  top = 2 * V * d + d  # embedding, head, final norm
  c = report.collectives
  # Each block's eight leaves gathered in the forward pass and again in the
  # (rematerialised) backward pass, inside two scans of 4 iterations; the
  # three top-level leaves once.
  assert c['all-gather'] == 2 * L * 8 + 3
  assert c.result_bytes['all-gather'] == 4 * (2 * L * per_layer + top)
  # Byte counts times (N-1)/N in float64: approx only for the division's rounding.
  assert c.ring_bytes['all-gather'] == pytest.approx(4 * (2 * L * per_layer + top) * 7 / 8)
  psi = L * per_layer + top
  assert report.num_params == psi
  assert report.floor_bytes == pytest.approx(3 * psi * 4 * 7 / 8)
  text = str(report)
  assert f'{"all-gather":<20} {2 * L * 8 + 3:>7}' in text
  assert 'ZeRO floor (stage 3: 3Ψ(N-1)/N' in text


@pytest.mark.slow
def test_plan_command_on_faked_cpu_devices(tmp_path):
  out = tmp_path / 'plan.json'
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'cpu:8', '--stage', '3', '--json', str(out)
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  report = json.loads(out.read_text())
  psi = presets.PRESETS['tiny'].num_params()
  assert report['num_params'] == psi and report['num_devices'] == 8
  assert report['fits'] is None  # CPU has no HBM budget
  # AdamW at stage 3: 12 bytes per parameter at rest, split 8 ways, + batch + counters.
  assert report['memory']['argument'] == 12 * psi // 8 + 8 * 65 * 4 // 8 + 8
  assert report['collectives']['counts']['all-gather'] >= 2 * 4 * 8


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_plan_command_for_tpu_topology(tmp_path):
  pytest.importorskip('libtpu', reason='needs the tpu extra')
  out = tmp_path / 'plan.json'
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'v5e:2x4', '--stage', '3', '--json', str(out)
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  report = json.loads(out.read_text())
  assert report['fits'] is True and report['hbm_bytes'] == 16 * 2**30
  assert 'FITS' in proc.stdout and 'TPU v5 lite' in proc.stdout
  assert report['collectives']['counts']['reduce-scatter'] >= 1


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_plan_for_a_chip_without_published_figures_says_why_it_has_no_step_time(tmp_path):
  # TPU v4 compiles, so memory and collectives are the compiler's; its peak and bandwidths
  # are not in zerojax's chip table, so the step is not timed, and the plan says so.
  pytest.importorskip('libtpu', reason='needs the tpu extra')
  out = tmp_path / 'plan.json'
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'v4:2x2x1', '--seq-len', '128', '--json', str(out)
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert (
    'no predicted step: zerojax has no published figures (peak FLOP/s, HBM and ICI bandwidth)'
    " for 'v4' chips, so the memory and collectives above are its compiler's but the step"
    ' cannot be timed; plan a chip it has figures for (v5e, v5p, v6e) for a step time.'
  ) in proc.stderr
  assert json.loads(out.read_text())['predicted_seconds'] is None
  assert 'predicted step' not in proc.stdout


@pytest.mark.slow
def test_plan_command_on_a_two_axis_mesh(tmp_path):
  # One ZeRO axis per grid dimension, gradients through zerojax.value_and_grad:
  # per-layer reduce-scatters, and the only all-reduce is the loss's.
  out = tmp_path / 'plan.json'
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'cpu:8', '--mesh', '2x4', '--json', str(out)
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "mesh {'x': 2, 'y': 4}, ZeRO over ('x', 'y'); gradients through" in proc.stdout
  report = json.loads(out.read_text())
  assert report['mesh'] == {'x': 2, 'y': 4} and report['gradients'] == 'zerojax.value_and_grad'
  psi = presets.PRESETS['tiny'].num_params()
  assert report['memory']['argument'] == 12 * psi // 8 + 8 * 65 * 4 // 8 + 8
  counts, nbytes = report['collectives']['counts'], report['collectives']['result_bytes']
  # Each split leaf's gradient is reduce-scattered over 'x' and then 'y'.
  assert counts['reduce-scatter'] >= 2 * 4 * 8
  assert counts['all-reduce'] == 1 and nbytes['all-reduce'] == 4


@pytest.mark.slow
@pytest.mark.parametrize('stage', [1, 2])
def test_plan_command_floor_counts_the_parameters_own_dtype_below_stage_3(stage):
  # fp32 presets: below stage 3 the gradients of the stored fp32 parameters are
  # reduce-scattered and the updated ones all-gathered, 2 x 4 bytes x Psi(N-1)/N:
  # exactly the floor through zerojax's own collectives (the loss adds 7 bytes).
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'cpu:8', '--stage', str(stage), '--grad', 'zerojax'
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  psi = presets.PRESETS['tiny'].num_params()
  floor = 2 * psi * 4 * 7 // 8
  assert f'Ψ={psi:,}, N=8): {floor:,} bytes; measured/floor = 1.000' in proc.stdout


@pytest.mark.parametrize(
  'mesh, message',
  [
    (
      '4x4',
      '--mesh 4x4 has 16 devices but the topology has 8; give the chip grid, e.g. --mesh 16x16'
      ' for v5e:16x16, or sizes whose product is 8',
    ),
    (
      '2xa',
      "--mesh '2xa': expected 'data', a grid of up to 3 dimensions like 16x16, or named axes"
      ' like data=16,tensor=4',
    ),
  ],
)
def test_plan_command_rejects_a_mesh_that_does_not_fit(mesh, message):
  proc = run_cli('plan', '--model', 'tiny', '--topology', 'cpu:8', '--mesh', mesh)
  assert proc.returncode != 0
  assert proc.stderr.strip() == f'error: {message}', proc.stderr


def test_plan_command_rejects_unknown_topology():
  proc = run_cli('plan', '--model', 'tiny', '--topology', 'v9z:3x3')
  assert proc.returncode != 0
  assert "cannot compile for TPU topology 'v9z:3x3'" in proc.stderr


@pytest.mark.tpu
def test_a_slice_the_installed_compiler_cannot_form_is_named_not_blamed_on_the_install():
  # With libtpu installed, the fix is another topology name, not installing the compiler.
  libtpu = pytest.importorskip('libtpu', reason='needs the tpu extra')
  del libtpu
  import importlib.metadata

  proc = run_cli('plan', '--model', 'tiny', '--topology', 'v5e:3x3')
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines[-2].startswith("error: cannot compile for TPU topology 'v5e:3x3': "), lines
  assert lines[-1] == (
    f'libtpu {importlib.metadata.version("libtpu")} cannot form that slice; name one it can,'
    ' like v5e:2x4, v5e:4x4, v5e:16x16, v5p:2x2x1, v5p:4x4x4 or v4:2x2x1.'
  )
  assert 'pip install' not in proc.stderr


def test_estimate_command():
  proc = run_cli('estimate', '--params', '1e9', '--devices', '64')
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].split()[:5] == ['stage', 'params', 'grads', 'opt', 'state']
  assert lines[4].split()[:5] == ['3', '0.058', '0.058', '0.116', '0.233']


def test_estimate_command_mixed_precision_and_offload():
  proc = run_cli(
    'estimate', '--params', '1e9', '--devices', '64', '--mixed-precision', '--offload', 'opt_state'
  )
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].split()[-5:] == ['total', 'host', 'GiB', 'per', 'device']
  # Stage 3: bf16 params and grads 2/N each, master 4/N on device, moments 8/N on host.
  gib = 1e9 / 64 / 2**30
  assert lines[4].split()[1:6] == [f'{x * gib:.3f}' for x in (2, 2, 4, 8, 8)]


LIBTPU_NOISE = ('Failed to find host bounds', 'INVALID_ARGUMENT', 'TPU_WORKER_HOSTNAMES')


@pytest.mark.slow
def test_cli_sets_up_jax_itself_before_its_backends_start():
  # No JAX_PLATFORMS and no XLA_FLAGS: `python -m zerojax` must choose the CPU
  # (no TPU probing, whose complaints libtpu prints) and fake the devices asked for.
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'cpu:4', drop=('XLA_FLAGS', 'JAX_PLATFORMS')
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'topology cpu:4: 4 devices (cpu)' in proc.stdout
  assert not [n for n in LIBTPU_NOISE if n in proc.stderr], proc.stderr


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_tpu_plan_output_is_only_what_was_asked_for():
  pytest.importorskip('libtpu', reason='needs the tpu extra')
  proc = run_cli(
    'plan', '--model', 'tiny', '--topology', 'v5e:2x4', drop=('XLA_FLAGS', 'JAX_PLATFORMS')
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert not [n for n in LIBTPU_NOISE if n in proc.stderr], proc.stderr
  assert 'CollectiveCountWarning' not in proc.stderr  # the scans' trip counts are found
  assert 'FITS' in proc.stdout


@pytest.mark.slow
def test_plan_command_takes_a_users_model_spec():
  proc = run_cli('plan', '--model', '_custom_model:spec', '--topology', 'cpu:8', '--stage', '3')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'two-layer | 0.00B params | ZeRO stage 3' in proc.stdout
  wrong = run_cli('plan', '--model', '_custom_model:wrong', '--topology', 'cpu:8')
  assert wrong.returncode != 0
  assert wrong.stderr.strip().endswith(
    'error: --model _custom_model:wrong returned a dict; it must return a'
    ' zerojax.inspect.ModelSpec(name=..., init_fn=..., loss_fn=..., batch=...).'
  )


def test_cli_help_shows_every_default():
  plan = ' '.join(run_cli('plan', '--help').stdout.split())
  for shown in (
    '--stage {0,1,2,3} ZeRO stage (default: 3)',
    '--optimizer {adam,adamw,sgd,lion,adafactor} optax optimizer (default: adamw)',
    '--batch-per-chip BATCH_PER_CHIP sequences per chip per step (default: 1)',
    '--compute-dtype COMPUTE_DTYPE dtype of the matmuls (default: bfloat16)',
    '(default: data)',
    '(default: auto)',
  ):
    assert shown in plan, shown
  estimate = ' '.join(run_cli('estimate', '--help').stdout.split())
  assert '--optimizer {adam,adamw,sgd,lion,adafactor} optax optimizer (default: adam)' in estimate
