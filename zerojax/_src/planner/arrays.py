"""The largest arrays a compiled program makes, and where they come from (one walk)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from zerojax._src.planner import hlo

_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_SOURCE = re.compile(r'\bsource_file="([^"]*)"\s+source_line=(\d+)')
_NOT_ARRAYS = hlo.BOOKKEEPING | {'while', 'conditional', 'call', 'dynamic-slice', 'slice'}


@dataclasses.dataclass(frozen=True)
class ProgramArray:
  """One array a compiled program makes (an instruction's result), for `largest_arrays`.

  Attributes:
    nbytes: its size on one device.
    type: its HLO type, e.g. 'bf16[48,4,2048,5120]'.
    opcode: the instruction that makes it ('fusion', 'dot', ...).
    source: what made it in the JAX program (the end of XLA's op_name, and the
      Python file and line where the metadata has them); '' where there is none.
    loop_trips: iterations of the loop whose body makes it (None: outside any
      loop, 0: a loop whose trip count the HLO does not give).
    stacked: written one slice per iteration inside a loop (a dynamic update
      slice) and its leading dimension is the loop's trip count: a value kept
      per layer (saved activations, per-layer gradients).
  """

  nbytes: int
  type: str
  opcode: str
  source: str
  loop_trips: int | None
  stacked: bool


def largest_arrays(compiled_or_text: Any, count: int | None = 8) -> list[ProgramArray]:
  """The `count` largest arrays one device's compiled program makes (None: all), largest first.

  Every instruction of the entry computation and of the computations it runs
  (loop bodies, branches, calls; not the insides of fusions, which are not
  materialised) is one array, except tuples, parameters, constants, views and
  copies. These are arrays, not buffers: the compiler may place several in the
  same memory, so they do not add up to the peak; they say which values are big
  and where they come from.
  """
  program = hlo.as_program(compiled_or_text)
  found = program.walk(_Arrays(program)).arrays
  found.sort(key=lambda a: -a.nbytes)
  return found if count is None else found[:count]


class _Listed:
  """An `_Arrays` tally: the arrays listed, each once however often its loop runs."""

  def __init__(self):
    self.arrays: list[ProgramArray] = []

  def add(self, other: _Listed, times: int) -> None:
    self.arrays.extend(other.arrays)

  def weight(self) -> int:
    return len(self.arrays)

  def counted(self) -> bool:
    return bool(self.arrays)


class _Arrays:
  """`largest_arrays` as an analysis of `hlo.Program.walk`: the arrays of the computations run at
  the top level (the entry, loop bodies, branches, calls), each computation read once."""

  _MATERIALISED = ('while', 'conditional', 'call')
  # Every branch's arrays are listed (what the program holds, not what one step runs), and a
  # loop body's once (each array records its loop's trips).
  counts, differ, every_branch = '', '', True

  def __init__(self, program: hlo.Program):
    self.program = program
    self.read: dict[str, hlo.Site | None] = {}  # computation -> the call that lists its arrays
    self.uncertain: list[str] = []

  def tally(self) -> _Listed:
    return _Listed()

  def line(self, site: hlo.Site, tally: list[ProgramArray]) -> bool:
    # A computation reached again (another call of it) is not listed twice.
    if self.read.setdefault(site.computation, site.caller) is not site.caller:
      return False
    op = site.opcode
    if op in self._MATERIALISED:
      return True
    if not op or op in _NOT_ARRAYS or op.endswith(('-start', '-done', '-update')):
      return False
    tally.arrays.extend(
      _program_arrays(site.line, op, site.trips, _slice_updated(site.line, op, self.program.bodies))
    )
    return False


def _slice_updated(line: str, op: str, bodies: dict[str, list[str]]) -> set[str]:
  """Shapes ('2,64,256') of the buffers the instruction writes one slice into: its own if it
  is a dynamic-update-slice, those of the dynamic-update-slices inside it if it is a fusion
  (how a loop stacks one value per iteration; a fusion may convert the result's dtype)."""
  if op == 'dynamic-update-slice':
    lines = [line]
  elif op == 'fusion' and hlo.callees(line):
    lines = bodies.get(hlo.callees(line)[0], [])
  else:
    return set()
  out = set()
  for x in lines:
    if hlo.opcode(x) == 'dynamic-update-slice':
      found = hlo.SHAPE.search(hlo.result_type(x))
      if found:
        out.add(found.group(2))
  return out


def _program_arrays(
  line: str, op: str, trips: int | None, slice_updated: set[str]
) -> list[ProgramArray]:
  """The arrays one instruction makes: one, or one per element of a tuple result."""
  type_str = hlo.result_type(line)
  name = _OP_NAME.search(line)
  source = '/'.join(name.group(1).split('/')[-2:]) if name else ''
  where = _SOURCE.search(line)
  if where:
    source += f' ({where.group(1).rsplit("/", 1)[-1]}:{where.group(2)})'
  out = []
  for dtype, shape in hlo.SHAPE.findall(type_str):
    dims = [int(d) for d in shape.split(',') if d]
    out.append(
      ProgramArray(
        nbytes=hlo.DTYPE_BYTES[dtype] * int(np.prod(dims or [1])),
        type=f'{dtype}[{shape}]',
        opcode=op,
        source=source,
        loop_trips=trips,
        stacked=bool(trips) and bool(dims) and dims[0] == trips and shape in slice_updated,
      )
    )
  return out
