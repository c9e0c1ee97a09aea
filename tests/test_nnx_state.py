"""zerojax.nnx: NNX models created and placed in a ZeRO layout, gathered and differentiated."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import SCANNED_TERMS, ScannedNNX, max_rel_err, nnx_train
from _tolerance import EPS32, reordered
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._src.layouts import ZeroState


class Small(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(16, 64, rngs=rngs)
    self.fc2 = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jnp.tanh(self.fc1(x)))


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_nnx_optimizer_with_zero_stage(stage, auto_mesh):
  mesh = auto_mesh  # nnx.grad of a batch-split loss needs Auto axes (README: Explicit and Auto)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), NamedSharding(mesh, P('data')))
  ref, _ = nnx_train(ScannedNNX(32, 2, nnx.Rngs(0)), optax.adamw(1e-2), x)
  tx = zerojax.zero_stage(optax.adamw(1e-2), stage, mesh=mesh)
  model = zerojax.nnx.shard(ScannedNNX(32, 2, nnx.Rngs(0), zero=tx), tx)
  model, opt = nnx_train(model, tx, x)
  params, ref_params = nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)
  assert max_rel_err(params, ref_params) <= reordered(SCANNED_TERMS, steps=5)
  plan = zerojax.plan_for(tx, params)
  assert jax.tree.map(lambda a: a.sharding, params) == plan.params
  mu = opt.opt_state[0].mu['blocks']['fc1']['kernel'][...]
  assert mu.sharding.is_fully_replicated == (stage == 0)


def test_create_nnx_model_abstractly_then_sharded(mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  model = zerojax.nnx.create_model(lambda: ScannedNNX(32, 2, nnx.Rngs(0)), tx)
  kernel = model.blocks.fc1.kernel[...]
  assert kernel.shape == (2, 32, 128)
  # Split on the 32 rows: 128 columns / 8 = 16 would unalign TPU's 128 lanes.
  assert {s.data.shape for s in kernel.addressable_shards} == {(2, 4, 128)}
  eager = ScannedNNX(32, 2, nnx.Rngs(0))
  # The same initialisers and keys: created in its layout, the same numbers.
  assert max_rel_err(nnx.state(model, nnx.Param), nnx.state(eager, nnx.Param)) == 0.0


def test_replicating_the_nnx_state_is_refused_on_an_explicit_mesh(explicit_mesh):
  # Flax's data-parallel recipe: device_put the model and optimizer state replicated.
  model = Small(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh), wrt=nnx.Param
  )
  state = jax.device_put(nnx.state((model, optimizer)), NamedSharding(explicit_mesh, P()))
  nnx.update((model, optimizer), state)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  with pytest.raises(ValueError) as err:
    nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
  assert str(err.value) == (
    "The optimizer state is replicated on every device (opt_state[0].mu['fc1']['bias'],"
    " opt_state[0].mu['fc1']['kernel'], opt_state[0].mu['fc2']['bias'],"
    " opt_state[0].mu['fc2']['kernel'] and 4 more), where stage 1 splits it over ('data',):"
    ' it was moved out of its ZeRO layout, e.g. by jax.device_put(state, NamedSharding(mesh,'
    ' P())) as in the plain data-parallel recipe. Leave the model and optimizer state where'
    ' zerojax placed them, and device_put only the batch.'
  )
  # As the message says: without the device_put the update runs, in the plan's layout.
  model = Small(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, zerojax.zero_stage(optax.adam(1e-3), 1, mesh=explicit_mesh), wrt=nnx.Param
  )
  nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
  assert not optimizer.opt_state[0].mu['fc1']['kernel'][...].sharding.is_fully_replicated


def test_stage3_nnx_on_an_explicit_mesh_gathered_inside_value_and_grad(explicit_mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=explicit_mesh)
  model = zerojax.nnx.shard(Small(nnx.Rngs(0)), tx)
  assert isinstance(model, Small) and type(model) is Small  # the model's own class, unchanged
  x = jax.device_put(jnp.ones((16, 16)), NamedSharding(explicit_mesh, P('data')))
  grad_fn = zerojax.nnx.value_and_grad(
    lambda m, b: jnp.mean(zerojax.nnx.gathered(m, tx)(b['x']) ** 2), tx, per_layer=True
  )
  want = nnx.grad(lambda m: jnp.mean(m(jnp.ones((16, 16))) ** 2))(Small(nnx.Rngs(0)))
  _, grads = nnx.jit(lambda m, b: grad_fn(m, b))(model, {'x': x})
  assert max_rel_err(grads, want) <= reordered(16 + 16 + 64 + 8)  # rows, fc1, fc2


# --- A Variable's layout in every form Flax and its tutorials write it (`out_sharding`)


def _forms(mesh, tensor):
  """A model whose layers declare their layouts each in another form; `tensor` is the mesh
  axis they split over (None on a 1-D mesh). RULES map the logical names."""
  init = nnx.initializers.lecun_normal()
  part = lambda sharding, **kw: dict(kernel_init=nnx.with_partitioning(init, sharding, **kw))
  rules = (('embed', None), ('mlp', tensor))

  class Forms(nnx.Module):
    def __init__(self, rngs):
      linear = lambda **kw: nnx.Linear(16, 16, rngs=rngs, **kw)
      self.axes = linear(**part((None, tensor), mesh=mesh))  # a tuple of mesh axis names
      self.spec = linear(**part(P(tensor, None), mesh=mesh))  # a PartitionSpec
      self.named = linear(**part(NamedSharding(mesh, P(None, tensor))))  # the JAX AI Stack's
      self.logical = linear(**part(('embed', 'mlp'), mesh=mesh))  # under nnx.logical_axis_rules
      self.local = linear(**part(('embed', 'mlp'), mesh=mesh, sharding_rules=rules))
      self.none = linear()  # no annotation

    def __call__(self, x, gather=lambda layer: layer):
      for layer in (self.axes, self.spec, self.named, self.logical, self.local, self.none):
        x = jnp.tanh(gather(layer)(x))
      return x

  want = {
    'axes': P(None, tensor),
    'spec': P(tensor, None),
    'named': P(None, tensor),
    'logical': P(None, tensor),
    'local': P(None, tensor),
    'none': P(),
  }
  return Forms, rules, want


FORM_MESHES = {'1d': ((8,), ('data',), None), '2d': ((4, 2), ('data', 'model'), 'model')}


@pytest.mark.parametrize('shape', FORM_MESHES)
def test_every_form_of_layout_metadata_is_read(shape):
  sizes, names, tensor = FORM_MESHES[shape]
  mesh = jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
  Forms, rules, want = _forms(mesh, tensor)
  with nnx.logical_axis_rules(rules):
    abstract = nnx.eval_shape(lambda: Forms(nnx.Rngs(0)))
  specs = zerojax.nnx.logical_param_specs(abstract, rules)
  assert {k: specs[k]['kernel'] for k in want} == want
  assert {specs[k]['bias'] for k in want} == {P()}

  with nnx.logical_axis_rules(rules):
    tx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh)
    eager = Forms(nnx.Rngs(0))  # placed by Flax from its annotations
    plan = zerojax.plan_for(tx, nnx.state(eager, nnx.Param))  # read from the placed arrays
    layout = lambda m: jax.tree.map(lambda a: a.sharding, nnx.state(m, nnx.Param))
    model = zerojax.nnx.create_model(lambda: Forms(nnx.Rngs(0)), tx)
    assert layout(model) == plan.params
    # The same initialisers and keys, jitted: the same numbers to one rounding of the scale.
    assert max_rel_err(nnx.state(model, nnx.Param), nnx.state(eager, nnx.Param)) <= EPS32
    assert layout(zerojax.nnx.shard(Forms(nnx.Rngs(0)), tx)) == plan.params
    for k, spec in want.items():  # the declared split kept, ZeRO's on the other dimension
      got = model.__getattribute__(k).kernel[...].sharding.spec
      assert [e for e in got if e not in (None, 'data')] == [e for e in spec if e], (k, got)
      assert 'data' in got, (k, got)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # tx.init
    state = optimizer.opt_state
    mu = (state.inner if isinstance(state, ZeroState) else state)[0].mu  # 2-D: layouts recorded
    at_rest = nnx.as_pure(plan.params)
    assert {k: mu[k]['kernel'][...].sharding for k in want} == {
      k: at_rest[k]['kernel'] for k in want
    }

    x = jax.random.normal(jax.random.key(1), (16, 16))
    loss = lambda m, b: jnp.mean(m(b['x']) ** 2)
    want_loss, want_grads = nnx.value_and_grad(loss)(Forms(nnx.Rngs(0)), {'x': x})
    layered = lambda m, b: jnp.mean(m(b['x'], lambda layer: zerojax.nnx.gathered(layer, tx)) ** 2)
    rows = {'x': jax.device_put(x, NamedSharding(mesh, P('data')))}
    fns = (zerojax.nnx.value_and_grad(layered, tx, per_layer=True),
           zerojax.nnx.value_and_grad(loss, tx))  # fmt: skip
    tol = reordered(16 + 6 * 16)
    for fn in fns:
      got_loss, grads = nnx.jit(fn)(model, rows)
      assert abs(float(got_loss) - float(want_loss)) <= tol * abs(float(want_loss))
      assert max_rel_err(grads, want_grads) <= tol
    for fn in fns:

      @nnx.jit
      def step(model, optimizer, batch, fn=fn):
        _, grads = fn(model, batch)
        optimizer.update(model, grads)

      step(model, optimizer, rows)
      assert layout(model) == plan.params


def test_layout_metadata_for_another_mesh_is_named():
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh, other = jax.make_mesh((4, 2), ('data', 'model'), axis_types=auto), None
  other = jax.make_mesh((2, 4), ('data', 'model'), axis_types=auto)
  Forms, rules, _ = _forms(mesh, 'model')
  tx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=other)
  with nnx.logical_axis_rules(rules), pytest.raises(ValueError) as err:
    zerojax.nnx.create_model(lambda: Forms(nnx.Rngs(0)), tx)
  devices = list(range(8))
  assert str(err.value) == (
    "params['axes']['kernel']: its sharding metadata ((None, 'model')) is for the mesh"
    f" {{'data': 4, 'model': 2}} over devices {devices}, and the optimizer was built on the"
    f" mesh {{'data': 2, 'model': 4}} over devices {devices}: a layout means something on its"
    ' own mesh only. Build the optimizer on the mesh the model was annotated with'
    " (zero_stage(..., mesh=that_mesh)), or annotate the model on the optimizer's mesh."
  )


def test_create_model_takes_the_programs_own_rngs(mesh):
  # Flax's examples/gemma makes its nnx.Rngs outside the function that builds the model.
  class WithDropout(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(16, 64, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError) as e:
    zerojax.nnx.create_model(lambda: WithDropout(rngs), tx)
  assert str(e.value) == (
    'zerojax.nnx.create_model: make_model uses an NNX object made outside it (an nnx.Rngs it'
    ' closes over), which cannot be advanced inside the abstract and jitted creation. Pass it'
    ' as an argument: zerojax.nnx.create_model(lambda rngs: Model(rngs=rngs), tx, rngs); or'
    ' build it inside: lambda: Model(rngs=nnx.Rngs(0)).'
  )
  model = zerojax.nnx.create_model(lambda r: WithDropout(r), tx, rngs)
  assert 'data' in model.fc.kernel[...].sharding.spec
  eager_rngs = nnx.Rngs(0)
  eager = WithDropout(eager_rngs)
  assert max_rel_err(nnx.state(model, nnx.Param), nnx.state(eager, nnx.Param)) == 0.0
  # The program's stream moved on as the eager creation moved its own.
  assert int(rngs.default.count[...]) == int(eager_rngs.default.count[...]) > 0


def test_a_model_naming_layouts_over_the_zero_axis_gets_the_right_cause_and_fix():
  # Flax's examples/gemma names each layer's output layout (`out_sharding=`) on an Explicit
  # ('fsdp', 'tensor') mesh: inside value_and_grad's per-device region 'fsdp' is manual.
  mesh = jax.make_mesh((4, 2), ('fsdp', 'tensor'))
  part = lambda axes: nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)

  class Named(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(8, 16, kernel_init=part(('fsdp', 'tensor')), rngs=rngs)
      self.b = nnx.Linear(16, 8, kernel_init=part(('tensor', 'fsdp')), rngs=rngs)

    def __call__(self, x):
      h = jnp.tanh(self.a(x, out_sharding=P('fsdp', 'tensor')))
      return self.b(h, out_sharding=P('fsdp', None))

  loss = lambda m, b: jnp.mean(m(b['x']) ** 2)
  x = jax.random.normal(jax.random.key(1), (16, 8))
  with jax.set_mesh(mesh):
    want_loss, want = nnx.value_and_grad(loss)(Named(nnx.Rngs(0)), {'x': x})
    tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, axis='fsdp')
    model = Named(nnx.Rngs(0))
    rows = {'x': jax.device_put(x, NamedSharding(mesh, P('fsdp')))}
    with pytest.raises((ValueError, NotImplementedError)) as e:
      nnx.jit(zerojax.nnx.value_and_grad(loss, tx))(model, rows)
    notes = getattr(e.value, '__notes__', [])
    assert not any('closes over' in n for n in notes), notes  # not the batch: never named
    assert (
      "zerojax.value_and_grad runs the loss on each device's part of the batch, in a region"
      " where the ZeRO axes ('fsdp',) are manual, and the model names a layout over one of them"
      ' there (an out_sharding= or jax.sharding.reshard naming it), which JAX refuses inside'
      ' such a region. Pass manual=False (zerojax.value_and_grad(loss_fn, tx, manual=False),'
      ' or zerojax.nnx.value_and_grad): the loss then runs on the whole batch'
    ) in notes[0]
    # The first fix it names: zerojax's gradient with the collectives the compiler's, at
    # every stage, the model gathered per layer where it is split (stage 3).
    for stage in range(4):
      ztx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis='fsdp')
      layered = lambda m, b, ztx=ztx: loss(zerojax.nnx.gathered(m, ztx), b)
      placed = zerojax.nnx.shard(Named(nnx.Rngs(0)), ztx)
      fn = zerojax.nnx.value_and_grad(layered, ztx, manual=False)
      got_loss, grads = nnx.jit(fn)(placed, rows)
      tol = reordered(16 + 8 + 16)
      assert abs(float(got_loss) - float(want_loss)) <= tol * abs(float(want_loss)), stage
      assert max_rel_err(grads, want) <= tol, stage
      plan = zerojax.plan_for(ztx, nnx.state(placed, nnx.Param))
      if stage >= 2:  # reduce-scattered into the plan's gradient layout
        assert nnx.as_pure(grads)['a']['kernel'].sharding == nnx.as_pure(plan.grads)['a']['kernel']
    with pytest.raises(ValueError, match=r'manual=False\) runs the loss once on the whole batch'):
      zerojax.value_and_grad(lambda p, b: 0.0, tx, manual=False, micro_batches=2)
    # The fix the note names: the model's own gradient and the optimizer line alone.
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
      value, grads = nnx.value_and_grad(loss)(model, batch)
      optimizer.update(model, grads)
      return value, grads

    got_loss, grads = step(model, optimizer, rows)
  tol = reordered(16 + 8 + 16)
  assert abs(float(got_loss) - float(want_loss)) <= tol * abs(float(want_loss))
  assert max_rel_err(grads, want) <= tol
  assert model.a.kernel[...].sharding.spec == P('fsdp', 'tensor')  # still split at rest
