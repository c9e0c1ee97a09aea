"""Collectives on the SparseCores: a plan and a search option (`--collective-offload`), its
compiler options, where it is refused, and what the TPU compiler makes of it."""

import os
import re
import subprocess
import sys

import pytest

from zerojax._src.planner import candidates, hlo
from zerojax._src.planner.roofline import CHIPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SC = candidates.SPARSECORE_OPTIONS


def test_the_offload_is_its_compiler_options_and_a_dimension_of_the_space():
  assert sorted(SC) == sorted(
    f'xla_tpu_enable_sparse_core_collective_offload_{k}'
    for k in ('all_gather', '2d_all_gather', '3d_all_gather', 'reduce_scatter',
              'nd_reduce_scatter', 'all_reduce')
  )  # fmt: skip
  assert all(v is True for v in SC.values())
  on = candidates.Candidate(3, collective_offload='sparsecore', scheduler_share=60)
  assert on.compiler_options({'xla_a': 1}) == {
    'xla_a': 1, candidates.SCHEDULER_OPTION: 60, **SC
  }  # fmt: skip
  assert candidates.Candidate(3).compiler_options() == {}
  assert on.label().endswith(' sched:60% sparsecore collectives')
  assert 'sparsecore' not in candidates.Candidate(3).label()
  space, _ = candidates.candidate_space(
    stages=(3,), layouts=('flat',), prefetch=(False,), remat=('full',),
    collective_offload=(None, 'sparsecore'),
  )  # fmt: skip
  assert [c.collective_offload for c in space] == [None, 'sparsecore']
  with pytest.raises(ValueError) as e:
    candidates.candidate_space(collective_offload=('tensorcore',))
  assert str(e.value) == (
    "`collective_offload`: unknown ['tensorcore']; choose from [None, 'sparsecore']."
  )


def test_a_search_tries_both_only_where_the_chip_has_sparsecores():
  assert CHIPS['v5p'].sparse_cores == 4
  assert CHIPS['v5e'].sparse_cores == 0 and CHIPS['v6e'].sparse_cores == 0
  both = candidates.default_collective_offloads
  assert both(CHIPS['v5p']) == (None, 'sparsecore')
  assert both(CHIPS['v5e']) == both(CHIPS['v6e']) == both(None) == (None,)
  # one of the options given by hand: the user placed the collectives, the search keeps it
  one = next(iter(SC))
  assert both(CHIPS['v5p'], {one: True}) == (None,)


@pytest.mark.parametrize(
  'topology, chip, given, message',
  [
    (
      'cpu:8', None, {},
      "`collective_offload` 'sparsecore' runs collectives on a TPU's SparseCores; cpu:8 compiles"
      ' with the CPU compiler, which has none: leave it out.',
    ),
    (
      'v5e:2x4', 'v5e', {},
      "`collective_offload` 'sparsecore': v5e:2x4 is a chip without SparseCores in the chip"
      ' table (its page gives none); leave it out (chips with them: v5p).',
    ),
    (
      'v6e:2x4', 'v6e', {},
      "`collective_offload` 'sparsecore': v6e:2x4 is a chip without SparseCores in the chip"
      ' table (its page gives none); leave it out (chips with them: v5p).',
    ),
    (
      'v5p:2x2x1', 'v5p', {'xla_tpu_enable_sparse_core_collective_offload_all_gather': True},
      'the compiler option xla_tpu_enable_sparse_core_collective_offload_all_gather and'
      " `collective_offload` 'sparsecore' set the same thing: give the offload alone (it sets"
      ' all of candidates.SPARSECORE_OPTIONS).',
    ),
  ],
)  # fmt: skip
def test_the_offload_is_refused_where_it_cannot_apply(topology, chip, given, message):
  with pytest.raises(ValueError) as e:
    candidates.check_collective_offloads(topology, CHIPS.get(chip), ('sparsecore',), given)
  assert str(e.value) == message
  # without the offload nothing is refused, whatever the chip
  candidates.check_collective_offloads(topology, CHIPS.get(chip), (None,), given)


def _cli(*args):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  return subprocess.run(
    [sys.executable, '-m', 'zerojax', 'plan', '--model', 'tiny', *args],
    capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
  )  # fmt: skip


