"""The recipes under a global `jax.set_mesh`, as JAX teaches them: no `mesh=` anywhere.

On Explicit and Auto meshes, 1-D ('data') and 2-D ('data', 'model': a second axis the
parameters are not split over), at stages 2 and 3: `zero_stage` takes the mesh from the
context; `create_train_state`, `value_and_grad` with `per_layer` and micro-batches around
`scan_layers`, and three steps, equal to plain optax on the whole batch; the `Checkpointer`
restores what it saved; `load_safetensors` reads back what `save_safetensors` wrote.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

LAYERS, WIDTH, OUT, ROWS = 4, 32, 8, 32
STEPS = 3
NAMES = {'layers/w': 'model.layers.weight', 'head': 'model.head.weight'}

MESHES = {
  'explicit-1d': ((8,), ('data',), AxisType.Explicit),
  'auto-1d': ((8,), ('data',), AxisType.Auto),
  'explicit-2d': ((4, 2), ('data', 'model'), AxisType.Explicit),
  'auto-2d': ((4, 2), ('data', 'model'), AxisType.Auto),
}


def _init(key):
  k1, k2 = jax.random.split(key)
  return {
    'layers': {'w': 0.1 * jax.random.normal(k1, (LAYERS, WIDTH, WIDTH))},
    'head': 0.1 * jax.random.normal(k2, (WIDTH, OUT)),
  }


def _plain_loss(params, batch):
  def layer(h, w):
    return h + jnp.tanh(h @ w), None

  h, _ = jax.lax.scan(layer, batch['x'], params['layers']['w'])
  return jnp.mean((h @ params['head'] - batch['y']) ** 2)


def _batch():
  kx, ky = jax.random.split(jax.random.key(3))
  return {
    'x': jax.random.normal(kx, (ROWS, WIDTH)),
    'y': jax.random.normal(ky, (ROWS, OUT)),
  }


def _plain_run(batch):
  tx = optax.adam(1e-2)
  params = _init(jax.random.key(0))
  state = tx.init(params)
  losses = []
  for _ in range(STEPS):
    loss, grads = jax.value_and_grad(_plain_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses, params


@pytest.mark.parametrize('stage', [2, 3])
@pytest.mark.parametrize('name', sorted(MESHES))
def test_the_recipes_under_set_mesh_equal_plain_optax(name, stage, tmp_path):
  shape, axes, kind = MESHES[name]
  mesh = jax.make_mesh(shape, axes, axis_types=(kind,) * len(axes))
  batch = _batch()
  want_losses, want_params = _plain_run(batch)
  with jax.set_mesh(mesh):
    tx = zerojax.zero_stage(optax.adam(1e-2), stage, stacked={'layers': True})
    assert zerojax.config_of(tx).mesh == mesh
    state = zerojax.create_train_state(_init, jax.random.key(0), tx=tx)

    def loss_fn(params, batch, tx):
      h = zerojax.scan_layers(
        lambda h, layer: h + jnp.tanh(h @ layer['w']), batch['x'], params['layers'], tx
      )
      return jnp.mean((h @ zerojax.gather(params['head'], tx) - batch['y']) ** 2)

    @jax.jit
    def step(state, batch):
      # state.tx: on Auto axes beside another axis, the train state's optimizer holds the
      # layouts the traced parameters cannot show (create_train_state records them there).
      grad_fn = zerojax.value_and_grad(
        lambda p, b: loss_fn(p, b, state.tx), state.tx, per_layer=True, micro_batches=2
      )
      loss, grads = grad_fn(state.params, batch)
      return state.apply_gradients(grads=grads), loss

    placed = jax.device_put(batch, NamedSharding(mesh, P('data')))
    losses = []
    for _ in range(STEPS):
      state, loss = step(state, placed)
      losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
      jax.device_get(state.params),
      jax.device_get(want_params),
    )
    # The state stays in the plan's layout.
    plan = zerojax.plan_for(tx, state.params)
    for x, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(plan.params)):
      assert x.sharding.is_equivalent_to(want, x.ndim)

    # Orbax checkpoints, saved and restored into the same layout.
    with zerojax.checkpoint.Checkpointer(tmp_path / 'ckpt') as ckpt:
      ckpt.save(STEPS, state)
      ckpt.wait_until_finished()
      restored, _ = ckpt.restore(state)
    jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
      restored.params,
      state.params,
    )

    # Published-checkpoint files, written and read back in the stage's layout.
    zerojax.checkpoint.save_safetensors(state.params, tmp_path / 'hf', names=NAMES)
    loaded = zerojax.checkpoint.load_safetensors(
      tmp_path / 'hf', _init, jax.random.key(1), tx=tx, names=NAMES
    )
  for a, b, want in zip(
    jax.tree.leaves(loaded), jax.tree.leaves(state.params), jax.tree.leaves(plan.params)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(want, a.ndim)


# jax >= 0.11 cannot lower psum_scatter in a shard_map that leaves an Explicit axis automatic
# (the 'explicit-2d' recipes above): zerojax reduce-scatters there with an all-to-all and a
# local sum. Forced here on any jax, against psum_scatter on the same devices.
@pytest.mark.parametrize('shape', [(4, 2), (2, 4), (8, 1)])
@pytest.mark.parametrize('dims, dim', [((16, 3), 0), ((3, 16), 1), ((2, 5, 24), 2), ((8,), 0)])
def test_the_all_to_all_reduce_scatter_equals_psum_scatter(shape, dims, dim, monkeypatch):
  from zerojax._src import compat, quantize

  n = shape[0]
  x = jax.random.normal(jax.random.key(4), (n, *dims))  # one operand per device of 'data'

  def scattered(force):
    monkeypatch.setattr(compat, 'PSUM_SCATTER_BESIDE_EXPLICIT_FAILS', force)
    kind = AxisType.Explicit if force else AxisType.Auto
    mesh = jax.make_mesh(shape, ('data', 'model'), axis_types=(kind, kind))

    def body(x):
      assert compat.psum_scatter_fails_here() == force
      return quantize.psum_scatter(x[0], 'data', dim)[None]

    with jax.set_mesh(mesh):
      f = jax.shard_map(body, in_specs=P('data'), out_specs=P('data'), axis_names={'data'})
      return np.asarray(jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P('data')))))

  want = scattered(False)
  got = scattered(True)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # And what both are: device i holds block i of the sum over devices.
  total = np.asarray(x).sum(0)
  blocks = np.split(total, n, axis=dim)
  np.testing.assert_allclose(got, np.stack(blocks), rtol=1e-5, atol=1e-5)


def test_stage_3_on_explicit_axes_splits_what_zerojax_differentiates_and_keeps_typed_the_rest():
  # Parameters placed whole at stage 3 on an Explicit mesh: zerojax.value_and_grad's gradients
  # arrive reduce-scattered, and the first update splits the parameters as the plan says; the
  # framework's own gradient of a model that reads them as typed arrives whole, and they stay
  # whole (split, their types would change under that model).
  mesh = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Explicit,))
  batch = _batch()

  def loss_fn(params, batch, tx):
    h = zerojax.scan_layers(
      lambda h, layer: h + jnp.tanh(h @ layer['w']), batch['x'], params['layers'], tx
    )
    return jnp.mean((h @ zerojax.gather(params['head'], tx) - batch['y']) ** 2)

  with jax.set_mesh(mesh):
    tx = zerojax.zero_stage(optax.adam(1e-2), 3, stacked={'layers': True})
    placed = jax.device_put(batch, NamedSharding(mesh, P('data')))
    split = zerojax.plan_for(tx, _init(jax.random.key(0))).params

    def first_update(grads_of):
      params = jax.device_put(_init(jax.random.key(0)), NamedSharding(mesh, P()))
      with pytest.warns(UserWarning, match='on Explicit mesh axes'):
        state = tx.init(params)

      @jax.jit
      def step(params, state):
        _, grads = grads_of(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      return jax.tree.map(lambda x: x.sharding.spec, step(params, state)[0])

    zero = first_update(
      lambda p: zerojax.value_and_grad(lambda p, b: loss_fn(p, b, tx), tx)(p, placed)
    )
    assert zero == jax.tree.map(lambda s: s.spec, split)
    own = first_update(lambda p: jax.value_and_grad(_plain_loss)(p, batch))
    assert len(jax.tree.leaves(own)) == 2  # the stacked layers and the head
    for spec in jax.tree.leaves(own):
      assert all(e is None for e in spec), spec
