"""Memory at MaxText's own settings: full rematerialisation, with and without the layer loop's
stack of block inputs in host memory.

MaxText's v5e-256 rows (16B, 32B and 64B at 6, 4 and 2 sequences of 2048 per chip, remat full,
flash attention, FSDP over all 256 chips) and the README's llama2-70b plan (one sequence per
chip, chunked or flash attention) are planned twice with the TPU compiler of the installed
libtpu (no TPU needed):

- `--remat full`: every block recomputed in the backward pass, its input kept in HBM for each
  layer (the layer loop's stack: layers x batch x seq x d_model bf16); zerojax's default plan
  and MaxText's setting, compiled lean (`candidates.LEAN_REMATS`: the head gathered after the
  layer loop, a one-hot cross-entropy, the TPU scheduler held to `candidates.LEAN_SHARE`
  percent of HBM);
- `--remat offload_layer_inputs`: the same recomputation, that stack written to host memory
  during the forward pass and read back a block at a time during the backward;
- `--remat full` again with the compiler's latency-hiding scheduler at its own default and held
  to 70%, 60% and 50% of HBM (`--scheduler-share compiler`, `70`, `60`, `50`; at the compiler's
  default it fills spare HBM by gathering later layers' weights early): the same program,
  scheduled differently. The default share is the largest of these at which every row peaks at
  or under MaxText's program (`candidates.LEAN_SHARE`; tests/test_docs.py holds it to that).

And MaxText's v5p rows (bench_maxtext.py's default plans, `--remat minimal`, 95 GiB a chip)
once more with the full-remat plan's share (`--scheduler-share` `candidates.LEAN_SHARE`),
against their committed plans: where a program needs most of HBM, holding the scheduler back
can cost step time.

Each program's device memory is read two ways: the plan's peak (the compiler's own peak of live
bytes where the program holds nothing in host memory; for a program that does, the compiler's
figures count host memory too, so the plan reports arguments + outputs - aliased +
temporaries), and the compiler's buffer assignment for the device's memory space (the total
of its dumped memory-usage report, `Memory Space: default`: every device buffer, fragmentation
included, host buffers not). Each row's MaxText peak is that of MaxText's own program for it,
compiled by MaxText on the same compiler (`bench_maxtext_program.py`, committed beside these
results; '—' on a compiler MaxText does not run with). Where `bench_recompute.py`'s
results for the same compiler are in --out, each v5e row's searched policy is planned too.

    python benchmarks/bench_memory.py [--rows 32B,64B] [--out benchmarks/results] [--reuse]

Writes memory_v5e.libtpu-VERSION.json and memory_v5e.md (every compiler's rows). About a minute
of compiling per program on a 2-core machine, four or five programs per row (`--reuse` keeps those of
the committed JSON whose command is unchanged).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import maxtext_table  # noqa: E402
import model_revision  # noqa: E402
from bench_maxtext import (  # noqa: E402
  ROWS,
  SEQ,
  V5E_ROWS,
  compiler_tag,
  decoder_model,
  row_mesh,
)

from zerojax._src.planner import candidates, presets  # noqa: E402

REMATS = ('full', 'offload_layer_inputs')
# `full` again with the TPU compiler's latency-hiding scheduler at these shares of HBM (`plan
# --scheduler-share`; the default plan's is `candidates.LEAN_SHARE`): the same program,
# scheduled to gather later layers' weights more or less far ahead.
SCHEDULER_SHARES = ('compiler', '70', '60', '50')
# The share the v5p rows (`minimal`, planned at the compiler's default) are planned at again.
V5P_HELD_SHARE = str(candidates.LEAN_SHARE)


def rows() -> list[tuple[str, str, list[str]]]:
  """(name, MaxText row, plan flags) of every row."""
  out = []
  for name, width, heads, mlp, layers, topology, tensor, batch, _ in V5E_ROWS:
    model = decoder_model(width, heads, mlp, layers)
    flags = ['--model', model, '--topology', topology, '--mesh', row_mesh(topology, tensor),
             '--stage', '3', '--batch-per-chip', str(batch), '--seq-len', str(SEQ),
             '--attention', 'flash']  # fmt: skip
    out.append((name, name, flags))
  llama = ['--model', 'llama2-70b', '--topology', 'v5e:16x16', '--mesh', '16x16', '--stage', '3',
           '--seq-len', str(SEQ)]  # fmt: skip
  out.append(('llama2-70b chunked', 'llama2-70b', llama + ['--attention-chunk', '512']))
  out.append(('llama2-70b flash', 'llama2-70b', llama + ['--attention', 'flash']))
  return out


def v5p_rows() -> list[tuple[str, list[str]]]:
  """(name, plan flags) of MaxText's v5p rows, as bench_maxtext.py plans them (`minimal`)."""
  out = []
  for name, width, heads, mlp, layers, topology, tensor, batch, _ in ROWS:
    flags = ['--model', decoder_model(width, heads, mlp, layers), '--topology', topology,
             '--mesh', row_mesh(topology, tensor), '--stage', '3', '--batch-per-chip',
             str(batch), '--seq-len', str(SEQ)]  # fmt: skip
    out.append((name, flags))
  return out


