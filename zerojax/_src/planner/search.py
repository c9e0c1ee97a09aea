"""Plan search: which ZeRO configuration for this model on this slice, answered before launch.

Every candidate (stage, mesh layout, micro-batches, rematerialisation, prefetch,
offload, quantization, batch per chip) is first checked against theory (its
model states at rest against HBM, its offloaded state against host memory),
and the survivors are compiled ahead of time for the real topology. Each
compiled program gives its own peak memory and collectives (ring bytes against
the ZeRO floor, bytes overlapped with compute); its FLOPs are counted on the
compiled program per chip with every loop iteration (XLA's cost analysis,
also reported, counts a loop body once); the step-time model (`roofline`)
turns the program's kernels, collectives and host transfers into a *predicted*
step time. The ranking is by predicted time among the candidates that fit.

Predicted is not measured: kernels take the TPU compiler's own cycle estimates,
collectives the ICI bandwidth one torus axis gets, less what the compiler
overlaps with compute, and host transfers the host link's bandwidth. On `cpu:N` the constants are measured on this machine
and the prediction is checked against the step's measured time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src import runtime
from zerojax._src.options import OFFLOADS, UPDATE_ON, Options
from zerojax._src.planner import cost, hlo, roofline
from zerojax._src.planner.presets import REMAT
from zerojax._src.planner.roofline import (
  CHIPS,
  Chip,
  calibrate_cpu,
  host_transfer_bytes,
  predict,
)

QUANTIZE = {
  None: None,
  'g8': dict(weights=None, grads='int8'),
  'g4': dict(weights=None, grads='int4'),
  'w8g8': dict(weights='int8', grads='int8'),
  'w8g4': dict(weights='int8', grads='int4'),
}
LAYOUTS = ('flat', 'torus', 'hpz')


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration to try.

  Attributes:
    stage: ZeRO stage, 1-3.
    layout: 'flat' (one ZeRO axis over every chip), 'torus' (one ZeRO axis per
      torus dimension) or 'hpz' (torus axes, stage-3 parameters split within
      the last axis only: ZeRO++ hierarchical partitioning).
    micro_batches: gradient accumulation steps within the step.
    remat: 'gathers' (`zerojax.recompute_gathers`: only gathers run again),
      'full' (each block recomputed) or 'none'.
    prefetch: gather block i+1 while block i computes (`zerojax.scan_layers`).
    offload: None, 'opt_state' or 'opt_state+master' (host memory), as `zerojax.Options`.
    update_on: where an offloaded optimizer update runs: 'device', 'host' or 'stream'
      (on the host, gradients sent down layer by layer), as `zerojax.Options`.
    quantize: ZeRO++ collectives: None, 'g8', 'g4', 'w8g8', 'w8g4' (see `QUANTIZE`).
    batch_per_chip: sequences per chip per step.
    slices: TPU slices of the topology, joined by the data-center network: an outer 'slice'
      mesh axis, data-parallel (hierarchical ZeRO: state split within each slice).
  """

  stage: int
  layout: str = 'flat'
  micro_batches: int = 1
  remat: str = 'full'
  prefetch: bool = False
  offload: str | None = None
  update_on: str = 'device'
  quantize: str | None = None
  batch_per_chip: int = 1
  slices: int = 1

  def label(self) -> str:
    parts = [f's{self.stage}', self.layout, f'b{self.batch_per_chip}']
    parts += [f'x{self.slices} slices'] if self.slices > 1 else []
    parts += [f'mb{self.micro_batches}'] if self.micro_batches > 1 else []
    parts += [f'remat:{self.remat}'] + (['prefetch'] if self.prefetch else [])
    if self.offload is not None:
      parts.append(f'offload:{self.offload}@{self.update_on}')
    return ' '.join(parts + ([f'q:{self.quantize}'] if self.quantize is not None else []))

  def reasons(self) -> list[str]:
    """Every reason this combination cannot run (empty: it can)."""
    rules = [
      (self.stage not in (1, 2, 3), 'stages 1-3 are searched'),
      (self.batch_per_chip % self.micro_batches, 'micro_batches does not divide batch_per_chip'),
      (
        self.prefetch and (self.stage != 3 or self.remat == 'none'),
        'prefetch is for stage 3 with remat',
      ),
      (self.layout == 'hpz' and self.stage != 3, 'hpz splits stage-3 parameters'),
      (
        self.layout == 'hpz' and (self.prefetch or self.quantize is not None),
        'hpz runs without per-layer gathers',
      ),
      (
        self.update_on != 'device' and self.offload is None,
        f'update_on={self.update_on!r} needs an offload',
      ),
      (
        self.quantize in ('w8g8', 'w8g4') and self.stage != 3,
        'quantized weights are gathered at stage 3 only',
      ),
      (
        self.slices > 1 and self.update_on == 'stream',
        "update_on='stream' sends gradient shards down before they are summed across slices",
      ),
    ]
    return [why for broken, why in rules if broken]

  def invalid(self) -> str | None:
    """Why this combination cannot run (the first reason), or None."""
    return next(iter(self.reasons()), None)


