"""python -m zerojax: each flag applies to its command or is an error."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _models import child_env

import zerojax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=600):
  env = child_env()
  return subprocess.run(
    [sys.executable, '-m', 'zerojax', 'plan', *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=timeout,
  )


@pytest.mark.parametrize(
  'args, message',
  [
    (
      ['--topology', 'cpu:8', '--offloads', 'none', '--update-ons', 'host'],
      "error: these options leave no valid candidate: update_on='host' needs an offload"
      ' (every combination).',
    ),
    (
      ['--topology', 'cpu:8', '--quantizes', 'int3'],
      "error: argument --quantizes: unknown 'int3'; choose from none, g8, g4, w8g8, w8g4",
    ),
    (
      # The default remats (gathers, full, minimal, none; no offload: the CPU has no host-link
      # figures) at 3 stages, one layout, and the 2 prefetching full recomputations: 14.
      ['--topology', 'cpu:8', '--stages', '1,2,3', '--max-candidates', '2'],
      'error: 14 candidates exceed --max-candidates 2;',
    ),
    (
      ['--topology', 'cpu:8', '--model', 'llama9'],
      "error: `model`='llama9' is not a preset;",
    ),
  ],
)
def test_search_cli_names_the_bad_option(args, message):
  # (Each runs the CLI in a fresh process.)
  proc = _cli('--search', *args)
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
  'args, message',
  [
    (
      ['--mixed-precision', '--micro-batches', '2', '--offloads', 'opt_state', '--hbm-gib', '8'],
      'error: --micro-batches, --offloads, --hbm-gib set the space of plan --search; a single'
      ' plan does not read them. Add --search, or set the plan with --stage, --batch-per-chip,'
      ' --mesh, --no-remat, --offload, --update-on.',
    ),
    (
      ['--search', '--stage', '2', '--json', 'x.json', '--update-on', 'host'],
      'error: plan --search does not read --stage, --json, --update-on: those set a single plan.'
      ' Give the'
      ' search its space instead (--stages, --layouts, --batches-per-chip, --remats,'
      ' --prefetch-options, --out), or drop --search.',
    ),
  ],
)
def test_a_plan_flag_the_mode_does_not_read_is_an_error(args, message):
  # Once ignored in silence (issue 26): now refused before anything compiles.
  proc = _cli('--topology', 'cpu:8', *args)
  assert proc.returncode == 2
  assert proc.stderr.strip().endswith(message), proc.stderr[-2000:]


@pytest.mark.parametrize(
  'args, code, message',
  [
    (
      ['--compiler-option', 'xla_tpu_rematerialization_min_size_in_bytes'],
      2,
      'error: argument --compiler-option: expected NAME=VALUE, got'
      " 'xla_tpu_rematerialization_min_size_in_bytes' (e.g."
      ' xla_tpu_rematerialization_min_size_in_bytes=33554432)',
    ),
    (
      ['--compiler-option', 'xla_no_such_option=1'],
      1,
      'error: --compiler-option xla_no_such_option=1: the compiler for cpu:8 refused it:'
      " INVALID_ARGUMENT: No such compile option: 'xla_no_such_option'. Option names and values"
      ' are those of the installed jaxlib and libtpu.',
    ),
    (
      ['--search', '--compiler-option', 'xla_no_such_option=true'],
      1,
      'error: --compiler-option xla_no_such_option=True: the compiler for cpu:8 refused it:',
    ),
  ],
)
def test_a_compiler_option_is_checked_before_the_step_compiles(args, code, message):
  """A malformed --compiler-option is an argument error; one the compiler does not know is
  refused by compiling a one-line program with it, before the model is built."""
  proc = _cli('--topology', 'cpu:8', *args)
  assert proc.returncode == code
  assert message in proc.stderr, proc.stderr[-2000:]
  assert 'command:' not in proc.stdout


@pytest.mark.parametrize(
  'args, code, message',
  [
    (
      ['--scheduler-share', '60'],
      1,
      'error: --scheduler-share 60 is a TPU compiler setting; cpu:8 compiles with the CPU'
      ' compiler, which has none: leave it out.',
    ),
    (
      ['--search', '--scheduler-shares', '60,compiler,70'],
      1,
      'error: --scheduler-shares 60,70 is a TPU compiler setting; cpu:8 compiles with the CPU'
      ' compiler, which has none: leave it out.',
    ),
    (
      ['--scheduler-share', 'most'],
      2,
      "error: argument --scheduler-share: expected a whole percent of HBM >= 1 or 'compiler',"
      " got 'most'",
    ),
    (
      ['--search', '--scheduler-shares', '60,0'],
      2,
      "error: argument --scheduler-shares: expected a whole percent of HBM >= 1 or 'compiler',"
      " got '0'",
    ),
    (
      ['--compiler-option', 'xla_tpu_scheduler_percent_shared_memory_limit=70'],
      1,
      'error: --compiler-option xla_tpu_scheduler_percent_shared_memory_limit=70: give it as'
      " --scheduler-share 70, the plan's own setting (reported with the line to train with; a"
      ' search takes several as --scheduler-shares).',
    ),
    (
      ['--scheduler-shares', '70'],
      2,
      'error: --scheduler-shares set the space of plan --search; a single plan does not read them.',
    ),
  ],
)
def test_a_scheduler_share_where_it_cannot_apply_is_refused(args, code, message):
  """The TPU scheduler's share of HBM: a whole percent, for a TPU topology, given one way
  (not also as the raw compiler option), and refused before anything compiles."""
  proc = _cli('--topology', 'cpu:8', *args)
  assert proc.returncode == code, proc.stderr[-2000:]
  assert message in proc.stderr, proc.stderr[-2000:]
  assert 'command:' not in proc.stdout


def test_a_candidates_scheduler_share_is_one_more_compiler_option():
  from zerojax._src.planner import candidates

  option = candidates.SCHEDULER_OPTION
  assert option == 'xla_tpu_scheduler_percent_shared_memory_limit'
  held = candidates.Candidate(3, scheduler_share=70)
  assert held.compiler_options({'xla_a': 1}) == {'xla_a': 1, option: 70}
  assert candidates.Candidate(3).compiler_options({'xla_a': 1}) == {'xla_a': 1}
  assert held.label().endswith(' sched:70%') and 'sched' not in candidates.Candidate(3).label()
  space, _ = candidates.candidate_space(stages=(3,), layouts=('flat',), remat=('full',),
                                        prefetch=(False,), scheduler_share=(None, 60, 70))  # fmt: skip
  assert [c.scheduler_share for c in space] == [None, 60, 70]
  with pytest.raises(ValueError) as e:
    candidates.candidate_space(scheduler_share=(60, 0, True))
  assert str(e.value) == (
    "`scheduler_share`: [0, True] are not whole percents of HBM >= 1 (None: the compiler's"
    ' default).'
  )
  with pytest.raises(ValueError) as e:
    candidates.check_scheduler_shares('v5e:2x4', (60,), {option: 60})
  assert str(e.value) == (
    f'the compiler option {option}=60 and `scheduler_share` 60 set the same thing: give the'
    " share alone (None for the compiler's default)."
  )


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_tpu_plan_compiles_with_its_scheduler_share_and_says_so(monkeypatch, tmp_path, capsys):
  """`--scheduler-share N` goes to the compiler beside --compiler-option's, the report gives the
  line to train with and the JSON records it; without it the plan under full remat (the
  default) holds it to `candidates.LEAN_SHARE` and says so, and under another remat, or
  with 'compiler', compiles at the compiler's default. A search takes the shares as one more
  dimension, and its winner's lines say how to compile the step."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  import json

  from zerojax._src.planner import candidates, cli, program_cache

  seen, compile_program = [], program_cache.compile_program
  monkeypatch.setattr(
    program_cache,
    'compile_program',
    lambda lowered, **kw: seen.append(kw['compiler_options']) or compile_program(lowered, **kw),
  )
  option, out = candidates.SCHEDULER_OPTION, tmp_path / 'plan.json'
  remat = {'xla_tpu_rematerialization_min_size_in_bytes': 33554432}
  argv = ['plan', '--model', 'tiny', '--topology', 'v5e:2x4', '--seq-len', '64', '--no-cache']
  argv += ['--compiler-option', 'xla_tpu_rematerialization_min_size_in_bytes=33554432']
  assert cli.main([*argv, '--scheduler-share', '60', '--json', str(out)]) == 0
  text = capsys.readouterr().out
  assert seen[-1] == {**remat, option: 60}
  assert (
    'compiled with the TPU scheduler held to 60% of HBM: train with jax.jit(step,'
    f" compiler_options={{'{option}': 60}}) (--scheduler-share)" in text
  )
  assert json.loads(out.read_text())['scheduler_share'] == 60
  assert cli.main([*argv, '--json', str(out)]) == 0
  lean = candidates.LEAN_SHARE
  assert seen[-1] == {**remat, option: lean}
  assert f'compiled with the TPU scheduler held to {lean}% of HBM' in capsys.readouterr().out
  assert json.loads(out.read_text())['scheduler_share'] == lean
  for given in (['--remat', 'gathers'], ['--scheduler-share', 'compiler']):
    assert cli.main([*argv, *given, '--json', str(out)]) == 0
    assert seen[-1] == remat
    assert 'scheduler held' not in capsys.readouterr().out
    assert json.loads(out.read_text())['scheduler_share'] is None
  seen.clear()
  search = ['plan', '--search', '--model', 'tiny', '--topology', 'v5e:2x4', '--seq-len', '64']
  search += ['--stages', '3', '--layouts', 'flat', '--remats', 'full', '--prefetch-options', 'off']
  assert cli.main([*search, '--no-cache', '--scheduler-shares', 'compiler,70']) == 0
  text = capsys.readouterr().out
  assert seen == [{}, {option: 70}]
  assert 's3 flat b1 remat:full sched:70%' in text and 's3 flat b1 remat:full ' in text
  held = f"# compile the step with jax.jit(train_step, compiler_options={{'{option}': 70}})"
  (first,) = [x for x in text.splitlines() if x.startswith('  1 s3 flat')]
  winner = text[text.index('winner (predicted, not measured):') :]
  assert (held in winner) == ('sched:70%' in first), (first, winner)


