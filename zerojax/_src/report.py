"""What a compiled step costs: per-device memory and the collectives it runs."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import jax
import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')

_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
}
_HEADER = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')
_OP = re.compile(
  r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+(?P<op>'
  + '|'.join(COLLECTIVES)
  + r')(?P<start>-start)?\('
)
_FUSED_RS = re.compile(
  r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+fusion\(.*kind=kCustom.*calls=%?all-reduce-scatter'
)
_SHAPE = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\]')
_CALLS = re.compile(r'\b(body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r'\bcondition=%?([\w.\-]+)')
_CONSTANT = re.compile(r'^\s*%?([\w.\-]+)\s*=\s*s32\[\][^ ]*\s+constant\((\d+)\)')
_COMPARE_LT = re.compile(r'compare\([^)]*%([\w.\-]+)\),\s*direction=LT')
# Replica groups: explicit lists, iota form [groups,size]<=[...], or TPU's
# mesh['axis_0'=8, ...] {'axis_0'} form.
_GROUPS_LIST = re.compile(r'replica_groups=\{\{([\d,]*)\}')
_GROUPS_IOTA = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=')
# (an optional `device_ids=(...)` permutation may sit between the two parts).
_GROUPS_MESH = re.compile(r'replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}')
_PARTITIONS = re.compile(r'num_partitions=(\d+)')
_CHANNEL = re.compile(r'\bchannel_id=(\d+)')


def _group_size(line: str, default: int) -> int:
  m = _GROUPS_LIST.search(line)
  if m:
    return len([x for x in m.group(1).split(',') if x]) or default
  m = _GROUPS_IOTA.search(line)
  if m:
    return int(m.group(2))
  m = _GROUPS_MESH.search(line)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    names = re.findall(r"'([^']+)'", m.group(2))
    return int(np.prod([int(sizes[n]) for n in names if n in sizes] or [1]))
  return default


def _ring_bytes(kind: str, result_bytes: int, n: int) -> float:
  """Bytes one device sends in a ring implementation of the collective."""
  if n <= 1:
    return 0.0
  if kind == 'all-reduce':
    return 2.0 * result_bytes * (n - 1) / n
  if kind in ('all-gather', 'all-to-all'):
    return result_bytes * (n - 1) / n
  if kind == 'reduce-scatter':
    return float(result_bytes * (n - 1))  # the input is n times the result
  return float(result_bytes)  # collective-permute


def _trip_count(line: str, bodies: dict[str, list[str]]) -> int:
  """Iterations of a `while`: XLA's known_trip_count, else its condition `i < N`."""
  m = _TRIP.search(line)
  if m:
    return int(m.group(1))
  cond = _CONDITION.search(line)
  if cond and cond.group(1) in bodies:
    consts = {}
    for cline in bodies[cond.group(1)]:
      c = _CONSTANT.match(cline)
      if c:
        consts[c.group(1)] = int(c.group(2))
      lt = _COMPARE_LT.search(cline)
      if lt and lt.group(1) in consts:
        return consts[lt.group(1)]
  return 1


def _type_bytes(type_str: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(type_str):
    total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(',') if d] or [1]))
  return total


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
  """Collectives of one compiled program, counted per step.

  Attributes:
    counts: kind -> number of ops executed per step (loop bodies multiplied by
      their trip counts).
    result_bytes: kind -> bytes of the ops' results per step, per device.
    ring_bytes: kind -> bytes each device sends per step if each op runs as a
      ring (all-reduce 2S(n-1)/n, all-gather and all-to-all S(n-1)/n of the
      result S, reduce-scatter S(n-1), over groups of n devices).
  """

  counts: dict[str, int]
  result_bytes: dict[str, int]
  ring_bytes: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def total_ring_bytes(self) -> float:
    return float(sum(self.ring_bytes.values()))

  def __getitem__(self, kind: str) -> int:
    return self.counts.get(kind, 0)


