"""Reading compiled HLO text: the collectives a program runs and what they move.

A small reader of XLA's text format (computations, instructions, while-loop trip
counts, replica groups, asynchronous start/done pairs), enough to count each
collective the number of times it executes, the bytes it moves on a ring, and
how many of those bytes overlap compute. `report` builds on it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')

DTYPE_BYTES = {
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
# may be a (nested) tuple, so the opcode is found after it by `split_type`.
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$')
_OPCODE = re.compile(r'^\s*(?P<op>[\w\-]+)\(')
_COMMENT = re.compile(r'/\*.*?\*/')
_FUSED_RS = re.compile(r'fusion\(.*kind=kCustom.*calls=%?all-reduce-scatter')
SHAPE = re.compile(r'\b(' + '|'.join(DTYPE_BYTES) + r')\[([\d,]*)\]')
_CALLS = re.compile(r'\b(calls|to_apply)=%?([\w.\-]+)')
_BODY = re.compile(r'\bbody=%?([\w.\-]+)')
_CONDITION = re.compile(r'\bcondition=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRUE_FALSE = re.compile(r'\b(?:true_computation|false_computation)=%?([\w.\-]+)')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INIT_STEP = re.compile(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"\}')
_CONSTANT = re.compile(r'^\s*%?([\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\][^ ]*\s+constant\((-?\d+)\)')
_OPERANDS = re.compile(r'%([\w.\-]+)')
# Replica groups: explicit lists, iota form [groups,size]<=[...], or TPU's
# mesh['axis_0'=8, ...] {'axis_0'} form.
_GROUPS_ANY = re.compile(r'replica_groups=')
# (an optional `device_ids=(...)` permutation may sit between the two parts).
_PARTITIONS = re.compile(r'num_partitions=(\d+)')


_IOTA_FULL = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')
# TPU's mesh form: mesh['a'=4,'b'=2], an optional device_ids=([dims]T(perm)) iota, {'a'}.
_GROUPS_MESH = re.compile(r'replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}')
_DEVICE_IDS = re.compile(r'device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)')


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
  type_str = split_type(_INSTR.match(line).group('rest'))[0]
  return _MEGASCALE_KINDS.get(m.group(1), 'collective-permute'), tuple_elements(type_str)[0]


def split_type(rest: str) -> tuple[str, str]:
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


def tuple_elements(type_str: str) -> list[str]:
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


def _instructions(lines: list[str]) -> dict[str, tuple[str, list[str], str]]:
  """name -> (opcode, operand names, the whole line) for one computation."""
  out = {}
  for line in lines:
    m = _INSTR.match(line)
    if m is None:
      continue
    _, tail = split_type(m.group('rest'))
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


def type_bytes(type_str: str) -> int:
  """Bytes of an HLO type (a tuple's elements summed)."""
  total = 0
  for dtype, dims in SHAPE.findall(type_str):
    total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(',') if d] or [1]))
  return total


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
      self._types[name] = {m.group('name'): split_type(m.group('rest'))[0] for m in found if m}
    return self._types[name]

  def trip_count(self, line: str, where: str) -> int | None:
    """Iterations of the `while` on `line` (in computation `where`); None where the HLO does
    not determine them."""
    return _trip_count(line, where, self.bodies, self._instructions)

  def walk(self, analysis: Analysis[T], root: str | None = None) -> T:
    """`analysis` run over every instruction the program executes, from `root` (the entry).

    The one traversal every analysis of a program is written as. Each instruction line of a
    computation is shown to `analysis.line` in order; where it returns True the walk goes
    into what the line runs: a `while` body (into a fresh tally, added back its trip count of
    times, or once where the HLO does not determine it, which `analysis.uncertain` is told),
    each branch of a `conditional` (each into a fresh tally; one runs per step, so the
    costliest by `Tally.weight` is added back, and `analysis.uncertain` is told where they
    differ), or the computations any other line calls (`calls=`, `to_apply=`), into the same
    tally. The recursion rule: a computation already on the way down is not entered again.
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
      if trip is None and sub.counted() and analysis.counts:
        analysis.uncertain.append(
          f'while loop %{site.name} in %{site.computation} has no known trip count in the HLO;'
          f' {analysis.counts} counted once'
        )
      tally.add(sub, 1 if trip is None else trip)
    elif site.opcode == 'conditional':
      subs = []
      for branch in branches(site.line):
        subs.append(analysis.tally())
        self._walk(analysis, branch, site, site.trips, stack, subs[-1])
      if getattr(analysis, 'every_branch', False):  # what any branch holds, not what runs
        for sub in subs:
          tally.add(sub, 1)
        return
      weights = [sub.weight() for sub in subs]
      if len(set(weights)) > 1 and analysis.counts:
        analysis.uncertain.append(
          f'conditional %{site.name} in %{site.computation}: its {len(subs)} branches'
          f' {analysis.differ} and one runs per step; the costliest branch is counted'
        )
      if subs:
        tally.add(subs[weights.index(max(weights))], 1)
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


class Tally(Protocol):
  """What an analysis adds up over a walk: one per computation body, folded by `Program.walk`."""

  def add(self, other: Any, times: int) -> None:
    """Adds `other` (a loop body's or a branch's tally), `times` times."""
    ...

  def weight(self) -> Any:
    """What the costliest of a conditional's branches is chosen by (comparable, hashable)."""
    ...

  def counted(self) -> bool:
    """Whether anything was counted (a loop's unknown trip count then makes a count uncertain)."""
    ...


