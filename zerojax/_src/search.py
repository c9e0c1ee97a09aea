"""Plan search: which ZeRO configuration for this model on this slice, answered before launch.

Every candidate (stage, mesh layout, micro-batches, rematerialisation, prefetch,
offload, quantization, batch per chip) is first checked against theory (its
model states at rest against HBM, its offloaded state against host memory),
and the survivors are compiled ahead of time for the real topology. Each
compiled program gives its own peak memory and collectives (ring bytes against
the ZeRO floor, bytes overlapped with compute); its FLOPs are counted on the
traced step with every loop iteration (XLA's cost analysis, also reported,
counts a loop body once); a roofline (`CHIPS`) turns those into a *predicted*
step time. The
ranking is by predicted time among the candidates that fit.

Predicted is not measured: the roofline counts compute at peak FLOPs,
collectives at the ICI bandwidth one torus axis
gets, less what the compiler overlaps with compute, and host transfers at the
host link's bandwidth. On `cpu:N` the constants are measured on this machine
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

from zerojax._src import gather as gather_lib

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """Roofline constants of one accelerator generation (per chip).

  Attributes:
    name: the topology prefix, e.g. 'v5e'.
    peak_flops: dense bf16 FLOP/s.
    hbm_bytes: HBM capacity.
    hbm_bandwidth: HBM bytes/s.
    ici_bandwidth: bidirectional inter-chip bytes/s, all ports together.
    torus_dims: dimensions of the torus; a collective over one mesh axis is
      taken to use that axis's ports: `ici_bandwidth / torus_dims`.
    host_bytes_per_chip: host DRAM divided by the chips of a host.
    host_link_bandwidth: host <-> chip bytes/s (assumed, see `source`).
    source: where the figures come from.
    collective_latency: seconds each collective costs beyond its bytes (measured
      on `cpu:N`; not modelled for TPUs, 0).
  """

  name: str
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float
  ici_bandwidth: float
  torus_dims: int
  host_bytes_per_chip: int
  host_link_bandwidth: float
  source: str
  collective_latency: float = 0.0

  @property
  def axis_bandwidth(self) -> float:
    return self.ici_bandwidth / self.torus_dims


# Figures from Google Cloud's TPU documentation pages (docs.cloud.google.com/tpu/docs/v5e,
# /v5p-training, /v6e). The host link is not published per chip: PCIe Gen4 x16 (32 GB/s) is
# assumed for v5e and v5p, Gen5 x16 (64 GB/s, the v6e page names Gen5) for v6e.
CHIPS = {
  'v5e': Chip('v5e', 197e12, 16 * GiB, 819e9, 400e9, 2, 512 * GiB // 8, 32e9,
              'v5e page: 197 TFLOP/s bf16, 16 GB HBM at 819 GB/s, 400 GB/s ICI (4 ports, 2-D'
              ' torus), 512 GiB DRAM per 8-chip host; host link PCIe Gen4 x16 assumed'),
  'v5p': Chip('v5p', 459e12, 95 * GiB, 2765e9, 1200e9, 3, 448 * 10**9 // 4, 32e9,
              'v5p page: 459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s, 1200 GB/s ICI (3-D torus),'
              ' 448 GB RAM per 4-chip VM; host link PCIe Gen4 x16 assumed'),
  'v6e': Chip('v6e', 918e12, 32 * GiB, 1638e9, 800e9, 2, 1536 * GiB // 8, 64e9,
              'v6e page: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, 800 GB/s ICI (4 ports, 2-D'
              ' torus), 1536 GiB DRAM per 8-chip host, PCIe Gen5 (x16 assumed)'),
}  # fmt: skip

QUANTIZE = {
  'none': None,
  'g8': dict(weights=None, grads='int8'),
  'g4': dict(weights=None, grads='int4'),
  'w8g8': dict(weights='int8', grads='int8'),
  'w8g4': dict(weights='int8', grads='int4'),
}
REMAT = ('gathers', 'full', 'none')
LAYOUTS = ('flat', 'torus', 'hpz')
OFFLOADS = ('none', 'opt_state', 'opt_state+master')


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
    offload: 'none', 'opt_state' or 'opt_state+master' (host memory).
    update_on: where an offloaded optimizer update runs: 'device' or 'host'.
    quantize: ZeRO++ collectives: 'none', 'g8', 'g4', 'w8g8', 'w8g4'.
    batch_per_chip: sequences per chip per step.
  """

  stage: int
  layout: str = 'flat'
  micro_batches: int = 1
  remat: str = 'full'
  prefetch: bool = False
  offload: str = 'none'
  update_on: str = 'device'
  quantize: str = 'none'
  batch_per_chip: int = 1

  def label(self) -> str:
    parts = [f's{self.stage}', self.layout, f'b{self.batch_per_chip}']
    parts += [f'mb{self.micro_batches}'] if self.micro_batches > 1 else []
    parts += [f'remat:{self.remat}'] + (['prefetch'] if self.prefetch else [])
    if self.offload != 'none':
      parts.append(f'offload:{self.offload}@{self.update_on}')
    return ' '.join(parts + ([f'q:{self.quantize}'] if self.quantize != 'none' else []))

  def reasons(self) -> list[str]:
    """Every reason this combination cannot run (empty: it can)."""
    rules = [
      (self.stage not in (1, 2, 3), 'stages 1-3 are searched'),
      (self.batch_per_chip % self.micro_batches, 'micro_batches does not divide batch_per_chip'),
      (self.prefetch and (self.stage != 3 or self.remat == 'none'),
       'prefetch is for stage 3 with remat'),
      (self.layout == 'hpz' and self.stage != 3, 'hpz splits stage-3 parameters'),
      (self.layout == 'hpz' and (self.prefetch or self.quantize != 'none'),
       'hpz runs without per-layer gathers'),
      (self.update_on == 'host' and self.offload == 'none', "update_on='host' needs an offload"),
      (self.quantize in ('w8g8', 'w8g4') and self.stage != 3,
       'quantized weights are gathered at stage 3 only'),
    ]  # fmt: skip
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
  collective_count: int = 0
  flops: float = 0.0  # traced, loops counted per iteration (`traced_flops`)
  cost_analysis_flops: float = 0.0  # XLA's, loop bodies counted once
  bytes_accessed: float = 0.0
  predicted: dict = dataclasses.field(default_factory=dict)  # seconds, by part
  compile_seconds: float = 0.0
  measured_seconds: float | None = None

  @property
  def fits(self) -> bool:
    return self.status == 'fits'

  @property
  def step_seconds(self) -> float:
    return self.predicted.get('step', math.inf)


