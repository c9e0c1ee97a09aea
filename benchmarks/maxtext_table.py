"""MaxText's own programs against zerojax's plans of the same rows on the same compiler.

Reads the committed results in a folder (no MaxText, no compiling):
- maxtext_program.libtpu-V.json (`bench_maxtext_program.py`: MaxText's programs, compiled by
  MaxText, priced by zerojax's model);
- recompute_v5e / recompute_v5p .libtpu-V.json (`bench_recompute.py`: zerojax's default and
  searched plans of MaxText's published rows);
- memory_v5e.libtpu-V.json (`bench_memory.py`: the device's share of HBM of the searched v5e
  plans, and the llama2-70b plan);

and writes maxtext_program.md: per compiler MaxText reached, one row per published row, with
the ratios the project claims (MaxText's predicted step over zerojax's; above 1, zerojax is
faster). `python benchmarks/maxtext_table.py [--out benchmarks/results]`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

GiB = 2**30
HOST_SHARES = ('1.0', '0.5')  # the host link at the chip table's bandwidth, then at half


def _load(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _version(path: str) -> str:
  """'0.0.50' of '.../maxtext_program.libtpu-0.0.50.json'."""
  return os.path.basename(path).split('.libtpu-')[1].removesuffix('.json')


def programs(out: str, libtpu: str, chip: str) -> dict[str, dict]:
  """MaxText's compiled programs of `chip`'s rows in `out` for the compiler `libtpu` ('0.0.50.1'
  or '0.0.50'), by zerojax's row name ('32B', 'llama2-70b'): {} where MaxText did not reach
  that compiler (it needs jax >= 0.11.1)."""
  short = '.'.join(libtpu.split('.')[:3])
  path = os.path.join(out, f'maxtext_program.libtpu-{short}.json')
  if not os.path.exists(path):
    return {}
  return {r['row'].split(' ', 1)[1]: r for r in _load(path)['rows'] if r['chip'] == chip}


def peak_gib(program: dict | None) -> float | None:
  """A compiled MaxText program's peak in GiB (None: none compiled, or it did not fit)."""
  return program['peak_bytes'] / GiB if program and 'peak_bytes' in program else None


def comparisons(out: str) -> list[dict]:
  """One record per MaxText row compiled in `out`, beside zerojax's plans of that row on the
  same compiler (where `out` holds them)."""
  records = []
  for path in sorted(glob.glob(os.path.join(out, 'maxtext_program.libtpu-*.json'))):
    version = _version(path)
    program = _load(path)
    zerojax = {}
    for chip in ('v5e', 'v5p'):
      found = os.path.join(out, f'recompute_{chip}.libtpu-{version}.json')
      if os.path.exists(found):
        zerojax.update({f'{chip} {r["row"]}': r for r in _load(found)['rows']})
    memory = {}
    found = os.path.join(out, f'memory_v5e.libtpu-{version}.json')
    if os.path.exists(found):
      memory = {f'v5e {r["row"]}': r for r in _load(found)['rows']}
    sparsecore = {}
    found = os.path.join(out, f'maxtext_program.sparsecore.libtpu-{version}.json')
    if os.path.exists(found):
      sparsecore = {r['row']: r for r in _load(found)['rows']}
    for m in program['rows']:
      rec = _compare(program['versions'], m, zerojax, memory)
      _with_sparsecore(rec, sparsecore.get(m['row']))
      records.append(rec)
  return records


def _with_sparsecore(rec: dict, program: dict | None) -> None:
  """Adds to `rec` MaxText's program compiled with the SparseCore collective options
  (`bench_maxtext_program.py --sparsecore`), and the searched plan's step against it."""
  if program is None:
    return
  rec['maxtext_sparsecore_status'] = program['status']
  step = rec['maxtext_sparsecore_step'] = program.get('step_seconds')
  if step is not None and 'searched_step' in rec:
    rec['searched_vs_maxtext_sparsecore'] = step / rec['searched_step_at']['1.0']


