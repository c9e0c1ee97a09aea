"""The ZeRO plan: NamedSharding layouts for params, grads and optimizer state."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import OrderedDict
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax._src import frozen as frozen_lib
from zerojax._src import layouts as layouts_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import rules, validation
from zerojax._src.config import ZeroConfig


@dataclasses.dataclass(frozen=True)
class PlanRow:
  """One leaf of the plan, for printing and accounting."""

  group: str  # 'params' or 'opt_state'
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  at_rest: PartitionSpec
  grads: PartitionSpec | None  # params rows only
  reason: str | None  # why the leaf stays whole on the ZeRO axes, if it does
  offloaded: bool = False  # kept in host memory (memory_kind='pinned_host')
  frozen: bool = False  # params rows only: not trained (no gradient, no optimizer state)


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroPlan:
  """Where every piece of the training state lives, for one ZeRO stage.

  Attributes:
    stage: the ZeRO stage, 0 to 3.
    mesh: the device mesh.
    axes: the mesh axes that ZeRO partitions over.
    params: NamedSharding per parameter, at rest (sharded only at stage 3; in host
      memory with `offload_params`).
    grads: NamedSharding per gradient, as reduced (sharded from stage 2).
    opt_state: NamedSharding per optimizer-state leaf (sharded from stage 1).
    param_shards: NamedSharding per parameter, fully sharded: the slice of the
      update each device computes from stage 1 up.
    rows: per-leaf records behind `str(plan)`.
    padding: per parameter leaf (in `jax.tree.leaves` order), None, or the
      (dimension, padded size) its gradient and optimizer state are padded to
      under policy='pad'.
    param_axes: the axes stage-3 parameters are split over at rest (hpZ: a
      subset of `axes`, e.g. the devices of one host); None means `axes`.
    state_padding: per optimizer-state leaf (in `jax.tree.leaves` order),
      None, or the (dimension, logical size) of a leaf padded under
      policy='pad': what checkpoints slice off to save the logical layout.
    quantize: the ZeRO++ quantized collectives asked for (`zerojax.Quantize`),
      or None.
    unquantized: with `quantize`, per parameter leaf (in `jax.tree.leaves`
      order), None where its collectives are quantized, else why they stay
      full precision.
    replica_axes: the data-parallel axes beside the ZeRO axes (`Options.replica_axis`;
      by default those across TPU slices): every position along them holds a whole
      copy of the split state.
    frozen: per parameter leaf (in `jax.tree.leaves` order), whether it is frozen
      (`Options.trainable`): laid out in `params` like the others, with no gradient and no
      optimizer state (`opt_state` is the state of the trainable leaves alone); () when
      every leaf trains. `grads` and `param_shards` still name a layout for every leaf.
  """

  stage: int
  mesh: Mesh
  axes: tuple[str, ...]
  params: Any
  grads: Any
  opt_state: Any
  param_shards: Any
  rows: tuple[PlanRow, ...]
  padding: tuple[tuple[int, int] | None, ...] = ()
  param_axes: tuple[str, ...] | None = None
  state_padding: tuple[tuple[int, int] | None, ...] = ()
  quantize: Any = None
  unquantized: tuple[str | None, ...] = ()
  replica_axes: tuple[str, ...] = ()
  frozen: tuple[bool, ...] = ()

  def trainable_part(self) -> ZeroPlan:
    """The plan of the trainable leaves alone, what the wrapped optimizer runs on: `params`,
    `grads` and `param_shards` with the frozen leaves pruned (`optax.MaskedNode`), the
    per-leaf tuples without them. The plan itself when nothing is frozen."""
    if not any(self.frozen):
      return self
    frozen = self.frozen
    keep = lambda items: tuple(frozen_lib.trained(list(items), frozen)) if items else items
    param_rows = [r for r in self.rows if r.group == 'params']
    return dataclasses.replace(
      self,
      params=frozen_lib.prune(self.params, frozen),
      grads=frozen_lib.prune(self.grads, frozen),
      param_shards=frozen_lib.prune(self.param_shards, frozen),
      rows=tuple(keep(param_rows)) + tuple(r for r in self.rows if r.group != 'params'),
      padding=keep(self.padding),
      unquantized=keep(self.unquantized),
      frozen=(),
    )

  def quantized(self) -> tuple[Any, ...]:
    """Per parameter leaf (in `jax.tree.leaves` order): the `Quantize` that applies, or None."""
    if self.quantize is None:
      return (None,) * len(jax.tree.leaves(self.params))
    return tuple(self.quantize if why is None else None for why in self.unquantized)

  @property
  def num_shards(self) -> int:
    """Number of devices along the ZeRO axes."""
    return mesh_lib.axes_size(self.mesh, self.axes)

  def bytes_per_device(self) -> dict[str, int]:
    """Bytes per device of params and optimizer state at rest, and of grads.

    Offloaded optimizer state and parameters (`offload_params`) are counted under
    'host' (host memory per device), not under 'opt_state' or 'params'.
    """
    out = {'params': 0, 'grads': 0, 'opt_state': 0, 'host': 0}
    for r in self.rows:
      n = rules.bytes_per_device(r.shape, r.dtype, r.at_rest, self.mesh)
      out['host' if r.offloaded else r.group] += n
      if r.grads is not None:
        out['grads'] += rules.bytes_per_device(r.shape, r.dtype, r.grads, self.mesh)
    return out

  def replicated(self) -> list[tuple[str, str, str]]:
    """(group, path, reason) for each leaf that stays whole on the ZeRO axes."""
    return [(r.group, r.path, r.reason) for r in self.rows if r.reason is not None]

  def __str__(self) -> str:
    return format_plan(self)


def fmt_bytes(n: int) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if n < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.2f} {unit}'
    n /= 1024
  raise AssertionError


def _spec_str(spec: PartitionSpec) -> str:
  return 'P(' + ', '.join(repr(e) if e is not None else 'None' for e in spec) + ')'


def format_plan(plan: ZeroPlan) -> str:
  """The per-leaf table that `str(plan)` prints."""
  axes = plan.axes[0] if len(plan.axes) == 1 else plan.axes
  lines = [
    f'ZeroPlan: stage {plan.stage} over mesh axis {axes!r} ({plan.num_shards} shards)'
    f' of mesh {dict(plan.mesh.shape)}',
    *_leaf_table(plan),
  ]
  totals = plan.bytes_per_device()
  host = totals.pop('host')
  total = sum(totals.values())
  lines.append(
    'per device: '
    + ', '.join(f'{k} {fmt_bytes(v)}' for k, v in totals.items())
    + f'; total {fmt_bytes(total)}'
    + (f'; in host memory (offloaded) {fmt_bytes(host)}' if host else '')
  )
  if plan.stage in (1, 2):
    lines.append(_STAGES_1_2[plan.stage])
  reps = plan.replicated()
  if reps:
    lines.append(f'replicated over {axes!r} ({plan.num_shards} devices): {len(reps)} leaves')
    lines.extend(f'  {g}{p}: {why}' for g, p, why in reps)
  else:
    lines.append(f'replicated over {axes!r} ({plan.num_shards} devices): no leaves')
  return '\n'.join(lines + _quantized_and_padded(plan))


# Stages 1 and 2 differ in the gradients they keep between calls; inside one jitted step that
# takes its gradients and updates at once, neither keeps whole gradients after the update.
_STAGES_1_2 = {
  1: 'gradients: whole where they are kept between calls; inside one jitted step (gradients'
  ' taken and applied at once) the compiler reduces them into the shards each device updates,'
  ' so stages 1 and 2 compile alike there. Stage 2 keeps them split between calls too'
  ' (accumulation across steps).',
  2: 'gradients: split where they are kept between calls (accumulation across steps); inside'
  ' one jitted step (gradients taken and applied at once) stages 1 and 2 compile alike.',
}


def _leaf_table(plan: ZeroPlan) -> list[str]:
  """The table's lines: a header, a rule, and a row per leaf."""
  header = ('group', 'path', 'shape', 'dtype', 'spec at rest', 'grads spec', 'bytes/device')
  table = []
  for r in plan.rows:
    nbytes = rules.bytes_per_device(r.shape, r.dtype, r.at_rest, plan.mesh)
    grads = _spec_str(r.grads) if r.grads is not None else 'frozen' if r.frozen else ''
    table.append(
      (r.group, r.path or '(root)', str(r.shape), r.dtype.name, _spec_str(r.at_rest), grads)
      + (f'{nbytes:,}',)
    )
  widths = [
    max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)
  ]
  fmt = lambda row: '  '.join(
    c.ljust(w) if i < 6 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
  )
  return [fmt(header), '  '.join('-' * w for w in widths), *(fmt(row) for row in table)]


