"""What a compiled step costs: per-device memory, the ZeRO floor, and a step report.

The collectives come from `hlo`'s reader of the compiled program's text; the
memory from `memory_analysis()`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from zerojax._src import mesh as mesh_lib
from zerojax._src import rules
from zerojax._src.planner.collectives import CollectiveStats, count_collectives
from zerojax._src.planner.hlo import COLLECTIVES


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Per-device bytes of one compiled program (from `memory_analysis()`).

  Attributes:
    argument, output, alias, temp: the sizes `memory_analysis()` reports.
    compiler_peak: the TPU compiler's own peak of live bytes (`peak_memory_in_bytes`),
      arguments and outputs included; 0 where it is not the compiler's own (CPU's omits
      temporaries) or counts host memory too (a program with host-offloaded state).
    allocated: the TPU compiler's allocation total (`total_allocation_bytes`, jax 0.11
      and later): arguments, outputs and the one block its temporaries are placed in,
      that block's fragmentation included; 0 where it is not reported.
    host_held: on TPU, the host-memory bytes the program holds (arguments and
      temporaries), where the compiler's figures are therefore not used; else 0.
  """

  argument: int
  output: int
  alias: int
  temp: int
  compiler_peak: int = 0
  allocated: int = 0
  host_held: int = 0  # TPU: host bytes the program holds (arguments and temporaries)

  @property
  def formula_peak(self) -> int:
    """Arguments + outputs - aliased + temporaries."""
    return self.argument + self.output - self.alias + self.temp

  @property
  def peak(self) -> int:
    """What must fit in one device's memory.

    On TPU, the compiler's own figures: the larger of its allocation total (where jax
    reports it) and its peak of live bytes. Neither bounds the other: a 70B step allocates
    10.89 GiB for a live peak of 10.81 (fragmentation), while a small program's allocation
    total (libtpu 0.0.50) leaves out 100 MiB of temporaries its live peak counts. The TPU compilers jax 0.10 and 0.12 pair with report
    `temp_size_in_bytes` that matches no buffer of their own assignment (a 70B step:
    12.03 GiB of temporaries beside a 7.88 GiB block of them in the dumped buffer
    assignment, and 0 for a small program that holds a 32 MiB gathered matrix), so the
    sum would overstate one and understate the other. Elsewhere (CPU, GPU, and a TPU
    program holding state in host memory, where the compiler's figures count host memory
    too): arguments + outputs - aliased + temporaries (CPU's own peak omits temporaries).
    """
    return max(self.allocated, self.compiler_peak) or self.formula_peak

  @property
  def source(self) -> str:
    """Which figure `peak` is."""
    if self.allocated and self.allocated >= self.compiler_peak:
      return "the TPU compiler's allocation total"
    if self.compiler_peak:
      return "the TPU compiler's peak of live bytes"
    return 'arguments + outputs - aliased + temporaries'


def platform_of(compiled: Any) -> str:
  """The platform a `jax.stages.Compiled` runs on ('tpu' for a TPU topology compiled ahead of
  time): its arguments' devices', else the default backend's."""
  for sharding in jax.tree.leaves(getattr(compiled, 'input_shardings', ())):
    return next(iter(sharding.device_set)).platform
  return jax.default_backend()


def memory_stats(compiled: Any, platform: str | None = None) -> MemoryStats:
  """Per-device memory of a compiled program, e.g. `jax.jit(f).lower(...).compile()`.

  The TPU compiler's own peak and allocation total are taken where the program holds
  nothing in host memory: they count host memory too (a 70B step with its optimizer state
  offloaded: 56.18 GiB, of which the device holds 14.12), and the device's share of them is
  not reported. There the peak is arguments + outputs - aliased + temporaries, device only.

  `platform` says where the program runs for one the planner read back from its cache
  (`program_cache.Compiled.platform`); None reads it from `compiled`'s devices.
  """
  m = compiled.memory_analysis()
  host = sum(int(getattr(m, f'host_{n}_size_in_bytes', 0) or 0) for n in ('argument', 'temp'))
  on_tpu = (platform or platform_of(compiled)) == 'tpu'
  tpu = on_tpu and not host
  return MemoryStats(
    argument=int(m.argument_size_in_bytes),
    output=int(m.output_size_in_bytes),
    alias=int(m.alias_size_in_bytes),
    temp=int(m.temp_size_in_bytes),
    compiler_peak=int(getattr(m, 'peak_memory_in_bytes', 0) or 0) if tpu else 0,
    allocated=int(getattr(m, 'total_allocation_bytes', 0) or 0) if tpu else 0,
    host_held=host if on_tpu else 0,
  )


