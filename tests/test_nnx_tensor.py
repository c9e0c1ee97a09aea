"""NNX on a tensor-parallel mesh with the optimizer line alone.

A model of the JAX AI Stack miniGPT tutorial's shape, written here: layers annotated with
`nnx.with_partitioning` over a 'model' axis, an unannotated embedding, a list of blocks; an
`nnx.Optimizer`, an `nnx.jit` step with `nnx.value_and_grad`. The only change from plain optax
is `zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis='batch')`. Meshes: 8x1 and 4x2
('batch', 'model'), Auto and Explicit axes.
"""

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._src.layouts import ZeroState

VOCAB, WIDTH, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 64, 2, 16, 16
STEPS = 3


def _explicit(mesh):
  return all(t == AxisType.Explicit for t in mesh.axis_types)


class Block(nnx.Module):
  def __init__(self, explicit: bool, rngs: nnx.Rngs):
    init = nnx.initializers.xavier_uniform()
    self.explicit = explicit
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(
      WIDTH, HIDDEN, kernel_init=nnx.with_partitioning(init, (None, 'model')), rngs=rngs
    )
    self.down = nnx.Linear(
      HIDDEN, WIDTH, kernel_init=nnx.with_partitioning(init, ('model', None)), rngs=rngs
    )

  def __call__(self, x):
    h = nnx.relu(self.up(self.norm(x)))
    # On Explicit axes the row-parallel matmul's output layout is the program's to say.
    return x + (self.down(h, out_sharding=P('batch')) if self.explicit else self.down(h))


