"""Reading compiled HLO text: the collectives a program runs and what they move.

A small reader of XLA's text format (computations, instructions, while-loop trip
counts, replica groups, asynchronous start/done pairs), enough to count each
collective the number of times it executes, the bytes it moves on a ring, and
how many of those bytes overlap compute. `report` builds on it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

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
# One instruction: `[ROOT] %name = TYPE opcode(operands), attributes`. The type
# may be a (nested) tuple, so the opcode is found after it by `_split_type`.
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$')
_OPCODE = re.compile(r'^\s*(?P<op>[\w\-]+)\(')
_COMMENT = re.compile(r'/\*.*?\*/')
_FUSED_RS = re.compile(r'fusion\(.*kind=kCustom.*calls=%?all-reduce-scatter')
_SHAPE = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\]')
_CALLS = re.compile(r'\b(calls|to_apply)=%?([\w.\-]+)')
_BODY = re.compile(r'\bbody=%?([\w.\-]+)')
_CONDITION = re.compile(r'\bcondition=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRUE_FALSE = re.compile(r'\b(?:true_computation|false_computation)=%?([\w.\-]+)')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INIT_STEP = re.compile(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"\}')
_CONSTANT = re.compile(r'^\s*%?([\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\][^ ]*\s+constant\((-?\d+)\)')
_OPERANDS = re.compile(r'%([\w.\-]+)')
_ASYNC_COPY = re.compile(r'\bcalls=%?async_collective_fusion')
# Replica groups: explicit lists, iota form [groups,size]<=[...], or TPU's
# mesh['axis_0'=8, ...] {'axis_0'} form.
_GROUPS_ANY = re.compile(r'replica_groups=')
# (an optional `device_ids=(...)` permutation may sit between the two parts).
_PARTITIONS = re.compile(r'num_partitions=(\d+)')
_CHANNEL = re.compile(r'\bchannel_id=(\d+)')


class CollectiveCountWarning(UserWarning):
  """A collective count could not be determined exactly from the HLO."""


def _group_size(line: str, default: int) -> int:
  """Devices per group of a collective (`replica_groups`); `default` where none is read."""
  groups = replica_groups(line, default)
  return len(groups[0]) if groups and groups[0] else default


_IOTA_FULL = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')
# TPU's mesh form: mesh['a'=4,'b'=2], an optional device_ids=([dims]T(perm)) iota, {'a'}.
_GROUPS_MESH = re.compile(r'replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}')
_DEVICE_IDS = re.compile(r'device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)')
_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')


def replica_groups(line: str, n: int) -> list[list[int]] | None:
  """The device groups of a collective (partition ids), from its `replica_groups` (a list,
  the iota form [G,S]<=[dims]T(perm), or TPU's mesh[...] form), or None where the form is
  not one of these. No groups, or `replica_groups={}`, is one group of all `n`."""
  m = re.search(r'replica_groups=\{(\{[\d,{} ]*\})?\}', line)
  if m:
    if not m.group(1):
      return [list(range(n))]
    return [[int(v) for v in g.split(',') if v] for g in re.findall(r'\{([\d,]*)\}', m.group(1))]
  m = _IOTA_FULL.search(line)
  if m:
    count, size = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(',')]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(',')])
    return ids.reshape(count, size).tolist()
  m = _GROUPS_MESH.search(line)
  if m:
    sizes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    names = [k for k, _ in sizes]
    shape = [v for _, v in sizes]
    ids = np.arange(int(np.prod(shape)))
    device_ids = _DEVICE_IDS.search(m.group(2))
    if device_ids:
      ids = ids.reshape([int(d) for d in device_ids.group(1).split(',')])
      if device_ids.group(2):
        ids = ids.transpose([int(p) for p in device_ids.group(2).split(',')])
    ids = ids.reshape(shape)
    over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3)) if a in names]
    rest = [i for i in range(len(shape)) if i not in over]
    size = int(np.prod([shape[i] for i in over])) if over else 1
    return ids.transpose(rest + over).reshape(-1, size).tolist()
  if _GROUPS_ANY.search(line):
    return None
  return [list(range(n))]


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


# A collective between TPU slices, as the TPU compiler emits it for the runtime that carries it
# over the data-center network: a `send` to that runtime, of the kind it names.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {
  'ALL_REDUCE': 'all-reduce',
  'ALL_GATHER': 'all-gather',
  'REDUCE_SCATTER': 'reduce-scatter',
  'ALL_TO_ALL': 'all-to-all',
}


def _megascale(line: str) -> tuple[str, str] | None:
  """(kind, the type it sends) of a collective between slices (a megascale `send`), else None."""
  m = _MEGASCALE.search(line)
  if m is None:
    return None
  if _opcode(line)[1] != 'send':
    return None
  type_str = _split_type(_INSTR.match(line).group('rest'))[0]
  return _MEGASCALE_KINDS.get(m.group(1), 'collective-permute'), _tuple_elements(type_str)[0]


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


def _split_type(rest: str) -> tuple[str, str]:
  """Splits `TYPE opcode(...)...` into the type and what follows it."""
  rest = rest.lstrip()
  if not rest.startswith('('):
    head, _, tail = rest.partition(' ')
    return head, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch in '([{'
    depth -= ch in ')]}'
    if depth == 0:
      return rest[: i + 1], rest[i + 1 :]
  return rest, ''


def _tuple_elements(type_str: str) -> list[str]:
  """The top-level elements of a tuple type (or [type_str] for an array type)."""
  type_str = type_str.strip()
  if not type_str.startswith('('):
    return [type_str]
  out, depth, current = [], 0, ''
  for ch in type_str[1:-1]:
    if ch == ',' and depth == 0:
      out.append(current.strip())
      current = ''
      continue
    depth += ch in '([{'
    depth -= ch in ')]}'
    current += ch
  if current.strip():
    out.append(current.strip())
  return out


def _result_type(kind: str, is_start: bool, type_str: str) -> str:
  """The type of what an op delivers (an async start also carries its operands)."""
  if not is_start:
    return type_str
  elements = _tuple_elements(type_str)
  if kind == 'all-reduce' and not elements[0].startswith('('):
    # all-reduce-start's type is its results only (a tuple when variadic).
    return type_str
  # all-gather-start (operands, results); collective-permute-start (operand,
  # result, contexts); the generic async form ((operands), result, context).
  return elements[1] if len(elements) > 1 else type_str


def _instructions(lines: list[str]) -> dict[str, tuple[str, list[str], str]]:
  """name -> (opcode, operand names, the whole line) for one computation."""
  out = {}
  for line in lines:
    m = _INSTR.match(line)
    if m is None:
      continue
    _, tail = _split_type(m.group('rest'))
    op = _OPCODE.match(tail)
    if op is None:
      continue
    depth, end = 0, len(tail)
    for i, ch in enumerate(tail):
      depth += ch == '('
      depth -= ch == ')'
      if ch == ')' and depth == 0:
        end = i
        break
    out[m.group('name')] = (op.group('op'), _OPERANDS.findall(tail[: end + 1]), line)
  return out


def _parsed(bodies: dict[str, list[str]], name: str, memo: dict) -> dict:
  """`_instructions` of computation `name`, parsed once per `memo` (a `Program` keeps one)."""
  if name not in memo:
    memo[name] = _instructions(bodies.get(name, []))
  return memo[name]


_PASS_THROUGH = ('copy', 'bitcast', 'convert')
_INDEX = re.compile(r'\bindex=(\d+)')


def _through(instrs: dict, name: str) -> str:
  """`name`, followed back through copies and bitcasts."""
  seen = set()
  while name in instrs and instrs[name][0] in _PASS_THROUGH and name not in seen:
    seen.add(name)
    name = instrs[name][1][0]
  return name


def _int_constant(instrs: dict, name: str) -> int | None:
  name = _through(instrs, name)
  if name in instrs and instrs[name][0] == 'constant':
    c = _CONSTANT.match(instrs[name][2])
    return int(c.group(2)) if c else None
  return None


def _tuple_index(instrs: dict, name: str) -> int | None:
  """k when `name` is element k of the computation's parameter tuple."""
  name = _through(instrs, name)
  if name in instrs and instrs[name][0] == 'get-tuple-element':
    source = _through(instrs, instrs[name][1][0])
    if source in instrs and instrs[source][0] == 'parameter':
      m = _INDEX.search(instrs[name][2])
      return int(m.group(1)) if m else None
  return None


def _compare_lt(instrs: dict, root: str, bodies: dict, memo: dict) -> tuple[str, str] | None:
  """The operands (i, N) of a root `compare(i, N), direction=LT`, directly or in a fusion."""
  op, operands, line = instrs[root]
  if op == 'compare' and 'direction=LT' in line and len(operands) == 2:
    return operands[0], operands[1]
  callee = _CALLS.search(line)
  if op == 'fusion' and callee and callee.group(2) in bodies:
    inner = _parsed(bodies, callee.group(2), memo)
    inner_root = next((n for n, v in inner.items() if v[2].lstrip().startswith('ROOT')), None)
    if inner_root is None:
      return None
    iop, iargs, iline = inner[inner_root]
    if iop == 'compare' and 'direction=LT' in iline and len(iargs) == 2:
      params = {}
      for n, (o, _, pline) in inner.items():
        m = re.search(r'parameter\((\d+)\)', pline)
        if o == 'parameter' and m:
          params[n] = int(m.group(1))
      if iargs[0] in params and iargs[1] in params:
        return operands[params[iargs[0]]], operands[params[iargs[1]]]
  return None


def _trip_count(line: str, where: str, bodies: dict[str, list[str]], memo: dict) -> int | None:
  """Iterations of the `while` on `line` (in computation `where`), or None if undetermined.

  XLA's `known_trip_count` when present (XLA:CPU writes it). Otherwise the
  loop must read as `for i = C; i < N; i += S` with constants C, N and S: the
  condition's root compares tuple element k with a constant, the loop's
  initial tuple holds a constant at k, and the body's result holds
  `element k + constant` at k (the TPU compiler's form). Nothing else is
  assumed.
  """
  m = _TRIP.search(line)
  if m:
    return int(m.group(1))
  cond, body = _CONDITION.search(line), _BODY.search(line)
  if not (cond and body and cond.group(1) in bodies and body.group(1) in bodies):
    return None
  cond_instrs = _parsed(bodies, cond.group(1), memo)
  root = next((n for n, v in cond_instrs.items() if v[2].lstrip().startswith('ROOT')), None)
  compared = _compare_lt(cond_instrs, root, bodies, memo) if root else None
  if compared is None:
    return None
  k, limit = _tuple_index(cond_instrs, compared[0]), _int_constant(cond_instrs, compared[1])
  if k is None or limit is None:
    return None
  init_step = _INIT_STEP.search(line)
  outer = _parsed(bodies, where, memo)
  init = None
  if init_step:
    init, step = int(init_step.group(1)), int(init_step.group(2))
  else:
    # The initial value: element k of the while's operand tuple.
    this = _INSTR.match(line).group('name')
    operand = _through(outer, outer[this][1][0]) if this in outer and outer[this][1] else None
    if operand in outer and outer[operand][0] == 'tuple' and k < len(outer[operand][1]):
      init = _int_constant(outer, outer[operand][1][k])
    # The step: element k of the body's result is `element k + S`.
    body_instrs = _parsed(bodies, body.group(1), memo)
    broot = next((n for n, v in body_instrs.items() if v[2].lstrip().startswith('ROOT')), None)
    step = None
    if broot and body_instrs[broot][0] == 'tuple' and k < len(body_instrs[broot][1]):
      new = _through(body_instrs, body_instrs[broot][1][k])
      if new in body_instrs and body_instrs[new][0] == 'add' and len(body_instrs[new][1]) == 2:
        a, b = body_instrs[new][1]
        for i_arg, c_arg in ((a, b), (b, a)):
          if _tuple_index(body_instrs, i_arg) == k and _int_constant(body_instrs, c_arg):
            step = _int_constant(body_instrs, c_arg)
    if init is None or step is None:
      return None
  if step <= 0:
    return None
  return max(0, -(-(limit - init) // step))


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

  def add(self, other: _Tally, mult: int = 1) -> None:
    for name in ('counts', 'nbytes', 'ring', 'overlapped', 'dcn', 'dcn_overlapped', 'dcn_gathers'):
      dst = getattr(self, name)
      for k, v in getattr(other, name).items():
        dst[k] += mult * v

  def key(self) -> tuple:
    return tuple(sorted(self.counts.items())), tuple(sorted(self.nbytes.items()))


def _parse_computations(text: str) -> tuple[dict[str, list[str]], str]:
  """Computation name -> its instruction lines (comments dropped), and the entry's name."""
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
        bodies[current].append(_COMMENT.sub('', line))
  if entry is None:
    raise ValueError('no ENTRY computation found in the HLO text')
  return bodies, entry


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """One compiled program's optimized HLO, read once: what every analysis of it walks.

  `count_collectives`, `count_host_transfers`, `largest_arrays` and `cost.program_cost` each
  take a `Program` (or, reading it then, a `jax.stages.Compiled` or its `as_text()`); a plan
  parses its program once and hands the same object to all of them.

  Attributes:
    text: the HLO text.
    bodies: computation name -> its instruction lines (comments dropped).
    entry: the entry computation's name.
  """

  text: str
  bodies: dict[str, list[str]]
  entry: str
  # Each computation's instructions and result types, read from its lines the first time they
  # are asked for.
  _instructions: dict = dataclasses.field(default_factory=dict, repr=False)
  _types: dict = dataclasses.field(default_factory=dict, repr=False)

  @classmethod
  def parse(cls, text: str) -> Program:
    bodies, entry = _parse_computations(text)
    return cls(text, bodies, entry)

  def instructions(self, name: str) -> dict[str, tuple[str, list[str], str]]:
    """Instruction name -> (opcode, operand names, its line) of computation `name`."""
    return _parsed(self.bodies, name, self._instructions)

  def result_types(self, name: str) -> dict[str, str]:
    """Instruction name -> its result type, for computation `name`."""
    if name not in self._types:
      found = (_INSTR.match(line) for line in self.bodies.get(name, []))
      self._types[name] = {m.group('name'): _split_type(m.group('rest'))[0] for m in found if m}
    return self._types[name]

  def trip_count(self, line: str, where: str) -> int | None:
    """Iterations of the `while` on `line` (in computation `where`); None where the HLO does
    not determine them."""
    return _trip_count(line, where, self.bodies, self._instructions)

  def walk(self, analysis: Analysis[T], root: str | None = None) -> T:
    """`analysis` run over every instruction the program executes, from `root` (the entry).

    The one traversal every analysis of a program is written as. Each instruction line of a
    computation is shown to `analysis.line` in order; where it returns True the walk goes
    into what the line runs: a `while` body (into a fresh tally, folded back by
    `analysis.loop` with the loop's trip count), each branch of a `conditional` (each into a
    fresh tally, folded back by `analysis.branches`: one runs per step), or the computations
    any other line calls (`calls=`, `to_apply=`), into the same tally. The recursion rule: a
    computation already on the way down is not entered again.
    """
    tally = analysis.tally()
    self._walk(analysis, root or self.entry, None, None, (), tally)
    return tally

  def walk_site(self, analysis: Analysis[T], site: Site) -> T:
    """`analysis` over one instruction and what it runs, as `walk` meets it at `site`."""
    tally = analysis.tally()
    stack = tuple(s.computation for s in site.callers())[::-1] + (site.computation,)
    self._step(analysis, site, stack, tally)
    return tally

  def _walk(self, analysis, name: str, caller, trips, stack: tuple, tally) -> None:
    if name in stack or name not in self.bodies:
      return
    inner = stack + (name,)
    for i, line in enumerate(self.bodies[name]):
      instr, op = _opcode(line)
      self._step(analysis, Site(self, name, i, line, instr, op, trips, caller), inner, tally)

  def _step(self, analysis, site: Site, stack: tuple, tally) -> None:
    if not analysis.line(site, tally):
      return
    if site.opcode == 'while':
      body, trip = loop_body(site.line), self.trip_count(site.line, site.computation)
      sub = analysis.tally()
      if body:
        self._walk(analysis, body, site, trip or 0, stack, sub)
      analysis.loop(site, trip, sub, tally)
    elif site.opcode == 'conditional':
      subs = []
      for branch in branches(site.line):
        subs.append(analysis.tally())
        self._walk(analysis, branch, site, site.trips, stack, subs[-1])
      analysis.branches(site, subs, tally)
    else:
      for callee in callees(site.line):
        self._walk(analysis, callee, site, site.trips, stack, tally)

  @property
  def num_partitions(self) -> int:
    """The program's partition count (1 where the module does not say)."""
    found = _PARTITIONS.search(self.text)
    return int(found.group(1)) if found else 1

  @property
  def crosses_slices(self) -> bool:
    """Whether the program sends anything between TPU slices (megascale transfers)."""
    return _MEGASCALE.search(self.text) is not None


T = TypeVar('T')


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
  """One instruction where `Program.walk` meets it, and how the walk got there.

  Attributes:
    program: the program walked.
    computation: the computation the line is in.
    index: the line's place in it (execution order, in a scheduled program).
    line: the instruction's HLO line.
    name: the instruction it defines ('' for a line that defines none).
    opcode: its opcode ('' for a line with none).
    trips: the trip count of the innermost loop around it: None outside any loop, 0 where
      the HLO does not give it.
    caller: the instruction that ran this computation (a `while`, a `conditional`, a call,
      a fusion...), None in the walk's root.
  """

  program: Program
  computation: str
  index: int
  line: str
  name: str
  opcode: str
  trips: int | None
  caller: Site | None

  def callers(self) -> Iterator[Site]:
    """The instructions that ran this one's computation, the nearest first."""
    site = self.caller
    while site is not None:
      yield site
      site = site.caller


class Analysis(Protocol[T]):
  """What `Program.walk` runs: a tally per computation body, and how bodies fold."""

  def tally(self) -> T:
    """A fresh, empty tally."""
    ...

  def line(self, site: Site, tally: T) -> bool:
    """Adds what the instruction at `site` does to `tally`; True to enter what it runs."""
    ...

  def loop(self, site: Site, trip: int | None, body: T, into: T) -> None:
    """Folds a `while` body's tally into `into`: it runs `trip` times (None: unknown)."""
    ...

  def branches(self, site: Site, subs: list[T], into: T) -> None:
    """Folds a `conditional`'s branch tallies into `into`: one of them runs."""
    ...


# What one HLO line says, for the analyses of a `Program` outside this module.


def instruction_name(line: str) -> str:
  """The name an instruction line defines ('' for a line that defines none)."""
  m = _INSTR.match(line)
  return m.group('name') if m else ''


def opcode(line: str) -> str:
  """The opcode of an instruction line ('' for a line with none)."""
  return _opcode(line)[1]


def result_type(line: str) -> str:
  """The type an instruction line's result has ('' for a line that defines none)."""
  m = _INSTR.match(line)
  return _split_type(m.group('rest'))[0] if m else ''


def callees(line: str) -> list[str]:
  """The computations an instruction calls (`calls=`, `to_apply=`)."""
  return [name for _, name in _CALLS.findall(line)]


def loop_body(line: str) -> str | None:
  """The body computation of a `while` line."""
  m = _BODY.search(line)
  return m.group(1) if m else None


def branches(line: str) -> list[str]:
  """The branch computations of a `conditional` line."""
  found = _BRANCHES.search(line)
  if found:
    return [b.strip().lstrip('%') for b in found.group(1).split(',')]
  return _TRUE_FALSE.findall(line)


def is_collective(line: str) -> bool:
  """Whether the line is a collective (`count_collectives` counts it)."""
  return _collective(line) is not None


def slice_send(line: str) -> tuple[str, str] | None:
  """(collective kind, the type it sends) of a send between TPU slices, else None."""
  return _megascale(line)


def type_bytes(type_str: str) -> int:
  """Bytes of an HLO type (a tuple's elements summed)."""
  return _type_bytes(type_str)


def as_program(compiled_or_text: Any) -> Program:
  """A `Program`: as it is, or parsed from a `jax.stages.Compiled` or its HLO text."""
  if isinstance(compiled_or_text, Program):
    return compiled_or_text
  if isinstance(compiled_or_text, str):
    return Program.parse(compiled_or_text)
  return Program.parse(compiled_or_text.as_text())


def _collective(line: str) -> tuple[str, bool, str] | None:
  """(kind, is an async start, type) of a collective instruction, else None."""
  m = _INSTR.match(line)
  if m is None:
    return None
  type_str, tail = _split_type(m.group('rest'))
  if _FUSED_RS.match(tail.lstrip()):
    return 'reduce-scatter', False, type_str
  op = _OPCODE.match(tail)
  if op is None:
    return None
  name = op.group('op')
  for kind in COLLECTIVES:
    if name == kind:
      return kind, False, type_str
    if name == kind + '-start':
      return kind, True, type_str
  return None


def _opcode(line: str) -> tuple[str, str]:
  """(instruction name, opcode) of an HLO line, or ('', '')."""
  m = _INSTR.match(line)
  if m is None:
    return '', ''
  op = _OPCODE.match(_split_type(m.group('rest'))[1])
  return m.group('name'), op.group('op') if op else ''


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
    compiled_or_text: a `Program`, a `jax.stages.Compiled`, or its `as_text()`.
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
  program = as_program(compiled_or_text)
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
  """`count_collectives` as an analysis of `Program.walk`: a `_Tally` per body."""

  def __init__(self, program: Program, slices: Any = None):
    self.program = program
    self.slices = slices
    self.num_slices = 0 if slices is None else len(set(slices.tolist()))
    self.uncertain: list[str] = []
    self.seen_channels: set[str] = set()  # of the fused reduce-scatters counted so far
    self.default_group = program.num_partitions
    self.overlapping: dict[str, set[int]] = {}  # computation -> its overlapping async starts

  def tally(self) -> _Tally:
    return _Tally()

  def line(self, site: Site, tally: _Tally) -> bool:
    overlapped = self._overlapped(site)
    found = _collective(site.line)
    if found is not None:
      fused = any(s.opcode == 'fusion' for s in site.callers())
      self.count_op(site.line, found, tally, fused, overlapped)
      return False
    between = _megascale(site.line)
    if between is not None:
      self.count_megascale(site.line, between, tally, overlapped)
      return False
    op = site.opcode
    # They name the computation that the async start already ran; TPU's continuation of an
    # async collective (the matmul it overlaps) is a copy of the collective its start counted.
    if op in ('async-update', 'async-done') or site.name.startswith('async-collective-done'):
      return False
    return not _ASYNC_COPY.search(site.line)

  def loop(self, site: Site, trip: int | None, body: _Tally, into: _Tally) -> None:
    if trip is None and body.counts:
      self.uncertain.append(
        f'while loop %{site.name} in %{site.computation} has no known trip count in the HLO;'
        ' the collectives of its body are counted once'
      )
    into.add(body, 1 if trip is None else trip)

  def branches(self, site: Site, subs: list[_Tally], into: _Tally) -> None:
    if len({s.key() for s in subs}) > 1:
      self.uncertain.append(
        f'conditional %{site.name} in %{site.computation}: its {len(subs)} branches run'
        ' different collectives and one runs per step; the costliest branch is counted'
      )
    if subs:
      into.add(max(subs, key=lambda s: (sum(s.ring.values()), sum(s.counts.values()))))

  def _overlapped(self, site: Site) -> bool:
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
    size = _type_bytes(_result_type(kind, is_start, type_str))
    tally.counts[kind] += 1
    tally.nbytes[kind] += size
    with_groups = self._with_groups(line)
    groups = _group_size(with_groups, self.default_group)
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
    size, ring = _megascale_bytes(kind, _type_bytes(sent_type), s)
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
      groups = replica_groups(line, len(self.slices))
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
    for _, callee in _CALLS.findall(line):
      for inner in self.program.bodies.get(callee, ()):
        if _GROUPS_ANY.search(inner):
          return inner
    return line


# Instructions that do no arithmetic of their own.
_BOOKKEEPING = frozenset(
  {
    'get-tuple-element',
    'tuple',
    'bitcast',
    'parameter',
    'constant',
    'copy',
    'copy-start',
    'copy-done',
    'reshape',
    'after-all',
  }
)


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
    instr, op = _opcode(line)
    rest = line.split('=', 1)[1] if '=' in line else ''
    parsed.append((instr, op, set(_OPERANDS.findall(rest))))
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
        o not in _BOOKKEEPING
        and not _is_start(n, o)
        and not _is_done(n, o)
        and o
        and _collective(lines[i + 1 + k]) is None
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


# -- host transfers ---------------------------------------------------------------------------

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
  m = _INSTR.match(line)
  if m is None or not _HOST_SPACE.search(line):
    return None
  type_str, tail = _split_type(m.group('rest'))
  op = _OPCODE.match(tail)
  if op is None or op.group('op') not in _TRANSFERS:
    return None
  kind = op.group('op')
  parts = _tuple_elements(type_str) if type_str.startswith('(') else [type_str]
  if kind == 'copy-start' and len(parts) >= 2:
    dest, src = parts[0], parts[1]
  elif kind == 'copy':
    dest, src = type_str, ''
    operand = _OPERANDS.search(tail)
    return ('to_host', _type_bytes(dest)) if operand and _HOST_SPACE.search(dest) else None
  elif kind == 'dynamic-update-slice-start' and len(parts) >= 2:
    buffer, update = _tuple_elements(parts[0])[:2] if parts[0].startswith('(') else parts[:2]
    if _HOST_SPACE.search(buffer) and not _HOST_SPACE.search(update):
      return 'to_host', _type_bytes(update)
    return None
  elif kind == 'dynamic-slice-start' and len(parts) >= 2:
    source = _tuple_elements(parts[0])[0] if parts[0].startswith('(') else parts[0]
    result = parts[1]
    if _HOST_SPACE.search(source) and not _HOST_SPACE.search(result):
      return 'to_device', _type_bytes(result)
    return None
  else:
    return None
  dest_host, src_host = bool(_HOST_SPACE.search(dest)), bool(_HOST_SPACE.search(src))
  if dest_host == src_host:
    return None
  return ('to_host' if dest_host else 'to_device'), _type_bytes(dest)


_ARRAY_LAYOUT = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\](\{[^}]*\})?')


def _host_execute(line: str) -> list[tuple[str, int]]:
  """The transfers a host computation (`HostExecute`) makes across the host link.

  Its start's type is ((operands...), results, context). The host reads an
  operand left in device memory (no `S(5)` in its layout) over the link, and
  writes a result placed in device memory over it: the TPU compiler keeps a
  host computation's results there unless they leave the program in host
  memory. One entry per array, as ('to_host' or 'to_device', bytes).
  """
  m = _INSTR.match(line)
  if m is None or 'custom_call_target="HostExecute"' not in line or 'call-start' not in line:
    return []
  type_str, _ = _split_type(m.group('rest'))
  parts = _tuple_elements(type_str) if type_str.startswith('(') else []
  if len(parts) < 2:
    return []
  out = []
  for direction, part in (('to_host', parts[0]), ('to_device', parts[1])):
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(part):
      if not _HOST_SPACE.search(layout or ''):
        out.append((direction, _type_bytes(f'{dtype}[{dims}]')))
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
    compiled_or_text: a `Program`, a `jax.stages.Compiled`, or its `as_text()`.

  Returns:
    A `HostTransfers`.
  """
  program = as_program(compiled_or_text)
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
    setattr(self, direction, getattr(self, direction) + size)
    largest = f'largest_{direction}'
    setattr(self, largest, max(getattr(self, largest), size))
    self.in_loops += size if in_loop else 0
    self.overlapped += size if overlapped else 0

  def add(self, other: _HostTally, mult: int) -> None:
    for name in ('to_host', 'to_device', 'in_loops', 'overlapped', 'host_computations'):
      setattr(self, name, getattr(self, name) + mult * getattr(other, name))
    self.largest_to_host = max(self.largest_to_host, other.largest_to_host)
    self.largest_to_device = max(self.largest_to_device, other.largest_to_device)


class _HostLink:
  """`count_host_transfers` as an analysis of `Program.walk`."""

  def __init__(self, program: Program):
    self.program = program
    self.uncertain: list[str] = []
    self.overlapping: dict[str, set[int]] = {}  # computation -> its overlapped transfers

  def tally(self) -> _HostTally:
    return _HostTally()

  def line(self, site: Site, tally: _HostTally) -> bool:
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

  def loop(self, site: Site, trip: int | None, body: _HostTally, into: _HostTally) -> None:
    if trip is None:
      self.uncertain.append(f'while loop %{site.name} in %{site.computation}')
    into.add(body, trip or 1)

  def branches(self, site: Site, subs: list[_HostTally], into: _HostTally) -> None:
    moved = [s.to_host + s.to_device for s in subs]
    if len(set(moved)) > 1:
      self.uncertain.append(
        f'conditional %{site.name} in %{site.computation}: its branches move different bytes'
        ' and one runs per step; the branch that moves most is counted'
      )
    if subs:
      into.add(subs[moved.index(max(moved))], 1)


def _overlapping_copies(lines: list[str]) -> set[int]:
  """Line indices of asynchronous host transfers with arithmetic scheduled before their done."""
  out = set()
  starts = {}
  for i, line in enumerate(lines):
    instr, op = _opcode(line)
    if op.endswith('-start') and _HOST_SPACE.search(line):
      starts[instr] = (i, False)
      continue
    if op.endswith('-done'):
      for name in _OPERANDS.findall(line.split('=', 1)[1] if '=' in line else ''):
        if name in starts:
          j, busy = starts.pop(name)
          if busy:
            out.add(j)
      continue
    if op and op not in _BOOKKEEPING and _collective(line) is None:
      starts = {k: (j, True) for k, (j, _) in starts.items()}
  return out


# -- where the memory goes ------------------------------------------------------------------

_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_SOURCE = re.compile(r'\bsource_file="([^"]*)"\s+source_line=(\d+)')
_NOT_ARRAYS = _BOOKKEEPING | {'while', 'conditional', 'call', 'dynamic-slice', 'slice'}


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
  program = as_program(compiled_or_text)
  found = program.walk(_Arrays(program))
  found.sort(key=lambda a: -a.nbytes)
  return found if count is None else found[:count]


class _Arrays:
  """`largest_arrays` as an analysis of `Program.walk`: the arrays of the computations run at
  the top level (the entry, loop bodies, branches, calls), each computation read once."""

  _MATERIALISED = ('while', 'conditional', 'call')

  def __init__(self, program: Program):
    self.program = program
    self.read: dict[str, Site | None] = {}  # computation -> the call that lists its arrays

  def tally(self) -> list[ProgramArray]:
    return []

  def line(self, site: Site, tally: list[ProgramArray]) -> bool:
    # A computation reached again (another call of it) is not listed twice.
    if self.read.setdefault(site.computation, site.caller) is not site.caller:
      return False
    op = site.opcode
    if op in self._MATERIALISED:
      return True
    if not op or op in _NOT_ARRAYS or op.endswith(('-start', '-done', '-update')):
      return False
    tally.extend(
      _program_arrays(site.line, op, site.trips, _slice_updated(site.line, op, self.program.bodies))
    )
    return False

  def loop(self, site: Site, trip: int | None, body: list, into: list) -> None:
    into.extend(body)

  def branches(self, site: Site, subs: list[list], into: list) -> None:
    for sub in subs:
      into.extend(sub)


def _slice_updated(line: str, op: str, bodies: dict[str, list[str]]) -> set[str]:
  """Shapes ('2,64,256') of the buffers the instruction writes one slice into: its own if it
  is a dynamic-update-slice, those of the dynamic-update-slices inside it if it is a fusion
  (how a loop stacks one value per iteration; a fusion may convert the result's dtype)."""
  if op == 'dynamic-update-slice':
    lines = [line]
  elif op == 'fusion' and _CALLS.search(line):
    lines = bodies.get(_CALLS.search(line).group(2), [])
  else:
    return set()
  out = set()
  for x in lines:
    if _opcode(x)[1] == 'dynamic-update-slice':
      found = _SHAPE.search(_split_type(_INSTR.match(x).group('rest'))[0])
      if found:
        out.add(found.group(2))
  return out


def _program_arrays(
  line: str, op: str, trips: int | None, slice_updated: set[str]
) -> list[ProgramArray]:
  """The arrays one instruction makes: one, or one per element of a tuple result."""
  type_str, _ = _split_type(_INSTR.match(line).group('rest'))
  name = _OP_NAME.search(line)
  source = '/'.join(name.group(1).split('/')[-2:]) if name else ''
  where = _SOURCE.search(line)
  if where:
    source += f' ({where.group(1).rsplit("/", 1)[-1]}:{where.group(2)})'
  out = []
  for dtype, shape in _SHAPE.findall(type_str):
    dims = [int(d) for d in shape.split(',') if d]
    out.append(
      ProgramArray(
        nbytes=_DTYPE_BYTES[dtype] * int(np.prod(dims or [1])),
        type=f'{dtype}[{shape}]',
        opcode=op,
        source=source,
        loop_trips=trips,
        stacked=bool(trips) and bool(dims) and dims[0] == trips and shape in slice_updated,
      )
    )
  return out
