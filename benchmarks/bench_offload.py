"""ZeRO-Offload on a TPU pod slice, compiled ahead of time: per-chip device bytes and peak.

For each stage and offload setting, compiles the donated training step of a bf16 model with an
fp32 master copy and Adam (`zerojax.mixed_precision`) for a TPU topology with libtpu (no TPU
needed) and records `memory_analysis()`: device and host argument bytes, temporaries, and the
peak (`zerojax.inspect.memory_stats(...).peak`: the TPU compiler's own figure). Writes JSON and
a Markdown table.

A second table puts the streamed update (`update_on='stream'`, gradients sent to host memory
layer by layer from the backward loop) beside today's on a scanned decoder (the `gpt2-small`
preset through `zerojax.value_and_grad(per_layer=True)`, stage 3), with the bytes crossing the
host link each step as counted in the compiled program (`zerojax.inspect.count_host_transfers`).

  .venv/bin/python benchmarks/bench_offload.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

DECODER_SETTINGS = [
  (None, 'device'),
  ('opt_state+master', 'device'),
  ('opt_state+master', 'host'),
  ('opt_state+master', 'stream'),
]

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
  parser.add_argument('--decoder', default='gpt2-small', help='preset for the streamed table')
  parser.add_argument('--seq-len', type=int, default=256, help="the decoder's sequence length")
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
    compiled = jax.jit(step, donate_argnums=0).lower(state, x).compile()
    m, peak = compiled.memory_analysis(), zerojax.inspect.memory_stats(compiled).peak
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

  decoder_rows = _decoder_rows(args.topology, args.decoder, args.seq_len)

  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f'offload_{args.topology.replace(":", "-")}')
  meta = {
    'topology': args.topology,
    'chips': n,
    'model': f'two {d}x{d} layers + biases, bf16 params, fp32 master + Adam',
    'num_params': psi,
    'jax': jax.__version__,
    'libtpu': importlib.metadata.version('libtpu'),
    'machine': f'{platform.machine()} {os.cpu_count()} cores (compile only)',
  }
  meta['decoder'] = f'{args.decoder} preset, seq {args.seq_len}, 1 sequence per chip, stage 3'
  with open(stem + '.json', 'w') as f:
    json.dump({'meta': meta, 'rows': rows, 'decoder_rows': decoder_rows}, f, indent=2)
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
  lines += [
    '',
    f"## Streamed beside today's: {meta['decoder']}, zerojax.value_and_grad(per_layer=True)",
    '',
    'MiB per chip; host link MB per step and chip, counted in the compiled program.',
    '',
    '| offload | update on | temporaries | peak | peak / none | to host | to device |'
    ' largest back | in layer loops | overlapped |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  mb = lambda v: f'{v / 1e6:,.2f}'
  for r in decoder_rows:
    lines.append(
      f'| {r["offload"] or "-"} | {r["update_on"]} | {mib(r["temp_bytes"])}'
      f' | {mib(r["peak_bytes"])} | {r["peak_vs_no_offload"]:.3f} | {mb(r["to_host"])}'
      f' | {mb(r["to_device"])} | {mb(r["largest_to_device"])} | {mb(r["in_loops"])}'
      f' | {r["overlapped"]:.0%} |'
    )
  with open(stem + '.md', 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  print(f'wrote {stem}.json and {stem}.md')
  return 0


def _decoder_rows(topology: str, model: str, seq_len: int) -> list[dict]:
  """The scanned decoder at stage 3 under each of `DECODER_SETTINGS`: memory and host link."""
  import optax
  from tqdm import tqdm

  import zerojax
  from zerojax._src.planner import candidates, lowering, presets, tpu

  target = lowering.make_target(
    model,
    topology,
    devices=tpu.topology_devices(topology),
    optimizer=lambda: optax.adamw(1e-4, weight_decay=0.1),
    mixed_precision=True,
    settings=presets.ModelSettings(seq_len=seq_len),
  )
  rows = []
  for offload, update_on in tqdm(DECODER_SETTINGS, desc='decoder', file=sys.stdout):
    candidate = candidates.Candidate(3, offload=offload, update_on=update_on)
    lowered = lowering.lower(target, candidate).lowered
    t0 = time.perf_counter()
    compiled = lowered.compile()
    m, peak = compiled.memory_analysis(), zerojax.inspect.memory_stats(compiled).peak
    moved = zerojax.inspect.count_host_transfers(compiled)
    rows.append(
      {
        'offload': offload,
        'update_on': update_on,
        'temp_bytes': m.temp_size_in_bytes,
        'peak_bytes': peak,
        'host_argument_bytes': m.host_argument_size_in_bytes,
        'to_host': moved.to_host,
        'to_device': moved.to_device,
        'largest_to_device': moved.largest_to_device,
        'in_loops': moved.in_loops,
        'overlapped': moved.overlapped,
        'compile_s': round(time.perf_counter() - t0, 2),
      }
    )
  for r in rows:
    r['peak_vs_no_offload'] = round(r['peak_bytes'] / rows[0]['peak_bytes'], 3)
  return rows


if __name__ == '__main__':
  sys.exit(main())
