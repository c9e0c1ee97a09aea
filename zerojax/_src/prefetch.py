"""`scan_layers`: a layer loop that gathers layer i+1 while layer i computes.

A scanned ZeRO-3 model gathers each layer's parameters where the layer runs;
the gather and the layer's compute then depend on each other, and the TPU
compiler runs them one after the other in the forward pass. Issuing the next
layer's gather first, with nothing in between that it depends on, lets the
collective run while the current layer computes: in the forward pass layer
i+1 is gathered during layer i, in the backward pass layer i-1 during layer
i's gradient.

Through autodiff a prefetched gather would be a loop carry, and `scan` keeps
every carry for the backward pass (each layer's whole parameters: ZeRO-3's
saving gone). So the loop has its own gradient (`jax.custom_vjp`): the forward
pass keeps each layer's input only; the backward pass gathers the layers again
(prefetching), recomputes each layer's forward (as a full `jax.checkpoint`
would) and reduce-scatters each layer's parameter gradient into its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import gather as gather_lib
from zerojax._src import quantize as quantize_lib


def scan_layers(
  body: Callable[[Any, Any], Any],
  init: Any,
  layers: Any,
  *,
  dtype: Any = None,
  prefetch: bool = True,
  mesh: Any = None,
  axis: Any = 'data',
) -> Any:
  """Runs `body(carry, layer)` over stacked layer parameters; returns the last carry.

  Inside `zerojax.value_and_grad(..., per_layer=True)` (stage 3), `layers`
  holds `zerojax.ShardedLeaf`s stacked along a leading layer axis; each step
  hands `body` its layer's parameters gathered (cast to `dtype` first), and
  with `prefetch` the next layer's gather is issued before the current layer
  runs, in the forward and the backward pass. The backward pass recomputes
  each layer's forward, as `jax.checkpoint` with no policy does (activations
  inside a layer are not kept), and gathers the parameters again; each layer's
  gradient is reduce-scattered into its shard (ZeRO++ quantized, if the plan
  says so). Leaves that are not ShardedLeafs are used whole, as stacked.

  Anywhere else (`prefetch=False`, or parameters that are not ShardedLeafs) it
  is `jax.lax.scan` over `jax.checkpoint(body)` with each layer gathered by
  `gather_leaves`.

  Args:
    body: `(carry, layer) -> carry`, the same pytree structure in and out.
    init: the first carry (e.g. the embedded tokens).
    layers: the stacked parameters, a leading dimension of one size (the
      layer count) on every leaf.
    dtype: compute dtype the parameters are cast to before they are gathered.
    prefetch: issue layer i+1's gather before layer i runs.
    mesh, axis: for the plain scan outside `value_and_grad` (see `gather_leaves`).

  Returns:
    The carry after the last layer.
  """
  leaves, treedef = jax.tree.flatten(layers, is_leaf=gather_lib.is_sharded_leaf)
  sharded = [gather_lib.is_sharded_leaf(x) for x in leaves]
  if not prefetch or not any(sharded):
    from zerojax._src import layers as layers_lib

    def plain(carry, layer):
      gathered = layers_lib.gather_leaves(layer, mesh=mesh, axis=axis, dtype=dtype)
      return body(carry, gathered), None

    return jax.lax.scan(jax.checkpoint(plain), init, layers)[0]
  stacked = [x.shard if s else x for x, s in zip(leaves, sharded)]
  # Stage 2: the whole parameters each device holds already (the "gather"
  # moves nothing; only gradients are reduce-scattered), sliced like the shards.
  wholes = [x.whole if s else None for x, s in zip(leaves, sharded)]
  sizes = {x.shape[0] for x in stacked}
  if len(sizes) != 1:
    raise ValueError(
      f'scan_layers: the stacked parameters have leading dimensions {sorted(sizes)}; every'
      ' leaf needs the same layer count first.'
    )
  (count,) = sizes
  meta = tuple(x.replace(shard=None, whole=None) if s else None for x, s in zip(leaves, sharded))
  layer_of = _layer_of(meta, dtype)
  # Closed-over arrays (constants, other parameters the body uses) become
  # explicit inputs, so their gradients are returned too.
  step, consts = jax.closure_convert(
    lambda carry, flat: body(carry, jax.tree.unflatten(treedef, flat)),
    init,
    layer_of(stacked, wholes, 0),
  )
  return _prefetched(step, count, meta, layer_of)(init, stacked, wholes, tuple(consts))


def _layer_of(meta: tuple, dtype: Any):
  def layer_of(stack, wholes, i):
    """Layer i's parameters: gathered (ShardedLeafs) or sliced (other leaves)."""
    take = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
    out = []
    for x, whole, m in zip(stack, wholes, meta):
      piece = take(x)
      out.append(piece if m is None else m.replace(shard=piece, whole=take(whole)).gather(dtype))
    return out

  return layer_of