def zero_floor_bytes(
  stage: int, num_params: int, num_devices: int, bytes_per_param: int = 4
) -> float:
  """ZeRO's per-device communication floor per step (ring-equivalent bytes).

  Stages 0-2 move 2Ψ(N-1)/N (a reduce-scatter and an all-gather, or one
  all-reduce); stage 3 moves 3Ψ(N-1)/N (parameters gathered for the forward and
  again for the backward pass, gradients reduce-scattered). A step that moves
  more has redundant collectives.
  """
  factor = 3 if stage == 3 else 2
  return factor * num_params * bytes_per_param * (num_devices - 1) / num_devices


def frozen_floor_bytes(plan: Any, num_devices: int, bytes_per_param: int = 4) -> float:
  """ZeRO's floor per device for a plan with frozen leaves (LoRA's base): the trainable
  leaves' gradients reduce-scattered (and, below stage 3, their updated values gathered) in
  `bytes_per_param`, and at stage 3 every parameter gathered for the forward and again for the
  backward pass, floating ones in `bytes_per_param` and the rest (a quantized base's codes and
  scales) as stored; times (N-1)/N."""
  rows = [r for r in plan.rows if r.group == 'params']
  size = lambda r: int(np.prod(r.shape))
  moved = lambda r: (
    size(r)
    * (bytes_per_param if np.issubdtype(r.dtype, np.floating) else np.dtype(r.dtype).itemsize)
  )
  trained = sum(size(r) for r in rows if not r.frozen) * bytes_per_param
  total = 2 * sum(moved(r) for r in rows) + trained if plan.stage == 3 else 2 * trained
  return total * (num_devices - 1) / num_devices


@dataclasses.dataclass(frozen=True)
class StepReport:
  """Measured cost of one compiled training step, per device.

  Attributes:
    memory: argument, output, alias and temp bytes.
    collectives: counts, result bytes and ring-equivalent bytes per kind.
    stage: the ZeRO stage, if known.
    num_params: the parameter count Ψ, if known.
    num_devices: devices on the ZeRO axis, if known.
    floor_bytes: ZeRO's communication floor for this stage, if known.
    process_devices: devices of the step's mesh in each process, by process
      index (one entry on one machine). Every device runs the same program, so
      a process needs `memory` times its device count, and the mesh the sum.
    quantized: with ZeRO++ quantized collectives (the plan's `quantize`), what
      is quantized and on how many leaves; the floor stays full precision.
    num_slices: the TPU slices the mesh spans (or the positions along the plan's
      replica axes standing in for them), when more than one: `collectives` then
      counts the bytes between slices apart, and `floor_bytes` is the floor on ICI
      (within a slice, N the ZeRO devices of one slice).
    dcn_floor_bytes: the floor between slices: each chip's gradient shard (its part of
      the update, split over the ZeRO and any tensor-parallel axes) all-reduced across them
      once per step, 2·(Ψ/N)·bytes·(S-1)/S, in the floor's bytes per parameter (ZeRO split
      over the slices too moves the same: a reduce-scatter and an all-gather of that shard).
    frozen_params: of `num_params`, the values of frozen leaves (`Options.trainable`): they
      have no gradient to reduce and no update to gather, so the floor counts them only where
      stage 3 gathers them (twice, as stored: `frozen_floor_bytes`).
  """

  memory: MemoryStats
  collectives: CollectiveStats
  stage: int | None = None
  num_params: int | None = None
  num_devices: int | None = None
  floor_bytes: float | None = None
  process_devices: dict[int, int] | None = None
  quantized: str | None = None
  num_slices: int = 1
  dcn_floor_bytes: float | None = None
  frozen_params: int = 0

  def per_process(self, process: int | None = None) -> MemoryStats:
    """Memory of all of one process's devices (default: this process)."""
    counts = self.process_devices or {0: 1}
    n = counts.get(jax.process_index() if process is None else process, 0)
    return _scaled(self.memory, n)

  def whole_mesh(self) -> MemoryStats:
    """Memory summed over every device of every process."""
    return _scaled(self.memory, sum((self.process_devices or {0: 1}).values()))

  def __str__(self) -> str:
    return format_report(self)


def _scaled(m: MemoryStats, n: int) -> MemoryStats:
  return dataclasses.replace(
    m,
    **{
      f.name: getattr(m, f.name) * n
      for f in dataclasses.fields(m)
      if isinstance(getattr(m, f.name), int)
    },
  )


def _process_devices(plan: Any) -> dict[int, int]:
  devices = plan.mesh.devices.flat if plan is not None else jax.devices()
  counts = collections.Counter(int(getattr(d, 'process_index', 0)) for d in devices)
  return dict(sorted(counts.items()))


