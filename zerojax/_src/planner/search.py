"""Plan search: which ZeRO configuration for this model on this slice, answered before launch.

Every candidate (stage, mesh layout, tensor-parallel degree, micro-batches,
rematerialisation, prefetch, offload, quantization, batch per chip) is first
checked against theory (its model states at rest against HBM, its offloaded
state against host memory), and the survivors are compiled ahead of time for the
real topology. Each compiled program gives its own peak memory and collectives
(ring bytes against the ZeRO floor, bytes overlapped with compute); its FLOPs
are counted on the compiled program per chip with every loop iteration (XLA's
cost analysis, also reported, counts a loop body once); the step-time model
(`roofline`) turns the program's kernels, collectives and host transfers into a
*predicted* step time. The ranking is by predicted time among the candidates
that fit.

Predicted is not measured: kernels take the TPU compiler's own cycle estimates,
collectives the ICI bandwidth one torus axis gets, less what the compiler
overlaps with compute, and host transfers the host link's bandwidth. On `cpu:N` the constants are measured on this machine
and the prediction is checked against the step's measured time.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax._src import runtime
from zerojax._src.planner import (
  arrays,
  collectives,
  cost,
  display,
  hlo,
  program_cache,
  roofline,
  tpu,
)
from zerojax._src.planner import report as report_lib
from zerojax._src.planner.candidates import (
  Candidate,
  candidate_space,
  check_collective_offloads,
  check_scheduler_shares,
  default_collective_offloads,
  default_remats,
  why_none_valid,
  with_default_shares,
)
from zerojax._src.planner.host_link import HostTraffic, host_traffic, updated_param_bytes
from zerojax._src.planner.lowering import Lowered, Target, lower, make_target
from zerojax._src.planner.presets import ModelSettings
from zerojax._src.planner.roofline import Chip, Prediction, predict


# A candidate's status where theory alone rules it out, before anything compiles.
class Outcome(enum.Enum):
  """What became of a candidate: the closed set a `Result` is one of (its `reason` says why)."""

  FITS = 'fits'
  OVER_HBM = 'over HBM'  # its compiled program's peak, or the compiler's refusal (the reason)
  PRUNED = 'pruned'  # refused before compiling: its states alone do not fit (the reason)
  FAILED = 'failed'  # zerojax's layout rules refused it (the reason: their error)


STATES_EXCEED_HBM = 'states alone exceed HBM'
STATE_EXCEEDS_HOST = 'offloaded state exceeds host memory'
PRUNED_HBM = f'pruned: {STATES_EXCEED_HBM}'  # the `Result.status` of each
PRUNED_HOST = f'pruned: {STATE_EXCEEDS_HOST}'


@dataclasses.dataclass(frozen=True)
class Priced:
  """A compiled candidate's figures, each an analysis of its program read once: memory and
  collectives against the ZeRO floors (`report`), the kernels' work, the host link's traffic
  and the predicted step."""

  report: Any  # `report.StepReport`
  program: hlo.Program
  work: cost.ProgramCost
  step: roofline.StepCost
  host_traffic: HostTraffic
  predicted: Prediction | None  # None where the chip has no figures

  def largest_arrays(self, count: int = 6) -> list[dict]:
    """The program's largest arrays, those of one type together (the entry's zeros and the
    loop's stacked updates of one buffer, or one value per layer), largest first."""
    groups: dict[str, dict] = {}
    for a in arrays.largest_arrays(self.program, count=None):
      g = groups.setdefault(a.type, dict(type=a.type, bytes=a.nbytes, count=0, sources=[]))
      g['count'] += 1
      if a.stacked:
        g['stacked_over'] = a.loop_trips
      if a.source and a.source not in g['sources']:
        g['sources'].append(a.source)
    return list(groups.values())[:count]


