"""zerojax.value_and_grad beside a tensor-parallel axis: each chip gathers only its own part.

Inside `jax.shard_map` over the ZeRO axis alone, XLA makes the operand of an all-gather or a
reduce-scatter over it whole over the other mesh axes first, so a parameter split over a
tensor axis would be gathered whole on every chip. zerojax runs those collectives manual over
the tensor axis too. Each test compiles the step on a faked CPU mesh and reads the program:
no collective over the tensor axis's device groups moves a parameter, and the gradients
equal `jax.value_and_grad`'s.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import EPS32, assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._src import jaxprs
from zerojax._src.planner import hlo

D, F, ROWS = 16, 32, 16
# The single-layer losses here gather outside a layer loop on purpose.
pytestmark = pytest.mark.filterwarnings(
  'ignore:zerojax.value_and_grad.per_layer=True.. the loss gathers'
)


def _mesh(data: int, tensor: int):
  devices = np.array(jax.devices()[: data * tensor]).reshape(data, tensor)
  return jax.sharding.Mesh(devices, ('data', 'tensor'), axis_types=(AxisType.Auto,) * 2)


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
    'w_in': jax.random.normal(k1, (D, F), jnp.float32) / 4,
    'w_out': jax.random.normal(k2, (F, D), jnp.float32) / 4,
    'norm': 1 + jax.random.normal(k3, (D,), jnp.float32) / 8,
  }


# Megatron-style: the MLP's columns, then its rows, over the tensor axis.
SPECS = {'w_in': P(None, 'tensor'), 'w_out': P('tensor', None), 'norm': P()}


def _loss(p, b):
  h = jnp.tanh((b['x'] * p['norm']) @ p['w_in'])
  return jnp.mean((h @ p['w_out'] - b['y']) ** 2)


def _tensor_groups(mesh) -> set[frozenset[int]]:
  """The device groups of the tensor axis, as positions in the mesh's device order."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  return {frozenset(int(i) for i in row) for row in ids}


def _over_tensor(text: str, mesh) -> list[str]:
  """The all-gathers and reduce-scatters of a compiled program that run over a tensor group
  (their groups read by the planner's own `hlo.replica_groups`, in each form XLA writes)."""
  n, tensor = mesh.devices.size, _tensor_groups(mesh)
  lines = [x for x in text.splitlines() if re.search(r' (all-gather|reduce-scatter)(-start)?\(', x)]
  assert lines, 'the step has no all-gather or reduce-scatter to read'
  over = []
  for line in lines:
    groups = hlo.replica_groups(line, n)
    assert groups is not None, f'replica groups not read: {line[:300]}'
    if {frozenset(g) for g in groups} & tensor:
      over.append(line.strip()[:200])
  return over


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('shape', [(4, 2), (2, 4), (2, 2)])
@pytest.mark.parametrize('per_layer', [False, True])
@pytest.mark.parametrize('micro', [1, 2])
def test_parameters_are_gathered_over_the_zero_axis_only(stage, shape, per_layer, micro):
  if per_layer and stage < 2:
    pytest.skip('per_layer below stage 2 is per_layer=False (test_fsdp: one loss line)')
  mesh = _mesh(*shape)
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, param_specs=SPECS)
  plan = zerojax.plan_for(tx, _params())
  params = jax.device_put(_params(), plan.params)
  rows = NamedSharding(mesh, P('data'))
  rng = np.random.default_rng(0)
  b = {
    'x': jax.device_put(rng.normal(size=(ROWS, D)).astype(np.float32), rows),
    'y': jax.device_put(rng.normal(size=(ROWS, D)).astype(np.float32), rows),
  }
  loss_fn = _loss
  if per_layer:  # the model gathers its own (split) parameters where it uses them
    loss_fn = lambda p, b: _loss(zerojax.gather(p, tx), b)
  grad_fn = zerojax.value_and_grad(loss_fn, tx, per_layer=per_layer, micro_batches=micro)
  compiled = jax.jit(grad_fn).lower(params, b)
  compiled = compiled.compile()
  loss, grads = compiled(params, b)
  want_loss, want = jax.jit(jax.value_and_grad(_loss))(_params(), b)
  assert_close(loss, want_loss, EPS32 * 64)
  for k in want:
    assert_close(grads[k], want[k], EPS32 * 256, f'gradient of {k}')
  over_tensor = _over_tensor(compiled.as_text(), mesh)
  assert not over_tensor, f'collectives over the tensor axis: {over_tensor}'


