"""`Options`: every ZeRO option, with its default and its check, in one place.

`zero_stage(target, stage, mesh=..., **options)` builds one from its keywords;
the memory estimator, the plan search and the command line embed one. The
stage and the mesh are not options: the stage is what `zero_stage` is called
for, and the mesh is where it runs (an estimate needs none).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from zerojax._src import quantize as quantize_lib
from zerojax._src import rules

AxisName = str | tuple[str, ...]
Offload = Literal['opt_state', 'opt_state+master'] | None
OFFLOADS: tuple[str | None, ...] = (None, 'opt_state', 'opt_state+master')
UPDATE_ON: tuple[str, ...] = ('device', 'host', 'stream')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """How ZeRO lays out one optimizer, apart from the stage and the mesh.

  Attributes:
    axis: the mesh axis, or tuple of axes, that ZeRO partitions over.
    policy: what to do with a large leaf that has no dimension divisible by the
      axis size: 'error' (the default), 'replicate' (keep it whole on every
      device), or 'pad' (its gradient and optimizer state are zero-padded to a
      multiple of the axis size along its largest free dimension and split;
      the parameter itself stays whole). Padding is exact for optimizers that
      act elementwise or through norms (Adam, SGD, LAMB, clipping), not for
      ones that average over a dimension (Adafactor's factored statistics).
    replicate_below_bytes: leaves below this size are kept whole under any
      policy; the plan lists them.
    param_specs: PartitionSpecs (a prefix tree of the params) for
      tensor-parallel layouts, overriding those the params carry (see
      `zerojax.linen.logical_param_specs` for Flax logical partitioning).
    stacked: which parameters are stacked layers, whose leading dimension is the axis a
      layer loop walks (`zerojax.scan_layers`, `nn.scan`, `nnx.scan`, `jax.lax.scan`): a
      bool or a prefix tree of them (and None), e.g. `{'layers': True, 'head': False}`.
      True: the leading dimension is never split (another dimension carries the ZeRO
      axes). False: any dimension may be, the leading one included. None (the default,
      for leaves not named): the leading dimension of a leaf of two or more dimensions is
      split only where no larger dimension divides by the ZeRO axes, so stacked layers of
      fewer layers than their width are never split along the layers; name them True
      when the layer count is the larger.
    param_axis: hierarchical partitioning (ZeRO++ hpZ): at stage 3 split the
      parameters over only these axes (a subset of `axis`, e.g. the devices of
      one host) so their all-gathers stay inside that group; gradients and
      optimizer state are still split over all of `axis`.
    offload: ZeRO-Offload: 'opt_state' keeps the optimizer state in host
      memory (`memory_kind='pinned_host'`); 'opt_state+master' also the fp32
      master copy of `zerojax.mixed_precision`; None (the default) keeps
      everything on the device.
    update_on: with `offload`, where the optimizer update runs and what
      crosses the host link: 'device' (the offloaded state streams through
      device memory for the update), 'host' (gradient shards go down after
      the backward pass and updates come up), or 'stream' (ZeRO-Offload's
      schedule: with `zerojax.value_and_grad(..., per_layer=True)` at stage 2
      or 3, each layer's gradient shard goes down from inside the backward
      layer loop as soon as its reduce-scatter is done; the update runs on the
      host, and with `zerojax.mixed_precision` the new parameters come up in
      their compute dtype, one leaf at a time; see the README's "Offload").
      Gradients that arrive in device memory, or an optimizer without
      `mixed_precision`, run as 'host' does, with a warning.
    offload_params: keep the parameters themselves in host memory between steps
      (DeepSpeed's `offload_param`), for a model whose weights alone fill the
      device. Inside `zerojax.value_and_grad(..., per_layer=True)` at stage 3 each
      layer's shard comes to the device where the layer loop uses it (in the backward
      pass too), and its gradient goes down as it is produced;
      other leaves, and every leaf at stages 0-2, come to the device whole at the
      step's start. The update runs where they live: needs `offload` and
      `update_on='host'` or `'stream'`, and the new parameters stay in host memory.
    quantize: ZeRO++ quantized collectives, a `zerojax.Quantize`, or None.
    replica_axis: data-parallel mesh axes outside ZeRO (e.g. 'slice', across TPU slices):
      every position along them holds a whole copy of the ZeRO-split state, the batch's
      rows are split over them too, and each gradient shard is all-reduced over them once
      per step (after its reduce-scatter over `axis`). None (the default) takes the mesh
      axes that run across TPU slices (`Device.slice_index`) and are not in `axis`, so a
      multi-slice mesh is hierarchical ZeRO unless `axis` names its slice axis.
    trainable: which parameters train; the rest are frozen (LoRA's base weights). None (the
      default): all of them. A bool or a prefix tree of bools (a mask), a predicate
      `(key_path, leaf) -> bool`, or a Flax Variable type (`nnx.LoRAParam`) for parameters
      given as Variables. Frozen leaves are laid out at rest like the others (split at stage
      3), but get no optimizer state, no master copy and no gradient in the update (it is
      not read, so a jitted step neither computes nor reduces it); their update is zero.

  Every field is checked when the object is made:

  >>> import zerojax
  >>> zerojax.Options(update_on='host')
  Traceback (most recent call last):
  ValueError: Options(update_on='host') runs the update where offloaded state lives: pass offload='opt_state' (or 'opt_state+master') too.
  """

  axis: AxisName = 'data'
  policy: rules.Policy = 'error'
  replicate_below_bytes: int = rules.DEFAULT_REPLICATE_BELOW_BYTES
  param_specs: Any = None
  stacked: Any = None
  param_axis: AxisName | None = None
  offload: Offload = None
  update_on: Literal['device', 'host', 'stream'] = 'device'
  offload_params: bool = False
  quantize: quantize_lib.Quantize | None = None
  replica_axis: AxisName | None = None
  trainable: Any = None

  def __post_init__(self):
    _check_axis_name(self.axis, 'axis')
    if self.replica_axis is not None:
      _check_axis_name(self.replica_axis, 'replica_axis')
      zero = {self.axis} if isinstance(self.axis, str) else set(self.axis)
      both = zero & (
        {self.replica_axis} if isinstance(self.replica_axis, str) else set(self.replica_axis)
      )
      if both:
        raise ValueError(
          f'Options(replica_axis={self.replica_axis!r}) names {sorted(both)}, which is also a'
          f' ZeRO axis (axis={self.axis!r}): an axis either splits the state (axis) or holds'
          ' whole copies of it (replica_axis). Drop it from one of them.'
        )
    if self.param_axis is not None:
      _check_axis_name(self.param_axis, 'param_axis')
    if self.policy not in rules.POLICIES:
      raise ValueError(f'Options(policy=...) must be one of {rules.POLICIES}, got {self.policy!r}.')
    size = self.replicate_below_bytes
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
      raise ValueError(
        f'Options(replicate_below_bytes=...) must be a whole number of bytes >= 0, got {size!r}.'
      )
    if self.offload not in OFFLOADS:
      raise ValueError(
        f'Options(offload=...) must be one of {OFFLOADS}, got {self.offload!r}: None keeps'
        " everything on the device, 'opt_state' moves the optimizer state to host memory,"
        " 'opt_state+master' also the mixed_precision master copy."
      )
    if self.update_on not in UPDATE_ON:
      raise ValueError(
        f"Options(update_on=...) must be 'device', 'host' or 'stream', got {self.update_on!r}:"
        " 'host' runs the optimizer update on the host, on offloaded state, and 'stream' also"
        " sends gradients down layer by layer (both need offload='opt_state')."
      )
    if self.update_on != 'device' and self.offload is None:
      raise ValueError(
        f'Options(update_on={self.update_on!r}) runs the update where offloaded state lives:'
        " pass offload='opt_state' (or 'opt_state+master') too."
      )
    _check_offload_params(self)
    if self.update_on == 'stream' and self.policy == 'pad':
      raise ValueError(
        "Options(update_on='stream') does not pad: its gradients reach host memory in the"
        " layout they were reduce-scattered into. Use policy='replicate' (or 'error') with it,"
        " or update_on='host'."
      )
    if self.quantize is not None and not isinstance(self.quantize, quantize_lib.Quantize):
      raise TypeError(
        f'Options(quantize=...) must be a zerojax.Quantize or None, got'
        f" {type(self.quantize).__name__}; e.g. zerojax.Quantize(weights='int8', grads='int4')."
      )

  def check_stage(self, stage: Any) -> int:
    """`stage` as an int, checked on its own and against these options.

    Raises:
      ValueError: `stage` is not 0-3, or `quantize` asks for more than it has.
    """
    if isinstance(stage, bool) or not _is_int(stage) or int(stage) not in STAGES:
      raise ValueError(f'`stage` must be 0, 1, 2 or 3 (the ZeRO stages), got {stage!r}.')
    stage = int(stage)
    quantize_lib.check_stage(self.quantize, stage)
    return stage

  def replace(self, **changes: Any) -> Options:
    """A copy with `changes`, checked again."""
    return dataclasses.replace(self, **changes)


STAGES = (0, 1, 2, 3)
NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Options))


def from_keywords(options: dict[str, Any], where: str) -> Options:
  """`Options(**options)`, with an error that names `where` and every option.

  Raises:
    TypeError: a keyword that is not an option.
  """
  unknown = sorted(set(options) - set(NAMES))
  if unknown:
    raise TypeError(
      f'{where} got unknown option(s) {", ".join(unknown)}; the ZeRO options (zerojax.Options)'
      f' are {", ".join(NAMES)}.'
    )
  return Options(**options)


def _check_offload_params(o: Options) -> None:
  """`Options.offload_params`: a bool, with an update on the host and no padding."""
  if not isinstance(o.offload_params, bool):
    raise TypeError(f'Options(offload_params=...) must be True or False, got {o.offload_params!r}.')
  if o.offload_params and o.update_on == 'device':
    raise ValueError(
      'Options(offload_params=True) keeps the parameters in host memory, so the optimizer'
      " update runs there too: pass offload='opt_state' (or 'opt_state+master') and"
      f" update_on='stream' (or 'host'), not update_on={o.update_on!r}."
    )
  if o.offload_params and o.policy == 'pad':
    raise ValueError(
      'Options(offload_params=True) does not pad: parameters in host memory are read in'
      " their own shapes. Use policy='replicate' (or 'error') with it."
    )


def _is_int(x: Any) -> bool:
  import numpy as np

  return isinstance(x, (int, np.integer))


def _check_axis_name(axis: Any, field: str) -> None:
  names = (axis,) if isinstance(axis, str) else axis
  if not isinstance(names, tuple) or not names or not all(isinstance(a, str) for a in names):
    raise TypeError(
      f'Options({field}=...) must be a mesh axis name or a tuple of names, got {axis!r}.'
    )
  if len(set(names)) != len(names):
    raise ValueError(f'Options({field}={axis!r}) names an axis more than once.')
