"""Recompute only what HBM cannot hold: MaxText's v5e-256 and v5p rows, its rematerialisation
against the policy the plan search picks.

For each of MaxText's published v5e-256 rows (its configs/v5e README: the 16B, 32B and 64B
decoders at 6, 4 and 2 sequences of 2048 per chip, flash attention, FSDP over all 256 chips,
which zerojax lays out as ZeRO-3 over both torus axes), this searches the rematerialisation
policies with the TPU compiler of the installed libtpu (no TPU needed):

- `full` (MaxText's setting for these rows: every block recomputed, zerojax's default plan);
- `save_attention`, `save_mlp` (keep one activation of each block in HBM);
- `offload_qkv`, `offload_minimal`, `save_attention_offload_minimal`, `offload_all` (keep
  them in host memory: written during the forward pass, read back during the backward,
  `jax.checkpoint_policies.save_and_offload_only_these_names`);
- `offload_layer_inputs`, `offload_minimal_inputs`, `save_attention_offload_minimal_inputs`
  (`full`, `offload_minimal` and `save_attention_offload_minimal` with the layer loop's stack
  of block inputs in host memory too).

Each candidate is compiled; the search ranks those that fit by predicted step (the step-time
model of docs/design.md). The table gives, per row: MaxText's published TFLOP/s, the default
plan's and the searched plan's predicted step and TFLOP/s (MaxText's own model-FLOP count over
the step, `bench_maxtext.maxtext_flops`), the executed matmul FLOPs over the model's (what
recomputing costs), each plan's peak, the host bytes per step, and the searched plan's step
again with the host link at half and a quarter of the bandwidth the chip table assumes (32
GB/s: PCIe Gen4 x16, not published for v5e), since that figure is not a citation.

With `--chip v5p` it takes MaxText's v5p rows instead (32B and 64B on 64 chips with a tensor
axis of 4, 128B on 128 and 256 chips and 256B on 512 with one of 8; MaxText runs them with
`minimal`, zerojax's default plan of them too, at the row's own mesh). The search there is
`python -m zerojax plan --search` over each of `V5P_REMATS` (`minimal`; `save_qkv_attention`
and `none`, which keep more in the chip's 95 GiB; `offload_minimal` and
`save_attention_offload_minimal`; `minimal_residual` and `offload_minimal_residual`, which keep
the residual stream after the attention too, in HBM or on the host, and so run no output
projection again) at the row's tensor axis and at half of it (`--layouts flat
--tensor-sizes`: ZeRO over the other chips), each with the collectives where the TPU compiler
puts them and on the chip's SparseCores (`--collective-offloads`, which a v5p search tries both
ways unless told), the fastest that fits the searched plan.

MaxText's own programs are compiled by `bench_maxtext_program.py` (MaxText's `train_compile`,
beside the newest CI end); `maxtext_table.py` sets these plans beside them.

    python benchmarks/bench_recompute.py [--chip v5e|v5p] [--rows 16B,32B,64B] [--out DIR] [--reuse]

Writes recompute_CHIP.libtpu-VERSION.json and recompute_CHIP.md (every compiler's rows).
Minutes per candidate on a 2-core machine; compiled programs are kept in the planner's cache
(`~/.cache/zerojax/programs`), so a second run reads them back. `--reuse` keeps a
committed candidate's figures where the row's search command is unchanged but for the policies
it lists (`POLICY_FLAGS`) and the candidate is compiled as it was (not lean,
`candidates.LEAN_REMATS`, then or now), compiles the others and ranks all of them as the search
does; the record lists what it reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(__file__))

import maxtext_table  # noqa: E402
import model_revision  # noqa: E402
from bench_maxtext import (  # noqa: E402
  ROWS,
  SEQ,
  V5E_ROWS,
  compiler_tag,
  decoder_model,
  maxtext_flops,
)

from zerojax._src.planner import candidates, presets  # noqa: E402

REMATS = (
  'full',
  'save_attention',
  'save_mlp',
  'offload_qkv',
  'offload_minimal',
  'save_attention_offload_minimal',
  'offload_all',
  'offload_layer_inputs',
  'offload_minimal_inputs',
  'save_attention_offload_minimal_inputs',
)
# MaxText's v5p rows keep the query, key, value and MLP activations (`minimal`, zerojax's plan
# of them too); a chip of 95 GiB may keep more (the attention's output as well; everything),
# or move what it keeps to the host.
V5P_REMATS = (
  'minimal',
  'save_qkv_attention',
  'none',
  'offload_minimal',
  'save_attention_offload_minimal',
  'minimal_residual',
  'offload_minimal_residual',
)
# The host link's bandwidth as a share of the chip table's assumed figure.
HOST_SHARES = (1.0, 0.5, 0.25)


def _figures(r, flops: float, chip) -> dict:
  """One searched candidate's figures: its step, TFLOP/s at MaxText's count, and its step with
  the host link at each share of the assumed bandwidth."""
  from zerojax._src.planner import roofline

  moved = r.host_traffic.moved
  steps = {}
  for share in HOST_SHARES:
    slower = dataclasses.replace(chip, host_link_bandwidth=chip.host_link_bandwidth * share)
    steps[share] = roofline.predict(slower, r, moved, r.host_traffic.overlapped).step
  return _identity(r) | {
    'fits': r.fits,
    'predicted_step_seconds': r.step_seconds,
    'predicted_tflops': flops / r.step_seconds / 1e12,
    'executed_matmul_flops': r.flops,
    'executed_over_model': r.flops / flops,
    'peak_gib': r.peak_bytes / 2**30,
    'peak_reported': r.peak_reported,
    'host_bytes_per_step': moved,
    'host_overlapped': r.host_traffic.overlapped,
    'step_at_host_share': {str(k): v for k, v in steps.items()},
  }


def tensor_sizes(row) -> tuple[int, ...]:
  """The tensor axes a v5p row's search tries: half the row's own (MaxText's), then its own."""
  tensor = row[6]
  return tuple(sorted({max(1, tensor // 2), tensor}))


def search_flags(row, chip: str = 'v5e') -> list[str]:
  """The flags of `python -m zerojax plan --search` that search one of MaxText's rows: its
  model and batch and flash attention; on v5e ZeRO-3 over both torus axes and every policy of
  `REMATS`, on v5p ZeRO-3 beside a tensor axis of each of `tensor_sizes` and every policy of
  `V5P_REMATS`."""
  name, width, heads, mlp, layers, topology, _, batch, published = row
  common = ['--model', decoder_model(width, heads, mlp, layers), '--topology', topology,
            '--stages', '3']  # fmt: skip
  if chip == 'v5e':
    space = ['--layouts', 'torus', '--prefetch-options', 'off', '--remats', ','.join(REMATS)]
  else:
    space = ['--layouts', 'flat', '--tensor-sizes', ','.join(map(str, tensor_sizes(row))),
             '--prefetch-options', 'off', '--remats', ','.join(V5P_REMATS)]  # fmt: skip
  return common + space + ['--batches-per-chip', str(batch), '--seq-len', str(SEQ),
                           '--attention', 'flash']  # fmt: skip


def search_setup(row, chip: str = 'v5e') -> tuple:
  """(the target, the candidates, `search.run_search`'s other arguments) of one row's search,
  made through the planner's Python API as `search_flags` asks the command line for them:
  MaxText's decoder at its batch, flash attention, ZeRO-3, the row's policies and layouts."""
  import optax

  from zerojax._src.planner import lowering, program_cache, search, tpu

  name, width, heads, mlp, layers, topology, _, batch, _ = row
  decoder = decoder_model(width, heads, mlp, layers)[len('decoder:') :]
  target = lowering.make_target(
    presets.parse_decoder(decoder, SEQ),
    topology,
    devices=tpu.topology_devices(topology),
    optimizer=lambda: optax.adamw(1e-4),
    settings=presets.ModelSettings(seq_len=SEQ, attention='flash'),
  )
  if chip == 'v5e':
    space = dict(layouts=('torus',), remat=REMATS)
  else:
    space = dict(layouts=('flat',), tensor=tensor_sizes(row), remat=V5P_REMATS)
  found, invalid = search.search_space(
    target, {}, stages=(3,), prefetch=(False,), batch_per_chip=(batch,), **space
  )
  run = dict(
    invalid=invalid,
    hbm_bytes=None,
    measure=False,
    cache_dir=str(program_cache.default_dir()),
    compiler_options={},
  )
  return target, found, run


def search_command(row, chip: str = 'v5e') -> str:
  """The command line that reproduces a row's search."""
  return 'python -m zerojax plan --search ' + shlex.join(search_flags(row, chip))


# The flags of a search that only list its candidates' policies: two searches of a row that
# differ in these alone compile each candidate they share to the same program.
POLICY_FLAGS = ('--remats', '--collective-offloads')


def setting(command: str) -> list[str]:
  """A search command's words without `POLICY_FLAGS` and their values."""
  words, out = shlex.split(command), []
  for i, word in enumerate(words):
    if word not in POLICY_FLAGS and (i == 0 or words[i - 1] not in POLICY_FLAGS):
      out.append(word)
  return out


def policy(c) -> str:
  """A candidate's name in the tables: its remat, its tensor axis where it has one, and where
  its collectives run when not where the compiler puts them."""
  name = c.remat if c.tensor == 1 else f'{c.remat}, tensor {c.tensor}'
  return name + (f', {c.collective_offload} collectives' if c.collective_offload else '')


def search_row(row, before: dict | None = None, chip: str = 'v5e') -> dict:
  """The candidates of one row, compiled and ranked by the command's own search; from `before`
  (the committed record, `--reuse`), the candidates compiled as they were are kept."""
  from zerojax._src.planner import search

  start = time.perf_counter()
  command = search_command(row, chip)
  target, space, run = search_setup(row, chip)
  old = {}
  # A record from before commands were recorded is this row's search with the same flags.
  if before and setting(before.get('command', command)) == setting(command):
    old = {
      maxtext_table.policy_name(c): c for c in before['candidates'] if not c.get('lean', False)
    }
  kept = [policy(c) for c in space if policy(c) in old and not candidates.lean(c.remat)]
  fresh = [c for c in space if policy(c) not in kept]
  report = search.run_search(target, fresh, **run)
  flops = _row_flops(row)
  done = {policy(r.candidate): _candidate(r, flops, report.target.chip) for r in report.results}
  figures = [old[policy(c)] if policy(c) in kept else done[policy(c)] for c in space]
  # Ranked as the search ranks: the fastest that fits, then the smallest peak.
  fitting = [f for f in figures if f.get('fits')]
  winner = min(fitting, key=lambda f: (f['predicted_step_seconds'], f['peak_gib']), default=None)
  # The default plan: MaxText's own setting (v5e `full`; v5p `minimal` at the row's mesh).
  mine = ('full', 1) if chip == 'v5e' else ('minimal', row[6])
  default = next(
    f
    for f in figures
    if (f['remat'], f.get('tensor', 1)) == mine and f.get('collective_offload') is None
  )
  record = _record(row, figures, default, winner)
  record.update(command=command, reused=kept)
  record['search_seconds'] = time.perf_counter() - start
  return record


def _identity(r) -> dict:
  """What a searched candidate is (its remat, tensor axis, collectives, name) and its status."""
  c = r.candidate
  return {
    'remat': c.remat,
    'tensor': c.tensor,
    'collective_offload': c.collective_offload,
    'policy': policy(c),
    'lean': candidates.lean(c.remat),
    'status': r.status,
  }


def _candidate(r, flops: float, chip) -> dict:
  """A candidate's figures, or what it is and its status where nothing was priced."""
  return _figures(r, flops, chip) if r.predicted is not None else _identity(r)


def _row_flops(row) -> float:
  """MaxText's model FLOPs per chip for a row."""
  name, width, heads, mlp, layers, topology, _, batch, published = row
  return maxtext_flops(width, heads, mlp, layers, batch)


def _record(row, figures: list[dict], default: dict, winner: dict | None) -> dict:
  """A row's record from its candidates' figures, its default plan's and its winner's."""
  name, width, heads, mlp, layers, topology, _, batch, published = row
  return {
    'row': name,
    'topology': topology,
    'batch_per_chip': batch,
    'published_tflops': published,
    'maxtext_flops_per_chip': _row_flops(row),
    'default': default if default.get('fits') else {'status': default['status']},
    'searched': winner,
    'candidates': figures,
  }


def table(out: str, chip: str = 'v5e') -> list[str]:
  """Every compiler's rows of `chip` in `out`: default plan against searched plan."""
  default = 'full rematerialisation' if chip == 'v5e' else '`minimal`'
  lines = [
    f"MaxText's {chip}{'-256' if chip == 'v5e' else ''} rows: zerojax's default plan"
    f" ({default}, MaxText's setting)"
    ' against the policy the plan search picks (`benchmarks/bench_recompute.py`). TFLOP/s is'
    " MaxText's model-FLOP count over the predicted step; executed/model is the compiled"
    " program's matmul FLOPs over that count; * marks a peak the compiler reports with host"
    ' memory in it (it compiled the program within HBM). Host link: 32 GB/s assumed, then half'
    ' and a quarter of it.'
    + (
      " MaxText's peak and step: its own program's for the row, compiled by MaxText on the same"
      " compiler and priced by the same model (`bench_maxtext_program.py`; '—' on a compiler"
      ' MaxText does not run with); "vs MaxText\'s program" is that step over the searched'
      " plan's, then with the host link at half."
      if chip == 'v5e'
      else ''
    ),
    '',
    '| row | compiler | published TFLOP/s | default step s | default TFLOP/s | default'
    ' executed/model | default peak GiB | searched policy (of candidates) | searched step s'
    ' | searched TFLOP/s | executed/model | peak GiB | host GB/step | speedup | at 1/2 host link'
    ' | at 1/4 |'
    + (" vs MaxText's program | fastest at or under MaxText's peak |" if chip == 'v5e' else ''),
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|'
    + ('---|---|' if chip == 'v5e' else ''),
  ]
  runs = []
  for name in sorted(os.listdir(out)):
    if name.startswith(f'recompute_{chip}.libtpu-') and name.endswith('.json'):
      with open(os.path.join(out, name)) as f:
        runs.append(json.load(f))
  for run in runs:
    compiled = maxtext_table.programs(out, run['versions']['libtpu'], chip)
    for r in run['rows']:
      d, s = r['default'], r['searched']
      program = compiled.get(r['row'])
      peak = lambda x: f'{x["peak_gib"]:.2f}' + ('' if x['peak_reported'] else '*')
      at = [
        d['predicted_step_seconds'] / s['step_at_host_share'][k] for k in ('1.0', '0.5', '0.25')
      ]
      lines.append(
        f'| {r["row"]}{model_revision.mark(run, r)} | {run["versions"]["libtpu"]} |'
        f' {r["published_tflops"]:.0f} |'
        f' {d["predicted_step_seconds"]:.2f} | {d["predicted_tflops"]:.0f} |'
        f' {d["executed_over_model"]:.2f} | {peak(d)} | {maxtext_table.policy_name(s)} (of {len(r["candidates"])}) |'
        f' {s["predicted_step_seconds"]:.2f} | {s["predicted_tflops"]:.0f} |'
        f' {s["executed_over_model"]:.2f} | {peak(s)} | {s["host_bytes_per_step"] / 1e9:.1f} |'
        f' {at[0]:.2f}x | {at[1]:.2f}x | {at[2]:.2f}x |'
        + (
          f' {_against_maxtext(program, s)} | {_under_maxtext(r, program)} |'
          if chip == 'v5e'
          else ''
        )
      )
  return (
    lines
    + model_revision.note(out, (f'recompute_{chip}.libtpu-',), marked=True)
    + _commands(chip, runs)
  )


def _commands(chip: str, runs: list[dict]) -> list[str]:
  """The commands that reproduce the table's searches, with the installed jax and libtpu."""
  rows = V5E_ROWS if chip == 'v5e' else ROWS
  lines = ['', "Each row's search (`--no-cache` compiles every candidate afresh):", '']
  return lines + [f'- {row[0]}: `{search_command(row, chip)}`' for row in rows]


def _step(program: dict | None) -> float | None:
  """MaxText's compiled program's predicted step (None: not compiled, or it did not fit)."""
  return program.get('step_seconds') if program else None


def _against_maxtext(program: dict | None, figures: dict) -> str:
  """'1.19x / 1.19x': the predicted step of MaxText's compiled `program` over that of the plan
  of `figures`, at the assumed host link and at half of it ('—': no program of MaxText's)."""
  step = _step(program)
  if step is None:
    return '—'
  at = figures['step_at_host_share']
  return f'{step / at["1.0"]:.2f}x / {step / at["0.5"]:.2f}x'


def _under_maxtext(r: dict, program: dict | None) -> str:
  """The fastest candidate whose peak is at or under the peak of MaxText's compiled `program`
  for the row, and its speedup over the default plan, then over MaxText's program (at the
  assumed host link and at half of it; '—': no program of MaxText's). For a program holding
  host memory the peak is the plan's upper bound (`bench_memory.py` reads the device's share
  from the compiler's buffer assignment: lower on every row it planned)."""
  cap = maxtext_table.peak_gib(program)
  if cap is None:
    return '—'
  under = [c for c in r['candidates'] if c.get('fits') and c['peak_gib'] <= cap]
  if not under:
    return 'none'
  best = min(under, key=lambda c: c['predicted_step_seconds'])
  speedup = r['default']['predicted_step_seconds'] / best['predicted_step_seconds']
  return (
    f'{maxtext_table.policy_name(best)}, {best["peak_gib"]:.2f} GiB, {speedup:.2f}x;'
    f" MaxText's program {_against_maxtext(program, best)}"
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--chip', default='v5e', choices=('v5e', 'v5p'), help="MaxText's rows of")
  parser.add_argument('--rows', default=None, help='comma-separated row names (default: all)')
  parser.add_argument(
    '--resume',
    action='store_true',
    help="skip the rows already searched at the presets' model revision (an interrupted run)",
  )
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  parser.add_argument(
    '--reuse', action='store_true', help='keep the committed figures of unchanged candidates'
  )
  args = parser.parse_args()
  every = V5E_ROWS if args.chip == 'v5e' else ROWS
  names = [r[0] for r in every]
  wanted = args.rows.split(',') if args.rows else names
  unknown = sorted(set(wanted) - set(names))
  if unknown:
    parser.error(f'--rows: no {args.chip} row {unknown}; the rows are {names}')
  import jax
  import libtpu

  tag = compiler_tag()
  path = os.path.join(args.out, f'recompute_{args.chip}.{tag}.json')
  committed = {}
  if os.path.exists(path):
    with open(path) as f:
      committed = {r['row']: r for r in json.load(f)['rows']}
  # --reuse keeps only what was compiled from the presets as they are (their revision).
  current = {n: r for n, r in committed.items() if model_revision.current(r)}
  before = current if args.reuse else {}
  versions = {'jax': jax.__version__, 'libtpu': getattr(libtpu, '__version__', '?')}
  os.makedirs(args.out, exist_ok=True)
  done = {}
  for row in (r for r in every if r[0] in wanted):
    if args.resume and row[0] in current:
      print(f'{row[0]}: searched at model revision {presets.MODEL_REVISION} already (--resume)')
      continue
    print(f'searching {row[0]} on {row[5]} with {tag} ...', flush=True)
    done[row[0]] = search_row(row, before.get(row[0]), args.chip)
    done[row[0]]['model_revision'] = presets.MODEL_REVISION
    # Saved after each row, the rows not searched (yet) keeping their records and revisions,
    # so that an interrupted run loses only the row it was on.
    rows = [done.get(n, committed.get(n)) for n in names if n in done or n in committed]
    versions['model_revision'] = min(r.get('model_revision', 1) for r in rows)
    with open(path + '.partial', 'w') as f:
      json.dump({'versions': versions, 'rows': rows}, f, indent=2)
    os.replace(path + '.partial', path)
  lines = table(args.out, args.chip)
  with open(os.path.join(args.out, f'recompute_{args.chip}.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