# -- the roofline ----------------------------------------------------------------------


def predict(chip: Chip, r: Result, host_transfer_bytes: float) -> dict[str, float]:
  """Predicted seconds per step: compute, collectives (exposed part), host transfers.

  compute = FLOPs / peak (HBM traffic is not modelled: XLA's byte count, like its
  FLOP count, sees each loop body once); collectives = ring bytes /
  one axis's ICI bandwidth (plus a latency per collective where one is known),
  of which the overlapped share hides under compute;
  host = offloaded bytes moved / host link bandwidth.
  """
  compute = r.flops / chip.peak_flops
  comm = r.ring_bytes / chip.axis_bandwidth + r.collective_count * chip.collective_latency
  share = r.overlapped_bytes / r.ring_bytes if r.ring_bytes else 0.0
  exposed = comm * (1 - share)
  host = host_transfer_bytes / chip.host_link_bandwidth
  step = max(compute, comm * share) + exposed + host
  return {'compute': compute, 'collectives': comm, 'exposed': exposed, 'host': host, 'step': step}


def host_transfer_bytes(c: Candidate, host_bytes: int, param_bytes: int) -> float:
  """Bytes crossing the host link per step and chip for an offload.

  Streamed to the device for the update (`update_on='device'`): the offloaded
  state comes down and goes back up. Updated on the host: gradient shards go
  down and the updates come up (the parameters' size each way).
  """
  if c.offload == 'none':
    return 0.0
  return 2.0 * (host_bytes if c.update_on == 'device' else param_bytes)


