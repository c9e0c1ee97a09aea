"""zero_stage over optax optimizers: equality with plain optax, and layouts."""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import max_rel_err, mlp_params, plain_run, train_tol, zero_run
from _tolerance import reordered

import zerojax


def _labels(params):
  return {
    'dense1': jax.tree.map(lambda _: 'adam', params['dense1']),
    'dense2': jax.tree.map(lambda _: 'sgd', params['dense2']),
  }


# Wrappers and settings that discovery (test_zero_stage.py) does not build, at every
# stage: the discovered optimizers themselves are tested there.
OPTIMIZERS = {
  'adam': lambda: optax.adam(1e-2),
  'sgd_nesterov': lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  'adafactor': lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
  'chain_clip': lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
  'multisteps': lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
  'inject_hyperparams': lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
  'masked': lambda: optax.masked(
    optax.adam(1e-2), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
  ),
  'multi_transform': lambda: optax.multi_transform(
    {'adam': optax.adam(1e-2), 'sgd': optax.sgd(1e-2, momentum=0.9)}, _labels
  ),
  'apply_if_finite': lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
}


@functools.cache
def _plain(name):
  """Plain optax's 10 steps of `name`, once per name (the reference of 8 tests)."""
  return plain_run(OPTIMIZERS[name](), steps=10)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_equals_plain_optax(name, stage, mesh):
  expected = _plain(name)
  params, opt_state, plan = zero_run(OPTIMIZERS[name](), mesh, stage, steps=10)
  assert max_rel_err(params, expected) <= train_tol(10)
  # Layouts survive ten jitted steps: no drift.
  assert jax.tree.map(lambda a: a.sharding, params) == plan.params
  assert jax.tree.map(lambda a: a.sharding, opt_state) == plan.opt_state


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_layouts_after_init_and_update(stage, mesh):
  tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh)
  params = mlp_params()
  state = tx.init(params)
  plan = zerojax.plan_for(tx, params)
  assert jax.tree.map(lambda a: a.sharding, state) == plan.opt_state
  grads = jax.tree.map(jnp.ones_like, params)
  for update in (tx.update, jax.jit(tx.update)):  # outside and inside jit
    updates, new_state = update(grads, state, jax.device_put(params, plan.params))
    assert jax.tree.map(lambda a: a.sharding, updates) == plan.params
    assert jax.tree.map(lambda a: a.sharding, new_state) == plan.opt_state

  # Each device holds 1/8 of every sharded leaf along the planned dimension.
  mu = state[0].mu['dense1']['kernel']
  shard_shapes = {s.data.shape for s in mu.addressable_shards}
  if stage >= 1:
    assert shard_shapes == {(16, 8)}  # (16, 64): the largest dimension is split
    assert len(mu.addressable_shards) == 8
  else:
    assert shard_shapes == {(16, 64)}
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(plan.opt_state)):
    assert leaf.addressable_shards[0].data.shape == sharding.shard_shape(leaf.shape)


def test_zero_and_plain_differ_only_in_layout(auto_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-2), 1, mesh=auto_mesh)
  config = zerojax.config_of(tx)
  assert config.inner.init is not tx.init
  assert config.stage == 1 and config.mesh == auto_mesh
  assert config.options == zerojax.Options()
  assert zerojax.config_of(optax.adam(1e-2)) is None


def test_mesh_from_set_mesh(auto_mesh):
  with jax.set_mesh(auto_mesh):
    tx = zerojax.zero_stage(optax.adam(1e-2), 2)
  assert zerojax.config_of(tx).mesh == auto_mesh


