"""The candidates of a plan search: one configuration to try (`Candidate`: stage, mesh layout,
tensor-parallel degree, micro-batches, rematerialisation, prefetch, offload, ZeRO++, batch per
chip, slices, the TPU scheduler's share of HBM), and the space of them a search compiles, each
combination that cannot run left out with why."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from zerojax._src.options import OFFLOADS, UPDATE_ON
from zerojax._src.planner.presets import POLICIES, REMAT
from zerojax._src.planner.roofline import CHIPS, prices_host_link

QUANTIZE = {
  None: None,
  'g8': dict(weights=None, grads='int8'),
  'g4': dict(weights=None, grads='int4'),
  'w8g8': dict(weights='int8', grads='int8'),
  'w8g4': dict(weights='int8', grads='int4'),
}


LAYOUTS = ('flat', 'torus', 'hpz')

# The TPU compiler's option for the share of HBM (percent) its latency-hiding scheduler plans
# within. At the compiler's default the scheduler fills spare HBM by gathering later
# layers' weights early; held lower, the same program holds less.
SCHEDULER_OPTION = 'xla_tpu_scheduler_percent_shared_memory_limit'

# The remats a plan compiles lean, holding the least it can at about the same step: the TPU
# scheduler held to LEAN_SHARE percent of HBM, and the presets' head gathered after the layer
# loop with a one-hot cross-entropy (`presets.decoder_loss(lean_head=True)`). Full
# rematerialisation is what a plan chooses when memory is short. LEAN_SHARE is the largest share
# of those benchmarks/bench_memory.py sweeps (50, 55, 60, 70 and the compiler's own) at which
# the plan of every one of MaxText's v5e rows and of the 70B plan peaks at or under MaxText's own
# program on the same compiler (libtpu 0.0.50): at 60 the 16B row is 0.15 GiB over; 55 costs up
# to 2% of the step against 60 on the 64B row and the 70B plan (docs/results.md, "Memory at
# MaxText's settings"). Under 'minimal' on MaxText's v5p rows, holding the scheduler back is
# predicted 5% to 7% slower on 64B and 128B, so the other remats keep the compiler's default.
LEAN_REMATS = ('full',)
LEAN_SHARE = 55

# The TPU compiler's options that run the collectives on the chip's SparseCores
# (`roofline.Chip.sparse_cores`) as asynchronous calls, beside the TensorCores' work, where by
# default it keeps ZeRO's all-gathers and reduce-scatters on the TensorCores, synchronous on
# v5p. MaxText's v5p 32B script sets the first for its all-gathers; the others extend it to the
# reduce-scatters, the all-reduces and the gathers over two and three torus dimensions.
SPARSECORE_OPTIONS = {
  f'xla_tpu_enable_sparse_core_collective_offload_{kind}': True
  for kind in (
    'all_gather',
    '2d_all_gather',
    '3d_all_gather',
    'reduce_scatter',
    'nd_reduce_scatter',
    'all_reduce',
  )
}
COLLECTIVE_OFFLOADS = (None, 'sparsecore')


def lean(remat: str) -> bool:
  """Whether a plan under `remat` compiles the least-memory step (`LEAN_REMATS`)."""
  return remat in LEAN_REMATS


def default_scheduler_share(
  remat: str, topology: str, compiler_options: dict[str, Any] | None = None
) -> int | None:
  """The scheduler share a plan or a search compiles `remat` with unless told: `LEAN_SHARE`
  for `LEAN_REMATS` on a TPU, None (the compiler's default) otherwise, on cpu:N, or where
  `compiler_options` sets `SCHEDULER_OPTION` itself.

  >>> default_scheduler_share('full', 'v5e:16x16'), default_scheduler_share('minimal', 'v5p:4x4x4')
  (55, None)
  >>> print(default_scheduler_share('full', 'cpu:8'))
  None
  """
  if topology.startswith('cpu:') or SCHEDULER_OPTION in (compiler_options or {}):
    return None
  return LEAN_SHARE if lean(remat) else None


def with_default_shares(
  space: Sequence[Candidate], topology: str, compiler_options: dict[str, Any] | None = None
) -> list[Candidate]:
  """`space` with each candidate's share set by `default_scheduler_share` (for a plan or
  search not given any)."""
  return [
    dataclasses.replace(
      c, scheduler_share=default_scheduler_share(c.remat, topology, compiler_options)
    )
    for c in space
  ]


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
      'full' (each block recomputed), 'none', or a policy of the presets' `POLICIES`.
    prefetch: gather block i+1 while block i computes (`zerojax.scan_layers`).
    offload: None, 'opt_state' or 'opt_state+master' (host memory), as `zerojax.Options`.
    update_on: where an offloaded optimizer update runs: 'device', 'host' or 'stream'
      (on the host, gradients sent down layer by layer), as `zerojax.Options`.
    quantize: ZeRO++ collectives: None, 'g8', 'g4', 'w8g8', 'w8g4' (see `QUANTIZE`).
    batch_per_chip: sequences per chip per step.
    slices: TPU slices of the topology, joined by the data-center network: an outer 'slice'
      mesh axis, data-parallel (hierarchical ZeRO: state split within each slice).
    scheduler_share: percent of HBM the TPU compiler's latency-hiding scheduler plans within
      (`SCHEDULER_OPTION`), or None for the compiler's default (and on CPU).
    tensor: the size of a tensor-parallel mesh axis (Megatron-style: heads, MLP columns,
      vocabulary) beside the 'flat' layout's ZeRO axis, innermost, so each group of `tensor`
      neighbouring chips splits every layer; 1: none. The step takes its gradients through
      `jax.value_and_grad` (the compiler places the tensor-parallel collectives).
    collective_offload: 'sparsecore' runs the step's collectives on the chip's SparseCores
      (`SPARSECORE_OPTIONS`), asynchronous beside the TensorCores; None leaves them where the
      compiler puts them.
    offload_params: the parameters at rest in host memory (`Options.offload_params`): at
      stage 3 with per-layer gathers each layer's shard comes to the device in the layer loop.
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
  scheduler_share: int | None = None
  tensor: int = 1
  collective_offload: str | None = None
  offload_params: bool = False

  def label(self) -> str:
    parts = [f's{self.stage}', self.layout] + ([f't{self.tensor}'] if self.tensor > 1 else [])
    parts += [f'b{self.batch_per_chip}']
    parts += [f'x{self.slices} slices'] if self.slices > 1 else []
    parts += [f'mb{self.micro_batches}'] if self.micro_batches > 1 else []
    parts += [f'remat:{self.remat}'] + (['prefetch'] if self.prefetch else [])
    if self.offload is not None:
      parts.append(
        f'offload:{self.offload}{"+params" if self.offload_params else ""}@{self.update_on}'
      )
    parts += [f'q:{self.quantize}'] if self.quantize is not None else []
    parts += [f'sched:{self.scheduler_share}%'] if self.scheduler_share else []
    return ' '.join(
      parts + ([f'{self.collective_offload} collectives'] if self.collective_offload else [])
    )

  def compiler_options(self, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options this candidate compiles with: `given` (a plan's --compiler-option), its
    scheduler share and its collective offload, as `jax.jit(..., compiler_options=...)` takes
    them."""
    share = {} if self.scheduler_share is None else {SCHEDULER_OPTION: self.scheduler_share}
    offload = SPARSECORE_OPTIONS if self.collective_offload == 'sparsecore' else {}
    return {**(given or {}), **share, **offload}

  def reasons(self) -> list[str]:
    """Every reason this combination cannot run (empty: it can)."""
    rules = [
      (self.stage not in (1, 2, 3), 'stages 1-3 are searched'),
      (self.batch_per_chip % self.micro_batches, 'micro_batches does not divide batch_per_chip'),
      (
        self.prefetch and (self.stage != 3 or self.remat == 'none'),
        'prefetch is for stage 3 with remat',
      ),
      (
        self.prefetch and self.remat in POLICIES,
        'prefetch runs remat gathers or full: its layer loop keeps no named activations',
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
        self.offload_params and (self.offload is None or self.update_on == 'device'),
        'offload_params updates the parameters where they live: an offload updated on the host',
      ),
      (
        self.quantize in ('w8g8', 'w8g4') and self.stage != 3,
        'quantized weights are gathered at stage 3 only',
      ),
      (
        self.slices > 1 and self.update_on == 'stream',
        "update_on='stream' sends gradient shards down before they are summed across slices",
      ),
      (self.tensor > 1 and self.layout != 'flat', "a tensor axis sits beside the 'flat' layout"),
      (
        self.tensor > 1 and (self.prefetch or self.micro_batches > 1 or self.update_on == 'stream'),
        'a tensor axis takes gradients through jax.value_and_grad: no prefetch, micro-batches'
        " or update_on='stream' (those are zerojax.value_and_grad's)",
      ),
    ]
    return [why for broken, why in rules if broken]

  def invalid(self) -> str | None:
    """Why this combination cannot run (the first reason), or None."""
    return next(iter(self.reasons()), None)


