"""Hierarchical ZeRO across slices on the faked CPU mesh: a 'slice' axis of 2 data-parallel
replicas, ZeRO over the 4 devices of each (`Options(replica_axis=...)`).

Results equal plain optax on the whole batch, and the compiled program's bytes between the
replicas (the stand-in for the data-center network between TPU slices) are the DCN floor:
each device's gradient shard all-reduced across the slices once per step.
"""

import json
import re

import jax
import numpy as np
import optax
import pytest
from _models import GRAD_TOL, batch, loss_fn, max_rel_err, mlp_params, train_tol
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import collectives, hlo

SLICES, PER_SLICE = 2, 4
PSI = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(mlp_params()))
# Each device's fp32 gradient shard (Ψ/4 values) all-reduced across 2 slices: 2·(4Ψ/4)·(1/2).
DCN_FLOOR = 2 * (4 * PSI / PER_SLICE) * (SLICES - 1) / SLICES
# The loss and its normaliser, one f32 summed over every device, cross the slices too.
LOSS_BYTES = 2 * (4 / PER_SLICE) * (SLICES - 1) / SLICES


def _mesh(kind=AxisType.Explicit):
  return jax.make_mesh((SLICES, PER_SLICE), ('slice', 'data'), axis_types=(kind, kind))


def _rows(mesh, *arrays):
  return jax.device_put(arrays, NamedSharding(mesh, PartitionSpec(('slice', 'data'))))


def _zero_step(mesh, stage, micro, steps=2, per_layer=False):
  """`steps` steps of zerojax.value_and_grad + the wrapped Adam; the step compiled."""
  tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh, replica_axis='slice')
  plan = zerojax.plan_for(tx, mlp_params())
  params = jax.device_put(mlp_params(), plan.params)
  opt_state = tx.init(params)
  x, y = _rows(mesh, *batch())
  grad_fn = zerojax.value_and_grad(
    lambda p, b: loss_fn(zerojax.gather(p, plan), *b),
    tx,
    per_layer=per_layer,
    micro_batches=micro,
  )

  @jax.jit
  def step(params, opt_state, b):
    loss, grads = grad_fn(params, b)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  first = None
  for _ in range(steps):
    params, opt_state, loss, grads = step(params, opt_state, (x, y))
    first = (loss, grads) if first is None else first
  return params, first, step.lower(params, opt_state, (x, y)).compile(), plan


def _plain(steps=2):
  params, (x, y), tx = mlp_params(), batch(), optax.adam(1e-2)
  state, first = tx.init(params), None
  for _ in range(steps):
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
    first = (loss, grads) if first is None else first
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, first


