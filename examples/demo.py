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
import os
import sys

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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--text', help='a text file (default: the standard library docstrings)')
  parser.add_argument('--out', default='demo_out')
  args = parser.parse_args(argv)
  n = len(jax.devices())
  print(f'jax {jax.__version__}: {n} x {jax.devices()[0].device_kind} devices; ZeRO over "data"')

  runs = [gpt.run(stage=s, steps=args.steps, text=args.text, log_every=5) for s in range(4)]
  psi = runs[0]['num_params']
  print(f'\nGPT: {psi:,} parameters (Ψ), AdamW fp32, {args.steps} steps per stage\n')
  print(runs[3]['plan'])
  print(
    f'\n{"stage":>5}  {"final loss":>10}  {"states/device":>13}  {"formula":>11}  match  collectives'
  )
  ok = True
  for r in runs:
    mem = zerojax.memory_stats(r['compiled'])
    scalars = sum(x.nbytes for x in jax.tree.leaves(r['state']) if x.ndim == 0)
    states = mem.argument - r['batch_bytes'] - scalars
    expect = formula(r['stage'], psi, n)
    ok &= states == expect
    counts = zerojax.count_collectives(r['compiled']).counts
    print(
      f'{r["stage"]:>5}  {r["losses"][-1][1]:>10.4f}  {states:>13,}  {expect:>11,}'
      f'  {"yes" if states == expect else "NO":>5}  {counts}'
    )
  same = max(abs(a[1] - b[1]) for r in runs for a, b in zip(r['losses'], runs[0]['losses']))
  print(f'\nlargest loss difference between stages: {same:.2e}')
  print(
    'states/device: compiled step arguments (memory_analysis) less the batch shard and'
    ' step counters. On CPU the stage 2-3 reduce-scatter lowers to all-reduce + slice.'
  )

  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for r, style in zip(runs, ['-', '--', ':', '-.']):
    steps, losses = np.array(r['losses']).T
    ax1.plot(steps, losses, style, label=f'stage {r["stage"]}')
  ax1.set(xlabel='step', ylabel='loss', title='training loss (identical across stages)')
  ax1.legend()
  parts = ['params', 'grads', 'opt_state']
  bottom = np.zeros(4)
  for part in parts:
    values = np.array([r['plan'].bytes_per_device()[part] / 2**20 for r in runs])
    ax2.bar([f'stage {s}' for s in range(4)], values, bottom=bottom, label=part)
    bottom += values
  ax2.set(ylabel='MiB per device', title=f'model states per device ({n} devices)')
  ax2.legend()
  fig.tight_layout()
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, 'zero_stages.png')
  fig.savefig(path, dpi=100)
  print(f'figure: {path}')
  return 0 if ok and same < 1e-3 else 1


if __name__ == '__main__':
  sys.exit(main())