def _quantized_and_padded(plan: ZeroPlan) -> list[str]:
  """The lines on ZeRO++ quantized collectives and on padded leaves, where the plan has them."""
  lines = []
  param_rows = [r for r in plan.rows if r.group == 'params']
  if plan.quantize is not None:
    q = plan.quantize
    off = [(r, why) for r, why in zip(param_rows, plan.unquantized) if why is not None]
    lines.append(
      f'ZeRO++ quantized collectives (weights {q.weights}, gradients {q.grads}, blocks of'
      f' {q.block_size}): {len(param_rows) - len(off)} of {len(param_rows)} parameter leaves'
    )
    lines.append(f'full precision ({len(off)}):' if off else 'full precision: none')
    lines.extend(f'  params{r.path}: {why}' for r, why in off)
  padded = [(r, pad) for r, pad in zip(param_rows, plan.padding) if pad is not None]
  if padded:
    lines.append(f"padded for the optimizer (policy='pad') ({len(padded)}):")
    for r, (dim, size) in padded:
      shape = list(r.shape)
      shape[dim] = size
      lines.append(f'  params{r.path}: {r.shape} -> {tuple(shape)} along dimension {dim}')
  return lines


spec_of = layouts_lib.spec_of


def _match_param(state_path: tuple, param_paths: dict[tuple, Any], shape) -> Any:
  """The parameter whose key path ends `state_path`, with the same shape."""
  for start in range(len(state_path) + 1):
    hit = param_paths.get(tuple(state_path[start:]))
    if hit is not None and hit[0] == tuple(shape):
      return hit
  return None


