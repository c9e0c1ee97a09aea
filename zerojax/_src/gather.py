"""Gathering ZeRO-sharded parameters where they are used.

Two mechanisms, one per kind of region:

- Under the compiler's control (a plain `jax.jit` step), a gather is a layout
  change (`with_sharding_constraint`/`reshard` to a layout without the ZeRO
  axes); the compiler places the all-gather, and the gradient's reduction into
  shards (a reduce-scatter on TPU and GPU; XLA:CPU lowers it to an all-reduce
  and a slice).
- Inside `zerojax.value_and_grad(..., per_layer=True)` at stage 3, the loss runs
  in `jax.shard_map` over the ZeRO axes and sees each split leaf as a
  `ShardedLeaf` (its local shard and the dimension it is split on). A gather
  there is an explicit `jax.lax.all_gather`, whose transpose is a
  `psum_scatter`: the gradient is reduce-scattered on every backend, CPU
  included, layer by layer.

Either way the gathered values are named `GATHERED` (`checkpoint_name`), so
`recompute_gathers`, a `jax.checkpoint` policy, can keep everything a layer
computes except its gathered parameters, which the backward pass gathers again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from zerojax._src import compat, jaxprs, rules, variables
from zerojax._src import config as config_lib
from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import quantize as quantize_lib

# The name of every gathered parameter, for jax.checkpoint policies.
GATHERED = jaxprs.GATHERED

# What a gather is made of: its name, the explicit all-gather of a manual
# region, the layout changes the compiler turns into all-gathers.
_GATHER_PRIMITIVES = frozenset({'name', 'all_gather', 'sharding_constraint', 'reshard'})


def recompute_gathers(prim, *args, **params) -> bool:
  """A `jax.checkpoint` policy: save what a layer computes, except its gathered parameters.

  Under it the backward pass recomputes only the gathers of ZeRO-3 parameters
  (the all-gathers run again, no matmul does), so each layer's whole parameters
  live only while the layer runs, and activations are kept as without
  rematerialisation. Use it where the layer loop rematerialises:

      block = nn.remat(zerojax.linen.gathered(Block, tx), policy=zerojax.recompute_gathers)
      jax.checkpoint(layer_fn, policy=zerojax.recompute_gathers)

  A full `jax.checkpoint` (no policy) saves less memory per layer at the cost of
  running each layer's forward pass again.

  >>> import jax, jax.numpy as jnp, zerojax
  >>> f = jax.checkpoint(lambda w, x: jnp.tanh(x @ w), policy=zerojax.recompute_gathers)
  >>> jax.grad(lambda w: f(w, jnp.ones(4)).sum())(jnp.eye(4)).shape
  (4, 4)
  """
  # A gathered value is not saved, and neither is what produced it (the name is
  # an identity: saving its operand would keep the same bytes). jax's own
  # save_anything_except_these_names saves everything in jax 0.10.
  if prim.name == 'custom_vjp_call':  # a gather with its own gradient (ZeRO++ qwZ, qgZ)
    return not jaxprs.is_gather(params.get('call_jaxpr'))
  if prim.name == 'device_put':  # an offloaded shard brought to the device (offload_params)
    return not all(d == jax.memory.Space.Device for d in params.get('devices', ()))
  return prim.name not in _GATHER_PRIMITIVES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedLeaf:
  """One device's shard of a parameter split over ZeRO axes, inside a manual region.

  `zerojax.value_and_grad(..., per_layer=True)` hands the loss function these
  in place of stage-3 parameters; `zerojax.gather` (and its linen and NNX
  adapters) turns them into whole arrays where the
  model uses them. Scanning over a stacked parameter slices `shard` and keeps
  the rest, so the split dimension is found again from `ndim`.

  Attributes:
    shard: this device's part.
    dim: the split dimension, counted in the array of `ndim` dimensions.
    axes: the mesh axes it is split over.
    ndim: the number of dimensions the parameter had when it was handed over.
    path: where it is in the parameter tree (for error messages).
    whole: at stage 2, the whole parameter this device holds already: the
      gather then moves nothing and only its gradient is reduce-scattered
      into `shard`'s place.
    quantize: the ZeRO++ quantized collectives (`zerojax.Quantize`) its gather
      and gradient use, or None for full precision.
    sink: with `update_on='stream'`, a stand-in in host memory of `shard`'s
      shape, which the gradient is taken with respect to: the reduce-scattered
      gradient goes to host memory as soon as it is computed (its value is
      never read). None: the gradient is `shard`'s, on the device.
    replicas: data-parallel mesh axes (`Options.replica_axis`, e.g. across TPU
      slices) over which the gather's backward also sums the reduce-scattered
      gradient, in the dtype it was gathered in; () leaves that to the caller.
    free: its layout over the mesh axes the region leaves to the compiler (a
      tensor-parallel axis), for the `ndim` dimensions; None where it is split
      over none. Its collectives then run manual over those axes too (see
      `on_free_axes`).
    host: `shard` is in host memory (`Options(offload_params=True)`): the gather
      first brings it to the device (inside a layer loop, one layer at a time),
      and its gradient goes to `sink`.

  Outside a gather it is not an array, and says so:

  >>> import jax.numpy as jnp, zerojax
  >>> leaf = zerojax.ShardedLeaf(jnp.ones((2, 4)), 0, ('data',), 2, "params['w']")
  >>> jnp.sum(leaf)
  Traceback (most recent call last):
  TypeError: parameter params['w'] was used without being gathered: ...
  """

  shard: jax.Array
  dim: int = dataclasses.field(metadata=dict(static=True))
  axes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
  ndim: int = dataclasses.field(metadata=dict(static=True))
  path: str = dataclasses.field(metadata=dict(static=True))
  whole: jax.Array | None = None
  quantize: Any = dataclasses.field(default=None, metadata=dict(static=True))
  sink: jax.Array | None = None
  replicas: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  free: PartitionSpec | None = dataclasses.field(default=None, metadata=dict(static=True))
  host: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def replace(self, **changes) -> ShardedLeaf:
    return dataclasses.replace(self, **changes)

  def __jax_array__(self):
    raise ungathered(self.path)

  # Indexing and arithmetic do not reach `__jax_array__` (an embedding lookup subscripts its
  # table first): each says the same.
  def _ungathered(self, *args, **kwargs):
    raise ungathered(self.path)

  __getitem__ = __array__ = __matmul__ = __rmatmul__ = _ungathered
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _ungathered

  def gather(self, dtype: Any = None) -> jax.Array:
    """The whole parameter: an all-gather of the shards (its transpose: a reduce-scatter)."""
    x = self.shard
    sliced = self.ndim - x.ndim  # leading dimensions a scan has taken off
    dim = self.dim - sliced
    if dim < 0:
      raise layer_axis_split(self.path, self.axes, self.dim)
    if self.host:
      x = jax.device_put(x, jax.memory.Space.Device)
    if self.sink is not None:
      x = to_sink(x, self.sink)
    free = None if self.free is None else PartitionSpec(*tuple(self.free)[sliced:])
    if self.whole is not None:
      collect = functools.partial(self._scattered_grad, dim=dim, dtype=dtype)
      return on_free_axes(collect, free, x, self.whole)
    collect = functools.partial(self._all_gather, dim=dim, dtype=dtype)
    return checkpoint_name(on_free_axes(collect, free, x), GATHERED)

  def _all_gather(self, x: jax.Array, *, dim: int, dtype: Any) -> jax.Array:
    """The gather's collectives on this device's part (ZeRO++ quantized if asked)."""
    q = self.quantize
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(dtype)
    if self.replicas:
      x = _summed_in_backward(x, self.replicas)
    if q is not None and q.weights is not None:
      return quantize_lib.quantized_all_gather(x, self.axes, dim, q)
    if q is not None:
      return quantize_lib.all_gather_with_quantized_grad(x, self.axes, dim, q)
    return all_gather_axes(x, self.axes, dim)

  def _scattered_grad(self, x: jax.Array, whole: jax.Array, *, dim: int, dtype: Any):
    """Stage 2: `whole`, whose gradient is reduce-scattered into `x`'s place."""
    q = self.quantize
    grads_q = q if q is not None and q.grads is not None else None
    x = _summed_in_backward(x, self.replicas) if self.replicas else x
    return _whole_with_scattered_grad(x, whole, dim, self.axes, dtype, grads_q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed_in_backward(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`x`; in the backward pass its cotangent is summed over `axes` (the replica axes: a
  gradient shard all-reduced across TPU slices once it is reduce-scattered)."""
  return x


def _summed_fwd(x, axes):
  return x, None


def _summed_bwd(axes, _, ct):
  return (jax.lax.psum(ct, axes[0] if len(axes) == 1 else axes),)


_summed_in_backward.defvjp(_summed_fwd, _summed_bwd)


def layer_axis_split(path: str, axes: Any, dim: int) -> ValueError:
  """The error for a stacked parameter split along the layer axis a loop walks."""
  return ValueError(
    f'parameter {path} is split over {axes} on dimension {dim}, the layer axis a layer loop'
    ' walks: each device would hold other layers. Mark the stacked layers so that ZeRO splits'
    " another dimension: zero_stage(..., stacked={'layers': True}) (their subtree in your"
    ' parameters), or give dimension 0 no mesh axis in `param_specs`.'
  )


def ungathered(path: str) -> TypeError:
  """The error for a split parameter used where its layer did not gather it."""
  return TypeError(
    f'parameter {path} was used without being gathered: inside'
    ' zerojax.value_and_grad(..., per_layer=True) split parameters arrive as shards,'
    ' and each layer gathers its own. Wrap the module with zerojax.linen.gathered'
    ' (linen) or zerojax.nnx.gathered (NNX), call zerojax.gather on the'
    ' parameters before use, or pass per_layer=False to gather everything up front.'
  )


# Over several mesh axes, collectives run one axis at a time: each is then a
# ring over one axis, which the TPU compiler keeps a real reduce-scatter or
# all-gather (over a whole 2-D torus it lowers a reduce-scatter to an
# all-reduce), and the bytes moved are the same as one collective over all.
# A dimension split over ('a', 'b') holds block a * |b| + b on device (a, b).


def all_gather_axes(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """Tiled all-gather over `axes` along `dim`, innermost axis first. Its gradient is the
  reduce-scatter; where JAX cannot lower `psum_scatter` (`compat.psum_scatter_fails_here`),
  the gather carries its own, which reduce-scatters another way."""
  if compat.psum_scatter_fails_here():
    return _all_gather_scattered_back(x, tuple(axes), dim)
  return _gather_each_axis(x, axes, dim)


def _gather_each_axis(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  for axis in reversed(axes):
    x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
  return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_gather_scattered_back(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  return _gather_each_axis(x, axes, dim)


def _all_gather_fwd(x, axes, dim):
  return _gather_each_axis(x, axes, dim), None


def _all_gather_bwd(axes, dim, _, ct):
  return (quantize_lib.reduce_scatter(ct, axes, dim, None),)


_all_gather_scattered_back.defvjp(_all_gather_fwd, _all_gather_bwd)


def psum_scatter_axes(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """Tiled reduce-scatter over `axes` along `dim`, in their order (full precision)."""
  return quantize_lib.reduce_scatter(x, axes, dim, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _whole_with_scattered_grad(shard, whole, dim, axes, dtype, quantize=None):
  """`whole` (cast to `dtype`), whose gradient goes to `shard`, reduce-scattered
  (ZeRO++ qgZ with `quantize`)."""
  del shard
  # Named like a gather, so `recompute_gathers` takes it again from `whole` in
  # the backward pass instead of keeping a copy of every layer.
  cast = dtype is not None and jnp.issubdtype(whole.dtype, jnp.floating)
  return checkpoint_name(whole.astype(dtype) if cast else whole, GATHERED)


def _whole_fwd(shard, whole, dim, axes, dtype, quantize):
  out = _whole_with_scattered_grad(shard, whole, dim, axes, dtype, quantize)
  return out, jnp.zeros((), shard.dtype)


def _whole_bwd(dim, axes, dtype, quantize, like, ct):
  return quantize_lib.reduce_scatter(ct, axes, dim, quantize).astype(like.dtype), None


_whole_with_scattered_grad.defvjp(_whole_fwd, _whole_bwd)


@jax.custom_vjp
def to_sink(x: jax.Array, sink: jax.Array) -> jax.Array:
  """`x`, whose gradient goes to `sink` in host memory instead (`update_on='stream'`)."""
  del sink
  return x


def _sink_fwd(x, sink):
  return x, jnp.zeros((0,), sink.dtype)  # only the sink's dtype is kept


def _sink_bwd(like, ct):
  # The shard is not differentiated (only its sink is): no zero cotangent is built for it.
  return None, jax.device_put(ct.astype(like.dtype), jax.memory.Space.Host)


to_sink.defvjp(_sink_fwd, _sink_bwd)


def is_sharded_leaf(x: Any) -> bool:
  return isinstance(x, ShardedLeaf)


def gather_manual(tree: Any, dtype: Any = None) -> Any:
  """Gathers the `ShardedLeaf`s of `tree`; other leaves are whole already (cast to `dtype`)."""

  def one(x):
    if isinstance(x, ShardedLeaf):
      return x.gather(dtype)
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree.map(one, tree, is_leaf=is_sharded_leaf)


def free_spec(
  spec: PartitionSpec, manual: tuple[str, ...], dim: int | None
) -> PartitionSpec | None:
  """`spec` over the mesh axes not in `manual`, or None where it splits over none of them, or
  where one shares dimension `dim` (the one the manual collectives split) with a manual axis."""
  entries = [tuple(a for a in rules.spec_axes(e) if a not in manual) for e in spec]
  if not any(entries) or (dim is not None and dim < len(entries) and entries[dim]):
    return None
  return PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in entries))


def on_free_axes(fn: Callable[..., jax.Array], spec: PartitionSpec | None, *xs: jax.Array):
  """`fn(*xs)`, collectives over the manual (ZeRO) axes, run manual over the axes `spec`
  splits `xs` over that are not manual here (a tensor-parallel axis the compiler places).

  Inside `jax.shard_map` over the ZeRO axes only, XLA makes the operand of an all-gather or a
  reduce-scatter over those axes whole over the other axes first: a parameter split over a
  tensor axis would be gathered whole on every chip. Manual over both, each chip gathers only
  its own tensor part, and the result leaves split over the tensor axis as it came in. `fn`
  keeps every dimension `spec` splits (it gathers or scatters another).
  """
  mesh = jax.sharding.get_abstract_mesh()
  used = {a for e in spec or () for a in rules.spec_axes(e)}
  free = used - set(mesh.manual_axes)
  if not free:
    return fn(*xs)
  return jax.shard_map(
    fn, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec, axis_names=free, check_vma=False
  )(*xs)


def _manual(axes: tuple[str, ...]) -> bool:
  """Whether the ZeRO axes are manual here (inside `value_and_grad`'s per-device loss, or any
  `jax.shard_map` over them): each device then holds its leaves whole, or as `ShardedLeaf`s."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  return bool(axes) and all(a in manual for a in axes)


def resolve(zero: Any) -> tuple[Any, tuple[str, ...], plan_lib.ZeroPlan | None]:
  """(mesh, ZeRO axes, plan or None) of a `ZeroPlan`, a `ZeroConfig` or a zero-wrapped tx."""
  if isinstance(zero, plan_lib.ZeroPlan):
    return zero.mesh, zero.axes, zero
  config = _config(zero)
  if config is None:
    raise TypeError(
      'zerojax.gather(tree, zero): `zero` says which mesh axes to gather over: the optimizer'
      ' made by zerojax.zero_stage, its zerojax.config_of(tx), or its plan'
      f' (zerojax.plan_for(tx, params)); got {type(zero).__name__}.'
    )
  return config.mesh, config.axes, None


def gather(
  tree: Any,
  zero: Any,
  *,
  dtype: Any = None,
  layouts: Any = None,
  scanned: bool = False,
) -> Any:
  """All-gathers ZeRO-sharded parameters over the ZeRO axes, for use.

  Only the ZeRO axes are gathered; tensor-parallel axes stay. The gradient of
  the gather is a reduce-scatter back into the shards. Called on the whole
  parameter tree it gathers everything at once: simple, but then the whole
  model is live on every device. For ZeRO-3 memory savings, call it per layer
  inside the layer loop (one layer's slice of a scanned stack), under
  `jax.checkpoint(..., policy=zerojax.recompute_gathers)`, so each layer's
  parameters are gathered just before use and dropped after (and gathered
  again in the backward pass). `zerojax.linen.gathered` and
  `zerojax.nnx.gathered` are this function applied to a module's parameters.

  Where it runs decides how:

  - inside `zerojax.value_and_grad`'s per-device loss, split parameters are
    `zerojax.ShardedLeaf`s and are all-gathered explicitly; other leaves are
    whole on every device already;
  - anywhere else, each leaf is laid out without the ZeRO axes and the
    compiler places the all-gather. Its layout over the other mesh axes is
    the plan's (when `zero` is a plan and `tree` is its whole parameter tree,
    or from `layouts`), else the array's own (Explicit axes, or placed
    arrays). Traced on Auto axes of a mesh with other axes, the array carries
    none: that is an error, not a guess.

  Args:
    tree: the parameters to gather (a whole tree, or one layer's slice).
    zero: which axes: the optimizer from `zerojax.zero_stage`, its
      `zerojax.config_of(tx)`, or its plan (`zerojax.plan_for(tx, params)`).
    dtype: cast floating leaves to this compute dtype *before* gathering, so
      the all-gather moves the smaller type (e.g. `jnp.bfloat16`).
    layouts: the plan's NamedShardings for `tree` when it is a subtree of the
      parameters, e.g. `plan.params['layers']`.
    scanned: `tree` is one layer of a stack (as `jax.lax.scan` slices it) and
      `layouts` describe the stack.

  Returns:
    `tree`, whole over the ZeRO axes.

  >>> import jax, jax.numpy as jnp, optax, zerojax
  >>> mesh = jax.make_mesh((len(jax.devices()),), ('data',))
  >>> tx = zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=mesh)
  >>> params = jax.device_put({'w': jnp.ones((64, 16))}, zerojax.plan_for(tx, {'w': jnp.ones((64, 16))}).params)
  >>> params['w'].sharding.spec, zerojax.gather(params, tx)['w'].sharding.spec
  (P('data', None), P(None, None))
  """
  mesh, axes, plan = resolve(zero)
  leaves = jax.tree.leaves(tree, is_leaf=is_sharded_leaf)
  if any(isinstance(x, ShardedLeaf) for x in leaves) or _manual(axes):
    return gather_manual(tree, dtype)
  if plan is None and layouts is None and variables.has_variables(tree):
    # Flax Variables say their layouts in their metadata where the arrays cannot: the plan of
    # this tree reads them there, as `plan_for(tx, tree)` does.
    config = _config(zero)
    resolved = layouts_lib.resolve(config, tree)
    plan = (
      plan_lib.plan_of(config, tree, layouts=resolved) if resolved.source == 'metadata' else None
    )
  if plan is not None and plan.quantize is not None:
    raise ValueError(
      'this plan asks for ZeRO++ quantized collectives (quantize=...), which zerojax places'
      ' itself inside zerojax.value_and_grad; here the compiler would gather in full'
      ' precision. Differentiate with zerojax.value_and_grad(loss_fn, tx, per_layer=True),'
      ' or build the optimizer without quantize.'
    )
  if layouts is None and plan is not None:
    if jax.tree.structure(tree) == jax.tree.structure(plan.params):
      layouts = plan.params
  if layouts is not None:
    shardings = jax.tree.map(
      lambda s: _without_zero_axes(s, axes, drop_leading=scanned),
      layouts,
      is_leaf=lambda s: isinstance(s, NamedSharding),
    )
  else:
    if scanned:
      raise ValueError('zerojax.gather(..., scanned=True) describes `layouts`: pass them too.')
    shardings = _own_layouts(tree, mesh, axes, _replica_axes(zero))
  return gather_to(tree, shardings, mesh, dtype)


def _config(zero: Any) -> config_lib.ZeroConfig | None:
  return zero if isinstance(zero, config_lib.ZeroConfig) else config_lib.config_of(zero)


def _replica_axes(zero: Any) -> tuple[str, ...]:
  """The data-parallel axes beside the ZeRO axes (nothing is ever split over them)."""
  if isinstance(zero, plan_lib.ZeroPlan):
    return zero.replica_axes
  config = _config(zero)
  return config.replica_axes if config is not None else ()


def _own_layouts(
  tree: Any, mesh: Any, axes: tuple[str, ...], replicas: tuple[str, ...] = ()
) -> Any:
  """Each leaf's layout without the ZeRO axes, read from the leaf itself.

  Raises:
    ValueError: a leaf traced on Auto axes (no layout to read) where the mesh
      has other axes it could be split over (not the data-parallel `replicas`).
  """
  hidden = not mesh_lib.any_explicit(mesh) and any(
    mesh.shape[a] > 1 for a in mesh.axis_names if a not in axes and a not in replicas
  )

  def one(path, x):
    if hidden and layouts_lib.is_traced(x):
      raise ValueError(
        f'zerojax.gather: params{jax.tree_util.keystr(path)} is traced on Auto mesh axes, where'
        ' arrays carry no layout, and the mesh has other axes than the ZeRO ones, so its'
        ' layout over them cannot be read. Pass the plan for the whole parameter tree'
        ' (zerojax.gather(params, zerojax.plan_for(tx, params))), or layouts=plan.params[...]'
        ' for a part of it, or use a mesh with Explicit axes.'
      )
    return NamedSharding(mesh, rules.normalize_spec(plan_lib.spec_of(x), x.ndim, mesh, axes))

  return jax.tree_util.tree_map_with_path(one, tree)


def _without_zero_axes(sharding: NamedSharding, axes, *, drop_leading: bool) -> NamedSharding:
  entries = list(sharding.spec)
  if drop_leading:
    entries = entries[1:]
  mesh = sharding.mesh
  return NamedSharding(
    mesh, rules.normalize_spec(PartitionSpec(*entries), len(entries), mesh, axes)
  )


def gather_to(tree: Any, shardings: Any, mesh, dtype: Any = None) -> Any:
  """Casts floating leaves to `dtype` (if given), then lays `tree` out as `shardings`.

  The cast comes first so the all-gather moves the smaller type; the layout is
  applied under `run_in_layout`, so it works on Explicit and Auto meshes.
  """
  if dtype is not None:
    tree = jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )
  out = mesh_lib.run_in_layout(lambda t: mesh_lib.constrain(t, shardings, mesh), mesh, shardings)(
    tree
  )
  return jax.tree.map(lambda x: checkpoint_name(x, GATHERED), out)
