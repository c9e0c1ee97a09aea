"""`python -m zerojax`: plan a run before launching it.

python -m zerojax plan --model llama2-70b --topology v5e:16x16 --mesh 16x16 --stage 3
python -m zerojax estimate --params 7e9 --devices 256
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from zerojax._src.options import OFFLOADS, UPDATE_ON
from zerojax._src.planner import lowering
from zerojax._src.planner.candidates import LEAN_SHARE, SCHEDULER_OPTION
from zerojax._src.planner.lowering import GRID_AXES, SLICE, TENSOR

# HBM per chip, GiB, by the topology name's prefix.
OPTIMIZERS = ('adam', 'adamw', 'sgd', 'lion', 'adafactor')


def _optimizer(name: str, lr: float = 1e-4):
  import optax

  return {
    'adam': lambda: optax.adam(lr),
    'adamw': lambda: optax.adamw(lr),
    'sgd': lambda: optax.sgd(lr, momentum=0.9),
    'lion': lambda: optax.lion(lr),
    'adafactor': lambda: optax.adafactor(lr),
  }[name]()


def _positive_int(text: str) -> int:
  """An argparse type: a whole number of at least 1 (a batch, a length, a chunk)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected a whole number >= 1, got {text!r}') from None
  if value < 1:
    raise argparse.ArgumentTypeError(f'expected a whole number >= 1, got {value}')
  return value