def step_report(
  compiled: Any,
  *,
  plan: Any = None,
  bytes_per_param: int = 4,
  hlo_text: str | None = None,
  platform: str | None = None,
) -> StepReport:
  """Measures a compiled step: memory per device and collectives per step.

  Args:
    compiled: `jax.jit(step).lower(*args).compile()`; the arguments may be
      ShapeDtypeStructs (e.g. from `zerojax.inspect.abstract_train_state`).
    plan: the step's `ZeroPlan`, to compare traffic with the ZeRO floor.
    bytes_per_param: bytes per parameter in the floor (4 for fp32 gradients).
    hlo_text: the program's optimized HLO, where `compiled.as_text()` cannot
      print it (`program_cache.compile_with_text`): its text, or the `hlo.Program` read from it.
    platform: where the program runs, for a program read back from the planner's cache
      (`program_cache.Compiled.platform`); None reads it from `compiled`.

  Returns:
    A `StepReport`; `print` it for a table.
  """
  memory = memory_stats(compiled, platform)
  text = compiled if hlo_text is None else hlo_text
  if plan is None:
    return StepReport(memory, count_collectives(text), process_devices=_process_devices(None))
  slices = mesh_lib.slice_ids(plan.mesh, plan.replica_axes)
  num_slices = 1 if slices is None else len(np.unique(slices))
  collectives = count_collectives(text, slices=slices if num_slices > 1 else None)
  num_params = sum(int(np.prod(r.shape)) for r in plan.rows if r.group == 'params')
  # ZeRO's devices within one slice: the floor on ICI is theirs.
  n = plan.num_shards // num_slices if _zero_over_slices(plan) else plan.num_shards
  dcn_floor = None
  if num_slices > 1:
    # Each chip's gradient shard (the part of the update it computes, split over the ZeRO and
    # any tensor-parallel axes), summed across the slices in the floor's dtype.
    shard = sum(
      int(np.prod(r.shape)) // _ways(s)
      for r, s in zip(_param_rows(plan), jax.tree.leaves(plan.param_shards))
    )
    dcn_floor = 2 * shard * bytes_per_param * (num_slices - 1) / num_slices
  frozen = sum(int(np.prod(r.shape)) for r in plan.rows if r.group == 'params' and r.frozen)
  floor = zero_floor_bytes(plan.stage, num_params, n, bytes_per_param)
  if frozen:
    floor = frozen_floor_bytes(plan, n, bytes_per_param)
  return StepReport(
    memory,
    collectives,
    stage=plan.stage,
    num_params=num_params,
    num_devices=n,
    floor_bytes=floor,
    process_devices=_process_devices(plan),
    quantized=_quantized(plan),
    num_slices=num_slices,
    dcn_floor_bytes=dcn_floor,
    frozen_params=frozen,
  )


def _param_rows(plan: Any) -> list:
  return [r for r in plan.rows if r.group == 'params']


def _ways(sharding: Any) -> int:
  """Into how many parts `sharding` splits an array (the product of the axes it names)."""
  used = {a for entry in sharding.spec if entry is not None for a in rules.spec_axes(entry)}
  return int(np.prod([sharding.mesh.shape[a] for a in used]))


def _zero_over_slices(plan: Any) -> bool:
  """Whether the plan's ZeRO axes run across TPU slices (ZeRO++ style, not hierarchical)."""
  return bool(set(mesh_lib.dcn_axes(plan.mesh)) & set(plan.axes))


def _quantized(plan: Any) -> str | None:
  q = getattr(plan, 'quantize', None)
  if q is None:
    return None
  on = sum(why is None for why in plan.unquantized)
  return (
    f'weights {q.weights}, gradients {q.grads}, blocks of {q.block_size}, on {on} of'
    f' {len(plan.unquantized)} parameter leaves'
  )


def _network_lines(report: StepReport) -> list[str]:
  """The two networks apart: bytes per chip on ICI and on DCN, each by its floor, the share
  of each overlapped, and the DCN traffic ZeRO need not have (flagged)."""
  c, s = report.collectives, report.num_slices
  share = lambda part, whole: f'{part / whole:.0%}' if whole else '-'
  ici_overlap = sum(c.overlapped_ring_bytes.values()) - sum(c.dcn_overlapped_ring_bytes.values())
  dcn = c.total_dcn_bytes
  ratio = dcn / report.dcn_floor_bytes if report.dcn_floor_bytes else float('nan')
  lines = [
    f'networks ({s} slices): ICI {c.total_ici_bytes:,.0f} bytes per chip, {share(ici_overlap, c.total_ici_bytes)} overlapped;'
    f' DCN {dcn:,.0f} bytes per chip, {share(sum(c.dcn_overlapped_ring_bytes.values()), dcn)} overlapped',
    f"DCN floor (each chip's gradient shard all-reduced across slices, 2(Ψ/N)(S-1)/S,"
    f' S={s}): {report.dcn_floor_bytes:,.0f} bytes; measured/floor = {ratio:.3f}',
  ]
  for gather in c.dcn_gathers:
    lines.append(
      f'  flagged: all-gather across slices ({gather} per step): parameters gathered over DCN;'
      " split them within a slice (the default, or param_axis=the slice's own axes)"
    )
  if dcn > 1.05 * report.dcn_floor_bytes and not c.dcn_gathers:
    lines.append(
      f'  flagged: {dcn - report.dcn_floor_bytes:,.0f} DCN bytes above the floor: gradients'
      ' reduced across slices before they are split, or reduced more than once per step'
    )
  return lines


