"""The layer axis: ZeRO never splits the leading dimension a layer loop walks.

Stacked layer parameters (a matrix pair, a bias and a norm scale per layer, stacked along a
leading layer axis) are swept over layer counts that do and do not divide the device count,
widths from 32 to 4096 and 2, 4 and 8 devices: the plan never puts a mesh axis on the layer
axis, and each of the README's layer-loop recipes (`zerojax.scan_layers` under
`zerojax.value_and_grad(per_layer=True)` and under the user's own `jax.grad`, linen
`zerojax.linen.gathered` over `nn.scan`, NNX layers scanned with `nnx.scan`) trains to plain
optax's losses.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, reordered
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

LAYERS = (1, 2, 3, 4, 8, 12, 16)
WIDTHS = (32, 64, 96, 128, 256, 384, 512, 768, 1024, 2048, 3072, 4096)
DEVICES = (2, 4, 8)
HIDDEN = 32  # the inner width of each layer's matrix pair, so wide layers stay small
STEPS = 3


def _stacked_shapes(layers: int, width: int) -> dict:
  return {
    'w_in': (layers, width, HIDDEN),
    'w_out': (layers, HIDDEN, width),
    'b': (layers, width),
    'scale': (layers, width),
  }


def _entries(spec) -> tuple:
  """A PartitionSpec's entries without trailing Nones (Auto and Explicit meshes differ there)."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def _mesh(n: int, kind=AxisType.Explicit):
  return jax.make_mesh((n,), ('data',), axis_types=(kind,), devices=jax.devices()[:n])


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('stacked', [None, True])
def test_the_plan_never_splits_the_layer_axis(stage, stacked):
  # The property over the whole sweep (abstract shapes: nothing is allocated), unmarked
  # (the default rule) and marked: every stacked leaf of two or more dimensions keeps its
  # leading dimension whole, and is still split over 'data' on another dimension.
  tried = 0
  for n, layers, width in itertools.product(DEVICES, LAYERS, WIDTHS):
    mesh = jax.sharding.AbstractMesh((n,), ('data',))
    shapes = _stacked_shapes(layers, width)
    params = {'layers': {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}}
    marks = None if stacked is None else {'layers': True}
    tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, stacked=marks)
    plan = zerojax.plan_for(tx, params)
    for group in ('params', 'grads', 'param_shards'):
      for path, sharding in jax.tree_util.tree_leaves_with_path(getattr(plan, group)):
        spec = tuple(sharding.spec) + (None,) * 3
        where = f'{group}{jax.tree_util.keystr(path)} n={n} L={layers} d={width}'
        assert spec[0] is None, where
        split = (stage >= 3 or group != 'params') and (stage >= 2 or group == 'param_shards')
        assert ('data' in spec[1:]) == split, (where, spec)
    for path, sharding in jax.tree_util.tree_leaves_with_path(plan.opt_state):
      spec = tuple(sharding.spec)
      if len(spec) >= 2:
        assert spec[0] is None, f'opt_state{jax.tree_util.keystr(path)} n={n} L={layers}'
    tried += 1
  assert tried == len(DEVICES) * len(LAYERS) * len(WIDTHS)


def test_a_marked_stack_keeps_a_layer_count_larger_than_its_width_whole():
  # Unmarked, a leading dimension larger than every other is split (it may be a Dense
  # kernel's input); marked stacked, it never is.
  mesh = jax.sharding.AbstractMesh((8,), ('data',))
  params = {'layers': {'b': jax.ShapeDtypeStruct((16, 8), jnp.float32)}}
  unmarked = zerojax.plan_for(zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh), params)
  assert _entries(unmarked.params['layers']['b'].spec) == ('data',)
  marked = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, stacked={'layers': True})
  assert _entries(zerojax.plan_for(marked, params).params['layers']['b'].spec) == (None, 'data')


def test_leaves_marked_unstacked_keep_the_lane_aligned_leading_dimension():
  # A head (d_model, vocab) whose vocabulary shards would not be whole TPU lane tiles: with
  # stacked=False its leading dimension is split (whole tiles), as for the planner's models.
  mesh = jax.sharding.AbstractMesh((256,), ('data',))
  params = {'head': jax.ShapeDtypeStruct((8192, 32000), jnp.bfloat16)}
  for marks, want in ((None, (None, 'data')), ({'head': False}, ('data',))):
    tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, stacked=marks)
    assert _entries(zerojax.plan_for(tx, params).params['head'].spec) == want, marks