class TinyGPT(nnx.Module):
  """Embedding (unannotated), blocks in a list, a column-parallel head."""

  def __init__(self, explicit: bool, rngs: nnx.Rngs):
    self.explicit = explicit
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([Block(explicit, rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(
      WIDTH,
      VOCAB,
      kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model')),
      rngs=rngs,
    )

  def __call__(self, tokens):
    if self.explicit:
      x = self.embed.embedding[...].at[tokens].get(out_sharding=P('batch'))
    else:
      x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x, out_sharding=P('batch')) if self.explicit else self.head(x)


def _loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def _train_step(model, optimizer, tokens):
  loss, grads = nnx.value_and_grad(_loss)(model, tokens)
  optimizer.update(model, grads)
  return loss


def _mesh(shape, kind):
  return jax.make_mesh(shape, ('batch', 'model'), axis_types=(kind, kind))


def _create(mesh):
  """The tutorial's way: created under jit, constrained to the annotations' layouts."""
  explicit = _explicit(mesh)

  @nnx.jit
  def create():
    model = TinyGPT(explicit, nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model

  return create()


def _tokens(mesh):
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
  return jax.device_put(tokens, NamedSharding(mesh, P('batch')))


def _train(mesh, tx):
  with jax.set_mesh(mesh):
    model = _create(mesh)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    at_creation = _per_device(nnx.as_pure(nnx.state(optimizer.opt_state)))
    tokens = _tokens(mesh)
    losses = [float(_train_step(model, optimizer, tokens)) for _ in range(STEPS)]
  return losses, model, optimizer, at_creation


def _per_device(tree):
  """Bytes per leaf on device 0."""
  return [x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)]


def _tensor_split(x, mesh):
  """How many parts the 'model' axis splits a placed leaf into."""
  return mesh.shape['model'] if 'model' in jax.tree.leaves(tuple(x.sharding.spec)) else 1


MESHES = [((8, 1), AxisType.Auto), ((4, 2), AxisType.Auto), ((8, 1), AxisType.Explicit)]
MESHES += [((4, 2), AxisType.Explicit)]


@pytest.mark.parametrize('shape, kind', MESHES, ids=lambda v: getattr(v, 'name', v))
@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_the_optimizer_line_alone_on_a_tensor_parallel_mesh(shape, kind, stage):
  mesh = _mesh(shape, kind)
  ref_losses, ref_model, ref_optimizer, ref_at_creation = _train(mesh, optax.adam(1e-3))
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis='batch')
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # stage 3's note that the first update splits the model
    losses, model, optimizer, at_creation = _train(mesh, tx)
  # The same numbers as plain nnx.Optimizer, step by step.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  ref_params = nnx.as_pure(nnx.state(ref_model, nnx.Param))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, ref_params
  )
  # Where the state records the layouts: on Auto axes beside a tensor axis of size > 1 only.
  hidden = kind == AxisType.Auto and mesh.shape['model'] > 1
  assert isinstance(optimizer.opt_state, ZeroState) == hidden
  final = _per_device(nnx.as_pure(nnx.state(optimizer.opt_state)))
  if stage == 0:  # nothing split over 'batch': the state is plain optax's, leaf by leaf
    assert at_creation == ref_at_creation
    assert final == _per_device(nnx.as_pure(nnx.state(ref_optimizer.opt_state)))
    assert _per_device(params) == _per_device(ref_params)
    return
  # The state at rest, from creation on and after the steps: each Adam moment is its
  # parameter's bytes over the tensor-parallel split kept, and over the 'batch' axis from
  # stage 1 (every dimension here divides 8).
  leaves = jax.tree.leaves(params)
  zero = mesh.shape['batch'] if stage >= 1 else 1
  moment = [x.nbytes // _tensor_split(x, mesh) // zero for x in leaves]
  count = np.dtype(np.int32).itemsize  # Adam's step count, whole on every device
  want = [count] + moment + moment
  assert at_creation == want
  assert final == want
  # Parameters at rest: whole over 'batch' below stage 3, split from stage 3's first update;
  # on Explicit axes, where the split would be in their types, kept whole (tx.init warned).
  split = stage == 3 and kind == AxisType.Auto
  total = sum(_per_device(params))
  assert total == sum(x.nbytes // _tensor_split(x, mesh) // (zero if split else 1) for x in leaves)


@pytest.mark.parametrize('shape', [(8, 1), (4, 2)])
def test_stage_3_on_explicit_axes_gathers_in_the_loss(shape):
  # On Explicit axes a stage-3 parameter's type says it is split over 'batch', so the model
  # cannot run on it as it is: the loss gathers it (zerojax.nnx.gathered), and
  # nnx.value_and_grad's gradient of that gather is the reduce-scatter.
  mesh = _mesh(shape, AxisType.Explicit)
  ref_losses, ref_model, _, _ = _train(mesh, optax.adam(1e-3))
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='batch')

  def loss(model, tokens):
    return _loss(zerojax.nnx.gathered(model, tx), tokens)

  @nnx.jit
  def step(model, optimizer, tokens):
    value, grads = nnx.value_and_grad(loss)(model, tokens)
    optimizer.update(model, grads)
    return value

  with jax.set_mesh(mesh):
    model = zerojax.nnx.shard(_create(mesh), tx)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    tokens = _tokens(mesh)
    losses = [float(step(model, optimizer, tokens)) for _ in range(STEPS)]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  ref_params = nnx.as_pure(nnx.state(ref_model, nnx.Param))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, ref_params
  )
  # At rest: every parameter split over 'batch', its tensor-parallel split kept.
  leaves = jax.tree.leaves(params)
  split = [x.nbytes // _tensor_split(x, mesh) // mesh.shape['batch'] for x in leaves]
  assert _per_device(params) == split


def test_stage_3_says_the_first_update_splits_a_whole_model():
  mesh = _mesh((4, 2), AxisType.Auto)
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='batch')
  with jax.set_mesh(mesh):
    model = _create(mesh)
    with pytest.warns(UserWarning) as record:
      nnx.Optimizer(model, tx, wrt=nnx.Param)
  (message,) = [str(w.message) for w in record]
  assert message.startswith(
    "zero_stage(stage=3): tx.init got 15 parameters whole over the ZeRO axes ('batch',)"
  )
  assert 'zerojax.nnx.shard(model, tx)' in message
  # Placed first, nothing to say.
  with jax.set_mesh(mesh):
    model = zerojax.nnx.shard(_create(mesh), tx)
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_stage_3_on_explicit_axes_keeps_parameters_typed_whole_and_says_so():
  # The optimizer line alone at stage 3 on Explicit axes: split, the parameters' types would
  # say so and the ungathered model could not take its next step. They stay whole, the state
  # is split, and tx.init says so with the way to stage 3's saving.
  mesh = _mesh((4, 2), AxisType.Explicit)
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='batch')
  with jax.set_mesh(mesh):
    model = _create(mesh)
    with pytest.warns(UserWarning) as record:
      nnx.Optimizer(model, tx, wrt=nnx.Param)
  (message,) = [str(w.message) for w in record]
  assert message == (
    'zero_stage(stage=3) on Explicit mesh axes: tx.init got 15 parameters whole over the ZeRO'
    " axes ('batch',) (params['blocks'][0]['down']['bias'], params['blocks'][0]['down']"
    "['kernel'], params['blocks'][0]['norm']['bias'] and 12 more). Updated with gradients that"
    ' arrive whole too (jax or nnx differentiating a model that reads them as typed), they stay'
    ' whole, the saving of stage 2: split, their types would say so and such a model would'
    " stop with JAX's ShardingTypeError. The optimizer state is split. For stage 3's saving,"
    ' place them split first (zerojax.nnx.shard(model, tx) or zerojax.nnx.create_model,'
    ' zerojax.create_train_state) and read them through zerojax.nnx.gathered(model, tx) (or'
    ' zerojax.gather(params, tx)) in the loss.'
  )