def _compare(versions: dict, m: dict, zerojax: dict, memory: dict) -> dict:
  rec = dict(
    row=m['row'],
    compiler=versions['libtpu'],
    maxtext=versions['maxtext'],
    batch_per_chip=m['batch_per_chip'],
    published_tflops=m['published_tflops'],
    maxtext_status=m['status'],
    maxtext_step=m.get('step_seconds'),
    maxtext_peak_gib=m['peak_bytes'] / GiB if 'peak_bytes' in m else None,
    maxtext_executed_over_model=m.get('executed_over_model'),
    maxtext_needed_gigabytes=m.get('needed_gigabytes'),
  )
  z = zerojax.get(m['row'])
  if m['row'] == 'v5e llama2-70b':  # the README's 70B plan: one default plan, flash attention
    full = memory.get('v5e llama2-70b flash', {}).get('plans', {}).get('full')
    if full:
      rec.update(default_step=full['predicted_step_seconds'], default_peak_gib=full['peak_gib'])
  elif z is not None and z['batch_per_chip'] == m['batch_per_chip']:
    d, s = z['default'], z['searched']
    # bench_memory plans v5e rows, whose searches have no tensor axis: keyed by the remat.
    device = memory.get(m['row'], {}).get('plans', {}).get(s['remat'], {}).get('device_space_gib')
    rec.update(
      default_remat=d['remat'],
      default_step=d['predicted_step_seconds'],
      default_peak_gib=d['peak_gib'],
      default_executed_over_model=d['executed_over_model'],
      searched_remat=policy_name(s),
      candidates=len(z['candidates']),
      searched_step=s['predicted_step_seconds'],
      searched_step_at=s['step_at_host_share'],
      searched_peak_gib=device if device is not None else s['peak_gib'],
      searched_peak_is_device=device is not None or s['peak_reported'],
      searched_executed_over_model=s['executed_over_model'],
      searched_host_gb=s['host_bytes_per_step'] / 1e9,
      # The search's pick were the host link at half: the fastest fitting candidate then.
      best_at_half=min(
        (c for c in z['candidates'] if c.get('fits')),
        key=lambda c: c['step_at_host_share']['0.5'],
      ),
    )
  step = rec['maxtext_step']
  if step is not None and 'searched_step' in rec:
    rec['searched_vs_maxtext'] = {k: step / rec['searched_step_at'][k] for k in HOST_SHARES}
    best = rec['best_at_half']
    rec['best_at_half_vs_maxtext'] = (policy_name(best), step / best['step_at_host_share']['0.5'])
  if step is not None and 'default_step' in rec:
    rec['default_vs_maxtext'] = step / rec['default_step']
  return rec


def policy_name(figures: dict) -> str:
  """A searched candidate's name: its remat, and its tensor axis where the search tried one
  (records from before that: the remat)."""
  return figures.get('policy', figures['remat'])


def _f(x, fmt: str = '.2f', suffix: str = '') -> str:
  return '—' if x is None else f'{x:{fmt}}{suffix}'


