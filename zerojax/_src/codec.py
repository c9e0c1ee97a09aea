"""The on-disk form of a checkpoint: the tree saved (a train state's step, params and opt_state,
or any pytree, and the extras), typed keys as raw data, the leaf table and the structure of
`extra` recorded beside it, and leaves in their logical (unpadded, global) shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import train_state as train_state_lib
from zerojax._src import transform


def as_array(x: Any) -> Any:
  """Python scalars (a fresh TrainState's `step=0`) as arrays; arrays as they are."""
  if isinstance(x, (int, float, bool, np.number)) and not isinstance(x, jax.Array):
    return jnp.asarray(x)
  return x


def state_tree(state: Any) -> dict:
  """The arrays to save: a train state's step, params and opt_state, or any pytree."""
  if train_state_lib.is_train_state(state):
    return {
      'step': as_array(state.step),
      'params': state.params,
      'opt_state': state.opt_state,
    }
  return {'tree': jax.tree.map(as_array, state)}


def plan_of(state: Any) -> plan_lib.ZeroPlan | None:
  """The plan of a zero-wrapped train state, if `state` is one."""
  config = transform.config_of(getattr(state, 'tx', None))
  if config is None or not train_state_lib.is_train_state(state):
    return None
  return plan_lib.plan_of(config, state.params)


def state_padding(state: Any, plan: plan_lib.ZeroPlan | None) -> list:
  """Per opt_state leaf: None or (dim, logical size) when it is padded in `state`."""
  leaves = jax.tree.leaves(state.opt_state) if plan is not None else []
  if plan is None or len(plan.state_padding) != len(leaves):
    return [None] * len(leaves)
  out = []
  for x, pad in zip(leaves, plan.state_padding):
    out.append(pad if pad is not None and x.shape[pad[0]] != pad[1] else None)
  return out


def to_logical(leaves: list, pads: list, sharding: Any = None) -> list:
  """Leaves padded for the optimizer (policy='pad') at their logical size; `pads` per leaf:
  None or (dim, logical size). Arrays are sliced; ShapeDtypeStructs (what to read) become
  the logical shape, placed with `sharding` (replicated) to be padded by `from_logical`."""
  out = []
  for x, pad in zip(leaves, pads):
    if pad is not None:
      dim, size = pad
      if isinstance(x, jax.ShapeDtypeStruct):
        shape = (*x.shape[:dim], size, *x.shape[dim + 1 :])
        x = jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
      else:
        x = jax.lax.slice_in_dim(x, 0, size, axis=dim)
    out.append(x)
  return out


def from_logical(leaves: list, pads: list, targets: list) -> list:
  """`to_logical` undone: logical leaves zero-padded to their target's padded shape, in the
  target's layout (`targets`: ShapeDtypeStructs with shardings)."""
  out = []
  for x, pad, target in zip(leaves, pads, targets):
    if pad is not None:
      widths = [(0, 0)] * x.ndim
      widths[pad[0]] = (0, target.shape[pad[0]] - x.shape[pad[0]])
      x = jax.jit(lambda v, w=tuple(widths): jnp.pad(v, w), out_shardings=target.sharding)(x)
    out.append(x)
  return out


def encode_keys(tree: Any) -> tuple[Any, dict[str, str]]:
  """Typed PRNG keys become their raw data (orbax saves plain arrays)."""
  impls = {}

  def encode(path, x):
    if hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
      return jax.random.key_data(x)
    return x

  return jax.tree_util.tree_map_with_path(encode, tree), impls


def decode_keys(tree: Any, impls: dict) -> Any:
  """Raw key data back into typed PRNG keys, wherever they were in the saved tree."""

  def decode(path, x):
    impl = impls.get(jax.tree_util.keystr(path))
    return jax.random.wrap_key_data(x, impl=impl) if impl else x

  return jax.tree_util.tree_map_with_path(decode, tree)


def abstract(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) for a tree of arrays or ShapeDtypeStructs."""

  def one(x):
    x = as_array(x)
    sharding = getattr(x, 'sharding', None)
    if hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, tree)


def leaf_table(tree: Any) -> dict[str, dict]:
  return {
    jax.tree_util.keystr(path): {'shape': list(np.shape(x)), 'dtype': str(x.dtype)}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def structure(tree: Any, where: str) -> Any:
  """A JSON description of `extra`'s containers, to rebuild it at restore.

  Raises:
    TypeError: a node that is not a dict, list, tuple, None or array.
  """
  if isinstance(tree, dict):
    bad = [k for k in tree if not isinstance(k, str)]
    if bad:
      raise TypeError(f'`extra`{where[9:]} has a key {bad[0]!r} that is not a string.')
    return {'dict': {k: structure(v, f'{where}[{k!r}]') for k, v in tree.items()}}
  if isinstance(tree, (list, tuple)):
    kind = 'list' if isinstance(tree, list) else 'tuple'
    return {kind: [structure(v, f'{where}[{i}]') for i, v in enumerate(tree)]}
  if tree is None:
    return {'none': None}
  if hasattr(tree, 'shape') and hasattr(tree, 'dtype') or isinstance(tree, (int, float, bool)):
    return {'leaf': where}
  raise TypeError(
    f'`extra`{where[9:]} is a {type(tree).__name__}; extra holds arrays (or Python numbers)'
    ' in dicts, lists and tuples.'
  )


def saved_extra(meta: dict, sharding: Any) -> Any:
  """ShapeDtypeStructs for the saved `extra`, in its saved structure, rebuilt from the metadata."""
  leaves = meta['leaves']

  def build(node):
    kind, value = next(iter(node.items()))
    if kind == 'dict':
      return {k: build(v) for k, v in value.items()}
    if kind in ('list', 'tuple'):
      items = [build(v) for v in value]
      return items if kind == 'list' else tuple(items)
    if kind == 'none':
      return None
    leaf = leaves[value]
    return jax.ShapeDtypeStruct(tuple(leaf['shape']), np.dtype(leaf['dtype']), sharding=sharding)

  structure = meta.get('extra_structure')
  if structure is not None:
    return build(structure)
  # Checkpoints written before the structure was recorded: flat dicts.
  out = {}
  for path, leaf in leaves.items():
    if path.startswith("['extra']"):
      out[path[len("['extra']['") : -2]] = jax.ShapeDtypeStruct(
        tuple(leaf['shape']), np.dtype(leaf['dtype']), sharding=sharding
      )
  return out


def global_leaves(tree: Any, sharding: Any) -> Any:
  """With several processes, host-local leaves (a step counter, extras) become global.

  Every process saves together, so each leaf must be one global array; a value
  that lives on one local device (or in numpy) is placed replicated on the
  state's mesh. It must be the same in every process.
  """
  if jax.process_count() == 1 or sharding is None:
    return tree

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    return jax.device_put(np.asarray(jax.device_get(x)), sharding)

  return jax.tree.map(one, tree)


def replicated_on_target(target: Any) -> Any:
  """A replicated sharding on the target's mesh, so extras sit beside the state."""
  config = transform.config_of(getattr(target, 'tx', None))
  if config is not None:
    return mesh_lib.replicated(config.mesh)
  for x in jax.tree.leaves(target):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return mesh_lib.replicated(sharding.mesh)
  return None


def with_default_sharding(x: jax.ShapeDtypeStruct, rep: Any) -> jax.ShapeDtypeStruct:
  """Leaves that carry no sharding (Python scalars, numpy) are read replicated."""
  if x.sharding is not None:
    return x
  sharding = rep or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
