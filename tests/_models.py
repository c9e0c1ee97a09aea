"""Small models and data shared by the tests (sized so 8 fake copies are cheap)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tolerance import reordered
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import hlo as hlo_lib

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


def plain_steps(tx: optax.GradientTransformation, *, extra: bool = False):
  """Plain optax on one device: the first carry (params, state), the step's other arguments
  (none) and the step, `step(carry, *args) -> carry`."""
  params = mlp_params()
  x, y = batch()
  tx = optax.with_extra_args_support(tx)  # extra args reach only optimizers that take them

  def step(carry):
    params, state = carry
    value, grads = jax.value_and_grad(loss_fn)(params, x, y)
    kwargs = dict(value=value, grad=grads, value_fn=lambda p: loss_fn(p, x, y)) if extra else {}
    updates, state = tx.update(grads, state, params, **kwargs)
    return optax.apply_updates(params, updates), state

  return (params, tx.init(params)), (), step


def zero_steps(tx, mesh, stage: int, *, extra: bool = False):
  """The same under `zero_stage`: the first carry (params, opt_state) placed as its plan
  says, the step's other arguments (the batch), the step and the plan."""
  ztx = zerojax.zero_stage(tx, stage, mesh=mesh)
  params = mlp_params()
  opt_state = ztx.init(params)
  plan = zerojax.plan_for(ztx, params)
  params = jax.device_put(params, plan.params)
  x, y = shard_batch(mesh, *batch())

  def step(carry, x, y):
    params, opt_state = carry

    def loss(p):
      return loss_fn(zerojax.gather(p, plan), x, y)

    value, grads = jax.value_and_grad(loss)(params)
    kwargs = dict(value=value, grad=grads, value_fn=loss) if extra else {}
    updates, opt_state = ztx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state

  return (params, opt_state), (x, y), step, plan


def run_steps(carry, args, step, steps: int):
  """`step(carry, *args)` applied `steps` times, jitted."""
  step = jax.jit(step)
  for _ in range(steps):
    carry = step(carry, *args)
  return carry


def plain_run(tx: optax.GradientTransformation, steps: int, *, extra: bool = False):
  """Reference: plain optax on one device."""
  return run_steps(*plain_steps(tx, extra=extra), steps)[0]


def zero_run(tx, mesh, stage: int, steps: int, *, extra: bool = False):
  """The same training under `zero_stage`; returns params, opt_state and the plan."""
  carry, args, step, plan = zero_steps(tx, mesh, stage, extra=extra)
  params, opt_state = run_steps(carry, args, step, steps)
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


# -- two d x d layers, gathered up front: bytes and collectives against the formulas ---------

TWO_LAYER_N = 8
D = TWO_LAYER_D = 256  # two 256x256 matrices and two biases: every leaf divides by 8
TWO_LAYER_PSI = 2 * D * D + 2 * D


def make_init(d):
  """Two d x d layers with biases."""

  def init_fn(key):
    k1, k2 = jax.random.split(key)
    return {
      'w1': jax.random.normal(k1, (d, d)),
      'b1': jnp.zeros((d,)),
      'w2': jax.random.normal(k2, (d, d)),
      'b2': jnp.zeros((d,)),
    }

  return init_fn


init_fn = make_init(D)


def step(state, x):
  plan = zerojax.plan_for(state.tx, state.params)

  def loss(p):
    p = zerojax.gather(p, plan)
    return jnp.mean((jnp.tanh(x @ p['w1'] + p['b1']) @ p['w2'] + p['b2']) ** 2)

  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def compile_step(mesh, stage, batch=64):
  state = zerojax.inspect.abstract_train_state(
    init_fn, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  )
  x = jax.ShapeDtypeStruct(
    (batch, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )
  return jax.jit(step).lower(state, x).compile(), batch * D * 4 // TWO_LAYER_N


SCALARS = 4 + 4  # TrainState.step and Adam's count, int32 each


DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count='


def child_env(drop=()) -> dict:
  """This process's environment for a child process that fakes its own devices: XLA_FLAGS
  without the suite's 8-device flag, the rest of it kept (the CPU code-generation level
  conftest.py sets); the variables named in `drop` left out."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  flags = [f for f in env.pop('XLA_FLAGS', '').split() if not f.startswith(DEVICE_COUNT_FLAG)]
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  return env


def run_cli(*args, timeout=600, drop=()):
  """`python -m zerojax ARGS`, with the tests' folder importable (models named module:function),
  in `child_env(drop)`."""
  env = child_env(drop)
  env['PYTHONPATH'] = os.pathsep.join(
    [os.path.dirname(os.path.abspath(__file__))] + env.get('PYTHONPATH', '').split(os.pathsep)
  )
  return subprocess.run(
    [sys.executable, '-m', 'zerojax', *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
  )


def mp_step(state, x):
  plan = zerojax.plan_for(state.tx, state.params)

  def loss(p):
    p = zerojax.gather(p, plan)
    h = jnp.tanh(x.astype(p['w1'].dtype) @ p['w1'] + p['b1'])
    return jnp.mean((h @ p['w2'] + p['b2']).astype(jnp.float32) ** 2)

  return state.apply_gradients(grads=jax.grad(loss)(state.params))


def collective_ops(text, kind):
  """(result dtype, result bytes) of each `kind` collective in the HLO."""
  out = []
  for line in text.splitlines():
    found = hlo_lib.collective(line)
    if found and found[0] == kind:
      shape = hlo_lib.SHAPE.search(found[2])
      out.append((shape.group(1), hlo_lib.type_bytes(found[2])))
  return out


# -- NNX: a residual block, and a stack of them scanned with per-layer gathers -----------


class Block(nnx.Module):
  def __init__(self, d, rngs):
    self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
    self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(jnp.tanh(self.fc1(x)))


class ScannedNNX(nnx.Module):
  def __init__(self, d, n_layers, rngs, zero=None):
    self.zero = zero  # the optimizer from zerojax.zero_stage, or None: no gathers

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(d, rngs)

    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.remat
    def layer(block, x):
      if self.zero is not None:
        block = zerojax.nnx.gathered(block, self.zero)
      return block(x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return layer(block, x)

    return run(x, self.blocks)


# ScannedNNX(32, 2) on 16 rows: each result's chain of sums is the rows and two
# blocks of 32- and 128-wide contractions.
SCANNED_TERMS = 16 + 2 * (32 + 128)


def nnx_train(model, tx, x, steps=5):
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss

  for _ in range(steps):
    step(model, opt)
  return model, opt