# The rematerialisation a search of the presets tries unless told: both full recomputations
# ('gathers' keeps the activations; 'full', MaxText's setting, keeps neither), MaxText's
# 'minimal' and 'none'; where the chip's host link has figures, the offloading policies that
# won MaxText's rows in benchmarks/bench_recompute.py too: the fastest (offload_minimal) and the
# one with the least HBM (offload_minimal_inputs, the layer loop's inputs on the host as well).
SEARCH_REMATS = ('gathers', 'full', 'minimal', 'none')
SEARCH_OFFLOAD_REMATS = ('offload_minimal', 'offload_minimal_inputs')


def default_remats(chip, preset: bool = True) -> tuple[str, ...]:
  """What a search tries for rematerialisation where it is not given: `SEARCH_REMATS`, with
  `SEARCH_OFFLOAD_REMATS` where `chip` (a `roofline` chip, or None) prices the host link; for a
  model that runs its own layer loop (`preset=False`), 'gathers' alone (the remat is its own).

  >>> default_remats(None)
  ('gathers', 'full', 'minimal', 'none')
  """
  if not preset:
    return ('gathers',)
  return SEARCH_REMATS + (SEARCH_OFFLOAD_REMATS if prices_host_link(chip) else ())


def check_scheduler_shares(
  topology: str,
  shares: Sequence[int | None],
  compiler_options: dict[str, Any] | None,
  name: str = '`scheduler_share`',
) -> None:
  """Refuses a scheduler share where it cannot apply: on cpu:N (no TPU compiler), or beside
  the same option given as a compiler option. `name` is how the error names the shares.

  Raises:
    ValueError: naming the share, the topology or the option, and the fix.
  """
  given = ','.join(str(s) for s in shares if s is not None)
  if given and topology.startswith('cpu:'):
    raise ValueError(
      f'{name} {given} is a TPU compiler setting; {topology} compiles with the CPU'
      ' compiler, which has none: leave it out.'
    )
  if given and SCHEDULER_OPTION in (compiler_options or {}):
    raise ValueError(
      f'the compiler option {SCHEDULER_OPTION}={compiler_options[SCHEDULER_OPTION]} and'
      f' {name} {given} set the same thing: give the share alone (None for the'
      " compiler's default)."
    )


