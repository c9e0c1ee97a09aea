"""Mixed precision, loss scaling, clipping, non-finite steps and donation, at every stage."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
  batch,
  loss_fn,
  max_rel_err,
  mlp_params,
  mp_step,
  plain_run,
  shard_batch,
  train_tol,
  zero_run,
)
from _tolerance import EPSBF16, MARGIN
from jax.sharding import NamedSharding, PartitionSpec

import zerojax

N = 8
D = 256
PSI = 2 * D * D + 2 * D
STAGES = [0, 1, 2, 3]


def init_fn(key):
  k1, k2 = jax.random.split(key)
  return {
    'w1': jax.random.normal(k1, (D, D)) / 16,
    'b1': jnp.zeros((D,)),
    'w2': jax.random.normal(k2, (D, D)) / 16,
    'b2': jnp.zeros((D,)),
  }


def abstract_state(mesh, stage, tx=None, param_dtype=jnp.bfloat16):
  return zerojax.inspect.abstract_train_state(
    init_fn,
    jax.random.key(0),
    tx=zerojax.zero_stage(tx or zerojax.mixed_precision(optax.adam(1e-3)), stage, mesh=mesh),
    param_dtype=param_dtype,
  )


def batch_spec(mesh, rows=64):
  return jax.ShapeDtypeStruct(
    (rows, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )


# bf16 params (2) + fp32 master (4) + Adam's two moments (8), grads excluded (docs/design.md).
MIXED_AT_REST = {0: 14 * PSI, 1: 2 * PSI + 12 * PSI // N, 2: 2 * PSI + 12 * PSI // N}
MIXED_AT_REST[3] = 14 * PSI // N
SCALARS = 4 + 4  # TrainState.step and Adam's count
BATCH_BYTES = 64 * D * 4 // N


@pytest.mark.parametrize('stage', STAGES)
def test_mixed_precision_argument_bytes_equal_formula(stage, mesh):
  state = abstract_state(mesh, stage)
  assert state.params['w1'].dtype == jnp.bfloat16
  assert state.opt_state.master['w1'].dtype == jnp.float32
  compiled = jax.jit(mp_step).lower(state, batch_spec(mesh)).compile()
  mem = zerojax.inspect.memory_stats(compiled)
  assert mem.argument == MIXED_AT_REST[stage] + BATCH_BYTES + SCALARS
  # The master copy is sharded with the optimizer state from stage 1.
  spec = state.opt_state.master['w1'].sharding.spec
  assert any(a is not None for a in spec) == (stage > 0)


@pytest.mark.parametrize('stage', STAGES)
def test_donated_step_aliases_the_whole_state(stage, mesh):
  for tx, dtype in [(optax.adam(1e-3), None), (zerojax.mixed_precision(optax.adam(1e-3)), 'bf16')]:
    state = abstract_state(mesh, stage, tx=tx, param_dtype=jnp.bfloat16 if dtype else None)
    state_bytes = sum(
      int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
      for x in jax.tree.leaves(state)
    )
    compiled = jax.jit(mp_step, donate_argnums=0).lower(state, batch_spec(mesh)).compile()
    mem = zerojax.inspect.memory_stats(compiled)
    assert mem.argument == state_bytes + BATCH_BYTES
    assert mem.alias == state_bytes  # updated in place: every byte of state is reused
    undonated = jax.jit(mp_step).lower(state, batch_spec(mesh)).compile()
    assert zerojax.inspect.memory_stats(undonated).alias == 0


def reference_mixed(tx, steps, dtype):
  """Plain optax on one device: fp32 master, compute-dtype params and grads."""
  master = mlp_params()
  opt_state = tx.init(master)
  x, y = batch()

  @jax.jit
  def step(master, opt_state):
    params = jax.tree.map(lambda m: m.astype(dtype), master)
    grads = jax.grad(lambda p: loss_fn(p, x.astype(dtype), y))(params)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = tx.update(grads, opt_state, master)
    return optax.apply_updates(master, updates), opt_state

  for _ in range(steps):
    master, opt_state = step(master, opt_state)
  return master


def zero_mixed(tx, mesh, stage, steps, dtype, **kwargs):
  ztx = zerojax.zero_stage(zerojax.mixed_precision(tx, **kwargs), stage, mesh=mesh)
  master = mlp_params()
  opt_state = ztx.init(master)
  plan = zerojax.plan_for(ztx, master)
  params = jax.device_put(zerojax.cast(master, dtype), plan.params)
  x, y = shard_batch(mesh, *batch())

  @jax.jit
  def step(params, opt_state):
    def loss(p):
      return loss_fn(zerojax.gather(p, plan), x.astype(dtype), y)

    grads = jax.grad(loss)(params)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(steps):
    params, opt_state = step(params, opt_state)
  return params, opt_state, plan


@pytest.mark.parametrize('stage', STAGES)
def test_mixed_precision_equals_plain_optax_reference(stage, mesh):
  tx = optax.adamw(1e-2, weight_decay=0.1)
  want = reference_mixed(tx, 10, jnp.bfloat16)
  params, opt_state, plan = zero_mixed(tx, mesh, stage, 10, jnp.bfloat16)
  # bf16 gradients, each rounded once to bf16 from float32 sums in another order
  # across devices: a relative difference of about one bf16 epsilon. Adam moves a
  # parameter by at most its learning rate whatever the gradient, so ten steps keep
  # the master within that of the reference (measured: 3.2e-4 on Auto meshes,
  # 4.8e-3 on Explicit ones).
  assert max_rel_err(opt_state.master, want) <= MARGIN * EPSBF16
  assert jax.tree.map(lambda p: p.dtype, params) == jax.tree.map(lambda _: jnp.bfloat16, want)
  # The parameters are the master rounded to bf16: exactly where a step moved a value by
  # less than 2x (Sterbenz); elsewhere (values near zero) within a bf16 rounding step of
  # the old value, far below the leaf's scale.
  for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(opt_state.master)):
    p, r = np.asarray(p, np.float32), np.asarray(m.astype(jnp.bfloat16), np.float32)
    assert np.max(np.abs(p - r)) <= EPSBF16 / 2 * np.max(np.abs(r))  # half a bf16 step
    assert np.mean(p != r) < 0.02
  assert jax.tree.map(lambda a: a.sharding, (params, opt_state)) == (plan.params, plan.opt_state)


# Plain optax's 10 steps, the reference of one test at every stage and mesh: run once each.
_PLAIN = {
  'adam': lambda: optax.adam(1e-2),
  'clip': lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5)),
  # Clipping on each device's shard alone.
  'clip_local': lambda: optax.chain(optax.clip_by_global_norm(0.05 / np.sqrt(N)), optax.sgd(0.5)),
}


@functools.cache
def _plain(name):
  return plain_run(_PLAIN[name](), 10)


@pytest.mark.parametrize('stage', STAGES)
def test_mixed_precision_in_fp32_equals_optax(stage, mesh):
  # With fp32 "compute" the wrapper must be invisible: same numbers as plain optax.
  params, _, _ = zero_mixed(_PLAIN['adam'](), mesh, stage, 10, jnp.float32)
  assert max_rel_err(params, _plain('adam')) <= train_tol(10)


@pytest.mark.parametrize('stage', STAGES)
def test_dynamic_loss_scale_skips_overflow_and_adjusts(stage, mesh):
  cfg = zerojax.DynamicLossScale(initial=2.0**10, growth_interval=2)
  ztx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.adam(1e-2), loss_scale=cfg), stage, mesh=mesh
  )
  master = mlp_params()
  opt_state = ztx.init(master)
  plan = zerojax.plan_for(ztx, master)
  params = jax.device_put(zerojax.cast(master, jnp.float16), plan.params)
  assert float(zerojax.loss_scale(opt_state)) == 1024.0
  x, y = shard_batch(mesh, *batch())

  @jax.jit
  def step(params, opt_state, poison):
    scale = zerojax.loss_scale(opt_state)
    grads = jax.grad(lambda p: loss_fn(zerojax.gather(p, plan), x.astype(jnp.float16), y) * scale)(
      params
    )
    grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  before = jax.tree.map(np.asarray, (params, opt_state))
  params2, state2 = step(params, opt_state, jnp.float32(np.inf))  # overflow
  after = jax.tree.map(np.asarray, (params2, state2._replace(loss_scale=None)))
  for a, b in zip(
    jax.tree.leaves(after),
    jax.tree.leaves(before[0]) + jax.tree.leaves(before[1]._replace(loss_scale=None)),
  ):
    np.testing.assert_array_equal(a, b)  # nothing moved
  assert float(zerojax.loss_scale(state2)) == 512.0
  assert jax.tree.map(lambda a: a.sharding, (params2, state2)) == (plan.params, plan.opt_state)
  params3, state3 = step(params2, state2, jnp.float32(1))
  assert int(state3.loss_scale.good_steps) == 1 and float(state3.loss_scale.scale) == 512.0
  params4, state4 = step(params3, state3, jnp.float32(1))
  assert float(state4.loss_scale.scale) == 1024.0  # two good steps: grows
  assert int(state4.loss_scale.good_steps) == 0
  # And those steps did train: they moved the parameters far beyond rounding.
  assert max_rel_err(params4, params2) > 100 * train_tol(2)
  assert all(np.isfinite(np.asarray(p, np.float32)).all() for p in jax.tree.leaves(params4))


@pytest.mark.parametrize('stage', STAGES)
def test_clipping_sharded_gradients_equals_full_gradient(stage, mesh):
  # The MLP's gradient norm is about 1: a threshold of 0.05 clips every step.
  x, y = batch()
  norm = optax.tree.norm(jax.grad(loss_fn)(mlp_params(), x, y))
  assert norm > 0.05 * 5
  params, opt_state, plan = zero_run(_PLAIN['clip'](), mesh, stage, 10)
  assert max_rel_err(params, _plain('clip')) <= train_tol(10)
  # Clipping on each device's shard alone would give another answer.
  assert max_rel_err(_plain('clip_local'), _plain('clip')) > 100 * train_tol(10)


@pytest.mark.parametrize('stage', STAGES)
def test_non_finite_gradients_skip_the_step(stage, mesh):
  tx = zerojax.zero_stage(optax.apply_if_finite(optax.adam(1e-2), 3), stage, mesh=mesh)
  params = mlp_params()
  opt_state = tx.init(params)
  plan = zerojax.plan_for(tx, params)
  params = jax.device_put(params, plan.params)
  x, y = shard_batch(mesh, *batch())

  @jax.jit
  def step(params, opt_state, poison):
    grads = jax.grad(lambda p: loss_fn(zerojax.gather(p, plan), x, y))(params)
    grads = {**grads, 'dense2': jax.tree.map(lambda g: g * poison, grads['dense2'])}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = step(params, opt_state, jnp.float32(1))
  before = jax.tree.map(np.asarray, (params, opt_state.inner_state))
  params2, state2 = step(params, opt_state, jnp.float32(np.nan))
  for a, b in zip(jax.tree.leaves((params2, state2.inner_state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert int(state2.notfinite_count) == 1
  assert jax.tree.map(lambda a: a.sharding, (params2, state2)) == (plan.params, plan.opt_state)


def test_estimate_mixed_precision_and_offload():
  n, psi = 64, 10**6 * 64
  tx = zerojax.mixed_precision(optax.adam(1e-3))
  est = zerojax.inspect.estimate_memory(psi, tx, num_devices=n, dtype=jnp.bfloat16)
  # bf16 params and grads, fp32 master + Adam (K = 12): 16, 4+12/N, 2+14/N, 16/N bytes/param
  # (docs/design.md), plus Adam's 4-byte step count.
  assert [e.total - 4 for e in est] == [
    16 * psi,
    4 * psi + 12 * psi // n,
    2 * psi + 14 * psi // n,
    16 * psi // n,
  ]
  off = zerojax.inspect.estimate_memory(
    psi, tx, num_devices=n, dtype=jnp.bfloat16, options=zerojax.Options(offload='opt_state')
  )
  assert [e.host for e in off] == [8 * psi, 8 * psi // n, 8 * psi // n, 8 * psi // n]
  assert [e.total + e.host for e in off] == [e.total for e in est]
  assert 'host' in zerojax.inspect.format_estimates(off)


def test_train_state_plan_counts_compute_dtype(auto_mesh):
  state = zerojax.create_train_state(
    init_fn,
    jax.random.key(0),
    tx=zerojax.zero_stage(zerojax.mixed_precision(optax.adam(1e-3)), 3, mesh=auto_mesh),
    param_dtype=jnp.bfloat16,
  )
  sizes = zerojax.plan_for(state.tx, state.params).bytes_per_device()
  assert sizes['params'] == 2 * PSI // N  # bf16 at rest
  assert sizes['opt_state'] == 12 * PSI // N + 4  # fp32 master + Adam, and its count


def _one_scaled_sgd_step(mesh, stage, scale, path):
  """One SGD(lr=1) step under `mixed_precision` with a loss scale; returns (master, new master, grad)."""
  ztx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.sgd(1.0), loss_scale=scale), stage, mesh=mesh
  )
  master = mlp_params()
  opt_state = ztx.init(master)
  plan = zerojax.plan_for(ztx, master)
  params = jax.device_put(master, plan.params)
  xs, ys = shard_batch(mesh, *batch())
  data = {'x': xs, 'y': ys}

  def batch_loss(p, b):
    return loss_fn(p, b['x'], b['y'])

  def grads_of(params, scale_value):
    if path == 'value_and_grad':
      grad_fn = zerojax.value_and_grad(batch_loss, ztx, micro_batches=2)
      return grad_fn(params, data, loss_scale=scale_value)[1]
    scaled = lambda p: batch_loss(zerojax.gather(p, plan), data) * scale_value
    return jax.grad(scaled)(params)

  @jax.jit
  def step(params, opt_state):
    grads = grads_of(params, zerojax.loss_scale(opt_state))
    _, opt_state = ztx.update(grads, opt_state, params)
    return opt_state

  # The true gradient, by the same path with no scale.
  grad = jax.jit(lambda p: grads_of(p, jnp.float32(1)))(params)
  new_state = step(params, opt_state)
  return jax.tree.map(np.asarray, (master, new_state.master, grad))


@pytest.mark.parametrize('path', ['value_and_grad', 'jax.grad'])
@pytest.mark.parametrize('scale', [1024.0, 'dynamic'])
@pytest.mark.parametrize('stage', STAGES)
def test_loss_scale_is_divided_out_exactly_once(stage, scale, path, mesh):
  master, new_master, grad = _one_scaled_sgd_step(mesh, stage, scale, path)
  # SGD is not scale-invariant: a scale divided out twice (or never) shows. The
  # scales are powers of two, so the unscaled gradient is bit for bit the true one.
  for m, new, g in zip(*map(jax.tree.leaves, (master, new_master, grad))):
    np.testing.assert_array_equal(new, m - 1.0 * g)
    assert np.abs(g).max() > 1e-3


@pytest.mark.parametrize('stage', [1, 3])
def test_mixed_precision_outside_zero_stage_is_refused(stage, mesh):
  ztx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  with pytest.raises(ValueError) as e:
    zerojax.mixed_precision(ztx)
  assert str(e.value) == (
    '`tx` is already wrapped by zero_stage, so the fp32 master copy that mixed_precision adds'
    ' would sit outside the sharded optimizer state, whole on every device. Nest them the'
    ' other way round: zerojax.zero_stage(zerojax.mixed_precision(tx), stage, mesh=mesh).'
  )