def _paths(tree: Any) -> list[tuple[tuple, Any]]:
  return jax.tree_util.tree_flatten_with_path(tree)[0]


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """Flattened leaves of a tree with their paths, and a layout rule for each."""

  entries: list[tuple[tuple, Any]]
  rules: list[rules.LeafRule]
  treedef: Any


def build_plan(
  config: ZeroConfig,
  params: optax.Params,
  layouts: layouts_lib.Resolved,
  opt_state: optax.OptState | None = None,
) -> ZeroPlan:
  """The ZeRO layouts of `params`, their grads and the optimizer's state, in named steps: a
  function of its inputs. `layouts` (`layouts.resolve`) says where each parameter is split
  over the other mesh axes.

  Nothing is allocated: shapes come from `params` (arrays, tracers or
  ShapeDtypeStructs) and the optimizer state is evaluated abstractly, unless
  `opt_state` is given to lay out instead.
  """
  param_axes = order_axes(config.mesh, config.axes, config.options.param_axis)[1]
  leaf_rule = _leaf_rule_for(config)
  param_leaves, opt_shapes = _param_rules(params, config, leaf_rule, layouts)
  frozen = layouts.frozen or ()
  state_leaves, state_padding = _state_rules(
    param_leaves, opt_shapes, config, leaf_rule, opt_state, frozen
  )
  _check_splittable(param_leaves, state_leaves, config, frozen)
  return _assemble(param_leaves, state_leaves, state_padding, param_axes, config, frozen)


