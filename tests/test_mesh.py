"""Several mesh axes: ZeRO over two axes, hierarchical partitioning (hpZ), tensor parallelism."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import reordered
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import collectives

D, HEADS, T, B = 64, 4, 8, 16
RULES = (('embed', None), ('heads', 'model'), ('mlp', 'model'))
# The key projection's bias gets gradients that are zero up to rounding (softmax ignores a
# shift of all scores); Adam's default eps would turn that noise, summed in another order on
# each mesh, into full-size steps. A larger eps keeps the comparison about ZeRO.
TX = optax.adam(1e-2, eps=1e-3)


def dense(features, names, name):
  return nn.Dense(
    features,
    name=name,
    kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.05), names),
    bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.05), names[1:]),
  )


class Block(nn.Module):
  """A GPT block whose attention heads and MLP are split over 'model' (Megatron style)."""

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    h = nn.LayerNorm(name='ln1')(x)
    qkv = dense(3 * d, ('embed', 'heads'), 'qkv')(h).reshape(b, t, 3, HEADS, d // HEADS)
    attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    x = x + dense(d, ('heads', 'embed'), 'out')(attn.reshape(b, t, d))
    h = dense(4 * d, ('embed', 'mlp'), 'up')(nn.LayerNorm(name='ln2')(x))
    return x + dense(d, ('mlp', 'embed'), 'down')(nn.gelu(h))


MODEL = Block()
X = jax.random.normal(jax.random.key(1), (B, T, D))
Y = jax.random.normal(jax.random.key(2), (B, T, D))


def init(key):
  return nn.unbox(MODEL.init(key, X[:1])['params'])


def loss(params, x, y):
  return jnp.mean((MODEL.apply({'params': params}, x) - y) ** 2)


@functools.cache  # one reference per optimizer and step count, shared by the meshes' tests
def plain(tx, steps):
  params = init(jax.random.key(0))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params, X, Y), state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return jax.tree.map(np.asarray, params)


def tp_split(names) -> int:
  """How many ways tensor parallelism splits a leaf (from its logical names alone)."""
  return 2 if any(dict(RULES).get(n) == 'model' for n in names if n) else 1


LOGICAL = nn.get_partition_spec(jax.eval_shape(MODEL.init, jax.random.key(0), X[:1])['params'])
SIZES = jax.tree.map(lambda x: x.size, init(jax.random.key(0)))
SPLITS = jax.tree.map(
  lambda s: tp_split(tuple(s)), LOGICAL, is_leaf=lambda s: isinstance(s, PartitionSpec)
)

MESHES = {
  # name: (shape, axis names, ZeRO axes, hpZ parameter axes)
  '4x2 data,model': ((4, 2), ('data', 'model'), ('data',), None),
  '2x2x2 replica,data,model hpZ': (
    (2, 2, 2),
    ('replica', 'data', 'model'),
    ('replica', 'data'),
    'data',
  ),
  '2x4 replica,data hpZ': ((2, 4), ('replica', 'data'), ('replica', 'data'), 'data'),
  '2x4 replica,data': ((2, 4), ('replica', 'data'), ('replica', 'data'), None),
}


def make(name, stage, kind=AxisType.Auto):
  shape, names, axes, param_axis = MESHES[name]
  mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(names))
  specs = zerojax.linen.logical_param_specs(
    jax.eval_shape(MODEL.init, jax.random.key(0), X[:1])['params'], RULES
  )
  if 'model' not in names:
    specs = None
  state = zerojax.create_train_state(
    init,
    jax.random.key(0),
    tx=zerojax.zero_stage(
      TX,
      stage,
      mesh=mesh,
      axis=axes,
      replicate_below_bytes=0,
      param_specs=specs,
      param_axis=param_axis,
    ),
  )
  batch = NamedSharding(mesh, PartitionSpec(axes))
  return mesh, state, jax.device_put((X, Y), batch), axes, param_axis


def train_step(state, x, y):
  plan = zerojax.plan_for(state.tx, state.params)
  grads = jax.grad(lambda p: loss(zerojax.gather(p, plan), x, y))(state.params)
  return state.apply_gradients(grads=grads)


@pytest.mark.parametrize('name', list(MESHES))
@pytest.mark.parametrize('stage', [1, 3])
def test_equivalence_and_layouts(name, stage):
  mesh, state, (x, y), axes, param_axis = make(name, stage)
  plan = zerojax.plan_for(state.tx, state.params)
  step = jax.jit(train_step)
  for _ in range(5):
    state = step(state, x, y)
  want = plain(TX, 5)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    # Rows (16 x 8 tokens), the block's 64-, 192-, 256-wide contractions and its
    # layer norms, summed in another order on each mesh; five steps.
    assert np.linalg.norm(np.asarray(a) - b) <= reordered(B * T + 4 * D + 4 * D, steps=5) * (
      np.linalg.norm(b)
    )
  assert jax.tree.map(lambda a: a.sharding, state.params) == plan.params
  assert jax.tree.map(lambda a: a.sharding, state.opt_state) == plan.opt_state
  kernel = plan.opt_state[0].mu['up']['kernel'].spec
  if 'model' in mesh.axis_names:
    assert 'model' in jax.tree.leaves(tuple(kernel))  # tensor parallelism kept
  # Optimizer state is split over every ZeRO axis.
  assert set(axes) <= set(jax.tree.leaves(tuple(kernel)))


@pytest.mark.parametrize('name', list(MESHES))
def test_stage3_argument_bytes(name):
  mesh, state, (x, y), axes, param_axis = make(name, 3)
  z = int(np.prod([mesh.shape[a] for a in axes]))
  g = mesh.shape[param_axis] if param_axis else z
  tp = 'model' in mesh.axis_names
  splits = jax.tree.leaves(SPLITS) if tp else [1] * len(jax.tree.leaves(SIZES))
  # fp32 params split over the parameter group; Adam's moments over all ZeRO axes;
  # tensor parallelism divides both further.
  want = sum(4 * n // (s * g) + 8 * n // (s * z) for n, s in zip(jax.tree.leaves(SIZES), splits))
  batch = 2 * B * T * D * 4 // z
  compiled = jax.jit(train_step).lower(state, x, y).compile()
  assert zerojax.inspect.memory_stats(compiled).argument == want + batch + 8  # + step and count


def group_sizes(text, op):
  sizes = []
  for line in text.splitlines():
    if re.search(rf'= \S+ {op}(-start)?\(', line):
      sizes.append(collectives.group_size(line, 0))  # the parser behind count_collectives
  return sizes


def test_hpz_gathers_parameters_within_the_group():
  # 2 groups of 4: parameters split over 'data' (4), optimizer state over all 8.
  mesh, state, (x, y), _, _ = make('2x4 replica,data hpZ', 3)
  text = jax.jit(train_step).lower(state, x, y).compile().as_text()
  sizes = group_sizes(text, 'all-gather')
  # Forward/backward gathers stay in a group of 4; the updated shards are gathered
  # across the 2 groups only.
  assert sizes and set(sizes) <= {4, 2}, sizes
  assert 4 in sizes and 2 in sizes
  _, flat_state, (fx, fy), _, _ = make('2x4 replica,data', 3)
  text = jax.jit(train_step).lower(flat_state, fx, fy).compile().as_text()
  assert set(group_sizes(text, 'all-gather')) == {8}  # plain stage 3: across all 8


def test_logical_specs_errors_name_the_leaf():
  params = jax.eval_shape(MODEL.init, jax.random.key(0), X[:1])['params']
  with pytest.raises(ValueError) as e:
    zerojax.linen.logical_param_specs(params, [('embed', None), ('heads', 'model')])
  assert str(e.value) == (
    "params['down']['kernel']: logical axis 'mlp' has no rule in `rules` (known: ['embed',"
    " 'heads']). Add ('mlp', MESH_AXIS_OR_None)."
  )


def test_param_axis_must_be_a_zero_axis():
  mesh = jax.make_mesh((2, 4), ('replica', 'data'), axis_types=(AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match=r"`param_axis`='replica' must be a subset of the ZeRO"):
    zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='data', param_axis='replica')
