"""Bytes crossing the host link in a compiled TPU step, as an analysis of one walk, and the
host traffic a plan reports: counted there, or by formula where the program cannot show it."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from zerojax._src.planner import hlo
from zerojax._src.planner.roofline import host_transfer_bytes

# Host memory in the TPU compiler's layouts (memory space 5: pinned host).
_HOST_SPACE = re.compile(r'S\(5\)')
_TRANSFERS = ('copy-start', 'dynamic-update-slice-start', 'dynamic-slice-start', 'copy')


@dataclasses.dataclass(frozen=True)
class HostTransfers:
  """Bytes crossing the host link in one compiled step, per device.

  Attributes:
    to_host: bytes written from device to host memory per step (loop bodies
      times their trip counts).
    to_device: bytes read from host into device memory per step.
    largest_to_device: the largest single host-to-device transfer (bytes).
    largest_to_host: the largest single device-to-host transfer (bytes).
    in_loops: bytes (both directions) moved by transfers inside loop bodies: a
      layer loop that streams sends its layers one iteration at a time.
    overlapped: the share of the bytes whose asynchronous transfer has compute
      scheduled between its start and its done.
    host_computations: host computations (`HostExecute`) started per step.
    uncertain: loops whose trip count the HLO does not determine (counted once).
  """

  to_host: int = 0
  to_device: int = 0
  largest_to_device: int = 0
  largest_to_host: int = 0
  in_loops: int = 0
  overlapped: float = 0.0
  host_computations: int = 0
  uncertain: tuple[str, ...] = ()


def _transfer(line: str) -> tuple[str, int] | None:
  """('to_host' or 'to_device', bytes) of a host transfer on `line`, else None.

  A copy whose destination (the first element of a `copy-start`'s tuple, or
  the result of a `copy`) is in host memory and its source is not goes to the
  host, and the reverse comes back; a `dynamic-update-slice-start` into a host
  buffer writes its update there; a `dynamic-slice-start` from one reads it.
  """
  found = hlo.parts(line)
  if found is None or not _HOST_SPACE.search(line):
    return None
  _, type_str, tail = found
  kind = hlo.opcode(line)
  if kind not in _TRANSFERS:
    return None
  parts = hlo.tuple_elements(type_str) if type_str.startswith('(') else [type_str]
  if kind == 'copy-start' and len(parts) >= 2:
    dest, src = parts[0], parts[1]
  elif kind == 'copy':
    dest, src = type_str, ''
    operand = hlo.operand_names(tail)
    return ('to_host', hlo.type_bytes(dest)) if operand and _HOST_SPACE.search(dest) else None
  elif kind == 'dynamic-update-slice-start' and len(parts) >= 2:
    buffer, update = hlo.tuple_elements(parts[0])[:2] if parts[0].startswith('(') else parts[:2]
    if _HOST_SPACE.search(buffer) and not _HOST_SPACE.search(update):
      return 'to_host', hlo.type_bytes(update)
    return None
  elif kind == 'dynamic-slice-start' and len(parts) >= 2:
    source = hlo.tuple_elements(parts[0])[0] if parts[0].startswith('(') else parts[0]
    result = parts[1]
    if _HOST_SPACE.search(source) and not _HOST_SPACE.search(result):
      return 'to_device', hlo.type_bytes(result)
    return None
  else:
    return None
  dest_host, src_host = bool(_HOST_SPACE.search(dest)), bool(_HOST_SPACE.search(src))
  if dest_host == src_host:
    return None
  return ('to_host' if dest_host else 'to_device'), hlo.type_bytes(dest)


_ARRAY_LAYOUT = re.compile(r'\b(' + '|'.join(hlo.DTYPE_BYTES) + r')\[([\d,]*)\](\{[^}]*\})?')


def _host_execute(line: str) -> list[tuple[str, int]]:
  """The transfers a host computation (`HostExecute`) makes across the host link.

  Its start's type is ((operands...), results, context). The host reads an
  operand left in device memory (no `S(5)` in its layout) over the link, and
  writes a result placed in device memory over it: the TPU compiler keeps a
  host computation's results there unless they leave the program in host
  memory. One entry per array, as ('to_host' or 'to_device', bytes).
  """
  found = hlo.parts(line)
  if found is None or 'custom_call_target="HostExecute"' not in line or 'call-start' not in line:
    return []
  type_str = found[1]
  parts = hlo.tuple_elements(type_str) if type_str.startswith('(') else []
  if len(parts) < 2:
    return []
  out = []
  for direction, part in (('to_host', parts[0]), ('to_device', parts[1])):
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(part):
      if not _HOST_SPACE.search(layout or ''):
        out.append((direction, hlo.type_bytes(f'{dtype}[{dims}]')))
  return out


def count_host_transfers(compiled_or_text: Any) -> HostTransfers:
  """Counts the transfers between device and host memory in a compiled TPU program, per step.

  Reads the memory spaces the TPU compiler writes in its layouts (`S(5)`: host
  memory): asynchronous copies between the two, and slices written to or read
  from a buffer in host memory (how a layer loop streams), and what a host
  computation reads from or writes to device memory. Ops inside a `while`
  body count once per iteration, as in `count_collectives`. XLA:CPU keeps no
  memory spaces in its program: there this finds nothing.

  Args:
    compiled_or_text: a `hlo.Program`, a `jax.stages.Compiled`, or its `as_text()`.

  Returns:
    A `HostTransfers`.
  """
  program = hlo.as_program(compiled_or_text)
  counting = _HostLink(program)
  total = program.walk(counting)
  moved = total.to_host + total.to_device
  return HostTransfers(
    to_host=total.to_host,
    to_device=total.to_device,
    largest_to_device=total.largest_to_device,
    largest_to_host=total.largest_to_host,
    in_loops=total.in_loops,
    overlapped=total.overlapped / moved if moved else 0.0,
    host_computations=total.host_computations,
    uncertain=tuple(counting.uncertain),
  )


@dataclasses.dataclass
class _HostTally:
  to_host: int = 0
  to_device: int = 0
  largest_to_host: int = 0
  largest_to_device: int = 0
  in_loops: int = 0
  overlapped: int = 0
  host_computations: int = 0

  def moved(self, direction: str, size: int, in_loop: bool, overlapped: bool) -> None:
    if direction == 'to_host':
      self.to_host += size
      self.largest_to_host = max(self.largest_to_host, size)
    else:
      self.to_device += size
      self.largest_to_device = max(self.largest_to_device, size)
    self.in_loops += size if in_loop else 0
    self.overlapped += size if overlapped else 0

  def add(self, other: _HostTally, times: int) -> None:
    self.to_host += times * other.to_host
    self.to_device += times * other.to_device
    self.in_loops += times * other.in_loops
    self.overlapped += times * other.overlapped
    self.host_computations += times * other.host_computations
    self.largest_to_host = max(self.largest_to_host, other.largest_to_host)
    self.largest_to_device = max(self.largest_to_device, other.largest_to_device)

  def weight(self) -> int:
    """The bytes moved either way (`hlo.Tally`)."""
    return self.to_host + self.to_device

  def counted(self) -> bool:
    return bool(self.to_host or self.to_device or self.host_computations)


class _HostLink:
  """`count_host_transfers` as an analysis of `hlo.Program.walk`."""

  counts = 'its host transfers are'
  differ = 'move different bytes'

  def __init__(self, program: hlo.Program):
    self.program = program
    self.uncertain: list[str] = []
    self.overlapping: dict[str, set[int]] = {}  # computation -> its overlapped transfers

  def tally(self) -> _HostTally:
    return _HostTally()

  def line(self, site: hlo.Site, tally: _HostTally) -> bool:
    if site.computation not in self.overlapping:
      self.overlapping[site.computation] = _overlapping_copies(
        self.program.bodies[site.computation]
      )
    overlapped = site.index in self.overlapping[site.computation]
    in_loop = site.trips is not None
    found = _transfer(site.line)
    if found is not None:
      tally.moved(*found, in_loop, overlapped)
      return False
    if 'custom_call_target="HostExecute"' in site.line and 'custom-call-start' in site.line:
      tally.host_computations += 1
      for direction, size in _host_execute(site.line):
        tally.moved(direction, size, in_loop, overlapped)
    return True


def _overlapping_copies(lines: list[str]) -> set[int]:
  """Line indices of asynchronous host transfers with arithmetic scheduled before their done."""
  out = set()
  starts = {}
  for i, line in enumerate(lines):
    instr, op = hlo.instruction_name(line), hlo.opcode(line)
    if op.endswith('-start') and _HOST_SPACE.search(line):
      starts[instr] = (i, False)
      continue
    if op.endswith('-done'):
      for name in hlo.operand_names(line.split('=', 1)[1] if '=' in line else ''):
        if name in starts:
          j, busy = starts.pop(name)
          if busy:
            out.add(j)
      continue
    if op and op not in hlo.BOOKKEEPING and hlo.collective(line) is None:
      starts = {k: (j, True) for k, (j, _) in starts.items()}
  return out


def updated_param_bytes(plan: Any, stage: int) -> int:
  """One chip's share of the parameters an offloaded update sends each way (the formula's
  unit): its shards at stage 3; below it the whole parameters it holds, split over the shards."""
  params = plan.bytes_per_device()['params']
  return params if stage == 3 else params // max(plan.num_shards, 1)


@dataclasses.dataclass(frozen=True)
class HostTraffic:
  """Bytes over the host link per step and chip, and where the figure comes from
  (`host_traffic`)."""

  to_host: float
  to_device: float
  largest_to_device: int | None  # None where the figure is the formula's
  in_loops: int | None  # both directions, from inside loop bodies; None likewise
  overlapped: float  # the share of the bytes whose transfer overlaps compute
  host_computations: int  # host computations started per step
  source: str  # 'hlo' (counted in the program), 'formula' or 'none' (nothing moves)

  @property
  def moved(self) -> float:
    """Bytes both ways."""
    return self.to_host + self.to_device


def host_traffic(program: Any, c: Any, host_bytes: int, param_bytes: int) -> HostTraffic:
  """Bytes over the host link per step and chip, and where the figure comes from.

  Counted in the compiled program (`count_host_transfers`: copies to and from
  host memory, slices of host buffers in layer loops, what host computations
  read and write) where it carries memory spaces, as the TPU compiler's does.
  XLA:CPU's carries none: there an offload's bytes come from the formula
  `host_transfer_bytes`, split evenly each way, with no overlap, and say so.
  """
  counted = count_host_transfers(program)
  if counted.to_host + counted.to_device:
    return HostTraffic(
      to_host=counted.to_host,
      to_device=counted.to_device,
      largest_to_device=counted.largest_to_device,
      in_loops=counted.in_loops,
      overlapped=counted.overlapped,
      host_computations=counted.host_computations,
      source='hlo',
    )
  moved = host_transfer_bytes(c, host_bytes, param_bytes)
  return HostTraffic(
    to_host=moved / 2,
    to_device=moved / 2,
    largest_to_device=None,
    in_loops=None,
    overlapped=0.0,
    host_computations=counted.host_computations,
    source='formula' if moved else 'none',
  )