def calibrate_cpu(num_devices: int, size: int = 1024, repeats: int = 5) -> Chip:
  """Roofline constants of this machine's faked devices, measured: a matmul's FLOP/s and a
  copy's bytes/s on the whole machine, divided among the `num_devices` that share it."""
  x = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  copy = jax.jit(lambda a: a + 1.0)

  def best(fn):
    fn(x).block_until_ready()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn(x).block_until_ready()
      times.append(time.perf_counter() - start)
    return min(times)

  flops = 2 * size**3 / best(matmul)
  bandwidth = 2 * x.nbytes / best(copy)
  # One small all-reduce over every device: what a collective costs beyond its bytes.
  mesh = jax.make_mesh((num_devices,), ('d',), devices=jax.devices()[:num_devices])
  one = jax.device_put(jnp.ones((num_devices,)), jax.sharding.NamedSharding(mesh, jax.P('d')))
  psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, 'd'), mesh=mesh, in_specs=jax.P('d'),
                               out_specs=jax.P('d')))  # fmt: skip
  latency = best(lambda _: psum(one))
  return Chip(
    'cpu', flops / num_devices, 0, bandwidth / num_devices, bandwidth / num_devices, 1,
    0, bandwidth / num_devices,
    f'measured here: {flops / 1e9:.1f} GFLOP/s (f32 matmul {size}^2), {bandwidth / 1e9:.1f} GB/s'
    f' (elementwise), {latency * 1e6:.0f} us per all-reduce; shared by {num_devices} faked devices',
    collective_latency=latency,
  )  # fmt: skip


# -- the candidate space -----------------------------------------------------------------