def v5p_held(out: str, tag: str, before: dict, reuse: bool) -> list[dict]:
  """Each v5p row's committed plan (bench_maxtext.py's, in `out`) beside the same plan with
  the scheduler held to `V5P_HELD_SHARE`."""
  share, rows = V5P_HELD_SHARE, []
  for name, flags in v5p_rows():
    with open(os.path.join(out, f'maxtext_v5p_{name}.{tag}.json')) as f:
      default = json.load(f)
    said = default['command'].split(' --json ')[0]
    if said != 'python -m zerojax plan ' + ' '.join(
      [*flags, '--remat', 'minimal', '--attention', 'flash']
    ):
      raise SystemExit(f'v5p {name}: the committed plan is not the one held here: {said}')
    held = plan_or_reuse(
      [*flags, '--attention', 'flash', '--scheduler-share', share],
      'minimal',
      before.get(name) if reuse else None,
    )
    rows.append({
      'row': name, 'share': int(share), 'default_command': said,
      'default_peak_gib': default['memory']['peak'] / 2**30,
      'default_step_seconds': default['predicted_seconds']['step'], 'held': held,
    })  # fmt: skip
  return rows


def device_space_bytes(dump: str) -> int:
  """The total of the device memory space in the training step's dumped memory-usage report."""
  reports = glob.glob(os.path.join(dump, '*train_step*memory-usage-report.txt'))
  if len(reports) != 1:
    raise SystemExit(f'{dump}: expected one memory-usage report of the train step, got {reports}')
  with open(reports[0]) as f:
    text = f.read()
  found = re.search(r'Memory Space: default \(color=0\)\nTotal bytes: (\d+)', text)
  if not found:
    raise SystemExit(f'{reports[0]}: no "Memory Space: default" total')
  return int(found.group(1))


def command(flags: list[str], remat: str) -> str:
  """The plan command a record names (what `--reuse` matches)."""
  return 'python -m zerojax plan ' + ' '.join([*flags, '--remat', remat])


def plan(flags: list[str], remat: str) -> dict:
  """One plan's figures, compiled afresh with the compiler's buffer assignment dumped (`flags`
  may name compiler options)."""
  with tempfile.TemporaryDirectory() as tmp:
    dump, out = os.path.join(tmp, 'dump'), os.path.join(tmp, 'plan.json')
    cmd = [sys.executable, '-m', 'zerojax', 'plan', *flags, '--remat', remat, '--no-cache',
           '--compiler-option', f'xla_dump_to={dump}',
           '--compiler-option', 'xla_dump_hlo_as_text=true', '--json', out]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.exists(out):
      raise SystemExit(f'{remat}: the plan failed (exit {done.returncode}):\n{done.stderr[-3000:]}')
    with open(out) as f:
      result = json.load(f)
    traffic = result['host_traffic']
    return {
      'remat': remat,
      'command': command(flags, remat),
      'lean': candidates.lean(remat),
      'scheduler_share': result['scheduler_share'],
      'fits': result['fits'],
      'peak_gib': result['memory']['peak'] / 2**30,
      'peak_source': result['memory']['peak_source'],
      'device_space_gib': device_space_bytes(dump) / 2**30,
      'host_held_gib': result['memory']['host_held'] / 2**30,
      'host_bytes_per_step': traffic.get('to_host', 0) + traffic.get('to_device', 0),
      'host_overlapped': traffic.get('overlapped'),
      'predicted_step_seconds': result['predicted_seconds']['step'],
      'matmul_flops_per_chip': result['matmul_flops_per_chip'],
      'wall_seconds': time.perf_counter() - start,
    }


def scheduler_share(flags: list[str], remat: str) -> int | None:
  """The scheduler share a plan of `flags` under `remat` compiles with: the one given, else
  the planner's default for the remat (`candidates.default_scheduler_share`)."""
  if '--scheduler-share' in flags:
    given = flags[flags.index('--scheduler-share') + 1]
    return None if given == 'compiler' else int(given)
  return candidates.default_scheduler_share(remat, flags[flags.index('--topology') + 1])