@dataclasses.dataclass(frozen=True)
class Result:
  """What one candidate costs, measured on its compiled program, and its predicted time: made
  once, by `evaluate`, from the candidate and its stages (or from what refused it)."""

  candidate: Candidate
  outcome: Outcome
  reason: str = ''  # why it is not 'fits': the compiler's refusal, which memory, the error
  theory_bytes: int = 0  # model states at rest per chip, from the plan
  host_bytes: int = 0
  peak_bytes: int = 0
  ring_bytes: float = 0.0
  floor_bytes: float = 0.0
  overlapped_bytes: float = 0.0
  dcn_bytes: float = 0.0  # of ring_bytes, those between slices (data-center network)
  dcn_floor_bytes: float | None = None  # each chip's gradient shard all-reduced across slices
  dcn_overlapped_bytes: float = 0.0
  # Per DCN transfer: (bytes sent, kernel seconds scheduled while in flight, runs per step)
  # (`cost.ProgramCost`); None where the program names none (the overlapped share is used).
  dcn_windows: tuple | None = None
  collective_count: int = 0
  flops: float = 0.0  # matmul FLOPs per chip in the compiled program (`cost.program_cost`)
  kernel_seconds: float = 0.0  # the program's kernels, one after another (`cost.program_cost`)
  cost_analysis_flops: float = 0.0  # XLA's, loop bodies counted once
  bytes_accessed: float = 0.0
  predicted: Prediction | None = None  # None where not compiled or the chip has no figures
  host_traffic: HostTraffic | None = None  # None where not compiled
  compile_seconds: float = 0.0  # lowering and compiling this candidate, in this run
  measured_seconds: float | None = None
  # Seconds of this run by phase ('lower', 'compile', 'analyse').
  phase_seconds: dict = dataclasses.field(default_factory=dict)
  # False for a TPU program holding host memory: the compiler reports no device-only peak,
  # and `peak_bytes` is arguments + outputs - aliased + temporaries as it reports them.
  peak_reported: bool = True
  # 'compiled'; 'cache' (read back from an earlier run); 'memo' (the same program as an
  # earlier candidate of this search); '' where nothing was compiled.
  program_source: str = ''
  # What the compiler said a candidate it refused needs, in its G (None where it said none).
  compiler_needs_gigabytes: float | None = None
  # Why zerojax refused to lay the candidate out ('failed: ...' status), as it was raised.
  error: Exception | None = dataclasses.field(default=None, repr=False, compare=False)
  # With `evaluate(keep=True)` (a single plan): the candidate lowered, its compile's outcome
  # and its priced program, for the plan's report; a search of many keeps none.
  lowered: Lowered | None = dataclasses.field(default=None, repr=False, compare=False)
  compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
  priced: Priced | None = dataclasses.field(default=None, repr=False, compare=False)

  def __post_init__(self):
    if not isinstance(self.outcome, Outcome):
      raise TypeError(f'Result.outcome must be an Outcome, got {self.outcome!r}.')

  @property
  def status(self) -> str:
    """The outcome and its reason in one line: 'fits', 'over HBM: ...', 'pruned: ...'."""
    return f'{self.outcome.value}: {self.reason}' if self.reason else self.outcome.value

  @property
  def fits(self) -> bool:
    return self.outcome is Outcome.FITS

  @property
  def step_seconds(self) -> float:
    return math.inf if self.predicted is None else self.predicted.step


# -- one candidate's compiled program, analysed and priced ------------------------------


def _cost(compiled) -> tuple[float, float]:
  """(FLOPs, bytes accessed) of one device's program, from XLA's cost analysis.

  Raises:
    ValueError: the compiler reported no FLOP count (it is never guessed).
  """
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  flops = (cost or {}).get('flops')
  if flops is None or flops <= 0:
    raise ValueError(f'the compiled program reports no FLOP count (cost analysis: {cost!r})')
  return float(flops), float(cost.get('bytes accessed', 0.0))


def program_cost(chip: Chip | None, program: Any) -> cost.ProgramCost:
  """One chip's matmul FLOPs and kernel time in a compiled step, with `chip`'s constants
  (the TPU compiler's cycle estimates at its clock; rooflines where there are none)."""
  if chip is None:  # no constants: count the FLOPs only
    chip = Chip('none', 1.0, 0, 1.0, 1.0, 1, 0, 1.0, '')
  return cost.program_cost(
    program, clock_hz=chip.clock_hz, peak_flops=chip.peak_flops, hbm_bandwidth=chip.hbm_bandwidth
  )


def as_dict(figures: HostTraffic | Prediction | None) -> dict:
  """`figures` as the JSON records write them: {} where there are none."""
  return {} if figures is None else dataclasses.asdict(figures)