@dataclasses.dataclass
class Result:
  """What one candidate costs, measured on its compiled program, and its predicted time."""

  candidate: Candidate
  status: str  # 'fits', 'over HBM', 'over host memory', 'pruned: ...', 'failed: ...'
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
  predicted: dict = dataclasses.field(default_factory=dict)  # seconds, by part
  # Bytes over the host link per step and chip: see `host_traffic`.
  host_traffic: dict = dataclasses.field(default_factory=dict)
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

  @property
  def fits(self) -> bool:
    return self.status == 'fits'

  @property
  def step_seconds(self) -> float:
    return self.predicted.get('step', math.inf)


# -- the candidate space -----------------------------------------------------------------


def candidate_space(
  *,
  stages: Sequence[int] = (1, 2, 3),
  layouts: Sequence[str] = ('flat', 'torus'),
  micro_batches: Sequence[int] = (1,),
  remat: Sequence[str] = ('gathers', 'full'),
  prefetch: Sequence[bool] = (False, True),
  offload: Sequence[str | None] = (None,),
  update_on: Sequence[str] = ('device',),
  quantize: Sequence[str | None] = (None,),
  batch_per_chip: Sequence[int] = (1,),
  slices: Sequence[int] = (1,),
  grid_dims: int = 2,
) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
  """Every valid combination, and the invalid ones with the reason (for the report).

  Raises:
    ValueError: an unknown value, naming the option and the choices.
  """
  for name, values, choices in (
    ('layouts', layouts, LAYOUTS),
    ('remat', remat, REMAT),
    ('offload', offload, OFFLOADS),
    ('update_on', update_on, UPDATE_ON),
    ('quantize', quantize, tuple(QUANTIZE)),
  ):
    bad = [v for v in values if v not in choices]
    if bad:
      raise ValueError(f'`{name}`: unknown {bad}; choose from {list(choices)}.')
  bad = [s for s in slices if isinstance(s, bool) or not isinstance(s, int) or s < 1]
  if bad:
    raise ValueError(f'`slices`: {bad} are not whole numbers of slices >= 1.')
  valid, invalid = [], []
  for combo in itertools.product(
    stages,
    layouts,
    micro_batches,
    remat,
    prefetch,
    offload,
    update_on,
    quantize,
    batch_per_chip,
    slices,
  ):
    c = Candidate(*combo)
    why = c.invalid()
    if why is None and c.layout != 'flat' and grid_dims < 2:
      why = 'the topology has one dimension'
    (valid.append(c) if why is None else invalid.append((c, why)))
  return valid, invalid


# -- compiling one candidate ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
  """Where and what to compile: the devices, their grid, the model and its training setup."""

  topology: str
  devices: tuple
  grid: tuple[int, ...]
  chip: Chip | None
  model: str | Callable[..., Any]  # a preset name, or a function of (remat, prefetch) -> ModelSpec
  optimizer: Callable[[], Any]
  mixed_precision: bool = False
  seq_len: int | None = None
  compute_dtype: Any = jnp.bfloat16
  attention_chunk: int | None = None  # presets: attention this many queries at a time
  attention: str = 'xla'  # presets: 'xla' or 'flash' (presets.ATTENTION)
  # The devices of S slices of the topology, slice by slice, for each S > 1 searched.
  slice_devices: tuple = ()

  def devices_for(self, slices: int) -> tuple:
    """The devices of `slices` slices of the topology."""
    if slices == 1:
      return self.devices
    found = dict(self.slice_devices).get(slices)
    if found is None:
      raise ValueError(f'the target has no devices for {slices} slices; make it with slices=.')
    return found