class Analysis(Protocol[T]):
  """What `Program.walk` runs: a `Tally` per computation body, and what each line adds to it.

  Attributes:
    uncertain: where the walk tells why a count is not exact (a loop with no known trip count,
      a conditional whose branches differ).
    counts: what a body's tally holds, as those lines name it ('its kernels are'); '' to say
      nothing (an analysis whose loops and branches are never entered, or that says its own).
    differ: how those lines say branches differ ('run different collectives').
    every_branch: (optional, default False) add every branch's tally, not the costliest's: for
      an analysis of what a program holds rather than what one step runs.
  """

  uncertain: list[str]
  counts: str
  differ: str

  def tally(self) -> T:
    """A fresh, empty tally."""
    ...

  def line(self, site: Site, tally: T) -> bool:
    """Adds what the instruction at `site` does to `tally`; True to enter what it runs."""
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
  return split_type(m.group('rest'))[0] if m else ''


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


def operand_names(text: str) -> list[str]:
  """The instruction names `text` (an instruction's operands, or a whole line) refers to."""
  return _OPERANDS.findall(text)


def parts(line: str) -> tuple[str, str, str] | None:
  """(name, result type, what follows the type: opcode, operands and attributes) of an
  instruction line; None for a line that defines no instruction."""
  m = _INSTR.match(line)
  if m is None:
    return None
  return (m.group('name'), *split_type(m.group('rest')))


def is_collective(line: str) -> bool:
  """Whether the line is a collective (`count_collectives` counts it)."""
  return collective(line) is not None


def slice_send(line: str) -> tuple[str, str] | None:
  """(collective kind, the type it sends) of a send between TPU slices, else None."""
  return _megascale(line)


def as_program(compiled_or_text: Any) -> Program:
  """A `Program`: as it is, or parsed from a `jax.stages.Compiled` or its HLO text."""
  if isinstance(compiled_or_text, Program):
    return compiled_or_text
  if isinstance(compiled_or_text, str):
    return Program.parse(compiled_or_text)
  return Program.parse(compiled_or_text.as_text())


def collective(line: str) -> tuple[str, bool, str] | None:
  """(kind, is an async start, type) of a collective instruction, else None."""
  m = _INSTR.match(line)
  if m is None:
    return None
  type_str, tail = split_type(m.group('rest'))
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
  op = _OPCODE.match(split_type(m.group('rest'))[1])
  return m.group('name'), op.group('op') if op else ''


# Instructions that do no arithmetic of their own.
BOOKKEEPING = frozenset(
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
