"""`value_and_grad` for ZeRO: micro-batch accumulation with the gradient collective in its place.

Differentiating a loss over a batch split across devices makes the compiler
reduce the gradients where they are produced. With a micro-batch loop that
means one reduction per micro-batch, which for stage 0-1 is wasted traffic. Here
the loop runs inside `jax.shard_map` over the ZeRO axes, so the placement is
explicit:

- stages 0-1: each device accumulates its own unreduced gradients over the
  micro-batches and one collective runs after the loop: an all-reduce at
  stage 0, a reduce-scatter into the optimizer state's shards at stage 1;
- stage 2-3: each micro-batch's gradients are reduce-scattered (`psum_scatter`,
  a real reduce-scatter even on CPU) into an accumulator holding only this
  device's shard;
- stage 3 with `per_layer=True`: the loss sees its parameters as shards
  (`ShardedLeaf`) and each layer gathers its own where the model calls
  `gathered_linen`, `gathered_nnx`, `gather_leaves` or `gather_params`: an
  explicit all-gather whose transpose reduce-scatters that layer's gradient,
  so whole parameters live one layer at a time. Without it, stage 3 gathers
  every parameter before the loss (XLA hoists the loop-invariant gather out of
  the micro-batch loop, so the whole model lives for the step).

Other mesh axes (tensor parallelism) stay under the compiler's control.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zerojax._src import gather as gather_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import quantize as quantize_lib
from zerojax._src import transform


def _zero_dim(spec: PartitionSpec, axes: tuple[str, ...]) -> tuple[int, tuple[str, ...]] | None:
  """The dimension a spec splits over ZeRO axes, and those axes (in the spec's order)."""
  for dim, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n in axes)
    if kept:
      return dim, kept
  return None


def _batch_spec(x: Any, axes: tuple[str, ...]) -> PartitionSpec:
  """Rows split over the ZeRO axes, in the order the batch already uses if it is so split."""
  spec = plan_lib.spec_of(x)
  if spec is not None and len(spec) and spec[0] is not None:
    first = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if set(first) == set(axes):
      return PartitionSpec(_axis_arg(first))
  return PartitionSpec(_axis_arg(axes))


def _axis_arg(names: tuple[str, ...]) -> str | tuple[str, ...]:
  return names[0] if len(names) == 1 else names


def _manual_spec(spec: PartitionSpec, axes: tuple[str, ...], ndim: int) -> PartitionSpec:
  """`spec` with only the ZeRO axes kept (shard_map's in/out specs name manual axes only)."""
  out = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n in axes)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*out)