def _mesh(target: Target, c: Candidate):
  from jax.sharding import AxisType, Mesh

  if c.layout == 'flat':
    shape, names = (len(target.devices),), ('data',)
  else:
    shape, names = target.grid, ('x', 'y', 'z')[: len(target.grid)]
  devices = target.devices_for(c.slices)
  # Several slices: an outer 'slice' axis (data-parallel); `names` stays the ZeRO axes.
  full = ((c.slices, *shape), ('slice', *names)) if c.slices > 1 else (shape, names)
  mesh = Mesh(
    np.array(devices).reshape(full[0]), full[1], axis_types=(AxisType.Auto,) * len(full[1])
  )
  return mesh, names


def model_spec(target: Target, c: Candidate):
  """The `ModelSpec` a candidate compiles: the target's model with the candidate's remat and
  prefetch."""
  from zerojax._src.planner import presets

  if callable(target.model):
    return target.model(c.remat, c.prefetch)
  return presets.decoder_spec(
    target.model,
    seq_len=target.seq_len,
    compute_dtype=jnp.dtype(target.compute_dtype),
    remat=c.remat,
    prefetch_next=c.prefetch,
    attention_chunk=target.attention_chunk,
    attention=target.attention,
  )


def zero_options(c: Candidate, names: tuple[str, ...], stacked: Any = None) -> Options:
  """The `zerojax.Options` of a candidate, for a mesh with axes `names` and a model whose
  stacked layers are `stacked` (`ModelSpec.stacked`)."""
  from zerojax._src import quantize as quantize_lib

  q = QUANTIZE[c.quantize]
  return Options(
    axis=names[0] if len(names) == 1 else names,
    param_axis=names[-1] if c.layout == 'hpz' else None,
    offload=c.offload,
    update_on=c.update_on if c.offload is not None else 'device',
    quantize=None if q is None else quantize_lib.Quantize(**q, min_size=1 << 16),
    replica_axis='slice' if c.slices > 1 else None,
    stacked=stacked,
  )


def lower_candidate(target: Target, c: Candidate):
  """(traced step, plan, abstract state, batch, the floor's unit in bytes) of a candidate."""
  from jax.sharding import NamedSharding, PartitionSpec

  from zerojax._src import grad as grad_lib
  from zerojax._src import precision, train_state, transform

  mesh, names = _mesh(target, c)
  spec = model_spec(target, c)
  options = zero_options(c, names, spec.stacked)
  inner = target.optimizer()
  if target.mixed_precision:
    inner = precision.mixed_precision(inner)
  tx = transform.zero_optimizer(transform.make_config(inner, c.stage, mesh, options))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  extra = {'param_dtype': jnp.bfloat16} if target.mixed_precision else {}
  state = train_state.abstract_train_state(spec.init_fn, key, tx=tx, **extra)
  plan = transform.plan_for(state.tx, state.params)
  rows = spec.batch(c.batch_per_chip * mesh.devices.size)
  # The batch's rows over every chip: the data-parallel (slice) axes, then ZeRO's.
  over = options.axis if isinstance(options.axis, tuple) else (options.axis,)
  over = transform.config_of(state.tx).replica_axes + over
  over = over[0] if len(over) == 1 else over
  batch = jax.ShapeDtypeStruct(
    rows.shape, rows.dtype, sharding=NamedSharding(mesh, PartitionSpec(over))
  )
  grad_fn = grad_lib.value_and_grad(
    lambda p, b: spec.loss_fn(p, b, plan),
    state.tx,
    per_layer=c.stage >= 2 and c.layout != 'hpz',
    micro_batches=c.micro_batches,
  )

  def train_step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  if c.stage == 3:
    unit = jnp.dtype(target.compute_dtype).itemsize
  else:
    unit = max(jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params))
  traced = jax.jit(train_step, donate_argnums=0).trace(state, batch)
  return traced, plan, state, batch, unit


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


def updated_param_bytes(plan: Any, stage: int) -> int:
  """One chip's share of the parameters an offloaded update sends each way (the formula's
  unit): its shards at stage 3; below it the whole parameters it holds, split over the shards."""
  params = plan.bytes_per_device()['params']
  return params if stage == 3 else params // max(plan.num_shards, 1)