def test_param_specs_that_split_a_marked_layer_axis_are_refused_before_tracing():
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  params = {'layers': {'w': jnp.zeros((4, 64, 64)), 'b': jnp.zeros((4, 64))}}
  tx = zerojax.zero_stage(
    optax.adam(1e-3),
    3,
    mesh=mesh,
    stacked={'layers': True},
    param_specs={'layers': {'w': P('model', None, None), 'b': P(None, 'model')}},
  )
  with pytest.raises(ValueError) as e:
    zerojax.plan_for(tx, params)
  assert str(e.value) == (
    '1 stacked leaf would be split along the layer axis (dimension 0), which a layer loop'
    " walks:\n  params['layers']['w']: shape (4, 64, 64), layout P('model', None,"
    " None): dimension 0 split over 'model'\nGive dimension 0 no mesh axis in `param_specs`"
    ' (e.g. P(None, ...)), or pass `stacked=False` for leaves whose leading dimension is not a'
    ' layer axis.'
  )


def test_a_layer_axis_split_by_the_default_rule_is_named_before_the_loop_is_traced():
  # 16 layers of width 8 on 8 devices, unmarked: the plan splits the layers (the default rule
  # cannot tell them from a Dense kernel's inputs), and scan_layers names the leaf and the fix
  # before it traces the body.
  mesh = _mesh(8)
  params = {'layers': {'b': jnp.zeros((16, 8))}}
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  placed = jax.device_put(params, zerojax.plan_for(tx, params).params)
  traced = []

  def loss(p, x):
    return jnp.sum(
      zerojax.scan_layers(lambda h, layer: traced.append(1) or h + layer['b'], x, p['layers'], tx)
    )

  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P('data')))
  with pytest.raises(ValueError) as e:
    jax.jit(zerojax.value_and_grad(loss, tx, per_layer=True))(placed, x)
  assert str(e.value) == (
    "parameter params['layers']['b'] is split over ('data',) on dimension 0, the layer axis a layer"
    ' loop walks: each device would hold other layers. Mark the stacked layers so that ZeRO'
    " splits another dimension: zero_stage(..., stacked={'layers': True}) (their subtree in"
    ' your parameters), or give dimension 0 no mesh axis in `param_specs`.'
  )
  assert not traced


# The recipes, end to end, on a spread of the sweep: every layer count, width and device
# count appears, and so do the shapes the README broke on (GPT-2 small's 12 x 768 on 4
# devices, 8 x 1024 on 8: layer counts that divide the devices, widths whose shards are not
# whole TPU lane tiles).
CASES = [
  (4, 12, 768),
  (8, 8, 1024),
  (8, 16, 2048),
  (2, 2, 4096),
  (2, 3, 384),
  (4, 4, 96),
  (8, 1, 32),
  (2, 16, 64),
  (8, 12, 128),
  (4, 8, 3072),
]


def _layer_fn(h, p):
  """One residual layer: a matrix pair with a tanh between, a bias, and a norm scale."""
  u = jnp.tanh(h @ p['w_in']) @ p['w_out'] + p['b']
  u = u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + 1e-6) * p['scale']
  return h + 0.5 * u


def _init(layers, width):
  ks = jax.random.split(jax.random.key(layers * 7919 + width), 3)
  return {
    'layers': {
      'w_in': jax.random.normal(ks[0], (layers, width, HIDDEN)) / np.sqrt(width),
      'w_out': jax.random.normal(ks[1], (layers, HIDDEN, width)) / np.sqrt(HIDDEN),
      'b': 0.01 * jax.random.normal(ks[2], (layers, width)),
      'scale': jnp.ones((layers, width)),
    }
  }


def _batch(n, width):
  x = jax.random.normal(jax.random.key(1), (2 * n, width))
  return x, jnp.roll(x, 1, axis=-1)


def _plain_losses(loss_fn, params, batch):
  """STEPS losses of plain optax Adam on one device: the reference."""
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)
  losses = []
  for _ in range(STEPS):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return np.array(losses)


def _zero_losses(tx, init_fn, grad_fn, batch, mesh):
  state = zerojax.create_train_state(init_fn, jax.random.key(0), tx=tx)
  for leaf in jax.tree.leaves(state.params):  # every leaf here is a stacked layer's
    spec = tuple(leaf.sharding.spec)
    assert not spec or spec[0] is None, (leaf.shape, spec)
  batch = jax.device_put(batch, NamedSharding(mesh, P('data')))

  @jax.jit
  def step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(STEPS):
    state, loss = step(state, batch)
    losses.append(float(loss))
  return np.array(losses)


def _tolerance(n, layers, width):
  """Rounding of the loss after STEPS updates: the batch's rows and, per layer, the
  contractions over the width and the hidden width."""
  return reordered(2 * n + layers * (width + HIDDEN), steps=STEPS)


