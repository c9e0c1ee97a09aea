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

Collectives are not kernels here: `collectives.count_collectives` counts them.
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

  def add(self, other: _Tally, times: int) -> None:
    self.flops += times * other.flops
    self.estimated += times * other.estimated
    self.roofline += times * other.roofline
    self.matmul += times * other.matmul
    self.kernels += times * other.kernels
    self.estimated_kernels += times * other.estimated_kernels
    self.unpriced += times * other.unpriced
    self.unpriced_seconds += times * other.unpriced_seconds

  def weight(self) -> float:
    """The kernels' seconds, to the picosecond (`hlo.Tally`)."""
    return round(self.seconds, 12)

  def counted(self) -> bool:
    return self.kernels > 0

  @property
  def seconds(self) -> float:
    return self.estimated + self.roofline


class _Kernels:
  """The kernels a program runs, as an analysis of `Program.walk`: a `_Tally` per body, the
  chip's constants, and what could not be determined."""

  counts = 'its kernels are'
  differ = 'cost differently'

  def __init__(
    self, program: hlo.Program, clock_hz: float | None, peak_flops: float, hbm_bandwidth: float
  ):
    self.program = program
    self.clock_hz, self.peak_flops, self.hbm_bandwidth = clock_hz, peak_flops, hbm_bandwidth
    self.flops_memo: dict[str, float] = {}
    self.uncertain: list[str] = []
    self.unpriced_names: set[str] = set()  # TPU custom kernels that state no cost

  def tally(self) -> _Tally:
    return _Tally()

  def line(self, site: hlo.Site, tally: _Tally) -> bool:
    op, caller = site.opcode, site.caller
    if not op or op in _FREE or hlo.is_collective(site.line) or op.endswith(('-done', '-update')):
      return False
    if caller is not None and caller.opcode not in ('while', 'conditional'):
      if site.computation.startswith('async_collective_fusion'):  # a collective's: not a kernel
        return False
    if op in ('while', 'conditional', 'call') or op.endswith('-start') and op != 'copy-start':
      return True  # what it runs is counted where it runs
    self.kernel(site, tally)
    return False

  def flops_inside(self, name: str) -> float:
    """Matmul FLOPs of one execution of a fused (or called) computation."""
    if name not in self.flops_memo:
      self.flops_memo[name] = self.program.walk(_Matmuls(self.program), root=name).flops
    return self.flops_memo[name]

  def kernel(self, site: hlo.Site, tally: _Tally) -> None:
    """Adds one kernel execution: its matmul FLOPs and its time."""
    op, line = site.opcode, site.line
    types = self.program.result_types(site.computation)
    operands = self.program.instructions(site.computation)[site.name][1]
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
      moved = hlo.type_bytes(types.get(site.name, ''))
      moved += sum(hlo.type_bytes(types.get(o, '')) for o in operands)
      seconds = max(flops / self.peak_flops, moved / self.hbm_bandwidth)
      tally.roofline += seconds
      if op == 'custom-call' and _TPU_KERNEL in line:
        tally.unpriced += 1
        tally.unpriced_seconds += seconds
        self.unpriced_names.add(_NUMBERED.sub('', site.name))
    tally.flops += flops
    tally.kernels += 1
    if flops:
      tally.matmul += seconds


class _Flops:
  """A `_Matmuls` tally: matmul FLOPs."""

  def __init__(self):
    self.flops = 0.0

  def add(self, other: _Flops, times: int) -> None:
    self.flops += times * other.flops

  def weight(self) -> float:
    return self.flops

  def counted(self) -> bool:
    return self.flops > 0


class _Matmuls:
  """The matmul FLOPs of one execution of a computation and what it calls (a fusion's inside),
  as an analysis of `Program.walk`. It enters no loop or branch (see `line`)."""

  counts, differ = '', ''

  def __init__(self, program: hlo.Program):
    self.program = program
    self.uncertain: list[str] = []

  def tally(self) -> _Flops:
    return _Flops()

  def line(self, site: hlo.Site, tally: _Flops) -> bool:
    if site.opcode in ('dot', 'convolution'):
      operands = self.program.instructions(site.computation)[site.name][1]
      types = self.program.result_types(site.computation)
      tally.flops += _matmul_flops(site.opcode, operands, site.line, types)
    return site.opcode not in ('while', 'conditional')


