"""A single plan's printed report and its JSON (a search's are in `search_report`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from zerojax._src.plan import fmt_bytes
from zerojax._src.planner import presets, roofline, search


def refusal(result: Any, hbm_gib: int | None) -> str:
  """Why a plan was refused before its program could be reported, with the figures."""
  if result.reason == search.STATES_EXCEED_HBM:
    lowered = result.lowered
    model = f'{lowered.num_params:,} parameters; ' if lowered is not None else ''
    return (
      f'{result.status} ({model}model states at rest {result.theory_bytes / roofline.GiB:.2f}'
      f' GiB per chip, of {hbm_gib} GiB HBM)'
    )
  if result.reason == search.STATE_EXCEEDS_HOST:
    host = result.lowered.plan.bytes_per_device()['host'] / roofline.GiB
    return f'{result.status} ({host:.2f} GiB per chip offloaded)'
  return result.status


def report_plan(args, target: Any, result: Any, hbm_gib: int | None) -> dict:
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
  fits = _print_fit(hbm_gib, report, sizes, target.chip)
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
    'model_revision': presets.MODEL_REVISION,
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


def _print_fit(hbm_gib: int | None, report, sizes: dict, chip: Any) -> bool | None:
  """Prints peak memory against HBM (and host memory against the host's share); returns
  whether the plan fits (None where the device memory is not known)."""
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
  lines = [
    "largest arrays in one chip's program (each made by one instruction; the compiler may"
    ' place several in one buffer, so they do not add up to the peak):'
  ]
  for g in groups:
    what = f'{fmt_bytes(g["bytes"]):>10}  {g["type"]}' + (
      f' x{g["count"]}' if g['count'] > 1 else ''
    )
    if g.get('stacked_over'):
      what += (
        f', stacked over a loop of {g["stacked_over"]}'
        f' ({fmt_bytes(g["bytes"] // g["stacked_over"])} per iteration)'
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
