"""What a compiled step costs: per-device memory and the collectives it runs."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

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
  """

  counts: dict[str, int]
  result_bytes: dict[str, int]

  def __getitem__(self, kind: str) -> int:
    return self.counts.get(kind, 0)


def count_collectives(compiled_or_text: Any) -> CollectiveStats:
  """Counts the collectives in a compiled program's HLO, per executed step.

  Ops inside a `while` body count `known_trip_count` times, so a scanned model
  is not undercounted. Asynchronous pairs count once (the `-start` op). TPU's
  fused `all-reduce-scatter` counts as a reduce-scatter.

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

  def visit(name: str, mult: int, stack: tuple[str, ...]) -> None:
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
        counts[kind] += mult
        type_str = m.group('type')
        if m.groupdict().get('start') and type_str.startswith('('):
          # An async start returns (operands, results); count the results.
          shapes = _SHAPE.findall(type_str)
          half = len(shapes) // 2
          type_str = ' '.join(f'{d}[{s}]' for d, s in shapes[half:]) if half else type_str
        nbytes[kind] += mult * _type_bytes(type_str)
        continue
      trip = _TRIP.search(line)
      for role, callee in _CALLS.findall(line):
        visit(
          callee, mult * (int(trip.group(1)) if (trip and role == 'body') else 1), stack + (name,)
        )
      for group in _BRANCHES.findall(line):
        for callee in group.split(','):
          visit(callee.strip().lstrip('%'), mult, stack + (name,))

  visit(entry, 1, ())
  return CollectiveStats(dict(counts), dict(nbytes))


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