@pytest.mark.parametrize(
  'stage, per_layer', [(1, False), (2, False), (3, False), (2, True), (3, True)]
)
@pytest.mark.parametrize('micro', [1, 2])
@pytest.mark.filterwarnings('ignore:zerojax.value_and_grad.per_layer=True.. the loss gathers')
def test_hierarchical_zero_follows_plain_optax_and_moves_the_dcn_floor(stage, per_layer, micro):
  # per_layer: each gather's backward reduce-scatters its gradient and, with one micro-batch,
  # sums the shard across the slices right there.
  want_params, (want_loss, want_grads) = _plain()
  params, (loss, grads), compiled, plan = _zero_step(_mesh(), stage, micro, per_layer=per_layer)
  assert plan.replica_axes == ('slice',) and plan.axes == ('data',)
  assert abs(float(loss) - float(want_loss)) <= GRAD_TOL * abs(float(want_loss))
  assert max_rel_err(grads, want_grads) <= GRAD_TOL
  assert max_rel_err(params, want_params) <= train_tol(2)
  # Between the slices: the gradient shards, once per step, and the loss.
  stats = collectives.count_collectives(compiled, slices=np.arange(8) // PER_SLICE)
  assert stats.total_dcn_bytes == pytest.approx(DCN_FLOOR + LOSS_BYTES)
  assert not stats.dcn_gathers


def test_the_report_separates_the_networks():
  _, _, compiled, plan = _zero_step(_mesh(AxisType.Auto), 2, 1, steps=1)
  report = zerojax.inspect.step_report(compiled, plan=plan)
  assert report.num_slices == SLICES and report.dcn_floor_bytes == DCN_FLOOR
  # Within each slice the ZeRO floor (N = 4: the devices of one slice), at 1.00x.
  assert report.num_devices == PER_SLICE
  assert report.collectives.total_ici_bytes == pytest.approx(report.floor_bytes, rel=0.01)
  printed = str(report)
  assert f'networks ({SLICES} slices): ICI' in printed
  assert "DCN floor (each chip's gradient shard all-reduced across slices" in printed
  ratios = [float(r) for r in re.findall(r'measured/floor = ([\d.]+)', printed)]
  assert len(ratios) == 2 and all(1.0 <= r <= 1.001 for r in ratios)  # ICI, then DCN
  assert 'flagged' not in printed


def test_parameters_gathered_across_slices_are_flagged():
  # ZeRO over both axes with the parameters split over both too: stage 3 gathers them across
  # the slices, which hierarchical ZeRO (or param_axis='data', hpZ) never does.
  mesh = _mesh()
  tx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh, axis=('slice', 'data'))
  plan = zerojax.plan_for(tx, mlp_params())
  params = jax.device_put(mlp_params(), plan.params)
  x, y = _rows(mesh, *batch())
  grad_fn = zerojax.value_and_grad(lambda p, b: loss_fn(p, *b), tx, per_layer=False)
  text = jax.jit(grad_fn).lower(params, (x, y)).compile().as_text()
  stats = collectives.count_collectives(text, slices=np.arange(8) // PER_SLICE)
  assert stats.dcn_gathers and stats.dcn_ring_bytes.get('all-gather', 0) > 0
  # With hpZ the gathers stay inside the slices.
  tx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh, axis=('slice', 'data'), param_axis='data')
  plan = zerojax.plan_for(tx, mlp_params())
  params = jax.device_put(mlp_params(), plan.params)
  grad_fn = zerojax.value_and_grad(lambda p, b: loss_fn(p, *b), tx, per_layer=False)
  text = jax.jit(grad_fn).lower(params, (x, y)).compile().as_text()
  assert not collectives.count_collectives(text, slices=np.arange(8) // PER_SLICE).dcn_gathers


def test_replica_axis_errors_name_the_fix():
  with pytest.raises(ValueError) as e:
    zerojax.Options(axis='data', replica_axis=('slice', 'data'))
  assert str(e.value) == (
    "Options(replica_axis=('slice', 'data')) names ['data'], which is also a ZeRO axis"
    " (axis='data'): an axis either splits the state (axis) or holds whole copies of it"
    ' (replica_axis). Drop it from one of them.'
  )
  with pytest.raises(ValueError, match=r"`axis`='rows' names \['rows'\]"):
    zerojax.zero_stage(optax.adam(1e-2), 2, mesh=_mesh(), replica_axis='rows')
  tx = zerojax.zero_stage(
    optax.adam(1e-2), 3, mesh=_mesh(), replica_axis='slice', offload='opt_state',
    update_on='stream',
  )  # fmt: skip
  grad_fn = zerojax.value_and_grad(lambda p, b: loss_fn(p, *b), tx, per_layer=True)
  x, y = _rows(_mesh(), *batch())
  with pytest.raises(ValueError) as e:
    jax.eval_shape(grad_fn, mlp_params(), (x, y))
  assert str(e.value) == (
    "update_on='stream' sends gradient shards to host memory from inside the backward pass,"
    " before they could be summed over the replica axes ('slice',); use update_on='host' on a"
    ' mesh with replica axes (e.g. several TPU slices).'
  )


def test_replica_groups_of_every_form():
  line = 'x = f32[8] all-reduce(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add'
  assert hlo.replica_groups(line, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert hlo.replica_groups('x = f32[8] all-reduce(%p), replica_groups={}', 4) == [[0, 1, 2, 3]]
  assert hlo.replica_groups('replica_groups=[2,4]<=[8]', 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  iota = 'replica_groups=[4,2]<=[2,4]T(1,0)'
  assert hlo.replica_groups(iota, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  mesh = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
  assert hlo.replica_groups(mesh, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo.replica_groups("replica_groups=mesh['a'=2,'b'=2] {'b'}", 4) == [[0, 1], [2, 3]]
  assert hlo.replica_groups('replica_groups=<unknown>', 8) is None


def test_a_collective_between_slices_as_the_tpu_compiler_emits_it():
  # The TPU compiler hands a collective between slices to its DCN runtime as a `send`.
  text = (
    'ENTRY %main (p: f32[1024]) -> f32[1024] {\n'
    '  %p = f32[1024]{0} parameter(0)\n'
    '  %a = token[] after-all()\n'
    '  %s = (f32[1024]{0}, u32[], token[]) send(%p, %a), channel_id=2, is_host_transfer=true,'
    ' frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}\n'
    '  %m = f32[1024]{0} multiply(%p, %p)\n'
    '  %d = token[] send-done(%s), channel_id=2, is_host_transfer=true\n'
    '  %r = (f32[1024]{0}, u32[], token[]) recv(%a), channel_id=1, is_host_transfer=true,'
    ' frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}\n'
    '  ROOT %rd = (f32[1024]{0}, token[]) recv-done(%r), channel_id=1, is_host_transfer=true\n'
    '}'
  )
  stats = collectives.count_collectives(text, slices=[0, 0, 1, 1, 2, 2, 2, 2])
  assert stats.counts == {'all-reduce': 1}
  assert stats.dcn_ring_bytes['all-reduce'] == pytest.approx(2 * 4096 * 2 / 3)  # 3 slices
  assert stats.dcn_overlapped_ring_bytes['all-reduce'] == stats.dcn_ring_bytes['all-reduce']
  with pytest.warns(collectives.CollectiveCountWarning, match='the number of slices was not given'):
    assert collectives.count_collectives(text).counts == {}


def test_a_cpu_search_over_slices_is_timed_and_measured(tmp_path):
  # On cpu:N the slices are stood in for by the faked devices: the search compiles, predicts
  # with the measured copy bandwidth for the bytes between them, and runs each candidate.
  from _models import run_cli

  r = run_cli(
    'plan', '--search', '--model', 'tiny', '--topology', 'cpu:4', '--slice-counts', '1,2',
    '--stages', '3', '--layouts', 'flat', '--remats', 'full', '--prefetch-options', 'off',
    '--out', str(tmp_path),
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  found = json.loads((tmp_path / 'search_tiny_cpu-4.json').read_text())['results']
  two = next(row for row in found if row['candidate']['slices'] == 2)
  assert two['fits'] and two['measured_seconds'] and two['predicted_seconds']['dcn'] > 0
  # The bf16 gradient shards cross in f32: XLA:CPU carries bf16 all-reduces in f32, twice the
  # floor's bytes (on TPU they cross in bf16, at the floor: tests/test_slices_tpu.py).
  floor = two['dcn_floor_bytes']
  assert 2 * floor <= two['dcn_ring_bytes'] <= 2 * floor + 16
