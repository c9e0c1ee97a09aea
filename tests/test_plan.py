"""The plan: leaf rules for every kind of optax state, tensor parallelism, printing."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import batch, loss_fn, max_rel_err, mlp_params, plain_run, plan_of, train_tol
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._src import plan as plan_lib
from zerojax._src import rules
from zerojax._src.layouts import ZeroState


def specs(tree):
  return jax.tree.map(lambda s: s.spec, tree)


@pytest.mark.parametrize(
  'shape, expected',
  [
    ((16, 64), P(None, 'data')),  # the largest (64 columns are not lane-aligned anyway)
    ((64, 16), P('data', None)),
    ((64, 64), P('data', None)),  # ties go to the first
    ((12, 40), P(None, 'data')),  # only 40 divides by 8
    ((8,), P('data')),
    ((4, 7), P(None, None)),  # small and indivisible: replicated
    ((), P()),
  ],
)
def test_leaf_rule_picks_largest_divisible_dimension(shape, expected, explicit_mesh):
  rule = rules.leaf_rule(
    shape, jnp.float32, None, mesh=explicit_mesh, axes=('data',), replicate_below_bytes=1 << 18
  )
  assert rule.sharded == expected


@pytest.mark.parametrize(
  'shape, stacked, dim',
  [
    # The 70B decoder's stacked MLP input: 28672 / 256 = 112 columns would
    # unalign TPU's 128 lanes, so the 8192 rows are split instead.
    ((80, 8192, 28672), True, 1),
    ((80, 28672, 8192), True, 1),  # the largest dimension is not the minor one
    # The LM head: 32000 / 256 = 125 columns. Marked as no layer stack, its rows are split;
    # unmarked, its leading dimension could be a layer axis, which lanes never promote.
    ((8192, 32000), False, 0),
    ((8192, 32000), None, 1),
    ((80, 1024, 65536), True, 2),  # 65536 / 256 = 256 columns: aligned, the largest
    ((28672,), None, 0),  # one dimension: nothing else to split
  ],
)
def test_leaf_rule_keeps_the_minor_dimension_lane_aligned(shape, stacked, dim):
  mesh = jax.sharding.AbstractMesh((16, 16), ('x', 'y'))
  rule = rules.leaf_rule(
    shape,
    jnp.bfloat16,
    None,
    mesh=mesh,
    axes=('x', 'y'),
    replicate_below_bytes=1 << 18,
    stacked=stacked,
  )
  assert rule.dim == dim
  assert rule.sharded[dim] == ('x', 'y')


def test_stage_layouts(explicit_mesh):
  params = mlp_params()
  row = P(None, 'data')  # dense1 kernel (16, 64): its 64 is split
  for stage in range(4):
    plan = plan_of(params, optax.adam(1e-3), stage=stage, mesh=explicit_mesh)
    kernel = lambda t: t['dense1']['kernel'].spec
    assert kernel(plan.params) == (row if stage == 3 else P(None, None))
    assert kernel(plan.grads) == (row if stage >= 2 else P(None, None))
    assert plan.opt_state[0].mu['dense1']['kernel'].spec == (row if stage >= 1 else P(None, None))
    assert plan.opt_state[0].count.spec == P()


def test_state_kinds_follow_their_parameter(explicit_mesh):
  params = {'w': jnp.zeros((16, 64)), 'v': jnp.zeros((64, 8)), 'b': jnp.zeros((64,))}
  labels = {'w': 'a', 'v': 'b', 'b': 'b'}
  tx = optax.chain(
    optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    optax.masked(optax.scale_by_rms(), {'w': True, 'v': False, 'b': False}),
    optax.multi_transform({'a': optax.sgd(1.0, momentum=0.9), 'b': optax.adagrad(1.0)}, labels),
  )
  multi = optax.MultiSteps(tx, every_k_schedule=2)
  plan = plan_of(params, multi.gradient_transformation(), stage=1, mesh=explicit_mesh)
  s = plan.opt_state
  # MultiSteps accumulator: shaped like params, split like them.
  assert s.acc_grads['w'].spec == P(None, 'data') and s.acc_grads['v'].spec == P('data', None)
  inject, masked, multi_state = s.inner_opt_state
  # inject_hyperparams: the hyperparameters are replicated scalars.
  assert inject.hyperparams['learning_rate'].spec == P()
  assert inject.inner_state[0].mu['w'].spec == P(None, 'data')
  # masked: only the selected leaves have state.
  assert masked.inner_state.nu['w'].spec == P(None, 'data')
  # multi_transform: each partition's state follows its parameters.
  assert multi_state.inner_states['a'].inner_state[0].trace['w'].spec == P(None, 'data')
  assert multi_state.inner_states['b'].inner_state[0].sum_of_squares['b'].spec == P('data')
  assert s.mini_step.spec == P()


def test_adafactor_factored_statistics(explicit_mesh):
  params = {'w': jnp.zeros((24, 64))}
  plan = plan_of(
    params, optax.adafactor(1e-3, min_dim_size_to_factor=8), stage=1, mesh=explicit_mesh
  )
  factored = plan.opt_state[0]
  # Row and column statistics are not shaped like the parameter: each is split
  # along its own largest divisible dimension.
  assert factored.v_row['w'].spec == P('data')  # (24,)
  assert factored.v_col['w'].spec == P('data')  # (64,)


def test_leaves_not_shaped_like_any_parameter(explicit_mesh):
  plan = plan_of(mlp_params(), optax.lbfgs(memory_size=8), stage=1, mesh=explicit_mesh)
  memory = plan.opt_state[0].diff_params_memory['dense1']['kernel']
  assert memory.spec == P(None, None, 'data')  # (8, 16, 64): the 64


def tp_mesh(kind):
  return jax.make_mesh((4, 2), ('data', 'model'), axis_types=(kind,) * 2)


@pytest.mark.parametrize('kind', [AxisType.Explicit, AxisType.Auto])
def test_tensor_parallel_sharding_is_kept(kind):
  mesh = tp_mesh(kind)
  params = mlp_params()
  tp = {
    'dense1': {'kernel': P(None, 'model'), 'bias': P('model')},
    'dense2': {'kernel': P('model', None), 'bias': P()},
  }
  params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), tp))
  plan = plan_of(params, optax.adam(1e-3), stage=3, mesh=mesh)
  # The ZeRO axis goes to a free dimension; 'model' stays where it was.
  assert specs(plan.params)['dense1']['kernel'] == P('data', 'model')
  assert specs(plan.params)['dense2']['kernel'] == P('model', 'data')
  # The bias's one dimension is taken by 'model': ZeRO splits it further (64 = 2 x 4 x 8).
  assert specs(plan.opt_state)[0].mu['dense1']['bias'] == P(('model', 'data'))
  assert specs(plan.params)['dense1']['bias'] == P(('model', 'data'))
  assert plan.num_shards == 4


def test_tensor_parallel_training_matches_optax():
  mesh = tp_mesh(AxisType.Auto)
  tp = {
    'dense1': {'kernel': P(None, 'model'), 'bias': P('model')},
    'dense2': {'kernel': P('model', None), 'bias': P()},
  }
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), tp)
  params = jax.device_put(mlp_params(), shardings)
  # Traced on Auto axes the arrays carry no layout: the optimizer is told it.
  tx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh, param_specs=tp)
  state = tx.init(params)
  plan = zerojax.plan_for(tx, params)
  params = jax.device_put(params, plan.params)
  x, y = jax.device_put(batch(), NamedSharding(mesh, P('data')))

  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: loss_fn(zerojax.gather(p, plan), x, y))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(10):
    params, state = step(params, state)
  assert jax.tree.map(lambda a: a.sharding, params) == plan.params
  assert max_rel_err(params, plain_run(optax.adam(1e-2), steps=10)) <= train_tol(10)


def test_axis_tuple_partitions_over_both_axes():
  mesh = jax.make_mesh((2, 4), ('replica', 'data'))
  plan = plan_of(mlp_params(), optax.adam(1e-3), stage=3, mesh=mesh, axis=('replica', 'data'))
  assert plan.num_shards == 8
  assert specs(plan.params)['dense1']['kernel'] == P(None, ('replica', 'data'))
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis=('replica', 'data'))
  state = tx.init(mlp_params())
  mu = state[0].mu['dense1']['kernel']
  assert {s.data.shape for s in mu.addressable_shards} == {(16, 8)}


def test_param_specs_argument_overrides(explicit_mesh):
  mesh = tp_mesh(AxisType.Explicit)
  plan = plan_of(
    mlp_params(),
    optax.adam(1e-3),
    stage=1,
    mesh=mesh,
    param_specs={'dense1': P(None, 'model'), 'dense2': None},
  )
  assert specs(plan.params)['dense1']['kernel'] == P(None, 'model')
  assert specs(plan.opt_state)[0].mu['dense1']['kernel'] == P('data', 'model')
  assert specs(plan.opt_state)[0].mu['dense2']['kernel'] == P('data', None)


def test_printed_plan(explicit_mesh):
  params = {'w': jnp.zeros((64, 16)), 'b': jnp.zeros((3,))}
  plan = plan_of(params, optax.adam(1e-3), stage=2, mesh=explicit_mesh)
  text = str(plan)
  lines = text.splitlines()
  assert lines[0] == "ZeroPlan: stage 2 over mesh axis 'data' (8 shards) of mesh {'data': 8}"
  assert lines[1].split() == [
    'group',
    'path',
    'shape',
    'dtype',
    'spec',
    'at',
    'rest',
    'grads',
    'spec',
    'bytes/device',
  ]
  row = next(line for line in lines if line.startswith('params') and "['w']" in line)
  assert row.split() == [
    'params',
    "['w']",
    '(64,',
    '16)',
    'float32',
    'P(None,',
    'None)',
    "P('data',",
    'None)',
    '4,096',
  ]
  row = next(line for line in lines if "[0].mu['w']" in line)
  assert row.split()[-1] == '512'
  sizes = plan.bytes_per_device()
  assert sizes == {
    'params': 64 * 16 * 4 + 12,
    'grads': 64 * 16 * 4 // 8 + 12,
    'opt_state': 2 * (512 + 12) + 4,
    'host': 0,  # nothing offloaded
  }
  assert 'per device: params 4.01 KiB, grads 524 B, opt_state 1.03 KiB; total 5.55 KiB' in text
  # Where stages 1 and 2 differ, and where they compile alike.
  assert (
    'gradients: split where they are kept between calls (accumulation across steps); inside'
    ' one jitted step (gradients taken and applied at once) stages 1 and 2 compile alike.'
  ) in lines
  # The axis's size, then how many leaves it holds whole (item 7: not a count posing as a size).
  assert "replicated over 'data' (8 devices): 4 leaves" in lines
  assert (
    "  params['b']: no free dimension of (3,) divides by 8 (small: 12 B < replicate_below_bytes=262144)"
    in lines
  )
  assert '  opt_state[0].count: scalar' in lines


@pytest.mark.parametrize('stage', [1, 3])
def test_plan_follows_the_dtype_it_is_asked_about(stage, mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  fp32 = mlp_params()
  tx.init(fp32)
  bf16 = zerojax.cast(fp32, jnp.bfloat16)
  psi = sum(x.size for x in jax.tree.leaves(fp32))
  got = zerojax.plan_for(tx, bf16).bytes_per_device()
  want = plan_of(bf16, optax.adam(1e-3), stage=stage, mesh=mesh).bytes_per_device()
  assert got == want
  # bf16 parameters: 2 bytes each (whole, or split 8 ways at stage 3), not fp32's 4.
  assert got['params'] == (2 * psi if stage < 3 else 2 * psi // 8)
  assert zerojax.plan_for(tx, fp32).bytes_per_device()['params'] == 2 * got['params']


def test_plan_follows_the_tensor_parallel_layout_of_the_leaves():
  mesh = jax.make_mesh((4, 2), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  tx = zerojax.zero_stage(optax.sgd(1e-3), 3, mesh=mesh)
  params = {'w': jnp.zeros((64, 32))}
  tx.init(params)
  tp = {'w': jax.device_put(params['w'], NamedSharding(mesh, P(None, 'model')))}
  assert zerojax.plan_for(tx, params).params['w'].spec == P('data', None)
  assert zerojax.plan_for(tx, tp).params['w'].spec == P('data', 'model')


TP_LAYOUTS = {'rows': P('model', None), 'cols': P(None, 'model')}


def _traced_plans(mesh, order):
  """The parameter layouts each traced step of a train state gets, for states of one structure
  placed in each tensor-parallel layout of `order`, stepped in that order."""
  from flax.training import train_state

  seen = {}
  for name in order:
    params = jax.device_put({'w': jnp.ones((64, 32))}, NamedSharding(mesh, TP_LAYOUTS[name]))
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    state = zerojax.zero_stage(state, 3, mesh=mesh)

    @jax.jit
    def step(state, name=name):
      seen[name] = zerojax.plan_for(state.tx, state.params).params['w'].spec
      return state.apply_gradients(grads=state.params)

    state = step(state)
    assert state.params['w'].sharding.spec == seen[name]
  return seen


@pytest.mark.parametrize('kind', [AxisType.Explicit, AxisType.Auto])
def test_a_traced_plan_does_not_depend_on_what_was_traced_before(kind):
  """Two layouts of one tree: each traced step gets its own state's plan, in either order."""
  mesh = tp_mesh(kind)
  first = _traced_plans(mesh, ['rows', 'cols'])
  second = _traced_plans(mesh, ['cols', 'rows'])
  assert first == second == {'rows': P('model', 'data'), 'cols': P('data', 'model')}


