"""Frozen parameters (`zero_stage(..., trainable=...)`): no gradient in the update, no optimizer
state, no master copy; split at rest at stage 3 like the rest; the updates equal optax's own
recipe for freezing (`optax.multi_transform` with `optax.set_to_zero`).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax
from zerojax._src.planner import hlo as hlo_lib

N = 8
# Distinct shapes, so the compiled program's collectives tell the leaves apart.
SHAPES = {
  'base': {'w': (64, 48), 'b': (48,)},
  'lora': {'a': (64, 16), 'b': (16, 48)},
}
MASK = {'base': False, 'lora': True}


def _params(dtype=jnp.float32):
  keys = iter(jax.random.split(jax.random.key(0), 4))
  return jax.tree.map(
    lambda s: (0.1 * jax.random.normal(next(keys), s)).astype(dtype),
    SHAPES,
    is_leaf=lambda s: isinstance(s, tuple),
  )


def _model(p, x):
  # A LoRA layer as LoRA computes it: the adapter's path beside the frozen weight's.
  h = x @ p['base']['w'] + (x @ p['lora']['a']) @ p['lora']['b'] + p['base']['b']
  return jnp.mean(jnp.tanh(h))


def _batch():
  return jax.random.normal(jax.random.key(1), (16, 64))


def _reference_run(params, x, steps):
  """optax's own freezing recipe, without zerojax, on one device's view of the arrays."""
  tx = optax.multi_transform(
    {'train': optax.adam(1e-2), 'frozen': optax.set_to_zero()}, MASK_LABELS
  )
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    g = jax.grad(_model)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for _ in range(steps):
    params, state = step(params, state)
  return params


MASK_LABELS = {'base': 'frozen', 'lora': 'train'}


def _zero_run(tx, params, x, steps, grad='jax'):
  plan = zerojax.plan_for(tx, params)
  params = jax.device_put(params, plan.params)
  state = tx.init(params)
  # The batch's rows split over the devices: each computes a part of the gradient.
  x = jax.device_put(x, jax.sharding.NamedSharding(plan.mesh, jax.P('data')))
  loss = lambda p, x: _model(zerojax.gather(p, tx), x)
  vg = zerojax.value_and_grad(loss, tx) if grad == 'zerojax' else jax.value_and_grad(loss)

  @jax.jit
  def step(p, s):
    _, g = vg(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = step.lower(params, state).compile()
  for _ in range(steps):
    params, state = step(params, state)
  return params, state, compiled


def _max_diff(a, b):
  return max(jax.tree.leaves(jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)))


@pytest.mark.parametrize('grad', ['jax', 'zerojax'])
@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_frozen_leaves_follow_optax_multi_transform(stage, grad, mesh):
  params, x = _params(), _batch()
  tx = zerojax.zero_stage(
    optax.adam(1e-2), stage, mesh=mesh, trainable=MASK, replicate_below_bytes=0
  )
  got, state, _ = _zero_run(tx, params, x, 3, grad)
  want = _reference_run(params, x, 3)
  assert _max_diff(got, want) <= 1e-6
  # The frozen base did not move, to the bit.
  np.testing.assert_array_equal(got['base']['w'], params['base']['w'])
  # Optimizer state only for the trainable leaves: optax.masked's inner form.
  mu = state[0].mu
  assert isinstance(mu['base']['w'], optax.MaskedNode)
  assert isinstance(mu['base']['b'], optax.MaskedNode)
  assert mu['lora']['a'].shape == SHAPES['lora']['a']


def _per_device(tree):
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _formula(stage, n=N):
  """Bytes per device, written from the stage table: a leaf of `e` f32 elements holds e*4
  bytes of parameter (/N at stage 3); a trainable one also e*4 of gradient (/N from stage 2)
  and Adam's 2*e*4 of moments (/N from stage 1), a frozen one neither. Adam's count: 4."""
  frozen = sum(
    np.prod(s) for s in jax.tree.leaves(SHAPES['base'], is_leaf=lambda s: isinstance(s, tuple))
  )
  train = sum(
    np.prod(s) for s in jax.tree.leaves(SHAPES['lora'], is_leaf=lambda s: isinstance(s, tuple))
  )
  split = lambda from_stage: n if stage >= from_stage else 1
  return {
    'params': int((frozen + train) * 4 // split(3)),
    'grads': int(train * 4 // split(2)),
    'opt_state': int(2 * train * 4 // split(1)) + 4,
  }


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_bytes_per_device_of_frozen_and_trainable_leaves(stage, explicit_mesh):
  params = _params()
  tx = zerojax.zero_stage(
    optax.adam(1e-2), stage, mesh=explicit_mesh, trainable=MASK, replicate_below_bytes=0
  )
  plan = zerojax.plan_for(tx, params)
  want = _formula(stage)
  got = plan.bytes_per_device()
  assert {k: got[k] for k in want} == want
  placed = jax.device_put(params, plan.params)
  state = tx.init(placed)
  assert _per_device(placed) == want['params']
  assert _per_device(state) == want['opt_state']
  # The plan's table says which leaves are frozen.
  rows = [line for line in str(plan).splitlines() if "['base']" in line]
  assert len(rows) == 2 and all('frozen' in line for line in rows)


def _reductions(compiled):
  """(kind, result type) of each collective that reduces (a gradient's)."""
  out = []
  for line in compiled.as_text().splitlines():
    found = hlo_lib.collective(line)
    if found and found[0] in ('all-reduce', 'reduce-scatter', 'all-reduce-start'):
      out.append((found[0], found[2]))
  return out


@pytest.mark.parametrize('grad', ['jax', 'zerojax'])
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_no_collective_reduces_a_frozen_gradient(stage, grad, explicit_mesh):
  params, x = _params(), _batch()
  tx = zerojax.zero_stage(
    optax.adam(1e-2), stage, mesh=explicit_mesh, trainable=MASK, replicate_below_bytes=0
  )
  _, _, compiled = _zero_run(tx, params, x, 1, grad)
  reduced = _reductions(compiled)
  # The base's gradient, whole or split 8 ways, in either orientation; no adapter's shape is
  # among them.
  frozen_shapes = {'64,48', '48,64', '8,48', '48,8', '64,6', '6,64', '48', '6'}
  shapes = [dims for _, t in reduced for dims in re.findall(r'\[([\d,]*)\]', t)]
  assert reduced, 'the trainable leaves are reduced'
  assert not frozen_shapes & set(shapes), reduced
  # At most the adapters' gradients, whole, cross the devices.
  moved = sum(hlo_lib.type_bytes(t) for _, t in reduced)
  assert moved <= (64 * 16 + 16 * 48) * 4, reduced
  # Thawed, the same program reduces the base's gradient too.
  whole = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=explicit_mesh, replicate_below_bytes=0)
  _, _, compiled = _zero_run(whole, params, x, 1, grad)
  assert sum(hlo_lib.type_bytes(t) for _, t in _reductions(compiled)) >= moved + 64 * 48 * 4 // N