def _leaf_rule_for(config: ZeroConfig):
  # Padding only matters where something is split: from stage 1 up.
  pad = config.options.policy == 'pad' and config.stage >= 1

  def rule_for(shape, dtype, base, stacked=None):
    return rules.leaf_rule(
      shape,
      dtype,
      base,
      mesh=config.mesh,
      axes=config.axes,
      replicate_below_bytes=config.options.replicate_below_bytes,
      pad=pad,
      stacked=stacked,
    )

  return rule_for


def _param_rules(params, config: ZeroConfig, rule_for, layouts) -> tuple[_Leaves, list]:
  """A rule per parameter (keeping its tensor-parallel layout), and the shapes the
  optimizer sees (padded where the policy pads)."""
  abstract = validation.abstract_arrays(params, 'params')
  if layouts.specs is not None:
    specs = validation.broadcast_prefix(layouts.specs, params, 'param_specs')
  else:
    specs = jax.tree.map(spec_of, params)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec))
  entries = _paths(abstract)
  if layouts.source == 'param_specs':
    _check_spec_axes(entries, spec_leaves, config.mesh)
  stacked = validation.stacked_leaves(config.options.stacked, params)
  leaf_rules = [
    rule_for(x.shape, x.dtype, s, k) for (_, x), s, k in zip(entries, spec_leaves, stacked)
  ]
  _check_layer_axes(entries, leaf_rules, stacked)
  opt_shapes = [r.padded_shape or r.shape for r in leaf_rules]
  return _Leaves(entries, leaf_rules, jax.tree.structure(abstract)), opt_shapes


def _check_spec_axes(entries, spec_leaves, mesh: Mesh) -> None:
  """Raises ValueError where `param_specs` name an axis the mesh does not have (most often
  a logical axis name no rules turned into a mesh axis): its dimension would be laid out
  whole without a word."""
  for (path, _), spec in zip(entries, spec_leaves):
    named = [e for e in spec or () if isinstance(e, (str, tuple))]
    unknown = [a for e in named for a in rules.spec_axes(e) if a not in mesh.axis_names]
    if unknown:
      raise ValueError(
        f'param_specs{jax.tree_util.keystr(path)} is {spec}, and {unknown[0]!r} is not an axis'
        f' of the mesh {tuple(mesh.axis_names)}. Logical axis names need their rules to become'
        ' mesh axes: param_specs=zerojax.nnx.logical_param_specs(params, rules) for NNX,'
        ' zerojax.linen.logical_param_specs(params, rules) for linen.'
      )


def _check_layer_axes(entries, leaf_rules, stacked) -> None:
  """Raises ValueError where `param_specs` (or a leaf's own layout) splits the layer axis of a
  leaf marked stacked: a layer loop would hand each device other layers' parameters."""
  offending = [
    f'  params{jax.tree_util.keystr(path)}: shape {rule.shape}, layout {rule.base}:'
    f' dimension 0 split over {rule.base[0]!r}'
    for (path, _), rule, walked in zip(entries, leaf_rules, stacked)
    if walked and len(rule.shape) >= 2 and rule.base[0] is not None
  ]
  if offending:
    raise ValueError(
      f'{validation.count(len(offending), "stacked leaf", "stacked leaves")} would be split'
      ' along the layer axis (dimension 0), which a layer loop walks:\n'
      + '\n'.join(offending)
      + '\nGive dimension 0 no mesh axis in `param_specs` (e.g. P(None, ...)), or pass'
      ' `stacked=False` for leaves whose leading dimension is not a layer axis.'
    )