def evaluate(
  target: Target,
  c: Candidate,
  *,
  hbm_bytes: int | None,
  cache_dir: Any = None,
  memo: dict | None = None,
  compiler_options: dict[str, Any] | None = None,
  measure: bool = False,
  keep: bool = False,
  observe: Callable[[str, Any], None] | None = None,
) -> Result:
  """One candidate through the pipeline: lowered (`lowering.lower`), checked against theory
  (states at rest against HBM, offloaded state against host memory), compiled or read back
  (`program_cache.compile_program`), priced (`price`). `python -m zerojax plan` is this for one
  candidate; a search runs it for each.

  `cache_dir` and `memo` (`program_cache.compile_program`) let a program lowered before,
  in an earlier run or by an earlier candidate, be read back instead of compiled again.
  `compiler_options` go to the compiler with every candidate. With `measure`, a program
  compiled here that fits is also run (`measured_seconds`; on cpu:N). With `keep`, the
  result keeps the lowered candidate, its compile and its priced program (a plan's report
  prints from them). `observe(event, stage)` is called with each stage as the candidate is
  'lowered' (its `Lowered`, when not pruned) and 'compiled' (its `program_cache.Compiled`,
  compiled or read back), for progress lines.
  """
  observe = observe or (lambda event, stage: None)
  start = time.perf_counter()
  try:
    lowered = lower(target, c)
  except ValueError as e:  # zerojax's layout rules refuse it: a leaf that cannot be split so
    return Result(c, Outcome.FAILED, f'{type(e).__name__}: {str(e).splitlines()[0][:160]}', error=e)
  except Exception as e:  # anything else is a bug, never a candidate that does not fit
    e.add_note(f'zerojax plan search: raised while lowering the candidate {c}.')
    raise
  phases = {'lower': time.perf_counter() - start}
  sizes = lowered.plan.bytes_per_device()
  theory = dict(theory_bytes=sizes['params'] + sizes['opt_state'], host_bytes=sizes['host'])
  kept = dict(lowered=lowered) if keep else {}
  pruned = _pruned(target, hbm_bytes, **theory)
  if pruned is not None:
    return Result(c, Outcome.PRUNED, pruned, **theory, phase_seconds=phases, **kept)
  observe('lowered', lowered)
  options = c.compiler_options(compiler_options)
  done = _compile(target, lowered, cache_dir, memo, options)
  if isinstance(done, _Refused):
    phases['compile'] = done.seconds
    return Result(
      c,
      Outcome.OVER_HBM,
      done.summary,
      **theory,
      phase_seconds=phases,
      compile_seconds=sum(phases.values()),
      program_source=done.source,
      compiler_needs_gigabytes=done.needed_gigabytes,
      **kept,
    )
  phases['compile'] = done.seconds
  observe('compiled', done)
  start = time.perf_counter()
  priced = price(target, lowered, done)
  outcome, figures = _figures(target, priced, done.program, hbm_bytes)
  phases['analyse'] = time.perf_counter() - start
  measured = None
  if measure and outcome is Outcome.FITS and done.source == 'compiled':
    measured = _measure_cpu(done.program, lowered.state, lowered.batch)
  if keep:
    kept |= dict(compiled=done, priced=priced)
  return Result(
    c,
    outcome,
    **theory,
    **figures,
    phase_seconds=phases,
    compile_seconds=phases['lower'] + done.seconds,
    program_source=done.source,
    measured_seconds=measured,
    **kept,
  )


def _pruned(target: Target, hbm_bytes: int | None, theory_bytes: int, host_bytes: int):
  """Why a candidate's states at rest (from its plan) alone exceed the device's or the host's
  memory, else None."""
  chip = target.chip
  if hbm_bytes is not None and theory_bytes > hbm_bytes:
    return STATES_EXCEED_HBM
  if chip is not None and chip.host_bytes_per_chip and host_bytes > chip.host_bytes_per_chip:
    return STATE_EXCEEDS_HOST
  return None


@dataclasses.dataclass(frozen=True)
class _Refused:
  """The TPU compiler's refusal of a program that does not fit (RESOURCE_EXHAUSTED)."""

  summary: str
  needed_gigabytes: float | None  # what it said the program needs, where it said
  source: str  # 'compiled', or where the kept refusal was read back from
  seconds: float


def _compile(target, lowered: Lowered, cache_dir, memo, compiler_options):
  """The compiled program (`program_cache.Compiled`), or the compiler's refusal for memory."""
  start = time.perf_counter()
  try:
    return program_cache.compile_program(
      lowered.lowered,
      topology=target.topology,
      cache_dir=cache_dir,
      memo=memo,
      compiler_options=compiler_options,
    )
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses what cannot fit
    if not runtime.is_out_of_memory(e):
      raise
    recorded = isinstance(e, program_cache.RecordedCompileError)
    refusal = runtime.OutOfMemory.parse(str(e))
    return _Refused(
      refusal.summary(),
      refusal.needed_gigabytes,
      e.source if recorded else 'compiled',
      time.perf_counter() - start,
    )


