"""zerojax against the FSDP recipe of JAX's documentation: the same collectives, the same
matmuls, the same memory; reduce-scatters on CPU; per-layer gathering through value_and_grad."""

import os
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import ScannedNNX, max_rel_err
from _tolerance import reordered
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))
import hlo_ops  # noqa: E402
import recipes  # noqa: E402

N = 8


def _data(mesh, width, batch=32):
  rows = NamedSharding(mesh, P('data'))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (batch, width)), rows)
  y = jax.device_put(jax.random.normal(jax.random.key(2), (batch, width)), rows)
  return x, y


def _zerojax_step(mesh, stage, *, layers=4, width=256, per_layer=True, remat=True):
  """The documented step: value_and_grad, per-layer gathers, gathers rematerialised."""
  ztx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  gather, policy = (lambda w: w), None
  if stage >= 2 and per_layer:
    gather = lambda w: zerojax.gather(w, ztx)
    policy = zerojax.recompute_gathers if remat and stage == 3 else None

  def loss_fn(params, batch):
    return recipes.mse(recipes.forward(params, batch['x'], gather, policy), batch['y'])

  grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=stage >= 2 and per_layer)

  def step(params, opt_state, x, y):
    loss, grads = grad_fn(params, {'x': x, 'y': y})
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = recipes.init_params(jax.random.key(0), layers, width)
  params = jax.device_put(params, zerojax.plan_for(ztx, params).params)
  return jax.jit(step, donate_argnums=(0, 1)), params, ztx.init(params)


def _compiled(mesh, stage, **kw):
  step, params, opt_state = _zerojax_step(mesh, stage, **kw)
  width = params['w'].shape[-1]
  return step.lower(params, opt_state, *_data(mesh, width)).compile(), params['w'].size


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_gradients_reach_their_shards_through_a_reduce_scatter_on_cpu(auto_mesh, stage):
  compiled, psi = _compiled(auto_mesh, stage)
  stats = zerojax.inspect.count_collectives(compiled)
  layers = 4
  # A reduce-scatter per layer at stages 2-3 (each gather's transpose), one for
  # the whole buffer at stage 1; no all-reduce of gradient size anywhere.
  assert stats['reduce-scatter'] == (layers if stage >= 2 else 1)
  assert stats.result_bytes.get('all-reduce', 0) <= 16  # the loss, a scalar
  # Exactly the floor, up to the loss's scalar all-reduce.
  floor = zerojax.inspect.zero_floor_bytes(stage, psi, N)
  assert floor <= stats.total_ring_bytes <= floor + 16


def test_per_layer_value_and_grad_is_the_docs_recipe(auto_mesh):
  width, layers = 256, 4
  compiled, _ = _compiled(auto_mesh, 3, layers=layers, width=width)
  tx = optax.adam(1e-3)
  step, sharding = recipes.shard_map_step(auto_mesh, tx)
  params, opt_state = recipes.place(
    recipes.init_params(jax.random.key(0), layers, width), tx, sharding
  )
  docs = step.lower(params, opt_state, *_data(auto_mesh, width)).compile()
  # The same matmuls (forward, and two per layer in the backward: no forward recomputed) ...
  assert hlo_ops.matmuls(compiled) == hlo_ops.matmuls(docs) == 3 * layers
  # ... the same collectives, and the same memory.
  ours, theirs = (
    zerojax.inspect.count_collectives(compiled),
    zerojax.inspect.count_collectives(docs),
  )
  assert (
    ours.counts
    == theirs.counts
    == {'all-gather': 2 * layers, 'reduce-scatter': layers, 'all-reduce': 1}
  )
  assert ours.total_ring_bytes == theirs.total_ring_bytes
  mine, docs_mem = zerojax.inspect.memory_stats(compiled), zerojax.inspect.memory_stats(docs)
  assert mine.argument == docs_mem.argument and mine.temp <= docs_mem.temp * 1.1


def test_a_full_checkpoint_runs_the_forward_again(auto_mesh):
  # What the README's recipe did before recompute_gathers: 4 matmuls per layer.
  step, params, opt_state = _zerojax_step(auto_mesh, 3, per_layer=True, remat=True)
  ztx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=auto_mesh)
  gather = lambda w: zerojax.gather(w, ztx)

  def loss_fn(params, batch):
    def body(h, w):
      return recipes.layer(h, gather(w)), None

    h, _ = jax.lax.scan(jax.checkpoint(body), batch['x'], params['w'])
    return recipes.mse(h, batch['y'])

  grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=True)
  x, y = _data(auto_mesh, 256)
  compiled = jax.jit(lambda p: grad_fn(p, {'x': x, 'y': y})).lower(params).compile()
  assert hlo_ops.matmuls(compiled) == 4 * 4