def test_a_state_recorded_for_other_parameters_is_refused():
  mesh = _mesh((4, 2), AxisType.Auto)
  tx = zerojax.zero_stage(optax.adam(1e-3), 1, mesh=mesh, axis='batch')
  with jax.set_mesh(mesh):
    params = nnx.as_pure(nnx.state(_create(mesh), nnx.Param))
    state = tx.init(params)
    fewer = dict(params)
    fewer.pop('head')
    with pytest.raises(ValueError) as info:
      jax.jit(tx.update)(fewer, state, fewer)
  n = len(jax.tree.leaves(params))
  assert str(info.value) == (
    f'the optimizer state was made by tx.init for {n} parameter leaves, and this update got'
    f' {n - 2} leaves of `params`: an optimizer state belongs to the parameters it was'
    ' initialised for. Call tx.init on these parameters.'
  )


def test_per_layer_on_a_loss_that_gathers_nothing_names_the_fix():
  mesh = _mesh((8, 1), AxisType.Auto)
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='batch')
  with jax.set_mesh(mesh):
    model = zerojax.nnx.shard(_create(mesh), tx)
    grad_fn = zerojax.nnx.value_and_grad(_loss, tx, per_layer=True)
    with pytest.raises(TypeError) as info:
      nnx.jit(grad_fn)(model, _tokens(mesh))
  first = str(info.value).splitlines()[0]
  assert first.startswith("parameter params['embed']['embedding']")
  assert 'zerojax.nnx.gathered' in first


def test_the_recorded_layouts_are_data_in_the_state():
  # jit, tree maps and flattening keep the record: it is part of the structure, with no leaves.
  mesh = _mesh((4, 2), AxisType.Auto)
  tx = zerojax.zero_stage(optax.sgd(0.1, momentum=0.9), 2, mesh=mesh, axis='batch')
  with jax.set_mesh(mesh):
    params = nnx.as_pure(nnx.state(_create(mesh), nnx.Param))
    state = tx.init(params)
  assert isinstance(state, ZeroState)
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(state.inner))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert state.layouts.specs[paths.index("['head']['kernel']")] == P(None, 'model')
  assert state.layouts.specs[paths.index("['embed']['embedding']")] == P()
  grads = jax.tree.map(jnp.ones_like, params)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert new_state.layouts == state.layouts
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_specs_of_reads_an_nnx_state_with_unannotated_leaves():
  # The one-line fix for a state that was never seen placed: nnx.Param leaves, some with no
  # mesh layout of their own.
  mesh = _mesh((4, 2), AxisType.Auto)
  with jax.set_mesh(mesh):
    model = _create(mesh)
    loose = nnx.Param(jnp.ones((8, 8)))  # a single-device array: no mesh layout
    state = nnx.state(model, nnx.Param)
    specs = zerojax.specs_of({'model': state, 'loose': loose})
  assert specs['model']['head']['kernel'] == P(None, 'model')
  assert specs['model']['blocks'][0]['down']['kernel'] == P('model')
  assert specs['model']['embed']['embedding'] == P()
  assert specs['loose'] == P()
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=mesh, axis='batch', param_specs=specs['model'])
  params = nnx.as_pure(state)
  opt_state = jax.jit(tx.init)(params)  # traced: nothing to record, the specs say it
  assert not isinstance(opt_state, ZeroState)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = jax.jit(tx.update)(grads, opt_state, params)
  assert updates['head']['kernel'].sharding.spec == P(None, 'model')


