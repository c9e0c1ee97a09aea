"""zerojax.linen: the gather adapter keeps module names and works with any mutable collection."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, reordered

import zerojax


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64)(x)  # auto-named Dense_0, Dense_1
    self.sow('intermediates', 'hidden', h)
    return nn.Dense(16)(jnp.tanh(h))


class Model(nn.Module):
  zero: object = None

  @nn.compact
  def __call__(self, x):
    block = Block if self.zero is None else zerojax.linen.gathered(Block, self.zero)
    return block()(x)


@pytest.mark.parametrize('stage', [2, 3])
def test_names_and_mutable_collections_are_the_unwrapped_models(stage, auto_mesh):
  x = jax.random.normal(jax.random.key(1), (16, 16))
  plain = Model()
  params = plain.init(jax.random.key(0), x)['params']
  tx = zerojax.zero_stage(optax.sgd(0.1), stage, mesh=auto_mesh)
  wrapped = Model(zero=tx)
  # The same names: the unwrapped model's parameters (and checkpoints) fit the wrapped one.
  wrapped_params = jax.eval_shape(wrapped.init, jax.random.key(0), x)['params']
  assert jax.tree.structure(wrapped_params) == jax.tree.structure(params)
  assert sorted(params['Block_0']) == ['Dense_0', 'Dense_1']
  placed = jax.device_put(params, zerojax.plan_for(tx, params).params)
  # Any mutable collection: intermediates sown inside the gathered block come back.
  run = jax.jit(lambda p, x: wrapped.apply({'params': p}, x, mutable=['intermediates']))
  out, state = run(placed, x)
  want, want_state = plain.apply({'params': params}, x, mutable=['intermediates'])
  assert_close(out, want, reordered(16 + 64))
  got_hidden = state['intermediates']['Block_0']['hidden'][0]
  assert_close(got_hidden, want_state['intermediates']['Block_0']['hidden'][0], reordered(16))
  assert np.asarray(got_hidden).shape == (16, 64)