def table(out: str) -> list[str]:
  """maxtext_program.md's lines."""
  lines = [
    "MaxText's own programs (MaxText's `train_compile` on its published scripts,"
    " `benchmarks/bench_maxtext_program.py`) against zerojax's plans of the same rows, on the"
    ' same compiler, every step predicted by the same model (not measured). "vs MaxText" is'
    " MaxText's predicted step over zerojax's (above 1: zerojax is faster); the searched plan's"
    " at the host link the chip table assumes, then at half of it, then the search's pick were"
    " the link at half. Peaks are the compiler's, per chip; * is a peak with host memory in"
    " it (the program holds host buffers; the device's share is not reported). MaxText's steps"
    ' are lower bounds: its splash attention kernels state no cost, so the model charges them'
    " their bytes at HBM bandwidth and none of their FLOPs (each record's `uncertain`). MaxText needs"
    " jax >= 0.11.1, so only the newest CI end's compiler is reached. The last two columns:"
    " MaxText's program compiled with the SparseCore collective options a v5p search tries"
    " (`bench_maxtext_program.py --sparsecore`; not MaxText's published setting), and the"
    ' searched plan against it.',
    '',
    '| row | compiler | batch/chip | published TFLOP/s | MaxText: step s | MaxText: peak GiB |'
    ' MaxText: executed/model | zerojax default: step s | default: peak GiB |'
    ' default: executed/model | default vs MaxText |'
    ' searched policy (of candidates) | searched step s | searched peak GiB |'
    ' searched executed/model | host GB/step | searched vs MaxText | at 1/2 host link |'
    ' search at 1/2 host link | MaxText + SparseCore options: step s | searched vs that |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in comparisons(out):
    if r['maxtext_status'] != 'fits':
      maxtext = [f'does not fit ({r["maxtext_status"].removeprefix("over HBM: ")})', '—', '—']
    else:
      maxtext = [
        _f(r['maxtext_step']),
        _f(r['maxtext_peak_gib']),
        _f(r['maxtext_executed_over_model']),
      ]
    searched = ['—'] * 8
    if 'searched_step' in r:
      vs = r.get('searched_vs_maxtext')
      best = r.get('best_at_half_vs_maxtext')
      searched = [
        f'{r["searched_remat"]} (of {r["candidates"]})',
        _f(r['searched_step']),
        _f(r['searched_peak_gib']) + ('' if r['searched_peak_is_device'] else '*'),
        _f(r['searched_executed_over_model']),
        _f(r['searched_host_gb'], '.1f'),
        _f(vs and vs['1.0'], '.2f', 'x'),
        _f(vs and vs['0.5'], '.2f', 'x'),
        f'{best[0]}, {best[1]:.2f}x' if best else '—',
      ]
    cells = [
      r['row'],
      r['compiler'],
      str(r['batch_per_chip']),
      _f(r['published_tflops'], '.0f'),
      *maxtext,
      _f(r.get('default_step')),
      _f(r.get('default_peak_gib')),
      _f(r.get('default_executed_over_model')),
      _f(r.get('default_vs_maxtext'), '.2f', 'x'),
      *searched,
      *_sparsecore_cells(r),
    ]
    lines.append('| ' + ' | '.join(cells) + ' |')
  import model_revision

  versions = [_version(p) for p in glob.glob(os.path.join(out, 'maxtext_program.libtpu-*.json'))]
  ours = tuple(
    f'{k}.libtpu-{v}.' for v in versions for k in ('recompute_v5e', 'recompute_v5p', 'memory_v5e')
  )
  return lines + model_revision.note(out, ours)


def summary(out: str) -> list[str]:
  """The README's small table of the claims: per row, MaxText's predicted step, the searched
  plan's, their ratio (also with the host link at half: the search's pick then), and the
  default plan's ratio. The full table is `table`'s (docs/results.md)."""
  lines = [
    '| row | MaxText step s | zerojax searched s | vs MaxText | at 1/2 host link | default plan |',
    '|---|---|---|---|---|---|',
  ]
  for r in comparisons(out):
    if r['row'].endswith('-b6'):  # the v5p script's own batch: no zerojax plan of it
      continue
    fits = r['maxtext_status'] == 'fits'
    best = r.get('best_at_half_vs_maxtext')
    vs = r.get('searched_vs_maxtext')
    cells = [
      r['row'],
      _f(r['maxtext_step']) if fits else 'does not fit',
      _f(r.get('searched_step')),
      _f(vs and vs['1.0'], '.2f', 'x'),
      _f(best and best[1], '.2f', 'x'),
      _f(r.get('default_vs_maxtext'), '.2f', 'x'),
    ]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


def _sparsecore_cells(r: dict) -> list[str]:
  if 'maxtext_sparsecore_status' not in r:
    return ['—', '—']
  if r['maxtext_sparsecore_step'] is None:
    return ['does not fit', '—']
  return [_f(r['maxtext_sparsecore_step']), _f(r.get('searched_vs_maxtext_sparsecore'), '.2f', 'x')]


def write(out: str) -> str:
  """Writes maxtext_program.md in `out` and returns its path."""
  path = os.path.join(out, 'maxtext_program.md')
  with open(path, 'w') as f:
    f.write('\n'.join(table(out)) + '\n')
  return path


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  print(open(write(p.parse_args().out)).read())
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
