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
pass keeps each layer's activations, not its gathered parameters (as
`jax.checkpoint(policy=zerojax.recompute_gathers)` does; with `remat='full'`
only each layer's input, recomputing the layer as a plain `jax.checkpoint`
would); the backward pass gathers the layers again (prefetching) and
reduce-scatters each layer's parameter gradient into its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import gather as gather_lib
from zerojax._src import plan as plan_lib
from zerojax._src import quantize as quantize_lib
from zerojax._src import reduction


def scan_layers(
  body: Callable[[Any, Any], Any],
  init: Any,
  layers: Any,
  zero: Any,
  *,
  dtype: Any = None,
  prefetch: bool = True,
  remat: str = 'gathers',
) -> Any:
  """Runs `body(carry, layer)` over stacked layer parameters; returns the last carry.

  Inside `zerojax.value_and_grad(..., per_layer=True)` (stage 3), `layers`
  holds `zerojax.ShardedLeaf`s stacked along a leading layer axis; each step
  hands `body` its layer's parameters gathered (cast to `dtype` first), and
  with `prefetch` the next layer's gather is issued before the current layer
  runs, in the forward and the backward pass. The backward pass gathers the
  parameters again; each layer's gradient is reduce-scattered into its shard
  (ZeRO++ quantized, if the plan says so). Leaves that are not ShardedLeafs
  are used whole, as stacked. One more layer's gathered parameters are live
  than without prefetching: the price of the overlap.

  Anywhere else (`prefetch=False`, or parameters that are not ShardedLeafs) it
  is `jax.lax.scan` over `jax.checkpoint(body, policy=...)` (the `remat`
  policy) with each layer gathered by `zerojax.gather`.

  Args:
    body: `(carry, layer) -> carry`, the same pytree structure in and out.
    init: the first carry (e.g. the embedded tokens).
    layers: the stacked parameters, a leading dimension of one size (the
      layer count) on every leaf.
    zero: which axes the layers are split over: the optimizer from
      `zerojax.zero_stage`, its `zerojax.config_of(tx)`, or its plan.
    dtype: compute dtype the parameters are cast to before they are gathered.
    prefetch: issue layer i+1's gather before layer i runs.
    remat: what the backward pass computes again. 'gathers' (default): only
      the gathers; each layer's activations are kept, as under
      `zerojax.recompute_gathers` (no forward matmul runs twice). 'full': the
      whole layer, from its input (the least memory: a layer's activations
      live only while it runs).

  Returns:
    The carry after the last layer.
  """
  if remat not in ('gathers', 'full'):
    raise ValueError(f"scan_layers: remat must be 'gathers' or 'full', got {remat!r}.")
  leaves, treedef = jax.tree.flatten(layers, is_leaf=gather_lib.is_sharded_leaf)
  sharded = [gather_lib.is_sharded_leaf(x) for x in leaves]
  _check_layer_axis(layers)
  if not prefetch or not any(sharded):

    def plain(carry, layer):
      gathered = gather_lib.gather(layer, zero, dtype=dtype)
      return body(carry, gathered), None

    policy = gather_lib.recompute_gathers if remat == 'gathers' else None
    return jax.lax.scan(jax.checkpoint(plain, policy=policy), init, layers)[0]
  stacked = [x.shard if s else x for x, s in zip(leaves, sharded)]
  # update_on='stream': gradients are taken with respect to host-memory sinks;
  # each layer's gradient goes to its sink as soon as its reduce-scatter is done.
  sinks = [x.sink if s else None for x, s in zip(leaves, sharded)]
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
  meta = tuple(
    x.replace(shard=None, whole=None, sink=None) if s else None for x, s in zip(leaves, sharded)
  )
  layer_of = _layer_of(meta, dtype)
  # Closed-over arrays (constants, other parameters the body uses) become
  # explicit inputs, so their gradients are returned too.
  step, consts = jax.closure_convert(
    lambda carry, flat: body(carry, jax.tree.unflatten(treedef, flat)),
    init,
    layer_of(stacked, wholes, 0),
  )
  dtypes = tuple(None if x is None else x.dtype for x in sinks)
  run = _prefetched(step, count, meta, layer_of, remat, dtypes)
  return run(init, stacked, wholes, tuple(consts), sinks)


def _check_layer_axis(layers: Any) -> None:
  """Raises ValueError, before the loop is traced, where a leaf of `layers` is split along its
  leading (layer) axis: by ZeRO (a ShardedLeaf) or by its own layout (an array's sharding)."""
  flat = jax.tree_util.tree_flatten_with_path(layers, is_leaf=gather_lib.is_sharded_leaf)[0]
  for path, x in flat:
    if gather_lib.is_sharded_leaf(x):
      if x.dim == 0:
        raise gather_lib.layer_axis_split(x.path, x.axes, 0)
      continue
    spec = plan_lib.spec_of(x)
    if spec is not None and len(spec) and spec[0] is not None:
      raise gather_lib.layer_axis_split(f'layers{jax.tree_util.keystr(path)}', spec[0], 0)


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


