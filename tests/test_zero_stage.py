"""Every optimizer of optax and optax.contrib under zero_stage equals plain optax.

The list is discovered from the installed optax (`_optimizers.py`), in the
optimizer form (`zero_stage(tx)`) and the TrainState form (`zero_stage(state)`),
at stages 1-3 on an Explicit mesh and at stage 3 on an Auto one.
"""

import warnings

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
  plain_run,
  plain_steps,
  run_steps,
  shard_batch,
  train_tol,
  zero_run,
  zero_steps,
)
from _optimizers import OPTIMIZERS
from flax.training import train_state

import zerojax

STEPS = 3


def test_discovery_found_the_optimizers_people_use():
  # Not the list under test (that is everything discovered), a guard that the
  # discovery itself works.
  for name in ('optax.adam', 'optax.sgd', 'optax.lbfgs', 'optax.noisy_sgd', 'optax.polyak_sgd'):
    assert name in OPTIMIZERS
  assert sum(name.startswith('optax.contrib.') for name in OPTIMIZERS) >= 10
  assert OPTIMIZERS['optax.lbfgs'][1] and not OPTIMIZERS['optax.adam'][1]


def _close(got, want):
  # The MLP's rounding (tests/_models.py), STEPS steps of it.
  err = max_rel_err(got, want)
  assert np.isfinite(err) and err <= train_tol(STEPS), err


def _train_state_steps(make, extra, mesh, stage):
  """The TrainState form: the state, the batch, one step of it and the plan."""
  x, y = shard_batch(mesh, *batch())
  state = train_state.TrainState.create(apply_fn=None, params=mlp_params(), tx=make())
  state = zerojax.zero_stage(state, stage, mesh=mesh)
  plan = zerojax.plan_for(state.tx, state.params)

  def step(state, x, y):
    loss = lambda p: loss_fn(zerojax.gather(p, plan), x, y)
    value, grads = jax.value_and_grad(loss)(state.params)
    if not extra:
      return state.apply_gradients(grads=grads)
    # apply_gradients passes no extra args: line searches call the optimizer.
    updates, opt_state = state.tx.update(
      grads, state.opt_state, state.params, value=value, grad=grads, value_fn=loss
    )
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

  return state, (x, y), step, plan


def _train_state_run(make, extra, mesh, stage):
  state, args, step, plan = _train_state_steps(make, extra, mesh, stage)
  return run_steps(state, args, step, STEPS), plan


# Every optimizer's run in one form is compiled with the others' as one program (a jit of the
# list of their steps): a third less compiling than a program each (6.8 s against 10.6 s for 47
# optimizers' stage-3 steps, measured on a 2-core machine). An optimizer whose carry
# changes type over a step (optax's zoom line search starts from weakly typed numbers) would
# have the whole program compiled again for the second step, so it runs alone, as does one
# whose set-up or step fails to trace, and every optimizer of a form whose shared program fails
# to compile or run: each test then meets its own error.
_TOGETHER: dict = {}  # (form, mesh axis type, stage) -> {optimizer name: final carry}


def _steps(form, name, mesh, stage):
  make, extra = OPTIMIZERS[name]
  if form == 'plain':
    return (*plain_steps(make(), extra=extra), None)
  if form == 'zero':
    return zero_steps(make(), mesh, stage, extra=extra)
  return _train_state_steps(make, extra, mesh, stage)


def _keeps_its_type(carry, args, step) -> bool:
  typed = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype, a.weak_type), tree)
  out = jax.eval_shape(step, carry, *args)
  return typed(out) == typed(jax.tree.map(jax.typeof, carry))


def _run(form, name, mesh=None, stage=0):
  """The final carry and plan of `name`'s STEPS steps in `form` ('plain', 'zero', 'state')."""
  key = (form, None if mesh is None else mesh.axis_types[0], stage)
  if key not in _TOGETHER:
    setups = {}
    for n in sorted(OPTIMIZERS):
      try:
        setup = _steps(form, n, mesh, stage)
        if _keeps_its_type(*setup[:3]):
          setups[n] = setup
      except Exception:  # set up again alone, in its own test, where it fails
        pass
    steps = [s[2] for s in setups.values()]
    together = jax.jit(lambda carries, args: [f(c, *a) for f, c, a in zip(steps, carries, args)])
    carries, args = [s[0] for s in setups.values()], [s[1] for s in setups.values()]
    try:
      for _ in range(STEPS):
        carries = together(carries, args)
      _TOGETHER[key] = dict(zip(setups, zip(carries, [s[3] for s in setups.values()])))
    except Exception:  # each optimizer then runs alone, and fails in its own test
      _TOGETHER[key] = {}
  if name in _TOGETHER[key]:
    return _TOGETHER[key][name]
  carry, args, step, plan = _steps(form, name, mesh, stage)
  return run_steps(carry, args, step, STEPS), plan


