"""The collectives a compiled program runs and what they move, as an analysis of one walk.

`count_collectives` counts each collective the number of times it executes per step (loop
bodies times their trip counts), the bytes it moves on a ring, how many of those bytes
overlap compute, and those that cross between TPU slices. `hlo` reads the program.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from typing import Any

import numpy as np

from zerojax._src.planner import hlo

_ASYNC_COPY = re.compile(r'\bcalls=%?async_collective_fusion')
_CHANNEL = re.compile(r'\bchannel_id=(\d+)')
_GROUPS_ANY = re.compile(r'replica_groups=')
_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')


class CollectiveCountWarning(UserWarning):
  """A collective count could not be determined exactly from the HLO."""


def group_size(line: str, default: int) -> int:
  """Devices per group of a collective (`replica_groups`); `default` where none is read."""
  groups = hlo.replica_groups(line, default)
  return len(groups[0]) if groups and groups[0] else default


def _network_split(kind: str, size: int, groups: list[list[int]], slices) -> tuple[float, float]:
  """(ICI, DCN) bytes one device sends for a collective whose groups hold devices of
  several slices, run hierarchically: the part inside a slice on ICI, and across slices only
  the 1/m-th each of the m devices of a slice in the group is left holding."""
  group = max(groups, key=len)
  members = collections.Counter(int(slices[d]) for d in group)
  s, m = len(members), min(members.values())
  n = len(group)
  if s <= 1:
    return _ring_bytes(kind, size, n), 0.0
  if kind in ('all-reduce', 'all-gather'):
    return _ring_bytes(kind, size, m), _ring_bytes(kind, size / m, s)
  if kind == 'reduce-scatter':
    return _ring_bytes(kind, size * s, m), _ring_bytes(kind, size, s)
  if kind == 'all-to-all':
    return size * (m - 1) / n, size * (n - m) / n
  return 0.0, float(size)


def _permute_split(line: str, size: int, slices) -> tuple[float, float] | None:
  """(ICI, DCN) bytes of a collective-permute: a pair whose ends lie in different slices
  crosses DCN; None when the line lists no pairs."""
  m = _PAIRS.search(line)
  if m is None:
    return None
  pairs = re.findall(r'\{(\d+),(\d+)\}', m.group(1))
  if any(slices[int(a)] != slices[int(b)] for a, b in pairs):
    return 0.0, float(size)
  return float(size), 0.0


def _megascale_bytes(kind: str, sent: int, s: int) -> tuple[int, float]:
  """(result bytes, ring bytes one device sends) of a collective over `s` slices that sends
  `sent` bytes from each device."""
  if kind == 'all-reduce':
    return sent, 2.0 * sent * (s - 1) / s
  if kind == 'all-gather':
    return sent * s, float(sent * (s - 1))
  if kind in ('reduce-scatter', 'all-to-all'):
    return sent // s if kind == 'reduce-scatter' else sent, sent * (s - 1) / s
  return sent, float(sent)


def _ring_bytes(kind: str, result_bytes: float, n: int) -> float:
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


def _result_type(kind: str, is_start: bool, type_str: str) -> str:
  """The type of what an op delivers (an async start also carries its operands)."""
  if not is_start:
    return type_str
  elements = hlo.tuple_elements(type_str)
  if kind == 'all-reduce' and not elements[0].startswith('('):
    # all-reduce-start's type is its results only (a tuple when variadic).
    return type_str
  # all-gather-start (operands, results); collective-permute-start (operand,
  # result, contexts); the generic async form ((operands), result, context).
  return elements[1] if len(elements) > 1 else type_str


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
    uncertain: why the counts are not exact, one line per cause (a loop whose
      trip count the HLO does not give is counted once; a conditional whose
      branches differ is counted as its costliest branch). Empty when exact.
    overlapped_ring_bytes: kind -> the ring bytes of collectives that run
      asynchronously with compute scheduled between their start and their
      done (XLA's `-start`/`-done` pairs, TPU's async collective fusions).
    dcn_ring_bytes: kind -> of `ring_bytes`, those that cross between TPU slices
      (the data-center network), when `count_collectives` was given the slices;
      a collective whose groups span slices is taken to run hierarchically.
    dcn_overlapped_ring_bytes: kind -> of those, the ones that overlap compute.
    dcn_gathers: the all-gathers that cross slices, one line each (count and
      result type): parameters gathered over DCN, which ZeRO need not do.
  """

  counts: dict[str, int]
  result_bytes: dict[str, int]
  ring_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
  uncertain: tuple[str, ...] = ()
  overlapped_ring_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
  dcn_ring_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
  dcn_overlapped_ring_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
  dcn_gathers: tuple[str, ...] = ()

  @property
  def total_dcn_bytes(self) -> float:
    return float(sum(self.dcn_ring_bytes.values()))

  @property
  def total_ici_bytes(self) -> float:
    return self.total_ring_bytes - self.total_dcn_bytes

  @property
  def overlap_fraction(self) -> float:
    """The share of ring bytes that overlaps compute (0 when nothing is moved)."""
    total = self.total_ring_bytes
    return float(sum(self.overlapped_ring_bytes.values())) / total if total else 0.0

  @property
  def exact(self) -> bool:
    """Whether every count was determined from the program."""
    return not self.uncertain

  @property
  def total_ring_bytes(self) -> float:
    return float(sum(self.ring_bytes.values()))

  def __getitem__(self, kind: str) -> int:
    return self.counts.get(kind, 0)


