"""Small models and data shared by the tests (sized so 8 fake copies are cheap)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tolerance import reordered
from jax.sharding import NamedSharding, PartitionSpec

import zerojax

# Every dimension divides by 8, so every leaf can be sharded.
SHAPES = {
  'dense1': {'kernel': (16, 64), 'bias': (64,)},
  'dense2': {'kernel': (64, 8), 'bias': (8,)},
}
BATCH = 32
# The longest chain of float32 additions behind one of the MLP's outputs, loss
# or gradient entry: the batch's rows, and the contractions over 16 inputs, 64
# hidden units and 8 outputs. zerojax sums them in another order (per device,
# then across devices), so results agree to `reordered(MLP_TERMS)`
# (tests/_tolerance.py), and after `steps` optimizer steps to `train_tol(steps)`.
MLP_TERMS = BATCH + 16 + 64 + 8
GRAD_TOL = reordered(MLP_TERMS)


def train_tol(steps: int) -> float:
  """Parameters after `steps` steps, each step's rounding carried into the next."""
  return reordered(MLP_TERMS, steps=steps)


def mlp_params(seed: int = 0):
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    treedef, [0.3 * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, leaves)]
  )


def mlp_apply(params, x):
  h = jnp.tanh(x @ params['dense1']['kernel'] + params['dense1']['bias'])
  return h @ params['dense2']['kernel'] + params['dense2']['bias']


def batch(seed: int = 1):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (BATCH, 16)), jax.random.normal(ky, (BATCH, 8))


def loss_fn(params, x, y):
  return jnp.mean((mlp_apply(params, x) - y) ** 2)


def shard_batch(mesh, *arrays):
  return jax.device_put(arrays, NamedSharding(mesh, PartitionSpec('data')))


def plain_run(tx: optax.GradientTransformation, steps: int, *, extra: bool = False):
  """Reference: plain optax on one device."""
  params = mlp_params()
  x, y = batch()
  tx = optax.with_extra_args_support(tx)  # extra args reach only optimizers that take them
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss_fn)(params, x, y)
    kwargs = dict(value=value, grad=grads, value_fn=lambda p: loss_fn(p, x, y)) if extra else {}
    updates, state = tx.update(grads, state, params, **kwargs)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params


def zero_run(tx, mesh, stage: int, steps: int, *, extra: bool = False):
  """The same training under `zero_stage`; returns params, opt_state and the plan."""
  ztx = zerojax.zero_stage(tx, stage, mesh=mesh)
  params = mlp_params()
  opt_state = ztx.init(params)
  plan = zerojax.plan_for(ztx, params)
  params = jax.device_put(params, plan.params)
  x, y = shard_batch(mesh, *batch())

  @jax.jit
  def step(params, opt_state, x, y):
    def loss(p):
      return loss_fn(zerojax.gather(p, plan), x, y)

    value, grads = jax.value_and_grad(loss)(params)
    kwargs = dict(value=value, grad=grads, value_fn=loss) if extra else {}
    updates, opt_state = ztx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(steps):
    params, opt_state = step(params, opt_state, x, y)
  return params, opt_state, plan


def max_rel_err(a, b) -> float:
  errs = jax.tree.map(
    lambda u, v: float(
      np.linalg.norm(np.asarray(u) - np.asarray(v)) / max(np.linalg.norm(np.asarray(v)), 1e-30)
    ),
    a,
    b,
  )
  return max(jax.tree.leaves(errs))


def plan_of(params, tx, *, stage, **options):
  """The plan `zero_stage(tx, stage, **options)` makes for `params`."""
  return zerojax.plan_for(zerojax.zero_stage(tx, stage, **options), params)
