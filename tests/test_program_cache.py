"""Compiled programs kept between plans (`program_cache`): read back, not compiled again,
only when everything that decides the program is the same; never half written."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _models import child_env

from zerojax._src.planner import program_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lowered(scale=2.0):
  f = jax.jit(lambda x: jnp.tanh(x @ x.T) * scale)
  return f.trace(jax.ShapeDtypeStruct((64, 32), jnp.float32)).lower()


def test_a_program_compiled_once_is_read_back_with_the_same_figures(tmp_path):
  first = program_cache.compile_program(_lowered(), topology='cpu:8', cache_dir=tmp_path)
  again = program_cache.compile_program(_lowered(), topology='cpu:8', cache_dir=tmp_path)
  assert (first.source, again.source) == ('compiled', 'cache')
  assert again.seconds == 0 and again.first_compile_seconds == first.seconds > 0
  assert again.text == first.text == first.program.as_text()
  m, n = first.program.memory_analysis(), again.program.memory_analysis()
  for field in ('argument', 'output', 'alias', 'temp'):
    name = f'{field}_size_in_bytes'
    assert getattr(n, name) == getattr(m, name)
  cost = first.program.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert again.program.cost_analysis()['flops'] == cost['flops'] > 0
  # One record, named by its key, under the key's first two characters.
  (path,) = tmp_path.rglob('*.json.gz')
  key = program_cache.program_key(_lowered(), 'cpu:8')
  assert path.relative_to(tmp_path).parts == (key[:2], f'{key}.json.gz')


def test_whatever_decides_the_program_is_in_its_key(tmp_path, monkeypatch):
  key = program_cache.program_key(_lowered(), 'v5e:2x4')
  assert program_cache.program_key(_lowered(3.0), 'v5e:2x4') != key  # another program
  assert program_cache.program_key(_lowered(), 'v5e:4x4') != key  # another topology
  monkeypatch.setenv('LIBTPU_INIT_ARGS', '--xla_tpu_enable_latency_hiding_scheduler=false')
  assert program_cache.program_key(_lowered(), 'v5e:2x4') != key  # other compiler flags
  monkeypatch.delenv('LIBTPU_INIT_ARGS')
  monkeypatch.setattr(program_cache, '_versions', lambda: {'jax': '0.0', 'libtpu': '0.0.1'})
  assert program_cache.program_key(_lowered(), 'v5e:2x4') != key  # another compiler
  monkeypatch.undo()
  assert program_cache.program_key(_lowered(), 'v5e:2x4') == key
  options = {'xla_tpu_rematerialization_min_size_in_bytes': 33554432}
  assert program_cache.program_key(_lowered(), 'v5e:2x4', options) != key  # compiler options
  assert program_cache.program_key(_lowered(), 'v5e:2x4', {}) == key  # none: keys kept as before


@pytest.mark.parametrize('cached', [False, True])
def test_compiler_options_reach_the_compiler_and_name_their_own_record(tmp_path, cached):
  """`compiler_options` (the planner's --compiler-option) go to the compile, here XLA's
  dump options, whose files show they arrived; with a cache they key a record of their own."""
  dump = tmp_path / 'dump'
  options = {'xla_dump_to': str(dump), 'xla_dump_hlo_as_text': True}
  cache = tmp_path / 'cache' if cached else None
  done = program_cache.compile_program(
    _lowered(), topology='cpu:8', cache_dir=cache, compiler_options=options
  )
  assert done.source == 'compiled'
  assert list(dump.glob('*after_optimizations.txt')), sorted(p.name for p in dump.iterdir())
  if cached:
    plain = program_cache.compile_program(_lowered(), topology='cpu:8', cache_dir=cache)
    assert plain.source == 'compiled'  # not the record compiled with the options
    assert len(list(cache.rglob('*.json.gz'))) == 2


def test_a_record_cut_short_is_compiled_again_and_rewritten(tmp_path):
  program_cache.compile_program(_lowered(), topology='cpu:8', cache_dir=tmp_path)
  (path,) = tmp_path.rglob('*.json.gz')
  whole = path.read_bytes()
  path.write_bytes(whole[: len(whole) // 2])
  again = program_cache.compile_program(_lowered(), topology='cpu:8', cache_dir=tmp_path)
  assert again.source == 'compiled'
  record = json.loads(gzip.decompress(path.read_bytes()))
  assert record['text'] == again.text and record['format'] == program_cache.FORMAT
  assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_refusal_for_memory_is_kept_and_raised_again(tmp_path):
  lowered = _lowered()
  key = program_cache.program_key(lowered, 'v5e:2x4')
  message = 'RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 17.20G of 15.75G hbm.'
  memo = {key: {'format': program_cache.FORMAT, 'error': message}}
  with pytest.raises(jax.errors.JaxRuntimeError) as err:
    program_cache.compile_program(lowered, topology='v5e:2x4', cache_dir=tmp_path, memo=memo)
  assert isinstance(err.value, program_cache.RecordedCompileError)
  assert str(err.value) == message and err.value.source == 'memo'
  assert not list(tmp_path.iterdir())  # read from this run's memo: nothing compiled or written


def test_a_folder_that_cannot_be_written_costs_the_reuse_not_the_plan(tmp_path):
  blocked = tmp_path / 'file'
  blocked.write_text('not a folder')
  with pytest.warns(UserWarning) as caught:
    done = program_cache.compile_program(_lowered(), topology='cpu:8', cache_dir=blocked / 'x')
  assert done.source == 'compiled' and done.text
  (w,) = caught
  assert str(w.message).startswith(f'zerojax: could not keep the compiled program in {blocked}/')
  assert str(w.message).endswith(
    'the plan is unaffected. Set ZEROJAX_CACHE_DIR to a writable folder, or pass --no-cache.'
  )


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv('ZEROJAX_CACHE_DIR', str(tmp_path / 'mine'))
  assert program_cache.default_dir() == tmp_path / 'mine'
  monkeypatch.delenv('ZEROJAX_CACHE_DIR')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert program_cache.default_dir() == tmp_path / 'xdg' / 'zerojax' / 'programs'


def _plan(*args, cache):
  env = child_env()
  env['ZEROJAX_CACHE_DIR'] = str(cache)
  return subprocess.run(
    [sys.executable, '-m', 'zerojax', 'plan', *args],
    capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
  )  # fmt: skip


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_tpu_plan_and_search_read_back_what_was_compiled(tmp_path):
  """The same plan twice: the second reads the program back and prints the same report
  (less its timed log lines); a search of two candidates, one of them that plan's program
  lowered again, compiles one; --no-cache compiles again."""
  pytest.importorskip('libtpu')
  args = ('--model', 'tiny', '--topology', 'v5e:2x4')
  runs = [_plan(*args, '--stage', '3', cache=tmp_path / 'c') for _ in range(2)]
  for proc in runs:
    assert proc.returncode == 0, proc.stderr[-3000:]
  logs = [[x for x in p.stdout.splitlines() if x.startswith('[')] for p in runs]
  assert any(x.endswith('s of XLA compile)') for x in logs[0])
  assert any(' read the compiled program back from ' in x for x in logs[1])
  assert not any('of XLA compile' in x for x in logs[1])
  untimed = [[x for x in p.stdout.splitlines() if not x.startswith('[')] for p in runs]
  assert untimed[0] == untimed[1]
  again = _plan(*args, '--stage', '3', '--no-cache', cache=tmp_path / 'c')
  assert any(x.endswith('s of XLA compile)') for x in again.stdout.splitlines())
  search = ('--search', '--stages', '2,3', '--layouts', 'flat', '--remats', 'gathers',
            '--prefetch-options', 'off')  # fmt: skip
  first = _plan(*args, *search, cache=tmp_path / 's')
  second = _plan(*args, *search, cache=tmp_path / 's')
  assert first.returncode == 0 == second.returncode, first.stderr[-3000:]
  summary = lambda p: next(x for x in p.stdout.splitlines() if x.startswith('search: '))
  assert summary(first).endswith(
    "2 programs compiled, 0 read back from the cache, 0 the same as an earlier candidate's"
  )
  assert summary(second).endswith(
    "0 programs compiled, 2 read back from the cache, 0 the same as an earlier candidate's"
  )
  table = lambda p: p.stdout[p.stdout.index('\n  # candidate') :].split('\nwhy')[0]
  assert table(first) == table(second)


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_candidate_that_lowers_like_an_earlier_one_reuses_its_program():
  pytest.importorskip('libtpu')
  import optax

  from zerojax._src.planner import candidates, lowering, search, tpu

  target = lowering.make_target(
    'tiny', 'v5e:2x4', devices=tpu.topology_devices('v5e:2x4'), optimizer=lambda: optax.sgd(0.1)
  )
  c = candidates.Candidate(3, remat='gathers')
  report = search.run_search(target, [c, c], progress=False)
  first, second = report.results
  assert (first.program_source, second.program_source) == ('compiled', 'memo')
  assert second.phase_seconds['compile'] == 0
  for field in ('peak_bytes', 'ring_bytes', 'flops', 'kernel_seconds', 'predicted'):
    assert getattr(second, field) == getattr(first, field), field
