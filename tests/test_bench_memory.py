"""benchmarks/bench_memory.py's `--reuse`: a committed plan is reused only where the planner would
compile the same program again."""

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
