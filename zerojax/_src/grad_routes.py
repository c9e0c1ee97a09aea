"""`zerojax.value_and_grad`'s routes: every decision about a parameter leaf (where it rests
split and where its gradient is, who gathers it, its quantization, its accumulator), made once,
before tracing, and the loss's inputs built from them inside the per-device region."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from zerojax._src import compat
from zerojax._src import gather as gather_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib

# A split: the dimension and the mesh axes (in the spec's order) it is split over.
Split = tuple[int, tuple[str, ...]]


def axis_arg(names: tuple[str, ...]) -> str | tuple[str, ...]:
  return names[0] if len(names) == 1 else names


def zero_split(spec: PartitionSpec, axes: tuple[str, ...]) -> Split | None:
  """The dimension a spec splits over ZeRO axes, and those axes."""
  for dim, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n in axes)
    if kept:
      return dim, kept
  return None


def manual_spec(spec: PartitionSpec, axes: tuple[str, ...], ndim: int) -> PartitionSpec:
  """`spec` with only the ZeRO axes kept (shard_map's specs name manual axes only)."""
  out = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n in axes)
    out.append(None if not kept else axis_arg(kept))
  return PartitionSpec(*out)


@dataclasses.dataclass(frozen=True)
class LeafRoute:
  """Where one parameter leaf's collectives go in a step.

  Attributes:
    path: the leaf's place in the parameter tree, for messages.
    rest_spec: its layout at rest over the ZeRO axes (what the device holds).
    grad_spec: its gradient's layout over the ZeRO axes (what is returned).
    gather: the split at rest, undone before use (None: whole at rest).
    scatter: the split of its gradient (None: all-reduced whole).
    model_split: with `per_layer`, the split the model's own gather undoes
      and whose transpose reduce-scatters the gradient (None: not so).
    quantize: the ZeRO++ `Quantize` of its collectives, or None.
    acc_shape: this device's gradient accumulator.
    acc_dtype: the accumulator's dtype.
    free: its layout at rest over the mesh axes left to the compiler (a tensor axis), or None;
      its collectives run manual over those too (`gather.on_free_axes`).
    grad_free: the same for its gradient.
    fetched: in host memory at rest (`offload_params`) and brought to the device by the
      model's own gather, layer by layer (stage 3, `per_layer`); other offloaded leaves
      come to the device before the step's region.
    frozen: not trained (`Options.trainable`): the loss is not differentiated with respect to
      it, nothing of its gradient is reduced, and zeros come back in its gradient's layout.
  """

  path: str
  rest_spec: PartitionSpec
  grad_spec: PartitionSpec
  gather: Split | None
  scatter: Split | None
  model_split: Split | None
  quantize: Any
  acc_shape: tuple[int, ...]
  acc_dtype: Any
  free: PartitionSpec | None = None
  grad_free: PartitionSpec | None = None
  fetched: bool = False
  frozen: bool = False
  grad_shape: tuple[int, ...] = ()  # one device's part of the returned gradient


def local_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
  """The shape of one device's part of an array of `shape` laid out as `spec`."""
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  return tuple(
    d if e is None else d // mesh_lib.axes_size(mesh, e if isinstance(e, tuple) else (e,))
    for d, e in zip(shape, entries)
  )


@dataclasses.dataclass(frozen=True)
class Routes:
  """The static decisions of one step: per-leaf routes and the loop's shape."""

  leaves: tuple[LeafRoute, ...]
  mesh: Mesh
  stage: int
  axes: tuple[str, ...]
  row_axes: tuple[str, ...]  # the batch's rows are split over these, in this order
  micro_batches: int
  has_aux: bool
  # update_on='stream': per-layer gradients are taken into host memory (see `loss_inputs`).
  stream: bool = False
  # Data-parallel axes beside ZeRO's (`Options.replica_axis`): rows split over them too, and
  # each gradient shard all-reduced over them once per step.
  replica_axes: tuple[str, ...] = ()

  def size(self, axes: tuple[str, ...]) -> int:
    return mesh_lib.axes_size(self.mesh, axes)

  @property
  def all_axes(self) -> tuple[str, ...]:
    """Every axis the batch's rows are split over: the replica axes, then ZeRO's."""
    return self.replica_axes + self.axes