def test_a_single_plan_reports_its_command_and_host_traffic(tmp_path):
  """A single plan takes the offload flags, prints the command that reproduces it first, and
  reports the host link's bytes: on cpu:N by formula (XLA:CPU keeps no memory spaces),
  said as such; the JSON records the same."""
  out = tmp_path / 'plan.json'
  args = ['--model', 'tiny', '--topology', 'cpu:8', '--stage', '3', '--mixed-precision']
  args += ['--offload', 'opt_state+master', '--update-on', 'stream', '--json', str(out)]
  proc = _cli(*args)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == 'command: python -m zerojax plan ' + ' '.join(args)
  assert 'gradients through zerojax.value_and_grad(per_layer=True)' in proc.stdout
  (link,) = [x for x in lines if x.startswith('host link per step and chip')]
  assert link.startswith(
    'host link per step and chip (by formula: this program carries no memory spaces (XLA:CPU)):'
  )
  import json

  report = json.loads(out.read_text())
  assert report['command'] == lines[0].removeprefix('command: ')
  assert (report['offload'], report['update_on'], report['mixed_precision']) == (
    'opt_state+master',
    'stream',
    True,
  )
  traffic = report['host_traffic']
  assert traffic['source'] == 'formula'
  # The formula: the bf16 parameter shards' bytes down (gradients) and back (new parameters).
  assert traffic['to_host'] == traffic['to_device'] == report['plan_bytes_per_chip']['params']