def price(target: Target, lowered: Lowered, done: Any) -> Priced:
  """A compiled candidate's figures (`Priced`), from its program's HLO read once.

  Raises:
    ValueError: the host link's figures are missing where the program moves bytes over it.
  """
  program = hlo.Program.parse(done.text)  # read once; every figure below is an analysis of it
  report = report_lib.step_report(
    done.program,
    plan=lowered.plan,
    bytes_per_param=lowered.unit,
    hlo_text=program,
    platform=done.platform,
  )
  c, plan = lowered.candidate, lowered.plan
  traffic = host_traffic(
    program, c, plan.bytes_per_device()['host'], updated_param_bytes(plan, c.stage)
  )
  return _priced(target.chip, report, program, traffic)


def price_program(chip: Chip | None, memory: Any, text: str) -> Priced:
  """The figures of a step compiled elsewhere (another library's program: no zerojax plan, so
  no ZeRO floors), by the same analysis `price` gives a candidate: the compiler's `memory`
  (`report.memory_stats` of the compiled program), the collectives, the kernels' work and the
  host transfers counted in its optimized HLO `text`, and the step predicted for `chip` (None:
  not timed).

  Raises:
    ValueError: the host link's figures are missing where the program moves bytes over it.
  """
  program = hlo.Program.parse(text)
  report = report_lib.StepReport(memory, collectives.count_collectives(program))
  # No plan: every byte over the host link is counted in the program, none by formula.
  traffic = host_traffic(program, None, 0, 0)
  return _priced(chip, report, program, traffic)


def _priced(chip: Chip | None, report: Any, program: hlo.Program, traffic: HostTraffic) -> Priced:
  """`price`'s and `price_program`'s common end: the kernels' work, the step-time model's
  figures and the step predicted for `chip` (None: not timed)."""
  work = program_cost(chip, program)
  step = roofline.StepCost.of(report.collectives, work)
  predicted = None
  if chip is not None:
    predicted = predict(chip, step, traffic.moved, traffic.overlapped)
  return Priced(report, program, work, step, traffic, predicted)


def _figures(target: Target, priced: Priced, compiled: Any, hbm_bytes) -> tuple[Outcome, dict]:
  """Whether a priced candidate fits `hbm_bytes`, and the search's figures of it."""
  report, chip = priced.report, target.chip
  flops, accessed = _cost(compiled)
  figures = dict(
    peak_bytes=report.memory.peak,
    dcn_floor_bytes=report.dcn_floor_bytes,
    floor_bytes=report.floor_bytes,
    cost_analysis_flops=flops,
    bytes_accessed=accessed,
    peak_reported=not report.memory.host_held,
    host_traffic=priced.host_traffic,
    predicted=priced.predicted,
  )
  figures |= {f.name: getattr(priced.step, f.name) for f in dataclasses.fields(priced.step)}
  chip_hbm = chip is not None and hbm_bytes is not None and hbm_bytes >= chip.hbm_bytes
  # A TPU program holding host memory has no device-only peak from the compiler; the compiler
  # itself refuses what does not fit its chip (RESOURCE_EXHAUSTED), so one it compiled for
  # the chip's own HBM fits.
  over = hbm_bytes is not None and report.memory.peak > hbm_bytes
  if over and not (report.memory.host_held and chip_hbm):
    return Outcome.OVER_HBM, figures
  return Outcome.FITS, figures


# -- the search ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SearchReport:
  """A search's results, ranked: fitting candidates by predicted step time, then the rest."""

  target: Target
  results: list[Result]
  invalid: list[tuple[Candidate, str]]
  seconds: float
  hbm_bytes: int | None = None  # the device memory each candidate was held to

  @property
  def ranked(self) -> list[Result]:
    fits = sorted((r for r in self.results if r.fits), key=lambda r: (r.step_seconds, r.peak_bytes))
    return fits + [r for r in self.results if not r.fits]

  @property
  def winner(self) -> Result | None:
    best = self.ranked[:1]
    return best[0] if best and best[0].fits else None