class _Tally:
  """Counts, result bytes and ring bytes by kind, accumulated over a walk."""

  def __init__(self):
    self.counts = collections.Counter()
    self.nbytes = collections.Counter()
    self.ring = collections.Counter()
    self.overlapped = collections.Counter()
    self.dcn = collections.Counter()
    self.dcn_overlapped = collections.Counter()
    self.dcn_gathers = collections.Counter()

  def add(self, other: _Tally, times: int = 1) -> None:
    for mine, theirs in zip(self._counters(), other._counters()):
      for k, v in theirs.items():
        mine[k] += times * v

  def _counters(self) -> tuple:
    names = ('counts', 'nbytes', 'ring', 'overlapped', 'dcn', 'dcn_overlapped', 'dcn_gathers')
    return tuple(vars(self)[name] for name in names)

  def key(self) -> tuple:
    return tuple(sorted(self.counts.items())), tuple(sorted(self.nbytes.items()))

  def weight(self) -> tuple:
    """The ring bytes, then the count, then which collectives (`hlo.Tally`)."""
    return (sum(self.ring.values()), sum(self.counts.values()), self.key())

  def counted(self) -> bool:
    return bool(self.counts)


def count_collectives(compiled_or_text: Any, slices: Any = None) -> CollectiveStats:
  """Counts the collectives in a compiled program's HLO, per executed step.

  Ops inside a `while` body count once per iteration (XLA's known_trip_count,
  or a condition `i < N` with a constant N and the loop's known start and
  step), so a scanned model is not undercounted. Asynchronous pairs count once
  (the `-start` op, with the bytes of the results it delivers), and so does a
  collective that the compiler copies into several fusions (one `channel_id`;
  TPU puts one in the async start, an overlapped matmul and the done). TPU's
  fused `all-reduce-scatter` counts as a reduce-scatter. One branch of a
  `conditional` runs per step: branches with the same collectives count once.

  Where the HLO does not determine a count (a loop with no known trip count,
  a conditional whose branches differ), `uncertain` says so and a
  `CollectiveCountWarning` is issued: such a loop is counted once per
  enclosing step (a lower bound), such a conditional as its costliest branch
  (an upper bound).

  Args:
    compiled_or_text: a `hlo.Program`, a `jax.stages.Compiled`, or its `as_text()`.
    slices: for a program over several TPU slices, each partition's slice (indexed by the
      partition ids the replica groups name: the mesh's devices in order); the bytes that
      cross between slices are then counted apart (`dcn_ring_bytes`). A collective whose
      groups cannot be read is counted on ICI and named in `uncertain`.

  Returns:
    A `CollectiveStats`.

  >>> import zerojax
  >>> stats = zerojax.inspect.count_collectives(
  ...     'ENTRY %main (p: f32[8]) -> f32[8] {\\n'
  ...     '  %p = f32[8]{0} parameter(0)\\n'
  ...     '  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add\\n'
  ...     '}')
  >>> stats['all-reduce'], stats.result_bytes['all-reduce'], stats.exact
  (1, 32, True)
  """
  program = hlo.as_program(compiled_or_text)
  counting = _Collectives(program, None if slices is None else np.asarray(slices).reshape(-1))
  total = program.walk(counting)
  for reason in counting.uncertain:
    warnings.warn(f'count_collectives: {reason}.', CollectiveCountWarning, stacklevel=2)
  return CollectiveStats(
    dict(total.counts),
    dict(total.nbytes),
    dict(total.ring),
    uncertain=tuple(counting.uncertain),
    overlapped_ring_bytes=dict(total.overlapped),
    dcn_ring_bytes=dict(total.dcn),
    dcn_overlapped_ring_bytes=dict(total.dcn_overlapped),
    dcn_gathers=tuple(f'{count} x {what}' for what, count in total.dcn_gathers.items()),
  )