class _Residuals:
  """What the loop keeps of each layer for its backward pass, decided once per trace.

  `jax.vjp(step, x, w, *consts)` keeps what the layer's backward needs: its
  activations, its input, and values of the parameters (the gathered `w`
  itself, casts or reshapes of it). With `remat='gathers'` those that depend
  on the layer's input are kept per layer, stacked by the forward loop; those
  computed from the parameters and constants alone are not (they would be a
  copy of every layer's gathered parameters) and are taken again in the
  backward pass from the re-gathered parameters. With `remat='full'` only the
  layer's input is kept and the backward pass runs the layer's forward again.
  """

  def __init__(self, step, remat: str):
    self.step, self.remat = step, remat
    self.keep: list[bool] | None = None

  def split(self, x, w, consts) -> tuple[Any, list]:
    """The layer's output and what is kept for its backward pass."""
    if self.remat == 'full':
      return self.step(x, w, *consts), jax.tree.leaves(x)
    y, pullback = jax.vjp(self.step, x, w, *consts)
    if self.keep is None:
      closed = jax.make_jaxpr(lambda x, w, c: jax.tree.leaves(jax.vjp(self.step, x, w, *c)[1]))(
        x, w, consts
      )
      num_x, num_w = len(jax.tree.leaves(x)), len(jax.tree.leaves(w))
      deps = reduction.output_deps(closed, num_x, num_w)
      self.keep = [reduction.depends_on_params(d) for d in deps]  # "params" here: the input
    return y, [r for r, k in zip(jax.tree.leaves(pullback), self.keep) if k]

  def pullback(self, kept: list, w, consts, like_x):
    """The layer's pullback from what was kept and its re-gathered parameters."""
    if self.remat == 'full':
      x = jax.tree.unflatten(jax.tree.structure(like_x), kept)
      return jax.vjp(self.step, x, w, *consts)[1]
    # Traced on a stand-in input: only the residuals of `w` and `consts` are
    # used from it; XLA drops the rest of this forward as dead code.
    _, fresh = jax.vjp(self.step, jax.tree.map(jnp.zeros_like, like_x), w, *consts)
    leaves, treedef = jax.tree.flatten(fresh)
    kept = iter(kept)
    return treedef.unflatten([next(kept) if k else r for r, k in zip(leaves, self.keep)])


def _prefetched(step, count: int, meta: tuple, layer_of, remat: str, sink_dtypes: tuple):
  """The loop with its own gradient; see the module docstring and `_Loop`."""
  loop = _Loop(step, count, meta, layer_of, _Residuals(step, remat), sink_dtypes)

  @jax.custom_vjp
  def run(init, stacked, wholes, consts, sinks):
    return loop.forward(init, stacked, wholes, consts, keep=False)[0]

  run.defvjp(loop.fwd, loop.bwd)
  return run


