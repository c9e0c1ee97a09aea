"""`python -m zerojax`: plan a run before launching it.

python -m zerojax plan --model llama2-70b --topology v5e:16x16 --mesh 16x16 --stage 3
python -m zerojax estimate --params 7e9 --devices 256
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import os
import shlex
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import checkpoint, hf_decoder, precision
from zerojax._src import lora as lora_lib
from zerojax._src.options import Options
from zerojax._src.planner import (
  candidates,
  display,
  estimate,
  flags,
  lowering,
  plan_report,
  presets,
  search,
  search_report,
)
from zerojax._src.planner.candidates import SCHEDULER_OPTION
from zerojax._src.planner.lowering import GRID_AXES, SLICE, TENSOR


def _log(start: float, message: str) -> None:
  print(f'[{time.perf_counter() - start:7.1f}s] {message}', flush=True)


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
  prefetch) returning its `ModelSpec` (a user's model runs its own layer loop); with --lora,
  the decoder with adapters."""
  model = _base_model(args)
  if getattr(args, 'lora', None) is None:
    if getattr(args, 'base_dtype', None) is not None:
      raise SystemExit('error: --base-dtype stores the frozen base of a LoRA model: give --lora R.')
    return model
  if callable(model):
    raise SystemExit(
      f'error: --lora adds adapters to the presets, decoder: and hf: models; --model'
      f' {args.model} builds its own (freeze its base with'
      ' zerojax.inspect.ModelSpec(trainable=...)).'
    )
  cfg = presets.PRESETS[model] if isinstance(model, str) else model
  targets = tuple(t.strip() for t in args.lora_targets.split(',') if t.strip())
  try:
    lora = lora_lib.LoraConfig(args.lora, 2.0 * args.lora, targets)
  except ValueError as e:
    raise SystemExit(f'error: --lora-targets: {e}') from None
  return dataclasses.replace(cfg, lora=lora)


def _base_model(args) -> Any:
  if args.model.startswith('decoder:'):
    try:
      return presets.parse_decoder(args.model[len('decoder:') :], args.seq_len)
    except ValueError as e:
      raise SystemExit(f'error: --model: {e}') from None
  if args.model.startswith('hf:'):  # a published checkpoint's config.json
    try:
      return hf_decoder.config_from_hf(args.model[len('hf:') :], seq_len=args.seq_len or 2048)
    except (ValueError, FileNotFoundError) as e:
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
  module_name, attr = args.model.split(':', 1)
  function = getattr(importlib.import_module(module_name), attr)
  takes_remat = 'remat' in inspect.signature(function).parameters
  named = [
    r for r in (args.remats or () if args.search else (args.remat,)) if r in presets.POLICIES
  ]
  if named and not takes_remat:
    raise SystemExit(
      f'error: remat {", ".join(map(repr, named))} is a policy the model applies in its own'
      f' layer loop, and --model {args.model} takes no `remat` argument to be told it. Give'
      f' {attr} a `remat` parameter and checkpoint its layer with'
      ' jax.checkpoint(layer, policy=zerojax.remat.policy(remat)), its activations tagged with'
      " zerojax.remat's names (jax.ad_checkpoint.checkpoint_name); or plan a preset or"
      ' decoder:... with it.'
    )

  model = _UserModel(args.model, function, takes_remat)
  model((args.remats or (args.remat,))[0] if args.search else args.remat, False)  # checked now
  return model


@dataclasses.dataclass(frozen=True)
class _UserModel:
  """`--model module:function` as a `lowering.Target` takes a model function: (remat,
  prefetch) -> `ModelSpec`, the function told the remat where it has a `remat` parameter."""

  flag: str
  function: Any
  takes_remat: bool

  def __call__(self, remat: str, prefetch: bool) -> presets.ModelSpec:
    made = self.function(remat=remat) if self.takes_remat else self.function()
    if not isinstance(made, presets.ModelSpec):
      raise SystemExit(
        f'error: --model {self.flag} returned a {type(made).__name__}; it must return a'
        ' zerojax.inspect.ModelSpec(name=..., init_fn=..., loss_fn=..., batch=...).'
      )
    return made


def cmd_search(args) -> int:
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
  devices, _ = flags.devices_of(args.topology)
  target, space, invalid = _search_space(args, devices)
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