def test_specs_of_refuses_traced_leaves_on_auto_axes():
  mesh = _mesh((4, 2), AxisType.Auto)
  with pytest.raises(ValueError) as info:
    jax.jit(lambda t: zerojax.specs_of(t) and t)({'w': jnp.ones((4, 4))})
  assert str(info.value) == (
    "zerojax.specs_of: params['w'] are traced on Auto mesh axes, where arrays carry no layout."
    ' Call it on the placed parameters outside jax.jit (or nnx.jit).'
  )
  del mesh


def test_optimizer_sharding_metadata_is_refused_before_tracing():
  mesh = _mesh((4, 2), AxisType.Auto)

  class Annotated(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jnp.ones((8, 8)), optimizer_sharding=('model', None))

  tx = zerojax.zero_stage(optax.adam(1e-3), 1, mesh=mesh, axis='batch')
  with jax.set_mesh(mesh):
    model = Annotated(nnx.Rngs(0))
    with pytest.raises(ValueError) as info:
      nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert str(info.value) == (
    "params['w']: nnx.Param(..., optimizer_sharding=...) lays out its optimizer state itself,"
    ' and zero_stage lays out the optimizer state over its ZeRO axes: the two would fight.'
    ' Drop optimizer_sharding from these parameters and let zero_stage split the state'
    ' (stage 1 and up), or leave zero_stage out for them.'
  )


# Stacked layers as Flax's sharding guide builds them: created by a vmap, applied by
# jax.lax.scan inside a jax.jit step that differentiates the model itself, the second weight
# an nnx.Param with its own sharding metadata; on Explicit axes the model names its layouts.

DEPTH, STACK = 64, 2


class Pair(nnx.Module):
  def __init__(self, explicit: bool, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.explicit = explicit
    if explicit:
      self.dot1 = nnx.Linear(
        DEPTH,
        DEPTH,
        use_bias=False,
        kernel_init=lambda k, s, d: init(k, s, d, out_sharding=P(None, 'model')),
        rngs=rngs,
      )
      self.w2 = nnx.Param(init(rngs.params(), (DEPTH, DEPTH), out_sharding=P('model', None)))
    else:
      cols = nnx.with_partitioning(init, (None, 'model'))
      self.dot1 = nnx.Linear(DEPTH, DEPTH, use_bias=False, kernel_init=cols, rngs=rngs)
      self.w2 = nnx.Param(init(rngs.params(), (DEPTH, DEPTH)), out_sharding=('model', None))
    self.b2 = nnx.Param(jnp.zeros((DEPTH,)))

  def __call__(self, x):
    y = jax.nn.relu(self.dot1(x))
    if self.explicit:
      return jnp.dot(y, self.w2[...], out_sharding=P('batch', None)) + self.b2
    y = jax.lax.with_sharding_constraint(y, P('batch', 'model'))
    return y @ self.w2[...] + self.b2


class Stacked(nnx.Module):
  def __init__(self, explicit: bool, rngs: nnx.Rngs):
    if explicit:
      make = jax.vmap(lambda r: Pair(True, r), spmd_axis_name=None)
    else:
      make = nnx.vmap(lambda r: Pair(False, r), transform_metadata={nnx.PARTITION_NAME: None})
    self.layers = make(rngs.split(STACK))

  def __call__(self, x):
    return jax.lax.scan(lambda h, layer: (layer(h), None), x, self.layers)[0]


@jax.jit
def _stacked_step(model, optimizer, x, y):
  loss, grads = jax.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)
  return model, loss