def _state_rules(
  param_leaves: _Leaves, opt_shapes: list, config: ZeroConfig, rule_for, opt_state, frozen=()
) -> tuple[_Leaves, list]:
  """A rule per optimizer-state leaf: its parameter's when path and shape match. The state
  is the wrapped optimizer's on the trainable leaves alone (`frozen` pruned)."""
  if opt_state is not None:
    state_abstract = validation.abstract_arrays(opt_state, 'opt_state')
  else:
    opt_params = jax.tree.unflatten(
      param_leaves.treedef,
      [jax.ShapeDtypeStruct(s, r.dtype) for s, r in zip(opt_shapes, param_leaves.rules)],
    )
    opt_params = frozen_lib.prune(opt_params, frozen or None)
    state_abstract = jax.eval_shape(config.inner.init, opt_params)
  entries = _paths(state_abstract)
  by_path = {
    path: (shape, rule)
    for (path, _), shape, rule in zip(param_leaves.entries, opt_shapes, param_leaves.rules)
  }
  leaf_rules, padding = [], []
  for path, x in entries:
    hit = _match_param(path, by_path, x.shape)
    leaf_rules.append(hit[1] if hit is not None else rule_for(x.shape, x.dtype, None))
    padded = hit is not None and hit[1].padded_shape is not None
    padding.append((hit[1].dim, hit[1].shape[hit[1].dim]) if padded else None)
  return _Leaves(entries, leaf_rules, jax.tree.structure(state_abstract)), padding


def _must_split(stage: int) -> dict[str, bool]:
  """Which groups the stage splits over the ZeRO axes."""
  return {'params': stage >= 3, 'grads': stage >= 2, 'opt_state': stage >= 1}


def _check_splittable(
  param_leaves: _Leaves, state_leaves: _Leaves, config: ZeroConfig, frozen=()
) -> None:
  """Under policy='error', every leaf the stage must split can be split; else one error.
  A frozen leaf has no gradient to split: only stage 3's parameters."""
  must = _must_split(config.stage)
  offending = []
  is_frozen = frozen or (False,) * len(param_leaves.rules)
  for (path, _), rule, cold in zip(param_leaves.entries, param_leaves.rules, is_frozen):
    split = must['params'] or (must['grads'] and not cold)
    if rule.indivisible and rule.dim is None and split:
      offending.append(('params', path, rule))
  for (path, _), rule in zip(state_leaves.entries, state_leaves.rules):
    if rule.indivisible and rule.dim is None and must['opt_state']:
      offending.append(('opt_state', path, rule))
  if not offending or config.options.policy != 'error':
    return
  n = mesh_lib.axes_size(config.mesh, config.axes)
  axis = config.axes[0] if len(config.axes) == 1 else config.axes
  listing = '\n'.join(
    f'  {group}{jax.tree_util.keystr(path)}: shape {r.shape}, {r.reason}'
    for group, path, r in offending
  )
  raise ValueError(
    f'{validation.count(len(offending), "leaf", "leaves")} cannot be split over mesh axis'
    f' {axis!r} of size {n}'
    f' for ZeRO stage {config.stage}:\n{listing}\n'
    f"Pass `policy='replicate'` to keep them whole on every device, `policy='pad'` to"
    ' pad their gradients and optimizer state to a multiple of the axis size, raise'
    f' `replicate_below_bytes` above their size, or choose a mesh whose {axis!r}'
    ' size divides one of their dimensions.'
  )


def _layout(rule: rules.LeafRule, split: bool, axes, padded_ok: bool = True, within=None):
  """A leaf's PartitionSpec: split by its rule, or whole. A padded split exists only inside the
  optimizer: parameters and the gradients handed to it keep their true shape, so they stay
  whole. `within`: the parameter axes of hpZ, a subset of `axes`."""
  if (rule.padded_shape is not None and not padded_ok) or not split:
    return rule.base
  if within is None or rule.dim is None:
    return rule.sharded
  return _restrict(rule.sharded, rule.dim, within, axes)


def _named(mesh, explicit: bool, spec: PartitionSpec, memory_kind: str | None = None):
  """The NamedSharding in the form JAX itself gives arrays on this kind of mesh, so that
  `array.sharding == plan_leaf` holds: Explicit meshes keep one entry per dimension, Auto
  meshes drop trailing Nones."""
  if not explicit:
    entries = list(spec)
    while entries and entries[-1] is None:
      entries.pop()
    spec = PartitionSpec(*entries)
  return NamedSharding(mesh, spec, memory_kind=memory_kind)


