"""Flax's lm1b_nnx state recipe (shared by MaxText-derived NNX programs) with the optimizer line
alone: a flax `TrainState` holding `nnx.split(model, nnx.Param)`'s `nnx.State`, a 3-axis
('data', 'fsdp', 'tensor') Auto mesh, and every layout read back from Flax's partitioning
metadata (`nnx.get_partition_spec`, `nnx.get_named_sharding`) for the jitted step's shardings.

The model is lm1b's shape in small (an embedding, pre-norm MLP blocks, an output projection, each
weight annotated with mesh axes as lm1b's rules give them); the step is lm1b's: the loss of
`nnx.merge(state.graphdef, params)`, `jax.value_and_grad`, `state.apply_gradients`.
"""

import jax
import numpy as np
import optax
import pytest
from _tolerance import reordered
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import zerojax

# lm1b's rules: the embedding dimension over 'fsdp', the MLP and vocabulary over 'tensor'.
RULES = {'embed': 'fsdp', 'mlp': 'tensor', 'vocab': 'tensor'}
VOCAB, D, H = 32, 16, 64


def _axes(*names):
  return tuple(RULES[n] for n in names)


def _init(init, *names):
  return nnx.with_partitioning(init, _axes(*names))


class _Block(nnx.Module):
  def __init__(self, rngs):
    ones, zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()
    xavier = nnx.initializers.xavier_uniform()
    self.norm = nnx.LayerNorm(
      D, scale_init=_init(ones, 'embed'), bias_init=_init(zeros, 'embed'), rngs=rngs
    )
    self.up = nnx.Linear(
      D, H, kernel_init=_init(xavier, 'embed', 'mlp'), bias_init=_init(zeros, 'mlp'), rngs=rngs
    )
    self.down = nnx.Linear(
      H, D, kernel_init=_init(xavier, 'mlp', 'embed'), bias_init=_init(zeros, 'embed'), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class _LM(nnx.Module):
  def __init__(self, rngs):
    normal = nnx.initializers.normal(1.0)
    self.embed = nnx.Embed(VOCAB, D, embedding_init=_init(normal, 'vocab', 'embed'), rngs=rngs)
    self.blocks = nnx.List([_Block(rngs), _Block(rngs)])
    self.logits = nnx.Linear(
      D,
      VOCAB,
      kernel_init=_init(nnx.initializers.xavier_uniform(), 'embed', 'vocab'),
      bias_init=_init(nnx.initializers.zeros_init(), 'vocab'),
      rngs=rngs,
    )

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.logits(x)


class TrainState(train_state.TrainState):
  graphdef: nnx.GraphDef


def _setup(tx, mesh):
  """lm1b's `setup_initial_state`, on `jax.set_mesh` (Flax creates annotated Variables placed)."""
  with jax.set_mesh(mesh):
    graphdef, params = nnx.split(_LM(nnx.Rngs(0)), nnx.Param)
    state = TrainState.create(apply_fn=graphdef.apply, params=params, tx=tx, graphdef=graphdef)
    state = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
  return state, nnx.get_named_sharding(state, mesh)


def _train_step(state, tokens, gather_with=None):
  def loss_fn(params):
    if gather_with is not None:
      params = zerojax.gather(params, gather_with)
    logits = nnx.merge(state.graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def _run(tx, mesh, steps=3, gather=False):
  state, shardings = _setup(tx, mesh)
  data = NamedSharding(mesh, PartitionSpec('data'))
  step = jax.jit(
    lambda s, t: _train_step(s, t, tx if gather else None),
    in_shardings=(shardings, data),
    out_shardings=(shardings, None),
    donate_argnums=0,
  )
  tokens = jax.device_put(jax.random.randint(jax.random.key(1), (16, 9), 0, VOCAB), data)
  losses = []
  for _ in range(steps):
    state, loss = step(state, tokens)
    losses.append(float(loss))
  return state, np.array(losses)


def _per_device(tree):
  """Bytes one device holds of `tree`'s arrays, scalars left out."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if x.ndim)


MESHES = [(8, 1, 1), (2, 2, 2), (4, 1, 2)]
# Three AdamW steps of a model whose longest chain of sums is the batch's tokens and 64-wide
# contractions: zerojax sums in another order.
TOL = reordered(16 * 8 + 2 * (D + H) + D, steps=3)


@pytest.fixture(scope='module')
def plain():
  """The program without zerojax on each mesh: its losses, and its state's bytes per device."""
  out = {}
  for shape in MESHES:
    mesh = jax.make_mesh(shape, ('data', 'fsdp', 'tensor'), axis_types=(AxisType.Auto,) * 3)
    state, losses = _run(optax.adamw(1e-2), mesh)
    out[shape] = losses, _per_device(state.opt_state), _per_device(state.params)
  return out


@pytest.mark.parametrize('shape', MESHES, ids=lambda s: 'x'.join(map(str, s)))
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_the_optimizer_line_alone_trains_lm1b_recipe_split(stage, shape, plain):
  mesh = jax.make_mesh(shape, ('data', 'fsdp', 'tensor'), axis_types=(AxisType.Auto,) * 3)
  tx = zerojax.zero_stage(optax.adamw(1e-2), stage, mesh=mesh, axis='data')
  with pytest.warns(UserWarning) if stage == 3 else _nothing():
    state, losses = _run(tx, mesh)
  losses_0, state_bytes, param_bytes = plain[shape]
  n = shape[0]
  np.testing.assert_allclose(losses, losses_0, rtol=TOL)
  # The optimizer state at rest: 1/N of the program's own; the parameters 1/N at stage 3.
  assert _per_device(state.opt_state) * n == state_bytes
  assert _per_device(state.params) * (n if stage == 3 else 1) == param_bytes
  # The state's layout reads the same through Flax's metadata and through the arrays.
  specs = jax.tree.leaves(nnx.get_partition_spec(state.opt_state))
  arrays = jax.tree.leaves(state.opt_state)
  assert len(specs) == len(arrays)
  for spec, x in zip(specs, arrays):
    assert x.sharding.spec == PartitionSpec(*spec) or (x.ndim == 0 and not any(spec))


def test_gather_with_the_optimizer_works_inside_the_step():
  """`zerojax.gather(params, tx)` in lm1b's loss, traced on the Auto mesh: read from the
  Variables' metadata, as `gather(params, zerojax.plan_for(tx, params))` would be."""
  mesh = jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'), axis_types=(AxisType.Auto,) * 3)
  tx = zerojax.zero_stage(optax.adamw(1e-2), 3, mesh=mesh, axis='data')
  with pytest.warns(UserWarning, match='whole over the ZeRO axes'):
    _, gathered = _run(tx, mesh, gather=True)
  with pytest.warns(UserWarning, match='whole over the ZeRO axes'):
    _, direct = _run(zerojax.zero_stage(optax.adamw(1e-2), 3, mesh=mesh, axis='data'), mesh)
  np.testing.assert_allclose(gathered, direct, rtol=TOL)


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
