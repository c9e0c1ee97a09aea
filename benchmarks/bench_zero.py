"""Benchmark: zerojax against the FSDP recipes of JAX's own documentation.

The model is the one `recipes.py` defines (a stack of residual dense layers,
scanned), with Adam, on a faked 8-device CPU mesh (or the real devices, with
--real-devices). The baselines are `recipes.py`'s: plain jax + optax, written
from JAX's documentation without zerojax code. Per configuration:

- step time: --rounds rounds after --warmup steps, each round running one step
  of every configuration in a shuffled order; a time ratio is the median over
  rounds of the ratio within the round, so drift on a shared machine cancels;
- per-device arguments, temporaries and peak of the compiled step;
- collectives and their ring bytes per device against ZeRO's floor;
- matmuls executed per step (`hlo_ops.py`, loop bodies times trip counts);
- numerics: the parameters after --check-steps steps against the replicated run.

Writes JSON, a Markdown table and a PNG to --out.

  python benchmarks/bench_zero.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

if '--real-devices' not in sys.argv:
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  ).strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hlo_ops  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import recipes  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax  # noqa: E402


def zerojax_step(mesh, tx, stage: int, path: str, quantize=None):
  """zerojax's documented step at `stage`.

  path 'value_and_grad': `zerojax.value_and_grad` (at stages 2-3 with
  per_layer=True: each layer's gradient is reduce-scattered as the backward pass
  reaches it; each layer "gathers" its own and `zerojax.recompute_gathers`
  remats only the gathers). path 'jax.grad': the user's own `jax.grad` and the
  wrapped optimizer, with the same per-layer gathers at stage 3 (the compiler
  places the collectives). path 'scan_layers' (stage 3): `zerojax.scan_layers`,
  layer i+1 gathered while layer i computes. path 'full-remat' (stage 3):
  'value_and_grad' with each layer fully rematerialised (`jax.checkpoint` saving
  nothing), the remat policy of the MaxText-shaped baseline. `quantize`: ZeRO++ quantized
  collectives (a `zerojax.Quantize`), with 'value_and_grad'.
  """
  ztx = zerojax.zero_stage(tx, stage, mesh=mesh, quantize=quantize)
  gather, policy = (lambda w: w), None
  if stage == 3 or stage == 2 and path == 'value_and_grad':
    # Each layer gathers its own; at stage 2 the gather moves nothing and marks
    # where value_and_grad reduce-scatters that layer's gradient.
    gather = lambda w: zerojax.gather(w, ztx)
    policy = zerojax.recompute_gathers
  if path == 'full-remat':
    policy = jax.checkpoint_policies.nothing_saveable

  def loss_fn(params, batch):
    if path == 'scan_layers':
      h = zerojax.scan_layers(recipes.layer, batch['x'], params['w'], ztx)
    else:
      h = recipes.forward(params, batch['x'], gather, policy)
    return recipes.mse(h, batch['y'])

  if path == 'jax.grad':
    grad_fn = jax.value_and_grad(loss_fn)
  else:
    grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=stage >= 2)

  def step(params, opt_state, x, y):
    loss, grads = grad_fn(params, {'x': x, 'y': y})
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def place(params):
    params = jax.device_put(params, zerojax.plan_for(ztx, params).params)
    return params, ztx.init(params)

  return jax.jit(step, donate_argnums=(0, 1)), place


def recipe_step(mesh, tx, name: str):
  build = {
    'replicated': recipes.replicated_step,
    'docs-gspmd': recipes.gspmd_step,
    'docs-shard_map': recipes.shard_map_step,
    'maxtext-shaped': recipes.maxtext_shaped_step,
  }[name]
  step, sharding = build(mesh, tx)
  return step, lambda params: recipes.place(params, tx, sharding)


# (name, floor's stage: 3 for anything that keeps parameters sharded at rest)
CONFIGS = [
  ('replicated', 0),
  ('docs-gspmd', 3),
  ('docs-shard_map', 3),
  ('maxtext-shaped', 3),
  ('zerojax-3 value_and_grad', 3),
  ('zerojax-3 value_and_grad int8', 3),
  ('zerojax-3 value_and_grad int4', 3),
  ('zerojax-3 jax.grad', 3),
  ('zerojax-3 scan_layers', 3),
  ('zerojax-3 full-remat', 3),
  ('zerojax-2 value_and_grad', 2),
  ('zerojax-2 jax.grad', 2),
  ('zerojax-1 value_and_grad', 1),
  ('zerojax-1 jax.grad', 1),
  ('zerojax-0 value_and_grad', 0),
]


def build(name: str, mesh, tx):
  if not name.startswith('zerojax'):
    return recipe_step(mesh, tx, name)
  stage, path, *fmt = name.split(' ')
  # ZeRO++: int8 weight gathers, and gradients reduce-scattered in `fmt`.
  quantize = zerojax.Quantize(weights='int8', grads=fmt[0]) if fmt else None
  return zerojax_step(mesh, tx, int(stage[-1]), path, quantize)


def max_rel_err(a, b) -> float:
  return max(
    float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument('--out', default='benchmarks/results', help='folder for JSON, table, PNG')
  parser.add_argument('--layers', type=int, default=8, help='scanned residual dense layers')
  parser.add_argument('--width', type=int, default=1024, help='layer width')
  parser.add_argument('--batch', type=int, default=64, help='global batch')
  parser.add_argument('--warmup', type=int, default=3, help='steps before timing')
  parser.add_argument('--rounds', type=int, default=30, help='timed rounds')
  parser.add_argument('--check-steps', type=int, default=3, help='steps compared for numerics')
  parser.add_argument(
    '--real-devices', action='store_true', help='use the real devices, not 8 faked CPUs'
  )
  args = parser.parse_args(argv)

  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,))
  tx = optax.adam(1e-3)
  psi = args.layers * args.width * args.width
  rows = NamedSharding(mesh, P('data'))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (args.batch, args.width)), rows)
  y = jax.device_put(jax.random.normal(jax.random.key(2), (args.batch, args.width)), rows)
  fresh = lambda: recipes.init_params(jax.random.key(0), args.layers, args.width)

  runs, results = {}, {}
  for name, floor_stage in tqdm(CONFIGS, desc='compiling and checking', file=sys.stdout):
    fn, place = build(name, mesh, tx)
    params, opt_state = place(fresh())
    compiled = fn.lower(params, opt_state, x, y).compile()
    mem, coll = zerojax.inspect.memory_stats(compiled), zerojax.inspect.count_collectives(compiled)
    floor = zerojax.inspect.zero_floor_bytes(floor_stage, psi, n)
    for _ in range(args.check_steps):
      params, opt_state, loss = fn(params, opt_state, x, y)
    checked = jax.device_get(params)
    for _ in range(args.warmup):
      params, opt_state, loss = fn(params, opt_state, x, y)
    jax.block_until_ready(params)
    runs[name] = [fn, params, opt_state]
    results[name] = {
      'argument_bytes': mem.argument,
      'temp_bytes': mem.temp,
      'peak_bytes': mem.peak,
      'collective_counts': coll.counts,
      'ring_bytes': coll.total_ring_bytes,
      'floor_bytes': floor,
      'ring_vs_floor': coll.total_ring_bytes / floor,
      'matmuls': hlo_ops.matmuls(compiled),
      'params_after_check': checked,
    }
  reference = results['replicated']['params_after_check']
  for r in results.values():
    r['rel_err_vs_replicated'] = max_rel_err(r.pop('params_after_check'), reference)

  # Paired timing: each round runs one step of every configuration, shuffled.
  order, rng = list(runs), random.Random(0)
  per_round = {name: [] for name in runs}
  for _ in tqdm(range(args.rounds), desc='timing', file=sys.stdout):
    rng.shuffle(order)
    for name in order:
      fn, params, opt_state = runs[name]
      t0 = time.perf_counter()
      params, opt_state, loss = fn(params, opt_state, x, y)
      jax.block_until_ready((params, loss))
      per_round[name].append(time.perf_counter() - t0)
      runs[name][1:] = [params, opt_state]
  for name, r in results.items():
    r['times'] = per_round[name]
    r['step_time_s'] = statistics.median(per_round[name])

  def paired(a, b):
    return statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))

  # zerojax stage 3 against the better recipe on each measure.
  better = {
    'time': min(('docs-gspmd', 'docs-shard_map'), key=lambda k: results[k]['step_time_s']),
    'peak': min(('docs-gspmd', 'docs-shard_map'), key=lambda k: results[k]['peak_bytes']),
    'ring': min(('docs-gspmd', 'docs-shard_map'), key=lambda k: results[k]['ring_bytes']),
  }
  z3 = 'zerojax-3 value_and_grad'
  ratios = {
    f'stage3 time vs {better["time"]} (paired median)': paired(z3, better['time']),
    f'stage3 peak vs {better["peak"]}': results[z3]['peak_bytes']
    / results[better['peak']]['peak_bytes'],
    f'stage3 ring bytes vs {better["ring"]}': results[z3]['ring_bytes']
    / results[better['ring']]['ring_bytes'],
  }
  for name in ('zerojax-2 value_and_grad', 'zerojax-1 value_and_grad'):
    ratios[f'{name} ring bytes vs floor'] = results[name]['ring_vs_floor']
  # ZeRO++ against full-precision zerojax and against the better recipe.
  for fmt in ('int8', 'int4'):
    q = f'{z3} {fmt}'
    ratios[f'{q} ring bytes vs full precision'] = (
      results[q]['ring_bytes'] / results[z3]['ring_bytes']
    )
    ratios[f'{q} ring bytes vs {better["ring"]}'] = (
      results[q]['ring_bytes'] / results[better['ring']]['ring_bytes']
    )
    ratios[f'{q} time vs full precision (paired median)'] = paired(q, z3)
    ratios[f'{q} time vs {better["time"]} (paired median)'] = paired(q, better['time'])
    ratios[f'{q} peak vs {better["peak"]}'] = (
      results[q]['peak_bytes'] / results[better['peak']]['peak_bytes']
    )
  # Every documented path (full precision) against the shard_map recipe and the
  # MaxText-shaped layout: paired step-time ratios, temporaries, peak, traffic.
  paths = {}
  for name in results:
    if not name.startswith('zerojax') or name.endswith(('int8', 'int4')):
      continue
    row = {}
    for base in ('docs-shard_map', 'maxtext-shaped'):
      row[f'time vs {base} (paired median)'] = paired(name, base)
      for key, label in (('temp_bytes', 'temp'), ('peak_bytes', 'peak'), ('ring_bytes', 'ring')):
        row[f'{label} vs {base}'] = results[name][key] / results[base][key]
    paths[name] = row
  machine = {
    'platform': platform.platform(),
    'processor': platform.processor() or platform.machine(),
    'cpu_count': os.cpu_count(),
    'devices': f'{n} x {jax.devices()[0].device_kind}',
    'jax': jax.__version__,
    'optax': optax.__version__,
    'python': platform.python_version(),
  }
  report = {
    'model': {'params': psi, 'layers': args.layers, 'width': args.width},
    'batch': args.batch,
    'warmup': args.warmup,
    'rounds': args.rounds,
    'check_steps': args.check_steps,
    'machine': machine,
    'results': results,
    'ratios': ratios,
    'paths': paths,
  }
  os.makedirs(args.out, exist_ok=True)
  tag = 'cpu8' if not args.real_devices else jax.devices()[0].platform
  with open(os.path.join(args.out, f'bench_{tag}.json'), 'w') as f:
    json.dump(report, f, indent=2)

  mib = lambda b: f'{b / 2**20:.2f}'
  lines = [
    f"# zerojax vs the FSDP recipes of JAX's documentation ({machine['devices']},"
    f' {machine["processor"]}, {machine["cpu_count"]} cores, jax {jax.__version__})',
    '',
    f'{args.layers} scanned residual dense layers of {args.width}², Ψ = {psi:,} fp32 parameters,'
    f' Adam, batch {args.batch}; {args.rounds} rounds after {args.warmup} warm-up steps, each'
    ' round one step of every configuration in shuffled order. Floor: 2Ψ(N−1)/N bytes per device'
    ' for stages 0–2, 3Ψ(N−1)/N for stage 3 and the FSDP recipes.',
    '',
    '| config | step (ms) | args (MiB) | temp (MiB) | peak (MiB) | ring (MiB) | ring / floor'
    ' | matmuls | collectives | rel. err vs replicated |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name, r in results.items():
    lines.append(
      f'| {name} | {1e3 * r["step_time_s"]:.1f} | {mib(r["argument_bytes"])}'
      f' | {mib(r["temp_bytes"])} | {mib(r["peak_bytes"])} | {mib(r["ring_bytes"])}'
      f' | {r["ring_vs_floor"]:.2f} | {r["matmuls"]} | {r["collective_counts"]}'
      f' | {r["rel_err_vs_replicated"]:.1e} |'
    )
  lines += ['', '| ratio | value |', '|---|---|']
  lines += [f'| {k} | {v:.3f} |' for k, v in ratios.items()]
  columns = list(next(iter(paths.values())))
  lines += ['', '| documented path | ' + ' | '.join(columns) + ' |']
  lines += ['|---' * (len(columns) + 1) + '|']
  for name, row in paths.items():
    lines.append(f'| {name} | ' + ' | '.join(f'{row[c]:.3f}' for c in columns) + ' |')
  table = '\n'.join(lines)
  with open(os.path.join(args.out, f'bench_{tag}.md'), 'w') as f:
    f.write(table + '\n')
  print(table)

  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  names = list(results)
  colors = [
    'gray'
    if k == 'replicated'
    else 'tab:orange'
    if k.startswith(('docs', 'maxtext'))
    else 'tab:blue'
    for k in names
  ]
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for ax, key, scale, title in [
    (axes[0], 'step_time_s', 1e3, 'step time (ms, median)'),
    (axes[1], 'peak_bytes', 1 / 2**20, 'peak per device (MiB)'),
    (axes[2], 'ring_vs_floor', 1, 'ring bytes per device / ZeRO floor'),
  ]:
    ax.bar(names, [results[k][key] * scale for k in names], color=colors)
    ax.set_title(title)
    ax.tick_params(axis='x', rotation=70)
  axes[2].axhline(1.0, color='black', linewidth=0.8)
  fig.suptitle(
    f'zerojax (blue) vs JAX docs FSDP recipes and MaxText-shaped FSDP (orange), {machine["devices"]}'
  )
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, f'bench_{tag}.png'), dpi=100)
  return 0


if __name__ == '__main__':
  sys.exit(main())