def test_traced_parameters_whose_layout_cannot_be_read_are_refused():
  """On Auto axes a traced array carries no layout: with a tensor-parallel axis in the mesh
  and no param_specs, the plan is not guessed. What tx.init saw placed travels in the state
  it returns (`layouts.ZeroState`), so a traced update reads it from there."""
  mesh = tp_mesh(AxisType.Auto)
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh)
  params = jax.device_put({'w': jnp.ones((64, 32))}, NamedSharding(mesh, TP_LAYOUTS['cols']))
  assert zerojax.plan_for(tx, params).params['w'].spec == P('data', 'model')
  state = tx.init(params)
  assert isinstance(state, ZeroState)
  assert state.layouts.specs == (TP_LAYOUTS['cols'],)
  updates, new_state = jax.jit(tx.update)(params, state, params)
  assert updates['w'].sharding.spec == P('data', 'model')
  assert new_state.layouts == state.layouts
  # An init traced on Auto axes has nothing to record: refused, with the fixes.
  with pytest.raises(ValueError) as e:
    jax.jit(tx.init)(params)
  assert str(e.value) == (
    'zerojax: these parameters are traced on Auto mesh axes, where arrays carry no layout, and'
    " the mesh splits them over ['model'] too (tensor parallelism), so where each is split"
    ' cannot be read. Give tx.init the placed parameters outside jit'
    ' (nnx.Optimizer(model, tx, wrt=nnx.Param) does), and the state it returns carries their'
    ' layouts to every update; or give them to the optimizer: zero_stage(...,'
    ' param_specs=zerojax.specs_of(params)) on the placed parameters (arrays,'
    ' nnx.state(model, nnx.Param), or a boxed linen tree); or build the state with'
    ' zerojax.create_train_state or zero_stage(train_state, ...), which record them in'
    ' state.tx.'
  )
  # The fix the message names, verbatim.
  told = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh, param_specs=zerojax.specs_of(params))
  updates, _ = jax.jit(told.update)(params, jax.jit(told.init)(params), params)
  assert updates['w'].sharding.spec == P('data', 'model')


