"""LoRA and QLoRA of the Llama shapes on one chip and on eight, planned from a CPU machine with
the TPU compiler of the installed libtpu (no TPU needed), beside the published anchors.

Each row compiles zerojax.llama's training step as `python -m zerojax plan --lora 16
--base-dtype ...` builds it: rank-16 adapters (alpha 32) on every projection (q, k, v, o, gate,
up, down), trained alone (`zero_stage(trainable=zerojax.llama.is_adapter)`: no gradient,
optimizer state or master for the base), AdamW in `zerojax.mixed_precision` at stage 3 with
per-layer gathering, every block recomputed (remat 'full'), and the anchors' batch: 2 sequences
of 2,048 tokens per chip (rows full of real tokens, as packed rows are), the cross-entropy 256
positions at a time (8 chunks, as torchtune's chunked loss). The settings:

- `lora`: the base stored in bf16, in HBM;
- `lora+params`: that, with the parameters at rest in host memory, streamed a layer at a time
  (`offload_params=True`);
- `qlora`: the base's projections stored as NF4 (`QuantizedWeight`), in HBM;
- `qlora+params`: NF4, in host memory.

The anchors (GPU figures, none for a TPU): torchtune's Llama 3.1 8B on one RTX 4090, QLoRA 7.4
GiB peak at 2,413 tokens/s and LoRA 16.2 GiB at 3,083 tokens/s (batch 2, packed 2,048 tokens,
activation checkpointing); Answer.AI's FSDP + QLoRA, Llama-2 70B on 2 x 24 GB GPUs at 14.92 GiB
per GPU.

    python benchmarks/bench_one_chip_lora.py [--rows v5e-1:8B:qlora,...] [--out DIR]

Writes one_chip_lora.libtpu-VERSION.json (rows of a restricted run replace those rows and keep
the others) and one_chip_lora.md. A row is one compile: minutes to tens of minutes on a 2-core
machine; compiled programs are kept in the planner's cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(__file__))

import optax  # noqa: E402
from bench_maxtext import compiler_tag  # noqa: E402
from bench_one_chip import _LLAMA3_ROPE, RESULTS, SHAPES, _gib, _llama, row  # noqa: E402

import zerojax.llama  # noqa: E402
from zerojax._src.planner import program_cache, search, tpu  # noqa: E402
from zerojax._src.planner.candidates import Candidate, with_default_shares  # noqa: E402
from zerojax._src.planner.lowering import make_target  # noqa: E402
from zerojax._src.planner.presets import ModelSettings  # noqa: E402

LLAMA_70B = _llama(8192, 28672, 80, 64, 8, 128256, 500000.0, False, dict(_LLAMA3_ROPE, factor=8.0))
SHAPES = {**SHAPES, '70B': ('Llama-3.1-70B', LLAMA_70B)}
RANK, TARGETS = 16, ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
BATCH, LOSS_CHUNK = 2, 256
TOPOLOGIES = {'v5e-1': 'v5e:1x1', 'v6e-1': 'v6e:1x1', 'v5e-8': 'v5e:2x4', 'v6e-8': 'v6e:2x4'}
_PARAMS = dict(offload_params=True, offload='opt_state+master', update_on='stream')
# setting: (how the base is stored, the candidate)
SETTINGS = {
  'lora': ('bf16', Candidate(3, remat='full', batch_per_chip=BATCH)),
  'lora+params': ('bf16', Candidate(3, remat='full', batch_per_chip=BATCH, **_PARAMS)),
  'qlora': ('nf4', Candidate(3, remat='full', batch_per_chip=BATCH)),
  'qlora+params': ('nf4', Candidate(3, remat='full', batch_per_chip=BATCH, **_PARAMS)),
}
# The bar's rows: 8B on one v5e (QLoRA, and LoRA streamed), 70B QLoRA on eight v5e and one v6e.
DEFAULT_ROWS = 'v5e-1:8B:qlora,v5e-1:8B:lora+params,v5e-8:70B:qlora,v6e-1:70B:qlora+params'
# The published anchors a row is set beside: (what, peak GiB per device, tokens/s per device).
ANCHORS = {
  ('8B', 'qlora'): ('torchtune, 1 x RTX 4090', 7.4, 2413),
  ('8B', 'lora'): ('torchtune, 1 x RTX 4090', 16.2, 3083),
  ('8B', 'lora+params'): ('torchtune LoRA, 1 x RTX 4090', 16.2, 3083),
  ('70B', 'qlora'): ('Answer.AI FSDP+QLoRA, 2 x 24 GB (Llama-2 70B)', 14.92, None),
  ('70B', 'qlora+params'): ('Answer.AI FSDP+QLoRA, 2 x 24 GB (Llama-2 70B)', 14.92, None),
}


def parse_rows(text: str) -> list[tuple[str, str, str]]:
  """'runtime:shape:setting,...' as (runtime, shape, setting), each checked."""
  out = []
  for item in text.split(','):
    parts = item.strip().split(':')
    if len(parts) != 3:
      raise ValueError(f'--rows: {item!r} is not runtime:shape:setting (e.g. v5e-1:8B:qlora).')
    for value, known, what in zip(
      parts, (TOPOLOGIES, SHAPES, SETTINGS), ('runtime', 'shape', 'setting')
    ):
      if value not in known:
        raise ValueError(f'--rows: {item!r}: unknown {what} {value!r}; choose from {list(known)}.')
    out.append(tuple(parts))
  return out


def one(runtime: str, shape: str, setting: str, cache_dir) -> dict:
  """One row: the candidate planned as the search evaluates it, with tokens per second."""
  topology = TOPOLOGIES[runtime]
  devices = tpu.topology_devices(topology)
  cfg = zerojax.llama.config_from_hf(SHAPES[shape][1], seq_len=2048)
  cfg = dataclasses.replace(cfg, lora=zerojax.llama.LoraConfig(RANK, 2.0 * RANK, TARGETS))
  base, candidate = SETTINGS[setting]
  target = make_target(
    cfg,
    topology,
    devices=devices,
    optimizer=lambda: optax.adamw(1e-4),
    mixed_precision=True,
    settings=ModelSettings(seq_len=2048, base_dtype=base, loss_chunk=LOSS_CHUNK),
  )
  found = with_default_shares([candidate], topology, None)
  print(f'{runtime} {shape} ({SHAPES[shape][0]}) {setting}: compiling', flush=True)
  result = search.run_search(target, found, cache_dir=cache_dir).results[0]
  chip = runtime.split('-')[0]
  out = row(chip, shape, setting, result, cfg.num_params(), SHAPES[shape][0]) | {
    'runtime': runtime,
    'base_dtype': base,
    'lora_rank': RANK,
    'batch_per_chip': BATCH,
  }
  step = out.get('step_seconds')
  out['tokens_per_second_per_chip'] = BATCH * 2048 / step if step else None
  anchor = ANCHORS.get((shape, setting))
  if anchor:
    out['anchor'] = dict(zip(('what', 'peak_gib', 'tokens_per_second'), anchor))
  return out


def table(rows: list[dict], compiler: str) -> str:
  lines = [
    f'### {compiler}',
    '',
    '| runtime | shape | setting | states in HBM GiB | host GiB | peak GiB | fits | predicted'
    ' step s | tokens/s per chip | anchor (peak GiB, tokens/s) |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    step, tps, a = r.get('step_seconds'), r.get('tokens_per_second_per_chip'), r.get('anchor')
    anchor = '-' if not a else f'{a["what"]}: {a["peak_gib"]}, {a["tokens_per_second"] or "-"}'
    lines.append(
      f'| {r["runtime"]} | {r["shape"]} ({r["model"]}) | {r["setting"]} |'
      f' {_gib(r["states_bytes"])} | {_gib(r["host_bytes"])} | {_gib(r["peak_bytes"])} |'
      f' {"yes" if r["fits"] else r["status"]} | {"-" if step is None else f"{step:.2f}"} |'
      f' {"-" if tps is None else f"{tps:,.0f}"} | {anchor} |'
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', default=DEFAULT_ROWS, help='runtime:shape:setting,...')
  parser.add_argument('--out', default=RESULTS)
  parser.add_argument('--no-cache', action='store_true', help='compile every program afresh')
  args = parser.parse_args(argv)
  try:
    wanted = parse_rows(args.rows)
  except ValueError as e:
    parser.error(str(e))
  version = compiler_tag().removeprefix('libtpu-')
  cache = None if args.no_cache else program_cache.default_dir()
  start = time.perf_counter()
  rows = [one(*key, cache) for key in wanted]
  path = os.path.join(args.out, f'one_chip_lora.libtpu-{version}.json')
  done = {(r['runtime'], r['shape'], r['setting']) for r in rows}
  if os.path.exists(path):
    with open(path) as f:
      rows = [
        r for r in json.load(f)['rows'] if (r['runtime'], r['shape'], r['setting']) not in done
      ] + rows
  record = dict(
    libtpu=version,
    jax=__import__('jax').__version__,
    lora=dict(rank=RANK, alpha=2.0 * RANK, targets=TARGETS),
    seq_len=2048,
    batch_per_chip=BATCH,
    loss_chunk=LOSS_CHUNK,
    optimizer='adamw, zerojax.mixed_precision (bf16 parameters, fp32 master and moments of the adapters)',
    rows=rows,
    seconds=round(time.perf_counter() - start, 1),
  )
  with open(path, 'w') as f:
    json.dump(record, f, indent=1)
  text = table(rows, f'libtpu {version}, jax {record["jax"]}')
  with open(os.path.join(args.out, 'one_chip_lora.md'), 'w') as f:
    f.write('# LoRA and QLoRA on one chip and on eight (bench_one_chip_lora.py)\n\n')
    f.write(__doc__.split('\n\n')[1].replace('\n', ' ') + '\n\n' + text + '\n')
  print(text)
  print(f'wrote {path} and one_chip_lora.md in {record["seconds"]:.0f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