def _scatter(grad: jax.Array, meta: Any, like: jax.Array) -> jax.Array:
  """A gathered layer parameter's gradient, reduce-scattered into its shard `like`."""
  if meta is None:
    return grad.astype(like.dtype)
  dim = meta.dim - (meta.ndim - like.ndim)  # the split dimension within one layer
  return quantize_lib.reduce_scatter(grad, meta.axes, dim, meta.quantize).astype(like.dtype)


def _prefetched(step, count: int, meta: tuple, layer_of):
  """The loop with its own gradient; see the module docstring."""

  def forward(init, stacked, wholes, consts):
    # Layers 0..count-2 run in the loop, each issuing its successor's gather
    # first; the last runs after it, on the parameters the loop carried out.
    def one(c, i):
      x, w = c
      following = layer_of(stacked, wholes, i + 1)
      return (step(x, w, *consts), following), x

    first = layer_of(stacked, wholes, 0)
    (x, w), inputs = jax.lax.scan(one, (init, first), jnp.arange(count - 1))
    return step(x, w, *consts), (inputs, x)

  @jax.custom_vjp
  def run(init, stacked, wholes, consts):
    return forward(init, stacked, wholes, consts)[0]

  def fwd(init, stacked, wholes, consts):
    out, (inputs, last_input) = forward(init, stacked, wholes, consts)
    # Kept for the backward pass: each layer's input and the shards, not the
    # gathered parameters.
    return out, (inputs, last_input, stacked, wholes, consts)

  def bwd(res, g):
    inputs, last_input, stacked, wholes, consts = res

    def grad_of(x, w, g, g_consts):
      _, vjp = jax.vjp(step, x, w, *consts)
      g_x, g_w, *g_c = vjp(g)
      return g_x, g_w, jax.tree.map(jnp.add, g_consts, tuple(g_c))

    def scatter(g_w, i):
      return [
        _scatter(gw, m, jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False))
        for gw, m, s in zip(g_w, meta, stacked)
      ]

    g_consts = jax.tree.map(jnp.zeros_like, consts)
    # The last layer, with layer count-2's gather issued first.
    w = layer_of(stacked, wholes, count - 1)
    previous = layer_of(stacked, wholes, count - 2) if count > 1 else None
    g, g_w, g_consts = grad_of(last_input, w, g, g_consts)
    last = scatter(g_w, count - 1)
    if count == 1:
      return g, [c[None] for c in last], None, g_consts

    def one(c, i):
      # Layer i (count-2 down to 1), its parameters gathered by the previous
      # iteration; layer i-1's gather is issued first.
      g, w, g_consts = c
      following = layer_of(stacked, wholes, i - 1)
      x = jax.lax.dynamic_index_in_dim(inputs, i, 0, keepdims=False)
      g, g_w, g_consts = grad_of(x, w, g, g_consts)
      return (g, following, g_consts), scatter(g_w, i)

    (g, w, g_consts), middle = jax.lax.scan(
      one, (g, previous, g_consts), jnp.arange(1, count - 1), reverse=True
    )
    x = jax.lax.dynamic_index_in_dim(inputs, 0, 0, keepdims=False)
    g, g_w, g_consts = grad_of(x, w, g, g_consts)
    first = scatter(g_w, 0)
    grads = [jnp.concatenate([a[None], b, c[None]], axis=0) for a, b, c in zip(first, middle, last)]
    return g, grads, None, g_consts  # the stage-2 wholes are constants

  run.defvjp(fwd, bwd)
  return run