def host_traffic(program: Any, c: Any, host_bytes: int, param_bytes: int) -> dict:
  """Bytes over the host link per step and chip, and where the figure comes from.

  Counted in the compiled program (`count_host_transfers`: copies to and from
  host memory, slices of host buffers in layer loops, what host computations
  read and write) where it carries memory spaces, as the TPU compiler's does.
  XLA:CPU's carries none: there an offload's bytes come from the formula
  `host_transfer_bytes`, split evenly each way, with no overlap, and say so.

  Returns:
    {'to_host', 'to_device', 'largest_to_device', 'in_loops', 'overlapped' (share
    of the bytes), 'host_computations', 'source' ('hlo', 'formula' or 'none')}.
  """
  counted = hlo.count_host_transfers(program)
  if counted.to_host + counted.to_device:
    return {
      'to_host': counted.to_host,
      'to_device': counted.to_device,
      'largest_to_device': counted.largest_to_device,
      'in_loops': counted.in_loops,
      'overlapped': counted.overlapped,
      'host_computations': counted.host_computations,
      'source': 'hlo',
    }
  moved = host_transfer_bytes(c, host_bytes, param_bytes)
  return {
    'to_host': moved / 2,
    'to_device': moved / 2,
    'largest_to_device': None,
    'in_loops': None,
    'overlapped': 0.0,
    'host_computations': counted.host_computations,
    'source': 'formula' if moved else 'none',
  }


def evaluate(
  target: Target,
  c: Candidate,
  *,
  hbm_bytes: int | None,
  cache_dir: Any = None,
  memo: dict | None = None,
  compiler_options: dict[str, Any] | None = None,
  measure: bool = False,
) -> Result:
  """Theory first (states at rest, host bytes), then the compiled program's own figures.

  `cache_dir` and `memo` (`program_cache.compile_program`) let a program lowered before,
  in an earlier run or by an earlier candidate, be read back instead of compiled again.
  `compiler_options` go to the compiler with every candidate. With `measure`, a program
  compiled here that fits is also run (`measured_seconds`; on cpu:N).
  """
  from zerojax._src.planner import program_cache

  start = time.perf_counter()
  try:
    traced, plan, state, batch, unit = lower_candidate(target, c)
    lowered = traced.lower()
  except ValueError as e:  # zerojax's layout rules refuse it: a leaf that cannot be split so
    return Result(c, f'failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}')
  except Exception as e:  # anything else is a bug, never a candidate that does not fit
    e.add_note(f'zerojax plan search: raised while lowering the candidate {c}.')
    raise
  sizes = plan.bytes_per_device()
  result = Result(
    c, 'fits', theory_bytes=sizes['params'] + sizes['opt_state'], host_bytes=sizes['host']
  )
  result.phase_seconds['lower'] = time.perf_counter() - start
  chip = target.chip
  if hbm_bytes is not None and result.theory_bytes > hbm_bytes:
    result.status = 'pruned: states alone exceed HBM'
    return result
  if chip is not None and chip.host_bytes_per_chip and result.host_bytes > chip.host_bytes_per_chip:
    result.status = 'pruned: offloaded state exceeds host memory'
    return result
  start = time.perf_counter()
  try:
    done = program_cache.compile_program(
      lowered,
      topology=target.topology,
      cache_dir=cache_dir,
      memo=memo,
      compiler_options=compiler_options,
    )
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses what cannot fit
    if not runtime.is_out_of_memory(e):
      raise
    result.phase_seconds['compile'] = time.perf_counter() - start
    result.compile_seconds = sum(result.phase_seconds.values())
    recorded = isinstance(e, program_cache.RecordedCompileError)
    result.program_source = e.source if recorded else 'compiled'
    refusal = runtime.OutOfMemory.parse(str(e))
    result.status = 'over HBM: ' + refusal.summary()
    result.compiler_needs_gigabytes = refusal.needed_gigabytes
    return result
  result.phase_seconds['compile'] = done.seconds
  result.program_source = done.source
  result.compile_seconds = result.phase_seconds['lower'] + done.seconds
  start = time.perf_counter()
  _analyse(result, target, plan, unit, done.program, done.text, hbm_bytes)
  result.phase_seconds['analyse'] = time.perf_counter() - start
  if measure and result.fits and done.source == 'compiled':
    result.measured_seconds = _measure_cpu(done.program, state, batch)
  return result


