"""Lowering a candidate: the target (topology, devices, model, optimizer) and the candidate's
mesh, ZeRO options, abstract train state and training step, traced for the compiler."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src import grad as grad_lib
from zerojax._src import jaxprs, precision, remat_policies, train_state, transform
from zerojax._src import plan as plan_lib
from zerojax._src import quantize as quantize_lib
from zerojax._src.options import Options
from zerojax._src.planner import candidates, presets
from zerojax._src.planner.candidates import QUANTIZE, Candidate
from zerojax._src.planner.roofline import (
  CHIPS,
  ONE_CHIP_VM_HOST_BYTES,
  Chip,
  calibrate_cpu,
  check_dcn,
  prices_host_link,
)

# The mesh axis a plan names for tensor parallelism; every other axis of a slice is a ZeRO axis.
TENSOR = 'tensor'
# The outermost mesh axis of several slices: across TPU slices, data-parallel (hierarchical ZeRO).
SLICE = 'slice'
# The names of a chip grid's axes, one per torus dimension.
GRID_AXES = ('x', 'y', 'z')
GRADIENTS = ('zerojax', 'jax')


class LayoutError(ValueError):
  """The mesh asked for does not fit the model (a tensor axis it cannot split over)."""


@dataclasses.dataclass(frozen=True)
class Target:
  """Where and what to compile: the devices, their grid, the model and its training setup."""

  topology: str
  devices: tuple  # the devices of one slice
  grid: tuple[int, ...]  # the 'torus' layout's mesh shape over one slice
  chip: Chip | None  # the step-time model's constants; None: the step is not timed
  # A preset name, a `presets.DecoderConfig`, or a function of (remat, prefetch) -> ModelSpec.
  model: Any
  optimizer: Callable[[], Any]
  mixed_precision: bool = False
  settings: presets.ModelSettings = presets.ModelSettings()  # how the presets compute
  # The devices of S slices of the topology, slice by slice, for each S > 1 searched.
  slice_devices: tuple = ()
  # The names of the 'torus' layout's axes (default GRID_AXES); an axis named TENSOR is
  # tensor-parallel over the model's `tensor_specs`, ZeRO splits over the others.
  axis_names: tuple[str, ...] = ()
  # 'zerojax' (zerojax.value_and_grad: the stage's collectives per layer) or 'jax'
  # (jax.value_and_grad: the compiler places the reduction).
  gradients: str = 'zerojax'

  def devices_for(self, slices: int) -> tuple:
    """The devices of `slices` slices of the topology."""
    if slices == 1:
      return self.devices
    found = dict(self.slice_devices).get(slices)
    if found is None:
      raise ValueError(f'the target has no devices for {slices} slices; make it with slices=.')
    return found

  def names(self) -> tuple[str, ...]:
    """The names of the 'torus' layout's axes."""
    return self.axis_names or GRID_AXES[: len(self.grid)]