def _measure_cpu(compiled: Any, state: Any, batch: Any, steps: int = 5) -> float:
  """Median seconds of the compiled step on the faked CPU devices, after one warm-up step."""
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), state)
  tokens = jnp.zeros(batch.shape, batch.dtype, device=batch.sharding)
  times = []
  for i in range(steps + 1):
    start = time.perf_counter()
    state, loss = compiled(state, tokens)
    loss.block_until_ready()
    if i:
      times.append(time.perf_counter() - start)
  return float(np.median(times))


def run_search(
  target: Target,
  candidates: Sequence[Candidate],
  *,
  invalid: Sequence[tuple[Candidate, str]] = (),
  hbm_bytes: int | None = None,
  progress: bool = True,
  measure: bool = False,
  cache_dir: Any = None,
  compiler_options: dict[str, Any] | None = None,
) -> SearchReport:
  """Evaluates every candidate (theory, then the compiled program) and ranks them.

  Args:
    target: the topology, model and training setup.
    candidates: from `candidate_space`.
    invalid: combinations left out, with why (reported, not compiled).
    hbm_bytes: device memory per chip; default the chip's (`CHIPS`).
    progress: show a progress bar with each candidate's outcome and phase times.
    measure: on `cpu:N`, run each fitting candidate's step and record its median
      time beside the prediction (every candidate is then compiled here).
    cache_dir: where compiled programs are kept between runs
      (`program_cache.default_dir()` for the planner's); None keeps none. Within
      the search, a candidate that lowers to an earlier one's program reuses it.
    compiler_options: XLA or libtpu options every candidate is compiled with (pass the
      same to `jax.jit` in the training run).

  Returns:
    A `SearchReport`.
  """
  start = time.perf_counter()
  hbm = hbm_bytes if hbm_bytes is not None else (target.chip.hbm_bytes or None)
  memo = None if measure else {}
  results = []
  with display.candidate_progress(len(candidates), enabled=progress) as (starting, finished):
    for c in candidates:
      starting(c.label())
      r = evaluate(
        target,
        c,
        hbm_bytes=hbm,
        cache_dir=None if measure else cache_dir,
        memo=memo,
        compiler_options=compiler_options,
        measure=measure,
      )
      # jax keeps each candidate's traced and compiled step in its caches; a TPU compile of a
      # 70B step holds about half a GB there, so a long search would run out of host memory.
      jax.clear_caches()
      results.append(r)
      finished(f'  {c.label():<60} {r.status} {display.phases(r)}')
  report = SearchReport(target, results, list(invalid), time.perf_counter() - start, hbm)
  if progress:
    print(display.phase_summary(report), flush=True)
  return report