def default_collective_offloads(
  chip, compiler_options: dict[str, Any] | None = None
) -> tuple[str | None, ...]:
  """What a search tries for `collective_offload` where it is not given: both ways on a chip
  with SparseCores (`roofline.Chip.sparse_cores`), unless `compiler_options` set one of
  `SPARSECORE_OPTIONS` themselves; the compiler's placement alone elsewhere.

  >>> from zerojax._src.planner.roofline import CHIPS
  >>> default_collective_offloads(CHIPS['v5p']), default_collective_offloads(CHIPS['v5e'])
  ((None, 'sparsecore'), (None,))
  """
  given = set(compiler_options or ()) & set(SPARSECORE_OPTIONS)
  return COLLECTIVE_OFFLOADS if chip is not None and chip.sparse_cores and not given else (None,)


def check_collective_offloads(
  topology: str,
  chip,
  offloads: Sequence[str | None],
  compiler_options: dict[str, Any] | None,
  name: str = '`collective_offload`',
) -> None:
  """Refuses a collective offload where it cannot apply: a value that is not one of
  `COLLECTIVE_OFFLOADS`, 'sparsecore' on cpu:N or on a chip without SparseCores, or beside one
  of `SPARSECORE_OPTIONS` given as a compiler option. `name` is how the error names them.

  Raises:
    ValueError: naming the value, the topology or the option, and the fix.
  """
  bad = [o for o in offloads if o not in COLLECTIVE_OFFLOADS]
  if bad:
    raise ValueError(f'{name}: unknown {bad}; choose from {list(COLLECTIVE_OFFLOADS)}.')
  if 'sparsecore' not in offloads:
    return
  if topology.startswith('cpu:'):
    raise ValueError(
      f"{name} 'sparsecore' runs collectives on a TPU's SparseCores; {topology} compiles with"
      ' the CPU compiler, which has none: leave it out.'
    )
  if chip is None or not chip.sparse_cores:
    with_them = ', '.join(n for n, c in CHIPS.items() if c.sparse_cores)
    raise ValueError(
      f"{name} 'sparsecore': {topology} is a chip without SparseCores in the chip table (its"
      f' page gives none); leave it out (chips with them: {with_them}).'
    )
  given = sorted(set(compiler_options or ()) & set(SPARSECORE_OPTIONS))
  if given:
    raise ValueError(
      f"the compiler option {given[0]} and {name} 'sparsecore' set the same thing: give the"
      ' offload alone (it sets all of candidates.SPARSECORE_OPTIONS).'
    )


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
  scheduler_share: Sequence[int | None] = (None,),
  tensor: Sequence[int] = (1,),
  collective_offload: Sequence[str | None] = (None,),
  offload_params: Sequence[bool] = (False,),
  grid_dims: int = 2,
  chips: int | None = None,
) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
  """Every valid combination, and the invalid ones with the reason (for the report).
  `chips` (the chips of one slice) is what each `tensor` size must divide.

  Raises:
    ValueError: an unknown value, naming the option and the choices.
  """
  for name, values, choices in (
    ('layouts', layouts, LAYOUTS),
    ('remat', remat, REMAT),
    ('offload', offload, OFFLOADS),
    ('update_on', update_on, UPDATE_ON),
    ('quantize', quantize, tuple(QUANTIZE)),
    ('collective_offload', collective_offload, COLLECTIVE_OFFLOADS),
  ):
    bad = [v for v in values if v not in choices]
    if bad:
      raise ValueError(f'`{name}`: unknown {bad}; choose from {list(choices)}.')
  bad = [s for s in slices if not _whole(s, 1)]
  if bad:
    raise ValueError(f'`slices`: {bad} are not whole numbers of slices >= 1.')
  bad = [t for t in tensor if not _whole(t, 1) or (chips is not None and chips % t)]
  if bad:
    raise ValueError(
      f'`tensor`: {bad} are not whole sizes >= 1'
      + (f' that divide the {chips} chips of a slice' if chips is not None else '')
      + ' (1: no tensor axis).'
    )
  bad = [s for s in scheduler_share if s is not None and not _whole(s, 1)]
  if bad:
    raise ValueError(
      f"`scheduler_share`: {bad} are not whole percents of HBM >= 1 (None: the compiler's default)."
    )
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
    scheduler_share,
    tensor,
    collective_offload,
    offload_params,
  ):
    c = Candidate(*combo)
    why = c.invalid()
    if why is None and c.layout != 'flat' and grid_dims < 2:
      why = 'the topology has one dimension'
    (valid.append(c) if why is None else invalid.append((c, why)))
  return valid, invalid


def _whole(n: Any, least: int) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and n >= least


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