def _stacked_train(mesh, tx):
  with jax.set_mesh(mesh):
    model = Stacked(_explicit(mesh), nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    at_creation = _per_device(nnx.as_pure(nnx.state(optimizer.opt_state)))
    keys = jax.random.split(jax.random.key(5))
    x, y = (jax.random.normal(k, (BATCH, DEPTH)) for k in keys)
    x, y = (jax.device_put(a, NamedSharding(mesh, P('batch'))) for a in (x, y))
    losses = []
    for _ in range(STEPS):
      model, loss = _stacked_step(model, optimizer, x, y)
      losses.append(float(loss))
  return losses, nnx.as_pure(nnx.state(model, nnx.Param)), at_creation


@pytest.mark.parametrize('shape', [(2, 4), (8, 1)])
@pytest.mark.parametrize('kind', [AxisType.Auto, AxisType.Explicit], ids=lambda k: k.name)
@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_stacked_layers_as_the_flax_guide_builds_them(shape, kind, stage):
  mesh = _mesh(shape, kind)
  ref_losses, ref_params, ref_state = _stacked_train(mesh, optax.adam(1e-3))
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis='batch')
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # stage 3's note on parameters placed whole
    losses, params, at_creation = _stacked_train(mesh, tx)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, ref_params
  )
  # The state from creation on: Adam's moments over the tensor split kept, and over 'batch'
  # from stage 1 (every dimension here divides 8).
  zero = mesh.shape['batch'] if stage >= 1 else 1
  moment = [x.nbytes // _tensor_split(x, mesh) // zero for x in jax.tree.leaves(params)]
  count = np.dtype(np.int32).itemsize
  assert at_creation == ([count] + moment + moment if stage else ref_state)
  # Stage 3 splits the parameters over 'batch' on Auto axes; on Explicit axes, where the
  # model reads them as typed, they stay whole (tx.init warns).
  split = mesh.shape['batch'] if stage == 3 and kind == AxisType.Auto else 1
  want = [x.nbytes // _tensor_split(x, mesh) // split for x in jax.tree.leaves(ref_params)]
  assert _per_device(params) == want


# Logical axis names (nnx.with_partitioning(init, ('embed', 'mlp')) with nnx.logical_axis_rules).

RULES = (('embed', None), ('mlp', 'model'))


class Logical(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.xavier_uniform()
    self.up = nnx.Linear(
      WIDTH, HIDDEN, kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')), rngs=rngs
    )
    self.down = nnx.Linear(
      HIDDEN, WIDTH, kernel_init=nnx.with_partitioning(init, ('mlp', 'embed')), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(nnx.relu(self.up(x)))


def _logical_train(mesh, tx, grads_of):
  """Created under the rules (as Flax needs them there), trained outside them."""
  with jax.set_mesh(mesh):
    with nnx.logical_axis_rules(RULES):
      model = Logical(nnx.Rngs(0))
      if tx is not None and zerojax.config_of(tx).stage == 3:
        model = zerojax.nnx.shard(model, tx)
      optimizer = nnx.Optimizer(model, tx or optax.adam(1e-3), wrt=nnx.Param)
    x = jax.device_put(
      jax.random.normal(jax.random.key(2), (BATCH, WIDTH)), NamedSharding(mesh, P('batch'))
    )
    loss = lambda m, x: (m(x) ** 2).mean()

    @nnx.jit
    def step(model, optimizer, x):
      value, grads = grads_of(loss)(model, x)
      optimizer.update(model, grads)
      return value

    losses = [float(step(model, optimizer, x)) for _ in range(STEPS)]
  return losses, nnx.as_pure(nnx.state(model, nnx.Param))


def test_logical_axis_names_read_outside_their_rules_name_the_fix():
  mesh = _mesh((4, 2), AxisType.Auto)
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='batch')
  with pytest.raises(ValueError) as info:
    _logical_train(mesh, tx, lambda loss: zerojax.nnx.value_and_grad(loss, tx))
  assert str(info.value) == (
    "params['down']['kernel']: its nnx.with_partitioning metadata reads P('mlp', 'embed'), and"
    " 'mlp' is not an axis of the mesh ('batch', 'model'): a logical name, and no"
    ' nnx.logical_axis_rules is active here to turn it into one. Run this under `with'
    ' nnx.logical_axis_rules(rules):` as when the model was created, or give the layouts'
    ' once: zero_stage(..., param_specs=zerojax.nnx.logical_param_specs(model, rules)).'
  )


@pytest.mark.parametrize('stage', [1, 3])
def test_logical_param_specs_give_the_layouts_once(stage):
  mesh = _mesh((4, 2), AxisType.Auto)
  ref_losses, ref_params = _logical_train(mesh, None, nnx.value_and_grad)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):  # as Flax creates it
    abstract = nnx.eval_shape(lambda: Logical(nnx.Rngs(0)))
  specs = zerojax.nnx.logical_param_specs(abstract, RULES)
  assert specs['up']['kernel'] == P(None, 'model')
  assert specs['down']['kernel'] == P('model', None)
  assert specs['up']['bias'] == P()
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis='batch', param_specs=specs)
  losses, params = _logical_train(mesh, tx, lambda loss: zerojax.nnx.value_and_grad(loss, tx))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, ref_params
  )
  # The tensor-parallel split kept; at stage 3 the ZeRO split beside it.
  want = P('batch', 'model') if stage == 3 else P(None, 'model')
  assert params['up']['kernel'].sharding.spec == want


