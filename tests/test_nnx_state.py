"""zerojax.nnx: NNX models created and placed in a ZeRO layout, gathered and differentiated."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import SCANNED_TERMS, ScannedNNX, max_rel_err, nnx_train
from _tolerance import reordered
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax


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
