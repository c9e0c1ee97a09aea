"""The planner against MaxText's published TPU training throughput (v5p and v5e; one slice, two).

For each single-slice row MaxText published for TPU v5p (its configs/v5p README:
measured runs, sequence 2048, Adam, bf16 compute), this plans the same model,
batch per chip, rematerialisation and layout with `python -m zerojax plan` (the
TPU compiler of the installed libtpu, no TPU needed) and compares the predicted
TFLOP/s per chip with the published one. TFLOP/s is MaxText's own count of a
step's model FLOPs (`maxtext_flops`, written here from MaxText's formula)
divided by the step time: published = that count / measured time, predicted =
that count / the planner's predicted time.

    python benchmarks/bench_maxtext.py [--rows 32B,64B] [--out benchmarks/results]

Writes maxtext_v5p.libtpu-VERSION.json and each row's plan report beside it
(maxtext_v5p_ROW.libtpu-VERSION.txt, one set per TPU compiler: run it at each
supported jax), and maxtext_v5p.md: every compiler's rows side by side (row,
predicted, published, ratio, peak, fits). Each row compiles a 32B-256B model for
64-512 chips: minutes per row on a 2-core machine.

With --chip v5e it plans MaxText's v5e-256 rows instead (its configs/v5e README and scripts:
the 16B, 32B and 64B models at 6, 4 and 2 sequences per chip, remat full, flash attention,
FSDP over all 256 chips, which zerojax lays out as ZeRO-3 over both torus axes, --mesh 16x16),
written as maxtext_v5e.* beside the v5p results.

With --slices 2 (v5e: any of 2,4,8,16,32) it plans each row's runs on that many slices
(MaxText's: the same slice repeated, data parallel over the data-center network; `plan
--slices S`, hierarchical ZeRO) and checks the scaling: predicted S-slice TFLOP/s over
predicted one-slice against the published ratio
(maxtext_v5p_slices.libtpu-VERSION.json, maxtext_v5p_slices.md). The one-slice plans must be
in --out already (run without --slices first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SEQ, VOCAB, HEAD = 2048, 32000, 128

# (name, width, heads, MLP, layers, topology (chips = TensorCores / 2), tensor size,
#  batch per chip, published TFLOP/s per chip): MaxText's v5p table, single slices.
ROWS = [
  ('32B', 8192, 64, 28672, 32, 'v5p:4x4x4', 4, 7, 328.0),
  ('64B', 8192, 64, 28672, 64, 'v5p:4x4x4', 4, 3, 323.0),
  ('128B', 8192, 128, 57344, 64, 'v5p:4x4x8', 8, 1, 315.0),
  ('128B-512', 8192, 128, 57344, 64, 'v5p:4x8x8', 8, 1, 316.0),
  ('256B', 16384, 128, 57344, 64, 'v5p:8x8x8', 8, 1, 308.0),
]  # fmt: skip


# Published TFLOP/s per chip of each row's runs on several slices, by the number of slices
# (MaxText's v5p table: two slices, "+ data parallel over DCN", the same batch per chip).
V5P_SLICES = {
  2: {'32B': 319.0, '64B': 309.0, '128B': 305.0, '128B-512': 274.0, '256B': 289.0},
}

# MaxText's v5e table (configs/v5e/README.md, measured on 1 to 32 v5e-256 slices) with each
# model's script: batch per chip 6 / 4 / 2, remat full, flash attention, FSDP over all chips.
V5E_ROWS = [
  ('16B', 4096, 64, 28672, 32, 'v5e:16x16', 1, 6, 120.0),
  ('32B', 8192, 64, 28672, 32, 'v5e:16x16', 1, 4, 132.0),
  ('64B', 8192, 64, 28672, 64, 'v5e:16x16', 1, 2, 118.0),
]  # fmt: skip
V5E_SLICES = {
  2: {'16B': 117.0, '32B': 128.0, '64B': 112.0},
  4: {'16B': 117.0, '32B': 126.0, '64B': 110.0},
  8: {'16B': 115.0, '32B': 125.0, '64B': 108.0},
  16: {'16B': 111.0, '32B': 123.0, '64B': 105.0},
  32: {'16B': 108.0, '32B': 119.0, '64B': 99.0},
}

# Per chip family: its rows, their figures on several slices and MaxText's rematerialisation.
CHIPS = {
  'v5p': (ROWS, V5P_SLICES, 'minimal'),
  'v5e': (V5E_ROWS, V5E_SLICES, 'full'),
}


def maxtext_flops(width, heads, mlp, layers, batch, seq=SEQ, vocab=VOCAB, head=HEAD) -> float:
  """MaxText's model FLOPs of one training step per chip (forward + backward = 3 x forward),
  attention counted in full (not halved for the causal mask), as when these runs were
  published. Written from MaxText's formula, not from zerojax's count."""
  tokens = batch * seq
  mlp_f = 2 * tokens * mlp * width * 2 + 2 * tokens * mlp * width
  qkv = 2 * tokens * width * (heads + 2 * heads) * head
  proj = 2 * tokens * width * heads * head
  embed = 2 * tokens * width * vocab
  attention = 4 * batch * seq**2 * heads * head
  return 3 * ((mlp_f + qkv + proj) * layers + embed) + 3 * attention * layers


def chip_count(topology: str) -> int:
  """The chips of a 'v5p:4x4x4' topology."""
  chips = 1
  for d in topology.split(':')[1].split('x'):
    chips *= int(d)
  return chips


def decoder_model(width: int, heads: int, mlp: int, layers: int) -> str:
  """The `--model decoder:...` of one of MaxText's rows."""
  return (
    f'decoder:vocab={VOCAB},d_model={width},n_layers={layers},n_heads={heads},d_ff={mlp},'
    f'head_size={HEAD}'
  )


