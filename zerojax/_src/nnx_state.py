"""Flax NNX models laid out for ZeRO, and differentiated with `zerojax.value_and_grad`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import NamedSharding

from zerojax._src import gather as gather_lib
from zerojax._src import grad as grad_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src import reduction, transform
from zerojax._src.variables import metadata_specs


def logical_param_specs(tree: Any, rules: Any, *, mesh: jax.sharding.Mesh | None = None) -> Any:
  """Mesh PartitionSpecs of an NNX model's `nnx.Param`s from their logical axis names, for
  `zero_stage(param_specs=...)`.

  The counterpart of `zerojax.linen.logical_param_specs` for
  `nnx.with_partitioning(init, ('embed', 'mlp'))`: Flax's own reading of the metadata
  (`nnx.get_partition_spec` under `nnx.logical_axis_rules(rules)`, with each Variable's
  `sharding_rules`), checked so that every logical name has a rule. It needs no arrays: an
  abstract model (`nnx.eval_shape`) will do.

  Args:
    tree: an NNX module, or an `nnx.State` of its Params.
    rules: logical name -> mesh axis (or None), e.g. `(('embed', None), ('mlp', 'model'))`.
    mesh: the mesh the layouts are for. Names that are its axes need no rule (as those of a
      Variable's own `mesh` metadata or of `jax.set_mesh`'s mesh), and a Variable annotated for
      another mesh is refused.

  Returns:
    A pure state (`nnx.as_pure`) of the Params with a `PartitionSpec` at each leaf (`P()`
    where a Param has no annotation).

  Raises:
    ValueError: a logical name has no rule; a Variable annotated for another mesh than `mesh`.
  """
  state = nnx.state(tree, nnx.Param) if isinstance(tree, nnx.Module) else tree
  named = {name for name, _ in rules}
  known = named | set(jax.sharding.get_abstract_mesh().axis_names)
  if mesh is not None:
    known |= set(mesh.axis_names)
  for path, var in jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]:
    meta = var.get_metadata() if isinstance(var, nnx.Variable) else {}
    local = {name for name, _ in meta.get('sharding_rules', None) or ()}
    local |= set(getattr(meta.get('mesh', None), 'axis_names', ()))
    declared = meta.get('out_sharding', None)
    if isinstance(declared, NamedSharding):  # mesh axes already, not logical names
      declared = ()
    names = [n for n in declared or () if isinstance(n, str)]
    missing = [n for n in names if n not in known | local]
    if missing:
      raise ValueError(
        f'params{jax.tree_util.keystr(path)}: logical axis {missing[0]!r} has no rule in'
        f' `rules` (known: {sorted(named)}). Add ({missing[0]!r}, MESH_AXIS_OR_None).'
      )
  with nnx.logical_axis_rules(rules):
    return metadata_specs(state, mesh)


def gathered(module: nnx.Module, zero: Any, *, dtype: Any = None) -> nnx.Module:
  """A copy of an NNX module with its `nnx.Param`s gathered (`zerojax.gather`), for use.

  Call it on a layer inside the scanned (and rematerialised) function, so the
  gathered copy lives only while that layer runs. Gradients flow back to the
  original sharded parameters as reduce-scatters.

  Args:
    module: the NNX module (a layer, or the whole model).
    zero: which axes to gather over: the optimizer from `zerojax.zero_stage`,
      its `zerojax.config_of(tx)`, or its plan.
    dtype: compute dtype to cast parameters to before the gather.
  """
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  params = gather_lib.gather(params, zero, dtype=dtype)
  return nnx.merge(graphdef, params, rest)


def _plan(tx: optax.GradientTransformation, model: nnx.Module, where: str) -> plan_lib.ZeroPlan:
  config = transform.config_of(tx)
  if config is None:
    raise TypeError(
      f'zerojax.nnx.{where} takes the optimizer wrapped by zerojax.zero_stage, which holds the'
      ' ZeRO stage and options: tx = zerojax.zero_stage(optax.adam(1e-3), stage=3, mesh=mesh).'
    )
  params = nnx.state(model, nnx.Param)
  return plan_lib.plan_of(config, params)


def shard(model: nnx.Module, tx: optax.GradientTransformation) -> nnx.Module:
  """Places an existing NNX model's parameters in the layout of `tx`'s plan, in place.

  At stage 3 the `nnx.Param`s are split over the ZeRO axes; below stage 3 they
  are replicated (their other axes kept). Returns `model`.

  Args:
    model: the NNX model.
    tx: the optimizer from `zerojax.zero_stage`: its stage and options decide.
  """
  plan = _plan(tx, model, 'shard')
  nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), plan.params))
  return model


def create_model(
  make_model: Callable[..., nnx.Module], tx: optax.GradientTransformation, *args: Any
) -> nnx.Module:
  """Creates an NNX model directly in the layout of `tx`'s plan.

  The model is first created abstractly (`nnx.eval_shape`: nothing
  allocated), its plan computed, and then created for real inside one jitted
  program whose parameter outputs are already sharded: no device ever holds
  the whole model.

  Args:
    make_model: builds the model from `args`, e.g. `lambda: GPT(cfg, rngs=nnx.Rngs(0))`, or
      `lambda rngs: GPT(cfg, rngs=rngs)` with the program's own `nnx.Rngs` in `args`.
    tx: the optimizer from `zerojax.zero_stage`: its stage and options decide
      the layout (stage 3 splits the parameters).
    *args: passed to `make_model`: NNX objects made outside it (an `nnx.Rngs`), advanced as
      creating the model eagerly would advance them.

  Returns:
    The model, with `nnx.Param`s carrying the plan's shardings.

  Raises:
    ValueError: `make_model` uses an NNX object (an `nnx.Rngs`) it closes over, which Flax
      cannot advance inside the abstract and jitted creation; pass it in `args`.
  """
  graph_args, arg_state = nnx.split(args)
  with _outer_objects_named():
    abstract = nnx.eval_shape(lambda state: make_model(*nnx.merge(graph_args, state)), arg_state)
  plan = _plan(tx, abstract, 'create_model')
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
  rest_shardings = jax.tree.map(lambda _: mesh_lib.replicated(plan.mesh), rest)

  def create(state):
    given = nnx.merge(graph_args, state)
    model = make_model(*given)
    _, p, r = nnx.split(model, nnx.Param, ...)
    p = mesh_lib.run_in_layout(
      lambda t: mesh_lib.constrain(t, plan.params, plan.mesh), plan.mesh, plan.params
    )(p)
    return p, r, nnx.state(given)

  with _outer_objects_named():
    created = jax.jit(create, out_shardings=(plan.params, rest_shardings, None))(arg_state)
  p, r, advanced = created
  nnx.update(args, advanced)  # the program's Rngs moved on, as an eager creation moves them
  return nnx.merge(graphdef, p, r)


@contextlib.contextmanager
def _outer_objects_named():
  """Flax's TraceContextError from `create_model`'s traced creation, in zerojax's words."""
  try:
    yield
  except flax_errors.TraceContextError as e:
    raise ValueError(
      'zerojax.nnx.create_model: make_model uses an NNX object made outside it (an nnx.Rngs'
      ' it closes over), which cannot be advanced inside the abstract and jitted creation.'
      ' Pass it as an argument: zerojax.nnx.create_model(lambda rngs: Model(rngs=rngs), tx,'
      ' rngs); or build it inside: lambda: Model(rngs=nnx.Rngs(0)).'
    ) from e


