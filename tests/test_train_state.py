"""zero_stage over flax train states; create_train_state."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import (
  batch,
  loss_fn,
  max_rel_err,
  mlp_apply,
  mlp_params,
  plain_run,
  shard_batch,
  train_tol,
)
from _tolerance import assert_close, reordered
from flax import struct
from flax.training import train_state

import zerojax


class StateWithExtras(train_state.TrainState):
  """A user subclass with an extra array field and a static field."""

  ema: dict
  label: str = struct.field(pytree_node=False, default='run')


def user_step(state, x, y):
  """A plain user step: no zerojax annotation except the stage-3 gather."""
  plan = zerojax.plan_for(state.tx, state.params)

  def loss(p):
    return loss_fn(zerojax.gather(p, plan), x, y)

  grads = jax.grad(loss)(state.params)
  return state.apply_gradients(grads=grads)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_train_state_keeps_plan_layout_and_matches_optax(stage, mesh):
  params = mlp_params()
  state = StateWithExtras.create(
    apply_fn=mlp_apply,
    params=params,
    tx=optax.adamw(1e-2),
    ema=jax.tree.map(jnp.zeros_like, params),
  )
  zstate = zerojax.zero_stage(state, stage, mesh=mesh)
  assert type(zstate) is StateWithExtras and zstate.label == 'run'
  plan = zerojax.plan_for(zstate.tx, zstate.params)
  x, y = shard_batch(mesh, *batch())
  step = jax.jit(user_step)
  for _ in range(10):
    zstate = step(zstate, x, y)
    assert jax.tree.map(lambda a: a.sharding, zstate.params) == plan.params
    assert jax.tree.map(lambda a: a.sharding, zstate.opt_state) == plan.opt_state
  assert int(zstate.step) == 10
  assert max_rel_err(zstate.params, plain_run(optax.adamw(1e-2), steps=10)) <= train_tol(10)
  # Stage 1 params must not come back sharded; state must not come back replicated.
  kernel = zstate.params['dense1']['kernel']
  assert kernel.sharding.is_fully_replicated == (stage < 3)
  assert zstate.opt_state[0].mu['dense1']['kernel'].sharding.is_fully_replicated == (stage == 0)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_create_train_state_is_born_sharded(stage, mesh):
  state = zerojax.create_train_state(
    lambda k: mlp_params(),
    jax.random.key(0),
    tx=zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh),
    apply_fn=mlp_apply,
  )
  plan = zerojax.plan_for(state.tx, state.params)
  assert jax.tree.map(lambda a: a.sharding, state.params) == plan.params
  assert jax.tree.map(lambda a: a.sharding, state.opt_state) == plan.opt_state
  assert max_rel_err(state.params, jax.jit(mlp_params)()) == 0.0
  # The initialising program writes only shards: its outputs per device are the
  # planned bytes, never a full replicated copy first.
  abstract = zerojax.inspect.abstract_train_state(
    lambda k: mlp_params(),
    jax.random.key(0),
    tx=zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh),
  )
  assert jax.tree.map(lambda a: a.sharding, abstract.opt_state) == plan.opt_state
  sizes = plan.bytes_per_device()
  assert (
    sum(
      a.addressable_shards[0].data.nbytes for a in jax.tree.leaves((state.params, state.opt_state))
    )
    == sizes['params'] + sizes['opt_state']
  )


def test_abstract_train_state_allocates_nothing(explicit_mesh):
  # 4 GiB of parameters: would not fit eight times in this machine's memory.
  state = zerojax.inspect.abstract_train_state(
    lambda k: {'w': jax.random.normal(k, (1 << 15, 1 << 15))},
    jax.random.key(0),
    tx=zerojax.zero_stage(optax.adam(1e-3), 3, mesh=explicit_mesh),
  )
  assert isinstance(state.params['w'], jax.ShapeDtypeStruct)
  assert state.params['w'].sharding.shard_shape((1 << 15, 1 << 15)) == (1 << 12, 1 << 15)


def _dense_state(mesh, stage=3):
  import flax.linen as nn
  from flax.training import train_state as flax_train_state

  model = nn.Dense(64)
  x = jnp.ones((16, 32))
  state = flax_train_state.TrainState.create(
    apply_fn=model.apply, params=model.init(jax.random.key(0), x)['params'], tx=optax.adam(1e-3)
  )
  return model, x, zerojax.zero_stage(state, stage, mesh=mesh)


def test_stage3_apply_fn_on_split_params_names_the_parameter_and_the_gather(explicit_mesh):
  # On an Explicit mesh a layer run on its split parameters would fail inside jax
  # (ShardingTypeError); the state zerojax returns says which parameter and the fix.
  from jax.sharding import NamedSharding, PartitionSpec

  model, x, state = _dense_state(explicit_mesh)
  xs = jax.device_put(x, NamedSharding(explicit_mesh, PartitionSpec('data')))
  with pytest.raises(ValueError) as e:
    jax.jit(lambda s, x: s.apply_fn({'params': s.params}, x))(state, xs)
  assert str(e.value) == (
    "zerojax: Dense (the top module) runs __call__ on params['bias'], float32[64@data]"
    " split over 'data' as ZeRO stage 3 keeps it at rest; a layer needs its parameters whole."
    " Gather them where they are used: the whole model with state.apply_fn({'params':"
    ' zerojax.gather(state.params, state.tx)}, x), or block by block (less memory) by building'
    ' the model from zerojax.linen.gathered(Block, tx). A module that gathers its own'
    ' parameters is built with zerojax.linen.gathered too.'
  )

  # Gathered where they are used, the parameters give the unsplit model's output.
  def fixed(s, x):
    return s.apply_fn({'params': zerojax.gather(s.params, s.tx)}, x)

  out = jax.jit(fixed)(state, xs)
  want = model.apply({'params': jax.device_get(state.params)}, x)
  # One Dense layer: each output sums 32 products, in another order once gathered.
  assert_close(out, want, reordered(32))


def test_stage3_apply_fn_check_passes_gathered_blocks_and_lower_stages(explicit_mesh):
  import flax.linen as nn
  from flax.training import train_state as flax_train_state

  # Below stage 3 the parameters are whole: apply_fn is the model's own.
  model, x, state = _dense_state(explicit_mesh, stage=2)
  assert state.apply_fn == model.apply

  # A model whose layers gather their own parameters runs on the split ones.
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=explicit_mesh)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = zerojax.linen.gathered(nn.Dense, tx)(64, name='a')(x)
      return zerojax.linen.gathered(nn.Dense, tx)(8, name='b')(jax.nn.relu(x))

  net = Net()
  params = net.init(jax.random.key(1), x)['params']
  state = zerojax.zero_stage(
    flax_train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3)),
    3,
    mesh=explicit_mesh,
  )
  assert state.params['a']['kernel'].sharding.spec != (None, None)
  out = jax.jit(lambda s, x: s.apply_fn({'params': s.params}, x))(state, x)
  assert_close(out, net.apply({'params': params}, x), reordered(64))


def test_builders_take_the_options_from_the_wrapped_optimizer(explicit_mesh):
  init = lambda k: mlp_params()
  ztx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=explicit_mesh, policy='replicate')
  state = zerojax.create_train_state(init, jax.random.key(0), tx=ztx)
  assert zerojax.config_of(state.tx) is zerojax.config_of(ztx)
  assert (
    state.params['dense1']['kernel'].sharding.spec
    == zerojax.plan_for(ztx, mlp_params()).params['dense1']['kernel'].spec
  )
  with pytest.raises(TypeError) as e:
    zerojax.create_train_state(init, jax.random.key(0), tx=optax.adam(1e-3), stage=3)
  assert str(e.value) == (
    'zerojax.create_train_state takes the optimizer already wrapped by'
    ' zerojax.zero_stage, which holds the ZeRO stage and options (got stage=):'
    ' tx=zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=mesh).'
  )
  with pytest.raises(TypeError, match=r'\(got mesh=, policy=\)'):
    zerojax.inspect.abstract_train_state(
      init, jax.random.key(0), tx=ztx, mesh=explicit_mesh, policy='pad'
    )


@pytest.mark.parametrize('stage', [0, 1, 2])
def test_an_fsdp_state_is_not_made_whole_without_a_word(stage, mesh):
  # A codebase with its own FSDP hands over parameters split over 'data'; stages 0-2 would
  # make them whole on every device (item 6 of issue 26).
  from jax.sharding import NamedSharding, PartitionSpec

  split = NamedSharding(mesh, PartitionSpec('data'))
  params = jax.device_put(mlp_params(), split)
  state = train_state.TrainState.create(apply_fn=mlp_apply, params=params, tx=optax.adam(1e-3))
  with pytest.raises(ValueError) as e:
    zerojax.zero_stage(state, stage, mesh=mesh)
  # Split by 8 over their first dimension: 16x64 + 64 + 64x8 + 8 floats, ~1/8 each (bias 8 -> 1).
  now = (16 * 64 // 8 + 64 // 8 + 64 * 8 // 8 + 1) * 4  # 812 B
  whole = (16 * 64 + 64 + 64 * 8 + 8) * 4  # 6,432 B
  assert str(e.value) == (
    f'zerojax.zero_stage(state, {stage}): 4 parameters already rest split over'
    " 'data' (params['dense1']['bias'], params['dense1']['kernel'], params['dense2']['bias'],"
    ' ...), as FSDP lays them out; stage'
    f' {stage} keeps parameters whole on every device, which would raise them from'
    f' {now} B to {whole / 1024:.2f} KiB per device. Use stage 3, which keeps them split and'
    ' gathers them where they are used; or, to hold them whole on purpose, place them'
    ' replicated (jax.device_put(params, NamedSharding(mesh, P()))) first.'
  )
  assert state.params['dense1']['kernel'].sharding == split  # nothing was moved
  # Stage 3 keeps them split; replicated on purpose, stage `stage` takes them.
  state3 = zerojax.zero_stage(state, 3, mesh=mesh)
  assert state3.params['dense1']['kernel'].sharding.spec == PartitionSpec(None, 'data')
  whole_state = state.replace(params=jax.device_put(params, NamedSharding(mesh, PartitionSpec())))
  assert zerojax.zero_stage(whole_state, stage, mesh=mesh).params['dense2']['bias'].shape == (8,)


def test_init_fn_is_traced_once_for_the_layout_and_once_to_run(explicit_mesh):
  """The parameters' shapes are read once (the plan and the state's layout come from them), and
  `create_train_state` traces `init_fn` once more to run it; `abstract_train_state` does not."""

  def counted(traces):
    def init_fn(key):
      traces.append(key)
      return {'w': jax.random.normal(key, (64, 8))}

    return init_fn

  tx = zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=explicit_mesh)
  traces = []
  state = zerojax.create_train_state(counted(traces), jax.random.key(0), tx=tx)
  assert len(traces) == 2
  assert state.params['w'].sharding.spec == jax.P('data', None)
  traces = []
  zerojax.inspect.abstract_train_state(counted(traces), jax.random.key(0), tx=tx)
  assert len(traces) == 1


def test_jit_shardings_of_the_wrapped_state_and_the_mistake_named(explicit_mesh):
  mesh = explicit_mesh
  state = train_state.TrainState.create(
    apply_fn=mlp_apply, params=mlp_params(), tx=optax.adam(1e-2)
  )
  before = jax.tree.map(lambda x: getattr(x, 'sharding', None), state)  # MaxText's recipe
  zstate = zerojax.zero_stage(state, 2, mesh=mesh)
  shardings = zerojax.inspect.jit_shardings(zstate)
  zerojax.inspect.check_jit_shardings(shardings, zstate)  # fits: returns
  assert shardings.opt_state == jax.tree.map(lambda a: a.sharding, zstate.opt_state)
  x, y = shard_batch(mesh, *batch())
  rows = x.sharding
  step = jax.jit(user_step, in_shardings=(shardings, rows, rows), out_shardings=shardings)
  out = step(zstate, x, y)
  assert jax.tree.map(lambda a: a.sharding, out.opt_state) == shardings.opt_state

  with pytest.raises(ValueError) as e:
    zerojax.inspect.check_jit_shardings(before, zstate)
  assert str(e.value) == (
    'in_shardings: these shardings were taken from the train state before zerojax.zero_stage'
    ' wrapped it: its tx is the plain optimizer, a part of the pytree metadata that jit'
    " compares, and its layouts are not the plan's. Take them from the state that is passed:"
    ' in_shardings=zerojax.inspect.jit_shardings(state).'
  )
  whole = jax.tree.map(
    lambda s: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), shardings
  )
  with pytest.raises(ValueError) as e:
    zerojax.inspect.check_jit_shardings(whole, zstate, 'out_shardings')
  assert str(e.value).startswith(
    "out_shardings: these shardings would move state.opt_state[0].mu['dense1']['bias'] (P()"
    " where it is P('data',)),"
  )
  with pytest.raises(ValueError) as e:
    zerojax.inspect.check_jit_shardings(shardings.replace(opt_state=()), zstate)
  assert str(e.value).startswith(
    'in_shardings: these shardings do not have the structure of the state passed (they differ'
    ' at opt_state), so jax.jit refuses them for different pytree metadata.'
  )


@pytest.mark.parametrize('stage', [0, 1, 2])
def test_the_optimizer_line_on_an_fsdp_program(stage, mesh):
  # Flax's examples/gemma splits its parameters over its data axis itself: stage 0 would make
  # their optimizer state whole on every device (7.8x there), without a word.
  import warnings

  from jax.sharding import NamedSharding, PartitionSpec

  params = jax.device_put(mlp_params(), NamedSharding(mesh, PartitionSpec('data')))
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  got = (
    f'zerojax.zero_stage(tx, {stage}): tx.init got 4 parameters already split over'
    " 'data' (params['dense1']['bias'], params['dense1']['kernel'], params['dense2']['bias']"
    ' and 1 more), as FSDP lays them out'
  )
  if stage == 0:
    with pytest.raises(ValueError) as e:
      tx.init(params)
    # Adam's two moments of 16x64 + 64 + 64x8 + 8 floats, whole, and split as the parameters;
    # and its step count (4 bytes).
    whole = 2 * (16 * 64 + 64 + 64 * 8 + 8) * 4 + 4
    split = 2 * (16 * 64 // 8 + 64 // 8 + 64 * 8 // 8 + 8 // 8) * 4 + 4
    assert str(e.value) == (
      f'{got}; stage 0 keeps the optimizer state whole on every device, which would raise it'
      f' from {split / 1024:.2f} KiB (split as the parameters are) to {whole / 1024:.2f} KiB'
      ' per device. Use stage 3, which keeps parameters and state split and gathers the'
      ' parameters where they are used; or, to hold them whole on purpose, place the'
      ' parameters replicated (jax.device_put(params, NamedSharding(mesh, P()))) first.'
    )
  else:
    with pytest.warns(UserWarning) as record:
      state = tx.init(params)
    assert [str(w.message) for w in record] == [
      f'{got}. Stage {stage} splits the optimizer state'
      + (' and the gradients' if stage == 2 else '')
      + " over it and leaves the parameters' layout to the program; on a layout already split"
      ' so, stage 3 is its ZeRO (parameters, gradients and state split, the parameters'
      ' gathered where they are used).'
    ]
    assert record[0].filename == __file__  # the caller's line
    assert not state[0].mu['dense1']['kernel'].sharding.is_fully_replicated
  whole = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    tx.init(whole)  # replicated on purpose: taken as it is
    zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh).init(params)  # stage 3 keeps the split
