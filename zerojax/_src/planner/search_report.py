"""Presenting a plan search: the ranked table, JSON, the plot, the winner's lines, and what
to do when nothing fits."""

from __future__ import annotations

import dataclasses
import math

from zerojax._src.planner import presets
from zerojax._src.planner.candidates import QUANTIZE
from zerojax._src.planner.display import phase_totals
from zerojax._src.planner.lowering import TENSOR, mesh_shape, model_label, model_spec, zero_options
from zerojax._src.planner.roofline import GiB
from zerojax._src.planner.search import SearchReport, as_dict


def winner_code(report: SearchReport) -> str:
  """The lines to paste for the winning candidate: its mesh, optimizer and gradient function."""
  r = report.winner
  if r is None:
    return '# no candidate fits'
  c, t = r.candidate, report.target
  shape, names = mesh_shape(t, c)
  # Several slices: an outer data-parallel 'slice' axis (on TPU, build it with
  # mesh_utils.create_hybrid_device_mesh; the axis across slices is found from the devices).
  full = ((c.slices, *shape), ('slice', *names)) if c.slices > 1 else (shape, names)
  inner = 'optax.adamw(lr)'
  if t.mixed_precision:
    inner = f'zerojax.mixed_precision({inner})'
  remat = presets.policy_code(c.remat)
  scan_remat = "remat='gathers'" if c.remat == 'gathers' else "remat='full'"
  loop = (
    f'zerojax.scan_layers({scan_remat}, prefetch)'
    if c.prefetch
    else f'a scanned layer loop with {remat}'
  )
  if c.tensor > 1:  # the compiler places the tensor-parallel collectives
    grad = 'grad_fn = jax.value_and_grad(loss_fn)'
  else:
    grad = (
      f'grad_fn = zerojax.value_and_grad(loss_fn, tx, per_layer={c.stage >= 2 and c.layout != "hpz"}'
      + (f', micro_batches={c.micro_batches}' if c.micro_batches > 1 else '')
      + ')'
    )
  lines = [
    f'mesh = jax.make_mesh({full[0]}, {full[1]})',
    f'tx = zerojax.zero_stage({inner}, {", ".join(_zero_stage_args(report, names))})',
    grad,
    f'# {c.batch_per_chip} sequence(s) per chip per step; layers in {loop}',
  ]
  if c.tensor > 1:
    lines.append(
      f'# param_specs: PartitionSpecs over {TENSOR!r} that split each layer Megatron-style'
      ' (heads, MLP columns, vocabulary)'
    )
  if c.scheduler_share is not None or c.collective_offload is not None:
    lines.append(
      f'# compile the step with jax.jit(train_step, compiler_options={c.compiler_options()})'
    )
  return '\n'.join(lines)


def _zero_stage_args(report: SearchReport, names: tuple[str, ...]) -> list[str]:
  """The winner's `zerojax.zero_stage` arguments after the optimizer, over mesh axes `names`."""
  c, t = report.winner.candidate, report.target
  spec = model_spec(t, c)
  options = zero_options(c, tuple(n for n in names if n != TENSOR), spec.stacked)
  args = [f'stage={c.stage}', 'mesh=mesh', f'axis={options.axis!r}']
  if options.replica_axis is not None:
    args.append(f'replica_axis={options.replica_axis!r}')
  if options.param_axis is not None:
    args.append(f'param_axis={options.param_axis!r}')
  if options.offload is not None:
    args += [f'offload={options.offload!r}', f'update_on={options.update_on!r}']
  if options.stacked is not None:
    args.append(f'stacked={options.stacked!r}')
  if options.quantize is not None:
    q = QUANTIZE[c.quantize]
    args.append(f'quantize=zerojax.Quantize(weights={q["weights"]!r}, grads={q["grads"]!r})')
  if c.tensor > 1:
    args.append('param_specs=param_specs')
  if spec.trainable is not None:  # a LoRA decoder's adapters
    args.append('trainable=zerojax.llama.is_adapter')
  return args


def _gib(n: float) -> str:
  return f'{n / GiB:.2f}'