def test_no_master_copy_for_frozen_leaves(explicit_mesh):
  params = _params()
  tx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.adam(1e-2)), 3, mesh=explicit_mesh, trainable=MASK
  )
  state = tx.init(jax.device_put(params, zerojax.plan_for(tx, params).params))
  master = state.master
  assert isinstance(master['base']['w'], optax.MaskedNode)
  assert master['lora']['a'].dtype == jnp.float32


def test_predicate_and_mask_agree(explicit_mesh):
  params = _params()
  by_path = lambda path, x: jax.tree_util.keystr(path).startswith("['lora']")
  plans = [
    zerojax.plan_for(
      zerojax.zero_stage(optax.adam(1e-2), 3, mesh=explicit_mesh, trainable=t), params
    )
    for t in (MASK, by_path, {'base': {'w': False, 'b': False}, 'lora': True})
  ]
  assert plans[0].frozen == plans[1].frozen == plans[2].frozen == (True, True, False, False)


def _errors(params, trainable):
  tx = zerojax.zero_stage(
    optax.adam(1e-2), 3, mesh=jax.make_mesh((N,), ('data',)), trainable=trainable
  )
  return zerojax.plan_for(tx, params)


def test_errors_name_the_leaf_and_the_fix():
  params = _params()
  with pytest.raises(
    TypeError, match=r"returned int for params\['base'\]\['b'\]; it must return True"
  ):
    _errors(params, lambda path, x: 1)
  with pytest.raises(TypeError, match=r"got params\['lora'\]\['a'\]: 'yes'"):
    _errors(params, {'base': False, 'lora': {'a': 'yes', 'b': True}})
  with pytest.raises(ValueError, match='a prefix of the parameters'):
    _errors(params, {'base': False})
  with pytest.raises(ValueError, match=r'leaves no parameter to train \(all 4 leaves are frozen\)'):
    _errors(params, False)
  with pytest.raises(
    ValueError, match='picks Flax Variables by type, and these parameters are plain'
  ):
    _errors(params, nnx.LoRAParam)