class _Loop:
  """The prefetching layer loop's forward pass and its backward pass.

  With `update_on='stream'` (a dtype in `sink_dtypes` for a leaf), the leaf's
  gradient is taken with respect to its sink: each layer's reduce-scattered
  gradient goes to host memory from inside the backward loop, and every layer
  runs in that loop (see `bwd`).
  """

  def __init__(self, step, count: int, meta: tuple, layer_of, residuals, sink_dtypes: tuple):
    self.step, self.count, self.meta, self.layer_of = step, count, meta, layer_of
    self.residuals, self.sink_dtypes = residuals, sink_dtypes

  def forward(self, init, stacked, wholes, consts, keep: bool):
    """Layers 0..count-2 run in the loop, each issuing its successor's gather first; the
    last runs after it, on the parameters the loop carried out."""

    def layer(x, w):
      if keep:
        return self.residuals.split(x, w, consts)
      return self.step(x, w, *consts), []

    def one(c, i):
      x, w = c
      following = self.layer_of(stacked, wholes, i + 1)
      y, kept = layer(x, w)
      return (y, following), kept

    first = self.layer_of(stacked, wholes, 0)
    (x, w), kept = jax.lax.scan(one, (init, first), jnp.arange(self.count - 1))
    y, last = layer(x, w)
    return y, (kept, last)

  def fwd(self, init, stacked, wholes, consts, sinks):
    out, (kept, last) = self.forward(init, stacked, wholes, consts, keep=True)
    # Kept for the backward pass: each layer's residuals that depend on its
    # input (activations), and the shards; not the gathered parameters.
    return out, (kept, last, init, stacked, wholes, consts)

  def bwd(self, res, g):
    """The gradients of the loop's inputs. Layers run backward in one loop, the gather of layer
    i-1 issued before layer i's gradient. Without sinks the last and first layers run outside
    it (no gather issued past layer 0), and the stacks are assembled after it; with sinks
    every layer runs in it (each gradient written into its host stack by the loop), its last
    iteration issuing layer 0's gather again."""
    kept, last_kept, like_x, stacked, wholes, consts = res
    ctx = (stacked, wholes, consts, like_x)
    g_consts = jax.tree.map(jnp.zeros_like, consts)
    if any(d is not None for d in self.sink_dtypes):
      kept_at = self._streamed_residuals(kept, last_kept)
      start = (g, self.layer_of(stacked, wholes, self.count - 1), g_consts)
      indices = jnp.arange(self.count)
      (g, _, g_consts), grads = self._backward(ctx, start, kept_at, indices, clamped=True)
      return self._outputs(g, grads, g_consts)
    # The last layer, with layer count-2's gather issued first.
    w = self.layer_of(stacked, wholes, self.count - 1)
    previous = self.layer_of(stacked, wholes, self.count - 2) if self.count > 1 else None
    g, g_w, g_consts = self._grad_of(ctx, last_kept, w, g, g_consts)
    last = self._scatter(stacked, g_w, self.count - 1)
    if self.count == 1:
      return self._outputs(g, [c[None] for c in last], g_consts)
    kept_at = lambda i: [jax.lax.dynamic_index_in_dim(r, i, 0, keepdims=False) for r in kept]
    start = (g, previous, g_consts)
    indices = jnp.arange(1, self.count - 1)
    (g, w, g_consts), middle = self._backward(ctx, start, kept_at, indices, clamped=False)
    g, g_w, g_consts = self._grad_of(ctx, kept_at(0), w, g, g_consts)
    first = self._scatter(stacked, g_w, 0)
    grads = [jnp.concatenate([a[None], b, c[None]], axis=0) for a, b, c in zip(first, middle, last)]
    return self._outputs(g, grads, g_consts)

  def _backward(self, ctx, start, kept_at, indices, clamped: bool):
    """The backward loop over `indices` (in reverse): layer i's gradient on parameters gathered
    by the previous iteration, layer i-1's gather issued first (`clamped` at layer 0 where the
    loop reaches it)."""
    stacked, wholes = ctx[0], ctx[1]

    def one(c, i):
      g, w, g_consts = c
      following = self.layer_of(stacked, wholes, jnp.maximum(i - 1, 0) if clamped else i - 1)
      g, g_w, g_consts = self._grad_of(ctx, kept_at(i), w, g, g_consts)
      return (g, following, g_consts), self._scatter(stacked, g_w, i)

    return jax.lax.scan(one, start, indices, reverse=True)

  def _streamed_residuals(self, kept, last_kept):
    """Layer i's residuals inside the one loop: the last layer's are those the forward loop
    left outside its stack."""
    if self.count == 1:
      return lambda i: last_kept

    def kept_at(i):
      at = jnp.minimum(i, self.count - 2)
      inner = [jax.lax.dynamic_index_in_dim(r, at, 0, keepdims=False) for r in kept]
      return [jnp.where(i == self.count - 1, a, b) for a, b in zip(last_kept, inner)]

    return kept_at

  def _grad_of(self, ctx, kept_i, w, g, g_consts):
    _, _, consts, like_x = ctx
    g_x, g_w, *g_c = self.residuals.pullback(kept_i, w, consts, like_x)(g)
    return g_x, g_w, jax.tree.map(jnp.add, g_consts, tuple(g_c))

  def _scatter(self, stacked, g_w, i):
    """Layer i's parameter gradients reduce-scattered into their shards (to host memory for
    a streamed leaf)."""
    out = []
    for gw, m, s, dtype in zip(g_w, self.meta, stacked, self.sink_dtypes):
      gw = _scatter(gw, m, jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False))
      out.append(gw if dtype is None else jax.device_put(gw.astype(dtype), jax.memory.Space.Host))
    return out

  def _outputs(self, g, grads, g_consts):
    """The cotangents of (init, stacked, wholes, consts, sinks): the stacked gradients go to
    `stacked`, or to the sinks (in host memory); the stage-2 wholes are constants."""
    on_device = [None if d is not None else x for x, d in zip(grads, self.sink_dtypes)]
    to_sinks = [x if d is not None else None for x, d in zip(grads, self.sink_dtypes)]
    return g, on_device, None, g_consts, to_sinks