def candidate_space(
  *,
  stages: Sequence[int] = (1, 2, 3),
  layouts: Sequence[str] = ('flat', 'torus'),
  micro_batches: Sequence[int] = (1,),
  remat: Sequence[str] = ('gathers', 'full'),
  prefetch: Sequence[bool] = (False, True),
  offload: Sequence[str] = ('none',),
  update_on: Sequence[str] = ('device',),
  quantize: Sequence[str] = ('none',),
  batch_per_chip: Sequence[int] = (1,),
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
    ('update_on', update_on, ('device', 'host')),
    ('quantize', quantize, tuple(QUANTIZE)),
  ):
    bad = [v for v in values if v not in choices]
    if bad:
      raise ValueError(f'`{name}`: unknown {bad}; choose from {list(choices)}.')
  valid, invalid = [], []
  for combo in itertools.product(
    stages, layouts, micro_batches, remat, prefetch, offload, update_on, quantize, batch_per_chip
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


def _mesh(target: Target, c: Candidate):
  from jax.sharding import AxisType, Mesh

  if c.layout == 'flat':
    shape, names = (len(target.devices),), ('data',)
  else:
    shape, names = target.grid, ('x', 'y', 'z')[: len(target.grid)]
  mesh = Mesh(
    np.array(target.devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names)
  )
  return mesh, names


def _spec(target: Target, c: Candidate):
  from zerojax._src import presets

  if callable(target.model):
    return target.model(c.remat, c.prefetch)
  return presets.decoder_spec(
    target.model,
    seq_len=target.seq_len,
    compute_dtype=jnp.dtype(target.compute_dtype),
    remat={'gathers': 'gathers', 'full': True, 'none': False}[c.remat],
    prefetch_next=c.prefetch,
  )


def zero_options(c: Candidate, names: tuple[str, ...]) -> dict[str, Any]:
  """The `zero_stage` options of a candidate, for a mesh with axes `names`."""
  from zerojax._src import quantize as quantize_lib

  options: dict[str, Any] = {'axis': names[0] if len(names) == 1 else names}
  if c.layout == 'hpz':
    options['param_axis'] = names[-1]
  if c.offload != 'none':
    options.update(offload=c.offload, update_on=c.update_on)
  if QUANTIZE[c.quantize] is not None:
    options['quantize'] = quantize_lib.Quantize(**QUANTIZE[c.quantize], min_size=1 << 16)
  return options


def lower_candidate(target: Target, c: Candidate):
  """(traced step, plan, abstract state, batch, the floor's unit in bytes) of a candidate."""
  from jax.sharding import NamedSharding, PartitionSpec

  from zerojax._src import grad as grad_lib
  from zerojax._src import precision, train_state, transform

  mesh, names = _mesh(target, c)
  spec = _spec(target, c)
  options = zero_options(c, names)
  inner = target.optimizer()
  if target.mixed_precision:
    inner = precision.mixed_precision(inner)
  tx = transform.zero_optimizer(inner, c.stage, mesh=mesh, **options)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  extra = {'param_dtype': jnp.bfloat16} if target.mixed_precision else {}
  state = train_state.abstract_train_state(spec.init_fn, key, tx=tx, **extra)
  plan = transform.plan_for(state.tx, state.params)
  rows = spec.batch(c.batch_per_chip * len(target.devices))
  batch = jax.ShapeDtypeStruct(
    rows.shape, rows.dtype, sharding=NamedSharding(mesh, PartitionSpec(options['axis']))
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


def traced_flops(jaxpr: Any) -> float:
  """Matmul and convolution FLOPs of a traced step, per device, loops counted per iteration.

  XLA's `cost_analysis()` counts a `while` body once, so a scanned model's FLOPs
  come out about one layer's worth; this walks the jaxpr instead: a scan's body
  counts `length` times, rematerialised code as often as it runs. Inside
  `shard_map` shapes are per device, which is where `value_and_grad` runs the
  model; operations outside it count at their global size.

  Raises:
    ValueError: a `while` loop with a matmul inside (its trip count is not in the
      jaxpr, and it is not guessed).
  """
  total = 0.0
  for eqn in getattr(jaxpr, 'jaxpr', jaxpr).eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      (lhs_contract, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    elif name == 'conv_general_dilated':
      rhs = eqn.invars[1].aval.shape  # kernel: out features, in features / groups, window...
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[1:])
    elif name == 'scan':
      total += eqn.params['length'] * traced_flops(eqn.params['jaxpr'])
    elif name == 'while':
      if traced_flops(eqn.params['body_jaxpr']):
        raise ValueError('a while loop with matmuls: its trip count is not in the jaxpr')
    elif name == 'cond':
      total += max(traced_flops(b) for b in eqn.params['branches'])
    else:
      total += sum(traced_flops(sub) for sub in gather_lib.sub_jaxprs(eqn))
  return total


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


def _oom_summary(message: str) -> str:
  """The compiler's own figure from an out-of-memory error, e.g. 'needs 15.85G of 15.75G'."""
  import re

  found = re.search(
    r'required for ([^(]*)\(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)', message
  )
  if found:
    return f'{found.group(1).strip()} need {found.group(2)} of {found.group(3)} (compiler)'
  found = re.search(r'Used ([\d.]+\w?) of ([\d.]+\w?) hbm', message)
  if found:
    return f'needs {found.group(1)} of {found.group(2)} (compiler)'
  return message.splitlines()[0][:120]


def evaluate(target: Target, c: Candidate, *, hbm_bytes: int | None) -> Result:
  """Theory first (states at rest, host bytes), then the compiled program's own figures."""
  from zerojax._src import report as report_lib

  start = time.perf_counter()
  try:
    traced, plan, state, batch, unit = lower_candidate(target, c)
  except (ValueError, TypeError) as e:  # e.g. a leaf that cannot be split this way
    return Result(c, f'failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}')
  sizes = plan.bytes_per_device()
  result = Result(
    c, 'fits', theory_bytes=sizes['params'] + sizes['opt_state'], host_bytes=sizes['host']
  )
  chip = target.chip
  if hbm_bytes is not None and result.theory_bytes > hbm_bytes:
    result.status = 'pruned: states alone exceed HBM'
    return result
  if chip is not None and chip.host_bytes_per_chip and result.host_bytes > chip.host_bytes_per_chip:
    result.status = 'pruned: offloaded state exceeds host memory'
    return result
  try:
    compiled = traced.lower().compile()
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses what cannot fit
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    result.compile_seconds = time.perf_counter() - start
    result.status = 'over HBM: ' + _oom_summary(str(e))
    return result
  result.compile_seconds = time.perf_counter() - start
  try:
    report = report_lib.step_report(compiled, plan=plan, bytes_per_param=unit)
  except jax.errors.JaxRuntimeError as e:  # the compiled HLO could not be printed
    result.status = f'failed: its compiled HLO cannot be read here ({str(e).splitlines()[0][:100]})'
    return result
  result.peak_bytes = report.memory.peak
  result.ring_bytes = report.collectives.total_ring_bytes
  result.overlapped_bytes = sum(report.collectives.overlapped_ring_bytes.values())
  result.collective_count = sum(report.collectives.counts.values())
  result.floor_bytes = report.floor_bytes
  result.cost_analysis_flops, result.bytes_accessed = _cost(compiled)
  result.flops = traced_flops(traced.jaxpr)
  if hbm_bytes is not None and result.peak_bytes > hbm_bytes:
    result.status = 'over HBM'
  if chip is not None:
    param_bytes = sizes['params'] if c.stage == 3 else sizes['params'] // max(plan.num_shards, 1)
    moved = host_transfer_bytes(c, result.host_bytes, param_bytes)
    result.predicted = predict(chip, result, moved)
  result._compiled = compiled  # kept for a measured run on cpu:N
  result._state, result._batch = state, batch
  return result


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


def _measure_cpu(result: Result, steps: int = 5) -> float:
  """Median seconds of the compiled step on the faked CPU devices, after one warm-up step."""
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), result._state)
  batch = result._batch
  tokens = jnp.zeros(batch.shape, batch.dtype, device=batch.sharding)
  times = []
  for i in range(steps + 1):
    start = time.perf_counter()
    state, loss = result._compiled(state, tokens)
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
) -> SearchReport:
  """Evaluates every candidate (theory, then the compiled program) and ranks them.

  Args:
    target: the topology, model and training setup.
    candidates: from `candidate_space`.
    invalid: combinations left out, with why (reported, not compiled).
    hbm_bytes: device memory per chip; default the chip's (`CHIPS`).
    progress: show a progress bar with each candidate's outcome.
    measure: on `cpu:N`, run each fitting candidate's step and record its median
      time beside the prediction.

  Returns:
    A `SearchReport`.
  """
  from rich.progress import Progress

  start = time.perf_counter()
  hbm = hbm_bytes if hbm_bytes is not None else (target.chip.hbm_bytes or None)
  results = []
  with Progress(disable=not progress, transient=False) as bar:
    task = bar.add_task('compiling candidates', total=len(candidates))
    for c in candidates:
      bar.update(task, description=f'{c.label():<60}')
      r = evaluate(target, c, hbm_bytes=hbm)
      if measure and r.fits:
        r.measured_seconds = _measure_cpu(r)
      for attr in ('_compiled', '_state', '_batch'):  # free the compiled program
        r.__dict__.pop(attr, None)
      results.append(r)
      bar.console.print(f'  {c.label():<60} {r.status}', soft_wrap=True)
      bar.advance(task)
  return SearchReport(target, results, list(invalid), time.perf_counter() - start, hbm)