def value_and_grad(
  loss_fn: Callable[..., Any], tx: optax.GradientTransformation, *, has_aux: bool = False, **options
) -> Callable[..., Any]:
  """`zerojax.value_and_grad` for an NNX model: `loss_fn(model, batch, *args)`.

  The model's `nnx.Param`s are differentiated; its other state (BatchNorm's
  running statistics, RNG streams) is passed to every device and micro-batch,
  and what the forward pass writes to it comes back into `model` as its mean
  over them. Give `nnx.BatchNorm` `axis_name=` the ZeRO axis (e.g. 'data') so
  its statistics are the global batch's, as under `jax.jit` on the whole
  batch; then the mean is exact with `micro_batches=1`. RNG streams draw
  independently per device and micro-batch (their keys are folded with the
  part's index).

  Args:
    loss_fn: `loss_fn(model, batch, *args)` -> the loss (or `(loss, aux)`), with
      the meaning `zerojax.value_and_grad` gives it.
    tx: the optimizer from `zerojax.zero_stage`.
    has_aux: `loss_fn` returns `(loss, aux)`.
    **options: `zerojax.value_and_grad`'s (`micro_batches`, `reduce_dtype`,
      `per_layer`, `manual`: False for a model that names its layouts over the ZeRO axes).

  Returns:
    `fn(model, batch, *args, loss_scale=None)` -> `(loss, grads)` (or
    `((loss, aux), grads)`), grads an `nnx.State` of the Params for
    `nnx.Optimizer.update(model, grads)`; to call inside `nnx.jit`.
  """

  def fn(model, batch, *args, loss_scale=None):
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngKey, ...)

    def state_loss(params, batch, keys, rest, *args):
      part = nnx.merge(graphdef, params, keys, rest, copy=True)
      out = loss_fn(part, batch, *args)
      _, _, _, written = nnx.split(part, nnx.Param, nnx.RngKey, ...)
      # Every part starts from the same state; what it writes is averaged over the parts.
      written = jax.tree.map(lambda x: reduction.WeightedMean(x.astype(jnp.float32)), written)
      return (out[0], (out[1], written)) if has_aux else (out, (None, written))

    grad_fn = grad_lib.value_and_grad(state_loss, tx, has_aux=True, **options)
    (loss, (aux, written)), grads = grad_fn(params, batch, keys, rest, *args, loss_scale=loss_scale)
    nnx.update(model, jax.tree.map(lambda new, old: new.astype(old.dtype), written, rest))
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return fn


class Optimizer(nnx.Optimizer):
  """`nnx.Optimizer` for a transformation from `zero_stage`, whose `update` takes offloaded
  stage-3 parameters' new values from the update's own host computation.

  With `offload_params=True` at stage 3, `nnx.Optimizer.update` calls `tx.update` and then
  adds the updates; the compiler holds them, every layer at once, in device memory for the
  add (`tx.update` warns). This class's `update` calls `zerojax.apply_gradients` there
  instead, so the device's peak stays flat in the layer count, and returns None (no updates
  are made to return). Everywhere else it is `nnx.Optimizer.update`, returning the updates.
  Construct it as `nnx.Optimizer`: `zerojax.nnx.Optimizer(model, tx, wrt=nnx.Param)`.
  """

  def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
    update = self.tx.update
    if not getattr(update, 'fuses', False):
      return super().update(model, grads, **kwargs)
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    new_params, new_state = transform.apply_gradients(
      self.tx, grads, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
    )
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_state, graph=self.graph))
    self.step[...] += 1
    return None