def search_plans(
  model: str | Callable[..., Any],
  topology: str,
  *,
  optimizer: Callable[[], Any] | None = None,
  mixed_precision: bool = False,
  seq_len: int | None = None,
  attention_chunk: int | None = None,
  attention: str = 'xla',
  loss_chunk: int | None = None,
  hbm_bytes: int | None = None,
  progress: bool = True,
  cache_dir: Any = None,
  compiler_options: dict[str, Any] | None = None,
  **space: Any,
) -> SearchReport:
  """Which ZeRO configuration for `model` on `topology`: every candidate compiled ahead of time.

  Args:
    model: a preset name ('tiny', 'llama2-7b', ...) or a function `(remat, prefetch)`
      returning a `zerojax.inspect.ModelSpec`.
    topology: a TPU topology ('v5e:2x4', 'v5p:2x2x1', 'v6e:4x4'; needs libtpu) or 'cpu:N'
      (the faked CPU devices, where each fitting candidate's step is also run and timed).
    optimizer: makes the optax optimizer; default `optax.adamw(1e-4)`.
    mixed_precision: bf16 parameters and gradients, fp32 master in the optimizer state.
    seq_len: the preset's sequence length, or this.
    attention_chunk: presets: compute attention this many queries at a time.
    attention: presets: 'xla' or 'flash' (fused Pallas kernels on TPU).
    loss_chunk: presets: compute the head's logits and the loss this many positions at a time.
    hbm_bytes: device memory per chip; default the chip's.
    progress: a progress bar with each candidate's outcome.
    cache_dir: keep compiled TPU programs here and read back those compiled before
      (`program_cache`; the command line's default is `program_cache.default_dir()`);
      None keeps none between runs.
    compiler_options: XLA or libtpu options every candidate is compiled with, as
      `jax.jit(..., compiler_options=...)` takes them.
    **space: `candidate_space`'s options (stages, layouts, micro_batches, remat, prefetch,
      offload, update_on, offload_params, quantize, batch_per_chip, slices, scheduler_share,
      collective_offload, tensor: sizes of a tensor-parallel axis beside the 'flat' layout's
      ZeRO axis). For a
      preset or a `DecoderConfig`, remat defaults to `candidates.default_remats` of the chip
      (the offloading policies where its host link has figures). scheduler_share: percents of
      HBM for the TPU compiler's scheduler (`candidates.SCHEDULER_OPTION`), None its default;
      not given, each candidate's `candidates.default_scheduler_share`. collective_offload:
      None and/or 'sparsecore' (the collectives on the chip's SparseCores); not given, both on
      a chip with SparseCores (`candidates.default_collective_offloads`).

  Returns:
    A `SearchReport`; `search_report.format_search`, `search_json`, `plot_search` and `winner_code`
    present it.

  Raises:
    ValueError: an unknown topology, model or option value, or a space with no valid candidate.
  """
  counts = sorted({s for s in space.get('slices', (1,)) if isinstance(s, int) and s > 1})
  target = make_target(
    model,
    topology,
    devices=tpu.topology_devices(topology),
    optimizer=optimizer or (lambda: optax.adamw(1e-4)),
    mixed_precision=mixed_precision,
    settings=ModelSettings(
      seq_len=seq_len, attention_chunk=attention_chunk, attention=attention, loss_chunk=loss_chunk
    ),
    slice_devices={s: tpu.topology_devices(topology, s) for s in counts},
  )
  found, invalid = search_space(target, compiler_options, **space)
  return run_search(
    target,
    found,
    invalid=invalid,
    hbm_bytes=hbm_bytes,
    progress=progress,
    measure=topology.startswith('cpu:'),
    cache_dir=cache_dir,
    compiler_options=compiler_options,
  )


# What a search of a one-chip target tries where it is not told (the offloads' whole space;
# `Candidate.reasons` drops the combinations that cannot run).
ONE_CHIP_OFFLOADS = dict(
  offload=(None, 'opt_state', 'opt_state+master'),
  update_on=('device', 'host', 'stream'),
  offload_params=(False, True),
)


def search_space(
  target: Target,
  compiler_options: dict[str, Any] | None = None,
  names: dict[str, str] | None = None,
  **space: Any,
) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
  """(the candidates, the combinations not valid with why) of a search of `target` over
  `space` (`candidate_space`'s options), the defaults a search takes filled in: remat
  (`default_remats` of the chip, for a preset or a `DecoderConfig`), the collectives'
  placement (`default_collective_offloads`) and each candidate's scheduler share
  (`default_scheduler_share`), and on a one-chip target every offload (`ONE_CHIP_OFFLOADS`).
  `names` says how errors name an option (the command line's flags); default its keyword.

  Raises:
    ValueError: a scheduler share or collective placement the topology cannot take, or a
      space with no valid candidate.
  """
  names = {'scheduler_share': '`scheduler_share`', 'collective_offload': '`collective_offload`'} | (
    names or {}
  )
  if not callable(target.model):  # a preset or a DecoderConfig: the presets' named activations
    space.setdefault('remat', default_remats(target.chip))
  if len(target.devices) == 1 and len(target.slice_devices) == 0:
    # One chip: nothing to split, so host memory is what makes a larger model fit.
    for key, values in ONE_CHIP_OFFLOADS.items():
      if key == 'update_on' and not target.mixed_precision:  # 'stream' needs the master step
        values = tuple(v for v in values if v != 'stream')
      space.setdefault(key, values)
  shares = space.get('scheduler_share', ())
  check_scheduler_shares(target.topology, shares, compiler_options, names['scheduler_share'])
  space.setdefault('collective_offload', default_collective_offloads(target.chip, compiler_options))
  check_collective_offloads(
    target.topology,
    target.chip,
    space['collective_offload'],
    compiler_options,
    names['collective_offload'],
  )
  found, invalid = candidate_space(grid_dims=len(target.grid), chips=len(target.devices), **space)
  if 'scheduler_share' not in space:
    found = with_default_shares(found, target.topology, compiler_options)
  if not found:
    raise ValueError(f'these options leave no valid candidate: {why_none_valid(invalid)}.')
  return found, invalid