# -- reporting ----------------------------------------------------------------------------


def winner_code(report: SearchReport) -> str:
  """The lines to paste for the winning candidate: its mesh, optimizer and gradient function."""
  r = report.winner
  if r is None:
    return '# no candidate fits'
  c, t = r.candidate, report.target
  if c.layout == 'flat':
    mesh = f"mesh = jax.make_mesh(({len(t.devices)},), ('data',))"
    names = ('data',)
  else:
    names = ('x', 'y', 'z')[: len(t.grid)]
    mesh = f'mesh = jax.make_mesh({tuple(t.grid)}, {names})'
  options = zero_options(c, names)
  args = [f'stage={c.stage}', 'mesh=mesh', f'axis={options.pop("axis")!r}']
  quantize = options.pop('quantize', None)
  args += [f'{k}={v!r}' for k, v in options.items()]
  if quantize is not None:
    q = QUANTIZE[c.quantize]
    args.append(f'quantize=zerojax.Quantize(weights={q["weights"]!r}, grads={q["grads"]!r})')
  inner = 'optax.adamw(lr)'
  if t.mixed_precision:
    inner = f'zerojax.mixed_precision({inner})'
  remat = {
    'gathers': 'policy=zerojax.recompute_gathers',
    'full': 'a full jax.checkpoint',
    'none': 'no rematerialisation',
  }[c.remat]
  scan_remat = "remat='gathers'" if c.remat == 'gathers' else "remat='full'"
  loop = (
    f'zerojax.scan_layers({scan_remat}, prefetch)'
    if c.prefetch
    else f'a scanned layer loop with {remat}'
  )
  return '\n'.join(
    [
      mesh,
      f'tx = zerojax.zero_stage({inner}, {", ".join(args)})',
      f'grad_fn = zerojax.value_and_grad(loss_fn, tx, per_layer={c.stage >= 2 and c.layout != "hpz"}'
      + (f', micro_batches={c.micro_batches}' if c.micro_batches > 1 else '')
      + ')',
      f'# {c.batch_per_chip} sequence(s) per chip per step; layers in {loop}',
    ]
  )


def _gib(n: float) -> str:
  return f'{n / GiB:.2f}'


