"""benchmarks/bench_memory.py's `--reuse`: a committed plan is reused only where the planner would
compile the same program again; bench_recompute.py's `--reuse` and `--resume` by model revision."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import bench_memory

  compiled = []
  monkeypatch.setattr(
    bench_memory, 'plan', lambda flags, remat: compiled.append((tuple(flags), remat)) or {
      'peak_gib': 1.0, 'device_space_gib': 1.0, 'predicted_step_seconds': 1.0,
    }
  )  # fmt: skip
  yield bench_memory, compiled
  sys.modules.pop('bench_memory', None)


FLAGS = ['--model', 'tiny', '--topology', 'v5e:16x16', '--stage', '3']


def test_the_share_a_plan_compiles_with_is_the_given_one_or_the_planners_default(bench):
  bench_memory, _ = bench
  from zerojax._src.planner import candidates

  assert bench_memory.scheduler_share(FLAGS, 'full') == candidates.LEAN_SHARE
  assert bench_memory.scheduler_share(FLAGS, 'offload_layer_inputs') is None
  assert bench_memory.scheduler_share([*FLAGS, '--scheduler-share', '70'], 'full') == 70
  assert bench_memory.scheduler_share([*FLAGS, '--scheduler-share', 'compiler'], 'full') is None


def test_a_committed_plan_is_reused_only_at_the_share_the_planner_now_gives_it(bench):
  """A record of the same command compiled at another share (the default moved) is compiled
  again; one at the share the planner gives now is kept as it is."""
  bench_memory, compiled = bench
  from zerojax._src.planner import candidates

  now = {
    'command': bench_memory.command(FLAGS, 'full'), 'lean': True,
    'scheduler_share': candidates.LEAN_SHARE, 'peak_gib': 9.0,
  }  # fmt: skip
  assert bench_memory.plan_or_reuse(FLAGS, 'full', now) is now
  assert compiled == []
  before = {**now, 'scheduler_share': candidates.LEAN_SHARE + 5}
  assert bench_memory.plan_or_reuse(FLAGS, 'full', before)['peak_gib'] == 1.0
  assert compiled == [(tuple(FLAGS), 'full')]
  # A record from before the lean rule (no 'lean' key) is not the lean program either.
  older = {k: v for k, v in now.items() if k != 'lean'}
  bench_memory.plan_or_reuse(FLAGS, 'full', older)
  assert len(compiled) == 2


def test_the_searches_reuse_and_resume_only_rows_of_the_presets_revision(tmp_path, monkeypatch):
  """benchmarks/bench_recompute.py: `--reuse` hands a row's search only a record compiled at the
  presets' model revision; each searched row is saved at once, stamped with the revision, the
  others kept as they were; `--resume` skips the rows already at the revision."""
  pytest.importorskip('libtpu', reason='bench_recompute records the installed libtpu')
  import json

  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import bench_recompute

  from zerojax._src.planner import presets

  now = presets.MODEL_REVISION
  path = tmp_path / 'recompute_v5e.libtpu-9.9.9.json'
  path.write_text(json.dumps({'rows': [{'row': '16B', 'model_revision': now}, {'row': '32B'}]}))
  searched, saved = [], []

  def search_row(row, before, chip):
    searched.append((row[0], before))
    saved.append('versions' in json.loads(path.read_text()))  # written by this run yet?
    return {'row': row[0]}

  monkeypatch.setattr(bench_recompute, 'compiler_tag', lambda: 'libtpu-9.9.9')
  monkeypatch.setattr(bench_recompute, 'search_row', search_row)
  monkeypatch.setattr(bench_recompute, 'table', lambda out, chip: [])
  argv = ['bench_recompute.py', '--out', str(tmp_path), '--rows', '16B,32B']
  monkeypatch.setattr(sys, 'argv', [*argv, '--reuse'])
  assert bench_recompute.main() == 0
  assert searched == [('16B', {'row': '16B', 'model_revision': now}), ('32B', None)]
  assert saved == [False, True]  # the first row was saved before the second was searched
  run = json.loads(path.read_text())
  assert run['rows'] == [
    {'row': '16B', 'model_revision': now},
    {'row': '32B', 'model_revision': now},
  ]
  assert run['versions']['model_revision'] == now
  path.write_text(json.dumps({'rows': [{'row': '16B', 'model_revision': now}, {'row': '32B'}]}))
  searched.clear()
  monkeypatch.setattr(sys, 'argv', [*argv, '--resume'])
  assert bench_recompute.main() == 0
  assert searched == [('32B', None)]
  sys.modules.pop('bench_recompute', None)


def test_the_memory_table_reuses_only_plans_of_the_presets_revision(bench, tmp_path, monkeypatch):
  """benchmarks/bench_memory.py `--reuse`: a row's committed plans are kept only where the row
  was compiled at the presets' model revision; an older row (or one without a revision) is
  compiled again and written at the revision, and the run records the oldest of its rows'."""
  pytest.importorskip('libtpu', reason='bench_memory records the installed libtpu')
  import json

  from zerojax._src.planner import presets

  bench_memory, compiled = bench
  now = presets.MODEL_REVISION
  every = [('16B', '16B', FLAGS), ('32B', '32B', [*FLAGS[:1], 'small', *FLAGS[2:]])]

  def record(flags, remat):
    return {
      'command': bench_memory.command(flags, remat), 'peak_gib': 9.0,
      'lean': bench_memory.candidates.lean(remat),
      'scheduler_share': bench_memory.scheduler_share(flags, remat),
    }  # fmt: skip

  def committed(flags, revision):
    plans = {m: record(flags, m) for m in bench_memory.REMATS}
    shares = {
      s: record([*flags, '--scheduler-share', s], 'full') for s in bench_memory.SCHEDULER_SHARES
    }
    row = {'plans': plans, 'scheduler_shares': shares}
    return row if revision is None else {**row, 'model_revision': revision}

  monkeypatch.setattr(bench_memory, 'rows', lambda: every)
  monkeypatch.setattr(bench_memory, 'compiler_tag', lambda: 'libtpu-9.9.9')
  monkeypatch.setattr(bench_memory, 'searched_policies', lambda out, tag: {})
  monkeypatch.setattr(bench_memory, 'table', lambda out: [])
  path = tmp_path / 'memory_v5e.libtpu-9.9.9.json'
  rows = [{'row': '16B', **committed(FLAGS, now)}, {'row': '32B', **committed(every[1][2], None)}]
  path.write_text(json.dumps({'versions': {}, 'rows': rows, 'v5p': []}))
  argv = ['bench_memory.py', '--out', str(tmp_path), '--rows', '16B,32B', '--reuse']
  monkeypatch.setattr(sys, 'argv', argv)
  assert bench_memory.main() == 0
  # Only the 32B row, compiled before the revision, was planned again: each remat and share.
  per_row = len(bench_memory.REMATS) + len(bench_memory.SCHEDULER_SHARES)
  assert len(compiled) == per_row
  assert all(flags[1] == 'small' for flags, _ in compiled)
  run = json.loads(path.read_text())
  assert [r['model_revision'] for r in run['rows']] == [now, now]
  assert run['rows'][0]['plans']['full']['peak_gib'] == 9.0  # kept as committed
  assert run['rows'][1]['plans']['full']['peak_gib'] == 1.0  # the fresh plan
  assert run['versions']['model_revision'] == now
