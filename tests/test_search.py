"""Plan search: the candidate space, the roofline, and searches compiled for cpu:8 and a TPU slice."""

import json
import math
import os
import subprocess
import sys

import jax
import optax
import pytest
from _models import child_env

import zerojax
from zerojax._src.planner import (
  candidates,
  lowering,
  presets,
  program_cache,
  roofline,
  search,
  search_report,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_candidate_space_keeps_valid_combinations_and_says_why_not():
  valid, invalid = candidates.candidate_space(
    stages=(1, 3), layouts=('flat', 'hpz'), prefetch=(False, True), remat=('full',)
  )
  assert candidates.Candidate(3, 'hpz') in valid
  assert candidates.Candidate(3, 'flat', prefetch=True) in valid
  reasons = {c.label(): why for c, why in invalid}
  assert reasons['s1 flat b1 remat:full prefetch'] == 'prefetch is for stage 3 with remat'
  assert reasons['s1 hpz b1 remat:full'] == 'hpz splits stage-3 parameters'
  assert reasons['s3 hpz b1 remat:full prefetch'] == 'hpz runs without per-layer gathers'
  assert len(valid) + len(invalid) == 2 * 2 * 2
  # A one-dimensional topology has no torus layouts.
  valid, invalid = candidates.candidate_space(
    stages=(3,), layouts=('torus',), remat=('full',), prefetch=(False,), grid_dims=1
  )
  assert valid == [] and {why for _, why in invalid} == {'the topology has one dimension'}


def test_prefetch_with_a_named_policy_is_left_out_with_why():
  # zerojax.scan_layers' loop keeps no named activations: compiling it would fail.
  valid, invalid = candidates.candidate_space(
    stages=(3,), layouts=('flat',), remat=('full', 'minimal', 'offload_minimal')
  )
  assert [c.label() for c in valid] == [
    's3 flat b1 remat:full',
    's3 flat b1 remat:full prefetch',
    's3 flat b1 remat:minimal',
    's3 flat b1 remat:offload_minimal',
  ]
  why = 'prefetch runs remat gathers or full: its layer loop keeps no named activations'
  assert {c.label(): w for c, w in invalid} == {
    's3 flat b1 remat:minimal prefetch': why,
    's3 flat b1 remat:offload_minimal prefetch': why,
  }


def test_a_tensor_axis_is_searched_beside_the_flat_layout_with_jax_gradients():
  valid, invalid = candidates.candidate_space(
    stages=(3,), layouts=('flat', 'torus'), remat=('minimal',), prefetch=(False,),
    micro_batches=(1, 2), tensor=(1, 4), batch_per_chip=(2,), chips=16,
  )  # fmt: skip
  assert [c.label() for c in valid] == [
    's3 flat b2 remat:minimal',
    's3 flat t4 b2 remat:minimal',
    's3 flat b2 mb2 remat:minimal',
    's3 torus b2 remat:minimal',
    's3 torus b2 mb2 remat:minimal',
  ]
  side = "a tensor axis sits beside the 'flat' layout"
  grads = (
    'a tensor axis takes gradients through jax.value_and_grad: no prefetch, micro-batches'
    " or update_on='stream' (those are zerojax.value_and_grad's)"
  )
  assert {c.label(): why for c, why in invalid} == {
    's3 flat t4 b2 mb2 remat:minimal': grads,
    's3 torus t4 b2 remat:minimal': side,
    's3 torus t4 b2 mb2 remat:minimal': side,
  }
  target = lowering.Target('cpu:8', (), (8,), None, 'tiny', optax.adamw)
  assert lowering.gradients(target, valid[1]) == 'jax'
  assert lowering.gradients(target, valid[0]) == target.gradients == 'zerojax'


@pytest.mark.parametrize('size', [0, 3, 32, 2.0])
def test_a_tensor_size_that_does_not_divide_the_slice_is_refused(size):
  with pytest.raises(ValueError) as err:
    candidates.candidate_space(tensor=(1, size), chips=16)
  assert str(err.value) == (
    f'`tensor`: [{size!r}] are not whole sizes >= 1 that divide the 16 chips of a slice'
    ' (1: no tensor axis).'
  )


@pytest.mark.parametrize('chips', [1, 2, 4, 6, 8, 12, 16, 64, 128, 256, 512])
def test_the_tensor_axis_groups_neighbouring_chips_for_every_divisor(chips):
  # The mesh rule over device counts and every tensor size that divides them: 'data' outer,
  # the tensor axis innermost over runs of neighbouring devices, every device once.
  devices = tuple(range(chips))  # stand-ins: the rule only orders them
  target = lowering.Target(f'cpu:{chips}', devices, (chips,), None, 'tiny', optax.adamw)
  for tensor in (t for t in range(1, chips + 1) if chips % t == 0):
    shape, names = lowering.mesh_shape(target, candidates.Candidate(3, tensor=tensor))
    if tensor == 1:
      assert (shape, names) == ((chips,), ('data',))
    else:
      assert (shape, names) == ((chips // tensor, tensor), ('data', lowering.TENSOR))


def test_the_tensor_axis_of_a_mesh_runs_over_neighbouring_devices():
  devices = tuple(jax.devices())
  target = lowering.Target('cpu:8', devices, (len(devices),), None, 'tiny', optax.adamw)
  mesh, names = lowering.mesh_for(target, candidates.Candidate(3, tensor=2))
  assert names == ('data', 'tensor') and dict(mesh.shape) == {'data': 4, 'tensor': 2}
  assert [list(row) for row in mesh.devices] == [list(devices[i : i + 2]) for i in (0, 2, 4, 6)]


def test_a_tensor_axis_the_model_cannot_split_is_a_failed_candidate_that_says_why():
  report = zerojax.inspect.search_plans(
    'tiny', 'cpu:8', progress=False, stages=(3,), layouts=('flat',), remat=('full',),
    prefetch=(False,), tensor=(8,),
  )  # fmt: skip
  (result,) = report.results
  assert report.winner is None and not result.fits
  assert result.status == (
    'failed: LayoutError: a tensor axis of 8 does not divide n_heads=4, n_kv_heads=4: pick a'
    ' tensor size that divides each (e.g. a divisor of 4), or drop the tensor axis.'
  )


@pytest.mark.parametrize('chip', [None, *roofline.CHIPS])
def test_a_search_tries_the_policies_unless_told_and_offloads_where_the_host_link_is_priced(chip):
  spec = roofline.CHIPS.get(chip)
  host = spec is not None and bool(spec.host_link_bandwidth and spec.host_bytes_per_chip)
  assert roofline.prices_host_link(spec) == host
  remats = candidates.default_remats(spec)
  assert remats[:4] == ('gathers', 'full', 'minimal', 'none')
  assert remats[4:] == (('offload_minimal', 'offload_minimal_inputs') if host else ())
  assert candidates.default_remats(spec, preset=False) == ('gathers',)
  # Every default is a valid remat, and the space it makes stays under the CLI's limit of 64.
  valid, _ = candidates.candidate_space(remat=remats)
  assert len(valid) == 2 * len(remats) * 3 + 2 * 2 and len(valid) <= 64


def test_candidate_space_names_an_unknown_value():
  with pytest.raises(ValueError) as err:
    candidates.candidate_space(offload=('gpu',))
  assert str(err.value) == (
    "`offload`: unknown ['gpu']; choose from [None, 'opt_state', 'opt_state+master']."
  )


@pytest.mark.slow
def test_search_on_the_cpu_mesh_compiles_ranks_and_measures(tmp_path):
  report = zerojax.inspect.search_plans(
    'tiny',
    'cpu:8',
    optimizer=lambda: optax.adamw(1e-3),
    progress=False,
    stages=(2, 3),
    layouts=('flat',),
    remat=('gathers',),
    prefetch=(False,),
  )
  assert [r.candidate.stage for r in report.results] == [2, 3]
  for r in report.results:
    assert r.fits and r.peak_bytes > 0 and r.flops > 0
    assert r.ring_bytes >= r.floor_bytes * 0.99  # never below ZeRO's floor
    assert 0 < r.measured_seconds and math.isfinite(r.step_seconds)
  ranked = report.ranked
  assert ranked[0].step_seconds <= ranked[1].step_seconds
  assert report.winner is ranked[0]
  code = search_report.winner_code(report)
  assert f'stage={report.winner.candidate.stage}' in code and 'zerojax.value_and_grad' in code
  out = search_report.search_json(report)
  assert out['roofline']['name'] == 'cpu' and len(out['results']) == 2
  assert out['results'][0]['measured_seconds'] > 0
  search_report.plot_search(report, str(tmp_path / 'search.png'))
  assert (tmp_path / 'search.png').stat().st_size > 1000
  text = search_report.format_search(report)
  assert 'pred/meas' in text and 'winner (predicted, not measured):' in text


@pytest.mark.slow
def test_a_searched_tensor_axis_compiles_the_program_of_the_plan_with_that_mesh(tmp_path):
  # A plan is a search of one: `--mesh data=4,tensor=2` and the search's 't2' candidate are
  # the same program, so the same collectives and FLOPs.
  report = zerojax.inspect.search_plans(
    'tiny', 'cpu:8', progress=False, stages=(3,), layouts=('flat',), remat=('minimal',),
    prefetch=(False,), tensor=(1, 2),
  )  # fmt: skip
  by_tensor = {r.candidate.tensor: r for r in report.results}
  assert sorted(by_tensor) == [1, 2] and all(r.fits for r in report.results)
  searched = by_tensor[2]
  out = tmp_path / 'plan.json'
  done = _cli(
    '--model', 'tiny', '--topology', 'cpu:8', '--mesh', 'data=4,tensor=2', '--stage', '3',
    '--remat', 'minimal', '--json', str(out),
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  plan = json.loads(out.read_text())
  assert plan['gradients'] == 'jax.value_and_grad' and plan['mesh'] == {'data': 4, 'tensor': 2}
  assert plan['matmul_flops_per_chip'] == searched.flops
  assert sum(plan['collectives']['ring_bytes'].values()) == searched.ring_bytes
  assert searched.ring_bytes != by_tensor[1].ring_bytes  # and not the program without it


@pytest.mark.slow
def test_nothing_fits_says_what_would(tmp_path):
  report = zerojax.inspect.search_plans(
    'tiny', 'cpu:8', progress=False, hbm_bytes=1024, stages=(3,), layouts=('flat',),
    remat=('gathers',), prefetch=(False,),
  )  # fmt: skip
  assert report.winner is None
  assert report.results[0].status == 'pruned: states alone exceed HBM'
  message = search_report.nothing_fits(report)
  assert message.startswith('no candidate fits on cpu:8 (8 chips).')
  assert 'Try --offloads opt_state,opt_state+master with --mixed-precision' in message


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


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_search_for_a_tpu_slice_writes_table_json_and_plot(tmp_path):
  pytest.importorskip('libtpu')
  proc = _cli(
    '--search', '--model', 'tiny', '--topology', 'v5e:2x4', '--stages', '2,3',
    '--layouts', 'flat,torus', '--remats', 'gathers', '--prefetch-options', 'off',
    '--out', str(tmp_path),
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  stem = tmp_path / 'search_tiny_v5e-2x4'
  data = json.loads(stem.with_suffix('.json').read_text())
  assert data['roofline']['name'] == 'v5e' and data['num_devices'] == 8
  assert [r['candidate']['layout'] for r in data['results']].count('torus') == 2
  for r in data['results']:
    assert r['fits'] and r['flops'] > 0 and r['predicted_seconds']['step'] > 0
  steps = [r['predicted_seconds']['step'] for r in data['results']]
  assert steps == sorted(steps)
  assert 'winner (predicted, not measured):' in stem.with_suffix('.txt').read_text()
  assert stem.with_suffix('.png').stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize('topology, chip', [('v5p:2x2x2', 'v5p'), ('v6e:2x4', 'v6e')])
def test_search_reads_v5p_and_v6e_programs(topology, chip):
  # jax 0.10.2 with libtpu 0.0.52 compiles these programs but cannot print them as HLO
  # text (an XLA RET_CHECK on async-update); the search reads XLA's dump of the same
  # compile instead, so their collectives are counted and the roofline applies.
  pytest.importorskip('libtpu')
  report = zerojax.inspect.search_plans(
    'tiny', topology, progress=False, stages=(3,), layouts=('flat',), remat=('full',),
    prefetch=(False,),
  )  # fmt: skip
  assert report.target.chip is roofline.CHIPS[chip]
  # v5p has SparseCores: the search tries its collectives there too, unless told
  offloads = [r.candidate.collective_offload for r in report.results]
  assert offloads == ([None, 'sparsecore'] if chip == 'v5p' else [None])
  for r in report.results:
    assert r.fits, r.status
    # The kernels' time (the compiler's estimates) cannot beat the matmuls at peak.
    assert r.predicted.compute == pytest.approx(r.kernel_seconds)
    assert r.kernel_seconds >= r.flops / roofline.CHIPS[chip].peak_flops
    # Every collective is found: a stage-3 step moves at least about the floor (measured:
    # v5p 0.98x, its small bias gathers below a tile; v6e 1.31x, the compiler all-reduces
    # some of this tiny model's gradients).
    assert r.ring_bytes >= 0.95 * r.floor_bytes, (r.ring_bytes, r.floor_bytes)
    assert r.collective_count > 0
  if chip == 'v5p':  # on the SparseCores every collective's bytes overlap compute
    plain, offloaded = report.results
    assert plain.overlapped_bytes < 0.5 * plain.ring_bytes
    assert offloaded.overlapped_bytes >= 0.99 * offloaded.ring_bytes  # measured: 99.7%


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_compile_with_text_reads_the_dump_where_as_text_fails():
  pytest.importorskip('libtpu')
  from zerojax._src.planner import tpu

  devices = tpu.topology_devices('v5p:2x2x2')
  lowered = lowering.lower(
    lowering.make_target('tiny', 'v5p:2x2x2', devices=devices, optimizer=lambda: optax.sgd(0.1)),
    candidates.Candidate(stage=3, remat='full'),
  ).lowered
  # What this jax and libtpu do: some pairs (jax 0.10.2 with libtpu 0.0.52) fail
  # to print this program with an XLA RET_CHECK, newer ones print it.
  try:
    printed = lowered.compile().as_text()
  except jax.errors.JaxRuntimeError as e:
    assert 'RET_CHECK' in str(e)  # the one failure the dump stands in for
    printed = None
  _, text = program_cache.compile_with_text(lowered)
  _, dumped = program_cache.dumped_hlo_text(lowered)  # the fallback, on every version
  assert dumped.startswith('HloModule') and 'ENTRY' in dumped
  counts = zerojax.inspect.count_collectives(dumped)
  assert counts['all-gather'] > 0
  # The same kinds of collective. (Not their counts on jax 0.12: its dump prints
  # the layer loop without its known trip count, so count_collectives warns and
  # counts the body once, 14 all-gathers against as_text()'s 50; there as_text()
  # prints the program and the dump is not used.)
  assert set(zerojax.inspect.count_collectives(text).counts) == set(counts.counts)
  if printed is not None:
    assert text == printed


def test_a_candidate_that_fails_for_a_bug_is_an_error_not_a_refusal(monkeypatch):
  target = lowering.make_target(
    'tiny', 'cpu:8', devices=jax.devices('cpu')[:8], optimizer=lambda: optax.sgd(0.1)
  )
  candidate = candidates.Candidate(stage=3, remat='full')

  def refused(target, c):
    raise ValueError('`params` leaf cannot be split')

  monkeypatch.setattr(search, 'lower', refused)
  result = search.evaluate(target, candidate, hbm_bytes=None)
  assert result.status == 'failed: ValueError: `params` leaf cannot be split'

  def broken(target, c):
    raise TypeError('missing 2 required keyword-only arguments')

  monkeypatch.setattr(search, 'lower', broken)
  with pytest.raises(TypeError, match='missing 2 required') as err:
    search.evaluate(target, candidate, hbm_bytes=None)
  assert err.value.__notes__ == [
    f'zerojax plan search: raised while lowering the candidate {candidate}.'
  ]


def test_the_search_passes_attention_chunk_to_the_presets():
  devices = jax.devices('cpu')[:8]

  def jaxpr_text(chunk):
    target = lowering.make_target(
      'tiny',
      'cpu:8',
      devices=devices,
      optimizer=lambda: optax.sgd(0.1),
      settings=presets.ModelSettings(attention_chunk=chunk),
    )
    lowered = lowering.lower(target, candidates.Candidate(stage=3, remat='full'))
    return str(lowered.traced.jaxpr)

  # The tiny preset's 64 tokens in chunks of 8: a loop of 8 inside each of its 4 blocks.
  assert 'length=8' in jaxpr_text(8)
  assert 'length=8' not in jaxpr_text(None)
  with pytest.raises(ValueError) as err:
    lowering.make_target(
      lambda remat, prefetch: None, 'cpu:8', devices=devices, optimizer=optax.sgd,
      settings=presets.ModelSettings(attention_chunk=16),
    )  # fmt: skip
  assert str(err.value) == (
    '`attention_chunk` is for the presets; a model function computes its own attention and loss.'
  )