def format_search(report: SearchReport, limit: int = 40) -> str:
  """The ranked table (predicted times are labelled as such)."""
  t = report.target
  chip = t.chip
  lines = [
    f'plan search: {t.model if isinstance(t.model, str) else "custom model"} on {t.topology}'
    f' ({len(t.devices)} chips); {len(report.results)} candidates evaluated,'
    f' {len(report.invalid)} combinations not valid, in {report.seconds:.0f} s',
  ]
  if chip is not None:
    lines.append(f'roofline ({chip.name}): {chip.source}')
  measured = any(r.measured_seconds for r in report.results)
  head = f'{"#":>3} {"candidate":<60} {"peak GiB":>8} {"ring/floor":>10} {"overlap":>7}'
  head += f' {"TFLOP/chip":>10} {"predicted s":>11}' + (
    f' {"measured s":>10} {"pred/meas":>9}' if measured else ''
  )
  lines += ['', head]
  for i, r in enumerate([r for r in report.ranked if r.fits][:limit], 1):
    ratio = r.ring_bytes / r.floor_bytes if r.floor_bytes else float('nan')
    share = r.overlapped_bytes / r.ring_bytes if r.ring_bytes else 0.0
    row = f'{i:>3} {r.candidate.label():<60} {_gib(r.peak_bytes):>8} {ratio:>10.3f}'
    row += f' {share:>7.0%} {r.flops / 1e12:>10.2f} {r.step_seconds:>11.4f}'
    if measured:
      m = r.measured_seconds
      row += f' {m:>10.4f} {r.step_seconds / m:>9.2f}' if m else f' {"":>10} {"":>9}'
    lines.append(row)
  not_fitting = [r for r in report.results if not r.fits]
  if not_fitting:
    lines += ['', 'why the others do not run:']
    lines += [f'  {r.candidate.label():<60} {r.status}' for r in not_fitting]
  lines += ['', 'winner (predicted, not measured):' if report.winner else 'no candidate fits']
  lines += ['  ' + line for line in winner_code(report).splitlines()]
  return '\n'.join(lines)


def search_json(report: SearchReport) -> dict:
  t = report.target
  rows = []
  for rank, r in enumerate(report.ranked, 1):
    rows.append(
      {
        'rank': rank,
        'candidate': dataclasses.asdict(r.candidate),
        'label': r.candidate.label(),
        'status': r.status,
        'fits': r.fits,
        'theory_state_bytes': r.theory_bytes,
        'host_bytes': r.host_bytes,
        'peak_bytes': r.peak_bytes,
        'ring_bytes': r.ring_bytes,
        'floor_bytes': r.floor_bytes,
        'overlapped_ring_bytes': r.overlapped_bytes,
        'flops': r.flops,
        'cost_analysis_flops': r.cost_analysis_flops,
        'bytes_accessed': r.bytes_accessed,
        'predicted_seconds': r.predicted,
        'measured_seconds': r.measured_seconds,
        'compile_seconds': r.compile_seconds,
      }
    )
  return {
    'model': t.model if isinstance(t.model, str) else 'custom',
    'topology': t.topology,
    'num_devices': len(t.devices),
    'mixed_precision': t.mixed_precision,
    'seq_len': t.seq_len,
    'roofline': None if t.chip is None else dataclasses.asdict(t.chip),
    'search_seconds': report.seconds,
    'invalid': [{'candidate': c.label(), 'why': why} for c, why in report.invalid],
    'results': rows,
    'winner_code': winner_code(report),
  }