def _count(text: str) -> int:
  """An argparse type: a count of at least 1, written as an integer or in e-notation (7e9)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected a count such as 7e9, got {text!r}') from None
  if not (math.isfinite(value) and value >= 1 and value == int(value)):
    raise argparse.ArgumentTypeError(f'expected a whole count >= 1 such as 7e9, got {text!r}')
  return int(value)


def _log(start: float, message: str) -> None:
  print(f'[{time.perf_counter() - start:7.1f}s] {message}', flush=True)


def _devices(topology: str, slices: int = 1):
  """Devices of `slices` slices of `topology` (in slice order) and the HBM of its chips in
  GiB (None for cpu:N)."""
  from zerojax._src.planner import roofline, tpu

  try:
    devices = tpu.topology_devices(topology, slices)
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  chip = topology.split(':', 1)[0]
  return devices, None if chip == 'cpu' else roofline.HBM_GIB.get(chip)


def _mesh_shape(mesh: str, n: int, slices: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """The device mesh `--mesh` asks for: 'data' (one axis), a grid like '16x16', or named
  axes like 'data=16,tensor=4' (an axis named 'tensor' is tensor-parallel)."""
  if '=' in mesh:
    try:
      pairs = [(k.strip(), int(v)) for k, v in (p.split('=') for p in mesh.split(','))]
    except ValueError:
      pairs = []
    names = tuple(k for k, _ in pairs)
    shape = tuple(v for _, v in pairs)
    if not pairs or min(shape) < 1 or len(set(names)) != len(names) or names == (TENSOR,):
      raise SystemExit(
        f'error: --mesh {mesh!r}: expected named axes like data=16,{TENSOR}=4 (distinct'
        f' names, sizes >= 1, at least one ZeRO axis beside {TENSOR!r})'
      )
  else:
    if mesh == 'data':
      return (n,), ('data',)
    try:
      shape = tuple(int(d) for d in mesh.lower().split('x'))
    except ValueError:
      shape = ()
    if not shape or len(shape) > len(GRID_AXES) or min(shape) < 1:
      raise SystemExit(
        f"error: --mesh {mesh!r}: expected 'data', a grid of up to {len(GRID_AXES)}"
        f' dimensions like 16x16, or named axes like data=16,{TENSOR}=4'
      )
    names = GRID_AXES[: len(shape)]
  if math.prod(shape) != n:
    where = f'one of the {slices} slices has {n}' if slices > 1 else f'the topology has {n}'
    raise SystemExit(
      f'error: --mesh {mesh} has {math.prod(shape)} devices but {where};'
      ' give the chip grid, e.g. --mesh 16x16 for v5e:16x16, or sizes whose product is'
      f' {n}'
      + (f' (--mesh describes one slice; the {SLICE!r} axis is added)' if slices > 1 else '')
    )
  return shape, names


def _model(args) -> Any:
  """The model of `--model`, as a `lowering.Target` takes it: a preset's name, a
  `presets.DecoderConfig` (decoder:...), or for module:function a function of (remat,
  prefetch) returning its `ModelSpec` (a user's model runs its own layer loop)."""
  from zerojax._src.planner import presets

  if args.model.startswith('decoder:'):
    try:
      return presets.parse_decoder(args.model[len('decoder:') :], args.seq_len)
    except ValueError as e:
      raise SystemExit(f'error: --model: {e}') from None
  if ':' not in args.model:
    return args.model
  for flag, given in (
    ('--attention-chunk', args.attention_chunk),
    ('--attention', args.attention != 'xla'),
    ('--loss-chunk', args.loss_chunk),
  ):
    if given:
      raise SystemExit(
        f'error: {flag} is for the presets; --model {args.model} computes its own'
        ' attention and loss (use zerojax.inspect.chunked_attention or'
        ' zerojax.inspect.flash_attention there, or leave it out).'
      )
  named = [
    r for r in (args.remats or () if args.search else (args.remat,)) if r in presets.POLICIES
  ]
  if named:
    raise SystemExit(
      f"error: remat {', '.join(map(repr, named))} keeps activations the presets' blocks name;"
      f' --model {args.model} runs its own layer loop and names none of them, so the policy'
      ' would keep nothing. Give its loop a jax.checkpoint policy of your own, or plan a'
      ' preset or decoder:... with it.'
    )
  module_name, attr = args.model.split(':', 1)
  spec = getattr(importlib.import_module(module_name), attr)()
  if not isinstance(spec, presets.ModelSpec):
    raise SystemExit(
      f'error: --model {args.model} returned a {type(spec).__name__}; it must return a'
      ' zerojax.inspect.ModelSpec(name=..., init_fn=..., loss_fn=..., batch=...).'
    )
  return lambda remat, prefetch: spec


def _csv(kind):
  def parse(text: str):
    try:
      return tuple(kind(v.strip()) for v in text.split(',') if v.strip())
    except ValueError:
      raise argparse.ArgumentTypeError(f'expected a comma-separated list, got {text!r}') from None

  return parse


def _none_or(choices):
  """A parser for one of `choices`, where 'none' on the command line is None in zerojax (no
  offload, no quantization)."""

  def parse(text: str) -> str | None:
    if text != 'none' and text not in choices:
      raise argparse.ArgumentTypeError(
        f'unknown {text!r}; choose from {", ".join(["none", *choices])}'
      )
    return None if text == 'none' else text

  return parse


# `plan` flags that only a --search reads, and those only a single plan reads: given to the
# other, each is an error, not ignored.
SEARCH_ONLY = tuple(
  'stages layouts tensor_sizes micro_batches remats prefetch_options offloads update_ons'
  ' quantizes batches_per_chip hbm_gib max_candidates out slice_counts scheduler_shares'
  ' collective_offloads'.split()
)
SINGLE_ONLY = tuple(
  'stage batch_per_chip no_remat remat gather_all mesh grad prefetch json offload update_on'
  ' slices scheduler_share collective_offload'.split()
)


def _check_plan_flags(parser: argparse.ArgumentParser, p: argparse.ArgumentParser, args) -> None:
  """Refuses a `plan` flag that the chosen mode (a single plan or --search) does not read."""
  flag = lambda name: '--' + name.replace('_', '-')
  unread = SINGLE_ONLY if args.search else SEARCH_ONLY
  given = [flag(n) for n in unread if getattr(args, n) != p.get_default(n)]
  if given:
    if args.search:
      parser.error(
        f'plan --search does not read {", ".join(given)}: those set a single plan. Give the'
        ' search its space instead (--stages, --layouts, --batches-per-chip, --remats,'
        ' --prefetch-options, --out), or drop --search.'
      )
    parser.error(
      f'{", ".join(given)} set the space of plan --search; a single plan does not read them.'
      ' Add --search, or set the plan with --stage, --batch-per-chip, --mesh, --no-remat,'
      ' --offload, --update-on.'
    )


def _compiler_option(text: str) -> tuple[str, Any]:
  """NAME=VALUE for the compiler; the value an int, a float, true/false or else text."""
  name, eq, value = text.partition('=')
  if not eq or not name.strip() or not value.strip():
    raise argparse.ArgumentTypeError(
      f'expected NAME=VALUE, got {text!r} (e.g. xla_tpu_rematerialization_min_size_in_bytes=33554432)'
    )
  value = value.strip()
  if value.lower() in ('true', 'false'):
    return name.strip(), value.lower() == 'true'
  for kind in (int, float):
    try:
      return name.strip(), kind(value)
    except ValueError:
      pass
  return name.strip(), value


def _share(text: str) -> int | str:
  """A scheduler share: a whole percent of HBM >= 1, or 'compiler' (the compiler's default)."""
  if text == 'compiler':
    return text
  try:
    share = int(text)
  except ValueError:
    share = 0
  if share < 1:
    raise argparse.ArgumentTypeError(
      f"expected a whole percent of HBM >= 1 or 'compiler', got {text!r}"
    )
  return share


def _scheduler_shares(
  args, given: Sequence[int | str] | None, flag: str
) -> tuple[int | None, ...] | None:
  """The scheduler shares a plan or a search compiles with: `given` ('compiler' is None), else
  None (each candidate's `candidates.default_scheduler_share`); refused where the topology's
  compiler has no such option."""
  from zerojax._src.planner import candidates

  if given is None:
    return None
  shares = tuple(None if s == 'compiler' else s for s in given)
  try:
    candidates.check_scheduler_shares(args.topology, shares, dict(args.compiler_options), flag)
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  return shares


def _on_off(text: str) -> bool:
  if text not in ('on', 'off'):
    raise ValueError(text)
  return text == 'on'


def cmd_search(args) -> int:
  from zerojax._src.planner import search, search_report

  target, space, run = _search_setup(args)
  print(
    f'{len(space)} candidates ({len(run["invalid"])} combinations not valid); compiling'
    f' for {args.topology} ({len(target.devices)} chips)',
    flush=True,
  )
  report = search.run_search(target, space, **run)
  text = f'command: {args.command_line}\n' + search_report.format_search(report)
  print('\n' + text)
  if args.out:
    _write_search(args, report, text)
  if report.winner is None:
    print('\n' + search_report.nothing_fits(report), file=sys.stderr)
    return 3
  return 0


def _search_setup(args) -> tuple[Any, list, dict]:
  """(target, candidates, `search.run_search`'s other arguments) of `plan --search`'s flags;
  a space with no valid candidate, or more than --max-candidates, is refused."""
  from zerojax._src.planner import candidates

  devices, _ = _devices(args.topology)
  target, space, invalid = _search_space(args, devices)
  if not space:
    raise SystemExit(
      f'error: these options leave no valid candidate: {candidates.why_none_valid(invalid)}.'
    )
  if len(space) > args.max_candidates:
    raise SystemExit(
      f'error: {len(space)} candidates exceed --max-candidates {args.max_candidates};'
      ' narrow the space (e.g. --stages 3 --remats gathers) or raise the limit'
    )
  run = dict(
    invalid=invalid,
    hbm_bytes=int(args.hbm_gib * 2**30) if args.hbm_gib else None,
    measure=args.topology.startswith('cpu:'),
    cache_dir=_cache_dir(args),
    compiler_options=dict(args.compiler_options),
  )
  return target, space, run


def _setup(args) -> dict:
  """The training setup a plan and a search share (`lowering.Target`'s fields): the optimizer,
  precision, sequence length and how the presets compute attention and the loss."""
  return dict(
    optimizer=lambda: _optimizer(args.optimizer),
    mixed_precision=args.mixed_precision,
    seq_len=args.seq_len,
    compute_dtype=args.compute_dtype,
    attention_chunk=args.attention_chunk,
    attention=args.attention,
    loss_chunk=args.loss_chunk,
  )


def _search_space(args, devices) -> tuple[Any, list, list]:
  """(target, candidates, invalid combinations) of `plan --search`'s flags."""
  from zerojax._src.planner import candidates, lowering

  model = _model(args)
  if callable(model):  # a user's model: its layer loop is its own
    if len(args.remats or ()) > 1 or True in args.prefetch_options:
      print(
        f'note: --model {args.model} runs its own layer loop: --remats and'
        ' --prefetch-options are not searched for it',
        file=sys.stderr,
      )
    args.remats = (args.remats or candidates.default_remats(None, preset=False))[:1]
    args.prefetch_options = (False,)
  shares = _scheduler_shares(args, args.scheduler_shares, '--scheduler-shares')
  try:
    target = lowering.make_target(
      model,
      args.topology,
      devices=devices,
      **_setup(args),
      slice_devices={s: _devices(args.topology, s)[0] for s in set(args.slice_counts) if s > 1},
    )
    offloads = args.collective_offloads or candidates.default_collective_offloads(
      target.chip, dict(args.compiler_options)
    )
    candidates.check_collective_offloads(
      args.topology, target.chip, offloads, dict(args.compiler_options), '--collective-offloads'
    )
    space, invalid = candidates.candidate_space(
      stages=args.stages,
      layouts=args.layouts,
      micro_batches=args.micro_batches,
      remat=args.remats or candidates.default_remats(target.chip),
      prefetch=args.prefetch_options,
      offload=args.offloads,
      update_on=args.update_ons,
      quantize=args.quantizes,
      batch_per_chip=args.batches_per_chip,
      slices=args.slice_counts,
      scheduler_share=shares or (None,),
      tensor=args.tensor_sizes,
      collective_offload=offloads,
      grid_dims=len(target.grid),
      chips=len(target.devices),
    )
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  if shares is None:
    space = candidates.with_default_shares(space, args.topology, dict(args.compiler_options))
  return target, space, invalid


def _write_search(args, report, text: str) -> None:
  """`--out`: the search's table (.txt), its figures (.json) and its plot (.png)."""
  from zerojax._src.planner import search_report

  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(
    args.out, f'search_{args.model.replace(":", "_")}_{args.topology.replace(":", "-")}'
  )
  with open(stem + '.txt', 'w') as f:
    f.write(text + '\n')
  with open(stem + '.json', 'w') as f:
    json.dump({'command': args.command_line} | search_report.search_json(report), f, indent=2)
  try:
    search_report.plot_search(report, stem + '.png')
    print(f'wrote {stem}.txt, .json and .png')
  except ImportError:
    print(f'wrote {stem}.txt and .json (no plot: pip install matplotlib, or zerojax[examples])')


def _check_compiler_options(args) -> None:
  """Refuses, in a second, a --compiler-option the topology's compiler does not take, before
  a compile of minutes: a one-line program is compiled with the options first."""
  import jax
  import jax.numpy as jnp

  options = dict(args.compiler_options)
  if not options:
    return
  device = _devices(args.topology)[0][0]
  x = jax.ShapeDtypeStruct(
    (8, 128), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  try:
    jax.jit(lambda a: a + 1).trace(x).lower().compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:
    given = ' '.join(f'--compiler-option {k}={v}' for k, v in options.items())
    raise SystemExit(
      f'error: {given}: the compiler for {args.topology} refused it: {str(e).splitlines()[0]}.'
      ' Option names and values are those of the installed jaxlib and libtpu.'
    ) from None


def cmd_plan(args) -> int:
  """One plan: a search of one candidate (`search.evaluate`), its compiled program reported."""
  options = dict(args.compiler_options)
  if SCHEDULER_OPTION in options:  # the plan's own setting: one way to give it
    value = options[SCHEDULER_OPTION]
    raise SystemExit(
      f'error: --compiler-option {SCHEDULER_OPTION}={value}: give it as --scheduler-share'
      f" {value}, the plan's own setting (reported with the line to train with; a search takes"
      ' several as --scheduler-shares).'
    )
  if args.search:  # refused here, before anything is built, where the share cannot apply
    _scheduler_shares(args, args.scheduler_shares, '--scheduler-shares')
  else:
    _scheduler_shares(args, args.scheduler_share and (args.scheduler_share,), '--scheduler-share')
  _check_compiler_options(args)
  if args.search:
    return cmd_search(args)
  print(f'command: {args.command_line}', flush=True)
  start = time.perf_counter()
  target, candidate, hbm_gib = _plan_target(args, start)
  phases = {'topology': time.perf_counter() - start}
  options = dict(args.compiler_options)
  from zerojax._src.planner import display, search

  with display.working('lowering and compiling...'):
    result = search.evaluate(
      target,
      candidate,
      hbm_bytes=None if hbm_gib is None else hbm_gib * 2**30,
      cache_dir=_cache_dir(args),
      compiler_options=options,
      keep=True,
      observe=lambda event, r: _log_phase(args, start, event, r),
    )
  if result.error is not None:
    prefix = f'--mesh {args.mesh}: ' if isinstance(result.error, lowering.LayoutError) else ''
    raise SystemExit(f'error: {prefix}{result.error}')
  if result.priced is None:  # refused before a program could be reported
    print(f'\n{candidate.label()}: DOES NOT FIT: {_refusal(result, hbm_gib)}', file=sys.stderr)
    return 3
  t = time.perf_counter()
  out = _report_plan(args, target, result, hbm_gib)
  phases |= result.lowered.phase_seconds | {'compile': result.compiled.seconds}
  phases['report'] = result.phase_seconds['analyse'] + time.perf_counter() - t
  _log(start, 'reported; ' + ', '.join(f'{k} {v:.1f} s' for k, v in phases.items()))
  if args.json:
    out['compiler_options'] = options
    out['compile_seconds'] = result.compiled.seconds
    out['program_source'] = result.compiled.source
    out['phase_seconds'] = phases | {'total': time.perf_counter() - start}
    with open(args.json, 'w') as f:
      json.dump(out, f, indent=2)
    _log(start, f'wrote {args.json}')
  return 0 if out['fits'] in (None, True) else 3


def _refusal(result: Any, hbm_gib: int | None) -> str:
  """Why a plan was refused before its program could be reported, with the figures."""
  from zerojax._src.planner import roofline, search

  if result.reason == search.STATES_EXCEED_HBM:
    return (
      f'{result.status} (model states at rest {result.theory_bytes / roofline.GiB:.2f} GiB per'
      f' chip, of {hbm_gib} GiB HBM)'
    )
  if result.reason == search.STATE_EXCEEDS_HOST:
    host = result.lowered.plan.bytes_per_device()['host'] / roofline.GiB
    return f'{result.status} ({host:.2f} GiB per chip offloaded)'
  return result.status


def _log_phase(args, start: float, event: str, stage: Any) -> None:
  """The plan's progress lines, as `search.evaluate` reaches each stage (`Lowered`, then
  `program_cache.Compiled`)."""
  if event == 'lowered':
    _log(
      start,
      f'model {stage.spec.name}: {stage.num_params:,} parameters; stage {args.stage} plan'
      ' built and lowered',
    )
    given = f' with compiler options {dict(args.compiler_options)}' if args.compiler_options else ''
    _log(start, f'compiling{given} (large models take minutes on a small machine)')
  elif event == 'compiled' and stage.source == 'cache':
    _log(
      start,
      f'read the compiled program back from {_cache_dir(args)} (compiling it took'
      f' {stage.first_compile_seconds:.1f} s; --no-cache compiles it again)',
    )
  elif event == 'compiled':
    _log(start, f'compiled ({stage.seconds:.1f} s of XLA compile)')


def _cache_dir(args) -> Any:
  """Where compiled TPU programs are kept (`program_cache`); None for cpu:N (compiled in
  seconds, and a measured search needs the executable) or with --no-cache."""
  if args.no_cache or args.topology.startswith('cpu:'):
    return None
  return args.cache_dir


def _plan_target(args, start: float) -> tuple[Any, Any, int | None]:
  """(the `lowering.Target` and the one `Candidate` of a plan's flags, the chips' HBM in GiB
  or None), the topology and mesh logged."""
  from zerojax._src.planner import candidates, roofline

  devices, hbm_gib = _devices(args.topology, args.slices)
  n = len(devices)
  _log(
    start,
    f'topology {args.topology}: {n} devices ({devices[0].device_kind})'
    + (f' in {args.slices} slices joined by the data-center network' if args.slices > 1 else ''),
  )
  chip = roofline.CHIPS.get(args.topology.split(':')[0])
  if args.slices > 1 and chip is not None:
    try:  # before a compile of minutes whose step could not be timed
      roofline.check_dcn(chip)
    except ValueError as e:
      raise SystemExit(f'error: {e}') from None
  shape, names = _mesh_shape(args.mesh, n // args.slices, args.slices)
  full = ((SLICE, *names), (args.slices, *shape)) if args.slices > 1 else (names, shape)
  explicit = _gradients(args, full[0])
  target = lowering.Target(
    topology=args.topology,
    devices=tuple(devices[: n // args.slices]),
    grid=shape,
    chip=chip,
    model=_model(args),
    **_setup(args),
    slice_devices=((args.slices, tuple(devices)),) if args.slices > 1 else (),
    axis_names=names,
    gradients='zerojax' if explicit else 'jax',
    gather_all=args.gather_all,
  )
  remat = 'none' if args.no_remat else args.remat
  offload = args.collective_offload
  try:
    candidates.check_collective_offloads(
      args.topology, chip, (offload,), dict(args.compiler_options), '--collective-offload'
    )
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  shares = _scheduler_shares(
    args, args.scheduler_share and (args.scheduler_share,), '--scheduler-share'
  )
  candidate = candidates.Candidate(
    args.stage,
    layout='flat' if names == ('data',) else 'torus',
    remat=remat,
    prefetch=args.prefetch,
    offload=args.offload,
    update_on=args.update_on,
    batch_per_chip=args.batch_per_chip,
    slices=args.slices,
    scheduler_share=shares[0]
    if shares
    else candidates.default_scheduler_share(remat, args.topology),
    collective_offload=offload,
  )
  _log_mesh(args, start, dict(zip(*full)), explicit)
  return target, candidate, hbm_gib


def _log_mesh(args, start: float, mesh: dict[str, int], explicit: bool) -> None:
  zero_axes = tuple(a for a in mesh if a not in (TENSOR, SLICE))
  _log(
    start,
    f'mesh {mesh}, ZeRO over {zero_axes}'
    + (f', data-parallel over {SLICE!r}' if SLICE in mesh else '')
    + (f', tensor-parallel over {TENSOR!r}' if TENSOR in mesh else '')
    + '; gradients through '
    + (
      f'zerojax.value_and_grad(per_layer={args.stage >= 2})' if explicit else 'jax.value_and_grad'
    ),
  )


def _narrow(dtype: str) -> bool:
  """Whether `dtype` (a --compute-dtype) is narrower than 32 bits."""
  import jax.numpy as jnp

  return jnp.dtype(dtype).itemsize < 4


def _gradients(args, names: tuple[str, ...]) -> bool:
  """Whether the plan takes gradients through zerojax.value_and_grad (else jax's)."""
  stream = args.update_on == 'stream'
  if stream and args.grad == 'jax':
    raise SystemExit(
      'error: --update-on stream writes gradients to host memory from inside'
      " zerojax.value_and_grad's layer loop; drop --grad jax (or use --grad zerojax)."
    )
  if TENSOR in names:  # auto: jax's, where the compiler places every collective
    explicit = args.grad == 'zerojax' or stream
    if explicit and args.topology.startswith('cpu:') and _narrow(args.compute_dtype):
      raise SystemExit(
        f'error: on CPU, zerojax.value_and_grad beside a {TENSOR!r} axis with'
        f' {args.compute_dtype} matmuls makes the XLA CPU compiler abort (its all-reduce'
        ' promotion fails on the low-precision all-reduces inside the region manual over the'
        ' ZeRO axes); add --compute-dtype float32, or drop --grad zerojax. TPU compiles it.'
      )
    return explicit
  return args.grad == 'zerojax' or (args.grad == 'auto' and (len(names) > 1 or stream))


def _report_plan(args, target: Any, result: Any, hbm_gib: int | None) -> dict:
  """Prints the plan's report (memory, collectives, host link, predicted step) from its priced
  program and returns its JSON record."""
  lowered, priced = result.lowered, result.priced
  report, n = priced.report, lowered.mesh.devices.size
  print(
    f'\n{lowered.spec.name} | {lowered.num_params / 1e9:.2f}B params | ZeRO stage {args.stage} |'
    f' {args.optimizer} | {args.topology}'
    + (f' x {args.slices} slices' if args.slices > 1 else '')
    + f' ({n} chips) | batch {args.batch_per_chip}/chip x'
    f' {lowered.batch.shape[1:]}'
  )
  c = lowered.candidate
  held = [f'the TPU scheduler held to {c.scheduler_share}% of HBM'] if c.scheduler_share else []
  held += ["the collectives on the chip's SparseCores"] if c.collective_offload else []
  if held:
    flags = ['--scheduler-share'] * bool(c.scheduler_share)
    flags += ['--collective-offload'] * bool(c.collective_offload)
    print(
      f'compiled with {" and ".join(held)}: train with jax.jit(step,'
      f' compiler_options={c.compiler_options()}) ({", ".join(flags)})'
    )
  plan = lowered.plan
  sizes = {k: v for k, v in plan.bytes_per_device().items() if v or k != 'host'}
  print('plan per chip: ' + ', '.join(f'{k} {v / 2**30:.2f} GiB' for k, v in sizes.items()))
  print(report)
  fits = _print_fit(args, hbm_gib, report, sizes)
  largest = priced.largest_arrays()
  print(_format_largest(largest))
  chip, traffic, work = target.chip, priced.host_traffic, priced.work
  if traffic.source != 'none':
    print(_format_traffic(traffic, chip))
  print(
    f'matmul FLOPs per chip per step (counted in the compiled program): {work.matmul_flops:.4g}'
  )
  predicted = _print_prediction(args.topology, chip, priced)
  figures = dict(sizes=sizes, chip=chip, traffic=traffic, predicted=predicted, work=work)
  figures |= dict(largest=largest, fits=fits, hbm_gib=hbm_gib)
  return _plan_json(args, lowered, report, figures)


def _plan_json(args, lowered: Any, report: Any, figures: dict) -> dict:
  """What `plan --json` writes: the command, the plan and the compiled program's figures (no
  predicted step, None, for a chip without figures)."""
  chip, work, predicted = figures['chip'], figures['work'], figures['predicted']
  c = report.collectives
  return {
    'command': args.command_line,
    'model': lowered.spec.name,
    'num_params': lowered.num_params,
    'stage': args.stage,
    'mixed_precision': args.mixed_precision,
    'offload': args.offload,
    'update_on': args.update_on,
    'plan_bytes_per_chip': figures['sizes'],
    'host_limit_bytes': chip.host_bytes_per_chip if chip is not None else None,
    'host_traffic': dataclasses.asdict(figures['traffic']),
    'predicted_seconds': None if predicted is None else dataclasses.asdict(predicted),
    'matmul_flops_per_chip': work.matmul_flops,
    'kernel_seconds': work.kernel_seconds,
    'kernels': dataclasses.asdict(work),
    'largest_arrays': figures['largest'],
    'roofline': None if chip is None else dataclasses.asdict(chip) | {'clock_hz': chip.clock_hz},
    'topology': args.topology,
    'num_devices': lowered.mesh.devices.size,
    'batch_per_chip': args.batch_per_chip,
    'scheduler_share': lowered.candidate.scheduler_share,
    'collective_offload': lowered.candidate.collective_offload,
    'mesh': dict(lowered.mesh.shape),
    'gradients': f'{lowered.gradients}.value_and_grad',
    'memory': dataclasses.asdict(report.memory)
    | {'peak': report.memory.peak, 'peak_source': report.memory.source},
    'hbm_bytes': None if figures['hbm_gib'] is None else figures['hbm_gib'] * 2**30,
    'fits': figures['fits'],
    'collectives': {
      'counts': c.counts,
      'result_bytes': c.result_bytes,
      'ring_bytes': c.ring_bytes,
      'overlapped_ring_bytes': c.overlapped_ring_bytes,
      'dcn_ring_bytes': c.dcn_ring_bytes,
      'dcn_overlapped_ring_bytes': c.dcn_overlapped_ring_bytes,
      'dcn_gathers': list(c.dcn_gathers),
    },
    'zero_floor_bytes': report.floor_bytes,
    'slices': args.slices,
    'dcn_floor_bytes': report.dcn_floor_bytes,
  }


def _print_prediction(topology: str, chip: Any, priced: Any):
  """Prints the predicted step (the step-time model of docs/design.md) and returns it; None
  for faked CPU devices, and for a chip without published figures, which it says."""
  from zerojax._src.planner import roofline

  if chip is None:
    name = topology.split(':')[0]
    if name != 'cpu':
      print(
        f'no predicted step: zerojax has no published figures (peak FLOP/s, HBM and ICI'
        f' bandwidth) for {name!r} chips, so the memory and collectives above are its'
        f" compiler's but the step cannot be timed; plan a chip it has figures for"
        f' ({", ".join(sorted(roofline.CHIPS))}) for a step time.',
        file=sys.stderr,
      )
    return None
  c, work, predicted = priced.report.collectives, priced.work, priced.predicted
  dcn = ''
  if c.total_dcn_bytes:
    windows = work.dcn_windows
    dcn = (
      f' (of which DCN {predicted.dcn_exposed:.3f} s: {predicted.dcn:.3f} s at'
      f' {chip.dcn_bandwidth / 1e9:.3g} GB/s per chip'
      + (
        f' in {sum(n for _, _, n in windows)} transfers, each hidden only under the kernels'
        ' scheduled while it is in flight'
        if windows
        else ''
      )
      + ')'
    )
  print(
    f'predicted step (not measured; docs/design.md "The step-time model"):'
    f' {predicted.step:.3f} s = kernels {predicted.compute:.3f} s (compiler estimates'
    f' for {work.estimated_kernels} of {work.kernels} kernel runs), collectives exposed'
    f' {predicted.exposed:.3f} s{dcn}, host link exposed {predicted.host_exposed:.3f} s;'
    f' {work.matmul_flops / predicted.step / 1e12:.1f} TFLOP/s per chip'
  )
  return predicted


def _print_fit(args, hbm_gib: int | None, report, sizes: dict) -> bool | None:
  """Prints peak memory against HBM (and host memory against the host's share); returns
  whether the plan fits (None where the device memory is not known)."""
  from zerojax._src.planner import roofline

  fits, peak = None, report.memory.peak
  if hbm_gib is not None and report.memory.host_held and peak > hbm_gib * 2**30:
    # No device-only peak from the compiler; it refuses what does not fit (RESOURCE_EXHAUSTED).
    fits = True
    print(
      f'\npeak {peak / 2**30:.2f} GiB as the TPU compiler reports its parts, of {hbm_gib} GiB'
      ' HBM per chip: it holds host memory, so the compiler gives no device-only peak, and it'
      " compiled the program within the chip's HBM: FITS"
    )
  elif hbm_gib is not None:
    fits = peak <= hbm_gib * 2**30
    print(
      f'\npeak {peak / 2**30:.2f} GiB of {hbm_gib} GiB HBM per chip'
      f' ({100 * peak / (hbm_gib * 2**30):.0f}%): {"FITS" if fits else "DOES NOT FIT"}'
    )
  chip = roofline.CHIPS.get(args.topology.split(':')[0])
  host_limit = chip.host_bytes_per_chip if chip is not None else None
  if sizes.get('host'):
    within = host_limit is None or sizes['host'] <= host_limit
    fits = fits if within else False
    print(
      f'host memory {sizes["host"] / 2**30:.2f} GiB per chip'
      + (
        f' of {host_limit / 2**30:.0f} GiB: {"FITS" if within else "DOES NOT FIT"}'
        if host_limit
        else ''
      )
    )
  return fits


def _format_largest(groups: list[dict]) -> str:
  """Lines naming the program's largest arrays, so a plan that does not fit says why."""
  from zerojax._src.plan import fmt_bytes as size

  lines = [
    "largest arrays in one chip's program (each made by one instruction; the compiler may"
    ' place several in one buffer, so they do not add up to the peak):'
  ]
  for g in groups:
    what = f'{size(g["bytes"]):>10}  {g["type"]}' + (f' x{g["count"]}' if g['count'] > 1 else '')
    if g.get('stacked_over'):
      what += (
        f', stacked over a loop of {g["stacked_over"]}'
        f' ({size(g["bytes"] // g["stacked_over"])} per iteration)'
      )
    if g['sources']:
      what += ': ' + '; '.join(g['sources'][:2])
    lines.append('  ' + what)
  return '\n'.join(lines)


def _format_traffic(traffic: Any, chip: Any) -> str:
  """The host link's bytes per step and chip, where the figure comes from, and its time."""
  gb = lambda n: f'{n / 1e9:.2f} GB' if n >= 1e8 else f'{n / 1e6:.2f} MB'
  how = {
    'hlo': 'counted in the compiled program',
    'formula': 'by formula: this program carries no memory spaces (XLA:CPU)',
  }[traffic.source]
  line = f'host link per step and chip ({how}): {gb(traffic.to_host)} down to the host,'
  line += f' {gb(traffic.to_device)} back to the device'
  if traffic.largest_to_device is not None:
    line += f'; largest single transfer back {traffic.largest_to_device / 2**20:.1f} MiB'
  if traffic.in_loops is not None:
    line += f'; {gb(traffic.in_loops)} from inside layer loops'
  line += f'; {traffic.overlapped:.0%} overlaps compute'
  if chip is not None:
    line += (
      f'; {traffic.moved / chip.host_link_bandwidth:.4f} s at'
      f' {chip.host_link_bandwidth / 1e9:.0f} GB/s (assumed: {chip.name} host link not published)'
    )
  return line


def cmd_estimate(args) -> int:
  import jax.numpy as jnp

  from zerojax._src import precision
  from zerojax._src.options import Options
  from zerojax._src.planner import estimate, presets

  if args.model:
    if args.model not in presets.PRESETS:
      raise SystemExit(f'error: --model {args.model!r} is not a preset: {sorted(presets.PRESETS)}')
    import jax

    params = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
      presets.PRESETS[args.model].shapes(),
      is_leaf=lambda x: isinstance(x, tuple),
    )
  elif args.params:
    params = args.params
  else:
    raise SystemExit('error: give --params COUNT (e.g. 7e9) or --model PRESET')
  tx, dtype = _optimizer(args.optimizer), jnp.float32
  if args.mixed_precision:
    tx, dtype = precision.mixed_precision(tx), jnp.bfloat16
    if not isinstance(params, int):
      params = precision.cast(params, dtype)
  estimates = estimate.estimate_memory(
    params, tx, num_devices=args.devices, dtype=dtype, options=Options(offload=args.offload)
  )
  print(estimate.format_estimates(estimates))
  return 0


def cmd_inspect(args) -> int:
  from zerojax._src import checkpoint

  try:
    print(checkpoint.format_checkpoint(args.directory, args.step))
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f'error: {e}') from None
  return 0


def _plan_parser(sub) -> argparse.ArgumentParser:
  """`plan`'s parser, with its single-plan flags."""
  from zerojax._src.planner import presets

  shown = argparse.ArgumentDefaultsHelpFormatter  # --help shows every default
  p = sub.add_parser(
    'plan', help='compile a training step ahead of time and report its cost', formatter_class=shown
  )
  p.add_argument(
    '--model',
    default='gpt2-small',
    help=f'a preset {sorted(presets.PRESETS)}; a decoder of any shape, decoder:KEY=VALUE,...'
    ' (vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, head_size, gated) or'
    ' decoder:FILE.json of the same keys; or module:function returning a'
    ' zerojax.inspect.ModelSpec',
  )
  p.add_argument(
    '--topology', default='v5e:2x4', help='TPU topology (v5e:16x16, v4:2x2x1, ...) or cpu:N'
  )
  p.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3), help='ZeRO stage')
  p.add_argument('--optimizer', default='adamw', choices=OPTIMIZERS, help='optax optimizer')
  p.add_argument(
    '--batch-per-chip', type=_positive_int, default=1, help='sequences per chip per step'
  )
  p.add_argument(
    '--seq-len', type=_positive_int, default=None, help="sequence length; None: the preset's"
  )
  p.add_argument('--compute-dtype', default='bfloat16', help='dtype of the matmuls')
  p.add_argument(
    '--remat',
    default='full',
    choices=presets.REMAT,
    help='what each block keeps for the backward pass (the rest is recomputed): full (nothing),'
    " gathers (all but the parameters' gathers), none (everything), or a policy named by what it"
    " keeps in HBM (save_qkv, save_attention, save_mlp, minimal: MaxText's) or moves to host"
    ' memory and back (offload_qkv, offload_minimal, offload_all, offload_layer_inputs: full'
    " with the layer loop's stack of block inputs on the host, ...); docs/planner.md",
  )
  p.add_argument('--no-remat', action='store_true', help='the same as --remat none')
  p.add_argument(
    '--gather-all', action='store_true', help='gather all parameters up front (not per layer)'
  )
  _layout_arguments(p)
  _precision_and_offload_arguments(p)
  return p


def _layout_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for the mesh, the gradients, the prefetch and the attention."""
  p.add_argument(
    '--mesh',
    default='data',
    help="the device mesh: 'data' (one ZeRO axis over every chip), the chip grid, e.g."
    ' 16x16 (one ZeRO axis per torus dimension, named x, y, z: on a 2-D torus the TPU'
    ' compiler keeps per-axis reduce-scatters, where over a whole 2-D torus it all-reduces),'
    f' or named axes, e.g. data=16,{TENSOR}=4: the axis named {TENSOR!r} splits the presets'
    ' Megatron-style (heads, MLP columns, vocabulary), ZeRO splits over the others',
  )
  p.add_argument(
    '--grad',
    default='auto',
    choices=('auto', 'jax', 'zerojax'),
    help='how gradients are taken: jax.value_and_grad (the compiler places the reduction),'
    ' zerojax.value_and_grad (explicit per-layer reduce-scatters; beside a tensor axis, each'
    ' chip gathers only its tensor part), or auto: zerojax on a multi-axis mesh without a'
    " 'tensor' axis, jax otherwise",
  )
  p.add_argument(
    '--prefetch',
    action='store_true',
    help="with zerojax gradients, gather block i+1's parameters while block i computes"
    ' (zerojax.scan_layers; one more block of parameters lives at a time)',
  )
  _model_arguments(p)


def _model_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for how the presets compute attention and the loss."""
  p.add_argument(
    '--attention-chunk',
    type=_positive_int,
    default=None,
    help='presets: compute attention this many queries at a time, one chunk of scores live at'
    ' a time (memory-efficient, the same arithmetic); default: all queries at once',
  )
  p.add_argument(
    '--loss-chunk',
    type=_positive_int,
    default=None,
    help="presets: compute the head's logits and the cross-entropy this many positions at a"
    ' time, one chunk of f32 logits live at a time (the same arithmetic); default: all at once',
  )
  p.add_argument(
    '--attention',
    choices=('xla', 'flash'),
    default='xla',
    help="presets: 'xla' (plain JAX, --attention-chunk applies) or 'flash' (fused Pallas kernels"
    ' on TPU, as MaxText runs: causal blocks skipped, scores never in HBM)',
  )


def _slices_argument(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    '--slices',
    type=int,
    default=1,
    help='TPU slices of --topology joined by the data-center network (DCN); the mesh gets an'
    f' outermost {SLICE!r} axis over them, data-parallel: state split within each slice, each'
    ' gradient shard all-reduced across slices once per step',
  )


def _precision_and_offload_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for several slices, mixed precision, host offload and the JSON report."""

  _slices_argument(p)
  p.add_argument(
    '--mixed-precision',
    action='store_true',
    help='bf16 parameters and gradients, fp32 master copy in the optimizer state'
    ' (zerojax.mixed_precision); with --search, for every candidate',
  )
  p.add_argument(
    '--offload',
    default=None,
    choices=OFFLOADS[1:],
    help='host offload of the optimizer state (and the fp32 master), as zerojax.Options',
  )
  p.add_argument(
    '--update-on',
    default='device',
    choices=UPDATE_ON,
    help="where an offloaded update runs: 'device', 'host', or 'stream' (gradients written"
    ' to host memory layer by layer in the backward pass; needs --mixed-precision)',
  )
  p.add_argument('--json', help='also write the report as JSON here')
  _compiler_arguments(p)


def _compiler_arguments(p: argparse.ArgumentParser) -> None:
  """`plan`'s flags for the TPU compiler's settings and the cache of compiled programs."""
  p.add_argument(
    '--scheduler-share',
    type=_share,
    default=None,
    metavar='PERCENT',
    help="the share of HBM the TPU compiler's latency-hiding scheduler plans within (compiler"
    f' option {SCHEDULER_OPTION}; pass the same to the training run); default: {LEAN_SHARE} under'
    " --remat full, else the compiler's own ('compiler'). Lower, the same program holds less"
    ' HBM, and may run slower',
  )
  p.add_argument(
    '--collective-offload',
    type=_none_or(('sparsecore',)),
    default=None,
    help="'sparsecore': run the collectives on the chip's SparseCores (v5p), asynchronous"
    " beside the TensorCores' work (the compiler options of candidates.SPARSECORE_OPTIONS;"
    ' pass the same to the training run); default none, where the compiler puts them',
  )
  p.add_argument(
    '--compiler-option',
    dest='compiler_options',
    type=_compiler_option,
    action='append',
    default=[],
    metavar='NAME=VALUE',
    help='an XLA or libtpu option to compile the step with (repeatable), as jax.jit(...,'
    ' compiler_options={NAME: VALUE}) takes it: pass the same to the training run',
  )
  from zerojax._src.planner import program_cache

  p.add_argument(
    '--cache-dir',
    default=str(program_cache.default_dir()),
    help='keep what the planner reads from each compiled TPU program here, and read it back'
    ' when the same program is planned again (by a plan or a search; keyed by the lowered'
    ' program, topology, jax/jaxlib/libtpu versions, XLA flags and compiler options; default from'
    f' ${program_cache.ENV})',
  )
  p.add_argument(
    '--no-cache', action='store_true', help='compile every program again and keep none'
  )


# `--remats` (a search's default is `candidates.default_remats`).
_REMATS_HELP = (
  'what each block keeps, as --remat; default: gathers, full, minimal, none, and'
  " offload_minimal, offload_minimal_inputs where the chip's host link has figures (a --model"
  ' module:function: gathers)'
)

_SHARES_HELP = (
  'as --scheduler-share, each a candidate (e.g. compiler,70,60); default:'
  f" {LEAN_SHARE} for remat full, else the compiler's"
)


def _layout_space(s) -> None:
  """`plan --search`'s stages and mesh layouts."""
  s.add_argument('--stages', type=_csv(int), default=(1, 2, 3), help='ZeRO stages')
  s.add_argument(
    '--layouts',
    type=_csv(str),
    default=('flat', 'torus'),
    help='flat (one ZeRO axis), torus (one per torus dimension), hpz (torus, stage-3'
    ' parameters split within the last axis)',
  )
  s.add_argument(
    '--tensor-sizes',
    type=_csv(_positive_int),
    default=(1,),
    help="sizes of a tensor-parallel axis beside the flat layout's ZeRO axis (Megatron-style:"
    ' heads, MLP columns, vocabulary; gradients through jax.value_and_grad); 1: none. Each'
    ' must divide the chips of a slice',
  )


def _search_arguments(p: argparse.ArgumentParser) -> None:
  """`plan --search` and the space it searches."""
  from zerojax._src.planner import candidates

  s = p.add_argument_group(
    'plan search (--search)',
    'compile every combination of these for the topology and rank them by predicted step time',
  )
  s.add_argument('--search', action='store_true', help='search the space below instead of one plan')
  _layout_space(s)
  s.add_argument('--micro-batches', type=_csv(int), default=(1,), help='micro-batches per step')
  s.add_argument('--remats', type=_csv(str), default=None, help=_REMATS_HELP)
  s.add_argument(
    '--prefetch-options',
    type=_csv(_on_off),
    default=(False, True),
    help='on, off: scan_layers prefetch of the next layer (stage 3)',
  )
  s.add_argument(
    '--offloads',
    type=_csv(_none_or(OFFLOADS[1:])),
    default=(None,),
    help='none, opt_state, opt_state+master (host memory)',
  )
  s.add_argument(
    '--update-ons',
    type=_csv(str),
    default=('device',),
    help='device, host, stream (the update on the host, gradients sent down layer by layer)',
  )
  s.add_argument(
    '--quantizes',
    type=_csv(_none_or(tuple(q for q in candidates.QUANTIZE if q))),
    default=(None,),
    help='ZeRO++: none, g8, g4 (gradients), w8g8, w8g4 (weights too, stage 3)',
  )
  s.add_argument(
    '--batches-per-chip', type=_csv(_positive_int), default=(1,), help='sequences per chip'
  )
  s.add_argument(
    '--slice-counts',
    type=_csv(_positive_int),
    default=(1,),
    help='TPU slices of --topology (data-parallel over the data-center network)',
  )
  s.add_argument('--scheduler-shares', type=_csv(_share), default=None, help=_SHARES_HELP)
  s.add_argument(
    '--collective-offloads',
    type=_csv(_none_or(('sparsecore',))),
    default=None,
    help="none, sparsecore (the collectives on the chip's SparseCores); default both on a chip"
    ' with SparseCores (v5p), none elsewhere',
  )
  s.add_argument(
    '--hbm-gib', type=float, default=None, help="device memory per chip; default the chip's"
  )
  s.add_argument('--max-candidates', type=int, default=64, help='refuse a larger space')
  s.add_argument('--out', default=None, help='write the table, JSON and a plot to this folder')


def _estimate_parser(sub) -> argparse.ArgumentParser:

  shown = argparse.ArgumentDefaultsHelpFormatter
  e = sub.add_parser(
    'estimate', help='per-device bytes of each stage, from theory', formatter_class=shown
  )
  e.add_argument('--params', type=_count, help='parameter count, e.g. 7e9')
  e.add_argument('--model', help='or a preset name')
  e.add_argument('--devices', type=_positive_int, required=True, help='devices on the ZeRO axes')
  e.add_argument('--optimizer', default='adam', choices=OPTIMIZERS, help='optax optimizer')
  e.add_argument(
    '--mixed-precision',
    action='store_true',
    help='bf16 params and grads, fp32 master copy in the optimizer state',
  )
  e.add_argument('--offload', choices=OFFLOADS[1:], help='host offload')
  return e


def _inspect_parser(sub) -> argparse.ArgumentParser:
  shown = argparse.ArgumentDefaultsHelpFormatter
  i = sub.add_parser(
    'inspect',
    help='describe a checkpoint folder: steps, stage, mesh, leaves',
    formatter_class=shown,
  )
  i.add_argument('directory')
  i.add_argument('--step', type=int, default=None, help='default: the latest committed step')
  return i


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
  """(the command line's parser, its `plan` subparser)."""
  parser = argparse.ArgumentParser(prog='python -m zerojax', description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='command', required=True)
  p = _plan_parser(sub)
  _search_arguments(p)
  p.set_defaults(func=cmd_plan)
  _estimate_parser(sub).set_defaults(func=cmd_estimate)
  _inspect_parser(sub).set_defaults(func=cmd_inspect)
  return parser, p


def plan_target(argv: list[str]) -> tuple[Any, Any, int | None]:
  """What `python -m zerojax plan ARGV` plans: its `lowering.Target`, its one `Candidate` and
  the chips' HBM in bytes (None: the chip's), for a script that evaluates other candidates on
  the same target with `search.evaluate` (the same plan at other scheduler shares, say). Bad
  flags exit as the command line does."""
  parser, p = _parsers()
  args = parser.parse_args(['plan', *argv])
  args.command_line = 'python -m zerojax plan ' + shlex.join(argv)
  _check_plan_flags(parser, p, args)
  _configure_jax(args.topology, args.slices)
  target, candidate, hbm_gib = _plan_target(args, time.perf_counter())
  return target, candidate, None if hbm_gib is None else hbm_gib * 2**30


def search_target(argv: list[str]) -> tuple[Any, list, dict]:
  """What `python -m zerojax plan --search ARGV` searches: its `lowering.Target`, its
  candidates and the other arguments it passes `search.run_search`, for a script that runs the
  command's own search and keeps the records it needs. Bad flags exit as the command line does."""
  parser, p = _parsers()
  args = parser.parse_args(['plan', '--search', *argv])
  args.command_line = 'python -m zerojax plan --search ' + shlex.join(argv)
  _check_plan_flags(parser, p, args)
  _configure_jax(args.topology, _most_slices(args))
  return _search_setup(args)


def main(argv: list[str] | None = None) -> int:
  parser, p = _parsers()
  args = parser.parse_args(argv)
  # What reproduces this run, for the reports it writes.
  args.command_line = 'python -m zerojax ' + shlex.join(sys.argv[1:] if argv is None else argv)
  if args.command == 'plan':
    _check_plan_flags(parser, p, args)

  _configure_jax(getattr(args, 'topology', ''), _most_slices(args))
  return args.func(args)


def _most_slices(args) -> int:
  """The most slices the command compiles for (--slices, or the largest of --slice-counts)."""
  return max(getattr(args, 'slices', 1) or 1, *(getattr(args, 'slice_counts', None) or (1,)))


def _configure_jax(topology: str, slices: int = 1) -> None:
  """Before jax starts its backends: CPU only (no TPU probing when compiling
  ahead of time), and the faked devices of `--topology cpu:N`.

  `python -m zerojax` has imported jax already (through the package), so
  environment variables set here would come too late; jax's config is read
  when the first backend starts, which has not happened yet.
  """
  import jax

  if 'JAX_PLATFORMS' not in os.environ:
    jax.config.update('jax_platforms', 'cpu')
  if topology.startswith('cpu:'):
    try:
      count = int(topology[4:])
    except ValueError:
      raise SystemExit(f'error: --topology {topology!r}: expected cpu:N, e.g. cpu:8') from None
    jax.config.update('jax_num_cpu_devices', count * slices)


if __name__ == '__main__':
  sys.exit(main())