def plan_or_reuse(flags: list[str], remat: str, old: dict | None) -> dict:
  """`plan(flags, remat)`, or `old` where it is the same command compiled the same way
  (`--reuse`): lean or not as `candidates.LEAN_REMATS` now says (a record from before the
  rule counting as not lean), at the scheduler share the planner now gives it."""
  said = command(flags, remat)[-80:]
  if (
    old
    and old['command'] == command(flags, remat)
    and old.get('lean', False) == candidates.lean(remat)
    and old.get('scheduler_share') == scheduler_share(flags, remat)
  ):
    print(f'  {said}: reusing the committed plan', flush=True)
    return old
  p = plan(flags, remat)
  print(f'  {said}: peak {p["peak_gib"]:.2f} GiB, device space'
        f' {p["device_space_gib"]:.2f} GiB, step {p["predicted_step_seconds"]:.2f} s', flush=True)  # fmt: skip
  return p


def searched_policies(out: str, tag: str) -> dict[str, str]:
  """The policy `bench_recompute.py`'s search picked for each v5e row with this compiler, where
  its results are in `out` (their memory is planned too)."""
  path = os.path.join(out, f'recompute_v5e.{tag}.json')
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {r['row']: r['searched']['remat'] for r in json.load(f)['rows'] if r['searched']}


def _share_name(share: str) -> str:
  return "the compiler's" if share == 'compiler' else f'{share}%'


def _share(row: dict, share: str) -> str:
  """A row's `full` at another scheduler share, as the table gives it."""
  p = row['scheduler_shares'].get(share)
  return '—' if p is None else f'{p["device_space_gib"]:.2f} ({p["predicted_step_seconds"]:.2f} s)'


def table(out: str) -> list[str]:
  """Every compiler's rows in `out`."""
  lines = [
    "Memory at MaxText's settings (full rematerialisation, its attention), per chip"
    " (`benchmarks/bench_memory.py`). Device space: the compiler's buffer assignment for"
    " HBM, fragmentation included, host buffers not. MaxText's peak: its own program's, compiled"
    " by MaxText (`bench_maxtext_program.py`; the 70B at the plan's settings), '—' on a compiler"
    " MaxText does not run with. Host link: 32 GB/s assumed (v5e's is not published)."
    f' `full` is the default plan: lean, the latency-hiding scheduler held to'
    f' {candidates.LEAN_SHARE}% of HBM; the last columns compile it with the scheduler at the'
    " compiler's own share and at "
    + ', '.join(f'{n}%' for n in SCHEDULER_SHARES[1:])
    + ' (`--scheduler-share`): device space GiB (predicted step s).',
    '',
    '| row | compiler | MaxText peak GiB | full: peak GiB | full: device space GiB |'
    ' offload_layer_inputs: device space GiB | host GB/step | step full s | step offloaded s |'
    ' searched policy | searched: device space GiB | searched step s |'
    + ''.join(f' full, scheduler at {_share_name(n)} |' for n in SCHEDULER_SHARES),
    '|---|---|---|---|---|---|---|---|---|---|---|---|' + '---|' * len(SCHEDULER_SHARES),
  ]
  for name in sorted(os.listdir(out)):
    if not (name.startswith('memory_v5e.libtpu-') and name.endswith('.json')):
      continue
    with open(os.path.join(out, name)) as f:
      run = json.load(f)
    compiled = maxtext_table.programs(out, run['versions']['libtpu'], 'v5e')
    for r in run['rows']:
      full, off = r['plans']['full'], r['plans']['offload_layer_inputs']
      peak = maxtext_table.peak_gib(compiled.get(r['row'].split(' ')[0]))
      maxtext = '—' if peak is None else f'{peak:.2f}'
      won = r.get('searched') and r['plans'].get(r['searched'])
      searched = (
        f'{r["searched"]} | {won["device_space_gib"]:.2f} | {won["predicted_step_seconds"]:.2f}'
        if won
        else '— | — | —'
      )
      lines.append(
        f'| {r["row"]}{model_revision.mark(run, r)} | {run["versions"]["libtpu"]} | {maxtext} |'
        f' {full["peak_gib"]:.2f} |'
        f' {full["device_space_gib"]:.2f} | {off["device_space_gib"]:.2f} |'
        f' {off["host_bytes_per_step"] / 1e9:.1f} | {full["predicted_step_seconds"]:.2f} |'
        f' {off["predicted_step_seconds"]:.2f} | {searched} |'
        + ''.join(f' {_share(r, n)} |' for n in SCHEDULER_SHARES)
      )
  return (
    lines + ['', *v5p_table(out)] + model_revision.note(out, ('memory_v5e.libtpu-',), marked=True)
  )


