"""zerojax.nnx.value_and_grad against Flax's own nnx.value_and_grad, under the same wrap.

The NNX example's miniGPT (examples/nnx_minigpt.py: tensor-parallel annotations over 'model',
an unannotated embedding, blocks in a list), trained with `nnx.Optimizer(model,
zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis='batch'))`. Per mesh (8x1 and 4x2 of
('batch', 'model'), Auto axes) and stage (2 and 3), the step is compiled twice, the gradients
taken by:

- `flax`: `nnx.value_and_grad(loss_fn)(model, tokens)`: the compiler places every collective
  from the layouts at rest (at stage 3, it gathers the split parameters where they are used);
- `zerojax`: `zerojax.nnx.value_and_grad(loss_fn, tx)(model, tokens)`: the loss runs per device
  inside `jax.shard_map` and zerojax places the gathers and reduce-scatters itself, the whole
  model gathered before the loss;
- `zerojax per layer` (stage 3): the same, `per_layer=True`, on the model built with `tx`, so
  each module gathers its own weights where it runs (`zerojax.nnx.gathered`);
- `flax, scanned` and `zerojax per layer, scanned` (stage 3): the blocks stacked by `nnx.vmap`
  and run under a rematerialised `nnx.scan` (`--scan` in the example), Flax's gradient on the
  split parameters against zerojax's layer-by-layer gathers.

Per program: the compiled step's per-device memory (arguments, outputs, temporaries, their
peak; the state is donated), and its collectives per step (counts and ring bytes per device,
`zerojax.inspect.count_collectives`). Compiled only: on the faked CPU mesh no step time is
measured, and nothing here needs a TPU.

    python benchmarks/bench_nnx_grad.py [--out benchmarks/results]

Writes nnx_grad_cpu8.json and nnx_grad_cpu8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'examples'))

import common  # noqa: E402

common.setup_devices(8)

import jax  # noqa: E402
import nnx_minigpt as example  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import zerojax  # noqa: E402

MESHES = ((8, 1), (4, 2))
STAGES = (2, 3)
PATHS = ('flax', 'zerojax', 'zerojax per layer', 'flax, scanned', 'zerojax per layer, scanned')
CONFIG = example.Config(width=256, hidden=1024, heads=4, layers=4, seq_len=64, batch=16)


def measure(mesh, stage: int, path: str) -> dict:
  compiled = example.compile_step(
    CONFIG, mesh, stage, scan=path.endswith('scanned'), grads=path.split(',')[0]
  )
  memory = zerojax.inspect.memory_stats(compiled)
  stats = zerojax.inspect.count_collectives(compiled)
  return {
    'argument': memory.argument,
    'output': memory.output,
    'alias': memory.alias,
    'temp': memory.temp,
    'peak': memory.formula_peak,
    'collectives': dict(stats.counts),
    'ring_bytes': {k: int(v) for k, v in stats.ring_bytes.items()},
    'total_ring_bytes': int(sum(stats.ring_bytes.values())),
    'exact': not stats.uncertain,
  }


def table(record: dict) -> str:
  lines = [
    f'# zerojax.nnx.value_and_grad against nnx.value_and_grad ({record["machine"]})',
    '',
    f"{record['model']}; Adam; the same `zero_stage(..., axis='batch')` wrap in both columns.",
    '',
    '| mesh | stage | gradients | peak (MiB) | temporaries (MiB) | collectives | ring bytes/device |'
    ' peak vs flax | ring bytes vs flax |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for row in record['rows']:
    for name in PATHS:
      if name not in row:
        continue
      flax = row['flax, scanned' if name.endswith('scanned') else 'flax']
      r = row[name]
      ops = ' '.join(f'{k} {v}' for k, v in sorted(r['collectives'].items()))
      ratio_peak = r['peak'] / flax['peak']
      ratio_ring = (
        r['total_ring_bytes'] / flax['total_ring_bytes'] if flax['total_ring_bytes'] else 0
      )
      lines.append(
        f'| {row["mesh"]} | {row["stage"]} | {name} | {r["peak"] / 2**20:.2f} |'
        f' {r["temp"] / 2**20:.2f} | {ops} | {r["total_ring_bytes"]:,} | {ratio_peak:.3f} |'
        f' {ratio_ring:.3f} |'
      )
  return '\n'.join(lines) + '\n'


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(HERE, 'results'))
  args = parser.parse_args(argv)
  rows = []
  for shape in MESHES:
    mesh = jax.make_mesh(shape, ('batch', 'model'), axis_types=(AxisType.Auto,) * 2)
    for stage in STAGES:
      row = {'mesh': 'x'.join(map(str, shape)), 'stage': stage}
      for path in PATHS:
        if path in ('flax', 'zerojax') or stage == 3:
          row[path] = measure(mesh, stage, path)
      print(
        f'{row["mesh"]} stage {stage}: peak flax {row["flax"]["peak"]:,}'
        f' zerojax {row["zerojax"]["peak"]:,}; ring bytes flax'
        f' {row["flax"]["total_ring_bytes"]:,} zerojax {row["zerojax"]["total_ring_bytes"]:,}'
      )
      rows.append(row)
  record = {
    'model': (
      f'examples/nnx_minigpt.py MiniGPT(width={CONFIG.width}, hidden={CONFIG.hidden},'
      f' heads={CONFIG.heads}, layers={CONFIG.layers}), batch {CONFIG.batch} x'
      f' {CONFIG.seq_len} tokens'
    ),
    'machine': f'8 x cpu ({platform.machine()}), jax {jax.__version__}',
    'rows': rows,
  }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'nnx_grad_cpu8.json'), 'w') as f:
    json.dump(record, f, indent=1)
  text = table(record)
  with open(os.path.join(args.out, 'nnx_grad_cpu8.md'), 'w') as f:
    f.write(text)
  print(text)
  return record


if __name__ == '__main__':
  main()