def row_mesh(topology: str, tensor: int) -> str:
  """A row's `--mesh`: a tensor axis beside ZeRO's, or (FSDP over every chip) ZeRO over each
  torus axis."""
  chips = chip_count(topology)
  return f'data={chips // tensor},tensor={tensor}' if tensor > 1 else topology.split(':')[1]


def plan_row(
  row, out: str, tag: str, reuse: bool = False, slices: int = 1, chip: str = 'v5p'
) -> dict:
  name, width, heads, mlp, layers, topology, tensor, batch, published = row
  _, sliced, remat = CHIPS[chip]
  if slices > 1:
    published = sliced[slices][name]
  chips, model = chip_count(topology), decoder_model(width, heads, mlp, layers)
  stem = os.path.join(
    out, f'maxtext_{chip}_{name}' + (f'_{slices}slices' if slices > 1 else '') + f'.{tag}'
  )
  mesh = row_mesh(topology, tensor)
  cmd = [
    sys.executable, '-m', 'zerojax', 'plan', '--model', model, '--topology', topology,
    '--mesh', mesh, '--stage', '3',
    '--batch-per-chip', str(batch), '--seq-len', str(SEQ), '--remat', remat,
    '--attention', 'flash', *(['--slices', str(slices)] if slices > 1 else []),
    '--json', os.path.relpath(stem + '.json'),
  ]  # fmt: skip
  start = time.perf_counter()
  if reuse and os.path.exists(stem + '.json'):
    print(f'  (reusing {stem}.json)', flush=True)
  else:
    if os.path.exists(stem + '.json'):
      os.remove(stem + '.json')
    done = subprocess.run(cmd, capture_output=True, text=True)
    with open(stem + '.txt', 'w') as f:
      f.write(done.stdout)
  if not os.path.exists(stem + '.json'):
    raise SystemExit(f'{name}: the plan failed (exit {done.returncode}):\n{done.stderr[-3000:]}')
  with open(stem + '.json') as f:
    if json.load(f)['command'].split(' --json ')[0] != 'python -m zerojax ' + ' '.join(cmd[3:-2]):
      raise SystemExit(f'{name}: {stem}.json was planned with another command; drop --reuse')
  with open(stem + '.json') as f:
    plan = json.load(f)
  flops = maxtext_flops(width, heads, mlp, layers, batch)
  step = plan['predicted_seconds']['step']
  predicted = flops / step / 1e12
  return {
    'row': name, 'topology': topology, 'chips': chips, 'tensor': tensor, 'batch_per_chip': batch,
    'maxtext_flops_per_chip': flops, 'zerojax_matmul_flops_per_chip': plan['matmul_flops_per_chip'],
    'predicted_step_seconds': step, 'published_step_seconds': flops / (published * 1e12),
    'predicted_tflops': predicted, 'published_tflops': published, 'ratio': predicted / published,
    'peak_gib': plan['memory']['peak'] / 2**30, 'fits': plan['fits'],
    'predicted_parts': plan['predicted_seconds'], 'kernels': plan['kernels'],
    'wall_seconds': time.perf_counter() - start, 'slices': slices,
    'dcn_bytes': sum(plan['collectives'].get('dcn_ring_bytes', {}).values()),
    'dcn_floor_bytes': plan.get('dcn_floor_bytes'),
  }  # fmt: skip