def v5p_table(out: str) -> list[str]:
  """MaxText's v5p rows, default plan against the scheduler held back, every compiler."""
  lines = [
    f"MaxText's v5p rows (`--remat minimal`, 95 GiB a chip): the committed default plan"
    f' (bench_maxtext.py) against the same plan with `--scheduler-share {V5P_HELD_SHARE}`.',
    '',
    '| row | compiler | default: peak GiB | default step s | held: peak GiB | held step s |'
    ' held / default step |',
    '|---|---|---|---|---|---|---|',
  ]
  for name in sorted(os.listdir(out)):
    if not (name.startswith('memory_v5e.libtpu-') and name.endswith('.json')):
      continue
    with open(os.path.join(out, name)) as f:
      run = json.load(f)
    for r in run.get('v5p', []):
      held = r['held']
      lines.append(
        f'| {r["row"]}{model_revision.mark(run, r)} | {run["versions"]["libtpu"]} |'
        f' {r["default_peak_gib"]:.2f} |'
        f' {r["default_step_seconds"]:.2f} | {held["peak_gib"]:.2f} |'
        f' {held["predicted_step_seconds"]:.2f} |'
        f' {held["predicted_step_seconds"] / r["default_step_seconds"]:.3f} |'
      )
  return lines


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', default=None, help='comma-separated row names (default: all)')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  parser.add_argument(
    '--reuse', action='store_true', help="reuse a plan already in --out's JSON (same command)"
  )
  args = parser.parse_args()
  every = rows()
  names = sorted({r[1] for r in every})
  wanted = args.rows.split(',') if args.rows else names
  unknown = sorted(set(wanted) - set(names))
  if unknown:
    parser.error(f'--rows: no row {unknown}; the rows are {names}')
  import jax
  import libtpu

  tag = compiler_tag()
  path = os.path.join(args.out, f'memory_v5e.{tag}.json')
  before, before_v5p = {}, []
  if os.path.exists(path):
    with open(path) as f:
      committed = json.load(f)
    before = {r['row']: r for r in committed['rows']}
    before_v5p = committed.get('v5p', [])
  # --reuse keeps only what was compiled from the presets as they are (their revision).
  reusable = {n: r for n, r in before.items() if model_revision.current(r)}
  reusable_v5p = {r['row']: r['held'] for r in before_v5p if model_revision.current(r)}
  winners = searched_policies(args.out, tag)
  results = []
  for name, family, flags in every:
    if family not in wanted:
      continue
    print(f'planning {name} with {tag} ...', flush=True)
    remats = [*REMATS, *([winners[name]] if winners.get(name) not in (None, *REMATS) else [])]
    reuse = reusable.get(name, {}) if args.reuse else {}
    plans = {m: plan_or_reuse(flags, m, reuse.get('plans', {}).get(m)) for m in remats}
    shares = {
      share: plan_or_reuse(
        [*flags, '--scheduler-share', share], 'full', reuse.get('scheduler_shares', {}).get(share)
      )
      for share in SCHEDULER_SHARES
    }
    results.append({
      'row': name, 'searched': winners.get(name),
      'plans': plans, 'scheduler_shares': shares, 'model_revision': presets.MODEL_REVISION,
    })  # fmt: skip
  versions = {'jax': jax.__version__, 'libtpu': getattr(libtpu, '__version__', '?')}
  os.makedirs(args.out, exist_ok=True)
  if args.rows:
    # Planning some rows again keeps this compiler's others, in the rows' order.
    kept = {**before, **{r['row']: r for r in results}}
    results = [kept[name] for name, _, _ in every if name in kept]
  if args.rows:
    v5p = before_v5p
  else:
    print(f'planning the v5p rows with {tag} ...', flush=True)
    v5p = v5p_held(args.out, tag, reusable_v5p, args.reuse)
    v5p = [{**r, 'model_revision': presets.MODEL_REVISION} for r in v5p]
  # Rows kept from an earlier run (--rows) keep their revision; the run's is the oldest.
  versions['model_revision'] = min(r.get('model_revision', 1) for r in [*results, *v5p])
  with open(path, 'w') as f:
    json.dump({'versions': versions, 'rows': results, 'v5p': v5p}, f, indent=2)
  lines = table(args.out)
  with open(os.path.join(args.out, 'memory_v5e.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
