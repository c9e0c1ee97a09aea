"""Estimates from theory: per-device bytes of each stage, before anything compiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType

from zerojax._src import options as options_lib
from zerojax._src import plan as plan_lib
from zerojax._src import transform


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes of model states one device holds under one stage.

  Attributes:
    stage: the ZeRO stage.
    num_devices: devices on the ZeRO axis.
    params: parameters at rest.
    grads: gradients, as reduced (before the update).
    opt_state: optimizer state in device memory.
    host: optimizer state offloaded to host memory (per device).
  """

  stage: int
  num_devices: int
  params: int
  grads: int
  opt_state: int
  host: int = 0

  @property
  def total(self) -> int:
    return self.params + self.grads + self.opt_state

  @property
  def at_rest(self) -> int:
    """What lives between steps: params and optimizer state (grads are transient)."""
    return self.params + self.opt_state


def estimate_memory(
  params: Any,
  tx: optax.GradientTransformation,
  *,
  num_devices: int,
  stages: Sequence[int] = (0, 1, 2, 3),
  dtype: Any = jnp.float32,
  options: options_lib.Options | None = None,
) -> list[MemoryEstimate]:
  """Per-device bytes of params, grads and optimizer state for each stage.

  Like DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs`, for any optax
  optimizer: its state is evaluated abstractly (`jax.eval_shape`), so factored,
  masked or multi-step states are counted as they really are. Nothing is
  allocated and no device is needed: the plan is made on an abstract mesh of
  `num_devices` devices along `options.axis`.

  Args:
    params: a parameter tree (arrays or ShapeDtypeStructs), or a parameter
      count (then one flat vector of `dtype`, padded to a multiple of
      `num_devices`).
    tx: the optax optimizer (not wrapped). For mixed precision pass
      `zerojax.mixed_precision(tx)` and `dtype=jnp.bfloat16`.
    num_devices: devices on the ZeRO axis, N.
    stages: which stages to estimate.
    dtype: parameter dtype when `params` is a count.
    options: the `zerojax.Options` the run will use (its `policy`,
      `replicate_below_bytes`, `offload`, ...); offloaded bytes are reported
      as `host`; default `zerojax.Options()`. Its `axis` must be one axis name.

  Returns:
    One `MemoryEstimate` per stage.

  >>> import optax, zerojax
  >>> est = zerojax.inspect.estimate_memory(10**9, optax.adam(1e-3), num_devices=64)
  >>> [round(e.total / 1e9, 2) for e in est]  # fp32 Adam: 16, 8+8/N, 4+12/N, 16/N bytes per param
  [16.0, 8.13, 4.19, 0.25]
  """
  options = options_lib.Options() if options is None else options
  if not isinstance(options, options_lib.Options):
    raise TypeError(
      f'options must be a zerojax.Options, got {type(options).__name__}: e.g.'
      " estimate_memory(params, tx, num_devices=8, options=zerojax.Options(policy='pad'))."
    )
  if not isinstance(options.axis, str):
    raise ValueError(
      f'estimate_memory lays the model out over one axis of num_devices devices; got'
      f' Options(axis={options.axis!r}). Pass one name, e.g. Options(axis="data").'
    )
  if isinstance(params, int):
    params = {'params': jax.ShapeDtypeStruct((params,), jnp.dtype(dtype))}
    options = options.replace(policy='pad')
  mesh = AbstractMesh((num_devices,), (options.axis,), axis_types=(AxisType.Auto,))
  out = []
  for stage in stages:
    config = transform.make_config(tx, stage, mesh, options, warn=False)
    sizes = plan_lib.plan_of(config, params).bytes_per_device()
    out.append(
      MemoryEstimate(
        stage, num_devices, sizes['params'], sizes['grads'], sizes['opt_state'], sizes['host']
      )
    )
  return out


def format_estimates(estimates: Sequence[MemoryEstimate]) -> str:
  """A table of `estimate_memory`'s results, in GiB per device."""
  gib = lambda n: f'{n / 2**30:10.3f}'
  lines = [
    f'{"stage":>5}  {"params":>10}  {"grads":>10}  {"opt state":>10}  {"total":>10}   GiB per device'
  ]
  host = any(e.host for e in estimates)
  if host:
    lines[0] = lines[0].replace('   GiB', f'  {"host":>10}   GiB')
  for e in estimates:
    lines.append(
      f'{e.stage:>5}  {gib(e.params)}  {gib(e.grads)}  {gib(e.opt_state)}  {gib(e.total)}'
      + (f'  {gib(e.host)}' if host else '')
      + f'   (N={e.num_devices})'
    )
  return '\n'.join(lines)