def _why(rule: rules.LeafRule, split: bool, padded_ok: bool = True) -> str | None:
  """Why a leaf that should be split is not (None when it is, or need not be)."""
  if not split:
    return None
  if rule.padded_shape is not None:
    return None if padded_ok else rule.reason + " (policy='pad')"
  if rule.dim is not None:
    return None
  return rule.reason + (" (policy='replicate')" if rule.indivisible else '')


def _assemble(
  param_leaves: _Leaves, state_leaves: _Leaves, state_padding: list, param_axes, config, frozen=()
) -> ZeroPlan:
  """NamedShardings and per-leaf rows from the rules."""
  mesh, axes = config.mesh, config.axes
  must = _must_split(config.stage)
  explicit = mesh_lib.any_explicit(mesh)
  named = functools.partial(_named, mesh, explicit)

  hpz = param_axes if param_axes != axes else None
  rows, p_rest, p_grad, p_shard = [], [], [], []
  is_frozen = frozen or (False,) * len(param_leaves.rules)
  for (path, _), rule, cold in zip(param_leaves.entries, param_leaves.rules, is_frozen):
    memory = HOST if config.options.offload_params and rule.shape else None  # offload_params
    p_rest.append(named(_layout(rule, must['params'], axes, padded_ok=False, within=hpz), memory))
    p_grad.append(named(_layout(rule, must['grads'], axes, padded_ok=False)))
    p_shard.append(named(_layout(rule, config.stage >= 1, axes)))
    reason = _why(rule, must['params'] or must['grads'], padded_ok=False)
    grads = None if cold else p_grad[-1].spec  # a frozen leaf has no gradient
    rows.append(_param_row(path, rule, p_rest[-1].spec, grads, reason, memory, cold))
  s_rest = []
  for (path, x), rule in zip(state_leaves.entries, state_leaves.rules):
    host = _offloaded(path, x, config.options.offload)
    s_rest.append(named(_layout(rule, must['opt_state'], axes), HOST if host else None))
    rows.append(
      PlanRow(
        'opt_state',
        jax.tree_util.keystr(path),
        tuple(x.shape),
        rules.as_dtype(x.dtype),
        s_rest[-1].spec,
        None,
        _why(rule, must['opt_state']),
        offloaded=host,
      )
    )
  treedef = param_leaves.treedef
  return ZeroPlan(
    stage=config.stage,
    mesh=mesh,
    axes=axes,
    params=jax.tree.unflatten(treedef, p_rest),
    grads=jax.tree.unflatten(treedef, p_grad),
    opt_state=jax.tree.unflatten(state_leaves.treedef, s_rest),
    param_shards=jax.tree.unflatten(treedef, p_shard),
    rows=tuple(rows),
    padding=tuple(
      None if r.padded_shape is None else (r.dim, r.padded_shape[r.dim]) for r in param_leaves.rules
    ),
    param_axes=hpz,
    state_padding=tuple(state_padding),
    quantize=config.options.quantize,
    unquantized=_unquantized(param_leaves, config.options.quantize),
    replica_axes=tuple(config.replica_axes),
    frozen=tuple(frozen),
  )


def _param_row(path, rule: rules.LeafRule, at_rest, grads, reason, memory, frozen) -> PlanRow:
  return PlanRow(
    'params',
    jax.tree_util.keystr(path),
    rule.shape,
    rule.dtype,
    at_rest,
    grads,
    reason,
    offloaded=memory is not None,
    frozen=frozen,
  )


def _unquantized(param_leaves: _Leaves, quantize) -> tuple[str | None, ...]:
  """Per parameter leaf: None where ZeRO++ quantizes its collectives, else why not."""
  if quantize is None:
    return ()
  out = []
  for rule in param_leaves.rules:
    if rule.dim is None or rule.padded_shape is not None:
      out.append('kept whole (not split over the ZeRO axes): no ZeRO collective to quantize')
    else:
      out.append(quantize.covers(rule.shape, rule.dtype))
  return tuple(out)


HOST = 'pinned_host'


