"""The largest Llama-shaped model that trains a step on one accelerator, with each offload.

For each setting, from plain (everything on the device) to parameter offload, this walks
Llama-family shapes of growing size (random weights, the presets' decoder with per-layer
gathers, AdamW under `zerojax.mixed_precision`: bf16 parameters, fp32 master and moments) and
trains two steps plus `--steps` timed ones of each in its own process, so that an
out-of-memory failure ends that process only and the device's peak belongs to one run:

- `plain`: stage 3 on one device, nothing offloaded (what plain optax holds);
- `opt_state`: the moments in host memory, the update on the host (`update_on='host'`);
- `opt_state+master@stream`: the moments and the fp32 master in host memory, gradients streamed
  down layer by layer, the update on the host, bf16 parameters back (`update_on='stream'`);
- `+params`: the same with the parameters in host memory too (`offload_params=True`), each
  layer's weights fetched inside the layer loop.

Per run: whether it trained (or the error: out of memory), the median step time and tokens per
second, the device's measured peak of bytes in use (`memory_stats()`, where the backend gives
it), the compiled program's device and host temporaries, and the bytes the compiled program
copies between device and host per step (`zerojax.inspect.count_host_transfers`, written for
the TPU compiler's forms: where it cannot read this compiler's program it says so). A run's
setting is the largest shape that trained; the walk stops at the first that does not.

    python benchmarks/bench_one_chip_gpu.py [--out benchmarks/results] [--sizes 1b,3b,8b,13b]

Writes one_chip_gpu.json and one_chip_gpu.md. `--tiny` runs a tiny shape (or `--sizes`
tiny-a,tiny-b) in this process: the test suite runs it on the CPU, where every setting trains
to the same losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Llama-family shapes (vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff), by parameter count.
SHAPES = {
  'tiny-a': (256, 64, 2, 4, 2, 128),
  'tiny-b': (256, 64, 4, 4, 2, 128),
  '1b': (128256, 2048, 16, 32, 8, 8192),  # Llama 3.2 1B
  '3b': (128256, 3072, 28, 24, 8, 8192),  # Llama 3.2 3B
  '7b': (32000, 4096, 32, 32, 32, 11008),  # Llama 2 7B
  '8b': (128256, 4096, 32, 32, 8, 14336),  # Llama 3.1 8B
  '13b': (32000, 5120, 40, 40, 40, 13824),  # Llama 2 13B
  '20b': (32000, 6144, 44, 48, 8, 16384),
  '34b': (32000, 8192, 48, 64, 8, 22016),
}
SETTINGS = {
  'plain': dict(),
  'opt_state': dict(offload='opt_state', update_on='host'),
  'opt_state+master@stream': dict(offload='opt_state+master', update_on='stream'),
  '+params': dict(offload='opt_state+master', update_on='stream', offload_params=True),
}
WARMUP = 2
DEFAULT_SIZES = '1b,3b,7b,8b,13b,20b,34b'


def one(setting: str, size: str, seq_len: int, batch: int, steps: int) -> dict:
  """Trains `steps` timed steps of one shape under one setting, in this process."""
  import jax
  import jax.numpy as jnp
  import optax

  import zerojax
  from zerojax._src.planner import presets

  vocab, d, layers, heads, kv, ff = SHAPES[size]
  cfg = presets.DecoderConfig(vocab, d, layers, heads, kv, ff, seq_len, gated=True)
  mesh = jax.make_mesh((1,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  tx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.adamw(1e-4, weight_decay=0.1)), 3, mesh=mesh,
    **SETTINGS[setting],
  )  # fmt: skip
  shapes = jax.eval_shape(lambda: presets.init_decoder(cfg, jax.random.key(0)))
  plan = zerojax.plan_for(tx, shapes)
  on_device = jax.tree.map(lambda s: s.with_memory_kind('device'), plan.params)
  master = jax.jit(lambda: presets.init_decoder(cfg, jax.random.key(0)), out_shardings=on_device)()
  opt_state = tx.init(master)
  params = jax.jit(lambda m: zerojax.cast(m, jnp.bfloat16), out_shardings=plan.params)(master)
  del master
  loss = lambda p, b: presets.decoder_loss(p, b, cfg, plan=plan)
  grad_fn = zerojax.value_and_grad(loss, tx, per_layer=True)

  def step(params, opt_state, tokens):
    value, grads = grad_fn(params, tokens)
    # One call: offloaded parameters are updated where they rest (the same arithmetic as
    # tx.update and optax.apply_updates elsewhere).
    params, opt_state = tx.update.apply_gradients(grads, opt_state, params)
    return params, opt_state, value

  tokens = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, vocab)
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
  compile_seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  try:
    moved = zerojax.inspect.count_host_transfers(compiled)
    counted = {'to_host': moved.to_host, 'to_device': moved.to_device}
  except Exception as e:  # the parser reads the TPU compiler's forms: say so, do not guess
    counted = {'error': f'{type(e).__name__}: {e}'[:300]}
  times, losses = [], []
  for i in range(WARMUP + steps):
    t = time.perf_counter()
    params, opt_state, value = compiled(params, opt_state, tokens)
    losses.append(float(value))  # waits for the step
    if i >= WARMUP:
      times.append(time.perf_counter() - t)
  stats = jax.devices()[0].memory_stats() or {}
  median = statistics.median(times)
  return {
    'setting': setting,
    'size': size,
    'parameters': sum(int(x.size) for x in jax.tree.leaves(shapes)),
    'device': jax.devices()[0].device_kind,
    'jax': jax.__version__,
    'compile_seconds': compile_seconds,
    'step_seconds_median': median,
    'tokens_per_second': batch * seq_len / median,
    'peak_bytes_in_use': stats.get('peak_bytes_in_use'),
    'temp_bytes': int(m.temp_size_in_bytes),
    'host_temp_bytes': int(getattr(m, 'host_temp_size_in_bytes', 0) or 0),
    'host_transfers_counted': counted,
    'losses': losses,
  }


def walk(setting: str, sizes: list[str], args, in_process: bool) -> list[dict]:
  """Each size in turn under `setting`, until one does not train."""
  rows = []
  for size in sizes:
    if in_process:
      row = one(setting, size, args.seq_len, args.batch, args.steps)
    else:
      argv = [sys.executable, __file__, '--one', f'{setting}:{size}', '--seq-len',
              str(args.seq_len), '--batch', str(args.batch), '--steps', str(args.steps)]  # fmt: skip
      done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
      found = [line for line in done.stdout.splitlines() if line.startswith('RESULT ')]
      if done.returncode or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ['no output']
        error = 'out of memory' if 'RESOURCE_EXHAUSTED' in done.stderr else tail[0][:300]
        row = {'setting': setting, 'size': size, 'error': error}
      else:
        row = json.loads(found[0][len('RESULT ') :])
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != 'losses'})[:400], flush=True)
    if 'error' in row:
      break
  return rows


def table(run: dict) -> list[str]:
  lines = [
    f'The largest Llama-shaped model that trains a step on one {run["device"]} (jax'
    f' {run["jax"]}; `benchmarks/bench_one_chip_gpu.py`): batch {run["batch"]} x'
    f' {run["seq_len"]} tokens, AdamW under mixed_precision, stage 3 with per-layer gathers,'
    f' median of {run["steps"]} steps after {WARMUP}. Host GB/step: the count of the copies'
    ' in the compiled program (zerojax.inspect.count_host_transfers).',
    '',
    '| setting | size | parameters | step s | tokens/s | measured peak GiB | host GB/step |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in run['rows']:
    if 'error' in r:
      lines.append(f'| {r["setting"]} | {r["size"]} | | {r["error"]} | | | |')
      continue
    c = r['host_transfers_counted']
    gb = 'not counted' if 'error' in c else f'{(c["to_host"] + c["to_device"]) / 1e9:.2f}'
    peak = r['peak_bytes_in_use']
    lines.append(
      f'| {r["setting"]} | {r["size"]} | {r["parameters"]:,} | {r["step_seconds_median"]:.3f} |'
      f' {r["tokens_per_second"]:,.0f} | {"n/a" if peak is None else f"{peak / 2**30:.2f}"} |'
      f' {gb} |'
    )
  largest = {}
  for r in run['rows']:
    if 'error' not in r:
      largest[r['setting']] = r['size']
  lines += ['', 'Largest that trained: ' + ', '.join(f'{k} {v}' for k, v in largest.items())]
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  parser.add_argument('--sizes', default=DEFAULT_SIZES)
  parser.add_argument('--settings', default=','.join(SETTINGS))
  parser.add_argument('--seq-len', type=int, default=2048)
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--timeout', type=int, default=900, help='seconds per run')
  parser.add_argument('--tiny', action='store_true', help='tiny shapes, in this process')
  parser.add_argument('--one', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    setting, size = args.one.split(':')
    print('RESULT ' + json.dumps(one(setting, size, args.seq_len, args.batch, args.steps)))
    return 0
  sizes = args.sizes.split(',') if not args.tiny or args.sizes != DEFAULT_SIZES else ['tiny-a']
  unknown = [s for s in sizes if s not in SHAPES] + [
    s for s in args.settings.split(',') if s not in SETTINGS
  ]
  if unknown:
    raise SystemExit(f'unknown {unknown}; sizes: {list(SHAPES)}; settings: {list(SETTINGS)}')
  rows = []
  for setting in args.settings.split(','):
    rows += walk(setting, sizes, args, in_process=args.tiny)
  ok = [r for r in rows if 'error' not in r]
  if not ok:
    raise SystemExit('nothing trained; see the errors above')
  keys = ('seq_len', 'batch', 'steps')
  run = {'device': ok[0]['device'], 'jax': ok[0]['jax'], **{k: getattr(args, k) for k in keys}}
  run['rows'] = rows
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'one_chip_gpu.json'), 'w') as f:
    json.dump(run, f, indent=2)
  lines = table(run)
  with open(os.path.join(args.out, 'one_chip_gpu.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
