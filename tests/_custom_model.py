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


def _layered(remat: str, tags: tuple[str, ...], name: str = 'tagged'):
  """Three stacked layers in a `lax.scan`, each checkpointed with `remat`'s policy and tagging
  the activations in `tags` with zerojax.remat's names."""
  from jax.ad_checkpoint import checkpoint_name

  def tag(x, name):
    return checkpoint_name(x, name) if name in tags else x

  def layer(x, w):
    q = tag(x @ w['wq'], zerojax.remat.QKV)
    h = tag(jnp.tanh(q) @ w['w_in'], zerojax.remat.MLP_HIDDEN)
    return x + jnp.tanh(h) @ w['w_out'], None

  if remat != 'none':
    layer = jax.checkpoint(layer, policy=zerojax.remat.policy(remat))

  def loss_fn(params, x, plan):
    p = zerojax.gather(params, plan)
    return jnp.mean(jax.lax.scan(layer, x, p['layers'])[0] ** 2)

  def init_fn(key):
    k = jax.random.split(key, 3)
    shape = {'wq': (3, 64, 64), 'w_in': (3, 64, 128), 'w_out': (3, 128, 64)}
    return {
      'layers': {n: 0.1 * jax.random.normal(k[i], s) for i, (n, s) in enumerate(shape.items())}
    }

  return zerojax.inspect.ModelSpec(
    name=name,
    init_fn=init_fn,
    loss_fn=loss_fn,
    batch=lambda rows: jax.ShapeDtypeStruct((rows, 64), jnp.float32),
    stacked={'layers': True},
  ), layer


def tagged(remat='gathers'):
  """A model of one's own whose layers tag the query-like and MLP activations: the named
  policies that keep those apply to it."""
  return _layered(remat, (zerojax.remat.QKV, zerojax.remat.MLP_HIDDEN))[0]


def untagged(remat='gathers'):
  """The same model tagging only the query-like activation."""
  return _layered(remat, (zerojax.remat.QKV,), 'untagged')[0]