def _analyse(result: Result, target: Target, plan, unit: int, compiled, text: str, hbm_bytes):
  """The compiled program's figures (memory, collectives, FLOPs, host link, predicted step)."""
  from zerojax._src.planner import report as report_lib

  c, chip = result.candidate, target.chip
  program = hlo.Program.parse(text)  # read once; every figure below is an analysis of it
  report = report_lib.step_report(compiled, plan=plan, bytes_per_param=unit, hlo_text=program)
  result.peak_bytes = report.memory.peak
  result.dcn_floor_bytes = report.dcn_floor_bytes
  result.floor_bytes = report.floor_bytes
  result.cost_analysis_flops, result.bytes_accessed = _cost(compiled)
  work = program_cost(chip, program)
  step = roofline.StepCost.of(report.collectives, work)
  for field in dataclasses.fields(step):
    setattr(result, field.name, getattr(step, field.name))
  result.peak_reported = not report.memory.host_held
  chip_hbm = chip is not None and hbm_bytes is not None and hbm_bytes >= chip.hbm_bytes
  if hbm_bytes is not None and result.peak_bytes > hbm_bytes:
    # A TPU program holding host memory has no device-only peak from the compiler; the
    # compiler itself refuses what does not fit its chip (RESOURCE_EXHAUSTED), so one it
    # compiled for the chip's own HBM fits.
    if not (report.memory.host_held and chip_hbm):
      result.status = 'over HBM'
  result.host_traffic = host_traffic(
    program, c, result.host_bytes, updated_param_bytes(plan, c.stage)
  )
  if chip is not None:
    moved = result.host_traffic['to_host'] + result.host_traffic['to_device']
    result.predicted = predict(chip, result, moved, result.host_traffic['overlapped'])


# -- the search ----------------------------------------------------------------------------


@dataclasses.dataclass
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
  from zerojax._src.planner import display

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
      finished(f'  {c.label():<60} {r.status} {_phases(r)}')
  report = SearchReport(target, results, list(invalid), time.perf_counter() - start, hbm)
  if progress:
    print(phase_summary(report), flush=True)
  return report


_SOURCE = {'cache': 'read back from the cache', 'memo': 'the same program as an earlier one'}


def _phases(r: Result) -> str:
  """'(lower 0.4 s, compile 31.2 s, analyse 0.9 s)', or how the program was reused."""
  if not r.phase_seconds:
    return ''
  parts = [f'{k} {v:.1f} s' for k, v in r.phase_seconds.items()]
  if r.program_source in _SOURCE:
    parts[1:2] = [_SOURCE[r.program_source]]
  return '(' + ', '.join(parts) + ')'


def phase_totals(report: SearchReport) -> tuple[dict[str, float], dict[str, int]]:
  """(seconds by phase, programs by where they came from: compiled, cache, memo)."""
  totals: dict[str, float] = {}
  for r in report.results:
    for k, v in r.phase_seconds.items():
      totals[k] = totals.get(k, 0.0) + v
  sources = [r.program_source for r in report.results if r.program_source]
  return totals, {s: sources.count(s) for s in ('compiled', 'cache', 'memo')}


def phase_summary(report: SearchReport) -> str:
  """Where a search's time went, by phase, and how many programs it compiled or reused."""
  totals, counts = phase_totals(report)
  return (
    f'search: {report.seconds:.1f} s for {len(report.results)} candidates: '
    + ', '.join(f'{k} {v:.1f} s' for k, v in totals.items())
    + f'; {counts["compiled"]} programs compiled, {counts["cache"]} read back from the cache,'
    f" {counts['memo']} the same as an earlier candidate's"
  )