def mesh_shape(target: Target, c: Candidate) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """(the shape, the axis names) of one slice's mesh for the candidate: 'flat' one ZeRO axis
  over every chip, with a tensor axis of `c.tensor` innermost (runs of neighbouring chips)
  where it has one; 'torus' and 'hpz' the target's grid."""
  if c.layout == 'flat' and c.tensor > 1:
    return (len(target.devices) // c.tensor, c.tensor), ('data', TENSOR)
  if c.layout == 'flat':
    return (len(target.devices),), ('data',)
  return tuple(target.grid), target.names()


def mesh_for(target: Target, c: Candidate):
  """(the candidate's mesh, the names of one slice's axes: ZeRO's and the tensor axis)."""
  from jax.sharding import AxisType, Mesh

  shape, names = mesh_shape(target, c)
  devices = target.devices_for(c.slices)
  # Several slices: an outer 'slice' axis (data-parallel) over whole slices.
  full = ((c.slices, *shape), (SLICE, *names)) if c.slices > 1 else (shape, names)
  mesh = Mesh(
    np.array(devices).reshape(full[0]), full[1], axis_types=(AxisType.Auto,) * len(full[1])
  )
  return mesh, names


def model_spec(target: Target, c: Candidate):
  """The `ModelSpec` a candidate compiles: the target's model with the candidate's remat and
  prefetch."""
  if callable(target.model):
    return target.model(c.remat, c.prefetch)
  return presets.decoder_spec(
    target.model,
    target.settings,
    remat=c.remat,
    prefetch_next=c.prefetch,
    lean_head=candidates.lean(c.remat),
  )


def model_label(target: Target) -> str:
  """The target's model in a report: the preset's name, a decoder's shape, or 'custom model'."""
  if isinstance(target.model, str):
    return target.model
  if callable(target.model):
    return 'custom model'
  cfg = target.model
  return (
    f'decoder (d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads},'
    f' d_ff={cfg.d_ff}, vocab={cfg.vocab})'
  )


def zero_options(
  c: Candidate,
  names: tuple[str, ...],
  stacked: Any = None,
  param_specs: Any = None,
  trainable: Any = None,
) -> Options:
  """The `zerojax.Options` of a candidate, for ZeRO axes `names`, a model whose stacked layers
  are `stacked` (`ModelSpec.stacked`), tensor-parallel layouts `param_specs` and trained
  parameters `trainable` (`ModelSpec.trainable`)."""
  q = QUANTIZE[c.quantize]
  return Options(
    axis=names[0] if len(names) == 1 else names,
    param_axis=names[-1] if c.layout == 'hpz' else None,
    offload=c.offload,
    update_on=c.update_on,
    offload_params=c.offload_params,
    quantize=None if q is None else quantize_lib.Quantize(**q, min_size=1 << 16),
    replica_axis=SLICE if c.slices > 1 else None,
    stacked=stacked,
    param_specs=param_specs,
    trainable=trainable,
  )


def _tensor_specs(spec: Any, mesh: Any) -> Any:
  """The parameters' tensor-parallel PartitionSpecs where the mesh has a tensor axis."""
  if TENSOR not in mesh.axis_names:
    return None
  if spec.tensor_specs is None:
    raise LayoutError(
      f'the mesh has a {TENSOR!r} axis but the model {spec.name} gives no tensor-parallel'
      ' layout (ModelSpec.tensor_specs); drop the tensor axis, or give one.'
    )
  try:
    return spec.tensor_specs(TENSOR, mesh.shape[TENSOR])
  except ValueError as e:
    raise LayoutError(str(e)) from None


def _check_activation_offload(target: Target, c: Candidate) -> None:
  """Refuses a remat policy that moves activations to host memory where the host link has no
  figures: its bytes could not be priced."""
  if not presets.offloads_activations(c.remat):
    return
  chip = target.chip
  if not prices_host_link(chip):
    name = target.topology.split(':')[0]
    raise ValueError(
      f'remat {c.remat!r} moves saved activations to host memory, but {name} has no host-link'
      ' figures (bandwidth and host memory per chip), so their transfers cannot be priced;'
      f' keep them in HBM ({", ".join(repr(k) for k, v in presets.POLICIES.items() if "offload" not in v)})'
      f' or plan a chip with those figures ({", ".join(sorted(CHIPS))}).'
    )


@dataclasses.dataclass(frozen=True)
class Lowered:
  """A candidate traced and lowered for the compiler, with what its analyses read: the model,
  the mesh, the abstract train state, its ZeRO plan and the batch."""

  candidate: Candidate
  spec: presets.ModelSpec
  mesh: jax.sharding.Mesh
  state: Any  # the abstract train state: a pytree of ShapeDtypeStructs, any TrainState class
  plan: plan_lib.ZeroPlan
  batch: jax.ShapeDtypeStruct  # the sharded batch
  unit: int  # the floor's unit: bytes of one parameter as the collectives carry it
  gradients: str  # 'zerojax' or 'jax' (`Target.gradients`)
  traced: jax.stages.Traced
  lowered: jax.stages.Lowered
  phase_seconds: dict[str, float]  # 'plan' (the state and its layout), 'trace and lower'

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))


def _abstract_state(target: Target, c: Candidate, spec: Any, mesh: Any, zero_axes: tuple):
  """(the abstract train state, its ZeRO plan) of a candidate, its optimizer wrapped for the
  candidate's stage over `zero_axes` of `mesh`."""
  options = zero_options(c, zero_axes, spec.stacked, _tensor_specs(spec, mesh), spec.trainable)
  inner = target.optimizer()
  if target.mixed_precision:
    inner = precision.mixed_precision(inner)
  tx = transform.zero_optimizer(transform.make_config(inner, c.stage, mesh, options, warn=False))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  extra = (
    {'param_dtype': jnp.dtype(target.settings.compute_dtype)} if target.mixed_precision else {}
  )
  state = train_state.abstract_train_state(spec.init_fn, key, tx=tx, **extra)
  return state, transform.plan_for(state.tx, state.params)


