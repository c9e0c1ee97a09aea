"""Peak host memory while loading a published checkpoint into a ZeRO-3 layout.

    python benchmarks/bench_load.py                 # 1.06 GiB checkpoint; writes results/load_*

Writes a safetensors checkpoint of a stacked-layer model in PyTorch's layout (per-layer
tensors, `Linear` weights (out, in); 8 layers of two 4096 x 4096 float32 matrices and their
biases: 1.06 GiB), then loads it at stage 3 in fresh processes on faked CPU devices, 1 process
x 8 devices and 2 processes x 4 (JAX's distributed runtime), two ways:

- zerojax: `zerojax.checkpoint.load_safetensors`, each process reading its devices' slices;
- whole file: what a user writes without it, independently of zerojax's loader: the whole file
  into host memory with `safetensors.numpy.load_file`, arranged into the tree, and
  `jax.device_put` into the plan's shardings.

For each process it records the peak resident memory during the load above what the process
held before it (`VmHWM` reset through /proc/self/clear_refs), against the process's share:
the bytes of the parameters its own devices hold (faked CPU devices live in host memory, so
the share is resident too). The table and JSON go to benchmarks/results/load_safetensors_cpu.*.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, 'results')
LAYERS, WIDTH = 8, 4096


def write_checkpoint(path: str) -> int:
  """The checkpoint, one layer's tensors at a time; returns its tensor bytes."""
  from safetensors.numpy import save_file

  rng = np.random.default_rng(0)
  tensors = {}
  for i in range(LAYERS):
    for name in ('up', 'down'):
      tensors[f'model.layers.{i}.{name}.weight'] = rng.standard_normal((WIDTH, WIDTH), np.float32)
      tensors[f'model.layers.{i}.{name}.bias'] = rng.standard_normal(WIDTH, np.float32)
  save_file(tensors, path)
  return sum(a.nbytes for a in tensors.values())


# --- The child: one process loading the checkpoint, one way.

CHILD = r"""
import json, os, sys
folder, how, local = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.environ['JAX_PLATFORMS'] = 'cpu'
import zerojax
if len(sys.argv) > 4:
  zerojax.distributed.initialize(sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), local_device_count=local)
else:
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={local}'
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
LAYERS, WIDTH = %(layers)d, %(width)d

def init_fn(key):
  k = jax.random.split(key, 4)
  return {'layers': {
    'up': {'kernel': jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)), 'bias': jnp.zeros((LAYERS, WIDTH))},
    'down': {'kernel': jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)), 'bias': jnp.zeros((LAYERS, WIDTH))}}}

Tensor = zerojax.checkpoint.Tensor
names = {}
for m in ('up', 'down'):
  names[f'layers/{m}/kernel'] = Tensor(f'model.layers.{{layer}}.{m}.weight', transpose=True)
  names[f'layers/{m}/bias'] = Tensor(f'model.layers.{{layer}}.{m}.bias')

mesh = jax.make_mesh((jax.device_count(),), ('data',))
tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, stacked={'layers': True})
abstract = jax.eval_shape(init_fn, jax.random.key(0))
plan = zerojax.plan_for(tx, abstract)

def rss(field):
  for line in open('/proc/self/status'):
    if line.startswith(field):
      return int(line.split()[1]) * 1024

jax.block_until_ready(jax.device_put(jnp.zeros(8), jax.devices()[0]))
before = rss('VmRSS:')
open('/proc/self/clear_refs', 'w').write('5')  # the peak (VmHWM) starts again from here
if how == 'zerojax':
  params = zerojax.checkpoint.load_safetensors(folder, init_fn, jax.random.key(0), tx=tx, names=names)
else:
  # Without zerojax's loader: the whole file, then arranged and placed.
  from safetensors.numpy import load_file
  whole = load_file(os.path.join(folder, 'model.safetensors'))
  tree = {'layers': {m: {
    'kernel': np.stack([whole[f'model.layers.{i}.{m}.weight'].T for i in range(LAYERS)]),
    'bias': np.stack([whole[f'model.layers.{i}.{m}.bias'] for i in range(LAYERS)])}
    for m in ('up', 'down')}}
  params = jax.device_put(tree, plan.params)
  del whole, tree
jax.block_until_ready(params)
peak = rss('VmHWM:')
share = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
print(json.dumps({'process': jax.process_index(), 'processes': jax.process_count(),
                  'how': how, 'before': before, 'peak': peak, 'share': share}))
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def load_in(folder: str, how: str, processes: int) -> list[dict]:
  """Runs the load in `processes` fresh processes of 8/processes devices; their records."""
  code = CHILD % {'layers': LAYERS, 'width': WIDTH}
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  port = _free_port()
  cmds = []
  for i in range(processes):
    cmd = [sys.executable, '-c', code, folder, how, str(8 // processes)]
    if processes > 1:
      cmd += [f'127.0.0.1:{port}', str(processes), str(i)]
    cmds.append(cmd)
  procs = [
    subprocess.Popen(
      c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    for c in cmds
  ]
  records = []
  for p in procs:
    out, err = p.communicate(timeout=900)
    if p.returncode != 0:
      raise RuntimeError(f'a {how} load failed:\n{err[-3000:]}')
    records.append(json.loads(out.strip().splitlines()[-1]))
  return records


def table(record: dict) -> str:
  gib = lambda n: f'{n / 2**30:.2f}'
  lines = [
    f'Loading a {gib(record["checkpoint_bytes"])} GiB safetensors checkpoint at ZeRO stage 3'
    f' ({record["machine"]}); peak resident memory during the load, per process, above'
    ' what it held before:',
    '',
    '| processes x devices | loader | process | its share (GiB) | peak during load (GiB) | peak / share |',
    '|---|---|---|---|---|---|',
  ]
  for r in record['runs']:
    lines.append(
      f'| {r["processes"]} x {8 // r["processes"]} | {r["how"]} | {r["process"]} | {gib(r["share"])}'
      f' | {gib(r["peak"] - r["before"])} | {(r["peak"] - r["before"]) / r["share"]:.2f} |'
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=RESULTS, help='folder for the JSON and the table')
  args = parser.parse_args(argv)
  import platform

  import jax

  with tempfile.TemporaryDirectory(prefix='zerojax_bench_load_') as folder:
    size = write_checkpoint(os.path.join(folder, 'model.safetensors'))
    runs = []
    for processes in (1, 2):
      for how in ('zerojax', 'whole file'):
        runs += load_in(folder, how, processes)
        print(f'{processes} process(es), {how}: done', flush=True)
  record = {
    'checkpoint_bytes': size,
    'machine': f'{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, faked CPU devices',
    'runs': runs,
  }
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, 'load_safetensors_cpu')
  with open(base + '.json', 'w') as f:
    json.dump(record, f, indent=2)
  with open(base + '.md', 'w') as f:
    f.write(table(record) + '\n')
  print(table(record))
  return 0


if __name__ == '__main__':
  sys.exit(main())