def format_search(report: SearchReport, limit: int = 40) -> str:
  """The ranked table (predicted times are labelled as such)."""
  t = report.target
  chip = t.chip
  lines = [
    f'plan search: {model_label(t)} on {t.topology}'
    f' ({len(t.devices)} chips); {len(report.results)} candidates evaluated,'
    f' {len(report.invalid)} combinations not valid, in {report.seconds:.0f} s',
  ]
  if chip is not None:
    lines.append(f'roofline ({chip.name}): {chip.source}')
  sources = sorted({r.host_traffic.source for r in report.results if r.host_traffic} - {'none'})
  offloads = bool(sources)
  if offloads:
    where = {
      'hlo': 'counted in the compiled programs',
      'formula': 'by formula (XLA:CPU programs carry no memory spaces)',
    }
    lines.append(
      'host link: "host GB" is bytes down + up per step and chip, '
      + ', '.join(where[k] for k in sources if k in where)
      + '; "host ovl" the share overlapping compute'
      + (f'; time at {chip.host_link_bandwidth / 1e9:.0f} GB/s, assumed' if chip else '')
    )
  measured = any(r.measured_seconds for r in report.results)
  head = f'{"#":>3} {"candidate":<60} {"peak GiB":>8} {"ring/floor":>10} {"overlap":>7}'
  if offloads:
    head += f' {"host GB":>7} {"host ovl":>8}'
  head += f' {"TFLOP/chip":>10} {"predicted s":>11}' + (
    f' {"measured s":>10} {"pred/meas":>9}' if measured else ''
  )
  lines += ['', head]
  for i, r in enumerate([r for r in report.ranked if r.fits][:limit], 1):
    # Within a slice (the floor's): bytes between slices are in the DCN column of the JSON.
    ratio = (r.ring_bytes - r.dcn_bytes) / r.floor_bytes if r.floor_bytes else float('nan')
    share = r.overlapped_bytes / r.ring_bytes if r.ring_bytes else 0.0
    peak = _gib(r.peak_bytes) + ('' if r.peak_reported else '*')
    row = f'{i:>3} {r.candidate.label():<60} {peak:>8} {ratio:>10.3f}'
    row += f' {share:>7.0%}'
    if offloads:
      h = r.host_traffic
      row += f' {h.moved / 1e9:>7.2f} {h.overlapped:>8.0%}'
    row += f' {r.flops / 1e12:>10.2f} {r.step_seconds:>11.4f}'
    if measured:
      m = r.measured_seconds
      row += f' {m:>10.4f} {r.step_seconds / m:>9.2f}' if m else f' {"":>10} {"":>9}'
    lines.append(row)
  if any(r.fits and not r.peak_reported for r in report.results):
    lines.append(
      '  * holds host memory: the TPU compiler reports no device-only peak (its own counts host'
      " memory too) but compiled it within the chip's HBM; the figure is arguments + outputs"
      ' - aliased + temporaries as it reports them'
    )
  not_fitting = [r for r in report.results if not r.fits]
  if not_fitting:
    lines += ['', 'why the others do not run:']
    lines += [f'  {r.candidate.label():<60} {r.status}' for r in not_fitting]
  lines += ['', 'winner (predicted, not measured):' if report.winner else 'no candidate fits']
  lines += ['  ' + line for line in winner_code(report).splitlines()]
  return '\n'.join(lines)


def search_json(report: SearchReport) -> dict:
  phases, programs = phase_totals(report)
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
        'peak_reported': r.peak_reported,
        'ring_bytes': r.ring_bytes,
        'floor_bytes': r.floor_bytes,
        'overlapped_ring_bytes': r.overlapped_bytes,
        'dcn_ring_bytes': r.dcn_bytes,
        'dcn_floor_bytes': r.dcn_floor_bytes,
        'flops': r.flops,
        'cost_analysis_flops': r.cost_analysis_flops,
        'bytes_accessed': r.bytes_accessed,
        'predicted_seconds': as_dict(r.predicted),
        'host_traffic': as_dict(r.host_traffic),
        'measured_seconds': r.measured_seconds,
        'compile_seconds': r.compile_seconds,
      }
    )
  return {
    'model': t.model if isinstance(t.model, str) else 'custom',
    'model_revision': presets.MODEL_REVISION,
    'topology': t.topology,
    'num_devices': len(t.devices),
    'mixed_precision': t.mixed_precision,
    'seq_len': t.settings.seq_len,
    'attention_chunk': t.settings.attention_chunk,
    'attention': t.settings.attention,
    'roofline': None if t.chip is None else dataclasses.asdict(t.chip),
    'search_seconds': report.seconds,
    'phase_seconds': phases,
    'programs': programs,
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
    pts = [r for r in compiled if r.fits == fits and r.predicted is not None]
    ax.scatter(
      [r.peak_bytes / GiB for r in pts], [r.step_seconds for r in pts], c=colour, label=name
    )
  win = report.winner
  if win is not None:
    ax.scatter(
      [win.peak_bytes / GiB],
      [win.step_seconds],
      s=200,
      facecolors='none',
      edgecolors='black',
      label='winner',
    )
  if report.target.chip is not None and report.target.chip.hbm_bytes:
    ax.axvline(report.target.chip.hbm_bytes / GiB, color='grey', ls='--', label='HBM per chip')
  ax.set_xlabel('peak memory per chip, GiB (compiled program)')
  ax.set_ylabel('predicted step time, s (roofline, not measured)')
  ax.set_title(f'{report.target.model} on {report.target.topology}: plan search')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def nothing_fits(report: SearchReport) -> str:
  """What to do when no candidate fits: the closest one, and the slice the states need."""
  t = report.target
  hbm = report.hbm_bytes or 0
  compiled = [r for r in report.results if r.peak_bytes]
  lines = [f'no candidate fits on {t.topology} ({len(t.devices)} chips).']
  if compiled:
    best = min(compiled, key=lambda r: r.peak_bytes)
    lines.append(f'closest: {best.candidate.label()} at {_gib(best.peak_bytes)} GiB peak per chip.')
  refused = [(r.compiler_needs_gigabytes, r) for r in report.results if r.compiler_needs_gigabytes]
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
