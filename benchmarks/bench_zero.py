"""Benchmark: zerojax stages 0-3 beside plain data parallelism and hand-written GSPMD.

For a GPT-style decoder on a faked 8-device CPU mesh (or the real devices, with
--real-devices), measures per configuration: step time (--steps x --repeats
rounds after warm-up; each round runs one step of every configuration in a
shuffled order, and time ratios are medians of within-round ratios), per-device
memory of the compiled step, and collective bytes. Writes JSON, a Markdown table and a PNG
to --out, and prints the ratios against the targets:

  zerojax stage k / hand-written stage k: <= 1.03 in time, 1.00 in bytes
  zerojax stage 3 / zerojax stage 0:      <= 1.2 in time

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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax  # noqa: E402
from zerojax._src import presets  # noqa: E402

CFG = presets.DecoderConfig(
  vocab=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=1024, seq_len=128, gated=False
)


def loss_with(gather_fn):
  return lambda p, tokens: presets.decoder_loss(
    p, tokens, CFG, gather_fn=gather_fn, compute_dtype=jnp.float32, remat=True
  )


# --- (b) The hand-written GSPMD version: what a careful user writes without zerojax.
def hand_written(mesh, stage, tx, params):
  """~40 lines: shard specs by hand, constraints in the step, in/out shardings."""

  def split(x):  # the largest dimension divisible by the mesh size carries 'data'
    dims = [i for i, d in enumerate(x.shape) if d % mesh.size == 0]
    if not dims:
      return P()
    i = max(dims, key=lambda i: (x.shape[i], -i))
    return P(*[('data' if j == i else None) for j in range(x.ndim)])

  named = lambda tree: jax.tree.map(
    lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P)
  )
  rep = jax.tree.map(lambda x: P(), params)
  shard = jax.tree.map(split, params)
  p_sh, g_sh = named(shard if stage == 3 else rep), named(shard if stage >= 2 else rep)
  state_abs = jax.eval_shape(tx.init, params)
  s_sh = named(
    optax.tree_map_params(
      tx,
      lambda _, s: s if stage >= 1 else P(),
      state_abs,
      shard,
      transform_non_params=lambda _: P(),
    )
  )

  def gather_fn(tree, group, scanned):
    full = jax.tree.map(lambda x: NamedSharding(mesh, P()), tree)
    return jax.lax.with_sharding_constraint(tree, full) if stage == 3 else tree

  loss_fn = loss_with(gather_fn)

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    grads = jax.lax.with_sharding_constraint(grads, g_sh)
    if stage >= 1:
      grads = jax.lax.with_sharding_constraint(grads, named(shard))
      sharded = jax.lax.with_sharding_constraint(params, named(shard))
    else:
      sharded = params
    updates, opt_state = tx.update(grads, opt_state, sharded)
    updates = jax.lax.with_sharding_constraint(updates, p_sh)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.device_put(params, p_sh)
  opt_state = jax.jit(tx.init, out_shardings=s_sh)(params)
  batch_sh = NamedSharding(mesh, P('data'))
  fn = jax.jit(
    step,
    in_shardings=(p_sh, s_sh, batch_sh),
    out_shardings=(p_sh, s_sh, None),
    donate_argnums=(0, 1),
  )
  return fn, (params, opt_state)


# --- (a) Plain replicated data parallelism, and zerojax.
def replicated(mesh, tx, params):
  loss_fn = loss_with(None)

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rep = NamedSharding(mesh, P())
  params = jax.device_put(params, rep)
  return jax.jit(step, donate_argnums=(0, 1)), (params, jax.device_put(tx.init(params), rep))


def with_zerojax(mesh, stage, tx, params):
  ztx = zerojax.zero_stage(tx, stage, mesh=mesh)
  opt_state = ztx.init(params)
  plan = zerojax.plan_for(ztx, params)
  loss_fn = loss_with(presets.plan_gather(plan))

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1)), (jax.device_put(params, plan.params), opt_state)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='benchmarks/results')
  parser.add_argument('--steps', type=int, default=10, help='timed steps per repeat')
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--repeats', type=int, default=4, help='rounds = steps x repeats')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument(
    '--real-devices', action='store_true', help='use the real devices, not 8 faked CPUs'
  )
  args = parser.parse_args(argv)

  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,))
  tx = optax.adam(1e-3)
  fresh = lambda: presets.init_decoder(CFG, jax.random.key(0))  # steps donate their inputs
  psi = CFG.num_params()
  tokens = jax.random.randint(jax.random.key(1), (args.batch, CFG.seq_len + 1), 0, CFG.vocab)
  tokens = jax.device_put(tokens, NamedSharding(mesh, P('data')))

  builders = {'replicated': lambda: replicated(mesh, tx, fresh())}
  for stage in range(4):
    builders[f'zerojax-{stage}'] = lambda stage=stage: with_zerojax(mesh, stage, tx, fresh())
    builders[f'hand-{stage}'] = lambda stage=stage: hand_written(mesh, stage, tx, fresh())

  runs, results = {}, {}
  for name, build in tqdm(builders.items(), desc='compiling', file=sys.stdout):
    fn, (p, s) = build()
    compiled = fn.lower(p, s, tokens).compile()
    mem, coll = zerojax.memory_stats(compiled), zerojax.count_collectives(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    for _ in range(args.warmup):
      p, s, loss = fn(p, s, tokens)
    jax.block_until_ready(p)
    runs[name] = [fn, p, s]
    results[name] = {
      'argument_bytes': mem.argument,
      'temp_bytes': mem.temp,
      'peak_bytes': mem.peak,
      'collective_counts': coll.counts,
      'ring_bytes': coll.total_ring_bytes,
      'times': [],
      'flops': float(cost.get('flops', 0.0)),
    }
  # Paired timing: each round runs one step of every configuration, in a shuffled
  # order, so drift on a shared machine hits the configurations of a round
  # alike; a ratio is the median over rounds of the ratio within the round.
  rounds = args.steps * args.repeats
  order = list(runs)
  rng = random.Random(0)
  per_round = {name: [] for name in runs}
  for _ in tqdm(range(rounds), desc='timing', file=sys.stdout):
    rng.shuffle(order)
    for name in order:
      run = runs[name]
      fn, p, s = run
      t0 = time.perf_counter()
      p, s, loss = fn(p, s, tokens)
      jax.block_until_ready((p, loss))
      per_round[name].append(time.perf_counter() - t0)
      run[1], run[2] = p, s
      results[name]['final_loss'] = float(loss)
  for name, r in results.items():
    r['times'] = per_round[name]
    r['step_time_s'] = statistics.median(per_round[name])

  def paired(a, b):
    return statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))

  ratios = {}
  for stage in range(4):
    z, h = results[f'zerojax-{stage}'], results[f'hand-{stage}']
    ratios[f'stage{stage}_time_vs_hand'] = paired(f'zerojax-{stage}', f'hand-{stage}')
    ratios[f'stage{stage}_bytes_vs_hand'] = z['argument_bytes'] / h['argument_bytes']
    ratios[f'stage{stage}_comm_vs_hand'] = z['ring_bytes'] / max(h['ring_bytes'], 1)
  ratios['stage3_vs_stage0_time'] = paired('zerojax-3', 'zerojax-0')
  ratios['stage0_vs_replicated_time'] = paired('zerojax-0', 'replicated')
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
    'model': {'params': psi, **CFG.__dict__},
    'batch': args.batch,
    'steps': args.steps,
    'warmup': args.warmup,
    'repeats': args.repeats,
    'machine': machine,
    'results': results,
    'ratios': ratios,
  }
  os.makedirs(args.out, exist_ok=True)
  tag = 'cpu8' if not args.real_devices else jax.devices()[0].platform
  with open(os.path.join(args.out, f'bench_{tag}.json'), 'w') as f:
    json.dump(report, f, indent=2)

  lines = [
    f'# zerojax benchmark ({machine["devices"]}, {machine["processor"]}, {machine["cpu_count"]} cores)',
    '',
    f'GPT-style decoder, {psi:,} parameters, Adam, batch {args.batch} x {CFG.seq_len} tokens;'
    f' {args.steps * args.repeats} rounds after {args.warmup} warm-up steps; each round runs one step'
    ' of every configuration in shuffled order. Step time: median over rounds; time ratios: median'
    ' over rounds of the ratio within a round.',
    '',
    '| config | step time (ms) | args/device (MiB) | temp/device (MiB) | ring bytes/device/step (MiB) | GFLOP/device | collectives |',
    '|---|---|---|---|---|---|---|',
  ]
  for name, r in results.items():
    lines.append(
      f'| {name} | {1e3 * r["step_time_s"]:.1f} | {r["argument_bytes"] / 2**20:.2f} |'
      f' {r["temp_bytes"] / 2**20:.2f} | {r["ring_bytes"] / 2**20:.2f} | {r["flops"] / 1e9:.3f} |'
      f' {r["collective_counts"]} |'
    )
  lines += ['', '| ratio | value | target |', '|---|---|---|']
  for key, value in ratios.items():
    target = {'time_vs_hand': '<= 1.03', 'vs_hand': '1.00', 'stage3_vs_stage0': '<= 1.2'}
    target = next((v for k, v in target.items() if k in key), '')
    lines.append(f'| {key} | {value:.3f} | {target} |')
  table = '\n'.join(lines)
  with open(os.path.join(args.out, f'bench_{tag}.md'), 'w') as f:
    f.write(table + '\n')
  print(table)

  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  names = list(results)
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  colors = [
    'gray' if k == 'replicated' else 'tab:blue' if k.startswith('zero') else 'tab:orange'
    for k in names
  ]
  for ax, key, scale, title in [
    (axes[0], 'step_time_s', 1e3, 'step time (ms)'),
    (axes[1], 'argument_bytes', 1 / 2**20, 'state at rest per device (MiB)'),
    (axes[2], 'ring_bytes', 1 / 2**20, 'ring bytes per device per step (MiB)'),
  ]:
    ax.bar(names, [results[k][key] * scale for k in names], color=colors)
    ax.set_title(title)
    ax.tick_params(axis='x', rotation=60)
  fig.suptitle(f'zerojax vs hand-written GSPMD vs replicated DP ({machine["devices"]})')
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, f'bench_{tag}.png'), dpi=100)
  return 0


if __name__ == '__main__':
  sys.exit(main())