def test_stream_needs_zerojax_gradients():
  proc = _cli('--topology', 'cpu:8', '--model', 'tiny', '--mixed-precision', '--offload',
              'opt_state+master', '--update-on', 'stream', '--grad', 'jax')  # fmt: skip
  assert proc.returncode != 0
  assert proc.stderr.strip().endswith(
    'error: --update-on stream writes gradients to host memory from inside'
    " zerojax.value_and_grad's layer loop; drop --grad jax (or use --grad zerojax)."
  )


@pytest.mark.parametrize(
  'args, message',
  [
    (
      ['--model', 'decoder:vocab=256,d_model=128,n_layers=2,n_heads=4,d_ff=512,width=3'],
      "error: --model: decoder shape: unknown ['width']; the keys are ['d_ff', 'd_model',"
      " 'gated', 'head_size', 'n_heads', 'n_kv_heads', 'n_layers', 'rope_theta', 'seq_len',"
      " 'vocab'].",
    ),
    (
      ['--model', 'decoder:vocab=256,d_model=128,n_heads=4'],
      "error: --model: decoder shape: ['d_ff', 'n_layers'] missing; give each as key=value.",
    ),
    (
      ['--model', 'decoder:no_such_shape.json'],
      "error: --model: decoder shape: no file 'no_such_shape.json'; give the path of a JSON file"
      ' of the keys, or the keys as key=value pairs (decoder:vocab=32000,d_model=4096,...).',
    ),
    (
      ['--model', 'decoder:vocab=256,d_model=128,n_layers=2,n_heads=6,d_ff=512',
       '--mesh', 'data=2,tensor=4'],
      'error: --mesh data=2,tensor=4: a tensor axis of 4 does not divide n_heads=6,'
      ' n_kv_heads=6: pick a tensor size that divides each (e.g. a divisor of 2), or drop the'
      ' tensor axis.',
    ),
    (
      ['--model', 'tiny', '--mesh', 'data=3,tensor=2'],
      'error: --mesh data=3,tensor=2 has 6 devices but the topology has 8; give the chip grid,'
      ' e.g. --mesh 16x16 for v5e:16x16, or sizes whose product is 8',
    ),
    (
      ['--model', 'tiny', '--mesh', 'data=4,tensor=2', '--grad', 'zerojax'],
      "error: on CPU, zerojax.value_and_grad beside a 'tensor' axis with bfloat16 matmuls"
      ' makes the XLA CPU compiler abort (its all-reduce promotion fails on the low-precision'
      ' all-reduces inside the region manual over the ZeRO axes); add --compute-dtype float32,'
      ' or drop --grad zerojax. TPU compiles it.',
    ),
  ],
)  # fmt: skip
def test_a_decoder_shape_or_tensor_axis_that_cannot_work_is_named(args, message):
  proc = _cli('--topology', 'cpu:8', *args)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.strip().endswith(message), proc.stderr[-2000:]