def _mib(n: float) -> str:
  return f'{n / 2**20:,.2f} MiB'


def format_report(report: StepReport) -> str:
  """The printed form of a `StepReport`."""
  lines = _memory_lines(report) + _collective_lines(report.collectives)
  if report.floor_bytes is not None and report.num_devices == 1:
    lines.append('ZeRO floor: 0 bytes (one device: nothing is split, nothing is exchanged)')
  elif report.floor_bytes is not None:
    c = report.collectives
    ici = c.total_ici_bytes if report.num_slices > 1 else c.total_ring_bytes
    ratio = ici / report.floor_bytes if report.floor_bytes else float('nan')
    factor = 3 if report.stage == 3 else 2
    rule = f'{factor}Ψ(N-1)/N, Ψ={report.num_params:,}'
    if report.frozen_params:
      trained = report.num_params - report.frozen_params
      rule = (
        f'the {trained:,} trained values reduced'
        + (', all gathered twice as stored' if report.stage == 3 else ' and gathered')
        + f', {report.frozen_params:,} frozen'
      )
    lines.append(
      f'ZeRO floor (stage {report.stage}: {rule},'
      f' N={report.num_devices}): {report.floor_bytes:,.0f} bytes; measured/floor = {ratio:.3f}'
      + (' (ICI, within a slice)' if report.num_slices > 1 else '')
    )
  if report.num_slices > 1:
    lines += _network_lines(report)
  if report.quantized is not None:
    lines.append(
      f'ZeRO++ quantized collectives ({report.quantized}): the floor counts full precision'
    )
  return '\n'.join(lines)


def _memory_lines(report: StepReport) -> list[str]:
  """The report's memory per device (and per process, where the mesh spans several)."""
  m = report.memory
  lines = [
    'memory per device:',
    f'  arguments {_mib(m.argument)}, outputs {_mib(m.output)}, aliased {_mib(m.alias)},'
    f' temporaries {_mib(m.temp)}; peak ~ {_mib(m.peak)}',
  ]
  if m.compiler_peak:
    held = (
      f"the TPU compiler's allocation total, fragmentation included (its live bytes peak at"
      f' {_mib(m.compiler_peak)})'
      if m.allocated >= m.compiler_peak
      else "the TPU compiler's own peak of live bytes"
      + (f' (its allocation total: {_mib(m.allocated)})' if m.allocated else '')
    )
    lines.append(
      f'  the peak is {held}; arguments + outputs - aliased + temporaries would be'
      f' {_mib(m.formula_peak)}'
    )
  elif m.host_held:
    lines.append(
      '  the peak is arguments + outputs - aliased + temporaries as the TPU compiler reports'
      f' them: its own peak counts the {_mib(m.host_held)} it holds in host memory too, and'
      ' it reports no device-only peak'
    )
  counts = report.process_devices or {}
  if len(counts) > 1:
    whole, sizes = report.whole_mesh(), sorted(set(counts.values()))
    shape = f'{len(counts)} x {sizes[0]}' if len(sizes) == 1 else f'{len(counts)} processes'
    lines.append(
      f'per process ({shape} devices): arguments {_mib(m.argument * max(sizes))},'
      f' peak ~ {_mib(m.peak * max(sizes))}; whole mesh: arguments'
      f' {_mib(whole.argument)}, peak ~ {_mib(whole.peak)}'
    )
  return lines


def _collective_lines(c: Any) -> list[str]:
  """The table of collectives per step, what is not exact in it, and the overlapped share."""
  lines = [
    'collectives per step (loop bodies times their trip counts):',
    f'  {"kind":<20} {"count":>7} {"result bytes":>16} {"ring bytes/device":>18}',
  ]
  for kind in COLLECTIVES:
    if c.counts.get(kind):
      lines.append(
        f'  {kind:<20} {c.counts[kind]:>7} {c.result_bytes.get(kind, 0):>16,}'
        f' {c.ring_bytes.get(kind, 0):>18,.0f}'
      )
  lines.append(f'  {"total":<20} {sum(c.counts.values()):>7} {"":>16} {c.total_ring_bytes:>18,.0f}')
  for reason in c.uncertain:
    lines.append(f'  not exact: {reason}')
  if c.total_ring_bytes:
    lines.append(
      f'  asynchronous, with compute scheduled before their done: {c.overlap_fraction:.0%}'
      ' of the ring bytes'
    )
  return lines
