"""Bad input: a clear error naming what, where and the fix, and nothing half-placed."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import mlp_params
from flax.training import train_state

import zerojax


def raises(exc, message):
  return pytest.raises(exc, match=re.escape(message))


@pytest.mark.parametrize('stage', [4, -1, 1.5, True, '2'])
def test_stage_outside_range(stage, explicit_mesh):
  with raises(ValueError, f'`stage` must be 0, 1, 2 or 3 (the ZeRO stages), got {stage!r}.'):
    zerojax.zero_stage(optax.adam(1e-3), stage, mesh=explicit_mesh)


def test_axis_not_in_mesh(explicit_mesh):
  with raises(
    ValueError,
    "`axis`='model' names ['model'] which is not an axis of the mesh (its axes are ('data',))."
    ' Pass one of those names',
  ):
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh, axis='model')
  with raises(ValueError, "`axis`=('data', 'fsdp') names ['fsdp'] which is not an axis"):
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh, axis=('data', 'fsdp'))


def test_no_mesh_given_and_none_set():
  with raises(ValueError, '`mesh` was not given and no mesh is set. Pass `mesh=jax.make_mesh('):
    zerojax.zero_stage(optax.adam(1e-3), 1)


def test_mesh_of_wrong_type():
  with raises(TypeError, '`mesh` must be a jax.sharding.Mesh (e.g. from jax.make_mesh), got list'):
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=jax.devices())


def test_non_array_leaves(explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh)
  params = {'w': jnp.ones((8, 8)), 'name': 'encoder', 'cfg': {'depth': 3}}
  with raises(
    TypeError,
    '`params` must be a pytree of arrays, but 2 leaves are not:\n'
    "  params['cfg']['depth']: int 3\n"
    "  params['name']: str 'encoder'\n"
    'Convert them with jnp.asarray',
  ):
    tx.init(params)


def test_grads_tree_differs_from_params(explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=explicit_mesh)
  params = mlp_params()
  state = tx.init(params)
  grads = {'dense1': params['dense1']}
  with raises(
    ValueError,
    '`grads` must have the tree structure of `params`; missing from `grads`:'
    " ['dense2']['bias'], ['dense2']['kernel']. Compute `grads` with jax.grad",
  ):
    tx.update(grads, state, params)


def test_grads_shapes_differ_from_params(explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=explicit_mesh)
  params = mlp_params()
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  grads['dense2']['kernel'] = jnp.zeros((64, 16))
  message = (
    '`grads` must have the shapes of `params`, but 1 leaf differs:\n'
    "  grads['dense2']['kernel']: shape (64, 16) but params['dense2']['kernel'] has shape (64, 8)"
  )
  with raises(ValueError, message):
    tx.update(grads, state, params)
  with raises(ValueError, message):  # also when traced
    jax.jit(tx.update)(grads, state, params)


def test_indivisible_large_leaf_under_error_policy(explicit_mesh):
  params = {'ok': jnp.zeros((64, 8)), 'odd': jnp.zeros((257, 513)), 'odd2': jnp.zeros((3, 99999))}
  tx = zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh)
  with raises(
    ValueError,
    "4 leaves cannot be split over mesh axis 'data' of size 8 for ZeRO stage 1:\n"
    "  opt_state[0].mu['odd']: shape (257, 513), no free dimension of (257, 513) divides by 8\n"
    "  opt_state[0].mu['odd2']: shape (3, 99999), no free dimension of (3, 99999) divides by 8\n"
    "  opt_state[0].nu['odd']: shape (257, 513)",
  ):
    tx.init(params)
  with raises(ValueError, "Pass `policy='replicate'` to keep them whole on every device"):
    tx.init(params)


def test_replicate_policy_replicates_and_says_so(explicit_mesh):
  params = {'ok': jnp.zeros((64, 8)), 'odd': jnp.zeros((257, 513))}
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=explicit_mesh, policy='replicate')
  state = tx.init(params)
  plan = zerojax.plan_for(tx, params)
  assert state[0].mu['odd'].sharding.is_fully_replicated
  assert not state[0].mu['ok'].sharding.is_fully_replicated
  assert (
    'params',
    "['odd']",
    "no free dimension of (257, 513) divides by 8 (policy='replicate')",
  ) in plan.replicated()
  assert "params['odd']: no free dimension of (257, 513) divides by 8 (policy='replicate')" in str(
    plan
  )


def test_wrapping_twice(explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=explicit_mesh)
  with raises(
    ValueError, '`tx` is already wrapped by zero_stage (stage 2); wrapping twice would shard twice.'
  ):
    zerojax.zero_stage(tx, 3, mesh=explicit_mesh)
  state = train_state.TrainState.create(apply_fn=None, params=mlp_params(), tx=tx)
  with raises(ValueError, '`tx` is already wrapped by zero_stage (stage 2)'):
    zerojax.zero_stage(state, 1, mesh=explicit_mesh)


def test_train_state_tx_not_optax(explicit_mesh):
  state = train_state.TrainState(
    step=0, apply_fn=None, params=mlp_params(), tx='adam', opt_state=()
  )
  with raises(
    TypeError, "`train_state.tx` must be an optax GradientTransformation, got str: 'adam'."
  ):
    zerojax.zero_stage(state, 1, mesh=explicit_mesh)


def test_target_neither_optimizer_nor_train_state(explicit_mesh):
  with raises(
    TypeError, '`target` must be an optax GradientTransformation or a flax TrainState, got dict.'
  ):
    zerojax.zero_stage({'lr': 1e-3}, 1, mesh=explicit_mesh)


def test_failed_train_state_conversion_places_nothing(explicit_mesh):
  params = {'ok': jnp.ones((64, 8)), 'odd': jnp.ones((257, 513))}
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  before = jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state))
  with raises(ValueError, "cannot be split over mesh axis 'data' of size 8 for ZeRO stage 3"):
    zerojax.zero_stage(state, 3, mesh=explicit_mesh)
  # The caller's state is untouched: nothing was moved onto the mesh.
  assert jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state)) == before
  assert all(len(a.devices()) == 1 for a in jax.tree.leaves(state.params))


def test_plan_for_unwrapped_optimizer():
  with raises(TypeError, '`tx` was not made by zerojax.zero_stage; wrap it first'):
    zerojax.plan_for(optax.adam(1e-3), mlp_params())