def _settings(args) -> presets.ModelSettings:
  """How the presets compute, from the flags a plan and a search share."""
  try:
    return presets.ModelSettings(
      seq_len=args.seq_len,
      compute_dtype=args.compute_dtype,
      attention=args.attention,
      attention_chunk=args.attention_chunk,
      loss_chunk=args.loss_chunk,
      per_layer=not getattr(args, 'gather_all', False),
      base_dtype=getattr(args, 'base_dtype', None),
    )
  except (TypeError, ValueError) as e:
    raise SystemExit(f'error: {e}') from None


def _search_space(args, devices) -> tuple[Any, list, list]:
  """(target, candidates, invalid combinations) of `plan --search`'s flags."""
  model = _model(args)
  if callable(model):  # a user's model: its layer loop is its own
    remats = args.remats or candidates.default_remats(None, preset=False)
    searched = remats if model.takes_remat else remats[:1]
    if len(searched) < len(remats) or True in args.prefetch_options:
      print(
        f'note: --model {args.model} runs its own layer loop'
        + ('' if model.takes_remat else ' and takes no `remat`: --remats and')
        + ' --prefetch-options '
        + ('is' if model.takes_remat else 'are')
        + ' not searched for it',
        file=sys.stderr,
      )
    args.remats, args.prefetch_options = searched, (False,)
  shares = flags.scheduler_shares(args, args.scheduler_shares, '--scheduler-shares')
  given = dict(
    remat=args.remats, scheduler_share=shares, collective_offload=args.collective_offloads
  )
  # Not given: the search's defaults (every offload on a one-chip topology).
  offloads = dict(
    offload=args.offloads, update_on=args.update_ons, offload_params=args.offload_params_options
  )
  try:
    target = lowering.make_target(
      model,
      args.topology,
      devices=devices,
      optimizer=lambda: flags.optimizer(args.optimizer),
      mixed_precision=args.mixed_precision,
      settings=_settings(args),
      slice_devices={
        s: flags.devices_of(args.topology, s)[0] for s in set(args.slice_counts) if s > 1
      },
    )
    space, invalid = search.search_space(
      target,
      dict(args.compiler_options),
      names={
        'scheduler_share': '--scheduler-shares',
        'collective_offload': '--collective-offloads',
      },
      stages=args.stages,
      layouts=args.layouts,
      micro_batches=args.micro_batches,
      prefetch=args.prefetch_options,
      quantize=args.quantizes,
      batch_per_chip=args.batches_per_chip,
      slices=args.slice_counts,
      tensor=args.tensor_sizes,
      **{k: v for k, v in given.items() if v},
      **{k: v for k, v in offloads.items() if v is not None},
    )
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  return target, space, invalid