def count_collectives(compiled_or_text: Any) -> CollectiveStats:
  """Counts the collectives in a compiled program's HLO, per executed step.

  Ops inside a `while` body count once per iteration (XLA's known_trip_count,
  or the loop condition's `i < N` bound), so a scanned model is not
  undercounted. Asynchronous pairs count once (the `-start` op), and so does a collective
  that the compiler copies into several fusions (one `channel_id`; TPU puts one
  in the async start, an overlapped matmul and the done). TPU's fused
  `all-reduce-scatter` counts as a reduce-scatter.

  Args:
    compiled_or_text: a `jax.stages.Compiled`, or its `as_text()`.

  Returns:
    A `CollectiveStats`.
  """
  text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
  bodies: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(' '):
      current = header.group(1)
      bodies[current] = []
      if line.startswith('ENTRY'):
        entry = current
    elif current is not None:
      if line.strip() == '}':
        current = None
      else:
        bodies[current].append(line)
  if entry is None:
    raise ValueError('no ENTRY computation found in the HLO text')

  counts: collections.Counter = collections.Counter()
  nbytes: collections.Counter = collections.Counter()
  ring: collections.Counter = collections.Counter()
  # channel_id -> whether first seen inside a fusion.
  seen_channels: dict[str, bool] = {}
  partitions = _PARTITIONS.search(text)
  default_group = int(partitions.group(1)) if partitions else 1

  def visit(name: str, mult: int, stack: tuple[str, ...], fused: bool = False) -> None:
    if name in stack or name not in bodies:
      return
    for line in bodies[name]:
      m = _OP.match(line)
      kind = None
      if m:
        kind = m.group('op')
      elif _FUSED_RS.match(line):
        m = _FUSED_RS.match(line)
        kind = 'reduce-scatter'
      if kind is not None:
        channel = _CHANNEL.search(line)
        if channel:
          # One logical collective can be copied into several fusions (TPU: the
          # async start, an overlapped matmul, the done), all with its channel.
          # Distinct unfused ops may share a channel too (collectives written
          # in shard_map on CPU all get channel 1): those all count.
          ch = channel.group(1)
          op_fused = fused or m.re is _FUSED_RS
          if ch in seen_channels and (op_fused or seen_channels[ch]):
            continue
          seen_channels.setdefault(ch, op_fused)
        counts[kind] += mult
        type_str = m.group('type')
        if m.groupdict().get('start') and type_str.startswith('('):
          # An async start returns (operands, results); count the results.
          shapes = _SHAPE.findall(type_str)
          half = len(shapes) // 2
          type_str = ' '.join(f'{d}[{s}]' for d, s in shapes[half:]) if half else type_str
        size = _type_bytes(type_str)
        nbytes[kind] += mult * size
        ring[kind] += mult * _ring_bytes(kind, size, _group_size(line, default_group))
        continue
      trip = _trip_count(line, bodies) if ' while(' in line else 1
      in_fusion = fused or ' fusion(' in line
      for role, callee in _CALLS.findall(line):
        visit(callee, mult * (trip if role == 'body' else 1), stack + (name,), in_fusion)
      for group in _BRANCHES.findall(line):
        for callee in group.split(','):
          visit(callee.strip().lstrip('%'), mult, stack + (name,))

  visit(entry, 1, ())
  return CollectiveStats(dict(counts), dict(nbytes), dict(ring))


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Per-device bytes of one compiled program (from `memory_analysis()`)."""

  argument: int
  output: int
  alias: int
  temp: int

  @property
  def peak(self) -> int:
    """Arguments + outputs - aliased + temporaries (CPU's own peak omits temps)."""
    return self.argument + self.output - self.alias + self.temp


def memory_stats(compiled: Any) -> MemoryStats:
  """Per-device memory of a compiled program, e.g. `jax.jit(f).lower(...).compile()`."""
  m = compiled.memory_analysis()
  return MemoryStats(
    argument=int(m.argument_size_in_bytes),
    output=int(m.output_size_in_bytes),
    alias=int(m.alias_size_in_bytes),
    temp=int(m.temp_size_in_bytes),
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
  """

  memory: MemoryStats
  collectives: CollectiveStats
  stage: int | None = None
  num_params: int | None = None
  num_devices: int | None = None
  floor_bytes: float | None = None
  process_devices: dict[int, int] | None = None

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
) -> StepReport:
  """Measures a compiled step: memory per device and collectives per step.

  Args:
    compiled: `jax.jit(step).lower(*args).compile()`; the arguments may be
      ShapeDtypeStructs (e.g. from `zerojax.abstract_train_state`).
    plan: the step's `ZeroPlan`, to compare traffic with the ZeRO floor.
    bytes_per_param: bytes per parameter in the floor (4 for fp32 gradients).

  Returns:
    A `StepReport`; `print` it for a table.
  """
  memory = memory_stats(compiled)
  collectives = count_collectives(compiled)
  if plan is None:
    return StepReport(memory, collectives, process_devices=_process_devices(None))
  num_params = sum(int(np.prod(r.shape)) for r in plan.rows if r.group == 'params')
  return StepReport(
    memory,
    collectives,
    stage=plan.stage,
    num_params=num_params,
    num_devices=plan.num_shards,
    floor_bytes=zero_floor_bytes(plan.stage, num_params, plan.num_shards, bytes_per_param),
    process_devices=_process_devices(plan),
  )


def _mib(n: float) -> str:
  return f'{n / 2**20:,.2f} MiB'


def format_report(report: StepReport) -> str:
  """The printed form of a `StepReport`."""
  m = report.memory
  lines = [
    'memory per device:',
    f'  arguments {_mib(m.argument)}, outputs {_mib(m.output)}, aliased {_mib(m.alias)},'
    f' temporaries {_mib(m.temp)}; peak ~ {_mib(m.peak)}',
  ]
  counts = report.process_devices or {}
  if len(counts) > 1:
    whole, sizes = report.whole_mesh(), sorted(set(counts.values()))
    shape = f'{len(counts)} x {sizes[0]}' if len(sizes) == 1 else f'{len(counts)} processes'
    lines.append(
      f'per process ({shape} devices): arguments {_mib(m.argument * max(sizes))},'
      f' peak ~ {_mib(m.peak * max(sizes))}; whole mesh: arguments'
      f' {_mib(whole.argument)}, peak ~ {_mib(whole.peak)}'
    )
  lines += [
    'collectives per step (loop bodies times their trip counts):',
    f'  {"kind":<20} {"count":>7} {"result bytes":>16} {"ring bytes/device":>18}',
  ]
  c = report.collectives
  for kind in COLLECTIVES:
    if c.counts.get(kind):
      lines.append(
        f'  {kind:<20} {c.counts[kind]:>7} {c.result_bytes.get(kind, 0):>16,}'
        f' {c.ring_bytes.get(kind, 0):>18,.0f}'
      )
  lines.append(f'  {"total":<20} {sum(c.counts.values()):>7} {"":>16} {c.total_ring_bytes:>18,.0f}')
  if report.floor_bytes is not None:
    ratio = c.total_ring_bytes / report.floor_bytes if report.floor_bytes else float('nan')
    factor = 3 if report.stage == 3 else 2
    lines.append(
      f'ZeRO floor (stage {report.stage}: {factor}Ψ(N-1)/N, Ψ={report.num_params:,},'
      f' N={report.num_devices}): {report.floor_bytes:,.0f} bytes; measured/floor = {ratio:.3f}'
    )
  return '\n'.join(lines)
