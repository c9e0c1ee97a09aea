"""Loads a safetensors checkpoint at stage 3 in one process of several (or alone), counting
what this process reads, and saves it back out.

python _pretrained_worker.py CHECKPOINT OUT LOCAL_DEVICES [COORDINATOR NUM_PROCESSES PROCESS_ID]

Writes OUT/reads-<process>.json (bytes read per tensor), OUT/params.npz (the whole parameters,
gathered, from process 0) and OUT/saved/ (`save_safetensors`, written by process 0).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
folder, out, local = sys.argv[1], sys.argv[2], int(sys.argv[3])
multi = len(sys.argv) > 4
os.environ['JAX_PLATFORMS'] = 'cpu'

import zerojax  # noqa: E402

if multi:
  coordinator, processes, pid = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
  zerojax.distributed.initialize(coordinator, processes, pid, local_device_count=local)
else:
  os.environ['XLA_FLAGS'] = (
    f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={local}'
  )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _pretrained_model import NAMES, init_fn  # noqa: E402
from _read_counter import count_reads  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ('data',))
tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, stacked={'layers': True})
log = []
restore = count_reads(log)
params = zerojax.checkpoint.load_safetensors(folder, init_fn, jax.random.key(0), tx=tx, names=NAMES)
restore()
me = jax.process_index()
reads = {}
for name, n in log:
  reads[name] = reads.get(name, 0) + n
with open(os.path.join(out, f'reads-{me}.json'), 'w') as f:
  json.dump(reads, f)
flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
whole = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True)) for k, x in flat.items()}
specs = {k: str(x.sharding.spec) for k, x in flat.items()}
zerojax.checkpoint.save_safetensors(params, os.path.join(out, 'saved'), names=NAMES)
if me == 0:
  np.savez(os.path.join(out, 'params.npz'), **whole)
  with open(os.path.join(out, 'specs.json'), 'w') as f:
    json.dump(specs, f)
print('done', me, flush=True)