def compiler_tag() -> str:
  """'libtpu-0.0.42' for libtpu 0.0.42.1: the name each compiler's results carry."""
  import libtpu

  return 'libtpu-' + '.'.join(getattr(libtpu, '__version__', '?').split('.')[:3])


def table(out: str, chip: str = 'v5p') -> list[str]:
  """The rows of every compiler's results in `out`, side by side (one column group each)."""
  runs = {}
  for name in sorted(os.listdir(out)):
    if name.startswith(f'maxtext_{chip}.libtpu-') and name.endswith('.json'):
      with open(os.path.join(out, name)) as f:
        run = json.load(f)
      runs[run['versions']['libtpu']] = {r['row']: r for r in run['rows']}
  order = sorted(runs, key=lambda v: tuple(int(x) for x in v.split('.') if x.isdigit()))
  head = '| row | slice | tensor | batch/chip | published TFLOP/s |'
  rule = '|---|---|---|---|---|'
  for v in order:
    head += f' predicted ({v}) | ratio | peak GiB | fits |'
    rule += '---|---|---|---|'
  lines = [
    f'MaxText {chip}, one slice: TFLOP/s per chip predicted by `python -m zerojax plan` with'
    ' each TPU compiler, against the published figure',
    '',
    head,
    rule,
  ]
  for row in CHIPS[chip][0]:
    got = [runs[v].get(row[0]) for v in order]
    if not any(got):
      continue
    line = f'| {row[0]} | {row[5]} | {row[6]} | {row[7]} | {row[8]:.0f} |'
    for r in got:
      line += (
        f' {r["predicted_tflops"]:.0f} | {r["ratio"]:.2f} | {r["peak_gib"]:.1f} | {r["fits"]} |'
        if r
        else ' | | | |'
      )
    lines.append(line)
  import model_revision

  return lines + model_revision.note(out, (f'maxtext_{chip}.libtpu-',))


def scaling_rows(one: list[dict], sliced: list[dict]) -> list[dict]:
  """Each row's predicted several-slice / one-slice TFLOP/s beside the published ratio."""
  by_name = {r['row']: r for r in one}
  out = []
  for r in sliced:
    base = by_name[r['row']]
    predicted = r['predicted_tflops'] / base['predicted_tflops']
    published = r['published_tflops'] / base['published_tflops']
    out.append({
      'row': r['row'], 'slices': r['slices'], 'chips_per_slice': r['chips'],
      'predicted_one': base['predicted_tflops'], 'predicted_sliced': r['predicted_tflops'],
      'published_one': base['published_tflops'], 'published_sliced': r['published_tflops'],
      'predicted_scaling': predicted,
      'published_scaling': published, 'difference_points': 100 * (predicted - published),
      'dcn_over_floor': r['dcn_bytes'] / r['dcn_floor_bytes'] if r['dcn_floor_bytes'] else None,
      'dcn_seconds': r['predicted_parts'].get('dcn'),
      'dcn_exposed_seconds': r['predicted_parts'].get('dcn_exposed'),
      'peak_gib': r['peak_gib'], 'fits': r['fits'],
    })  # fmt: skip
  return out