PAD_OPTIMIZERS = {
  'adam': lambda: optax.adam(1e-2),
  'sgd_momentum': lambda: optax.sgd(1e-2, momentum=0.9),
  'lamb': lambda: optax.lamb(1e-2),
  'clip_adamw': lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
}


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('name', sorted(PAD_OPTIMIZERS))
def test_pad_policy_splits_padded_state_and_matches_optax(name, stage, mesh):
  params = {'odd': 0.1 * jax.random.normal(jax.random.key(0), (129, 515)), 'ok': jnp.ones((64, 8))}
  target = jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params)
  loss = lambda p: sum(
    jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(target))
  )
  ztx = zerojax.zero_stage(PAD_OPTIMIZERS[name](), stage, mesh=mesh, policy='pad')
  state = ztx.init(params)
  plan = zerojax.plan_for(ztx, params)
  # The optimizer state of the odd leaf is padded 515 -> 520 along its largest
  # dimension and split: 65 columns per device. The parameter stays whole.
  mu = jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, 'shape'))
  odd_states = [x for x in mu if x.shape == (129, 520)]
  assert odd_states and all(
    {s.data.shape for s in x.addressable_shards} == {(129, 65)} for x in odd_states
  )
  assert plan.padding == (None, (1, 520)) or plan.padding == ((1, 520), None)
  assert "  params['odd']: (129, 515) -> (129, 520) along dimension 1" in str(plan).splitlines()

  @jax.jit
  def step(p, s):
    updates, s = ztx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  ref_tx = PAD_OPTIMIZERS[name]()
  ref_p, ref_s = params, ref_tx.init(params)
  p = jax.device_put(params, plan.params)
  for _ in range(5):
    p, state = step(p, state)
    u, ref_s = ref_tx.update(jax.grad(loss)(ref_p), ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  assert p['odd'].shape == (129, 515)
  assert jax.tree.map(lambda a: a.sharding, p) == plan.params
  # lamb's trust ratio and the clip's global norm sum every element (129 x 515
  # of the odd leaf, in another order once it is split and padded); five steps.
  assert max_rel_err(p, ref_p) <= reordered(129 * 515 + 64 * 8, steps=5)


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_init_writes_only_shards(stage, mesh):
  # 4 MiB of parameters: the state of one, replicated, would be 8 MiB/device.
  params = {'w': jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  plan = zerojax.plan_for(tx, params)
  compiled = jax.jit(tx.init).lower(params).compile()
  mem = zerojax.inspect.memory_stats(compiled)
  shards = plan.bytes_per_device()['opt_state']
  assert shards == 2 * 4 * 1024 * 1024 // 8 + 4  # mu and nu split 8 ways, and the count
  # XLA:CPU adds the output tuple's index table: 8 bytes per output buffer.
  assert mem.output == shards + 8 * len(jax.tree.leaves(plan.opt_state))
  assert mem.temp < 4 * 1024 * 1024 // 8  # no full-size buffer on any device


@pytest.mark.parametrize('stage', [1, 2])
def test_weight_decay_does_not_drag_parameters_sharded(stage, mesh):
  # Regression: the optimizer's use of the parameters (weight decay) once
  # propagated the shard layout back onto them, so `params + updates` came out
  # sharded at stages 1-2 for stacked (layer, in, out) parameters.
  params = {'k': jnp.ones((2, 32, 128)), 'b': jnp.ones((2, 128))}
  tx = zerojax.zero_stage(optax.adamw(1e-2, weight_decay=0.01), stage, mesh=mesh)
  state = tx.init(params)
  plan = zerojax.plan_for(tx, params)

  @jax.jit
  def step(p, s):
    updates, s = tx.update(jax.tree.map(lambda x: 0.1 * x, p), s, p)
    return optax.apply_updates(p, updates), s

  p = jax.device_put(params, plan.params)
  for _ in range(2):
    p, state = step(p, state)
  assert jax.tree.map(lambda a: a.sharding, p) == plan.params
  assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(p))


def test_the_config_is_data_on_the_transformation_not_an_attribute_of_a_function(explicit_mesh):
  inner = zerojax.mixed_precision(optax.adam(1e-3))
  assert callable(inner.update.master_step)
  assert isinstance(inner, optax.GradientTransformationExtraArgs)
  tx = zerojax.zero_stage(inner, 2, mesh=explicit_mesh)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert dataclasses.is_dataclass(tx.update) and tx.update.config is zerojax.config_of(tx)
  assert zerojax.config_of(tx).stage == 2 and zerojax.config_of(tx).inner is inner
  # Rebuilt from its two fields, as flax and optax rebuild NamedTuples, it keeps its config.
  again = type(tx)(*tx)
  assert zerojax.config_of(again) is zerojax.config_of(tx)
  with pytest.raises(dataclasses.FrozenInstanceError):
    tx.update.config = None
  # A chain around it is another transformation, with no ZeRO config.
  assert zerojax.config_of(optax.chain(tx, optax.scale(1.0))) is None


def _parameters(fn):
  return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_update_has_optaxs_signature_and_apply_gradients_is_update_then_add(stage, auto_mesh):
  """`tx.update` takes what optax's extra-args update takes, nothing private; and
  `zerojax.apply_gradients` is `tx.update` followed by `optax.apply_updates`, bit for bit,
  for a zerojax optimizer and a plain optax one alike."""
  optax_update = optax.TransformUpdateExtraArgsFn.__call__
  tx = zerojax.zero_stage(optax.adamw(1e-2, weight_decay=0.1), stage, mesh=auto_mesh)
  assert _parameters(tx.update) == _parameters(optax_update)[1:]  # without `self`
  params = jax.device_put(mlp_params(), zerojax.plan_for(tx, mlp_params()).params)
  grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
  state = tx.init(params)

  @jax.jit
  def update_then_add(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  want, want_state = update_then_add(grads, state, params)
  got, got_state = jax.jit(functools.partial(zerojax.apply_gradients, tx))(grads, state, params)
  assert max_rel_err(got, want) == 0.0
  assert max_rel_err(got_state, want_state) == 0.0
  plain = optax.sgd(0.5)
  new, _ = zerojax.apply_gradients(plain, grads, plain.init(params), params)
  assert max_rel_err(new, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)) == 0.0


def test_apply_gradients_needs_the_parameters():
  tx = optax.sgd(0.1)
  with pytest.raises(TypeError) as err:
    zerojax.apply_gradients(tx, {'w': jnp.ones(2)}, tx.init({'w': jnp.ones(2)}), None)
  assert str(err.value) == (
    'zerojax.apply_gradients(tx, grads, opt_state, params): params is None; pass the'
    ' parameters the gradients are of (the new ones are made from them).'
  )