def order_axes(
  mesh: Mesh, axes: tuple[str, ...], param_axis: mesh_lib.AxisName | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The ZeRO axes with hpZ's parameter axes first, and the parameter axes.

  Parameter axes go first (major), so a parameter shard is a run of whole
  optimizer-state shards: one all-gather over the other axes rebuilds it.

  Raises:
    ValueError: `param_axis` names an axis that is not a ZeRO axis.
  """
  if param_axis is None:
    return axes, axes
  param_axes = mesh_lib.resolve_axes(mesh, param_axis)
  if not set(param_axes) <= set(axes):
    raise ValueError(
      f'`param_axis`={param_axis!r} must be a subset of the ZeRO axes {axes}: parameters'
      ' are split within a group of the devices that split the optimizer state.'
    )
  return tuple(param_axes) + tuple(a for a in axes if a not in param_axes), param_axes


def _offloaded(path: tuple, x: Any, offload: str | None) -> bool:
  """Whether an optimizer-state leaf goes to host memory under `offload`."""
  if offload is None or not x.ndim:
    return False
  is_master = any(getattr(k, 'name', None) == 'master' for k in path)
  return offload == 'opt_state+master' or not is_master


def _restrict(
  spec: PartitionSpec, dim: int, within: tuple[str, ...], axes: tuple[str, ...]
) -> PartitionSpec:
  """`spec` with dimension `dim` split over only the ZeRO axes in `within` (others kept)."""
  entries = list(spec)
  names = entries[dim] if isinstance(entries[dim], tuple) else (entries[dim],)
  kept = tuple(n for n in names if n in within or n not in axes)
  entries[dim] = None if not kept else kept[0] if len(kept) == 1 else kept
  return PartitionSpec(*entries)


# The plans of each config, a pure function of (config, the parameters' signature, their
# layouts), kept per config while it lives; the least recently used past `PLAN_CACHE_SIZE` go.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PLAN_CACHE_SIZE = 16


def plan_of(
  config: ZeroConfig,
  params: optax.Params,
  *,
  layouts: layouts_lib.Resolved | None = None,
  recorded: layouts_lib.Layouts | None = None,
  opt_state: optax.OptState | None = None,
  name: str = 'params',
) -> ZeroPlan:
  """`build_plan(config, params, layouts.resolve(config, params, recorded))`, memoised for
  parameters that are not traced. `params` may hold Flax Variables (their metadata is a source
  of layouts); `layouts`, when given, was resolved already.

  Raises:
    ValueError: as `layouts.resolve` does, where no source says the layouts.
  """
  if layouts is None:
    layouts = layouts_lib.resolve(config, params, recorded, name)
  traced = layouts_lib.any_traced(params)
  key = None if traced else _signature(config, params, layouts)
  cache = _PLANS.setdefault(config, OrderedDict())
  if key is not None and key in cache:
    cache.move_to_end(key)
    return cache[key]
  plan = build_plan(config, params, layouts, opt_state)
  if key is not None:
    cache[key] = plan
    while len(cache) > PLAN_CACHE_SIZE:
      cache.popitem(last=False)
  return plan


def _signature(config: ZeroConfig, tree: Any, layouts: layouts_lib.Resolved) -> tuple:
  """(tree structure, (shape, dtype) per leaf, layout per leaf over the other mesh axes): what
  a plan depends on. Where the ZeRO axes split a leaf is the plan's own output, not an input."""
  leaves, treedef = jax.tree.flatten(tree)
  shapes = tuple(
    (tuple(getattr(x, 'shape', ())), str(getattr(x, 'dtype', type(x).__name__))) for x in leaves
  )
  if layouts.specs is None:
    given = [spec_of(x) for x in leaves]
  else:
    given = jax.tree.leaves(
      validation.broadcast_prefix(layouts.specs, tree, 'param_specs'),
      is_leaf=lambda s: s is None or isinstance(s, PartitionSpec),
    )
  specs = tuple(
    rules.normalize_spec(s, len(shape), config.mesh, drop=config.axes)
    for s, (shape, _) in zip(given, shapes)
  )
  return treedef, shapes, specs, layouts.source, layouts.frozen
