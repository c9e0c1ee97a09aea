"""Lowering a candidate: the target (topology, devices, model, optimizer) and the candidate's
mesh, ZeRO options, abstract train state and training step, traced for the compiler."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.options import Options
from zerojax._src.planner.candidates import QUANTIZE, Candidate
from zerojax._src.planner.roofline import CHIPS, Chip, calibrate_cpu


@dataclasses.dataclass(frozen=True)
class Target:
  """Where and what to compile: the devices, their grid, the model and its training setup."""

  topology: str
  devices: tuple
  grid: tuple[int, ...]
  chip: Chip | None
  model: str | Callable[..., Any]  # a preset name, or a function of (remat, prefetch) -> ModelSpec
  optimizer: Callable[[], Any]
  mixed_precision: bool = False
  seq_len: int | None = None
  compute_dtype: Any = jnp.bfloat16
  attention_chunk: int | None = None  # presets: attention this many queries at a time
  attention: str = 'xla'  # presets: 'xla' or 'flash' (presets.ATTENTION)
  # The devices of S slices of the topology, slice by slice, for each S > 1 searched.
  slice_devices: tuple = ()

  def devices_for(self, slices: int) -> tuple:
    """The devices of `slices` slices of the topology."""
    if slices == 1:
      return self.devices
    found = dict(self.slice_devices).get(slices)
    if found is None:
      raise ValueError(f'the target has no devices for {slices} slices; make it with slices=.')
    return found


def _mesh(target: Target, c: Candidate):
  from jax.sharding import AxisType, Mesh

  if c.layout == 'flat':
    shape, names = (len(target.devices),), ('data',)
  else:
    shape, names = target.grid, ('x', 'y', 'z')[: len(target.grid)]
  devices = target.devices_for(c.slices)
  # Several slices: an outer 'slice' axis (data-parallel); `names` stays the ZeRO axes.
  full = ((c.slices, *shape), ('slice', *names)) if c.slices > 1 else (shape, names)
  mesh = Mesh(
    np.array(devices).reshape(full[0]), full[1], axis_types=(AxisType.Auto,) * len(full[1])
  )
  return mesh, names


def model_spec(target: Target, c: Candidate):
  """The `ModelSpec` a candidate compiles: the target's model with the candidate's remat and
  prefetch."""
  from zerojax._src.planner import presets

  if callable(target.model):
    return target.model(c.remat, c.prefetch)
  return presets.decoder_spec(
    target.model,
    seq_len=target.seq_len,
    compute_dtype=jnp.dtype(target.compute_dtype),
    remat=c.remat,
    prefetch_next=c.prefetch,
    attention_chunk=target.attention_chunk,
    attention=target.attention,
  )


def zero_options(c: Candidate, names: tuple[str, ...], stacked: Any = None) -> Options:
  """The `zerojax.Options` of a candidate, for a mesh with axes `names` and a model whose
  stacked layers are `stacked` (`ModelSpec.stacked`)."""
  from zerojax._src import quantize as quantize_lib

  q = QUANTIZE[c.quantize]
  return Options(
    axis=names[0] if len(names) == 1 else names,
    param_axis=names[-1] if c.layout == 'hpz' else None,
    offload=c.offload,
    update_on=c.update_on if c.offload is not None else 'device',
    quantize=None if q is None else quantize_lib.Quantize(**q, min_size=1 << 16),
    replica_axis='slice' if c.slices > 1 else None,
    stacked=stacked,
  )


def lower_candidate(target: Target, c: Candidate):
  """(traced step, plan, abstract state, batch, the floor's unit in bytes) of a candidate."""
  from jax.sharding import NamedSharding, PartitionSpec

  from zerojax._src import grad as grad_lib
  from zerojax._src import precision, train_state, transform

  mesh, names = _mesh(target, c)
  spec = model_spec(target, c)
  options = zero_options(c, names, spec.stacked)
  inner = target.optimizer()
  if target.mixed_precision:
    inner = precision.mixed_precision(inner)
  tx = transform.zero_optimizer(transform.make_config(inner, c.stage, mesh, options))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  extra = {'param_dtype': jnp.bfloat16} if target.mixed_precision else {}
  state = train_state.abstract_train_state(spec.init_fn, key, tx=tx, **extra)
  plan = transform.plan_for(state.tx, state.params)
  rows = spec.batch(c.batch_per_chip * mesh.devices.size)
  # The batch's rows over every chip: the data-parallel (slice) axes, then ZeRO's.
  over = options.axis if isinstance(options.axis, tuple) else (options.axis,)
  over = transform.config_of(state.tx).replica_axes + over
  over = over[0] if len(over) == 1 else over
  batch = jax.ShapeDtypeStruct(
    rows.shape, rows.dtype, sharding=NamedSharding(mesh, PartitionSpec(over))
  )
  grad_fn = grad_lib.value_and_grad(
    lambda p, b: spec.loss_fn(p, b, plan),
    state.tx,
    per_layer=c.stage >= 2 and c.layout != 'hpz',
    micro_batches=c.micro_batches,
  )

  def train_step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  if c.stage == 3:
    unit = jnp.dtype(target.compute_dtype).itemsize
  else:
    unit = max(jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params))
  traced = jax.jit(train_step, donate_argnums=0).trace(state, batch)
  return traced, plan, state, batch, unit


def make_target(
  model: str | Callable[..., Any],
  topology: str,
  *,
  devices: Sequence[Any],
  optimizer: Callable[[], Any],
  mixed_precision: bool = False,
  seq_len: int | None = None,
  compute_dtype: Any = jnp.bfloat16,
  attention_chunk: int | None = None,
  attention: str = 'xla',
  slice_devices: Any = (),
) -> Target:
  """A `Target` for `topology` ('v5e:2x4', 'v5p:2x2x1', 'v6e:4x4' or 'cpu:N') and its devices
  (`slice_devices`: {S: the devices of S slices} for each S > 1 to search).

  Raises:
    ValueError: a topology without roofline constants, or a preset name that does not exist.
  """
  from zerojax._src.planner import presets

  chip_name, _, dims = topology.partition(':')
  if chip_name == 'cpu':
    grid, chip = (len(devices),), calibrate_cpu(len(devices))
  elif chip_name in CHIPS:
    grid, chip = tuple(int(d) for d in dims.lower().split('x')), CHIPS[chip_name]
  else:
    raise ValueError(
      f'`topology`={topology!r}: no roofline constants for {chip_name!r}; the search knows'
      f' {sorted(CHIPS)} and cpu:N.'
    )
  if isinstance(model, str) and model not in presets.PRESETS:
    raise ValueError(f'`model`={model!r} is not a preset; choose one of {sorted(presets.PRESETS)}.')
  for name, given in (('attention_chunk', attention_chunk), ('attention', attention != 'xla')):
    if given and not isinstance(model, str):
      raise ValueError(f'`{name}` is for the presets; a model function computes its own attention.')
  if attention not in presets.ATTENTION:
    raise ValueError(f'`attention`={attention!r}: choose one of {presets.ATTENTION}.')
  if dict(slice_devices) and not chip.dcn_bandwidth:
    raise ValueError(
      f'{chip_name} has no published data-center network bandwidth, so a step across slices'
      ' cannot be timed; search one slice, or a chip whose page gives it (v5e, v5p).'
    )
  return Target(
    topology,
    tuple(devices),
    grid,
    chip,
    model,
    optimizer,
    mixed_precision,
    seq_len,
    compute_dtype,
    attention_chunk,
    attention,
    tuple((s, tuple(d)) for s, d in dict(slice_devices).items()),
  )