# One test per optimizer and mesh, sharing one plain-optax reference. On an
# Explicit mesh (JAX's default): the optimizer form at stages 1 and 3 (every
# layout an optimizer sees: sharded state, whole or sharded parameters) and the
# TrainState form at stage 2. On an Auto mesh, where the compiler places the
# layouts, the optimizer form at stage 3 (both sharded). Hand-picked optimizers
# and wrappers at every stage on both kinds of mesh are in test_transform.py.
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_equals_plain_optax_in_both_forms(name, mesh):
  want = _run('plain', name)[0][0]  # one device, no mesh: the same for Explicit and Auto
  explicit = mesh.axis_types[0] == jax.sharding.AxisType.Explicit
  for stage in (1, 3) if explicit else (3,):
    (params, opt_state), plan = _run('zero', name, mesh, stage)
    _close(params, want)
    assert jax.tree.map(lambda a: a.sharding, opt_state) == plan.opt_state
  if explicit:
    state, plan = _run('state', name, mesh, 2)
    _close(state.params, want)
    assert jax.tree.map(lambda a: a.sharding, state.opt_state) == plan.opt_state


@pytest.mark.parametrize('stage', [0, 3])
def test_multisteps_in_a_train_state(stage, mesh):
  make = lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  state, plan = _train_state_run(make, False, mesh, stage)
  _close(state.params, plain_run(make(), STEPS))
  # The accumulator is optimizer state: sharded from stage 1.
  acc = state.opt_state.acc_grads['dense1']['kernel']
  assert acc.sharding == plan.opt_state.acc_grads['dense1']['kernel']


def _keyed_noise(scale):
  """A transformation whose state holds typed PRNG keys in nested places."""

  def init(params):
    keys = jax.random.split(jax.random.key(0), 8)
    return {'one': jax.random.key(1), 'nested': [(keys, jnp.zeros(()))]}

  def update(updates, state, params=None):
    del params
    key, sub = jax.random.split(state['one'])
    noise = jax.tree.map(lambda u: scale * jax.random.normal(sub, u.shape), updates)
    keys = jax.vmap(lambda k: jax.random.split(k)[0])(state['nested'][0][0])
    new = {'one': key, 'nested': [(keys, state['nested'][0][1] + 1)]}
    return jax.tree.map(jnp.add, updates, noise), new

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_typed_keys_anywhere_in_the_state(stage, mesh):
  make = lambda: optax.chain(_keyed_noise(1e-3), optax.sgd(1e-2))
  params, opt_state, plan = zero_run(make(), mesh, stage, STEPS)
  _close(params, plain_run(make(), STEPS))
  keys = opt_state[0]['nested'][0][0]
  assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
  assert keys.sharding.is_equivalent_to(plan.opt_state[0]['nested'][0][0], keys.ndim)
  rows = [r for r in plan.rows if r.group == 'opt_state' and 'nested' in r.path]
  assert rows[0].reason == ('PRNG key (kept whole)' if stage else None)


@pytest.mark.parametrize('stage', [1, 3])
def test_zero_over_an_axis_of_one_device_warns(stage):
  # lm1b_nnx's default mesh: 'data' of size 1, so ZeRO over it splits nothing.
  mesh = jax.make_mesh((1, 8, 1), ('data', 'fsdp', 'tensor'))
  with pytest.warns(UserWarning) as record:
    zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  assert [str(w.message) for w in record] == [
    f"zerojax.zero_stage: ZeRO stage {stage} over 'data' (size 1) splits nothing: that is one"
    ' device, so every device keeps whole parameters, gradients and optimizer state, as at'
    " stage 0, and they stay replicated over 'fsdp' (size 8) (unless a layout splits them"
    " there). Name an axis of more than one device: axis='fsdp' (or axis=('data', 'fsdp')),"
    " or make 'data' larger in the mesh."
  ]
  assert record[0].filename == __file__  # the user's line, not zerojax's
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis=('data', 'fsdp'))
    zerojax.zero_stage(optax.adam(1e-3), 0, mesh=mesh)  # stage 0 splits nothing by design
    zerojax.zero_stage(optax.adam(1e-3), stage, mesh=jax.make_mesh((1,), ('data',)))  # one chip