def gradients(target: Target, c: Candidate) -> str:
  """How the candidate's step takes gradients: 'jax' where it has a tensor axis (the compiler
  places the tensor-parallel collectives), else the target's."""
  return 'jax' if c.tensor > 1 else target.gradients


def _gradient_fn(target: Target, c: Candidate, spec: Any, state: Any, plan: Any):
  """(params, batch) -> (loss, gradients), through zerojax's or jax's value_and_grad."""
  loss = lambda p, b: spec.loss_fn(p, b, plan)
  if gradients(target, c) == 'jax' and any(plan.frozen or ()):
    return _trainable_value_and_grad(loss, plan.frozen)
  if gradients(target, c) == 'jax':
    return lambda p, b: jax.value_and_grad(lambda q: loss(q, b))(p)
  return grad_lib.value_and_grad(
    loss,
    state.tx,
    per_layer=c.stage >= 2 and c.layout != 'hpz',
    micro_batches=c.micro_batches,
  )


def _trainable_value_and_grad(loss: Any, frozen: tuple[bool, ...]):
  """`jax.value_and_grad` of `loss` with respect to the trainable leaves alone, as a LoRA
  program differentiates its adapters: the frozen leaves' gradients are zeros the update never
  reads (the compiler drops them), so a quantized base is never differentiated."""

  def value_and_grad(params, batch):
    leaves, treedef = jax.tree.flatten(params)
    held = [x for x, f in zip(leaves, frozen, strict=True) if f]

    def of_trained(trained):
      it, kept = iter(trained), iter(held)
      full = [next(kept) if f else next(it) for f in frozen]
      return loss(jax.tree.unflatten(treedef, full), batch)

    value, grads = jax.value_and_grad(of_trained)([x for x, f in zip(leaves, frozen) if not f])
    it = iter(grads)
    full = [jnp.zeros_like(x) if f else next(it) for x, f in zip(leaves, frozen)]
    return value, jax.tree.unflatten(treedef, full)

  return value_and_grad


def _check_tags(spec: presets.ModelSpec, remat: str, jaxpr: Any) -> None:
  """Refuses a named remat policy for a model of the user's own that tags none of, or only
  some of, the activations the policy keeps (it would keep nothing, or less than its name
  says), naming the tags missing."""
  needed = remat_policies.policy_names(remat)
  found = jaxprs.checkpoint_names(jaxpr)
  missing = [n for n in needed if n not in found]
  if missing:
    known = {
      n
      for kept in presets.POLICIES.values()
      for n in (*kept.get('save', ()), *kept.get('offload', ()))
    }
    tags = ', '.join(sorted(found & known)) or 'none of them'
    raise ValueError(
      f'remat {remat!r} keeps the activations tagged {", ".join(needed)}; the model'
      f' {spec.name!r} does not tag {", ".join(missing)} (it tags {tags}). Tag them in its'
      ' layer with jax.ad_checkpoint.checkpoint_name(x, zerojax.remat.QKV) and the like'
      " (zerojax.remat's names), or plan 'gathers', 'full' or 'none'."
    )


def lower(target: Target, c: Candidate) -> Lowered:
  """The candidate's training step traced and lowered for the compiler.

  Raises:
    LayoutError: a tensor axis the model cannot be split over.
    ValueError: zerojax refuses the layout (a leaf that cannot be split, a bad option).
  """
  from jax.sharding import NamedSharding, PartitionSpec

  _check_activation_offload(target, c)
  start = time.perf_counter()
  mesh, names = mesh_for(target, c)
  spec = model_spec(target, c)
  zero_axes = tuple(a for a in names if a != TENSOR)
  state, plan = _abstract_state(target, c, spec, mesh, zero_axes)
  phases = {'plan': time.perf_counter() - start}
  start = time.perf_counter()
  rows = spec.batch(c.batch_per_chip * mesh.devices.size)
  # The batch's rows over every chip: the data-parallel (slice) axes, then ZeRO's.
  over = transform.config_of(state.tx).replica_axes + zero_axes
  over = over[0] if len(over) == 1 else over
  batch = jax.ShapeDtypeStruct(
    rows.shape, rows.dtype, sharding=NamedSharding(mesh, PartitionSpec(over))
  )
  grad_fn = _gradient_fn(target, c, spec, state, plan)

  def train_step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  traced = jax.jit(train_step, donate_argnums=0).trace(state, batch)
  if callable(target.model):
    _check_tags(spec, c.remat, traced.jaxpr)
  lowered = traced.lower()
  phases['trace and lower'] = time.perf_counter() - start
  # The floor's unit: at stage 3 parameters travel in the compute dtype (cast before they are
  # gathered) and so do their gradients (the gather's transpose); below it the gradients of
  # the stored parameters are reduced and the updated parameters gathered, in their own dtype.
  if c.stage == 3:
    unit = jnp.dtype(target.settings.compute_dtype).itemsize
  else:
    unit = max(jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params))
  return Lowered(
    c, spec, mesh, state, plan, batch, unit, gradients(target, c), traced, lowered, phases
  )


