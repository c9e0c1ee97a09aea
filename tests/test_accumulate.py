"""Gradient accumulation: equal to the full-batch gradient, with the collective in its place."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import (
  GRAD_TOL,
  batch,
  loss_fn,
  max_rel_err,
  mlp_params,
  plain_run,
  shard_batch,
  train_tol,
)
from _tolerance import EPSBF16, MARGIN, reordered
from jax.sharding import NamedSharding, PartitionSpec

import zerojax

STAGES = [0, 1, 2, 3]


def batch_loss(p, b):
  return loss_fn(p, b['x'], b['y'])


@pytest.mark.parametrize('stage', STAGES)
@pytest.mark.parametrize('micro', [1, 4])
def test_equals_full_batch_gradient(stage, micro, mesh):
  x, y = batch()
  want_loss, want = jax.value_and_grad(loss_fn)(mlp_params(), x, y)
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  plan = zerojax.plan_for(tx, mlp_params())
  params = jax.device_put(mlp_params(), plan.params)
  xs, ys = shard_batch(mesh, x, y)
  grad_fn = zerojax.value_and_grad(batch_loss, tx, micro_batches=micro)
  loss, grads = jax.jit(grad_fn)(params, {'x': xs, 'y': ys})
  assert abs(float(loss) - float(want_loss)) <= GRAD_TOL * abs(float(want_loss))
  assert max_rel_err(grads, want) <= GRAD_TOL
  got = jax.tree.map(lambda g: g.sharding.spec, grads)
  # The plan's gradient layout; at stage 1, the optimizer state's shards (the
  # update reads only its own, and the reduce-scatter stays within the floor).
  want_layout = plan.param_shards if stage == 1 else plan.grads
  assert got == jax.tree.map(lambda s: s.spec, want_layout)


@pytest.mark.parametrize('stage', STAGES)
def test_training_with_accumulation_equals_optax(stage, auto_mesh):
  tx = optax.adam(1e-2)
  ztx = zerojax.zero_stage(tx, stage, mesh=auto_mesh)
  params = mlp_params()
  opt_state = ztx.init(params)
  params = jax.device_put(params, zerojax.plan_for(ztx, params).params)
  xs, ys = shard_batch(auto_mesh, *batch())
  grad_fn = zerojax.value_and_grad(batch_loss, ztx, micro_batches=2)

  @jax.jit
  def step(params, opt_state):
    _, grads = grad_fn(params, {'x': xs, 'y': ys})
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(10):
    params, opt_state = step(params, opt_state)
  assert max_rel_err(params, plain_run(tx, 10)) <= train_tol(10)


def test_bf16_params_reduce_in_fp32_with_aux(auto_mesh):
  tx = zerojax.zero_stage(zerojax.mixed_precision(optax.adam(1e-3)), 2, mesh=auto_mesh)
  master = mlp_params()
  tx.init(master)
  plan = zerojax.plan_for(tx, master)
  params = jax.device_put(zerojax.cast(master, jnp.bfloat16), plan.params)
  x, y = batch()
  xs, ys = shard_batch(auto_mesh, x, y)

  def loss_aux(p, b):
    loss = loss_fn(p, b['x'].astype(jnp.bfloat16), b['y'])
    return loss, {'loss_copy': zerojax.WeightedMean(loss.astype(jnp.float32))}

  grad_fn = zerojax.value_and_grad(
    loss_aux, tx, micro_batches=2, reduce_dtype=jnp.float32, has_aux=True
  )
  (loss, aux), grads = jax.jit(grad_fn)(params, {'x': xs, 'y': ys})
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  want = jax.grad(lambda p: loss_fn(p, x.astype(jnp.bfloat16), y))(
    zerojax.cast(master, jnp.bfloat16)
  )
  # Both sides round the layers' bf16 activations and the bf16 reference its
  # gradients, each once from float32 sums in another order: about one bf16 epsilon.
  bf16_tol = MARGIN * EPSBF16
  assert max_rel_err(grads, jax.tree.map(lambda g: g.astype(jnp.float32), want)) <= bf16_tol
  # A WeightedMean aux leaf is the mean over every part: the global loss, from the
  # same 16 per-part values (8 devices, 2 micro-batches), summed in float32.
  assert aux['loss_copy'].shape == ()
  assert abs(float(aux['loss_copy']) - float(loss)) <= reordered(16) * abs(float(loss))


D = 256


def compiled_step(mesh, stage, micro):
  def init(key):
    k1, k2 = jax.random.split(key)
    return {'w1': jax.random.normal(k1, (D, D)), 'w2': jax.random.normal(k2, (D, D))}

  state = zerojax.inspect.abstract_train_state(
    init, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  )

  def loss(p, b):
    return jnp.mean((jnp.tanh(b @ p['w1']) @ p['w2']) ** 2)

  grad_fn = zerojax.value_and_grad(loss, state.tx, micro_batches=micro)

  def step(state, b):
    _, grads = grad_fn(state.params, b)
    return state.apply_gradients(grads=grads)

  x = jax.ShapeDtypeStruct(
    (64, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )
  return zerojax.inspect.count_collectives(jax.jit(step).lower(state, x).compile())


GRAD_BYTES = 2 * D * D * 4


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_gradient_collective_placement(stage, auto_mesh):
  one, four = compiled_step(auto_mesh, stage, 1), compiled_step(auto_mesh, stage, 4)
  if stage == 1:
    # A full gradient buffer through the micro-batches, reduce-scattered once,
    # after the loop: the same reduce-scatters with 4 micro-batches as with 1
    # (ops in loop bodies count once per iteration), and no gradient all-reduce.
    assert four.result_bytes['reduce-scatter'] == one.result_bytes['reduce-scatter']
    assert one.result_bytes['reduce-scatter'] == GRAD_BYTES // 8
    assert four.counts['reduce-scatter'] == one.counts['reduce-scatter']
    assert four.result_bytes.get('all-reduce', 0) < GRAD_BYTES // 8
  else:
    # Reduce-scattered into the sharded accumulator at every micro-batch: the
    # reduce-scatters sit inside the loop, 4x the ops and bytes.
    assert one.result_bytes['reduce-scatter'] == GRAD_BYTES // 8
    assert four.counts['reduce-scatter'] == 4 * one.counts['reduce-scatter']
    assert four.result_bytes['reduce-scatter'] == 4 * GRAD_BYTES // 8
    # No gradient-sized all-reduce anywhere.
    assert four.result_bytes.get('all-reduce', 0) < GRAD_BYTES // 8


def test_errors(auto_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=auto_mesh)
  params = jax.device_put(mlp_params(), zerojax.plan_for(tx, mlp_params()).params)
  xs, ys = shard_batch(auto_mesh, *batch())
  with pytest.raises(ValueError) as e:
    zerojax.value_and_grad(batch_loss, tx, micro_batches=3)(params, {'x': xs, 'y': ys})
  assert str(e.value) == (
    "batch['x'] has 32 rows, which do not split into 8 devices x 3 micro-batches."
    ' Use a batch size divisible by 24.'
  )
  with pytest.raises(ValueError, match='`micro_batches` must be a positive int, got 0'):
    zerojax.value_and_grad(batch_loss, tx, micro_batches=0)
  with pytest.raises(TypeError, match='`tx` was not made by zerojax.zero_stage'):
    zerojax.value_and_grad(batch_loss, optax.adam(1e-3))


@pytest.mark.parametrize('stage', [2, 3])
@pytest.mark.parametrize('micro', [1, 2])
def test_hierarchical_partitioning_equals_full_batch_gradient(stage, micro):
  # hpZ: stage-3 parameters split over 'data' only (4 devices), gradients over all 8.
  mesh = jax.make_mesh((2, 4), ('replica', 'data'))
  x, y = batch()
  want_loss, want = jax.value_and_grad(loss_fn)(mlp_params(), x, y)
  tx = zerojax.zero_stage(
    optax.adam(1e-3), stage, mesh=mesh, axis=('replica', 'data'), param_axis='data'
  )
  plan = zerojax.plan_for(tx, mlp_params())
  params = jax.device_put(mlp_params(), plan.params)
  data = jax.device_put({'x': x, 'y': y}, NamedSharding(mesh, PartitionSpec(('replica', 'data'))))
  loss, grads = jax.jit(zerojax.value_and_grad(batch_loss, tx, micro_batches=micro))(params, data)
  assert abs(float(loss) - float(want_loss)) <= GRAD_TOL * abs(float(want_loss))
  assert max_rel_err(grads, want) <= GRAD_TOL
  assert jax.tree.map(lambda g: g.sharding.spec, grads) == jax.tree.map(
    lambda s: s.spec, plan.grads
  )
