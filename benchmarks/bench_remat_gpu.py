"""Rematerialisation policies and activation offload, run on one GPU: step time, memory, equality.

The TPU results of `bench_recompute.py` and `bench_memory.py` are compiled for a pod and
priced by the planner's model; this runs the same policies for real on whatever GPU jax sees
(the presets' decoder, `presets.decoder_loss`, one device, no ZeRO), each in its own process so
that the device's peak of bytes in use belongs to that policy alone:

- `none`, `full`, and policies between them that keep activations in HBM (`save_mlp`,
  `minimal`);
- policies that move what they keep to pinned host memory during the forward pass and back
  during the backward (`offload_layer_inputs`: full recomputation with the layer loop's stack
  of block inputs on the host; `offload_minimal`; `offload_all`).

Per policy: the compiled program's device temporaries and host temporaries
(`memory_analysis()`), the bytes it copies between device and host per step (counted in the
compiled program), the device's measured peak of bytes in use (`memory_stats()`), the median
of 10 steps after 2 warm-up steps, and the loss and gradient norm against `full`'s (offloading
copies values, so they must agree; recomputing may reorder a fused chain).

    python benchmarks/bench_remat_gpu.py [--out benchmarks/results]

Writes remat_gpu.json and remat_gpu.md. Needs a GPU with about 40 GiB free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES = (
  'none',
  'full',
  'offload_layer_inputs',
  'save_mlp',
  'minimal',
  'offload_minimal',
  'offload_all',
)
SHAPE = dict(
  vocab=32000, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16, d_ff=8192, seq_len=2048,
  gated=True,
)  # fmt: skip
BATCH, STEPS, WARMUP = 4, 10, 2


def one(remat: str) -> dict:
  """Compiles and runs one policy's forward and backward step in this process."""
  import jax
  import jax.numpy as jnp
  import optax

  from zerojax._src.planner import host_link, presets

  cfg = presets.DecoderConfig(**SHAPE)
  params = presets.init_decoder(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq_len + 1), 0, cfg.vocab)
  loss = lambda p, t: presets.decoder_loss(p, t, cfg, remat=remat)
  step = jax.jit(jax.value_and_grad(loss))
  start = time.perf_counter()
  compiled = step.lower(params, tokens).compile()
  compile_seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  try:
    moved = host_link.count_host_transfers(compiled)
    host = {'to_host': moved.to_host, 'to_device': moved.to_device}
  except Exception as e:  # the parser is written for TPU programs: say so, do not guess
    host = {'error': f'{type(e).__name__}: {e}'}
  times = []
  for i in range(WARMUP + STEPS):
    t = time.perf_counter()
    value, grads = compiled(params, tokens)
    jax.block_until_ready(grads)
    if i >= WARMUP:
      times.append(time.perf_counter() - t)
  stats = jax.devices()[0].memory_stats() or {}
  return {
    'remat': remat,
    'device': jax.devices()[0].device_kind,
    'jax': jax.__version__,
    'compile_seconds': compile_seconds,
    'temp_bytes': int(m.temp_size_in_bytes),
    'host_temp_bytes': int(getattr(m, 'host_temp_size_in_bytes', 0) or 0),
    'argument_bytes': int(m.argument_size_in_bytes),
    'peak_bytes_in_use': stats.get('peak_bytes_in_use'),
    'host_transfers': host,
    'step_seconds_median': statistics.median(times),
    'step_seconds': times,
    'loss': float(value),
    'grad_norm': float(optax.global_norm(grads)),
    'finite': bool(jnp.isfinite(value)),
  }


def table(run: dict) -> list[str]:
  rows = {r['remat']: r for r in run['policies'] if 'step_seconds_median' in r}
  base = rows.get('full')
  lines = [
    f'Remat policies on one {run["device"]} (jax {run["jax"]}; `benchmarks/bench_remat_gpu.py`):'
    f" the presets' decoder {SHAPE['d_model']} wide, {SHAPE['n_layers']} layers, batch"
    f' {BATCH} x {SHAPE["seq_len"]}, forward and backward, median of {STEPS} steps.'
    " Step and peak are measured; temporaries are the compiled program's. Host GB/step:"
    " the planner's count of the copies in the compiled program, which reads the TPU"
    " compiler's forms of them, not the GPU's.",
    '',
    '| remat | step s | step / full | measured peak GiB | device temporaries GiB |'
    " host temporaries GiB | host GB/step | loss - full's | grad norm / full's |",
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for r in run['policies']:
    if 'step_seconds_median' not in r:
      error = r.get('error', 'failed')
      error = 'out of memory' if 'RESOURCE_EXHAUSTED' in error else error
      lines.append(f'| {r["remat"]} | {error} | | | | | | | |')
      continue
    moved = r['host_transfers']
    counted = 'error' not in moved and moved['to_host'] + moved['to_device']
    # The planner's transfer count reads the TPU compiler's forms; where it finds none in a
    # program that holds host temporaries, it does not read this compiler's: no figure.
    gb = f'{counted / 1e9:.2f}' if counted or not r['host_temp_bytes'] else 'not counted'
    peak = r['peak_bytes_in_use']
    lines.append(
      f'| {r["remat"]} | {r["step_seconds_median"]:.3f} |'
      f' {r["step_seconds_median"] / base["step_seconds_median"]:.2f} |'
      f' {"n/a" if peak is None else f"{peak / 2**30:.2f}"} | {r["temp_bytes"] / 2**30:.2f} |'
      f' {r["host_temp_bytes"] / 2**30:.2f} | {gb} | {r["loss"] - base["loss"]:.2e} |'
      f' {r["grad_norm"] / base["grad_norm"]:.6f} |'
    )
  return lines


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  parser.add_argument('--one', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    print('RESULT ' + json.dumps(one(args.one)), flush=True)
    return 0
  results = []
  for remat in POLICIES:
    done = subprocess.run(
      [sys.executable, __file__, '--one', remat], capture_output=True, text=True, timeout=400
    )
    found = [line for line in done.stdout.splitlines() if line.startswith('RESULT ')]
    if done.returncode or not found:
      tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ['no output']
      results.append({'remat': remat, 'error': tail[0][:300]})
    else:
      results.append(json.loads(found[0][len('RESULT ') :]))
    print(json.dumps(results[-1])[:400], flush=True)
  ok = [r for r in results if 'device' in r]
  if not ok or not any(r['remat'] == 'full' for r in ok):
    raise SystemExit('no policy ran (full included); see the errors above')
  run = {'device': ok[0]['device'], 'jax': ok[0]['jax'], 'policies': results}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'remat_gpu.json'), 'w') as f:
    json.dump(run, f, indent=2)
  lines = table(run)
  with open(os.path.join(args.out, 'remat_gpu.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