def _write_search(args, report, text: str) -> None:
  """`--out`: the search's table (.txt), its figures (.json) and its plot (.png)."""
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(
    args.out,
    f'search_{args.model.replace(":", "_").replace(os.sep, "_")}_{args.topology.replace(":", "-")}',
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
    flags.scheduler_shares(args, args.scheduler_shares, '--scheduler-shares')
  else:
    flags.scheduler_shares(
      args, args.scheduler_share and (args.scheduler_share,), '--scheduler-share'
    )
  flags.check_compiler_options(args)
  if args.search:
    return cmd_search(args)
  print(f'command: {args.command_line}', flush=True)
  start = time.perf_counter()
  target, candidate, hbm_gib = _plan_target(args, start)
  phases = {'topology': time.perf_counter() - start}
  options = dict(args.compiler_options)
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
    print(
      f'\n{candidate.label()}: DOES NOT FIT: {plan_report.refusal(result, hbm_gib)}',
      file=sys.stderr,
    )
    return 3
  t = time.perf_counter()
  out = plan_report.report_plan(args, target, result, hbm_gib)
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
  devices, hbm_gib = flags.devices_of(args.topology, args.slices)
  n = len(devices)
  _log(
    start,
    f'topology {args.topology}: {n} devices ({devices[0].device_kind})'
    + (f' in {args.slices} slices joined by the data-center network' if args.slices > 1 else ''),
  )
  shape, names = _mesh_shape(args.mesh, n // args.slices, args.slices)
  full = ((SLICE, *names), (args.slices, *shape)) if args.slices > 1 else (names, shape)
  explicit = _gradients(args, full[0])
  try:
    target = lowering.make_target(
      _model(args),
      args.topology,
      devices=devices[: n // args.slices],
      optimizer=lambda: flags.optimizer(args.optimizer),
      mixed_precision=args.mixed_precision,
      settings=_settings(args),
      slice_devices={args.slices: devices} if args.slices > 1 else {},
      mesh=(shape, names),
      gradients='zerojax' if explicit else 'jax',
      time_steps=False,
    )
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  chip = target.chip
  remat = 'none' if args.no_remat else args.remat
  offload = args.collective_offload
  try:
    candidates.check_collective_offloads(
      args.topology, chip, (offload,), dict(args.compiler_options), '--collective-offload'
    )
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  shares = flags.scheduler_shares(
    args, args.scheduler_share and (args.scheduler_share,), '--scheduler-share'
  )
  candidate = candidates.Candidate(
    args.stage,
    layout='flat' if names == ('data',) else 'torus',
    remat=remat,
    prefetch=args.prefetch,
    offload=args.offload,
    update_on=args.update_on,
    offload_params=args.offload_params,
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


def cmd_estimate(args) -> int:

  if args.model:
    if args.model not in presets.PRESETS:
      raise SystemExit(f'error: --model {args.model!r} is not a preset: {sorted(presets.PRESETS)}')
    params = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
      presets.PRESETS[args.model].shapes(),
      is_leaf=lambda x: isinstance(x, tuple),
    )
  elif args.params:
    params = args.params
  else:
    raise SystemExit('error: give --params COUNT (e.g. 7e9) or --model PRESET')
  tx, dtype = flags.optimizer(args.optimizer), jnp.float32
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
  try:
    print(checkpoint.format_checkpoint(args.directory, args.step))
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f'error: {e}') from None
  return 0


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
  """(the command line's parser, its `plan` subparser)."""
  parser = argparse.ArgumentParser(prog='python -m zerojax', description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='command', required=True)
  p = flags.plan_parser(sub)
  flags.search_arguments(p)
  p.set_defaults(func=cmd_plan)
  flags.estimate_parser(sub).set_defaults(func=cmd_estimate)
  flags.inspect_parser(sub).set_defaults(func=cmd_inspect)
  return parser, p


def plan_target(argv: list[str]) -> tuple[Any, Any, int | None]:
  """What `python -m zerojax plan ARGV` plans: its `lowering.Target`, its one `Candidate` and
  the chips' HBM in bytes (None: the chip's), for a script that evaluates other candidates on
  the same target with `search.evaluate` (the same plan at other scheduler shares, say). Bad
  flags exit as the command line does."""
  parser, p = _parsers()
  args = parser.parse_args(['plan', *argv])
  args.command_line = 'python -m zerojax plan ' + shlex.join(argv)
  flags.check_plan_flags(parser, p, args)
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
  flags.check_plan_flags(parser, p, args)
  _configure_jax(args.topology, flags.most_slices(args))
  return _search_setup(args)


def main(argv: list[str] | None = None) -> int:
  parser, p = _parsers()
  args = parser.parse_args(argv)
  # What reproduces this run, for the reports it writes.
  args.command_line = 'python -m zerojax ' + shlex.join(sys.argv[1:] if argv is None else argv)
  if args.command == 'plan':
    flags.check_plan_flags(parser, p, args)

  _configure_jax(getattr(args, 'topology', ''), flags.most_slices(args))
  return args.func(args)


def _configure_jax(topology: str, slices: int = 1) -> None:
  """Before jax starts its backends: CPU only (no TPU probing when compiling
  ahead of time), and the faked devices of `--topology cpu:N`.

  `python -m zerojax` has imported jax already (through the package), so
  environment variables set here would come too late; jax's config is read
  when the first backend starts, which has not happened yet.
  """
  if 'JAX_PLATFORMS' not in os.environ:
    jax.config.update('jax_platforms', 'cpu')
  if topology.startswith('cpu:'):
    try:
      count = int(topology[4:])
    except ValueError:
      raise SystemExit(f'error: --topology {topology!r}: expected cpu:N, e.g. cpu:8') from None
    try:
      jax.config.update('jax_num_cpu_devices', count * slices)
    except RuntimeError:  # jax started already (plan_target in a program): its devices serve
      if len(jax.devices('cpu')) < count * slices:
        raise SystemExit(
          f'error: --topology {topology!r}: jax started with {len(jax.devices("cpu"))} CPU'
          f' devices, fewer than {count * slices}; plan before any jax computation runs.'
        ) from None


if __name__ == '__main__':
  sys.exit(main())
