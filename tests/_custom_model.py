"""A user's own model for `python -m zerojax plan --model _custom_model:spec`."""

import jax
import jax.numpy as jnp

import zerojax


def spec():
  def loss_fn(params, x, plan):
    p = zerojax.gather(params, plan)
    return jnp.mean(jnp.tanh(x @ p['w1']) @ p['w2'])

  return zerojax.inspect.ModelSpec(
    name='two-layer',
    init_fn=lambda key: {
      'w1': jax.random.normal(key, (64, 128)),
      'w2': jax.random.normal(key, (128, 64)),
    },
    loss_fn=loss_fn,
    batch=lambda rows: jax.ShapeDtypeStruct((rows, 64), jnp.float32),
  )


def wrong():
  return {'not': 'a ModelSpec'}
