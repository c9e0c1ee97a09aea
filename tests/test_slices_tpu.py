"""Several TPU slices, compiled ahead of time for two v5e:2x2 slices with no TPU: the devices
carry their slice, the compiler hands collectives between slices to its data-center network
(DCN) runtime, and the planner counts those apart and checks the layout."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import TWO_LAYER_PSI, D, init_fn, run_cli, step
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import tpu

pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu) for ahead-of-time compilation')
pytestmark = [pytest.mark.tpu, pytest.mark.xdist_group('libtpu')]

PER_SLICE = 4


@pytest.fixture(scope='module')
def devices():
  return tpu.topology_devices('v5e:2x2', slices=2)


def _mesh(devices, names=('slice', 'data')):
  grid = np.array(devices).reshape(2, PER_SLICE)
  if names == ('data', 'slice'):
    grid = grid.T
  return Mesh(grid, names, axis_types=(AxisType.Explicit,) * 2)


def test_devices_come_slice_by_slice(devices):
  assert [d.slice_index for d in devices] == [0] * PER_SLICE + [1] * PER_SLICE
  assert zerojax.zero_stage(optax.adam(1e-3), 3, mesh=_mesh(devices)) is not None


@pytest.mark.parametrize('stage', [2, 3])
def test_the_compiled_step_moves_the_dcn_floor_between_slices(stage, devices):
  mesh = _mesh(devices)
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)  # replica_axis found: 'slice'
  assert zerojax.config_of(tx).replica_axes == ('slice',)
  state = zerojax.inspect.abstract_train_state(init_fn, jax.random.key(0), tx=tx)
  rows = NamedSharding(mesh, PartitionSpec(('slice', 'data')))
  x = jax.ShapeDtypeStruct((64, D), jnp.float32, sharding=rows)
  compiled = jax.jit(step).lower(state, x).compile()
  report = zerojax.inspect.step_report(compiled, plan=zerojax.plan_for(tx, state.params))
  # fp32 gradient shards of Ψ/4 values all-reduced across 2 slices: 2·(4Ψ/4)·(1/2).
  assert report.num_slices == 2 and report.dcn_floor_bytes == 4 * TWO_LAYER_PSI / PER_SLICE
  c = report.collectives
  # Beyond the floor: the loss, and the biases' shards (64 values) padded to whole TPU tiles.
  assert report.dcn_floor_bytes <= c.total_dcn_bytes <= report.dcn_floor_bytes + 2048
  assert not c.dcn_gathers and 'flagged' not in str(report)


def test_a_slice_axis_inside_the_mesh_is_refused(devices):
  with pytest.raises(ValueError) as e:
    zerojax.zero_stage(optax.adam(1e-3), 2, mesh=_mesh(devices, ('data', 'slice')))
  assert str(e.value) == (
    "the mesh axes ('slice',) run across TPU slices but the mesh is ('data', 'slice'): axes"
    ' across slices must come first (outermost), so each slice holds whole blocks of the'
    ' others. Build it with jax.experimental.mesh_utils.create_hybrid_device_mesh, or order'
    " the axes as ('slice', 'data')."
  )


def test_stage3_over_slices_must_say_where_parameters_are_gathered(devices):
  mesh = _mesh(devices)
  with pytest.raises(ValueError) as e:
    zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis=('slice', 'data'))
  assert str(e.value) == (
    "stage 3 with ZeRO over ['slice'], which runs across TPU slices, would all-gather every"
    ' parameter over the data-center network in each forward and backward pass. Keep the'
    " parameters inside a slice with param_axis=('data',) (ZeRO++ hpZ), or leave ['slice']"
    ' out of `axis` (hierarchical ZeRO: one DCN all-reduce of each gradient shard per step),'
    " or say param_axis=('slice', 'data') to gather over DCN on purpose."
  )
  with pytest.raises(ValueError, match='with a ZeRO axis inside the slices and param_axis= that'):
    zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='slice')
  # Said either way, it is taken.
  zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis=('slice', 'data'), param_axis='data')
  zerojax.zero_stage(
    optax.adam(1e-3), 3, mesh=mesh, axis=('slice', 'data'), param_axis=('slice', 'data')
  )


def test_a_slice_axis_that_is_neither_zero_nor_data_parallel_is_refused(devices):
  mesh = Mesh(
    np.array(devices).reshape(2, 2, 2),
    ('slice', 'data', 'model'),
    axis_types=(AxisType.Explicit,) * 3,
  )
  with pytest.raises(ValueError, match=r"the mesh axes \['slice'\] run across TPU slices but are"):
    zerojax.zero_stage(optax.adam(1e-3), 2, mesh=mesh, replica_axis='model')


TINY = 'decoder:vocab=512,d_model=256,n_layers=2,n_heads=2,n_kv_heads=2,d_ff=512,head_size=128'


def test_plan_slices_reports_both_networks(tmp_path):
  out = tmp_path / 'plan.json'
  r = run_cli(
    'plan', '--model', TINY, '--seq-len', '256', '--topology', 'v5e:2x2', '--slices', '2',
    '--stage', '3', '--json', str(out), '--no-cache',
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  assert "data-parallel over 'slice'" in r.stdout
  assert 'networks (2 slices): ICI' in r.stdout and 'DCN floor' in r.stdout
  plan = json.loads(out.read_text())
  assert plan['slices'] == 2 and plan['mesh'] == {'slice': 2, 'data': PER_SLICE}
  dcn = sum(plan['collectives']['dcn_ring_bytes'].values())
  assert plan['dcn_floor_bytes'] <= dcn <= 1.01 * plan['dcn_floor_bytes']
  assert plan['predicted_seconds']['dcn'] == pytest.approx(dcn / (25e9 / 8))


@pytest.mark.parametrize(
  'args, message',
  [
    (
      ('--topology', 'v6e:2x2', '--slices', '2'),
      'error: v6e has no published data-center network bandwidth, so a step across slices'
      ' cannot be timed; plan one slice, or a chip whose page gives it (v5e, v5p).',
    ),
    (('--slices', '0'), 'error: the number of slices must be a whole number >= 1, got 0.'),
    (
      # The compiler would end the process (a failed check, no exception) at 512 slices.
      ('--topology', 'v5e:2x2', '--slices', '512'),
      'error: 512 slices of v5e:2x2: the TPU compiler stops the process when it compiles for 512'
      ' slices or more (libtpu 0.0.42 and 0.0.50); plan at most 511, or fewer, larger slices.',
    ),
    (
      ('--topology', 'v5e:2x2', '--slices', '2', '--mesh', '4x4'),
      'error: --mesh 4x4 has 16 devices but one of the 2 slices has 4; give the chip grid, e.g.'
      ' --mesh 16x16 for v5e:16x16, or sizes whose product is 4 (--mesh describes one slice; the'
      " 'slice' axis is added)",
    ),
  ],
)
def test_plan_slices_errors(args, message):
  r = run_cli('plan', '--model', TINY, '--seq-len', '256', '--stage', '3', '--no-cache', *args)
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_plan_search_takes_slices_as_one_more_dimension(tmp_path):
  r = run_cli(
    'plan', '--search', '--model', 'tiny', '--topology', 'v5e:2x2', '--stages', '3',
    '--layouts', 'flat', '--remats', 'full', '--prefetch-options', 'off', '--slice-counts', '1,2',
    '--out', str(tmp_path), '--no-cache',
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  found = json.loads((tmp_path / 'search_tiny_v5e-2x2.json').read_text())['results']
  by_slices = {row['candidate']['slices']: row for row in found}
  assert sorted(by_slices) == [1, 2] and all(row['fits'] for row in found)
  one, two = by_slices[1], by_slices[2]
  assert one['dcn_ring_bytes'] == 0 and one['dcn_floor_bytes'] is None
  # Beyond the floor: the loss, and small leaves' shards padded to whole TPU tiles: the final
  # norm (128,) and the stacked norm scales (4, 128), split along their width (never along
  # the layers a loop walks) into 32-value shards. Measured on libtpu 0.0.42: 1.020x.
  assert two['dcn_floor_bytes'] <= two['dcn_ring_bytes'] <= two['dcn_floor_bytes'] * 1.025
  assert 's3 flat b1 x2 slices remat:full' in r.stdout


def test_plan_search_over_slices_needs_a_published_dcn_figure():
  r = run_cli(
    'plan', '--search', '--model', 'tiny', '--topology', 'v6e:2x2', '--stages', '3',
    '--slice-counts', '1,2', '--no-cache',
  )  # fmt: skip
  assert r.returncode != 0
  assert (
    'error: v6e has no published data-center network bandwidth, so a step across slices'
    ' cannot be timed; plan one slice, or a chip whose page gives it (v5e, v5p).'
  ) in r.stderr, r.stderr[-2000:]
