"""The FSDP recipes JAX's own documentation teaches, in plain jax + optax (no zerojax).

These are the baselines zerojax is measured against, so they must not share its
code: nothing here imports zerojax. Each is written from the documentation's
description, for the benchmark's model (a stack of residual dense layers,
scanned) and optimizer (Adam):

- `gspmd_step`: "Distributed arrays and automatic parallelization". Put the
  parameters and the optimizer state in `NamedSharding`s split over the data
  axis, split the batch over it too, and let `jax.jit` place the collectives.
- `shard_map_step`: the FSDP example of the shard_map tutorial. Inside
  `jax.shard_map`, each layer `all_gather`s its own weight shard within the
  scan; autodiff turns that gather into a `psum_scatter` of the gradient; the
  gathered weights are named with `checkpoint_name` and a `jax.checkpoint`
  policy saves everything but them, so the backward pass gathers each layer
  again instead of keeping the whole model.
- `maxtext_shaped_step`: the layout of MaxText's FSDP for a dense decoder, as
  far as it can be reproduced without MaxText: every weight split over all the
  devices on its input ("embed") dimension, the batch split over them too, the
  scanned layers fully rematerialised (MaxText's default `remat_policy:
  full`), and the compiler placing the collectives (MaxText does not choose
  them: on a 2-D TPU torus its gradients are all-reduced).
- `replicated_step`: plain data parallelism (the numerics reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


# --- The model: residual dense layers, stacked along a leading layer axis.
def init_params(key, layers: int, width: int) -> dict:
  return {'w': jax.random.normal(key, (layers, width, width), jnp.float32) / jnp.sqrt(width)}


def layer(x, w):
  return x + jnp.tanh(x @ w)


def forward(params, x, gather=lambda w: w, policy=None):
  """Scans the layers; `gather` is applied to each layer's weight inside the loop."""

  def body(h, w):
    return layer(h, gather(w)), None

  if policy is not None:
    body = jax.checkpoint(body, policy=policy)
  h, _ = jax.lax.scan(body, x, params['w'])
  return h


def mse(pred, y):
  return jnp.mean((pred - y) ** 2)


# --- Plain data parallelism: everything replicated, the batch split.
def replicated_step(mesh, tx):
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: mse(forward(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rep = NamedSharding(mesh, P())
  return jax.jit(step, donate_argnums=(0, 1)), rep


# --- (a) "Distributed arrays and automatic parallelization": shardings in, jit decides.
def gspmd_step(mesh, tx, axis: str = 'data'):
  """Weights split over `axis` on their first per-layer dimension; the compiler does the rest."""
  w_sharding = NamedSharding(mesh, P(None, axis, None))

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: mse(forward(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1)), w_sharding


# --- (b) The shard_map tutorial's FSDP: gather per layer, remat only the gathered weights.
def shard_map_step(mesh, tx, axis: str = 'data'):
  w_sharding = NamedSharding(mesh, P(None, axis, None))

  # The tutorial's policy: save everything but the gathered weights. Spelled out,
  # because jax.checkpoint_policies.save_anything_except_these_names saves
  # everything in jax 0.10 (it returns True for every value), and the named
  # value's operand (the all_gather's output, the same bytes) must not be
  # saved either.
  def policy(prim, *_, **params):
    return prim.name not in ('name', 'all_gather')

  def gather(w):  # one layer's shard (width / N, width) -> the whole layer
    full = jax.lax.all_gather(w, axis, axis=0, tiled=True)
    return checkpoint_name(full, 'gathered')

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=({'w': P(None, axis, None)}, P(axis), P(axis)),
    out_specs=P(),
  )
  def loss_fn(params, x, y):
    return jax.lax.pmean(mse(forward(params, x, gather, policy), y), axis)

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1)), w_sharding


# --- (c) MaxText-shaped FSDP: split on the embed dimension, full remat, jit decides.
def maxtext_shaped_step(mesh, tx, axis: str = 'data'):
  w_sharding = NamedSharding(mesh, P(None, axis, None))
  remat = jax.checkpoint_policies.nothing_saveable

  def step(params, opt_state, x, y):
    def loss(p):
      return mse(forward(p, x, policy=remat), y)

    loss_value, grads = jax.value_and_grad(loss)(params)
    # MaxText constrains the gradients to the parameters' layout.
    grads = jax.lax.with_sharding_constraint(grads, {'w': w_sharding})
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_value

  return jax.jit(step, donate_argnums=(0, 1)), w_sharding


def place(params, tx, sharding):
  """Parameters in `sharding`, and Adam's state born in the same layout (jit's out_shardings)."""
  params = jax.device_put(params, sharding)
  state_shardings = jax.tree.map(
    lambda x: sharding if getattr(x, 'ndim', 0) == 3 else NamedSharding(sharding.mesh, P()),
    jax.eval_shape(tx.init, params),
  )
  return params, jax.jit(tx.init, out_shardings=state_shardings)(params)