class _LoRANet(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.LoRALinear(64, 48, lora_rank=16, rngs=rngs)
    self.out = nnx.Linear(48, 8, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.fc(x)))


@pytest.mark.parametrize('spelling', ['wrt', 'trainable'])
@pytest.mark.parametrize('stage', [1, 3])
def test_flax_lora_trains_only_its_adapters(stage, spelling, explicit_mesh):
  """Flax's own spelling (`nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`) and zerojax's
  (`trainable=` a predicate, over every parameter) move the adapters alike, and no base."""
  x = _batch()
  results = []
  for form in ('plain', spelling):
    model = _LoRANet(nnx.Rngs(0))
    # Placed on the mesh whole, as a program puts its model there before it trains.
    whole = jax.sharding.NamedSharding(explicit_mesh, jax.P())
    nnx.update(model, jax.device_put(nnx.state(model), whole))
    before = nnx.state(model, nnx.Param)
    base = jax.tree.map(np.asarray, nnx.to_pure_dict(before))
    lora = lambda path, x: 'lora' in jax.tree_util.keystr(path)
    tx, wrt = None, nnx.LoRAParam
    if form == 'plain':
      opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    elif form == 'wrt':
      tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=explicit_mesh)
    else:
      tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=explicit_mesh, trainable=lora)
      wrt = nnx.Param
    if tx is not None:
      # At stage 3 every parameter, the frozen base included, rests split, and the loss
      # reads them gathered.
      zerojax.nnx.shard(model, tx)
      opt = nnx.Optimizer(model, tx, wrt=wrt)
    if form == 'trainable':
      mu = opt.opt_state[0].mu
      assert isinstance(nnx.to_pure_dict(mu)['fc']['kernel'], optax.MaskedNode)
    if stage == 3 and tx is not None:
      assert nnx.state(model, nnx.Param)['fc']['kernel'].sharding.spec == jax.P('data', None)

    @nnx.jit(static_argnums=(3, 4))
    def step(model, opt, x, wrt, tx):
      use = lambda m: zerojax.nnx.gathered(m, tx) if tx is not None else m
      loss = lambda m: jnp.mean(use(m)(x) ** 2)
      grads = nnx.grad(loss, argnums=nnx.DiffState(0, wrt))(model)
      opt.update(model, grads)

    for _ in range(3):
      step(model, opt, x, wrt, tx)
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(after['fc']['kernel'], base['fc']['kernel'])
    np.testing.assert_array_equal(after['out']['kernel'], base['out']['kernel'])
    results.append(after)
  assert _max_diff(results[0], results[1]) <= 1e-6
  assert _max_diff(results[1]['fc']['lora']['lora_a'], base['fc']['lora']['lora_a']) > 0


def test_a_type_filter_reads_variables_and_names_flax_spelling_on_arrays(explicit_mesh):
  model = _LoRANet(nnx.Rngs(0))
  tx = zerojax.zero_stage(optax.adam(1e-2), 1, mesh=explicit_mesh, trainable=nnx.LoRAParam)
  variables = nnx.state(model, nnx.Param)
  plan = zerojax.plan_for(tx, variables)
  kinds = [
    type(v) for v in jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nnx.Variable))
  ]
  assert plan.frozen == tuple(k is not nnx.LoRAParam for k in kinds)
  state = tx.init(variables)
  assert isinstance(nnx.to_pure_dict(state[0].mu)['fc']['kernel'], optax.MaskedNode)
  with pytest.raises(ValueError, match=r'nnx.Optimizer\(model, tx, wrt=nnx.LoRAParam\) trains'):
    zerojax.plan_for(tx, nnx.to_pure_dict(variables))


@pytest.mark.parametrize('stage', [1, 3])
def test_a_train_state_with_frozen_leaves_saves_and_restores(stage, tmp_path, explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=explicit_mesh, trainable=MASK)
  state = zerojax.create_train_state(_params, tx=tx)
  x = jax.device_put(_batch(), jax.sharding.NamedSharding(explicit_mesh, jax.P('data')))
  loss = lambda p: _model(zerojax.gather(p, tx), x)
  state = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params)))(state)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state)
  fresh = zerojax.create_train_state(_params, tx=tx)
  with zerojax.checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    restored, _ = ckpt.restore(fresh)
  assert _max_diff(restored.params, state.params) == 0
  assert _max_diff(restored.opt_state, state.opt_state) == 0
  assert isinstance(restored.opt_state[0].mu['base']['w'], optax.MaskedNode)
  got = jax.tree.map(lambda x: x.sharding.spec, restored.params)
  assert got == jax.tree.map(lambda x: x.sharding.spec, state.params)
