"""Checks at the public boundary: every error names the argument, the path and the fix."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

_MAX_LISTED = 10


def _listing(items: list[str]) -> str:
  shown = items[:_MAX_LISTED]
  more = len(items) - len(shown)
  return '\n'.join(f'  {s}' for s in shown) + (f'\n  ... and {more} more' if more else '')


def count(n: int, one: str, many: str) -> str:
  """'1 leaf', '3 leaves'."""
  return f'{n} {one if n == 1 else many}'


def is_array_like(x: Any) -> bool:
  return hasattr(x, 'shape') and hasattr(x, 'dtype')


def abstract_arrays(tree: Any, name: str) -> Any:
  """`tree` as ShapeDtypeStructs, after checking every leaf is an array.

  Raises:
    TypeError: listing each non-array leaf with its path.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  bad = [
    f'{name}{jax.tree_util.keystr(path)}: {type(x).__name__} {x!r:.60}'
    for path, x in leaves
    if not is_array_like(x)
  ]
  if bad:
    raise TypeError(
      f'`{name}` must be a pytree of arrays, but {count(len(bad), "leaf is", "leaves are")} not:\n'
      f'{_listing(bad)}\n'
      f'Convert them with jnp.asarray, or keep non-array values out of `{name}`'
      ' (for example in a static field of the train state).'
    )
  return jax.tree.unflatten(
    treedef, [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for _, x in leaves]
  )


def check_like_params(tree: Any, params: Any, name: str) -> None:
  """Checks `tree` has the structure and shapes of `params`.

  Raises:
    ValueError: naming the paths missing or extra, or each mismatching shape.
  """
  t_leaves = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
  p_leaves = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  if jax.tree.structure(tree) != jax.tree.structure(params):
    missing = [jax.tree_util.keystr(k) for k in p_leaves if k not in t_leaves]
    extra = [jax.tree_util.keystr(k) for k in t_leaves if k not in p_leaves]
    detail = []
    if missing:
      detail.append(f'missing from `{name}`: {", ".join(missing[:_MAX_LISTED])}')
    if extra:
      detail.append(f'not in `params`: {", ".join(extra[:_MAX_LISTED])}')
    if not detail:
      detail.append(
        f'`{name}` has structure {jax.tree.structure(tree)}, `params` has'
        f' {jax.tree.structure(params)}'
      )
    raise ValueError(
      f'`{name}` must have the tree structure of `params`; '
      + '; '.join(detail)
      + f'. Compute `{name}` with jax.grad over the same `params`.'
    )
  bad = [
    f'{name}{jax.tree_util.keystr(k)}: shape {np.shape(t_leaves[k])} but params'
    f'{jax.tree_util.keystr(k)} has shape {np.shape(p_leaves[k])}'
    for k in p_leaves
    if np.shape(t_leaves[k]) != np.shape(p_leaves[k])
  ]
  if bad:
    raise ValueError(
      f'`{name}` must have the shapes of `params`, but {count(len(bad), "leaf differs", "leaves differ")}:\n'
      f'{_listing(bad)}'
    )


def key_name(key: Any) -> Any:
  """What a key-path entry names: a dict key, an attribute name or a sequence index."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return getattr(key, attr)
  return key


def stacked_leaves(marks: Any, tree: Any) -> list[bool | None]:
  """`Options.stacked` per leaf of `tree`, in `jax.tree.leaves` order.

  `marks` is True, False, None, or a dict (nested) keyed like `tree`'s dicts; a key it
  does not name is None. Each leaf takes the mark of the longest prefix of its path.

  Raises:
    ValueError: a mark that is not a bool, None or a dict, or a key no leaf's path has.
  """
  used: set[tuple] = set()

  def mark_of(path: tuple) -> bool | None:
    node, walked = marks, ()
    for key in path:
      if not isinstance(node, dict):
        break
      name = key_name(key)
      if name not in node:
        return None
      node, walked = node[name], walked + (name,)
      used.add(walked)
    if node is not None and not isinstance(node, bool):
      raise ValueError(
        f'`stacked` must be True, False, None or a dict of them keyed like the parameters'
        f" (e.g. {{'layers': True, 'head': False}}); at {list(walked)} it holds {node!r}."
      )
    return node

  out = [mark_of(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  unknown = sorted(str(list(k)) for k in _key_paths(marks) if k not in used)
  if unknown:
    raise ValueError(
      f'`stacked` names {", ".join(unknown)}, which no parameter path has: spell the keys as'
      ' the parameter tree does.'
    )
  return out


def _key_paths(marks: Any, prefix: tuple = ()) -> list[tuple]:
  """The key paths a nested dict of marks names."""
  if not isinstance(marks, dict):
    return []
  out = []
  for k, v in marks.items():
    out.append(prefix + (k,))
    out += _key_paths(v, prefix + (k,))
  return out


def broadcast_prefix(prefix: Any, tree: Any, name: str) -> Any:
  """Broadcasts a prefix tree of PartitionSpecs (or None) to the leaves of `tree`."""
  is_spec = lambda s: s is None or isinstance(s, PartitionSpec)
  try:
    return jax.tree.map(
      lambda spec, sub: jax.tree.map(lambda _: spec, sub), prefix, tree, is_leaf=is_spec
    )
  except ValueError as e:
    raise ValueError(
      f'`{name}` must be a PartitionSpec or a tree of them that is a prefix of `params`: {e}'
    ) from None


def listed(names: list[str], most: int = 3) -> str:
  """The first `most` of `names` joined for an error message, and how many more there are.

  >>> listed(['a', 'b', 'c', 'd', 'e'])
  'a, b, c and 2 more'
  """
  extra = len(names) - most
  return ', '.join(names[:most]) + (f' and {extra} more' if extra > 0 else '')
