"""ZeRO-Offload on a TPU pod slice, compiled ahead of time: per-chip device bytes and peak.

For each stage and offload setting, compiles the donated training step of a bf16 model with an
fp32 master copy and Adam (`zerojax.mixed_precision`) for a TPU topology with libtpu (no TPU
needed) and records `memory_analysis()`: device and host argument bytes, temporaries, and the
peak (arguments + outputs - aliased + temporaries). Writes JSON and a Markdown table.

  .venv/bin/python benchmarks/bench_offload.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

SETTINGS = [
  (None, 'device'),
  ('opt_state', 'device'),
  ('opt_state', 'host'),
  ('opt_state+master', 'device'),
  ('opt_state+master', 'host'),
]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--topology', default='v5e:2x4')
  parser.add_argument('--d-model', type=int, default=4096, help='two d x d layers')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--out', default='benchmarks/results')
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import topologies
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
  from tqdm import tqdm

  import zerojax

  d = args.d_model
  topology = topologies.get_topology_desc(topology_name=args.topology, platform='tpu')
  mesh = Mesh(np.array(topology.devices), ('data',), axis_types=(AxisType.Auto,))
  n = mesh.size
  psi = 2 * d * d + 2 * d

  def init_fn(key):
    k1, k2 = jax.random.split(key)
    return {
      'w1': jax.random.normal(k1, (d, d)) / d**0.5,
      'b1': jnp.zeros((d,)),
      'w2': jax.random.normal(k2, (d, d)) / d**0.5,
      'b2': jnp.zeros((d,)),
    }

  def step(state, x):
    plan = zerojax.plan_for(state.tx, state.params)

    def loss(p):
      p = zerojax.gather(p, plan)
      h = jnp.tanh(x.astype(jnp.bfloat16) @ p['w1'] + p['b1'])
      return jnp.mean((h @ p['w2'] + p['b2']).astype(jnp.float32) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  x = jax.ShapeDtypeStruct(
    (args.batch, d), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )
  rows = []
  jobs = [(stage, off, on) for stage in (1, 2, 3) for off, on in SETTINGS]
  for stage, offload, update_on in tqdm(jobs, desc='compiling', file=sys.stdout):
    state = zerojax.inspect.abstract_train_state(
      init_fn,
      jax.random.key(0),
      tx=zerojax.zero_stage(
        zerojax.mixed_precision(optax.adam(1e-3)),
        stage,
        mesh=mesh,
        offload=offload,
        update_on=update_on,
      ),
      param_dtype=jnp.bfloat16,
    )
    t0 = time.perf_counter()
    m = jax.jit(step, donate_argnums=0).lower(state, x).compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    peak += m.temp_size_in_bytes
    rows.append(
      {
        'stage': stage,
        'offload': offload,
        'update_on': update_on,
        'device_argument_bytes': m.argument_size_in_bytes,
        'host_argument_bytes': m.host_argument_size_in_bytes,
        'temp_bytes': m.temp_size_in_bytes,
        'peak_bytes': peak,
        'compile_s': round(time.perf_counter() - t0, 2),
      }
    )
  base = {r['stage']: r for r in rows if r['offload'] is None}
  for r in rows:
    b = base[r['stage']]
    r['device_argument_drop'] = b['device_argument_bytes'] - r['device_argument_bytes']
    r['peak_vs_no_offload'] = round(r['peak_bytes'] / b['peak_bytes'], 3)

  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f'offload_{args.topology.replace(":", "-")}')
  meta = {
    'topology': args.topology,
    'chips': n,
    'model': f'two {d}x{d} layers + biases, bf16 params, fp32 master + Adam',
    'num_params': psi,
    'jax': jax.__version__,
    'machine': f'{platform.machine()} {os.cpu_count()} cores (compile only)',
  }
  with open(stem + '.json', 'w') as f:
    json.dump({'meta': meta, 'rows': rows}, f, indent=2)
  mib = lambda v: f'{v / 2**20:,.2f}'
  lines = [
    f'# ZeRO-Offload on {args.topology} ({n} chips), compiled ahead of time',
    '',
    f'{meta["model"]}, Ψ = {psi:,}. MiB per chip.',
    '',
    '| stage | offload | update on | device args | host args | drop | temporaries | peak | peak / none |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    lines.append(
      f'| {r["stage"]} | {r["offload"] or "-"} | {r["update_on"]} | {mib(r["device_argument_bytes"])}'
      f' | {mib(r["host_argument_bytes"])} | {mib(r["device_argument_drop"])}'
      f' | {mib(r["temp_bytes"])} | {mib(r["peak_bytes"])} | {r["peak_vs_no_offload"]:.3f} |'
    )
  with open(stem + '.md', 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  print(f'wrote {stem}.json and {stem}.md')
  return 0


if __name__ == '__main__':
  sys.exit(main())