@pytest.mark.parametrize(
  'args, code, message',
  [
    (
      ['--topology', 'cpu:8', '--collective-offload', 'sparsecore'],
      1,
      "error: --collective-offload 'sparsecore' runs collectives on a TPU's SparseCores; cpu:8"
      ' compiles with the CPU compiler, which has none: leave it out.',
    ),
    (
      ['--topology', 'cpu:8', '--search', '--collective-offloads', 'none,sparsecore'],
      1,
      "error: --collective-offloads 'sparsecore' runs collectives on a TPU's SparseCores; cpu:8"
      ' compiles with the CPU compiler, which has none: leave it out.',
    ),
    (
      ['--topology', 'cpu:8', '--collective-offload', 'tensorcore'],
      2,
      "argument --collective-offload: unknown 'tensorcore'; choose from none, sparsecore",
    ),
    (
      ['--topology', 'cpu:8', '--collective-offloads', 'sparsecore'],
      2,
      'error: --collective-offloads set the space of plan --search; a single plan does not'
      ' read them.',
    ),
  ],
)
def test_the_command_line_refuses_the_offload_before_anything_compiles(args, code, message):
  proc = _cli(*args)
  assert proc.returncode == code, proc.stderr[-2000:]
  assert message in proc.stderr, proc.stderr[-2000:]
  assert 'compiled' not in proc.stdout


SPARSECORE_THREAD = 'async_execution_thread="sparsecore"'


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_on_v5p_the_collectives_run_on_the_sparsecores_overlapped(monkeypatch, tmp_path, capsys):
  """The TPU compiler, given the offload, moves every ZeRO collective of a v5p step into an
  asynchronous call on the SparseCore thread, with the TensorCores' kernels scheduled between
  its start and its done: the step's collectives then overlap compute, where without it the
  compiler keeps them synchronous. The bytes moved are the same; the report says how to
  compile the training step, and the JSON records it."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  import json

  from zerojax._src.planner import cli, program_cache

  texts, compile_program = [], program_cache.compile_program

  def keep(lowered, **kw):
    compiled = compile_program(lowered, **kw)
    texts.append((kw['compiler_options'], compiled))
    return compiled

  monkeypatch.setattr(program_cache, 'compile_program', keep)
  argv = ['plan', '--model', 'tiny', '--topology', 'v5p:2x2x1', '--seq-len', '64', '--no-cache']
  out = tmp_path / 'plan.json'
  stats = {}
  for offload in ('none', 'sparsecore'):
    assert cli.main([*argv, '--collective-offload', offload, '--json', str(out)]) == 0
    record = json.loads(out.read_text())
    assert record['collective_offload'] == (None if offload == 'none' else offload)
    stats[offload] = record['collectives']
  text = capsys.readouterr().out
  options = [o for o, _ in texts]
  assert set(SC) <= set(options[-1]) and not set(SC) & set(options[0])
  assert "and the collectives on the chip's SparseCores: train with jax.jit(step," in text
  assert '(--scheduler-share, --collective-offload)' in text
  off, on = stats['none'], stats['sparsecore']
  assert on['ring_bytes'] == pytest.approx(off['ring_bytes'])
  for kind in ('all-gather', 'reduce-scatter'):
    assert off['overlapped_ring_bytes'].get(kind, 0) == 0, kind
    assert on['overlapped_ring_bytes'][kind] == pytest.approx(on['ring_bytes'][kind]), kind
  program = texts[-1][1].text
  assert SPARSECORE_THREAD in program and SPARSECORE_THREAD not in texts[0][1].text
  # each all-gather and reduce-scatter sits in a computation the SparseCore thread runs
  bodies = hlo.as_program(program).bodies
  called = {
    m.group(1) for body in bodies.values() for line in body if SPARSECORE_THREAD in line
    for m in [re.search(r'to_apply=%([\w.-]+)', line)] if m
  }  # fmt: skip
  holding = {
    name for name, body in bodies.items()
    if any(hlo.is_collective(x) and re.search(r' (all-gather|reduce-scatter)\(', x) for x in body)
  }  # fmt: skip
  assert holding and holding <= called, sorted(holding - called)