def test_logical_param_specs_refuse_a_name_without_a_rule():
  with jax.set_mesh(_mesh((4, 2), AxisType.Auto)), nnx.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: Logical(nnx.Rngs(0)))
  with pytest.raises(ValueError) as info:
    zerojax.nnx.logical_param_specs(abstract, [('embed', None)])
  assert str(info.value) == (
    "params['down']['kernel']: logical axis 'mlp' has no rule in `rules` (known: ['embed'])."
    " Add ('mlp', MESH_AXIS_OR_None)."
  )


def test_param_specs_naming_an_axis_the_mesh_lacks_are_refused():
  mesh = _mesh((4, 2), AxisType.Auto)
  tx = zerojax.zero_stage(
    optax.adam(1e-3), 1, mesh=mesh, axis='batch', param_specs={'w': P('embed', 'mlp')}
  )
  with pytest.raises(ValueError) as info:
    zerojax.plan_for(tx, {'w': jax.ShapeDtypeStruct((32, 64), jnp.float32)})
  assert str(info.value) == (
    "param_specs['w'] is P('embed', 'mlp'), and 'embed' is not an axis of the mesh ('batch',"
    " 'model'). Logical axis names need their rules to become mesh axes:"
    ' param_specs=zerojax.nnx.logical_param_specs(params, rules) for NNX,'
    ' zerojax.linen.logical_param_specs(params, rules) for linen.'
  )


# The example (examples/nnx_minigpt.py): a miniGPT with attention, its blocks in a list or
# stacked and scanned; plain optax against the optimizer line, on the same bytes.

EXAMPLES = os.path.join(os.path.dirname(__file__), '..', 'examples')


def _example():
  if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
  import nnx_minigpt

  return nnx_minigpt


@pytest.mark.parametrize(
  'argv, ratio',
  [
    (['--stage', '2', '--mesh', '4x2'], 4),
    (['--stage', '3', '--scan', '--mesh', '4x2'], 4),
    (['--stage', '3', '--scan', '--mesh', '8x1'], 8),
  ],
)
def test_the_nnx_example_trains_as_plain_optax(argv, ratio):
  out = _example().main([*argv, '--steps', '4'])
  assert out['zerojax']['final_loss'] == pytest.approx(out['plain']['final_loss'], rel=1e-5)
  # The state each device holds is the plan's (Adam's moments split over 'batch', the
  # tensor-parallel splits kept), about 1/ratio of plain optax's. Not exactly: plain optax lets
  # the compiler split the unannotated biases over 'model' too (docs/training.md).
  plain, zero = out['plain']['state_bytes'], out['zerojax']['state_bytes']
  assert zero == out['zerojax']['plan_state_bytes']
  assert zero * ratio < 1.01 * plain, (zero, plain)


def _step_memory(example, mesh, layers, per_layer):
  """The compiled stage-3 step's memory: the example's scanned model, Flax's own split/merge
  step around zerojax.nnx.value_and_grad (per layer, or everything gathered up front)."""
  # Few tokens: the activations each layer saves stay small beside its weights.
  cfg = example.Config(layers=layers, width=256, hidden=1024, heads=4, seq_len=8, batch=8)
  grads = 'zerojax per layer' if per_layer else 'zerojax'
  compiled = example.compile_step(cfg, mesh, 3, scan=True, grads=grads)
  return zerojax.inspect.memory_stats(compiled), cfg


@pytest.mark.slow
def test_nnx_scan_gathers_one_layer_at_a_time():
  # The temporaries' slope per added layer, as for linen (tests/test_gather.py): gathered
  # where each layer runs, under nnx.scan and remat, a fraction of a layer (measured 0.22 of
  # its parameter bytes on 8 devices: its gradient's and update's shards, and the few
  # activations it saves); everything gathered up front, more than a layer (measured 2.35).
  example = _example()
  mesh = _mesh((8, 1), AxisType.Auto)
  slope = {}
  for per_layer in (True, False):
    (m2, cfg), (m6, _) = (
      _step_memory(example, mesh, 2, per_layer),
      _step_memory(example, mesh, 6, per_layer),
    )
    slope[per_layer] = (m6.temp - m2.temp) / 4
  w, h = cfg.width, cfg.hidden
  layer_bytes = 4 * (4 * w * w + 2 * w * h)  # attention's four projections, the MLP's pair
  assert slope[True] < layer_bytes / 3, (slope, layer_bytes)
  assert slope[False] >= layer_bytes, (slope, layer_bytes)