def make_target(
  model: str | Callable[..., Any],
  topology: str,
  *,
  devices: Sequence[Any],
  optimizer: Callable[[], Any],
  mixed_precision: bool = False,
  settings: presets.ModelSettings | None = None,
  slice_devices: Any = (),
  mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
  gradients: str = 'zerojax',
  time_steps: bool = True,
) -> Target:
  """The `Target` of a plan or a search, every check of it made here: `topology` ('v5e:2x4',
  'v5p:2x2x1', 'v6e:4x4' or 'cpu:N') and its `devices` (one slice's), the model (a preset's
  name, a `presets.DecoderConfig`, or a function of (remat, prefetch) returning a `ModelSpec`),
  how the presets compute (`settings`; default `presets.ModelSettings()`), the devices of S slices (`slice_devices`: {S: devices}
  for each S > 1) and the data-center network they need, and the 'torus' layout's mesh
  (`mesh`: its shape and axis names over one slice; default the topology's chip grid).
  `time_steps`: a search ranks candidates by predicted step, so it needs the chip's constants
  (on 'cpu:N' measured here, `roofline.calibrate_cpu`); a single plan (False) reports its step
  where the chip table has the figures and leaves it untimed elsewhere (a chip not in the
  table, or cpu:N, whose constants a single plan does not measure).

  Raises:
    ValueError: a topology without roofline constants (with `time_steps`), a preset name that does not exist,
      presets' settings for a model function, slices on a chip without a published
      data-center network, or a mesh whose size is not the slice's.
  """
  settings = settings or presets.ModelSettings()
  chip_name, _, dims = topology.partition(':')
  if chip_name == 'cpu':
    grid, chip = (len(devices),), calibrate_cpu(len(devices)) if time_steps else None
  elif chip_name in CHIPS or not time_steps:
    grid, chip = tuple(int(d) for d in dims.lower().split('x')), CHIPS.get(chip_name)
    if len(devices) == 1 and chip_name in ONE_CHIP_VM_HOST_BYTES:  # a one-chip VM's memory
      chip = dataclasses.replace(chip, host_bytes_per_chip=ONE_CHIP_VM_HOST_BYTES[chip_name])
  else:
    raise ValueError(
      f'`topology`={topology!r}: no roofline constants for {chip_name!r}; the search knows'
      f' {sorted(CHIPS)} and cpu:N.'
    )
  if isinstance(model, str) and model not in presets.PRESETS:
    raise ValueError(f'`model`={model!r} is not a preset; choose one of {sorted(presets.PRESETS)}.')
  if callable(model) and settings.given():
    raise ValueError(
      f'`{settings.given()[0]}` is for the presets; a model function computes its own attention'
      ' and loss.'
    )
  if gradients not in GRADIENTS:
    raise ValueError(f'`gradients`={gradients!r}: choose one of {GRADIENTS}.')
  if dict(slice_devices) and chip is not None:
    check_dcn(chip)
  names = ()
  if mesh is not None:
    grid, names = tuple(mesh[0]), tuple(mesh[1])
    if math.prod(grid) != len(devices) or len(grid) != len(names):
      raise ValueError(
        f'`mesh`={mesh!r}: {len(names)} names for {len(grid)} sizes whose product is'
        f' {math.prod(grid)}, over one slice of {len(devices)} devices; give one name per size,'
        f' the sizes multiplying to {len(devices)}.'
      )
  return Target(
    topology,
    tuple(devices),
    grid,
    chip,
    model,
    optimizer,
    mixed_precision=mixed_precision,
    settings=settings,
    slice_devices=tuple((s, tuple(d)) for s, d in dict(slice_devices).items()),
    axis_names=names,
    gradients=gradients,
  )