def value_and_grad(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  micro_batches: int = 1,
  reduce_dtype: Any = None,
  has_aux: bool = False,
  per_layer: bool = False,
) -> Callable[..., Any]:
  """`jax.value_and_grad` for a zero-wrapped optimizer, with gradient accumulation.

  Args:
    loss_fn: `loss_fn(params, batch, *args)` -> the mean loss over `batch` (or
      `(loss, aux)` with `has_aux`). It sees one device's micro-batch, and
      whole parameters (or, with `per_layer`, shards for its layers to gather).
    tx: the optimizer from `zerojax.zero_stage` (its stage, mesh and plan decide
      where the reduction goes).
    micro_batches: split each device's rows into this many micro-batches,
      run one after another (activations of one micro-batch live at a time).
    reduce_dtype: accumulate and reduce gradients in this dtype (e.g.
      `jnp.float32` for bf16 models); default: the parameters' dtype.
    has_aux: `loss_fn` returns `(loss, aux)`; the aux of the last micro-batch
      is returned, averaged over devices where it is floating point.
    per_layer: stages 2-3: hand `loss_fn` each split parameter as a
      `zerojax.ShardedLeaf` for the model to gather layer by layer
      (`gathered_linen`, `gathered_nnx`, `gather_leaves`, `gather_params`),
      each gather's gradient reduce-scattered as the backward pass reaches it,
      so only gradient shards are carried through it. At stage 3 the gather is
      an all-gather of the shards; at stage 2 it moves nothing (the device
      holds the whole parameter). A split parameter used without a gather
      raises a TypeError naming it. Default False: `loss_fn` gets whole
      parameters (gathered up front at stage 3) and the reduction follows it.

  Returns:
    `fn(params, batch, *args, loss_scale=None)` -> `(loss, grads)` (or
    `((loss, aux), grads)`), to call inside `jax.jit`: the mean loss over the
    global batch and its gradient, in the plan's gradient layout (at stage 1:
    split like the optimizer state, whose update reads only its shard).
    `batch` is a pytree of arrays whose leading dimension (the global batch)
    is split over the ZeRO axes; `args` are passed to `loss_fn` unchanged (replicated).
    With `loss_scale` (e.g. `zerojax.loss_scale(opt_state)` for fp16), the
    gradients are of `loss * loss_scale` (still scaled: the optimizer's
    `zerojax.mixed_precision` divides the scale out and skips steps that
    overflowed); the returned loss is unscaled.

  Raises:
    ValueError: the rows of a device do not divide into `micro_batches`;
      `per_layer` below stage 3 or with `param_axis`.
  """
  config = transform.require_config(tx)
  if per_layer and (config.stage < 2 or config.param_axis is not None):
    raise ValueError(
      '`per_layer=True` is for stages 2-3 with parameters split over all of the ZeRO axes'
      f' (got stage {config.stage}, param_axis={config.param_axis!r}); stages 0-1 keep'
      ' whole gradients by design, and under hpZ (param_axis) use per_layer=False.'
    )
  if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
    raise ValueError(f'`micro_batches` must be a positive int, got {micro_batches!r}.')
  axes, mesh, stage = config.axes, config.mesh, config.stage
  axis_arg = axes if len(axes) > 1 else axes[0]
  n = mesh_lib.axes_size(mesh, axes)

  def fn(params, batch, *args, loss_scale=None):
    plan = config.plan(params)
    leaves, treedef = jax.tree.flatten(params)
    param_specs = [
      _manual_spec(s.spec, axes, x.ndim) for s, x in zip(jax.tree.leaves(plan.params), leaves)
    ]
    # Stage 1 keeps a full gradient buffer through the micro-batches but leaves
    # it reduce-scattered into the optimizer state's shards (the update reads
    # only those): the floor's traffic, where an all-reduce would move more.
    out_layouts = jax.tree.leaves(plan.grads)
    if stage == 1:
      shards = jax.tree.leaves(plan.param_shards)
      padding = plan.padding or (None,) * len(shards)
      out_layouts = [g if pad else s for g, s, pad in zip(out_layouts, shards, padding)]
    grad_specs = [_manual_spec(s.spec, axes, x.ndim) for s, x in zip(out_layouts, leaves)]
    # ZeRO++: the Quantize that applies to each leaf's collectives, or None.
    quants = plan.quantized()
    gather_dims = [_zero_dim(s, axes) for s in param_specs]
    scatter_dims = [_zero_dim(s, axes) for s in grad_specs]
    # per_layer: the model's own gathers reduce-scatter these gradients already
    # (stage 3: split at rest; stage 2: whole at rest, split as gradients).
    split = gather_dims if stage == 3 else scatter_dims
    scattered = [per_layer and d is not None for d in split]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
      rows = x.shape[0] if x.ndim else 0
      if rows % (n * micro_batches):
        raise ValueError(
          f'batch{jax.tree_util.keystr(path)} has {rows} rows, which do not split into'
          f' {n} devices x {micro_batches} micro-batches. Use a batch size divisible'
          f' by {n * micro_batches}.'
        )
    batch_spec = jax.tree.map(lambda x: _batch_spec(x, axes), batch)
    scale = jnp.ones((), jnp.float32) if loss_scale is None else jnp.asarray(loss_scale)

    def local(flat_params, batch, args, scale):
      def gathered(flat):
        # Over the axes that split the leaf at rest: all ZeRO axes, or under
        # hpZ (`param_axis`) only the parameter axes.
        return [
          x
          if g is None
          else gather_lib.ShardedLeaf(x, g[0], g[1], x.ndim, f'params{path}', quantize=q).gather()
          for x, g, q, path in zip(flat, gather_dims, quants, paths)
        ]

      def as_shards(flat):
        # Stage 3: the local shard. Stage 2: this device's slice of the whole
        # parameter it holds, with the whole beside it (the gather moves nothing).
        out = []
        for x, d, path, q in zip(flat, split, paths, quants):
          if d is None:
            out.append(x)
          elif stage == 3:
            out.append(gather_lib.ShardedLeaf(x, d[0], d[1], x.ndim, f'params{path}', quantize=q))
          else:
            size = x.shape[d[0]] // mesh_lib.axes_size(mesh, d[1])
            start = jax.lax.axis_index(_axis_arg(d[1])) * size
            shard = jax.lax.dynamic_slice_in_dim(x, start, size, d[0])
            out.append(
              gather_lib.ShardedLeaf(shard, d[0], d[1], x.ndim, f'params{path}', x, quantize=q)
            )
        return out

      def micro_grads(flat_params, mb):
        if per_layer:
          # Differentiated with respect to the shards only: a stage-2 whole
          # parameter is a constant here, and no whole-sized gradient exists.
          leaves = as_shards(flat_params)
          diff = [x.shard if gather_lib.is_sharded_leaf(x) else x for x in leaves]

          def rebuild(diff):
            return jax.tree.unflatten(
              treedef,
              [
                x.replace(shard=v) if gather_lib.is_sharded_leaf(x) else v
                for x, v in zip(leaves, diff)
              ],
            )
        else:
          diff = gathered(flat_params)
          rebuild = lambda diff: jax.tree.unflatten(treedef, diff)

        def scaled(diff):
          with gather_lib.per_device_region():
            out = loss_fn(rebuild(diff), mb, *args)
          loss, aux = out if has_aux else (out, None)
          return (loss * scale.astype(loss.dtype)).astype(loss.dtype), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(diff)
        if reduce_dtype is not None:
          grads = [g.astype(reduce_dtype) for g in grads]
        return loss, aux, grads

      def reduce_now(g, d, done, q):
        # Stages 2-3: each micro-batch's gradient is reduce-scattered at once
        # over the axes that split it, and summed over any other ZeRO axes.
        if done:  # reduce-scattered by the transpose of the model's gather
          return g
        if stage >= 1 and d is not None:
          g = quantize_lib.reduce_scatter(g, d[1], d[0], q)  # qgZ if q asks for it
          rest = tuple(a for a in axes if a not in d[1])
          return jax.lax.psum(g, _axis_arg(rest)) if rest else g
        return g

      micro = jax.tree.map(
        lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch
      )

      def body(carry, mb):
        acc, loss_sum = carry
        loss, aux, grads = micro_grads(flat_params, mb)
        acc = [
          a + (reduce_now(g, d, done, q) if stage >= 2 else g)
          for a, g, d, done, q in zip(acc, grads, scatter_dims, scattered, quants)
        ]
        return (acc, loss_sum + loss.astype(jnp.float32)), aux

      acc0 = []
      for x, g, d in zip(flat_params, gather_dims, scatter_dims):
        shape = list(x.shape)
        if g is not None:  # stage 3: the local shard of a gathered leaf
          shape[g[0]] *= mesh_lib.axes_size(mesh, g[1])
        if stage >= 2 and d is not None:  # the accumulator holds one shard
          shape[d[0]] //= mesh_lib.axes_size(mesh, d[1])
        acc0.append(jnp.zeros(shape, reduce_dtype or x.dtype))
      (acc, loss_sum), auxes = jax.lax.scan(body, (acc0, jnp.zeros((), jnp.float32)), micro)
      # After the loop: stage 1 reduce-scatters its full buffer once; stage 0
      # (and leaves kept whole) all-reduces it once.
      acc = [
        a
        if (stage >= 2 and d is not None)
        else reduce_now(a, d, False, q)
        if (stage == 1 and d is not None)
        else jax.lax.psum(a, axis_arg)
        for a, d, q in zip(acc, scatter_dims, quants)
      ]
      # The mean over devices and micro-batches. A loss scale stays in: the
      # optimizer's `mixed_precision` divides it out, once, beside its
      # overflow check (dividing here too made every step 1/scale too small).
      denom = n * micro_batches
      grads = [(a / denom).astype(a.dtype) for a in acc]
      loss = jax.lax.pmean(loss_sum / micro_batches, axis_arg)
      aux = None
      if has_aux:
        aux = jax.tree.map(lambda x: x[-1], auxes)
        aux = jax.tree.map(
          lambda x: jax.lax.pmean(x, axis_arg) if jnp.issubdtype(x.dtype, jnp.floating) else x,
          aux,
        )
      return loss, aux, grads

    mapped = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(param_specs, batch_spec, PartitionSpec(), PartitionSpec()),
      out_specs=(PartitionSpec(), PartitionSpec(), grad_specs),
      axis_names=set(axes),
      check_vma=False,
    )
    if mesh_lib.any_explicit(mesh):
      # Explicit axes: shard_map takes its inputs only in the layouts it names.
      # Parameters go to the plan's layout at rest and batch rows to the ZeRO
      # axes (no-ops when they are there already), so any batch layout works.
      leaves = [jax.sharding.reshard(x, s) for x, s in zip(leaves, jax.tree.leaves(plan.params))]
      batch = jax.tree.map(
        lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)),
        batch,
        batch_spec,
      )
    loss, aux, grads = mapped(leaves, batch, args, scale)
    grads = jax.tree.unflatten(treedef, grads)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return fn