def test_per_layer_value_and_grad_keeps_temporaries_per_layer(auto_mesh):
  # Going from 4 to 8 layers adds far less than a layer's bytes per layer of
  # temporaries: each layer's whole weight lives only while the layer runs,
  # and only gradient shards are carried through the backward pass.
  width, stage = 512, 3
  temps = {}
  for layers in (4, 8):
    compiled, _ = _compiled(auto_mesh, stage, layers=layers, width=width)
    temps[layers] = zerojax.inspect.memory_stats(compiled).temp
  layer_bytes = width * width * 4
  slope = (temps[8] - temps[4]) / 4
  assert slope < layer_bytes / 4, (temps, layer_bytes)
  # Without per_layer, every layer's whole weight is kept.
  up_front = {}
  for layers in (4, 8):
    compiled, _ = _compiled(auto_mesh, stage, layers=layers, width=width, per_layer=False)
    up_front[layers] = zerojax.inspect.memory_stats(compiled).temp
  assert (up_front[8] - up_front[4]) / 4 >= layer_bytes


def test_stage_2_carries_gradient_shards_through_the_backward_pass(auto_mesh):
  # Stage 2 holds whole parameters and a whole update; what per_layer removes is
  # the whole gradient buffer: each layer's gradient is reduce-scattered as the
  # backward pass reaches it. Measured against the plain jax.grad step.
  layers, width = 8, 1024
  temp = lambda **kw: (
    zerojax.inspect.memory_stats(_compiled(auto_mesh, 2, layers=layers, width=width, **kw)[0]).temp
  )
  per_layer, whole = temp(per_layer=True), temp(per_layer=False)
  ztx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=auto_mesh)

  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: recipes.mse(recipes.forward(p, x), y))(params)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = recipes.init_params(jax.random.key(0), layers, width)
  params = jax.device_put(params, zerojax.plan_for(ztx, params).params)
  plain = zerojax.inspect.memory_stats(
    jax.jit(step).lower(params, ztx.init(params), *_data(auto_mesh, width)).compile()
  ).temp
  psi_bytes = layers * width * width * 4
  assert whole - per_layer >= psi_bytes * 0.6  # a gradient-sized buffer less
  # Still above the plain step (measured 1.28x here, 1.15x in the benchmark):
  # the gap left, said in benchmarks/README.md.
  assert per_layer <= plain * 1.3, (per_layer, plain)


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_numerics_equal_plain_optax(auto_mesh, stage):
  step, params, opt_state = _zerojax_step(auto_mesh, stage)
  x, y = _data(auto_mesh, 256)
  ref_step, rep = recipes.replicated_step(auto_mesh, optax.adam(1e-3))
  ref = recipes.init_params(jax.random.key(0), 4, 256)
  ref_state = optax.adam(1e-3).init(ref)
  for _ in range(3):
    params, opt_state, loss = step(params, opt_state, x, y)
    ref, ref_state, ref_loss = ref_step(ref, ref_state, x, y)
  # 32 rows through 4 layers of 256-wide contractions, three Adam steps.
  tol = reordered(32 + 4 * 256, steps=3)
  assert max_rel_err(jax.device_get(params), jax.device_get(ref)) <= tol
  assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))


class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(64, use_bias=False)(h)), None


class Deep(nn.Module):
  zero: object = None

  @nn.compact
  def __call__(self, x):
    gathered = lambda cls: zerojax.linen.gathered(cls, self.zero)
    h = gathered(nn.Dense)(64)(x)
    block = nn.remat(gathered(Block), prevent_cse=False, policy=zerojax.recompute_gathers)
    h, _ = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True}, length=4)()(
      h, None
    )
    return gathered(nn.Dense)(8)(h)


def test_gathered_linen_gathers_per_layer_inside_value_and_grad(auto_mesh):
  ztx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=auto_mesh)
  model = Deep(ztx)
  x = jax.random.normal(jax.random.key(1), (32, 16))
  y = jax.random.normal(jax.random.key(2), (32, 8))
  params = model.init(jax.random.key(0), x)['params']
  loss_fn = lambda p, b: jnp.mean((model.apply({'params': p}, b['x']) - b['y']) ** 2)
  grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=True)
  sharded = jax.device_put(params, zerojax.plan_for(ztx, params).params)
  batch = jax.device_put({'x': x, 'y': y}, NamedSharding(auto_mesh, P('data')))
  fn = jax.jit(grad_fn)
  loss, grads = fn(sharded, batch)
  want_loss, want = jax.value_and_grad(loss_fn)(params, {'x': x, 'y': y})
  tol = reordered(32 + 16 + 64 + 4 * 64 + 8)  # rows, Deep's five layers
  assert max_rel_err(jax.device_get(grads), want) <= tol
  assert abs(float(loss) - float(want_loss)) <= tol * abs(float(want_loss))
  stats = zerojax.inspect.count_collectives(fn.lower(sharded, batch).compile())
  assert stats['reduce-scatter'] >= 4 and stats['all-gather'] >= 8  # each block, twice


