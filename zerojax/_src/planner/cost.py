"""The work one chip does in a compiled step: matmul FLOPs and kernel time, read from the HLO.

The compiled program is what one chip runs (SPMD), so everything counted here is
per chip, whichever way the step was written (`jax.value_and_grad` outside
`shard_map` or `zerojax.value_and_grad` inside it). A *kernel* is an
instruction the chip executes as a unit: a fusion, or an unfused instruction
at the top level of the entry computation, a `while` body, a branch or a call.
Each kernel counts once per execution: a `while` body's kernels are multiplied
by the loop's trip count (read as `count_collectives` reads it), so a scanned
model and its rematerialised backward pass are counted in full.

- Matmul FLOPs: every `dot` and `convolution` inside a kernel, 2 x the output's
  elements x the contracted size (XLA's own `cost_analysis()` counts a loop
  body once; this does not).
- Kernel time: the TPU compiler writes its own estimate of each kernel's cycles
  into the program (`estimated_cycles` in the backend config): its cost model of
  the MXU rate for that matmul's shape and of the vector and memory work of the
  fusion. The cycles become seconds at the chip's clock (`Chip.clock_hz`, derived
  from the published peak and MXU count). A kernel without an estimate (XLA:CPU
  writes none; on TPU, copies and slices) costs its own roofline: the larger of
  its FLOPs at peak and the bytes it reads and writes at HBM bandwidth.

Collectives are not kernels here: `hlo.count_collectives` counts them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any

import numpy as np

from zerojax._src.planner import hlo

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
# The TPU compiler writes INT64_MAX where it has no estimate (seen on v5p, libtpu 0.0.42 and
# 0.0.50): such a kernel is costed as one without an estimate.
_NO_ESTIMATE = 2**63 - 1
_LHS_CONTRACTING = re.compile(r'lhs_contracting_dims=\{([\d,]*)\}')
_DIM_LABELS = re.compile(r'dim_labels=([\w]+)_([\w]+)->([\w]+)')
_WINDOW = re.compile(r'window=\{([^}]*)\}')
_DIMS = re.compile(r'\[([\d,]*)\]')
# A Pallas kernel's own cost (`pl.CostEstimate`), which the TPU compiler writes into the
# custom call's config and does not estimate itself.
_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)",[^}]*"bytes_accessed":"(\d+)"')
# A TPU custom kernel (Pallas / Mosaic), whose FLOPs the HLO shows only where it states them.
_TPU_KERNEL = 'custom_call_target="tpu_custom_call"'
_NUMBERED = re.compile(r'\.\d+$')
# Instructions that launch nothing of their own.
_FREE = frozenset(
  {
    'parameter',
    'constant',
    'get-tuple-element',
    'tuple',
    'bitcast',
    'after-all',
    'partition-id',
    'replica-id',
    'opt-barrier',
    'add-dependency',
    'send',
    'recv',
  }
)
_CONTROL = frozenset({'while', 'conditional', 'call'})


class CostCountWarning(UserWarning):
  """A kernel count could not be determined exactly from the HLO."""


@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """One chip's work in one step of a compiled program.

  Attributes:
    matmul_flops: FLOPs of every dot and convolution executed per step.
    kernel_seconds: the kernels' time one after another, with the clock and
      roofline constants given: the compiler's estimate where the program has one,
      the kernel's roofline elsewhere.
    estimated_seconds: the part of `kernel_seconds` from the compiler's estimates.
    roofline_seconds: the part from rooflines (kernels without an estimate).
    matmul_seconds: the part spent in kernels that contain a matmul.
    kernels: kernel executions per step.
    estimated_kernels: how many of them carried the compiler's estimate.
    uncertain: why a count is not exact (a loop with no trip count in the HLO,
      counted once; a conditional, counted as its costliest branch).
    dcn_windows: per collective between TPU slices (a data-center network `send`): the
      bytes it sends, the kernel seconds scheduled between it and its done (what can hide
      it), and how often it runs per step (loops times their trip counts). None for a
      program with none.
    unpriced_kernels: runs per step of TPU custom kernels (Pallas) that state no cost and
      carry no compiler estimate: each is costed at the bytes of its operands and results
      over HBM bandwidth, its FLOPs uncounted, so `kernel_seconds` is a lower bound for them
      (`uncertain` names them).
    unpriced_seconds: the part of `kernel_seconds` those runs were costed at.
  """

  matmul_flops: float
  kernel_seconds: float
  estimated_seconds: float
  roofline_seconds: float
  matmul_seconds: float
  kernels: int
  estimated_kernels: int
  uncertain: tuple[str, ...] = ()
  dcn_windows: tuple[tuple[int, float, int], ...] | None = None
  unpriced_kernels: int = 0
  unpriced_seconds: float = 0.0


def _shape(type_str: str) -> tuple[int, ...]:
  m = _DIMS.search(type_str)
  return tuple(int(d) for d in m.group(1).split(',') if d) if m else ()


def _matmul_flops(op: str, operands: list[str], line: str, types: dict[str, str]) -> float:
  """FLOPs of one dot or convolution: 2 x output elements x the contracted size."""
  out = math.prod(_shape(hlo.result_type(line)))
  if op == 'dot':
    lhs = _shape(types.get(operands[0], ''))
    dims = _LHS_CONTRACTING.search(line)
    contracted = [int(d) for d in dims.group(1).split(',') if d] if dims else []
    return 2.0 * out * math.prod(lhs[d] for d in contracted if d < len(lhs))
  # convolution: each output element sums over the kernel's input features ('i')
  # times the window taps that land on an input element (not on padding, not on
  # a hole of a dilated input). The TPU compiler writes batched matmuls as such
  # convolutions, their batch dimensions spatial: one tap of each window is real.
  lhs, rhs = _shape(types.get(operands[0], '')), _shape(types.get(operands[1], ''))
  labels = _DIM_LABELS.search(line)
  if not lhs or not rhs or labels is None or 'i' not in labels.group(2):
    raise ValueError(f'cannot read the convolution on this HLO line: {line.strip()[:200]}')
  in_labels, out_labels = labels.group(1), labels.group(3)
  out_shape = _shape(hlo.result_type(line))
  window = _WINDOW.search(line)
  fields = dict(f.split('=', 1) for f in window.group(1).split()) if window else {}
  spatial = sorted(c for c in in_labels if c.isdigit())
  share = 1.0
  for k, dim in enumerate(spatial):
    pick = lambda key, default, k=k: int(fields[key].split('x')[k]) if key in fields else default
    pad = [int(v) for v in fields['pad'].split('x')[k].split('_')] if 'pad' in fields else [0, 0]
    share *= _real_taps(
      n=lhs[in_labels.index(dim)],
      m=out_shape[out_labels.index(dim)],
      size=pick('size', 1),
      stride=pick('stride', 1),
      low=pad[0],
      lhs_dilate=pick('lhs_dilate', 1),
      rhs_dilate=pick('rhs_dilate', 1),
    )
  return 2.0 * out * rhs[labels.group(2).index('i')] * share


def _real_taps(*, n, m, size, stride, low, lhs_dilate, rhs_dilate) -> float:
  """Window taps per output position, on average, that read an input element along one
  spatial dimension (input n elements dilated by `lhs_dilate`, padded `low` before)."""
  out = np.arange(m)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - low
  real = (out >= 0) & (out <= (n - 1) * lhs_dilate) & (out % lhs_dilate == 0)
  return float(real.sum()) / max(m, 1)


@dataclasses.dataclass
class _Tally:
  flops: float = 0.0
  estimated: float = 0.0
  roofline: float = 0.0
  matmul: float = 0.0
  kernels: int = 0
  estimated_kernels: int = 0
  unpriced: int = 0  # runs of TPU custom kernels that state no cost
  unpriced_seconds: float = 0.0

  def add(self, other: _Tally, mult: int) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + mult * getattr(other, f.name))

  @property
  def seconds(self) -> float:
    return self.estimated + self.roofline


class _Walk:
  """One walk over a program: per-computation caches, the chip's constants, and what could
  not be determined."""

  def __init__(
    self, program: hlo.Program, clock_hz: float | None, peak_flops: float, hbm_bandwidth: float
  ):
    self.program, self.bodies, self.entry = program, program.bodies, program.entry
    self.clock_hz, self.peak_flops, self.hbm_bandwidth = clock_hz, peak_flops, hbm_bandwidth
    self.flops_memo: dict = {}
    self.uncertain: list[str] = []
    self.unpriced_names: set[str] = set()  # TPU custom kernels that state no cost

  def instrs(self, name: str) -> dict:
    return self.program.instructions(name)

  def typed(self, name: str) -> dict[str, str]:
    return self.program.result_types(name)

  def flops_inside(self, name: str, stack: tuple = ()) -> float:
    """Matmul FLOPs of one execution of a fused (or called) computation."""
    if name in self.flops_memo:
      return self.flops_memo[name]
    if name in stack:
      return 0.0
    types, total = self.typed(name), 0.0
    for op, operands, line in self.instrs(name).values():
      if op in ('dot', 'convolution'):
        total += _matmul_flops(op, operands, line, types)
      for callee in hlo.callees(line):
        total += self.flops_inside(callee, stack + (name,))
    self.flops_memo[name] = total
    return total

  def kernel(self, name: str, op: str, operands: list[str], line: str, tally: _Tally) -> None:
    """Adds one kernel execution: its matmul FLOPs and its time."""
    types = self.typed(name)
    if op in ('dot', 'convolution'):
      flops = _matmul_flops(op, operands, line, types)
    elif op == 'fusion':
      flops = sum(self.flops_inside(c) for c in hlo.callees(line))
    else:
      flops = 0.0
    cycles = _CYCLES.search(line)
    if cycles and int(cycles.group(1)) >= _NO_ESTIMATE:
      cycles = None
    stated = _KERNEL_COST.search(line) if op == 'custom-call' else None
    if stated and not cycles:
      # A Pallas kernel (flash attention): the FLOPs and bytes it states, at the roofline.
      flops = float(stated.group(1))
      seconds = max(flops / self.peak_flops, int(stated.group(2)) / self.hbm_bandwidth)
      tally.roofline += seconds
    elif cycles and self.clock_hz:
      seconds = int(cycles.group(1)) / self.clock_hz
      tally.estimated += seconds
      tally.estimated_kernels += 1
    else:
      moved = hlo.type_bytes(types.get(hlo.instruction_name(line), ''))
      moved += sum(hlo.type_bytes(types.get(o, '')) for o in operands)
      seconds = max(flops / self.peak_flops, moved / self.hbm_bandwidth)
      tally.roofline += seconds
      if op == 'custom-call' and _TPU_KERNEL in line:
        tally.unpriced += 1
        tally.unpriced_seconds += seconds
        self.unpriced_names.add(_NUMBERED.sub('', hlo.instruction_name(line)))
    tally.flops += flops
    tally.kernels += 1
    if flops:
      tally.matmul += seconds

  def visit(self, name: str, stack: tuple[str, ...], tally: _Tally) -> None:
    """Adds every kernel computation `name` runs (loops times their trip counts)."""
    if name in stack or name not in self.bodies:
      return
    inner = stack + (name,)
    for instr, (op, operands, line) in self.instrs(name).items():
      self.one(name, instr, op, operands, line, inner, tally)

  def one(self, name, instr, op, operands, line, inner, tally: _Tally) -> None:
    """Adds what one instruction of computation `name` runs."""
    if op in _FREE or hlo.is_collective(line) or op.endswith(('-done', '-update')):
      return
    if op == 'while':
      self.loop(name, instr, line, inner, tally)
    elif op == 'conditional':
      self.branches(name, instr, line, inner, tally)
    elif op == 'call' or op.endswith('-start') and op != 'copy-start':
      for callee in hlo.callees(line):
        if not callee.startswith('async_collective_fusion'):
          self.visit(callee, inner, tally)
    else:
      self.kernel(name, op, operands, line, tally)

  def dcn_windows(self, name: str, stack: tuple[str, ...] = (), mult: int = 1) -> list:
    """(bytes sent, kernel seconds scheduled between the send and its done, executions per
    step) of each collective between TPU slices in `name` and what it calls."""
    if name in stack or name not in self.bodies:
      return []
    inner = stack + (name,)
    items = list(self.instrs(name).items())
    seconds: dict[int, float] = {}  # line -> its kernels' seconds, computed once

    def cost_of(j: int) -> float:
      if j not in seconds:
        instr, (op, operands, line) = items[j]
        part = _Tally()
        self.one(name, instr, op, operands, line, inner, part)
        seconds[j] = part.seconds
      return seconds[j]

    out = []
    for k, (instr, (_, _, line)) in enumerate(items):
      found = hlo.slice_send(line)
      if found is None:
        continue
      done = next(
        (
          j
          for j in range(k + 1, len(items))
          if items[j][1][0] == 'send-done' and instr in items[j][1][1]
        ),
        len(items),
      )
      window = sum(cost_of(j) for j in range(k + 1, done))
      out.append((hlo.type_bytes(found[1]), window, mult))
    # Sends inside loops and calls, times how often those run.
    for _, (op, _, line) in items:
      if op == 'while':
        body = hlo.loop_body(line)
        trip = self.program.trip_count(line, name) or 1
        out += self.dcn_windows(body, inner, mult * trip) if body else []
      elif op in ('call', 'conditional'):
        for callee in hlo.callees(line):
          out += self.dcn_windows(callee, inner, mult)
    return out

  def loop(self, name: str, instr: str, line: str, inner: tuple, tally: _Tally) -> None:
    body = hlo.loop_body(line)
    trip = self.program.trip_count(line, name)
    sub = _Tally()
    if body:
      self.visit(body, inner, sub)
    if trip is None and sub.kernels:
      self.uncertain.append(
        f'while loop %{instr} in %{name} has no known trip count in the HLO; its kernels'
        ' are counted once'
      )
    tally.add(sub, 1 if trip is None else trip)

  def branches(self, name: str, instr: str, line: str, inner: tuple, tally: _Tally) -> None:
    subs = []
    for b in hlo.branches(line):
      subs.append(_Tally())
      self.visit(b, inner, subs[-1])
    if subs:
      if len({round(s.seconds, 12) for s in subs}) > 1:
        self.uncertain.append(
          f'conditional %{instr} in %{name}: its branches cost differently and one runs per'
          ' step; the costliest is counted'
        )
      tally.add(max(subs, key=lambda s: s.seconds), 1)


def program_cost(
  compiled_or_text: Any,
  *,
  clock_hz: float | None,
  peak_flops: float,
  hbm_bandwidth: float,
) -> ProgramCost:
  """Counts one chip's matmul FLOPs and kernel time in a compiled step.

  Args:
    compiled_or_text: an `hlo.Program`, a `jax.stages.Compiled`, or its `as_text()`.
    clock_hz: the chip's clock, to turn the compiler's cycle estimates into
      seconds; None ignores them (every kernel then costs its roofline).
    peak_flops: the chip's dense FLOP/s, for kernels without an estimate.
    hbm_bandwidth: the chip's HBM bytes/s, for kernels without an estimate.

  Returns:
    A `ProgramCost`. Where the HLO does not determine a count, `uncertain` says
    why and a `CostCountWarning` is issued (nothing is guessed silently).

  >>> from zerojax._src.planner import cost
  >>> c = cost.program_cost(
  ...     'ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {\\n'
  ...     '  %a = f32[8,16]{1,0} parameter(0)\\n'
  ...     '  %b = f32[16,4]{1,0} parameter(1)\\n'
  ...     '  ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1},'
  ...     ' rhs_contracting_dims={0}\\n'
  ...     '}', clock_hz=None, peak_flops=1e9, hbm_bandwidth=1e9)
  >>> c.matmul_flops, c.kernels
  (1024.0, 1)
  """
  program = hlo.as_program(compiled_or_text)
  walk = _Walk(program, clock_hz, peak_flops, hbm_bandwidth)
  total = _Tally()
  walk.visit(walk.entry, (), total)
  if walk.unpriced_names:
    walk.uncertain.append(
      f'{total.unpriced} runs per step of TPU custom kernels that state no cost'
      f' ({", ".join(sorted(walk.unpriced_names))}: no pl.CostEstimate and no compiler'
      f' estimate) are costed at their bytes over HBM bandwidth, {total.unpriced_seconds:.3f} s,'
      " their FLOPs uncounted: the kernels' time is a lower bound for them"
    )
  for reason in walk.uncertain:
    warnings.warn(f'program_cost: {reason}.', CostCountWarning, stacklevel=2)
  return ProgramCost(
    matmul_flops=total.flops,
    kernel_seconds=total.seconds,
    estimated_seconds=total.estimated,
    roofline_seconds=total.roofline,
    matmul_seconds=total.matmul,
    kernels=total.kernels,
    estimated_kernels=total.estimated_kernels,
    uncertain=tuple(walk.uncertain),
    dcn_windows=tuple(walk.dcn_windows(walk.entry)) if program.crosses_slices else None,
    unpriced_kernels=total.unpriced,
    unpriced_seconds=total.unpriced_seconds,
  )
