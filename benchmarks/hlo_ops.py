"""How many times a compiled program executes each kind of instruction per step.

Written for the benchmark, independently of zerojax's own HLO reader, so that
the two can check each other: an instruction inside a `while` body counts once
per iteration (the loop's `known_trip_count`), one inside a called or fused
computation once per call.
"""

from __future__ import annotations

import collections
import re

# A computation: a header line at column 0 ending in '{', its body, a closing '}' line.
_BLOCK = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*?\{[ \t]*\n(.*?)^\}', re.M | re.S)
_ENTRY = re.compile(r'^ENTRY\s+%?([\w.\-]+)', re.M)
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$')
_NAME = re.compile(r'\s*([\w\-]+)\(')
_CALLEES = re.compile(r'(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)')
_BODY = re.compile(r'body=%?([\w.\-]+)')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """Computation name -> its lines, and the ENTRY computation's name."""
  blocks = {m.group(2): m.group(3).splitlines() for m in _BLOCK.finditer(text)}
  entry = _ENTRY.search(text)
  if entry is None:
    raise ValueError('no ENTRY computation in this HLO text')
  return blocks, entry.group(1)


def _opcode(line: str) -> str | None:
  """The opcode of an instruction line: what follows its (possibly tuple) result type."""
  m = _INSTR.match(line)
  if m is None:
    return None
  rest = m.group(1)
  if rest.startswith('('):  # a tuple type: skip to its closing parenthesis
    depth = 0
    for i, c in enumerate(rest):
      depth += c == '('
      depth -= c == ')'
      if depth == 0:
        rest = rest[i + 1 :]
        break
  else:
    rest = rest.split(' ', 1)[1] if ' ' in rest else ''
  op = _NAME.match(rest)
  return op.group(1) if op else None


def executed_ops(text: str) -> collections.Counter:
  """Opcode -> executions per step.

  Raises:
    ValueError: a loop whose trip count the HLO does not state (the count
      would be a guess).
  """
  bodies, entry = _computations(text)
  total: collections.Counter = collections.Counter()

  def visit(name: str, mult: int, stack: tuple) -> None:
    if name in stack or name not in bodies:
      return
    for line in bodies[name]:
      opcode = _opcode(line)
      if opcode is None:
        continue
      total[opcode] += mult
      if opcode == 'while':
        trip = _TRIP.search(line)
        if trip is None:
          raise ValueError(f'a while loop in %{name} states no known_trip_count: {line.strip()}')
        visit(_BODY.search(line).group(1), mult * int(trip.group(1)), stack + (name,))
        continue
      for callee in _CALLEES.findall(line):
        visit(callee, mult, stack + (name,))

  visit(entry, 1, ())
  return total


def matmuls(compiled) -> int:
  """Dot products executed per step (XLA `dot` and `convolution` instructions)."""
  ops = executed_ops(compiled.as_text())
  return ops['dot'] + ops['convolution']