@pytest.mark.parametrize('n, layers, width', CASES)
@pytest.mark.parametrize('grads', ['per_layer', 'jax.grad'])
def test_scan_layers_recipe_trains_as_plain_optax(n, layers, width, grads):
  params = _init(layers, width)
  batch = _batch(n, width)

  def plain_loss(p, b):
    h, _ = jax.lax.scan(lambda h, layer: (_layer_fn(h, layer), None), b[0], p['layers'])
    return jnp.mean((h - b[1]) ** 2)

  want = _plain_losses(plain_loss, params, batch)
  kind = AxisType.Explicit if grads == 'per_layer' else AxisType.Auto
  mesh = _mesh(n, kind)
  tx = zerojax.zero_stage(optax.adam(1e-2), stage=3, mesh=mesh)

  def loss(p, b):
    h = zerojax.scan_layers(_layer_fn, b[0], p['layers'], tx)
    return jnp.mean((h - b[1]) ** 2)

  if grads == 'per_layer':
    grad_fn = zerojax.value_and_grad(loss, tx, per_layer=True)
  else:
    grad_fn = jax.value_and_grad(loss)
  got = _zero_losses(tx, lambda k: params, grad_fn, batch, mesh)
  assert_close(got, want, _tolerance(n, layers, width))


class _Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, h, _):
    u = nn.Dense(self.width)(jnp.tanh(nn.Dense(HIDDEN, use_bias=False)(h)))
    return h + 0.5 * nn.RMSNorm()(u), None


class _Stack(nn.Module):
  width: int
  layers: int
  zero: object = None

  @nn.compact
  def __call__(self, x):
    block = _Block if self.zero is None else zerojax.linen.gathered(_Block, self.zero)
    block = nn.remat(block, prevent_cse=False, policy=zerojax.recompute_gathers)
    scan = nn.scan(
      block, variable_axes={'params': 0}, split_rngs={'params': True}, length=self.layers
    )
    return scan(self.width)(x, None)[0]


@pytest.mark.parametrize('n, layers, width', CASES)
def test_linen_gathered_over_nn_scan_trains_as_plain_optax(n, layers, width):
  batch = _batch(n, width)
  plain = _Stack(width, layers)
  init_fn = lambda key: plain.init(key, batch[0])['params']
  params = init_fn(jax.random.key(0))
  loss_of = lambda model: lambda p, b: jnp.mean((model.apply({'params': p}, b[0]) - b[1]) ** 2)
  want = _plain_losses(loss_of(plain), params, batch)

  mesh = _mesh(n, AxisType.Auto)
  tx = zerojax.zero_stage(optax.adam(1e-2), stage=3, mesh=mesh)
  zero = _Stack(width, layers, tx)
  grad_fn = zerojax.value_and_grad(loss_of(zero), tx, per_layer=True)
  got = _zero_losses(tx, init_fn, grad_fn, batch, mesh)
  assert_close(got, want, _tolerance(n, layers, width))


class _NNXBlock(nnx.Module):
  def __init__(self, width, rngs):
    self.w_in = nnx.Linear(width, HIDDEN, use_bias=False, rngs=rngs)
    self.w_out = nnx.Linear(HIDDEN, width, rngs=rngs)
    self.norm = nnx.RMSNorm(width, rngs=rngs)

  def __call__(self, h):
    return h + 0.5 * self.norm(self.w_out(jnp.tanh(self.w_in(h))))


class _NNXStack(nnx.Module):
  def __init__(self, width, layers, rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _NNXBlock(width, rngs)

    self.blocks = make(rngs)

  def __call__(self, x, zero=None):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat(policy=zerojax.recompute_gathers)
    def run(block, h):
      return (block if zero is None else zerojax.nnx.gathered(block, zero))(h)

    return run(self.blocks, x)


@pytest.mark.parametrize('n, layers, width', CASES[:6])
def test_nnx_scanned_layers_train_as_plain_optax(n, layers, width):
  batch = _batch(n, width)
  make = lambda: _NNXStack(width, layers, nnx.Rngs(0))
  loss = lambda zero: lambda m, b: jnp.mean((m(b[0], zero) - b[1]) ** 2)

  model = make()
  graphdef, params = nnx.split(model, nnx.Param)
  want = _plain_losses(lambda p, b: loss(None)(nnx.merge(graphdef, p), b), params, batch)

  mesh = _mesh(n)
  tx = zerojax.zero_stage(optax.adam(1e-2), stage=3, mesh=mesh)
  model = zerojax.nnx.create_model(make, tx)
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
    spec = tuple(leaf.sharding.spec)
    assert leaf.ndim < 2 or spec[0] is None, (leaf.shape, spec)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grad_fn = zerojax.nnx.value_and_grad(loss(tx), tx, per_layer=True)
  batch = jax.device_put(batch, NamedSharding(mesh, P('data')))

  @nnx.jit
  def step(model, optimizer, batch):
    value, grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return value

  got = np.array([float(step(model, optimizer, batch)) for _ in range(STEPS)])
  assert_close(got, want, _tolerance(n, layers, width))