@pytest.mark.parametrize(
  'flag, value', [('--batch-per-chip', '0'), ('--seq-len', '-3'), ('--attention-chunk', 'x')]
)
def test_a_batch_length_or_chunk_below_one_is_refused_by_name(flag, value):
  # A zero batch planned a step of no work (0 FLOPs, "FITS") before it was refused.
  proc = _cli('--topology', 'cpu:8', '--model', 'tiny', flag, value)
  assert proc.returncode == 2, proc.stderr[-2000:]
  shown = repr(value) if value == 'x' else str(int(value))
  assert proc.stderr.strip().endswith(
    f'error: argument {flag}: expected a whole number >= 1, got {shown}'
  ), proc.stderr[-2000:]


@pytest.mark.parametrize(
  'args, message',
  [
    (('estimate', '--params', '1e9', '--devices', '0'),
     'argument --devices: expected a whole number >= 1, got 0'),
    (('estimate', '--params', '-5', '--devices', '8'),
     "argument --params: expected a whole count >= 1 such as 7e9, got '-5'"),
    (('estimate', '--params', 'inf', '--devices', '8'),
     "argument --params: expected a whole count >= 1 such as 7e9, got 'inf'"),
    (('estimate', '--params', 'abc', '--devices', '8'),
     "argument --params: expected a count such as 7e9, got 'abc'"),
    (('plan', '--search', '--model', 'tiny', '--topology', 'cpu:8', '--batches-per-chip', '1,0'),
     'argument --batches-per-chip: expected a whole number >= 1, got 0'),
    (('plan', '--search', '--model', 'tiny', '--topology', 'cpu:8', '--slice-counts', '0'),
     'argument --slice-counts: expected a whole number >= 1, got 0'),
  ],
)  # fmt: skip
def test_a_count_below_one_is_refused_by_argparse_not_a_traceback(args, message):
  # --devices 0 raised ZeroDivisionError and --params -5 a JAX TypeError from deep inside.
  env = child_env()
  proc = subprocess.run(
    [sys.executable, '-m', 'zerojax', *args], capture_output=True, text=True, env=env, cwd=ROOT
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().endswith(f'{args[0]}: error: {message}'), proc.stderr[-2000:]


def test_a_decoder_of_any_shape_plans_tensor_parallel_with_each_phase_timed(tmp_path):
  """A decoder given on the command line (128-wide heads on a 256-wide model, as MaxText's
  family has), split over a tensor axis beside the ZeRO axis: the projections keep their
  tensor split at rest, the report gives FLOPs per chip, and the JSON each phase's time."""
  out = tmp_path / 'plan.json'
  model = 'decoder:vocab=512,d_model=256,n_layers=2,n_heads=4,d_ff=512,head_size=128'
  proc = _cli('--topology', 'cpu:8', '--model', model, '--mesh', 'data=4,tensor=2',
              '--remat', 'minimal', '--seq-len', '64', '--json', str(out))  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "ZeRO over ('data',), tensor-parallel over 'tensor'" in proc.stdout
  import json

  report = json.loads(out.read_text())
  assert report['num_params'] == 2 * (4 * 256 * 512 + 3 * 256 * 512 + 2 * 256) + 2 * 512 * 256 + 256
  assert report['mesh'] == {'data': 4, 'tensor': 2}
  from zerojax._src.planner import presets

  assert report['model_revision'] == presets.MODEL_REVISION == 2
  # At rest (fp32): every matrix split over both axes (8 ways), the norms over 'data' only.
  matrices = 2 * (4 * 256 * 512 + 3 * 256 * 512) + 2 * 512 * 256
  assert report['plan_bytes_per_chip']['params'] == 4 * (matrices // 8 + (2 * 2 * 256 + 256) // 4)
  assert set(report['phase_seconds']) == {
    'topology',
    'plan',
    'trace and lower',
    'compile',
    'report',
    'total',
  }
  assert report['matmul_flops_per_chip'] > 0
  line = [x for x in proc.stdout.splitlines() if x.startswith('matmul FLOPs per chip')]
  assert line == [f'matmul FLOPs per chip per step (counted in the compiled program):'
                  f' {report["matmul_flops_per_chip"]:.4g}']  # fmt: skip
  # Where the memory goes: the largest arrays, largest first, and the values the layer loop
  # stacks one per layer (what it saves for the backward pass) said as such.
  largest = report['largest_arrays']
  assert len(largest) == 6
  assert [g['bytes'] for g in largest] == sorted((g['bytes'] for g in largest), reverse=True)
  assert any(
    g.get('stacked_over') == 2 and g['type'].split('[')[1].startswith('2,') for g in largest
  )
  lines = proc.stdout.splitlines()
  at = lines.index(next(x for x in lines if x.startswith('largest arrays in one chip')))
  assert all(
    lines[at + 1 + i].lstrip().split('  ')[1].startswith(g['type']) for i, g in enumerate(largest)
  )


def _tensor_ring_bytes(tmp_path, *flags) -> dict:
  """Each collective's ring bytes per chip of `plan` at --grad jax and --grad zerojax."""
  import json

  ring = {}
  for grad in ('jax', 'zerojax'):
    out = tmp_path / f'{grad}.json'
    proc = _cli(*flags, '--grad', grad, '--no-cache', '--json', str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report['gradients'] == f'{grad}.value_and_grad'
    ring[grad] = report['collectives']['ring_bytes']
  return ring


def test_zerojax_gradients_beside_a_tensor_axis_gather_only_each_chips_tensor_part(tmp_path):
  """`--grad zerojax` on a mesh with a tensor axis: zerojax.value_and_grad's explicit gathers
  and reduce-scatters move each chip's tensor part only, so the program's all-gathers move
  what the compiler's own placement (`--grad jax`) moves, not the tensor-split weights whole
  (2.8x as many bytes before the collectives ran manual over the tensor axis too)."""
  model = 'decoder:vocab=512,d_model=256,n_layers=2,n_heads=4,d_ff=512,head_size=128'
  ring = _tensor_ring_bytes(tmp_path, '--topology', 'cpu:8', '--model', model, '--mesh',
                            'data=4,tensor=2', '--seq-len', '64', '--compute-dtype', 'float32')  # fmt: skip
  assert ring['zerojax']['reduce-scatter'] > 0
  assert abs(ring['zerojax']['all-gather'] / ring['jax']['all-gather'] - 1) < 0.05, ring


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_on_tpu_zerojax_gradients_beside_a_tensor_axis_move_what_jax_gradients_move(tmp_path):
  """The same on the TPU compiler (v5e:2x4, bf16, flash attention nested in the region
  manual over 'data', `--remat minimal`): the all-gathers and reduce-scatters move what the
  compiler's own placement moves, within 5%."""
  model = 'decoder:vocab=1024,d_model=512,n_layers=2,n_heads=8,d_ff=1024,head_size=64'
  ring = _tensor_ring_bytes(tmp_path, '--topology', 'v5e:2x4', '--model', model, '--mesh',
                            'data=4,tensor=2', '--seq-len', '256', '--remat', 'minimal',
                            '--attention', 'flash')  # fmt: skip
  for kind in ('all-gather', 'reduce-scatter'):
    assert abs(ring['zerojax'][kind] / ring['jax'][kind] - 1) < 0.05, ring


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_plan_is_a_search_of_one_and_reads_its_program_once(monkeypatch, tmp_path, capsys):
  """`plan` runs its one candidate through `search.evaluate`, as a search runs each of its
  own: the same candidate gives the same figures either way. The optimized HLO of one
  compiled program is parsed once per plan and once per search candidate: collectives, host
  transfers, largest arrays and kernel cost are analyses of one `hlo.Program`."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  import json

  import optax

  from zerojax._src.planner import candidates, cli, hlo, lowering, presets, search, tpu

  parses, evaluated = [], []
  parse, evaluate = hlo._parse_computations, search.evaluate
  monkeypatch.setattr(hlo, '_parse_computations', lambda text: parses.append(1) or parse(text))
  monkeypatch.setattr(
    search, 'evaluate', lambda target, c, **kw: evaluated.append(c) or evaluate(target, c, **kw)
  )
  out = tmp_path / 'plan.json'
  argv = ['plan', '--model', 'tiny', '--topology', 'v5e:2x4', '--seq-len', '64', '--no-cache']
  assert cli.main([*argv, '--grad', 'zerojax', '--json', str(out)]) == 0
  assert 'measured/floor' in capsys.readouterr().out
  one = candidates.Candidate(3, scheduler_share=candidates.LEAN_SHARE)  # full remat: lean
  assert evaluated == [one] and len(parses) == 1
  plan = json.loads(out.read_text())
  parses.clear()
  target = lowering.make_target(
    'tiny',
    'v5e:2x4',
    devices=tpu.topology_devices('v5e:2x4'),
    optimizer=lambda: optax.adamw(1e-4),
    settings=presets.ModelSettings(seq_len=64),
  )
  result = evaluate(target, one, hbm_bytes=None)
  assert result.fits and result.flops > 0 and result.ring_bytes > 0
  assert len(parses) == 1
  assert plan['predicted_seconds'] == dataclasses.asdict(result.predicted)
  assert plan['memory']['peak'] == result.peak_bytes
  assert plan['matmul_flops_per_chip'] == result.flops
  assert sum(plan['collectives']['ring_bytes'].values()) == result.ring_bytes


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_plan_whose_states_exceed_hbm_is_refused_before_it_compiles(monkeypatch, capsys):
  """As a search prunes such a candidate: its model states at rest are over the chip's HBM
  before any activation, so the plan says so and exits 3 without a compile of minutes."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  import math

  import jax

  from zerojax._src.planner import candidates, cli, presets, program_cache

  def never(*args, **kwargs):
    raise AssertionError('compiled a plan that cannot fit')

  monkeypatch.setattr(program_cache, 'compile_program', never)
  argv = ['plan', '--model', 'llama2-7b', '--topology', 'v5e:2x4', '--stage', '1', '--no-cache']
  assert cli.main([*argv, '--seq-len', '64']) == 3
  err = capsys.readouterr().err.splitlines()
  # Stage 1, AdamW: fp32 parameters whole on each chip (4 bytes each), the two fp32 moments
  # split over the 8 chips (8 / 8 bytes each).
  spec = presets.decoder_spec('llama2-7b', presets.ModelSettings(seq_len=64))
  shapes = jax.eval_shape(spec.init_fn, jax.random.key(0))
  psi = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  assert err[-1] == (
    f's1 flat b1 remat:full sched:{candidates.LEAN_SHARE}%: DOES NOT FIT: pruned: states alone'
    f' exceed HBM ({psi:,} parameters; model states at rest {psi * (4 + 8 / 8) / 2**30:.2f} GiB'
    ' per chip, of 16 GiB HBM)'
  )


def test_activation_offload_is_refused_where_the_host_link_has_no_figures():
  proc = _cli('--topology', 'cpu:8', '--model', 'tiny', '--remat', 'offload_qkv')
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
    "error: remat 'offload_qkv' moves saved activations to host memory, but cpu has no"
    ' host-link figures (bandwidth and host memory per chip), so their transfers cannot be'
    " priced; keep them in HBM ('minimal', 'save_qkv', 'save_attention', 'save_qkv_attention',"
    " 'save_mlp', 'minimal_residual') or plan a chip with those figures (v5e, v5p, v6e)."
  )


def test_an_unknown_remat_policy_is_refused_with_the_choices():
  proc = _cli('--topology', 'cpu:8', '--model', 'tiny', '--remat', 'save_everything')
  assert proc.returncode == 2
  assert "--remat: invalid choice: 'save_everything' (choose from" in proc.stderr
  assert 'offload_minimal' in proc.stderr  # quoted or not, by the Python's argparse


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize('remat, per_layer', [('offload_qkv', 3), ('offload_layer_inputs', 1)])
def test_offloaded_activations_are_counted_as_host_bytes_per_step(tmp_path, remat, per_layer):
  """`--remat offload_qkv`: each block's query, key and value projections go to host memory in
  the forward pass and come back in the backward; `offload_layer_inputs`: each block's input
  does (the layer loop's stack). The report counts them in the compiled program like an
  offloaded optimizer state."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  import json

  from zerojax._src.planner import presets

  out = tmp_path / 'plan.json'
  proc = _cli('--topology', 'v5e:2x4', '--model', 'tiny', '--seq-len', '256', '--remat',
              remat, '--no-cache', '--json', str(out))  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  traffic = json.loads(out.read_text())['host_traffic']
  cfg = presets.PRESETS['tiny']
  # One sequence per chip: per layer, `per_layer` bf16 (256, d_model) activations each way.
  moved = cfg.n_layers * per_layer * 256 * cfg.d_model * 2
  assert traffic['source'] == 'hlo'
  assert traffic['to_host'] == traffic['to_device'] == moved
  assert 'host link per step and chip (counted in the compiled program)' in proc.stdout


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_tpu_search_tries_the_offloading_policies_unless_told():
  # v5e's host link has figures: 6 remats at 3 stages and 2 layouts, and the 4 prefetching
  # full recomputations (stage 3, 2 layouts); --remats full leaves 6 and 2. Refused for size
  # before anything compiles.
  proc = _cli('--search', '--topology', 'v5e:2x4', '--max-candidates', '1')
  assert (
    proc.stderr.strip()
    .splitlines()[-1]
    .startswith('error: 40 candidates exceed --max-candidates 1;')
  ), proc.stderr[-2000:]
  proc = _cli('--search', '--topology', 'v5e:2x4', '--remats', 'full', '--max-candidates', '1')
  assert 'error: 8 candidates exceed' in proc.stderr, proc.stderr[-2000:]


def test_a_search_of_a_users_model_tries_gathers_alone_unless_told():
  from _models import run_cli

  proc = run_cli('plan', '--search', '--topology', 'cpu:8', '--model', '_custom_model:spec',
                 '--prefetch-options', 'off', '--max-candidates', '1')  # fmt: skip
  assert (
    proc.stderr.strip()
    .splitlines()[-1]
    .startswith('error: 3 candidates exceed --max-candidates 1;')
  ), proc.stderr[-2000:]
  assert 'note:' not in proc.stderr


def test_a_named_policy_is_refused_for_a_model_that_cannot_be_told_it():
  from _models import run_cli

  proc = run_cli(
    'plan', '--topology', 'cpu:8', '--model', '_custom_model:spec', '--remat', 'save_qkv'
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
    "error: remat 'save_qkv' is a policy the model applies in its own layer loop, and --model"
    ' _custom_model:spec takes no `remat` argument to be told it. Give spec a `remat` parameter'
    ' and checkpoint its layer with jax.checkpoint(layer, policy=zerojax.remat.policy(remat)),'
    " its activations tagged with zerojax.remat's names (jax.ad_checkpoint.checkpoint_name); or"
    ' plan a preset or decoder:... with it.'
  )


def test_a_named_policy_plans_a_users_model_that_tags_what_it_keeps(tmp_path):
  """`plan module:function --remat NAME`: a function taking `remat` is told the policy; a model
  tagging what it keeps compiles, one missing a tag is refused naming it."""
  from _models import run_cli

  out = tmp_path / 'plan.json'
  proc = run_cli('plan', '--topology', 'cpu:8', '--model', '_custom_model:tagged', '--remat', 'minimal',
              '--json', str(out))  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(out.read_text())['model'] == 'tagged'
  proc = run_cli(
    'plan', '--topology', 'cpu:8', '--model', '_custom_model:untagged', '--remat', 'minimal'
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
    "error: remat 'minimal' keeps the activations tagged zerojax_qkv, zerojax_mlp_hidden; the"
    " model 'untagged' does not tag zerojax_mlp_hidden (it tags zerojax_qkv). Tag them in its"
    ' layer with jax.ad_checkpoint.checkpoint_name(x, zerojax.remat.QKV) and the like'
    " (zerojax.remat's names), or plan 'gathers', 'full' or 'none'."
  )


@pytest.mark.parametrize(
  'remat, kept', [('minimal', {'zerojax_qkv': 1, 'zerojax_mlp_hidden': 1}),
                  ('save_qkv', {'zerojax_qkv': 1}), ('save_mlp', {'zerojax_mlp_hidden': 1}),
                  ('full', {})],
)  # fmt: skip
def test_a_users_layer_keeps_exactly_what_its_policy_names(remat, kept, capsys):
  """zerojax.remat.policy on a model of one's own: the residuals its layer keeps for the
  backward pass are the activations the policy names, beside the layer's arguments."""
  import _custom_model

  _, layer = _custom_model._layered(remat, (zerojax.remat.QKV, zerojax.remat.MLP_HIDDEN))
  params = _custom_model.tagged().init_fn(jax.random.key(0))
  w = jax.tree.map(lambda x: x[0], params['layers'])
  x = jnp.ones((4, 64))
  jax.ad_checkpoint.print_saved_residuals(lambda x, w: jnp.sum(layer(x, w)[0]), x, w)
  lines = capsys.readouterr().out.splitlines()
  named = [line.split("'")[1] for line in lines if ' named ' in line]
  assert {n: named.count(n) for n in set(named)} == kept
  assert all('from the argument' in line or ' named ' in line for line in lines), lines


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_plan_target_is_what_the_plan_command_plans(capsys):
  """`cli.plan_target(flags)`: the target and the one candidate `python -m zerojax plan FLAGS`
  hands to `search.evaluate`, for a script that plans other candidates on the same target."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  from zerojax._src.planner import cli, roofline

  target, candidate, hbm = cli.plan_target(
    ['--topology', 'v5e:2x4', '--mesh', '2x4', '--model', 'tiny', '--seq-len', '256',
     '--remat', 'save_qkv']
  )  # fmt: skip
  assert (candidate.stage, candidate.layout, candidate.remat) == (3, 'torus', 'save_qkv')
  assert (target.topology, target.grid, target.axis_names) == ('v5e:2x4', (2, 4), ('x', 'y'))
  assert target.settings.seq_len == 256 and target.gradients == 'zerojax'
  assert hbm == roofline.HBM_GIB['v5e'] * 2**30
  with pytest.raises(SystemExit):
    cli.plan_target(['--topology', 'v5e:2x4', '--model', 'tiny', '--remat', 'keep_nothing'])
  assert "invalid choice: 'keep_nothing'" in capsys.readouterr().err.replace('"', "'")


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_full_remat_is_planned_and_searched_lean_unless_told(monkeypatch):
  """Under --remat full (`candidates.LEAN_REMATS`) a TPU plan holds the compiler's scheduler to
  `candidates.LEAN_SHARE` of HBM and compiles the lean head; other remats keep the compiler's
  default; a share given (or 'compiler') wins."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  from zerojax._src.planner import candidates, cli, lowering, presets

  assert candidates.LEAN_REMATS == ('full',)

  plan = ['--topology', 'v5e:2x4', '--model', 'tiny', '--stage', '3']
  shares = lambda *flags: cli.plan_target([*plan, *flags])[1].scheduler_share
  lean = candidates.LEAN_SHARE
  assert shares() == lean and shares('--remat', 'full') == lean
  assert shares('--remat', 'gathers') is None and shares('--remat', 'minimal') is None
  assert shares('--scheduler-share', 'compiler') is None
  assert shares('--scheduler-share', '80') == 80
  search = ['--topology', 'v5e:2x4', '--model', 'tiny', '--stages', '3', '--layouts', 'flat',
            '--remats', 'gathers,full', '--prefetch-options', 'off']  # fmt: skip
  space = lambda *flags: [
    (c.remat, c.scheduler_share) for c in cli.search_target([*search, *flags])[1]
  ]
  assert space() == [('gathers', None), ('full', lean)]
  assert space('--scheduler-shares', 'compiler,70') == [
    ('gathers', None), ('gathers', 70), ('full', None), ('full', 70),
  ]  # fmt: skip
  target, candidate, _ = cli.plan_target(plan)
  seen = []
  monkeypatch.setattr(presets, 'decoder_spec', lambda *a, **kw: seen.append(kw['lean_head']))
  for remat in ('full', 'gathers', 'minimal'):
    lowering.model_spec(target, dataclasses.replace(candidate, remat=remat))
  assert seen == [True, False, False]


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_search_target_is_what_the_search_command_searches():
  """`cli.search_target(flags)`: the target, the candidates and `search.run_search`'s other
  arguments of `python -m zerojax plan --search FLAGS`, for a script that runs the command's
  own search; a space over --max-candidates is refused as the command refuses it."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  from zerojax._src.planner import cli

  flags = ['--topology', 'v5e:2x4', '--model', 'tiny', '--stages', '2,3', '--layouts', 'flat',
           '--remats', 'full', '--prefetch-options', 'off', '--hbm-gib', '2']  # fmt: skip
  target, space, run = cli.search_target(flags)
  assert (target.topology, target.model, len(target.devices)) == ('v5e:2x4', 'tiny', 8)
  assert [(c.stage, c.layout, c.remat, c.prefetch) for c in space] == [
    (2, 'flat', 'full', False),
    (3, 'flat', 'full', False),
  ]
  assert run['hbm_bytes'] == 2 * 2**30 and not run['measure'] and run['invalid'] == []
  with pytest.raises(SystemExit) as info:
    cli.search_target([*flags, '--max-candidates', '1'])
  assert str(info.value) == (
    'error: 2 candidates exceed --max-candidates 1; narrow the space (e.g. --stages 3'
    ' --remats gathers) or raise the limit'
  )


def test_a_search_of_a_users_model_tries_its_named_policies_and_names_a_missing_tag():
  """A function taking `remat` is searched over --remats; a policy whose tags its model lacks is
  that candidate's failure, naming them, and the others still rank."""
  from _models import run_cli

  proc = run_cli('plan', '--search', '--topology', 'cpu:8', '--model', '_custom_model:untagged',
                 '--stages', '3', '--layouts', 'flat', '--remats', 'gathers,minimal',
                 '--prefetch-options', 'off')  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '1 s3 flat b1 remat:gathers' in proc.stdout
  assert (
    's3 flat b1 remat:minimal                                     failed: ValueError: remat'
    " 'minimal' keeps the activations tagged zerojax_qkv, zerojax_mlp_hidden; the model"
    " 'untagged' does not tag zerojax_mlp_hidden"
  ) in proc.stdout
  assert 'note:' not in proc.stderr  # its --remats are searched, not cut to one


@pytest.mark.parametrize(
  'args, message',
  [
    (
      ['--update-on', 'host'],
      '--update-on host runs the optimizer update where an offloaded state lives: add --offload'
      ' opt_state (or --offload opt_state+master), or drop --update-on.',
    ),
    (
      ['--offload', 'opt_state+master', '--update-on', 'stream'],
      "--update-on stream sends the new parameters back through zerojax.mixed_precision's"
      ' master step (without it the update runs as --update-on host): add --mixed-precision,'
      ' or say --update-on host.',
    ),
    (
      ['--offload', 'opt_state+master', '--update-on', 'stream', '--offload-params'],
      "--update-on stream sends the new parameters back through zerojax.mixed_precision's"
      ' master step (without it the update runs as --update-on host): add --mixed-precision,'
      ' or say --update-on host.',
    ),
    (
      ['--mixed-precision', '--offload-params'],
      '--offload-params keeps the parameters in host memory, so the optimizer update runs'
      ' there too, on an offloaded state: add --offload opt_state+master and --update-on host'
      ' (or stream).',
    ),
    (
      ['--offload', 'opt_state', '--offload-params'],
      '--offload-params keeps the parameters in host memory, so the optimizer update runs'
      ' there too, on an offloaded state: add --update-on host (or stream).',
    ),
    (
      ['--search', '--offloads', 'opt_state', '--update-ons', 'host,stream'],
      "--update-ons stream sends the new parameters back through zerojax.mixed_precision's"
      ' master step, which the search plans only with --mixed-precision: add'
      ' --mixed-precision, or drop stream from --update-ons.',
    ),
  ],
)
def test_offload_flags_that_make_no_one_candidate_are_refused_before_tracing(
  args, message, monkeypatch, capsys
):
  # Refused by the parser, before a model is built: a plan and a search of one candidate
  # cannot differ for lack of a flag.
  from zerojax._src.planner import cli, lowering

  monkeypatch.setattr(lowering, 'make_target', lambda *a, **k: pytest.fail('traced'))
  with pytest.raises(SystemExit) as e:
    cli.main(['plan', '--model', 'tiny', '--topology', 'v5e:1x1', *args])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f': error: {message}')
