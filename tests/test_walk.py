"""The one traversal of a compiled program (`hlo.Program.walk`) and the analyses written on it.

The committed MaxText programs (benchmarks/results/*.hlo.gz, libtpu 0.0.50) were read by the
four walks the planner had before this one (one per analysis, each with its own recursion
guard): their figures are in tests/data/hlo_analyses.json.gz. The analyses written on the one
walk read the same figures, to the last bit.
"""

import dataclasses
import gzip
import json
import os
import warnings

import pytest

from zerojax._src.planner import arrays, collectives, cost, hlo, host_link

HERE = os.path.dirname(__file__)
RESULTS = os.path.join(HERE, '..', 'benchmarks', 'results')
with gzip.open(os.path.join(HERE, 'data', 'hlo_analyses.json.gz'), 'rt') as f:
  BEFORE = json.load(f)


def _plain(x):
  if dataclasses.is_dataclass(x):
    return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in sorted(x.items())}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x


@pytest.mark.parametrize('name', sorted(BEFORE))
def test_the_committed_programs_read_as_the_four_walks_read_them(name):
  with gzip.open(os.path.join(RESULTS, name), 'rt') as f:
    program = hlo.Program.parse(f.read())
  n = program.num_partitions
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    now = {
      'collectives': _plain(collectives.count_collectives(program)),
      # Two made-up slices: the DCN split of every collective.
      'collectives_sliced': _plain(
        collectives.count_collectives(program, slices=[i * 2 // n for i in range(n)])
      ),
      'host': _plain(host_link.count_host_transfers(program)),
      'arrays': _plain(arrays.largest_arrays(program, 20)),
      'cost': _plain(
        cost.program_cost(program, clock_hz=1.5e9, peak_flops=1.97e14, hbm_bandwidth=8.1e11)
      ),
      'cost_noclock': _plain(
        cost.program_cost(program, clock_hz=None, peak_flops=1.97e14, hbm_bandwidth=8.1e11)
      ),
    }
  # JSON's own round trip (tuples as lists), as the figures were stored.
  assert json.loads(json.dumps(now, sort_keys=True)) == BEFORE[name]


PROGRAM = """HloModule walked, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]{0}) tuple(%j, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%gather (x: f32[8]) -> f32[32] {
  %x = f32[8]{0} parameter(0)
  ROOT %ag = f32[32]{0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}
}

%quiet (x: f32[8]) -> f32[32] {
  %x = f32[8]{0} parameter(0)
  ROOT %z = f32[32]{0} broadcast(%x), dimensions={}
}

%itself (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %again = f32[8]{0} call(%x), to_apply=%itself
}

ENTRY %main (x: f32[8], c: s32[]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %c = s32[] parameter(1)
  %zero = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(%zero, %x)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body
  %y = f32[8]{0} get-tuple-element(%w), index=1
  %b = f32[32]{0} conditional(%c, %y, %y), branch_computations={%gather, %quiet}
  ROOT %r = f32[8]{0} call(%y), to_apply=%itself
}
"""


class _Seen:
  """A `_Sites` tally: the sites shown, and each fold of a body into it recorded."""

  def __init__(self, folds):
    self.sites, self.folds = [], folds

  def add(self, other, times):
    self.folds.append((times, len(other.sites)))
    self.sites.extend(other.sites)

  def weight(self):
    return len(self.sites)

  def counted(self):
    return bool(self.sites)


class _Sites:
  """Each site the walk shows, with its trip count and its caller's opcode; folds recorded."""

  counts, differ = 'its sites are', 'show different sites'

  def __init__(self):
    self.folds, self.uncertain = [], []

  def tally(self):
    return _Seen(self.folds)

  def line(self, site, tally):
    caller = site.caller.opcode if site.caller else None
    tally.sites.append((site.computation, site.name, site.trips, caller))
    return True


def test_the_walk_enters_loops_branches_and_calls_once_down_each_path():
  program = hlo.Program.parse(PROGRAM)
  sites = _Sites()
  seen = program.walk(sites).sites
  # The loop's trip count is read from its condition and initial tuple (no XLA annotation),
  # its body walked once into a fresh tally and added back that many times.
  assert (5, 7 + 3) in sites.folds  # the body's lines and its reduction's
  assert ('body', 'ar', 5, 'while') in seen
  # What an all-reduce calls (its reduction) is entered too, inside the loop.
  assert ('add', 's', 5, 'all-reduce') in seen
  # Both branches walked, each into its own tally; one runs: one of them is added back, once.
  assert ('gather', 'ag', None, 'conditional') in seen  # the first of equal weights
  assert (1, 2) in sites.folds
  assert sites.uncertain == []  # the two branches show as many sites: the same weight
  # A computation is not entered again below itself.
  assert [s for s in seen if s[0] == 'itself'] == [
    ('itself', 'x', None, 'call'),
    ('itself', 'again', None, 'call'),
  ]
  # The condition computation is not walked (nothing it runs executes per step).
  assert not [s for s in seen if s[0] == 'cond']


def test_the_analyses_fold_loops_by_trips_and_branches_as_one():
  program = hlo.Program.parse(PROGRAM)
  with pytest.warns(collectives.CollectiveCountWarning, match='branches run different'):
    stats = collectives.count_collectives(program)
  assert stats.counts == {'all-reduce': 5, 'all-gather': 1}  # the costlier branch
  assert stats.result_bytes == {'all-reduce': 5 * 32, 'all-gather': 128}
  # The walk from a site: one instruction and what it runs (the loop, five times).
  loop_site = next(
    hlo.Site(program, 'main', i, line, 'w', 'while', None, None)
    for i, line in enumerate(program.bodies['main'])
    if ' while(' in line
  )
  counted = program.walk_site(collectives._Collectives(program), loop_site)
  assert counted.counts == {'all-reduce': 5}