def make_target(
  model: str | Callable[..., Any],
  topology: str,
  *,
  devices: Sequence[Any],
  optimizer: Callable[[], Any],
  mixed_precision: bool = False,
  seq_len: int | None = None,
  compute_dtype: Any = jnp.bfloat16,
  attention_chunk: int | None = None,
  attention: str = 'xla',
  slice_devices: Any = (),
) -> Target:
  """A `Target` for `topology` ('v5e:2x4', 'v5p:2x2x1', 'v6e:4x4' or 'cpu:N') and its devices
  (`slice_devices`: {S: the devices of S slices} for each S > 1 to search).

  Raises:
    ValueError: a topology without roofline constants, or a preset name that does not exist.
  """
  from zerojax._src.planner import presets

  chip_name, _, dims = topology.partition(':')
  if chip_name == 'cpu':
    grid, chip = (len(devices),), calibrate_cpu(len(devices))
  elif chip_name in CHIPS:
    grid, chip = tuple(int(d) for d in dims.lower().split('x')), CHIPS[chip_name]
  else:
    raise ValueError(
      f'`topology`={topology!r}: no roofline constants for {chip_name!r}; the search knows'
      f' {sorted(CHIPS)} and cpu:N.'
    )
  if isinstance(model, str) and model not in presets.PRESETS:
    raise ValueError(f'`model`={model!r} is not a preset; choose one of {sorted(presets.PRESETS)}.')
  for name, given in (('attention_chunk', attention_chunk), ('attention', attention != 'xla')):
    if given and not isinstance(model, str):
      raise ValueError(f'`{name}` is for the presets; a model function computes its own attention.')
  if attention not in presets.ATTENTION:
    raise ValueError(f'`attention`={attention!r}: choose one of {presets.ATTENTION}.')
  if dict(slice_devices) and not chip.dcn_bandwidth:
    raise ValueError(
      f'{chip_name} has no published data-center network bandwidth, so a step across slices'
      ' cannot be timed; search one slice, or a chip whose page gives it (v5e, v5p).'
    )
  return Target(
    topology,
    tuple(devices),
    grid,
    chip,
    model,
    optimizer,
    mixed_precision,
    seq_len,
    compute_dtype,
    attention_chunk,
    attention,
    tuple((s, tuple(d)) for s, d in dict(slice_devices).items()),
  )


def search_plans(
  model: str | Callable[..., Any],
  topology: str,
  *,
  optimizer: Callable[[], Any] | None = None,
  mixed_precision: bool = False,
  seq_len: int | None = None,
  attention_chunk: int | None = None,
  attention: str = 'xla',
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
    hbm_bytes: device memory per chip; default the chip's.
    progress: a progress bar with each candidate's outcome.
    cache_dir: keep compiled TPU programs here and read back those compiled before
      (`program_cache`; the command line's default is `program_cache.default_dir()`);
      None keeps none between runs.
    compiler_options: XLA or libtpu options every candidate is compiled with, as
      `jax.jit(..., compiler_options=...)` takes them.
    **space: `candidate_space`'s options (stages, layouts, micro_batches, remat,
      prefetch, offload, update_on, quantize, batch_per_chip, slices).

  Returns:
    A `SearchReport`; `search_report.format_search`, `search_json`, `plot_search` and `winner_code`
    present it.

  Raises:
    ValueError: an unknown topology, model or option value, or a space with no valid candidate.
  """
  import optax

  from zerojax._src.planner import tpu

  devices = tpu.topology_devices(topology)
  counts = sorted({s for s in space.get('slices', (1,)) if isinstance(s, int) and s > 1})
  target = make_target(
    model,
    topology,
    devices=devices,
    optimizer=optimizer or (lambda: optax.adamw(1e-4)),
    mixed_precision=mixed_precision,
    seq_len=seq_len,
    attention_chunk=attention_chunk,
    attention=attention,
    slice_devices={s: tpu.topology_devices(topology, s) for s in counts},
  )
  candidates, invalid = candidate_space(grid_dims=len(target.grid), **space)
  if not candidates:
    raise ValueError(f'these options leave no valid candidate: {why_none_valid(invalid)}.')
  return run_search(
    target,
    candidates,
    invalid=invalid,
    hbm_bytes=hbm_bytes,
    progress=progress,
    measure=topology.startswith('cpu:'),
    cache_dir=cache_dir,
    compiler_options=compiler_options,
  )


def why_none_valid(invalid: Sequence[tuple[Candidate, str]]) -> str:
  """Why a space has no valid candidate: the reasons that rule out every combination, or
  each reason with how many combinations it rules out."""
  counts: dict[str, int] = {}
  for c, _ in invalid:
    for why in c.reasons() or [_]:
      counts[why] = counts.get(why, 0) + 1
  everywhere = [why for why, n in counts.items() if n == len(invalid)]
  if everywhere:
    return '; '.join(everywhere) + ' (every combination)'
  return '; '.join(f'{why} ({n} of {len(invalid)})' for why, n in sorted(counts.items()))