def scaling_table(out: str, chip: str = 'v5p') -> list[str]:
  """Every compiler's scaling rows in `out`, one line each."""
  lines = [
    f'MaxText {chip}, several slices over the data-center network: predicted S-slice /'
    ' one-slice TFLOP/s per chip against the published ratio (`plan --slices S`)',
    '',
    '| row | slices | compiler | predicted 1 slice | predicted S slices | predicted scaling |'
    ' published scaling | difference (points) | DCN / floor | DCN s (exposed) | peak GiB | fits |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name in sorted(os.listdir(out)):
    if not (name.startswith(f'maxtext_{chip}_slices.libtpu-') and name.endswith('.json')):
      continue
    with open(os.path.join(out, name)) as f:
      run = json.load(f)
    for r in run['rows']:
      lines.append(
        f'| {r["row"]} | {r["slices"]} | {run["versions"]["libtpu"]} | {r["predicted_one"]:.0f} |'
        f' {r["predicted_sliced"]:.0f} | {r["predicted_scaling"]:.3f} |'
        f' {r["published_scaling"]:.3f} |'
        f' {r["difference_points"]:+.1f} | {r["dcn_over_floor"]:.3f} |'
        f' {r["dcn_seconds"]:.3f} ({r["dcn_exposed_seconds"]:.3f}) | {r["peak_gib"]:.1f} |'
        f' {r["fits"]} |'
      )
  import model_revision

  return lines + model_revision.note(out, (f'maxtext_{chip}_slices.libtpu-',))


def _save(out: str, name: str, payload: dict) -> None:
  with open(os.path.join(out, name), 'w') as f:
    json.dump(payload, f, indent=2)


def _show(out: str, md: str, lines: list[str]) -> None:
  with open(os.path.join(out, md), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--chip', default='v5p', choices=sorted(CHIPS), help="whose published rows (MaxText's tables)"
  )
  parser.add_argument('--rows', default=None, help='comma-separated row names (default: all)')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  parser.add_argument(
    '--reuse', action='store_true', help="reuse a row's plan JSON already in --out (same command)"
  )
  parser.add_argument(
    '--slices',
    default='1',
    help='1 (one slice), or comma-separated slice counts MaxText published for --chip (v5p: 2;'
    ' v5e: 2,4,8,16,32): those runs and their scaling against one slice',
  )
  args = parser.parse_args()
  tag, chip = compiler_tag(), args.chip
  rows, published, _ = CHIPS[chip]
  wanted = args.rows.split(',') if args.rows else [r[0] for r in rows]
  unknown = sorted(set(wanted) - {r[0] for r in rows})
  if unknown:
    parser.error(f'--rows: no {chip} row {unknown}; the rows are {[r[0] for r in rows]}')
  counts = [int(c) for c in args.slices.split(',')]
  if counts != [1] and not set(counts) <= set(published):
    parser.error(f'--slices: MaxText published {chip} runs on {sorted(published)} slices, or 1')
  os.makedirs(args.out, exist_ok=True)
  import jax
  import libtpu

  from zerojax._src.planner import presets

  results = []
  for row in (r for r in rows if r[0] in wanted):
    for slices in counts:
      where = row[5] + (f' x {slices} slices' if slices > 1 else '')
      print(f'planning {row[0]} on {where} with {tag} ...', flush=True)
      results.append(plan_row(row, args.out, tag, args.reuse, slices, chip))
      r = results[-1]
      print(f'  predicted {r["predicted_tflops"]:.0f} TFLOP/s, published {r["published_tflops"]:.0f}:'
            f' {r["ratio"]:.2f}x; peak {r["peak_gib"]:.1f} GiB; {r["wall_seconds"]:.0f} s', flush=True)  # fmt: skip
  versions = {'jax': jax.__version__, 'libtpu': getattr(libtpu, '__version__', '?')}
  versions['model_revision'] = presets.MODEL_REVISION
  if counts != [1]:
    with open(os.path.join(args.out, f'maxtext_{chip}.{tag}.json')) as f:
      one = json.load(f)['rows']
    payload = {'versions': versions, 'rows': scaling_rows(one, results), 'plans': results}
    _save(args.out, f'maxtext_{chip}_slices.{tag}.json', payload)
    _show(args.out, f'maxtext_{chip}_slices.md', scaling_table(args.out, chip))
    return 0
  _save(args.out, f'maxtext_{chip}.{tag}.json', {'versions': versions, 'rows': results})
  _show(args.out, f'maxtext_{chip}.md', table(args.out, chip))
  return 0


if __name__ == '__main__':
  sys.exit(main())
