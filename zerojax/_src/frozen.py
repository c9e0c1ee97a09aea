"""Frozen parameters: which leaves train (`Options.trainable`), and the trees the wrapped
optimizer sees.

A frozen leaf is a parameter the optimizer never changes (a LoRA base weight, a frozen
embedding). It is laid out at rest like any parameter (split at stage 3, gathered where it is
used), but it has no optimizer state, no master copy and no gradient in the update: the wrapped
optax optimizer runs on the trainable leaves alone, the frozen ones pruned from its trees as
`optax.masked` prunes them (`optax.MaskedNode`), and its update for a frozen leaf is zero.

Which leaves train is a fact of the parameters' record (`layouts.Resolved.frozen`), read once
per update with their layouts, so the plan is a function of (config, params, that record).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from zerojax._src import validation, variables

WHERE = 'zero_stage(trainable=...)'


def _leaves_with_paths(params: Any) -> list[tuple[tuple, Any]]:
  """(key path, leaf) per parameter, a Flax Variable kept whole (its path is its value's)."""
  return jax.tree_util.tree_flatten_with_path(params, is_leaf=variables.is_variable)[0]


def _by_predicate(fn: Callable, params: Any) -> list[bool]:
  out = []
  for path, leaf in _leaves_with_paths(params):
    answer = fn(path, leaf)
    if not isinstance(answer, bool):
      raise TypeError(
        f'{WHERE}: the predicate returned {type(answer).__name__} for'
        f' params{jax.tree_util.keystr(path)}; it must return True (the leaf trains) or False'
        ' (frozen), e.g. trainable=lambda path, x: "lora" in jax.tree_util.keystr(path).'
      )
    out.append(answer)
  return out


def _by_type(kind: type, params: Any) -> list[bool]:
  leaves = _leaves_with_paths(params)
  if not any(variables.is_variable(x) for _, x in leaves):
    raise ValueError(
      f'{WHERE}: trainable={kind.__name__} picks Flax Variables by type, and these parameters'
      ' are plain arrays, which carry no type (nnx.Optimizer hands tx.update plain arrays).'
      f' Give Flax the filter instead: nnx.Optimizer(model, tx, wrt=nnx.{kind.__name__}) trains'
      ' those alone; or give trainable a mask or a predicate on the path'
      " (lambda path, x: 'lora' in jax.tree_util.keystr(path))."
    )
  return [isinstance(x, kind) for _, x in leaves]


def _by_mask(mask: Any, params: Any) -> list[bool]:
  values = variables.values_of(params)
  try:
    full = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask, values)
  except ValueError as e:
    raise ValueError(
      f'{WHERE}: a mask must be True, False or a tree of them that is a prefix of the'
      f' parameters (a dict of the same keys, down to any depth): {e}'
    ) from None
  flags = jax.tree.leaves(full, is_leaf=lambda x: x is None)
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(values)[0]]
  bad = [
    f'params{jax.tree_util.keystr(p)}: {f!r}' for p, f in zip(paths, flags) if type(f) is not bool
  ]
  if bad:
    raise TypeError(
      f'{WHERE}: a mask holds True (trains) or False (frozen) for each leaf or subtree; got'
      f' {validation.listed(bad)}.'
    )
  return flags


def trainable_leaves(trainable: Any, params: Any) -> tuple[bool, ...] | None:
  """Per parameter leaf (in `jax.tree.leaves` order of their values): whether it trains. None
  when every leaf does (no `trainable`, or one that keeps them all).

  `trainable` is None, a bool or a prefix tree of bools (a mask), a predicate
  `(key_path, leaf) -> bool` (the leaf is the Flax Variable where the parameters are Variables),
  or a Flax Variable type (`nnx.LoRAParam`): the leaves of that type train.

  Raises:
    TypeError: a mask entry or a predicate's answer that is not a bool, named by path.
    ValueError: a mask that is not a prefix of the parameters; a type on plain arrays; a
      choice that leaves nothing to train.
  """
  if trainable is None:
    return None
  if isinstance(trainable, type):
    flags = _by_type(trainable, params)
  elif callable(trainable):
    flags = _by_predicate(trainable, params)
  else:
    flags = _by_mask(trainable, params)
  if flags and not any(flags):
    raise ValueError(
      f'{WHERE} leaves no parameter to train (all {len(flags)} leaves are frozen): check the'
      ' mask or predicate; a model with nothing to train needs no optimizer.'
    )
  return None if all(flags) else tuple(flags)


def prune(tree: Any, frozen: tuple[bool, ...] | None) -> Any:
  """`tree` (of the parameters' structure) with its frozen leaves replaced by
  `optax.MaskedNode()`, as `optax.masked` hands its inner optimizer; None stays None."""
  if tree is None or frozen is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  kept = [optax.MaskedNode() if f else x for x, f in zip(leaves, frozen, strict=True)]
  return jax.tree.unflatten(treedef, kept)


def trained(items: list, frozen: tuple[bool, ...] | None) -> list:
  """The entries of a per-leaf list that belong to trainable leaves."""
  if frozen is None:
    return items
  return [x for x, f in zip(items, frozen, strict=True) if not f]


def fill(pruned: Any, like: Any, frozen: tuple[bool, ...] | None, fills: list) -> Any:
  """The full tree of `like`'s structure: trainable leaves from `pruned` (in order), frozen ones
  from `fills` (one per frozen leaf, in order)."""
  if frozen is None:
    return pruned
  treedef = jax.tree.structure(like)
  got, filled = iter(jax.tree.leaves(pruned)), iter(fills)
  return jax.tree.unflatten(treedef, [next(filled) if f else next(got) for f in frozen])


def frozen_of(tree: Any, frozen: tuple[bool, ...] | None) -> list:
  """The leaves of `tree` that are frozen, in order."""
  if frozen is None:
    return []
  return [x for x, f in zip(jax.tree.leaves(tree), frozen, strict=True) if f]