class _Collectives:
  """`count_collectives` as an analysis of `hlo.Program.walk`: a `_Tally` per body."""

  counts = 'the collectives of its body are'
  differ = 'run different collectives'

  def __init__(self, program: hlo.Program, slices: Any = None):
    self.program = program
    self.slices = slices
    self.num_slices = 0 if slices is None else len(set(slices.tolist()))
    self.uncertain: list[str] = []
    self.seen_channels: set[str] = set()  # of the fused reduce-scatters counted so far
    self.default_group = program.num_partitions
    self.overlapping: dict[str, set[int]] = {}  # computation -> its overlapping async starts

  def tally(self) -> _Tally:
    return _Tally()

  def line(self, site: hlo.Site, tally: _Tally) -> bool:
    overlapped = self._overlapped(site)
    found = hlo.collective(site.line)
    if found is not None:
      fused = any(s.opcode == 'fusion' for s in site.callers())
      self.count_op(site.line, found, tally, fused, overlapped)
      return False
    between = hlo.slice_send(site.line)
    if between is not None:
      self.count_megascale(site.line, between, tally, overlapped)
      return False
    op = site.opcode
    # They name the computation that the async start already ran; TPU's continuation of an
    # async collective (the matmul it overlaps) is a copy of the collective its start counted.
    if op in ('async-update', 'async-done') or site.name.startswith('async-collective-done'):
      return False
    return not _ASYNC_COPY.search(site.line)

  def _overlapped(self, site: hlo.Site) -> bool:
    """Whether the collective at `site`, or the instruction that ran its computation (up to
    the nearest loop or branch), is an async start with compute scheduled before its done."""
    for s in (site, *site.callers()):
      if s is not site and s.opcode in ('while', 'conditional'):
        return False
      if s.computation not in self.overlapping:
        self.overlapping[s.computation] = _overlapping_starts(self.program.bodies[s.computation])
      if s.index in self.overlapping[s.computation]:
        return True
    return False

  def count_op(self, line: str, found, tally: _Tally, fused: bool, overlapped: bool) -> None:
    kind, is_start, type_str = found
    # Copies of one collective: TPU's async collectives are counted at their
    # start (their continuation fusions and dones are skipped in `line`); its
    # fused all-reduce-scatter appears as several fusions sharing one channel.
    # Other ops that share a channel are distinct (a shard_map's explicit
    # collectives all carry channel_id=1) and all count.
    if kind == 'reduce-scatter' and (fused or ' fusion(' in line):
      channel = _CHANNEL.search(line)
      if channel:
        if channel.group(1) in self.seen_channels:
          return
        self.seen_channels.add(channel.group(1))
    size = hlo.type_bytes(_result_type(kind, is_start, type_str))
    tally.counts[kind] += 1
    tally.nbytes[kind] += size
    with_groups = self._with_groups(line)
    groups = group_size(with_groups, self.default_group)
    ring, dcn = _ring_bytes(kind, size, groups), 0.0
    if self.slices is not None:
      ici, dcn = self._networks(kind, size, groups, with_groups)
      ring = ici + dcn
      if dcn and kind == 'all-gather':
        tally.dcn_gathers[_result_type(kind, is_start, type_str)] += 1
    tally.ring[kind] += ring
    tally.dcn[kind] += dcn
    if overlapped:
      tally.overlapped[kind] += ring
      tally.dcn_overlapped[kind] += dcn

  def count_megascale(self, line: str, found, tally: _Tally, overlapped: bool) -> None:
    """A collective between slices: all of its bytes cross the data-center network."""
    kind, sent_type = found
    s = self.num_slices
    if s < 2:
      reason = (
        f'a {kind} between TPU slices, but the number of slices was not given'
        ' (count_collectives(..., slices=...)); it is not counted'
      )
      if reason not in self.uncertain:
        self.uncertain.append(reason)
      return
    size, ring = _megascale_bytes(kind, hlo.type_bytes(sent_type), s)
    tally.counts[kind] += 1
    tally.nbytes[kind] += size
    tally.ring[kind] += ring
    tally.dcn[kind] += ring
    if kind == 'all-gather':
      tally.dcn_gathers[sent_type] += 1
    if overlapped:
      tally.overlapped[kind] += ring
      tally.dcn_overlapped[kind] += ring

  def _networks(self, kind: str, size: int, n: int, line: str) -> tuple[float, float]:
    """(ICI, DCN) bytes one device sends for one execution of the collective."""
    if kind == 'collective-permute':
      split = _permute_split(line, size, self.slices)
    else:
      groups = hlo.replica_groups(line, len(self.slices))
      split = None if groups is None else _network_split(kind, size, groups, self.slices)
    if split is None:
      reason = (
        f'the device groups of a {kind} are not in a form read here'
        f' ({line.strip()[:80]}...); its bytes are counted on ICI'
      )
      if reason not in self.uncertain:
        self.uncertain.append(reason)
      return _ring_bytes(kind, size, n), 0.0
    return split

  def _with_groups(self, line: str) -> str:
    """`line`, or for TPU's fused all-reduce-scatter (whose line names no
    replica groups) the line inside its computation that does."""
    if _GROUPS_ANY.search(line):
      return line
    for callee in hlo.callees(line):
      for inner in self.program.bodies.get(callee, ()):
        if _GROUPS_ANY.search(inner):
          return inner
    return line


