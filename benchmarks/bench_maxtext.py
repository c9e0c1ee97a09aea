"""The planner against MaxText's published v5p training throughput (one slice).

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


def plan_row(row, out: str, tag: str, reuse: bool = False) -> dict:
  name, width, heads, mlp, layers, topology, tensor, batch, published = row
  chips = 1
  for d in topology.split(':')[1].split('x'):
    chips *= int(d)
  model = (
    f'decoder:vocab={VOCAB},d_model={width},n_layers={layers},n_heads={heads},d_ff={mlp},'
    f'head_size={HEAD}'
  )
  stem = os.path.join(out, f'maxtext_v5p_{name}.{tag}')
  cmd = [
    sys.executable, '-m', 'zerojax', 'plan', '--model', model, '--topology', topology,
    '--mesh', f'data={chips // tensor},tensor={tensor}', '--stage', '3',
    '--batch-per-chip', str(batch), '--seq-len', str(SEQ), '--remat', 'minimal',
    '--attention', 'flash', '--json', os.path.relpath(stem + '.json'),
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
    'wall_seconds': time.perf_counter() - start,
  }  # fmt: skip


def compiler_tag() -> str:
  """'libtpu-0.0.42' for libtpu 0.0.42.1: the name each compiler's results carry."""
  import libtpu

  return 'libtpu-' + '.'.join(getattr(libtpu, '__version__', '?').split('.')[:3])


def table(out: str) -> list[str]:
  """The rows of every compiler's results in `out`, side by side (one column group each)."""
  runs = {}
  for name in sorted(os.listdir(out)):
    if name.startswith('maxtext_v5p.libtpu-') and name.endswith('.json'):
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
    'MaxText v5p, one slice: TFLOP/s per chip predicted by `python -m zerojax plan` with each'
    ' TPU compiler, against the published figure',
    '',
    head,
    rule,
  ]
  for row in ROWS:
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
  return lines


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', default=','.join(r[0] for r in ROWS))
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  parser.add_argument(
    '--reuse', action='store_true', help="reuse a row's plan JSON already in --out (same command)"
  )
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  import jax
  import libtpu

  tag = compiler_tag()
  wanted = args.rows.split(',')
  results = []
  for row in ROWS:
    if row[0] in wanted:
      print(f'planning {row[0]} on {row[5]} with {tag} ...', flush=True)
      results.append(plan_row(row, args.out, tag, args.reuse))
      r = results[-1]
      print(f'  predicted {r["predicted_tflops"]:.0f} TFLOP/s, published {r["published_tflops"]:.0f}:'
            f' {r["ratio"]:.2f}x; peak {r["peak_gib"]:.1f} GiB; {r["wall_seconds"]:.0f} s', flush=True)  # fmt: skip
  versions = {'jax': jax.__version__, 'libtpu': getattr(libtpu, '__version__', '?')}
  with open(os.path.join(args.out, f'maxtext_v5p.{tag}.json'), 'w') as f:
    json.dump({'versions': versions, 'rows': results}, f, indent=2)
  lines = table(args.out)
  with open(os.path.join(args.out, 'maxtext_v5p.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