def test_a_parameter_used_without_a_gather_is_named(auto_mesh):
  ztx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=auto_mesh)
  params = {'layer': {'w': jnp.ones((64, 32))}}
  grad_fn = zerojax.value_and_grad(lambda p, b: jnp.sum(b @ p['layer']['w']), ztx, per_layer=True)
  params = jax.device_put(params, zerojax.plan_for(ztx, params).params)
  with pytest.raises(TypeError) as e:
    jax.jit(grad_fn)(params, jnp.ones((8, 64)))
  assert str(e.value).startswith(
    "parameter params['layer']['w'] was used without being gathered: inside"
    ' zerojax.value_and_grad(..., per_layer=True) split parameters arrive as shards'
  )


def test_one_loss_line_with_per_layer_serves_every_stage(mesh):
  # The script's stage is the one thing that changes: the same loss (gathering each layer) and
  # the same value_and_grad(per_layer=True) line at stages 0-3, losses and gradients equal.
  params = recipes.init_params(jax.random.key(0), 2, 64)
  x, y = _data(mesh, 64, batch=16)
  hx, hy = jax.device_get((x, y))  # the reference: plain jax on one device
  want_loss, want = jax.value_and_grad(lambda p: recipes.mse(recipes.forward(p, hx), hy))(params)
  for stage in range(4):
    ztx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)

    def loss_fn(p, batch, ztx=ztx):
      gather = lambda w: zerojax.gather(w, ztx)
      pred = recipes.forward(p, batch['x'], gather, zerojax.recompute_gathers)
      return recipes.mse(pred, batch['y'])

    placed = jax.device_put(params, zerojax.plan_for(ztx, params).params)
    grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=True)
    loss, grads = jax.jit(grad_fn)(placed, {'x': x, 'y': y})
    tol = reordered(x.shape[0] * 64)
    assert abs(float(loss) - float(want_loss)) <= tol * abs(float(want_loss)), stage
    assert max_rel_err(grads, want) <= tol, stage
    if stage < 2:  # nothing split: per_layer=False's program, to the text
      whole = zerojax.value_and_grad(loss_fn, ztx, per_layer=False)
      args = (placed, {'x': x, 'y': y})
      assert jax.jit(grad_fn).lower(*args).as_text() == jax.jit(whole).lower(*args).as_text()


def test_per_layer_with_hpz_is_refused():
  mesh = jax.make_mesh((2, 4), ('replica', 'data'))
  ztx = zerojax.zero_stage(
    optax.adam(1e-3), 3, mesh=mesh, axis=('replica', 'data'), param_axis='data'
  )
  with pytest.raises(ValueError) as e:
    zerojax.value_and_grad(lambda p, b: 0.0, ztx, per_layer=True)
  assert str(e.value) == (
    '`per_layer=True` hands the loss shards split over all of the ZeRO axes, and under hpZ'
    " (param_axis='data') the parameters are split over that axis only: use per_layer=False"
    ' with param_axis.'
  )


def test_recompute_gathers_saves_everything_but_gathers():
  from jax.ad_checkpoint import checkpoint_name

  def primitive(fn, *args):
    return jax.make_jaxpr(fn)(*args).eqns[0].primitive

  named = primitive(lambda w: checkpoint_name(w, zerojax._src.gather.GATHERED), jnp.ones(4))
  assert not zerojax.recompute_gathers(named, name=zerojax._src.gather.GATHERED)
  assert zerojax.recompute_gathers(primitive(jnp.tanh, jnp.ones(4)))
  assert zerojax.recompute_gathers(primitive(lambda a: a @ a, jnp.ones((4, 4))))


def test_gathered_nnx_gathers_per_layer_inside_value_and_grad(auto_mesh):
  from flax import nnx

  x = jax.random.normal(jax.random.key(1), (16, 32))
  ztx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=auto_mesh)
  model = ScannedNNX(32, 2, nnx.Rngs(0), zero=ztx)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, b):
    return jnp.mean(nnx.merge(graphdef, p, rest)(b) ** 2)

  plan = zerojax.plan_for(ztx, params)
  sharded = jax.device_put(params, plan.params)
  batch = jax.device_put(x, NamedSharding(auto_mesh, P('data')))
  fn = jax.jit(zerojax.value_and_grad(loss_fn, ztx, per_layer=True))
  loss, grads = fn(sharded, batch)
  want_loss, want = jax.value_and_grad(loss_fn)(params, x)
  tol = reordered(16 + 2 * (32 + 128))  # rows, ScannedNNX(32, 2)'s blocks
  assert max_rel_err(jax.device_get(grads), want) <= tol
  assert abs(float(loss) - float(want_loss)) <= tol * abs(float(want_loss))
  assert (
    zerojax.inspect.count_collectives(fn.lower(sharded, batch).compile())['reduce-scatter'] >= 4
  )