def test_plan_cache_is_bounded(explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh)
  config = zerojax.config_of(tx)
  for rows in range(8, 8 * 40, 8):
    zerojax.plan_for(tx, {'w': jax.ShapeDtypeStruct((rows, 8), jnp.float32)})
  assert len(plan_lib._PLANS[config]) <= plan_lib.PLAN_CACHE_SIZE == 16
  # The newest plans are kept.
  last = {'w': jax.ShapeDtypeStruct((8 * 39, 8), jnp.float32)}
  assert zerojax.plan_for(tx, last) is zerojax.plan_for(tx, last)


def test_a_config_refuses_to_plan_with_the_new_spelling(explicit_mesh):
  """`zerojax.config_of(tx).plan(params)`, as code written before the plan left the config
  calls it: refused, naming the call that gives the plan now."""
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=explicit_mesh)
  params = {'w': jax.ShapeDtypeStruct((64, 8), jnp.float32)}
  with pytest.raises(AttributeError) as err:
    zerojax.config_of(tx).plan(params)
  assert str(err.value) == (
    'ZeroConfig.plan(params) moved: a ZeroConfig holds only what the optimizer was built with.'
    ' Call zerojax.plan_for(tx, params) on the optimizer instead.'
  )
  assert zerojax.plan_for(tx, params).grads['w'].spec == jax.P('data', None)
