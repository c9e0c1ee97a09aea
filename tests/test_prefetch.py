"""`zerojax.scan_layers`: the layer loop that gathers layer i+1 while layer i computes."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, reordered
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))
import hlo_ops  # noqa: E402

D = 256


@pytest.fixture(scope='module')
def mesh():
  return jax.make_mesh((8,), ('data',))


def _params(layers):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
    'layers': {
      'w': 0.05 * jax.random.normal(k1, (layers, D, D)),
      'b': 0.01 * jax.random.normal(k2, (layers, D)),
    },
    'gain': jnp.ones((D,)),  # used inside every layer: closed over by the body
    'head': 0.1 * jax.random.normal(k3, (D, 8)),
  }


def _layer(h, layer, gain):
  return h + jnp.tanh(h @ layer['w'] + layer['b']) * gain


def _loss_scan(p, x, *, tx, remat='gathers'):
  gain = zerojax.gather(p['gain'], tx)
  h = zerojax.scan_layers(lambda h, layer: _layer(h, layer, gain), x, p['layers'], tx, remat=remat)
  return jnp.mean((h @ zerojax.gather(p['head'], tx)) ** 2)


def _loss_plain(p, x):
  h = x
  for i in range(p['layers']['w'].shape[0]):
    h = _layer(h, jax.tree.map(lambda a, i=i: a[i], p['layers']), p['gain'])
  return jnp.mean((h @ p['head']) ** 2)


def _run(mesh, layers, quantize=None, stage=3, remat='gathers'):
  params = _params(layers)
  tx = zerojax.zero_stage(
    optax.adam(1e-3), stage, mesh=mesh, replicate_below_bytes=512, quantize=quantize
  )
  plan = zerojax.plan_for(tx, params)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (64, D)), NamedSharding(mesh, P('data')))
  loss = functools.partial(_loss_scan, tx=tx, remat=remat)
  fn = jax.jit(zerojax.value_and_grad(loss, tx, per_layer=True))
  placed = jax.device_put(params, plan.params)
  return fn, placed, x, params


@pytest.mark.parametrize(
  'layers, stage, remat',
  [(1, 3, 'gathers'), (2, 3, 'gathers'), (5, 3, 'gathers'), (3, 2, 'gathers'), (1, 3, 'full'),
   (5, 3, 'full'), (3, 2, 'full')],
)  # fmt: skip
def test_scan_layers_equals_the_plain_gradient(mesh, layers, stage, remat):
  # At stage 2 the layers are whole on every device: nothing is gathered, and
  # each layer's gradient is still reduce-scattered into its shard.
  fn, placed, x, params = _run(mesh, layers, stage=stage, remat=remat)
  loss, grads = fn(placed, x)
  want_loss, want = jax.value_and_grad(_loss_plain)(params, np.asarray(x))
  # 64 rows through `layers` layers of 256-wide contractions and the 8-wide head.
  tol = reordered(64 + layers * D + 8)
  assert abs(float(loss) - float(want_loss)) <= tol * abs(float(want_loss))
  got, ref = jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want)
  for (path, g), r in zip(got, ref):
    # The closed-over gain's gradient comes back through the loop too.
    assert_close(g, r, tol, err_msg=str(path))
  if stage == 3:
    assert grads['layers']['w'].sharding == placed['layers']['w'].sharding
  else:
    assert grads['layers']['w'].sharding.spec == P(None, 'data', None)


@pytest.mark.parametrize('remat', ['gathers', 'full'])
def test_each_layer_is_gathered_again_and_reduce_scattered_once(mesh, remat):
  layers = 5
  fn, placed, x, _ = _run(mesh, layers, remat=remat)
  stats = zerojax.inspect.count_collectives(fn.lower(placed, x).compile())
  # Forward: w and b per layer; gain and head once each. Backward: with the
  # activations kept, only w is needed again (h @ w's input gradient), so b's
  # gather is dead code; recomputing the layer needs both again.
  backward = layers if remat == 'gathers' else 2 * layers
  assert stats['all-gather'] == 2 * layers + backward + 2
  assert stats['reduce-scatter'] == 2 * layers + 2
  assert stats.result_bytes.get('all-reduce', 0) <= 8  # the loss only


@pytest.mark.parametrize('remat, per_layer', [('gathers', 3), ('full', 4)])
def test_the_forward_runs_again_only_with_remat_full(mesh, remat, per_layer):
  # Per layer: one matmul forward and two backward (input and weight
  # gradients); remat='full' runs the forward one more time. The head adds
  # three; the first layer's input gradient is dead (the input is data).
  layers = 5
  fn, placed, x, _ = _run(mesh, layers, remat=remat)
  matmuls = hlo_ops.matmuls(fn.lower(placed, x).compile())
  assert matmuls == per_layer * layers + 3 - 1


@pytest.mark.parametrize('remat', ['gathers', 'full'])
def test_gathered_parameters_are_not_kept_for_the_backward_pass(mesh, remat):
  # Temporaries grow by far less than a layer's gathered parameters per layer:
  # the prefetched parameters are not kept per layer.
  temps = {}
  for layers in (4, 12):
    fn, placed, x, _ = _run(mesh, layers, remat=remat)
    temps[layers] = zerojax.inspect.memory_stats(fn.lower(placed, x).compile()).temp
  per_layer = (temps[12] - temps[4]) / 8
  assert per_layer < D * D * 4 / 4, temps


def test_scan_layers_with_quantized_collectives(mesh):
  fn, placed, x, params = _run(mesh, 3)
  _, exact = fn(placed, x)
  qfn, qplaced, *_ = _run(mesh, 3, quantize=zerojax.Quantize(grads='int8', min_size=4096))
  _, grads = qfn(qplaced, x)
  rel = jnp.linalg.norm(grads['layers']['w'] - exact['layers']['w']) / jnp.linalg.norm(
    exact['layers']['w']
  )
  assert float(rel) < 0.03
  stats = zerojax.inspect.count_collectives(qfn.lower(qplaced, x).compile())
  # w's gradient per layer: one all-to-all of its values and scales together; the
  # biases (below min_size), gain and head stay full-precision reduce-scatters.
  assert stats['all-to-all'] == 3 and stats['reduce-scatter'] == 3 + 2


def test_outside_value_and_grad_it_is_a_plain_rematerialised_scan(mesh):
  params = jax.device_put(_params(3), NamedSharding(mesh, P()))
  x = jnp.ones((8, D))
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  with jax.set_mesh(mesh):  # JAX's own need, outside jit on an Explicit mesh
    got = jax.grad(
      lambda p: jnp.sum(zerojax.scan_layers(lambda h, layer: _layer(h, layer, 1.0), x, p, tx))
    )(params['layers'])
  want = jax.grad(
    lambda p: jnp.sum(jax.lax.scan(lambda h, layer: (_layer(h, layer, 1.0), None), x, p)[0])
  )(jax.device_get(params['layers']))
  # 8 rows through 3 layers of 256-wide contractions.
  assert_close(got['w'], want['w'], reordered(8 + 3 * D))


def test_layers_of_different_counts_are_refused(mesh):
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh, replicate_below_bytes=512)
  params = {'a': jnp.ones((3, D, D)), 'b': jnp.ones((4, D))}
  plan = zerojax.plan_for(tx, params)
  x = jax.device_put(jnp.ones((8, D)), NamedSharding(mesh, P('data')))

  def loss(p, x):
    return jnp.sum(zerojax.scan_layers(lambda h, layer: h @ layer['a'], x, p, tx))

  fn = zerojax.value_and_grad(loss, tx, per_layer=True)
  with pytest.raises(ValueError) as info:
    jax.jit(fn)(jax.device_put(params, plan.params), x)
  assert str(info.value) == (
    'scan_layers: the stacked parameters have leading dimensions [3, 4]; every leaf needs the'
    ' same layer count first.'
  )
