"""zerojax demo (the README's main job): the GPT example under ZeRO stages 0-3.

Trains the byte-level GPT of examples/gpt.py for a short run under each stage on
a faked 8-device CPU mesh, then prints per stage the final loss, the per-device
bytes of the model states measured from the compiled step against the ZeRO
formula, and the collectives; and saves a figure with the loss curves (the same
under every stage) and per-device memory by stage.

  python examples/demo.py [--steps 60] [--out demo_out]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import gpt  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402


def formula(stage: int, psi: int, n: int) -> int:
  """Model states at rest per device, fp32 AdamW (docs/design.md): 12Ψ, 4Ψ+8Ψ/N, 4Ψ+8Ψ/N, 12Ψ/N."""
  return {0: 12 * psi, 1: 4 * psi + 8 * psi // n, 2: 4 * psi + 8 * psi // n, 3: 12 * psi // n}[
    stage
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument('--steps', type=int, default=60, help='training steps per stage')
  parser.add_argument('--data', help='a text file (default: the standard library docstrings)')
  parser.add_argument('--out', default='demo_out', help='folder for the figure and JSON')
  args = parser.parse_args(argv)
  start = time.perf_counter()
  n = len(jax.devices())
  print(f'jax {jax.__version__}: {n} x {jax.devices()[0].device_kind} devices; ZeRO over "data"')

  runs = [gpt.run(stage=s, steps=args.steps, text=args.data, log_every=5) for s in range(4)]
  psi = runs[0]['num_params']
  print(f'\nGPT: {psi:,} parameters (Ψ), AdamW fp32, {args.steps} steps per stage\n')
  print(runs[3]['plan'])

  # One set of numbers per stage, printed and plotted alike (MiB per device):
  # params and optimizer state at rest (measured: the step's arguments less the
  # batch shard and step counters, checked against the formula), gradients as
  # the stage holds them before the update (the plan), and the step's
  # temporaries (measured).
  rows = []
  for r in runs:
    mem = zerojax.inspect.memory_stats(r['compiled'])
    scalars = sum(x.nbytes for x in jax.tree.leaves(r['state']) if x.ndim == 0)
    at_rest = mem.argument - r['batch_bytes'] - scalars
    plan_bytes = r['plan'].bytes_per_device()
    rows.append(
      {
        'stage': r['stage'],
        'loss': r['losses'][-1][1],
        'params': plan_bytes['params'],
        'opt_state': at_rest - plan_bytes['params'],
        'at_rest': at_rest,
        'formula': formula(r['stage'], psi, n),
        'grads': plan_bytes['grads'],
        'temp': mem.temp,
        'collectives': zerojax.inspect.count_collectives(r['compiled']).counts,
      }
    )
  mib = lambda b: f'{b / 2**20:.2f}'
  header = (
    f'{"stage":>5}  {"final loss":>10}  {"at rest":>8}  {"formula":>8}  match'
    f'  {"grads":>7}  {"temps":>7}  collectives'
  )
  print("\nper device, MiB: at rest = params + optimizer state (measured), formula = ZeRO's;")
  print("grads = as the stage holds them for the update (plan); temps = the step's temporaries\n")
  print(header)
  for row in rows:
    match = 'yes' if row['at_rest'] == row['formula'] else 'NO'
    print(
      f'{row["stage"]:>5}  {row["loss"]:>10.4f}  {mib(row["at_rest"]):>8}  {mib(row["formula"]):>8}'
      f'  {match:>5}  {mib(row["grads"]):>7}  {mib(row["temp"]):>7}  {row["collectives"]}'
    )
  ok = all(row['at_rest'] == row['formula'] for row in rows)
  same = max(abs(a[1] - b[1]) for r in runs for a, b in zip(r['losses'], runs[0]['losses']))
  print(f'\nlargest loss difference between stages: {same:.2e}')
  print(
    'On CPU the stage 2-3 gradient reduction into shards lowers to all-reduce + slice'
    ' (a TPU emits reduce-scatters): see docs/design.md.'
  )

  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
  for r, style in zip(runs, ['-', '--', ':', '-.']):
    steps, losses = np.array(r['losses']).T
    ax1.plot(steps, losses, style, label=f'stage {r["stage"]}')
  ax1.set(xlabel='step', ylabel='loss', title='training loss (identical across stages)')
  ax1.legend()
  parts = [
    ('params', 'parameters at rest'),
    ('opt_state', 'optimizer state at rest'),
    ('grads', 'gradients held for the update (plan)'),
    ('temp', 'temporaries of the step (measured; gradients live here)'),
  ]
  labels = [f'stage {row["stage"]}' for row in rows]
  bottom = np.zeros(len(rows))
  for key, label in parts:
    values = np.array([row[key] / 2**20 for row in rows])
    ax2.bar(labels, values, bottom=bottom, label=label)
    bottom += values
  for i, row in enumerate(rows):
    ax2.annotate(f'at rest {mib(row["at_rest"])}', (i, bottom[i]), ha='center', va='bottom')
  ax2.set(
    ylabel='MiB per device', title=f"memory per device ({n} devices): the table's columns, stacked"
  )
  ax2.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, 'zero_stages.png')
  fig.savefig(path, dpi=100)
  with open(os.path.join(args.out, 'zero_stages.json'), 'w') as f:
    record = {
      'num_params': psi,
      'devices': n,
      'steps': args.steps,
      'wall_seconds': round(time.perf_counter() - start, 1),
      'machine': f'{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}',
      'stages': rows,
    }
    json.dump(record, f, indent=2)
  print(f'figure: {path} (numbers in zero_stages.json)')
  return 0 if ok and same < 1e-3 else 1


if __name__ == '__main__':
  sys.exit(main())