def _is_start(instr: str, op: str) -> bool:
  return (
    op.endswith('-start')
    and op != 'copy-start'
    or op in ('send', 'recv')  # between TPU slices (see `_megascale`): done by send-/recv-done
    or instr.startswith('async-collective-start')
  )


def _is_done(instr: str, op: str) -> bool:
  return op.endswith('-done') and op != 'copy-done' or instr.startswith('async-collective-done')


def _overlapping_starts(lines: list[str]) -> set[int]:
  """Line indices of asynchronous collective starts with compute before their done.

  HLO text after scheduling lists a computation's instructions in execution
  order. A start is paired with the done that depends on it (through the
  operands, e.g. a TPU done reads the continuation fusion that reads the
  start); it overlaps compute when an instruction doing arithmetic (not a
  collective, not bookkeeping) is scheduled strictly between the two.
  """
  parsed = []
  for line in lines:
    instr, op = hlo.instruction_name(line), hlo.opcode(line)
    rest = line.split('=', 1)[1] if '=' in line else ''
    parsed.append((instr, op, set(hlo.operand_names(rest))))
  index = {instr: i for i, (instr, _, _) in enumerate(parsed) if instr}
  out = set()
  for i, (instr, op, _) in enumerate(parsed):
    if not _is_start(instr, op):
      continue
    for j in range(i + 1, len(parsed)):
      done_instr, done_op, _ = parsed[j]
      if not _is_done(done_instr, done_op) or not _depends_on(parsed, index, j, instr):
        continue
      between = parsed[i + 1 : j]
      if any(
        o not in hlo.BOOKKEEPING
        and not _is_start(n, o)
        and not _is_done(n, o)
        and o
        and hlo.collective(lines[i + 1 + k]) is None
        for k, (n, o, _) in enumerate(between)
      ):
        out.add(i)
      break
  return out


def _depends_on(parsed, index: dict[str, int], j: int, target: str) -> bool:
  """Whether instruction j reads `target`, directly or through earlier instructions."""
  seen, todo = set(), [j]
  while todo:
    k = todo.pop()
    for name in parsed[k][2]:
      if name == target:
        return True
      if name in index and name not in seen and index[name] < k:
        seen.add(name)
        todo.append(index[name])
  return False
