"""Per-layer gathering: each layer gathers its own ZeRO-3 shards just before use.

ZeRO-3 saves memory while training only if parameters are gathered layer by
layer inside the layer loop and let go after (and, under rematerialisation,
gathered again in the backward pass). Three forms of the same operation:

- `gather_leaves(tree)`: for hand-written functions (call it on one layer's
  parameters inside `jax.lax.scan`).
- `gathered_linen(ModuleClass)`: a Flax linen module class whose 'params' are
  gathered when it runs; wrap the block you pass to `nn.scan`/`nn.remat`.
- `gathered_nnx(module)`: an NNX module whose `nnx.Param`s are gathered; call
  it on the layer inside the scanned function.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from zerojax._src import gather, rules
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib


def gather_leaves(
  tree: Any,
  *,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  dtype: Any = None,
) -> Any:
  """All-gathers each leaf over the ZeRO axes, keeping its other axes.

  Each leaf's layout is read from the array itself (its type, under an
  Explicit mesh). Under an Auto mesh, where traced arrays carry no layout,
  leaves are gathered to fully replicated; use `zerojax.gather_params` with the
  plan to keep tensor-parallel axes there. The gradient of the gather is a
  reduce-scatter back into the shards.

  Args:
    tree: arrays (e.g. one layer's parameters inside `jax.lax.scan`).
    mesh: the device mesh; defaults to the one set by `jax.set_mesh`.
    axis: the ZeRO mesh axis or axes.
    dtype: cast floating leaves to this compute dtype before gathering, so the
      all-gather moves the smaller type.

  Returns:
    `tree`, gathered.
  """
  if gather.gathers_explicitly(tree):  # inside value_and_grad's per-device loss
    return gather.gather_manual(tree, dtype)
  mesh = mesh_lib.resolve_mesh(mesh)
  axes = mesh_lib.resolve_axes(mesh, axis)
  shardings = jax.tree.map(
    lambda x: NamedSharding(mesh, rules.normalize_spec(plan_lib.spec_of(x), x.ndim, mesh, axes)),
    tree,
  )
  return gather.gather_to(tree, shardings, mesh, dtype)


def gathered_linen(
  module_cls: type[nn.Module],
  *,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  dtype: Any = None,
) -> type[nn.Module]:
  """A linen module class whose 'params' are all-gathered when it is applied.

  Use it on the block of a scanned model, under `nn.remat`, so that each
  block's parameters are gathered inside the layer loop, used, and dropped:

      Block = nn.remat(zerojax.gathered_linen(Block, mesh=mesh))
      x, _ = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True},
                     length=n_layers)(...)(x, None)

  Args:
    module_cls: the linen Module class to wrap.
    mesh: the device mesh; defaults to the one set by `jax.set_mesh`.
    axis: the ZeRO mesh axis or axes.
    dtype: compute dtype to cast parameters to before the gather.

  Every public method of the class gathers, not only `__call__`: a tied
  embedding's `attend` sees whole parameters too.

  Returns:
    A Module class with the same constructor.
  """

  def trans_in(variables):
    return gather_leaves(variables, mesh=mesh, axis=axis, dtype=dtype)

  return nn.map_variables(
    module_cls, 'params', trans_in_fn=trans_in, init=True, methods=_public_methods(module_cls)
  )


def _public_methods(module_cls: type[nn.Module]) -> list[str]:
  """`__call__` and the public methods a linen Module subclass defines (not `setup`)."""
  base = set(dir(nn.Module)) | {f.name for f in dataclasses.fields(module_cls)}  # not fields
  names = [
    name
    for name, value in inspect.getmembers(module_cls, inspect.isfunction)
    if not name.startswith('_') and name not in base
  ]
  defines_call = any(
    '__call__' in vars(k) for k in module_cls.__mro__ if k not in (nn.Module, object)
  )
  return (['__call__'] if defines_call else []) + names


def gathered_nnx(
  module: nnx.Module,
  *,
  mesh: Mesh | None = None,
  axis: mesh_lib.AxisName = 'data',
  dtype: Any = None,
) -> nnx.Module:
  """A copy of an NNX module with its `nnx.Param`s all-gathered, for use.

  Call it on a layer inside the scanned (and rematerialised) function, so the
  gathered copy lives only while that layer runs. Gradients flow back to the
  original sharded parameters as reduce-scatters.
  """
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  params = gather_leaves(params, mesh=mesh, axis=axis, dtype=dtype)
  return nnx.merge(graphdef, params, rest)