def plot_search(report: SearchReport, path: str) -> None:
  """Predicted step time against peak memory per chip, one point per compiled candidate."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  compiled = [r for r in report.results if r.peak_bytes]
  for fits, colour, name in ((True, 'tab:blue', 'fits'), (False, 'tab:red', 'over HBM')):
    pts = [r for r in compiled if r.fits == fits and r.predicted]
    ax.scatter(
      [r.peak_bytes / GiB for r in pts], [r.step_seconds for r in pts], c=colour, label=name
    )
  win = report.winner
  if win is not None:
    ax.scatter([win.peak_bytes / GiB], [win.step_seconds], s=200, facecolors='none',
               edgecolors='black', label='winner')  # fmt: skip
  if report.target.chip is not None and report.target.chip.hbm_bytes:
    ax.axvline(report.target.chip.hbm_bytes / GiB, color='grey', ls='--', label='HBM per chip')
  ax.set_xlabel('peak memory per chip, GiB (compiled program)')
  ax.set_ylabel('predicted step time, s (roofline, not measured)')
  ax.set_title(f'{report.target.model} on {report.target.topology}: plan search')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _gigabytes(status: str) -> float | None:
  """The first 'NN.NNG' figure of an out-of-memory status, or None."""
  import re

  found = re.search(r'need[s]? ([\d.]+)G', status)
  return float(found.group(1)) if found else None


def nothing_fits(report: SearchReport) -> str:
  """What to do when no candidate fits: the closest one, and the slice the states need."""
  t = report.target
  hbm = report.hbm_bytes or 0
  compiled = [r for r in report.results if r.peak_bytes]
  lines = [f'no candidate fits on {t.topology} ({len(t.devices)} chips).']
  if compiled:
    best = min(compiled, key=lambda r: r.peak_bytes)
    lines.append(f'closest: {best.candidate.label()} at {_gib(best.peak_bytes)} GiB peak per chip.')
  refused = [(_gigabytes(r.status), r) for r in report.results if _gigabytes(r.status)]
  if refused:
    need, best = min(refused, key=lambda x: x[0])
    lines.append(
      f'closest the compiler refused: {best.candidate.label()}: {best.status}, beside'
      f' {_gib(best.theory_bytes)} GiB of model states at rest per chip.'
    )
  states = [r.theory_bytes for r in report.results if r.theory_bytes]
  if states and hbm:
    need = min(states) * len(t.devices)
    chips = math.ceil(need / hbm)
    lines.append(
      f'the model states alone (params + optimizer state at rest, least of the candidates)'
      f' total {need / GiB:,.0f} GiB: at least {chips} chips of {hbm / GiB:.0f} GiB before'
      ' activations and gradients. Try --offloads opt_state,opt_state+master with'
      ' --mixed-precision, --stages 3, or a larger slice.'
    )
  return '\n'.join(lines)


def make_target(
  model: str | Callable[..., Any],
  topology: str,
  *,
  devices: Sequence[Any],
  optimizer: Callable[[], Any],
  mixed_precision: bool = False,
  seq_len: int | None = None,
  compute_dtype: Any = jnp.bfloat16,
) -> Target:
  """A `Target` for `topology` ('v5e:2x4', 'v5p:2x2x1', 'v6e:4x4' or 'cpu:N') and its devices.

  Raises:
    ValueError: a topology without roofline constants, or a preset name that does not exist.
  """
  from zerojax._src import presets

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
  return Target(
    topology, tuple(devices), grid, chip, model, optimizer, mixed_precision, seq_len, compute_dtype
  )


def search_plans(
  model: str | Callable[..., Any],
  topology: str,
  *,
  optimizer: Callable[[], Any] | None = None,
  mixed_precision: bool = False,
  seq_len: int | None = None,
  hbm_bytes: int | None = None,
  progress: bool = True,
  **space: Any,
) -> SearchReport:
  """Which ZeRO configuration for `model` on `topology`: every candidate compiled ahead of time.

  Args:
    model: a preset name ('tiny', 'llama2-7b', ...) or a function `(remat, prefetch)`
      returning a `zerojax.ModelSpec`.
    topology: a TPU topology ('v5e:2x4', 'v5p:2x2x1', 'v6e:4x4'; needs libtpu) or 'cpu:N'
      (the faked CPU devices, where each fitting candidate's step is also run and timed).
    optimizer: makes the optax optimizer; default `optax.adamw(1e-4)`.
    mixed_precision: bf16 parameters and gradients, fp32 master in the optimizer state.
    seq_len: the preset's sequence length, or this.
    hbm_bytes: device memory per chip; default the chip's.
    progress: a progress bar with each candidate's outcome.
    **space: `candidate_space`'s options (stages, layouts, micro_batches, remat,
      prefetch, offload, update_on, quantize, batch_per_chip).

  Returns:
    A `SearchReport`; `format_search`, `search_json`, `plot_search` and `winner_code`
    present it.

  Raises:
    ValueError: an unknown topology, model or option value, or a space with no valid candidate.
  """
  import optax

  from zerojax._src import tpu

  devices = tpu.topology_devices(topology)
  target = make_target(
    model,
    topology,
    devices=devices,
    optimizer=optimizer or (lambda: optax.adamw(1e-4)),
    mixed_precision=mixed_precision,
    seq_len=seq_len,
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