def test_a_layer_loop_gathers_each_layer_again_in_the_backward_pass():
  """Under `zerojax.recompute_gathers` the tensor-manual gather is still a gather: not saved
  for the backward pass (one all-gather per split leaf and layer each way)."""
  mesh = _mesh(4, 2)
  layers, specs = 3, {'w_in': P(None, None, 'tensor'), 'w_out': P(None, 'tensor', None)}
  tx = zerojax.zero_stage(
    optax.sgd(0.1), 3, mesh=mesh, param_specs=specs, stacked={'w_in': True, 'w_out': True}
  )
  key = jax.random.key(1)
  params = {
    'w_in': jax.random.normal(key, (layers, D, F), jnp.float32) / 4,
    'w_out': jax.random.normal(key, (layers, F, D), jnp.float32) / 4,
  }
  plan = zerojax.plan_for(tx, params)
  layouts = plan.params

  def loss(p, b):
    def block(x, w):
      w = zerojax.gather(w, tx, layouts=layouts, scanned=True)
      return x + jnp.tanh(x @ w['w_in']) @ w['w_out'], None

    block = jax.checkpoint(block, policy=zerojax.recompute_gathers)
    x, _ = jax.lax.scan(block, b['x'], p)
    return jnp.mean(x**2)

  b = {'x': jax.device_put(np.ones((ROWS, D), np.float32), NamedSharding(mesh, P('data')))}
  placed = jax.device_put(params, plan.params)
  grad_fn = zerojax.value_and_grad(loss, tx, per_layer=True)
  outside, inside = jaxprs.count_gathers(jax.make_jaxpr(grad_fn)(placed, b).jaxpr)
  assert (outside, inside) == (0, 2 * len(params))
  got = jax.jit(grad_fn)(placed, b)[1]
  want = jax.jit(jax.grad(loss))(params, {'x': np.ones((ROWS, D), np.float32)})
  for k in want:
    assert_close(got[k], want[k], EPS32 * 256, f'gradient of {k}')


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_on_the_tpu_compiler_too():
  """The same contract in the program the TPU compiler writes for a v5e:2x4 slice (4 x 2),
  ahead of time with no TPU: without the tensor-manual region it gathers each weight whole
  over the tensor axis there as well."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu) for ahead-of-time compiling')
  from jax.experimental import topologies

  topology = topologies.get_topology_desc(topology_name='v5e:2x4', platform='tpu')
  devices = np.array(topology.devices).reshape(4, 2)
  mesh = jax.sharding.Mesh(devices, ('data', 'tensor'), axis_types=(AxisType.Auto,) * 2)
  shapes = {'w_in': (256, 512), 'w_out': (512, 256), 'norm': (256,)}
  rows = NamedSharding(mesh, P('data'))
  b = {k: jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=rows) for k in 'xy'}
  for stage, per_layer in [(1, False), (2, False), (2, True), (3, False), (3, True)]:
    tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, param_specs=SPECS)
    plan = zerojax.plan_for(
      tx, {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
    )
    params = {
      k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=plan.params[k]) for k, v in shapes.items()
    }
    loss_fn = _loss
    if per_layer:
      loss_fn = lambda p, b, tx=tx: _loss(zerojax.gather(p, tx), b)
    grad_fn = jax.jit(zerojax.value_and_grad(loss_fn, tx, per_layer=per_layer))
    over_tensor = _over_tensor(grad_fn.lower(params, b).compile().as_text(), mesh)
    assert not over_tensor, f'stage {stage}, per_layer={per_layer}: {over_tensor}'


def test_free_spec_over_every_spec_of_two_and_three_dimensions():
  """`gather.free_spec` keeps, for each dimension, the axes that are not manual, in order; it
  gives None where none is left or where the collectives' own dimension keeps one (a split the
  nested region could not hold apart from the ZeRO axes)."""
  import itertools

  from zerojax._src import gather

  entries = [
    None,
    'data',
    'tensor',
    'replica',
    ('data', 'tensor'),
    ('tensor', 'data'),
    ('replica', 'data'),
    ('tensor', 'model'),
  ]
  manual = ('replica', 'data')
  for ndim in (2, 3):
    for spec in itertools.product(entries, repeat=ndim):
      for dim in (None, *range(ndim)):
        got = gather.free_spec(P(*spec), manual, dim)
        free = [
          tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in manual)
          for e in spec
        ]
        if not any(free) or (dim is not None and free[dim]):
          assert got is None, (spec, dim, got)
          continue
        want = P(*(f[0] if len(f) == 1 else (f or None) for f in free))  # two free axes: both
        assert got == want, (spec, dim, got)