def leaf_routes(config: Any, params: Any, *, per_layer: bool, reduce_dtype: Any) -> tuple:
  """One `LeafRoute` per parameter leaf, from the plan."""
  plan, axes, stage = plan_lib.plan_of(config, params), config.axes, config.stage
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  # Stage 1 keeps a full gradient buffer through the micro-batches and leaves
  # it reduce-scattered into the optimizer state's shards (the update reads
  # only those): the floor's traffic, where an all-reduce would move more.
  layouts = grad_layouts(plan)
  frozen = plan.frozen or (False,) * len(flat)
  routes = []
  for (path, x), rest, grad, q, cold in zip(
    flat, jax.tree.leaves(plan.params), layouts, plan.quantized(), frozen
  ):
    rest_spec = manual_spec(rest.spec, axes, x.ndim)
    grad_spec = manual_spec(grad.spec, axes, x.ndim)
    gather, scatter = zero_split(rest_spec, axes), zero_split(grad_spec, axes)
    acc_shape = list(x.shape)
    if stage >= 2 and scatter is not None:
      acc_shape[scatter[0]] //= mesh_lib.axes_size(config.mesh, scatter[1])
    model_split = (gather if stage == 3 else scatter) if per_layer else None
    manual = config.replica_axes + axes
    free = gather_lib.free_spec(rest.spec, manual, (model_split or gather or (None,))[0])
    grad_free = gather_lib.free_spec(grad.spec, manual, (scatter or (None,))[0])
    fetched = (
      rest.memory_kind == plan_lib.HOST
      and stage == 3
      and model_split is not None
      and not packed_rows(x.ndim, x.dtype)
    )
    routes.append(
      LeafRoute(
        f'params{jax.tree_util.keystr(path)}',
        rest_spec,
        grad_spec,
        gather,
        scatter,
        model_split,
        q,
        tuple(acc_shape),
        reduce_dtype or x.dtype,
        free,
        grad_free,
        fetched,
        cold,
        local_shape(x.shape, grad_spec, config.mesh),
      )
    )
  return tuple(routes), plan


def grad_layouts(plan: plan_lib.ZeroPlan) -> list:
  """Each gradient leaf's layout as `value_and_grad` returns it: the plan's, and at stage 1
  split like the optimizer state (where the leaf is not padded)."""
  grad_layouts = jax.tree.leaves(plan.grads)
  if plan.stage == 1:
    shards = jax.tree.leaves(plan.param_shards)
    padding = plan.padding or (None,) * len(shards)
    grad_layouts = [g if pad else s for g, s, pad in zip(grad_layouts, shards, padding)]
  return grad_layouts


def loss_inputs(r: Routes, flat_params: list) -> tuple[list, Callable[[list], list]]:
  """What the loss is differentiated with respect to, and how it becomes its leaves.

  Without `per_layer`, split leaves are gathered up front. With it, the loss
  gets `ShardedLeaf`s (stage 3: the local shard; stage 2: this device's slice
  of the whole it holds, with the whole beside it, so its gather moves
  nothing) and the gradient is taken with respect to the shards only.
  """
  leaves = []
  for route, x in zip(r.leaves, flat_params):
    if route.model_split is not None:
      dim, axes = route.model_split
      whole = None
      if r.stage < 3:
        size = x.shape[dim] // r.size(axes)
        whole, x = x, jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, dim)
      # update_on='stream': the gradient is taken with respect to a stand-in in
      # host memory, which the model's gathers send it to (its value is never
      # read; whether the TPU compiler drops it is not yet checked).
      streamed = r.stream and not route.frozen
      sink = host_stand_in(x.shape, sink_dtype(x.ndim, route.acc_dtype)) if streamed else None
      leaves.append(
        gather_lib.ShardedLeaf(
          x,
          dim,
          axes,
          x.ndim,
          route.path,
          whole,
          route.quantize,
          sink,
          # With one micro-batch the gather's backward also sums the shard over the replica
          # axes, in the dtype it was reduce-scattered in (the compute dtype, at stage 3).
          replicas=r.replica_axes if r.micro_batches == 1 else (),
          free=route.free,
          host=route.fetched,
        )
      )
    elif route.gather is not None:
      leaf = gather_lib.ShardedLeaf(
        x, *route.gather, x.ndim, route.path, quantize=route.quantize, free=route.free
      )
      leaves.append(leaf.gather())
    else:
      leaves.append(x)
  diff = [diff_of(x) for x in leaves]

  def rebuild(diff):
    return [with_diff(x, v) for x, v in zip(leaves, diff)]

  return diff, rebuild


def diff_of(x: Any) -> Any:
  if not gather_lib.is_sharded_leaf(x):
    return x
  return x.shard if x.sink is None else x.sink


def with_diff(x: Any, v: Any) -> Any:
  if not gather_lib.is_sharded_leaf(x):
    return v
  return x.replace(shard=v) if x.sink is None else x.replace(sink=v)


def packed_rows(ndim: int, dtype: Any) -> bool:
  """Whether a layer loop over a stacked leaf would move single rows of a packed 16-bit
  vector to or from host memory (two rows share a word), which the TPU compiler cannot:
  leaves of fewer than three dimensions in a 16-bit float."""
  return ndim < 3 and jnp.dtype(dtype).itemsize < 4 and jnp.issubdtype(dtype, jnp.floating)


def sink_dtype(ndim: int, dtype: Any) -> Any:
  """The dtype a leaf's gradient travels to host memory in: 32-bit where its rows would
  be packed (`packed_rows`; cast back on the host). Offloaded parameters with packed rows
  (norm scales) come to the device whole instead of row by row."""
  return jnp.float32 if packed_rows(ndim, dtype) else dtype


def host_stand_in(shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """Zeros in host memory, asked of the host (a stand-in whose value is never read)."""
  zeros = lambda: jnp.zeros(shape, dtype)
  return compat.compute_on_host(zeros, out_memory_spaces=jax.memory.Space.Host)()