class _Sends:
  """A `_DcnWindows` tally: (bytes sent, kernel seconds in flight, executions per step)."""

  def __init__(self):
    self.sends: list[tuple[int, float, int]] = []

  def add(self, other: _Sends, times: int) -> None:
    self.sends.extend((sent, window, runs * times) for sent, window, runs in other.sends)

  def weight(self) -> int:
    return sum(sent for sent, _, _ in self.sends)

  def counted(self) -> bool:
    return bool(self.sends)


class _DcnWindows:
  """Each collective between TPU slices, as an analysis of `Program.walk`: (bytes sent, kernel
  seconds scheduled between the send and its done, executions per step)."""

  # Its loops and branches: a send in a loop body runs once per trip; of a conditional's
  # branches the one that sends most. A loop's unknown trip count is the kernels' to say.
  counts, differ = '', ''

  def __init__(self, kernels: _Kernels):
    self.program, self.kernels = kernels.program, kernels
    self.uncertain: list[str] = []

  def tally(self) -> _Sends:
    return _Sends()

  def line(self, site: hlo.Site, tally: _Sends) -> bool:
    if site.index == 0:
      tally.sends.extend(self._sends(site))
    return site.opcode in ('while', 'conditional', 'call')

  def _sends(self, first: hlo.Site) -> list:
    """The sends of `first`'s computation, each with the kernels scheduled before its done."""
    name = first.computation
    instrs = self.program.instructions(name)
    lines = [(i, line) for i, line in enumerate(self.program.bodies[name]) if hlo.opcode(line)]
    seconds: dict[int, float] = {}  # place in `lines` -> its kernels' seconds, computed once

    def cost_of(j: int) -> float:
      if j not in seconds:
        i, line = lines[j]
        instr, op = hlo.instruction_name(line), hlo.opcode(line)
        site = hlo.Site(self.program, name, i, line, instr, op, first.trips, first.caller)
        seconds[j] = self.program.walk_site(self.kernels, site).seconds
      return seconds[j]

    out = []
    for k, (_, line) in enumerate(lines):
      found = hlo.slice_send(line)
      if found is None:
        continue
      instr = hlo.instruction_name(line)
      done = next(
        (
          j
          for j in range(k + 1, len(lines))
          if hlo.opcode(lines[j][1]) == 'send-done'
          and instr in instrs[hlo.instruction_name(lines[j][1])][1]
        ),
        len(lines),
      )
      window = sum(cost_of(j) for j in range(k + 1, done))
      out.append((hlo.type_bytes(found[1]), window, 1))
    return out


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
  kernels = _Kernels(program, clock_hz, peak_flops, hbm_bandwidth)
  total = program.walk(kernels)
  if kernels.unpriced_names:
    kernels.uncertain.append(
      f'{total.unpriced} runs per step of TPU custom kernels that state no cost'
      f' ({", ".join(sorted(kernels.unpriced_names))}: no pl.CostEstimate and no compiler'
      f' estimate) are costed at their bytes over HBM bandwidth, {total.unpriced_seconds:.3f} s,'
      " their FLOPs uncounted: the kernels' time is a lower bound for them"
    )
  for reason in kernels.uncertain:
    warnings.warn(f'program_cost: {reason}.', CostCountWarning, stacklevel=2)
  windows = None
  if program.crosses_slices:  # a fresh count: what it finds uncertain was said above
    windows = tuple(
      program.walk(_DcnWindows(_Kernels(program, clock_hz, peak_flops, hbm_bandwidth))).sends
    )
  return ProgramCost(
    matmul_flops=total.flops,
    kernel_seconds=total.seconds,
    estimated_seconds=total.estimated,
    roofline_seconds=total.roofline,
    matmul_seconds=total.matmul,
    kernels=total.kernels,
    estimated_kernels=total.estimated_kernels,
    uncertain=tuple(kernels.uncertain),
    dcn_windows=windows,
    unpriced_kernels=total.unpriced,
    unpriced_seconds=total.unpriced_seconds,
  )
