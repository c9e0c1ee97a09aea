"""`zerojax.value_and_grad`: the global batch's loss and gradient, with ZeRO's collectives in place.

The loss runs per device inside `jax.shard_map` over the ZeRO axes, on that
device's rows of the batch, one micro-batch after another; the gradient's
reduction is placed here rather than left to the compiler:

- stages 0-1: each device accumulates its own unreduced gradient over the
  micro-batches and one collective runs after the loop: an all-reduce at
  stage 0, a reduce-scatter into the optimizer state's shards at stage 1;
- stages 2-3: each micro-batch's gradient is reduce-scattered (`psum_scatter`,
  a real reduce-scatter even on CPU) into an accumulator holding one shard;
- with `per_layer=True` the loss sees split parameters as `ShardedLeaf`s and
  the model's own gathers (`zerojax.gather` and its linen and NNX adapters)
  are explicit all-gathers whose transposes reduce-scatter each layer's
  gradient as the backward pass reaches it.

What the per-device parts mean for the whole batch (scalar means,
`WeightedMean`s, per-row aux, random keys) is `reduction`'s. Every decision
about a parameter leaf (where it is split at rest and as a gradient, who
gathers it, its quantization) is made once, in `routes_lib.LeafRoute`, before tracing.
Other mesh axes (tensor parallelism) stay under the compiler's control, but for
each leaf's own collectives: those run manual over the tensor axes the leaf is
split over too (`gather.on_free_axes`), so that a chip gathers and reduce-scatters
only its tensor part (XLA would otherwise make the operand whole over them first).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax._src import compat, jaxprs, reduction, runtime, streaming, transform
from zerojax._src import frozen as frozen_lib
from zerojax._src import gather as gather_lib
from zerojax._src import grad_routes as routes_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import quantize as quantize_lib
from zerojax._src import update as update_lib

# -- per device -----------------------------------------------------------------


def _host_finish(
  noted: streaming.Noted, parts: list, weight: jax.Array, dtype: Any, weighted: bool
) -> jax.Array:
  """A streamed gradient's micro-batch parts summed and divided by `weight` in host memory, by
  the host, in the arithmetic of the device's accumulator (`dtype`).

  It runs after the per-device region, because the TPU compiler places a host
  computation inside `shard_map` on the device. The streamed update finishes
  the noted parts inside its own host computation instead, and this one is then
  dropped (see `streaming`).
  """
  host = jax.memory.Space.Host
  how = streaming.Parts(tuple(parts), jax.device_put(weight, host), dtype, weighted)
  run = compat.compute_on_host(
    functools.partial(streaming.finish, how), out_memory_spaces=host, typed_as_device=False
  )
  return noted.note(run(how.parts, how.weight), how)


def _traced_loss(r: routes_lib.Routes, loss_fn, treedef, rebuild, diff, mb, args):
  """The loss of one part as (total, weight, aux). What the loss raises keeps its type, with a
  note on what zerojax changed around it: shards in place of split parameters, and part of the
  batch in place of the whole."""
  try:
    out = loss_fn(jax.tree.unflatten(treedef, rebuild(diff)), mb, *args)
  except Exception as e:
    rows = jax.tree.leaves(mb)[0].shape[0]
    split = [route.path for route in r.leaves if route.model_split is not None]
    if split:
      e.add_note(
        f'zerojax.value_and_grad(per_layer=True) handed the loss {len(split)} split'
        f' parameter(s) as shards ({", ".join(split[:3])}{", ..." if len(split) > 3 else ""}),'
        ' for each layer to gather: wrap linen blocks in zerojax.linen.gathered, NNX layers in'
        ' zerojax.nnx.gathered, or call zerojax.gather on the parameters before use.'
      )
    if runtime.is_manual_axis_layout_error(e):
      e.add_note(
        "zerojax.value_and_grad runs the loss on each device's part of the batch, in a region"
        f' where the ZeRO axes {r.axes} are manual, and the model names a layout over one of'
        ' them there (an out_sharding= or jax.sharding.reshard naming it), which JAX refuses'
        ' inside such a region. Pass manual=False (zerojax.value_and_grad(loss_fn, tx,'
        ' manual=False), or zerojax.nnx.value_and_grad): the loss then runs on the whole batch'
        " and the compiler places ZeRO's collectives; or take the model's own gradient"
        ' (nnx.value_and_grad or jax.value_and_grad inside jit) with the optimizer line alone;'
        ' or name the layouts without the ZeRO axes.'
      )
      raise
    e.add_note(
      f'zerojax.value_and_grad ran the loss on one part of the batch ({rows} rows: one'
      " device's micro-batch). An array the loss closes over keeps the whole batch's rows:"
      ' pass batch-shaped arrays (weights, masks, targets) inside `batch`.'
    )
    raise
  loss, aux = out if r.has_aux else (out, None)
  total, weight = reduction.as_weighted(loss)
  return total, weight, aux  # weight None: a plain mean, one per part


@dataclasses.dataclass(frozen=True)
class Options:
  """`value_and_grad`'s options, checked: how many micro-batches, the dtype gradients are
  reduced in (None: the parameters'), and whether the loss returns `(loss, aux)`."""

  micro_batches: int
  reduce_dtype: Any
  has_aux: bool


@dataclasses.dataclass(frozen=True)
class LossKind:
  """What tracing one part's loss finds out (`_check_loss`), before the step is built.

  Attributes:
    weighted: the loss is a `zerojax.WeightedMean` (else a plain mean, one per part).
    aux_kinds: per aux leaf, how its parts combine (`reduction.aux_kinds`); () without aux.
    aux_treedef: the aux's structure (None without aux).
  """

  weighted: bool
  aux_kinds: tuple = ()
  aux_treedef: Any = None

  @property
  def per_row(self) -> list[bool]:
    """Per aux leaf: whether it keeps one value per batch row (concatenated over devices)."""
    return [k == 'rows' for k in self.aux_kinds]


def _check_loss(r: routes_lib.Routes, loss_fn, treedef, flat_params, mb, args) -> LossKind:
  """Traces one part's loss once, before the loop: refuses a loss or aux whose parts would
  not add up to the global batch's, and says what it returns."""

  def one_part(flat, b):  # traced on its own: nothing of it enters the step's program
    diff, rebuild = routes_lib.loss_inputs(r, flat)
    return _traced_loss(r, loss_fn, treedef, rebuild, diff, b, args)

  closed, shapes = jax.make_jaxpr(one_part, return_shape=True)(flat_params, mb)
  num_params, num_batch = len(flat_params), len(jax.tree.leaves(mb))
  _, weight, aux = shapes
  weighted = weight is not None
  deps = reduction.output_deps(closed, num_params, num_batch)  # one walk for both checks
  if not reduction.depends_on_batch(deps[0]):
    raise ValueError(
      'zerojax.value_and_grad: the loss does not read the `batch` it is given. It runs on each'
      " device's part of the batch, so a loss that closes over a batch instead would run the"
      ' whole of it on every device. Compute the loss from its `batch` argument:'
      ' loss_fn(params, batch), called as fn(params, batch).'
    )
  # The scalar loss, and scalar aux values (means over the rows under the same rule).
  outputs = ['loss'] + [None] * weighted
  kind = LossKind(weighted)
  if r.has_aux:
    kinds = tuple(reduction.aux_kinds(aux, jax.tree.leaves(mb)[0].shape[0]))
    kind = LossKind(weighted, kinds, jax.tree.structure(aux, is_leaf=reduction.is_combined))
    outputs += reduction.aux_output_names(aux, list(kinds))
  outputs += [None] * (len(closed.jaxpr.outvars) - len(outputs))
  reduction.check_normalisation(closed, num_params, num_batch, outputs)
  if weighted and reduction.depends_on_params(deps[1]):
    raise ValueError(
      'zerojax.value_and_grad: the loss returned a zerojax.WeightedMean whose weight depends'
      ' on the parameters; the weight is a count or sum of weights taken from the batch.'
    )
  if r.stage == 3 and any(route.model_split is not None for route in r.leaves):
    _warn_unrolled(closed)
  return kind


def _warn_unrolled(closed: Any) -> None:
  """Per-layer gathers save memory only inside a layer loop: says so when there is none."""
  outside, inside = jaxprs.count_gathers(closed)
  if outside >= 2 and inside == 0:
    warnings.warn(
      f'zerojax.value_and_grad(per_layer=True): the loss gathers {outside} split parameters,'
      ' none of them inside a layer loop (lax.scan, nn.scan, nnx.scan, zerojax.scan_layers).'
      ' Unrolled layers (a Python for loop) give the compiler separate gathers it may run'
      ' together, so the whole model can be live at once, as with per_layer=False. Scan over'
      ' stacked layers, rematerialised (policy=zerojax.recompute_gathers), to hold one'
      " layer's parameters at a time.",
      stacklevel=2,
    )


def _micro_step(r: routes_lib.Routes, loss_fn, treedef, flat_params, mb, args, scale, kind):
  """One part's (total, weight, aux, gradients of total * scale)."""
  diff, rebuild = routes_lib.loss_inputs(r, flat_params)
  # Frozen leaves (`Options.trainable`) are closed over, not differentiated: their gradient
  # is neither computed nor reduced (None from here on).
  trains = [not route.frozen for route in r.leaves]

  def scaled(trained):
    given = iter(trained)
    full = [next(given) if t else x for x, t in zip(diff, trains)]
    total, weight, aux = _traced_loss(r, loss_fn, treedef, rebuild, full, mb, args)
    return (total * scale.astype(total.dtype)).astype(total.dtype), (total, weight, aux)

  trained = [x for x, t in zip(diff, trains) if t]
  (_, (total, weight, aux)), got = jax.value_and_grad(scaled, has_aux=True)(trained)
  if r.has_aux:
    aux = reduction.stack_aux(aux, list(kind.aux_kinds))
  got = iter(got)
  grads = [next(got) if t else None for t in trains]
  grads = [
    g if g is None or update_lib.in_host_memory(g) else g.astype(route.acc_dtype)
    for g, route in zip(grads, r.leaves)
  ]
  return total.astype(jnp.float32), weight, aux, grads


def _reduce_scatter(route: routes_lib.LeafRoute, g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """Reduce-scatters over the axes that split the gradient, sums over the other ZeRO axes."""
  dim, split_axes = route.scatter
  g = quantize_lib.reduce_scatter(g, split_axes, dim, route.quantize)  # qgZ if asked
  rest = tuple(a for a in axes if a not in split_axes)
  return jax.lax.psum(g, routes_lib.axis_arg(rest)) if rest else g


def _across_replicas(r: routes_lib.Routes, g: jax.Array) -> jax.Array:
  """A gradient shard summed over the replica axes (one all-reduce of the shard: the only
  traffic between TPU slices under hierarchical ZeRO)."""
  return jax.lax.psum(g, routes_lib.axis_arg(r.replica_axes)) if r.replica_axes else g


def _reduce_micro(r: routes_lib.Routes, route: routes_lib.LeafRoute, g: jax.Array) -> jax.Array:
  """Stages 2-3: each micro-batch's gradient into its shard (unless the model's gather did).

  With one micro-batch the shard is also summed over the replica axes here (or by the
  model's gather, inside the backward pass where the compiler can overlap it); with several,
  once after the loop.
  """
  if g is not None and r.stage >= 2 and route.scatter is not None and route.model_split is None:

    def reduce(g):
      g = _reduce_scatter(route, g, r.axes)
      return _across_replicas(r, g) if r.micro_batches == 1 else g

    g = gather_lib.on_free_axes(reduce, route.grad_free, g)
  return g


# A whole gradient all-reduced at stage 0 or 1 gets its own output buffer on XLA:CPU, so a
# large leaf would be held twice. Leaves of three or more dimensions (stacked layers, most
# often) larger than this are all-reduced in place in slices along their first dimension, each
# slice at most this size where the first dimension allows; smaller leaves at once, as plain
# data parallelism does (an attention kernel is not a loop of tiny all-reduces).
PSUM_SLICE_BYTES = 4 << 20


def _psum_in_slices(x: jax.Array, axes: Any) -> jax.Array:
  """All-reduces `x`, in slices of whole leading indices if it is large (see PSUM_SLICE_BYTES)."""
  nbytes = x.size * x.dtype.itemsize
  if x.ndim < 3 or nbytes <= PSUM_SLICE_BYTES:
    return jax.lax.psum(x, axes)
  n = x.shape[0]
  # The fewest slices of at most PSUM_SLICE_BYTES that divide the first dimension evenly.
  slices = next((d for d in range(2, n + 1) if n % d == 0 and nbytes // d <= PSUM_SLICE_BYTES), n)
  if slices == 1:
    return jax.lax.psum(x, axes)
  size = n // slices

  def one(i, x):
    part = jax.lax.dynamic_slice_in_dim(x, i * size, size, 0)
    return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.psum(part, axes), i * size, 0)

  return jax.lax.fori_loop(0, slices, one, x)


def _reduce_final(r: routes_lib.Routes, route: routes_lib.LeafRoute, acc: jax.Array) -> jax.Array:
  """After the loop: stage 1 reduce-scatters its full buffer; whole leaves are all-reduced."""
  if route.scatter is not None and r.stage >= 2:
    if r.micro_batches == 1:
      return acc
    return gather_lib.on_free_axes(functools.partial(_across_replicas, r), route.grad_free, acc)
  if route.scatter is not None and r.stage == 1:
    reduce = lambda g: _across_replicas(r, _reduce_scatter(route, g, r.axes))
    return gather_lib.on_free_axes(reduce, route.grad_free, acc)
  whole = functools.partial(_psum_in_slices, axes=routes_lib.axis_arg(r.all_axes))
  return gather_lib.on_free_axes(whole, route.grad_free, acc)


def _finished(r: routes_lib.Routes, acc: list, weight: Any) -> list:
  """Each leaf's gradient from its accumulator: reduced and divided by the global weight;
  streamed ones as their parts; frozen leaves zeros in their gradient's layout, from no
  computation."""
  return [
    jnp.zeros(route.grad_shape, route.acc_dtype)
    if route.frozen
    else a
    if isinstance(a, tuple)
    else (_reduce_final(r, route, a) / weight).astype(a.dtype)
    for a, route in zip(acc, r.leaves)
  ]


def _per_device(r: routes_lib.Routes, loss_fn, treedef, found, flat_params, batch, args, scale):
  """One device's step: the micro-batch loop, then the reductions and the global means. What
  tracing the loss found (`LossKind`) is handed out in `found`, a one-slot list, for the
  step's outputs to be read by."""
  m = r.micro_batches
  micro = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)
  first = jax.lax.axis_index(routes_lib.axis_arg(r.row_axes)) * m  # this device's first part

  def body(carry, xs):
    acc, sums = carry
    i, mb = xs
    part = reduction.fold_keys(args, first + i)  # each part draws its own numbers
    t, w, aux, grads = _micro_step(r, loss_fn, treedef, flat_params, mb, part, scale, kind)
    grads = [_reduce_micro(r, route, g) for g, route in zip(grads, r.leaves)]
    if acc is None:  # the first micro-batch; streamed gradients are kept part by part
      acc = [(g,) if g is not None and update_lib.in_host_memory(g) else g for g in grads]
    else:
      acc = [
        None if g is None else a + (g,) if isinstance(a, tuple) else a + g
        for a, g in zip(acc, grads)
      ]
    return (acc, sums + (t if w is None else jnp.stack([t, w]))), aux

  mb0 = jax.tree.map(lambda x: x[0], micro)
  kind = _check_loss(r, loss_fn, treedef, flat_params, mb0, reduction.fold_keys(args, first))
  found.append(kind)
  sums0 = jnp.zeros((2,) if kind.weighted else (), jnp.float32)
  if m == 1:
    # No loop and no accumulator: the gradient goes straight to its reduction,
    # so no second gradient-sized buffer is live.
    (acc, sums), aux = body((None, sums0), (0, mb0))
    auxes = jax.tree.map(lambda x: x[None], aux)
  elif r.stream:
    # Streamed gradients leave each micro-batch's backward pass for host memory;
    # they are added up there after this region (see `_host_finish`).
    carry, parts = (None, sums0), []
    for i in range(m):
      carry, aux = body(carry, (i, jax.tree.map(lambda x, i=i: x[i], micro)))
      parts.append(aux)
    acc, sums = carry
    auxes = jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
  else:
    acc0 = [
      None if route.frozen else jnp.zeros(route.acc_shape, route.acc_dtype) for route in r.leaves
    ]
    (acc, sums), auxes = jax.lax.scan(body, (acc0, sums0), (jnp.arange(m), micro))
  # The global normaliser: the parts' summed weights (one all-reduce with the
  # loss), or for a plain mean the number of parts. A loss scale stays in the
  # gradients: `mixed_precision` divides it out, once.
  sums = jax.lax.psum(sums, routes_lib.axis_arg(r.all_axes))
  total, weight = (sums[0], sums[1]) if kind.weighted else (sums, r.size(r.all_axes) * m)
  # Streamed gradients leave as their micro-batch parts, with the divisor.
  grads = _finished(r, acc, weight)
  loss = total / weight
  weight = jnp.asarray(weight, jnp.float32)
  if not r.has_aux:
    return loss, None, grads, weight
  aux, per_row = reduction.finish_aux(
    auxes, kind.aux_treedef, list(kind.aux_kinds), routes_lib.axis_arg(r.all_axes)
  )
  # Per-row leaves leave concatenated over devices; global means leave one copy per device.
  return loss, [x if rows else x[None] for x, rows in zip(aux, per_row)], grads, weight


# -- the public function ----------------------------------------------------------


def _fetch_whole(leaves: list, routes: tuple, plan: Any) -> list:
  """Offloaded parameters (`offload_params`) the model does not fetch layer by layer, moved
  to device memory whole before the step's region (their layout at rest, on the device)."""
  out = []
  for x, route, s in zip(leaves, routes, jax.tree.leaves(plan.params)):
    if s.memory_kind == plan_lib.HOST and not route.fetched:
      x = jax.device_put(x, s.with_memory_kind('device'))
    out.append(x)
  return out


def _first(x: jax.Array, mesh: Mesh) -> jax.Array:
  """One device's copy of a value every device computed alike."""
  if mesh_lib.any_explicit(mesh):
    x = jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
  return x[0]


def _check_batch(batch: Any, n: int, micro_batches: int) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    where = f'batch{jax.tree_util.keystr(path)}'
    if jnp.ndim(x) == 0:
      raise ValueError(
        f'{where} is a scalar: every leaf of `batch` is split by rows over the devices. Pass'
        ' values that are the same for every row as extra arguments, after `batch`.'
      )
    rows = x.shape[0]
    if rows % (n * micro_batches):
      raise ValueError(
        f'{where} has {rows} rows, which do not split into {n} devices x {micro_batches}'
        f' micro-batches. Use a batch size divisible by {n * micro_batches}.'
      )


def _row_axes(batch: Any, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The ZeRO axes the rows are split over, in the order the batch already uses if so split."""
  first = jax.tree.leaves(batch)[0]
  spec = plan_lib.spec_of(first)
  if spec is not None and len(spec) and spec[0] is not None:
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if set(names) == set(axes):
      return tuple(names)
  return axes


_NO_BATCH = (
  'zerojax.value_and_grad(loss_fn, tx) returns fn(params, batch, *args): it splits'
  ' `batch` over the devices and runs loss_fn(params, batch, *args) on each part, so the'
  ' batch is an argument, not something the loss closes over. Write the loss as'
  ' loss_fn(params, batch) and call fn(params, batch).'
)


def value_and_grad(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  micro_batches: int = 1,
  reduce_dtype: Any = None,
  has_aux: bool = False,
  per_layer: bool = False,
  manual: bool = True,
) -> Callable[..., Any]:
  """`jax.value_and_grad` over the global batch, for a zero-wrapped optimizer.

  The loss runs once per device and micro-batch, on those rows of the batch,
  and the parts are combined into what `jax.value_and_grad(loss_fn)` returns
  on the whole batch under `jax.jit`:

  - a scalar loss is taken to be the mean over its rows (every row weighs the
    same); the result is the mean over the global batch. A scalar loss that
    divides by a count it computed from its batch is refused with the fix;
  - a `zerojax.WeightedMean(total, weight)` (sums over its rows, e.g. a
    padding-weighted cross-entropy and its count of real tokens): the result
    is the global sum of `total` over the global sum of `weight`;
  - aux leaves whose leading dimension is the rows come back with every row
    of the batch; `WeightedMean` aux leaves are combined as above; any other
    aux leaf is refused (its meaning for the whole batch is unknown);
  - every typed PRNG key among `args` (`jax.random.key`) is folded with the
    part's index (device, micro-batch), so each part draws its own numbers,
    as one key over the whole batch would (equal in distribution).

  Args:
    loss_fn: `loss_fn(params, batch, *args)` -> a scalar mean over `batch`'s
      rows or a `zerojax.WeightedMean` (with `has_aux`: `(loss, aux)`). It gets
      whole parameters or, with `per_layer`, shards for its layers to gather.
    tx: the optimizer from `zerojax.zero_stage` (its stage, mesh and plan decide
      where the reduction goes).
    micro_batches: split each device's rows into this many micro-batches, run
      one after another (the activations of one live at a time).
    reduce_dtype: accumulate and reduce gradients in this dtype (e.g.
      `jnp.float32` for bf16 models); default: the parameters' dtype.
    has_aux: `loss_fn` returns `(loss, aux)`.
    per_layer: hand `loss_fn` each split parameter as a `zerojax.ShardedLeaf`
      for the model to gather layer by layer (`zerojax.gather`,
      `zerojax.linen.gathered`, `zerojax.nnx.gathered`), each gather's gradient
      reduce-scattered as the backward pass reaches it (stage 3; at stage 2 the
      parameters are whole and each layer's gradient is scattered as it is
      reached). At stages 0-1 nothing is split: the loss's gathers return their
      input and the program is `per_layer=False`'s, so one loss line serves
      every stage. A split parameter used without a gather raises a TypeError
      naming it.
    manual: True (the default): the loss runs once per device and micro-batch
      inside `jax.shard_map` over the ZeRO axes, and zerojax writes the
      collectives. False: the loss runs once on the whole batch under `jit`,
      as `jax.value_and_grad` runs it, and the compiler places ZeRO's
      collectives from the layouts (the gathers of `zerojax.gather`, the
      gradients laid out as the plan says). For a model that names layouts
      over the ZeRO axes (`out_sharding=`, `jax.sharding.reshard`), which JAX
      refuses inside a region manual over them. One micro-batch, parameters on
      the device; the loss's values combine as above (a `WeightedMean` is
      its total over its weight on the whole batch), and the keys among
      `args` are not folded (one draw over the whole batch).

  Returns:
    `fn(params, batch, *args, loss_scale=None)` -> `(loss, grads)` (or
    `((loss, aux), grads)`), to call inside `jax.jit`: the global batch's loss
    and its gradient, in the plan's gradient layout (at stage 1: split like
    the optimizer state). Every leaf of `batch` has the global batch's rows
    first (split over the ZeRO axes here); `args` reach every part unchanged
    but for their keys. With `loss_scale` (`zerojax.loss_scale(opt_state)`),
    the gradients are of the scaled loss (`zerojax.mixed_precision` divides
    the scale out); the returned loss is unscaled.

  Raises:
    ValueError: the rows do not divide into devices x `micro_batches`; a batch
      leaf is a scalar; `per_layer` with `param_axis` (hpZ); at
      trace time, a loss or aux whose parts cannot be combined exactly (a
      division by a batch count names the loss, or the aux path).
  """
  config = transform.require_config(tx)
  if per_layer and config.options.param_axis is not None:
    raise ValueError(
      '`per_layer=True` hands the loss shards split over all of the ZeRO axes, and under hpZ'
      f' (param_axis={config.options.param_axis!r}) the parameters are split over that axis'
      ' only: use per_layer=False with param_axis.'
    )
  # Below stage 2 the loss gets whole parameters and whole gradients come back, so there is
  # nothing to gather or scatter per layer: its gathers are no-ops, the program per_layer=False's.
  # One loss line then serves every stage.
  per_layer = per_layer and config.stage >= 2
  if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
    raise ValueError(f'`micro_batches` must be a positive int, got {micro_batches!r}.')
  options = Options(micro_batches, reduce_dtype, has_aux)
  if not manual:
    _check_compiler_placed(config, micro_batches)

    def whole_batch_fn(params, *batch_and_args, loss_scale=None):
      if not batch_and_args:
        raise TypeError(_NO_BATCH)
      return _whole_batch_step(config, loss_fn, options, params, *batch_and_args, scale=loss_scale)

    return whole_batch_fn

  def grad_fn(params, *batch_and_args, loss_scale=None):
    if not batch_and_args:
      raise TypeError(_NO_BATCH)
    return _step(
      config, loss_fn, per_layer, options, params, *batch_and_args, loss_scale=loss_scale
    )

  return grad_fn


def _check_compiler_placed(config: Any, micro_batches: int) -> None:
  """Refuses what `value_and_grad(manual=False)` does not do, naming what does."""
  if micro_batches != 1:
    raise ValueError(
      f'value_and_grad(manual=False) runs the loss once on the whole batch, so it takes no'
      f' micro_batches (got {micro_batches}): accumulate over batches in the step, or use'
      ' manual=True.'
    )
  streamed = config.options.update_on == 'stream' or config.options.offload_params
  if streamed or config.replica_axes:
    why = 'replica axes' if config.replica_axes else 'gradients streamed to host memory'
    raise ValueError(
      f'value_and_grad(manual=False) leaves the collectives to the compiler, and {why}'
      " (update_on='stream', offload_params, replica_axis) need the per-device region"
      ' zerojax writes: use manual=True.'
    )


def _whole_batch_step(config, loss_fn, options, params, batch, *args, scale=None):
  """`value_and_grad(manual=False)`: jax's gradient of the loss on the whole batch, the
  gradients laid out as the plan says (the compiler places the reduction)."""
  plan = plan_lib.plan_of(config, params)
  has_aux, reduce_dtype = options.has_aux, options.reduce_dtype
  value = lambda x: x.value if reduction.is_combined(x) else x
  scale = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale)

  frozen = plan.frozen or None

  def scaled(trained):
    # Frozen leaves (`Options.trainable`) are closed over: no gradient is taken for them.
    p = frozen_lib.fill(trained, params, frozen, frozen_lib.frozen_of(params, frozen))
    out = loss_fn(p, batch, *args)
    loss, aux = out if has_aux else (out, None)
    loss = value(loss)
    aux = jax.tree.map(value, aux, is_leaf=reduction.is_combined)
    return (loss * scale.astype(loss.dtype)), (loss, aux)

  trained = frozen_lib.prune(params, frozen)
  (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(trained)
  zeros = [jnp.zeros_like(x) for x in frozen_lib.frozen_of(params, frozen)]
  grads = frozen_lib.fill(grads, params, frozen, zeros)
  leaves, treedef = jax.tree.flatten(grads)
  layouts = routes_lib.grad_layouts(plan)
  cast = lambda g: g.astype(reduce_dtype) if reduce_dtype is not None else g
  lay = (
    jax.sharding.reshard if mesh_lib.any_explicit(config.mesh) else jax.lax.with_sharding_constraint
  )
  leaves = [lay(cast(g), layout) for g, layout in zip(leaves, layouts)]
  grads = jax.tree.unflatten(treedef, leaves)
  return ((loss, aux), grads) if has_aux else (loss, grads)


def _step(config, loss_fn, per_layer, options, params, batch, *args, loss_scale=None):
  """What `value_and_grad`'s function does: routes, then the per-device step in shard_map."""
  mesh, m = config.mesh, options.micro_batches
  axes, replica = config.axes, config.replica_axes
  _check_batch(batch, mesh_lib.axes_size(mesh, replica + axes), m)
  reduction.check_raw_keys(args)
  leaves, treedef = jax.tree.flatten(params)
  routes, plan = routes_lib.leaf_routes(
    config, params, per_layer=per_layer, reduce_dtype=options.reduce_dtype
  )
  row_axes = _row_axes(batch, replica + axes)
  # Offloaded parameters stream their gradients down too: the update runs in host memory.
  stream = per_layer and (config.options.update_on == 'stream' or config.options.offload_params)
  if stream and replica:
    why, fix = (
      ('offload_params=True', 'keep the parameters on the device (offload_params=False)')
      if config.options.offload_params
      else ("update_on='stream'", "use update_on='host'")
    )
    raise ValueError(
      f'{why} sends gradient shards to host memory from inside the backward pass,'
      f' before they could be summed over the replica axes {replica}; {fix}'
      ' on a mesh with replica axes (e.g. several TPU slices).'
    )
  noted = streaming.start() if stream else None
  r = routes_lib.Routes(
    routes, mesh, config.stage, axes, row_axes, m, options.has_aux, stream, replica
  )
  rows = PartitionSpec(routes_lib.axis_arg(row_axes))
  scale = jnp.ones((), jnp.float32) if loss_scale is None else jnp.asarray(loss_scale)
  found: list[LossKind] = []  # what tracing the loss finds out (`_per_device` hands it out)
  # Streamed gradients leave the region as one part per micro-batch (see `_host_finish`).
  streamed = [stream and x.model_split is not None and not x.frozen for x in routes]
  grad_specs = [(x.grad_spec,) * m if s else x.grad_spec for x, s in zip(routes, streamed)]
  mapped = jax.shard_map(
    functools.partial(_per_device, r, loss_fn, treedef, found),
    mesh=mesh,
    in_specs=([x.rest_spec for x in routes], rows, PartitionSpec(), PartitionSpec()),
    out_specs=(PartitionSpec(), rows, grad_specs, PartitionSpec()),
    axis_names=set(axes) | set(replica),
    check_vma=False,
  )
  if mesh_lib.any_explicit(mesh):
    # Explicit axes: shard_map takes its inputs only in the layouts it names.
    # Parameters go to the plan's layout at rest and batch rows to the ZeRO
    # axes (no-ops when they are there already), so any batch layout works.
    leaves = [jax.sharding.reshard(x, s) for x, s in zip(leaves, jax.tree.leaves(plan.params))]
    batch = jax.tree.map(lambda x: jax.sharding.reshard(x, NamedSharding(mesh, rows)), batch)
  leaves = _fetch_whole(leaves, routes, plan)
  loss, aux, grads, weight = mapped(leaves, batch, args, scale)
  (kind,) = found
  grads = [
    _host_finish(noted, list(g), weight, route.acc_dtype, kind.weighted) if s else g
    for g, route, s in zip(grads, routes, streamed)
  ]
  grads = jax.tree.unflatten(treedef, grads)
  if not r.has_aux:
    return loss, grads
  aux = [x if per_row else _first(x, mesh) for x, per_row in zip(aux, kind.per_row)]
  return (loss, kind.aux_treedef.unflatten(aux)), grads
