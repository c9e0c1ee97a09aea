"""Flax linen adapters: a module class whose parameters are gathered where it runs, and
tensor parallelism declared with Flax logical partitioning."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import linen as nn
from flax.core import lift
from jax.sharding import PartitionSpec

from zerojax._src import gather as gather_lib
from zerojax._src import rules


def gathered(module_cls: type[nn.Module], zero: Any, *, dtype: Any = None) -> type[nn.Module]:
  """A linen module class whose 'params' are gathered (`zerojax.gather`) when it runs.

  Use it on the block of a scanned model, under `nn.remat`, so that each
  block's parameters are gathered inside the layer loop, used, and dropped:

      Block = nn.remat(zerojax.linen.gathered(Block, tx), policy=zerojax.recompute_gathers)
      x, _ = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True},
                     length=n_layers)()(x, None)

  The class keeps the name of `module_cls`, so parameters are named as
  without the wrapper (`Dense_0` stays `Dense_0`) and checkpoints of the
  unwrapped model fit. Other collections (`intermediates`, `batch_stats`)
  pass through untouched, mutable or not. Every public method of the class
  gathers, not only `__call__`: a tied embedding's `attend` sees whole
  parameters too.

  Args:
    module_cls: the linen Module class to wrap.
    zero: which axes to gather over: the optimizer from `zerojax.zero_stage`,
      its `zerojax.config_of(tx)`, or its plan.
    dtype: compute dtype to cast parameters to before the gather.

  Returns:
    A Module class with the same constructor and name.
  """
  gather_lib.resolve(zero)  # a bad `zero` fails here, not deep inside a model's apply

  def trans_in(variables):
    return gather_lib.gather(variables, zero, dtype=dtype)

  lifted = nn.transforms.lift_transform(
    _gather_params, module_cls, trans_in, methods=_public_methods(module_cls)
  )
  names = {'__module__': module_cls.__module__, '__qualname__': module_cls.__qualname__}
  return type(module_cls.__name__, (lifted, GathersItsParams), names)


class GathersItsParams:
  """The mark of the classes `gathered` makes: their own 'params' arrive split and they
  gather them, so `guard_split_params` lets them run on split parameters."""


def _gather_params(fn: Any, trans_in: Any) -> Any:
  """The lifted form of `gathered`: flax's `map_variables` over 'params'.

  While the parameters are being created (the 'params' collection is mutable:
  `init`), the module first runs on them raw to create them; when they exist,
  it runs only on the gathered view, so applying with other mutable
  collections never runs it on shards.
  """
  creating = lift.map_variables(fn, 'params', trans_in, init=True)
  using = lift.map_variables(fn, 'params', trans_in, init=False)

  def call(scopes, *args, **kwargs):
    scope = jax.tree.leaves(scopes)[0]
    run = creating if scope.is_mutable_collection('params') else using
    return run(scopes, *args, **kwargs)

  return call


def guard_split_params(apply_fn: Callable[..., Any] | None, axes: tuple[str, ...]) -> Any:
  """`apply_fn`, refusing in zerojax's words a linen module run on parameters split over `axes`.

  At stage 3 a train state's parameters rest split over the ZeRO axes. On an
  Explicit mesh their split is part of their type, and a layer run on them
  directly fails deep inside jax (`ShardingTypeError: dot_general ...
  produces an illegally sharded result`). The returned function runs
  `apply_fn` under `flax.linen.intercept_methods`: before each module method
  runs, the module's own 'params' are checked, and one still split over `axes`
  is a ValueError naming it and the gather to use. Modules from `gathered`
  gather their own parameters and are not checked; their submodules see the
  gathered values. On Auto axes no split is in the types, and nothing is refused.
  """
  if apply_fn is None or (isinstance(apply_fn, GuardedApply) and apply_fn.axes == tuple(axes)):
    return apply_fn
  return GuardedApply(apply_fn, tuple(axes))


@dataclasses.dataclass(frozen=True, eq=False)
class GuardedApply:
  """An `apply_fn` run under `guard_split_params`'s interceptor (compared by identity, as the
  function it stands for).

  Attributes:
    fn: the train state's `apply_fn`.
    axes: the ZeRO axes over which a module's own parameters must not be split.
  """

  fn: Callable[..., Any]
  axes: tuple[str, ...]

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with nn.intercept_methods(functools.partial(_refuse_split, self.axes)):
      return self.fn(*args, **kwargs)


def _refuse_split(axes: tuple[str, ...], next_fun, args, kwargs, context):
  """The interceptor of `guard_split_params`: checks the module's own parameters, then runs."""
  module = context.module
  scope = module.scope
  if (
    scope is None
    or isinstance(module, GathersItsParams)
    or scope.is_mutable_collection('params')  # init: the parameters are being created
  ):
    return next_fun(*args, **kwargs)
  for name, value in module.variables.get('params', {}).items():
    if isinstance(value, Mapping):  # a submodule's: checked when it runs
      continue
    for leaf in jax.tree.leaves(value):
      spec = getattr(getattr(jax.typeof(leaf), 'sharding', None), 'spec', None) or ()
      split = [a for entry in spec for a in rules.spec_axes(entry) if a in axes]
      if split:
        path = ''.join(f'[{k!r}]' for k in (*scope.path, name))
        where = '/'.join(scope.path) or 'the top module'
        raise ValueError(
          f'zerojax: {type(module).__name__} ({where}) runs {context.method_name} on'
          f' params{path}, {jax.typeof(leaf).str_short()} split over {split[0]!r} as ZeRO'
          ' stage 3 keeps it at rest; a layer needs its parameters whole. Gather them where'
          " they are used: the whole model with state.apply_fn({'params':"
          ' zerojax.gather(state.params, state.tx)}, x), or block by block (less memory) by'
          ' building the model from zerojax.linen.gathered(Block, tx). A module that gathers'
          ' its own parameters is built with zerojax.linen.gathered too.'
        )
  return next_fun(*args, **kwargs)


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


Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def logical_param_specs(tree: Any, rules: Rules) -> Any:
  """Mesh PartitionSpecs from Flax logical axis names, for `zero_stage(param_specs=...)`.

  Args:
    tree: linen parameters made with `nn.with_logical_partitioning` (boxed,
      as `model.init` or `jax.eval_shape(model.init, ...)` return them). NNX
      needs no conversion: its variables are sharded when created (under
      `jax.set_mesh` with logical rules), and zerojax keeps the
      tensor-parallel axes that arrays already carry.
    rules: logical name -> mesh axis (or None), e.g.
      `(('embed', None), ('mlp', 'model'), ('heads', 'model'))`.

  Returns:
    The same tree with a `PartitionSpec` over mesh axes at each leaf (`P()`
    for leaves without names). ZeRO then splits each leaf over its own axes on
    a dimension the tensor-parallel axes leave free.

  Raises:
    ValueError: a logical name has no rule.

  >>> import jax, jax.numpy as jnp, zerojax
  >>> from flax import linen as nn
  >>> dense = nn.Dense(64, kernel_init=nn.with_logical_partitioning(
  ...     nn.initializers.lecun_normal(), ('embed', 'mlp')))
  >>> params = jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((1, 16)))['params']
  >>> zerojax.linen.logical_param_specs(params, [('embed', None), ('mlp', 'model')])['kernel']
  P(None, 'model')
  """
  logical = nn.get_partition_spec(tree)
  known = {name for name, _ in rules}

  def to_mesh(path, spec):
    if not isinstance(spec, PartitionSpec):
      spec = PartitionSpec(*spec) if isinstance(spec, tuple) else PartitionSpec()
    missing = [n for n in spec if n is not None and not isinstance(n, tuple) and n not in known]
    if missing:
      raise ValueError(
        f'params{jax.tree_util.keystr(path)}: logical axis {missing[0]!r} has no rule in'
        f' `rules` (known: {sorted(known)}). Add ({missing[0]!r}, MESH_AXIS_OR_None).'
      )
    return nn.logical_to_mesh_axes(tuple(spec), rules)

  return jax.tree_util.tree_map_with_path(
    to_mesh, logical, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
  )
