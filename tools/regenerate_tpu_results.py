"""Regenerates every committed TPU result for the installed jax and libtpu, in order.

    python tools/regenerate_tpu_results.py [--list] [--from N] [--only N,M] [--no-cache] [--resume]
    python tools/regenerate_tpu_results.py --tables

A change to what the planner compiles (the presets' model, a default option) moves the figures
of every result under benchmarks/results that carries `libtpu-VERSION` in its name. This runs,
one after the other, the benchmark scripts that write them and the recorded `command:` of each
committed plan and search, for the libtpu installed beside this jax (run it once per supported
end: this machine's Python for libtpu 0.0.42, `tools/newest-jax`'s root for 0.0.50). The steps
are numbered; `--from N` resumes after an interruption, `--only N,M` runs those steps in that
order, `--list` prints them and what each writes. The searches of MaxText's rows save row by
row; `--resume` skips the rows already compiled at the presets' model revision. Each step's
output and time go to the terminal; a failed step stops the run with its number, so that
`--from` starts there again.

Each benchmark also rewrites the table (.md) the compilers share from the runs beside it. When
the two ends run in separate checkouts, copy one's versioned files into the other and run
`--tables` there: it rewrites every shared table from all the committed runs, compiling nothing.

Compiling takes hours on a 2-core machine (the v5e-256 programs about a minute and a half each,
the searches tens of them). Programs already compiled are read back from the planner's cache
(`~/.cache/zerojax/programs`) unless `--no-cache` is given, which the plans and searches then
pass on. Afterwards, `tests/test_docs.py` names each figure the documents quote that moved.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join('benchmarks', 'results')
BENCHMARKS = os.path.join(ROOT, 'benchmarks')  # the scripts, here even where ROOT is moved


@dataclasses.dataclass(frozen=True)
class Step:
  """Commands (each an argv and the file its printed output goes to, or None), the committed
  files (globs under benchmarks/results) they write, and files they write under another name,
  moved to the committed one afterwards ((written, committed) paths from the repository root).
  `resumable`: its script saves row by row and takes --resume (skip the rows already current)."""

  name: str
  runs: tuple[tuple[tuple[str, ...], str | None], ...]
  writes: tuple[str, ...]
  moves: tuple[tuple[str, str], ...] = ()
  resumable: bool = False


def libtpu_version() -> str:
  """'0.0.42' for libtpu 0.0.42.1, as the results' names carry it."""
  try:
    version = importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    raise SystemExit(
      "error: libtpu is not installed; install the tpu extra (pip install '.[tpu]')."
    ) from None
  return '.'.join(version.split('.')[:3])


def _bench(name: str, script: str, writes: tuple[str, ...], *flags: str) -> Step:
  argv = (sys.executable, os.path.join('benchmarks', script), *flags)
  return Step(name, ((argv, None),), writes, resumable=script == 'bench_recompute.py')


def _zerojax(command: str, path: str) -> tuple[str, ...]:
  """The argv of a recorded `python -m zerojax ...` command, run by this Python."""
  argv = shlex.split(command)
  if argv[:3] != ['python', '-m', 'zerojax']:
    raise SystemExit(f'error: {path} records {command!r}, not a zerojax command.')
  return (sys.executable, *argv[1:])


def _recorded(version: str, prefix: str) -> list[Step]:
  """The committed plans (prefix 'plan_') or searches ('search_') of libtpu `version`, each
  made again by the commands it records: a plan's report (.txt) is the printed output of the
  command its first line gives, its JSON written by the command the JSON records; a search
  writes all three of its files (--out), named without the libtpu version, which are then moved
  to the committed names."""
  steps = []
  for path in sorted(glob.glob(os.path.join(ROOT, RESULTS, f'{prefix}*.libtpu-{version}.json'))):
    with open(path) as f:
      runs = [(_zerojax(json.load(f)['command'], path), None)]
    stem = os.path.basename(path)[: -len('.json')]
    if prefix == 'plan_':
      txt = os.path.join(RESULTS, stem + '.txt')
      with open(os.path.join(ROOT, txt)) as f:
        first = f.readline()
      if not first.startswith('command: '):
        raise SystemExit(f'error: {txt} does not begin with the command that wrote it.')
      runs.insert(0, (_zerojax(first[len('command: ') :].strip(), txt), txt))
    moves = ()
    if prefix == 'search_':  # --out names a search by its model and topology only
      written = stem[: -len(f'.libtpu-{version}')]
      moves = tuple(
        (os.path.join(RESULTS, f'{written}.{ext}'), os.path.join(RESULTS, f'{stem}.{ext}'))
        for ext in ('txt', 'json', 'png')
      )
    steps.append(Step(stem, tuple(runs), (f'{stem}.*',), moves))
  return steps


def _maxtext_programs(version: str) -> list[Step]:
  """MaxText's own programs, where they were compiled with this compiler: priced again by this
  checkout's model from their committed HLO (compiling them again needs MaxText, beside the
  newest end: `tools/maxtext-root python benchmarks/bench_maxtext_program.py`)."""
  if not os.path.exists(os.path.join(ROOT, RESULTS, f'maxtext_program.libtpu-{version}.json')):
    return []
  writes = (f'maxtext_program.libtpu-{version}.json', f'maxtext_program_*.libtpu-{version}.hlo.gz')
  found = [
    _bench('MaxText programs, priced again', 'bench_maxtext_program.py', writes, '--reprice')
  ]
  sparse = f'maxtext_program.sparsecore.libtpu-{version}.json'
  if os.path.exists(os.path.join(ROOT, RESULTS, sparse)):  # compiled with --sparsecore
    found.append(
      _bench(
        'MaxText programs with the SparseCore options, priced again',
        'bench_maxtext_program.py',
        (sparse, f'maxtext_program_*.sparsecore.libtpu-{version}.hlo.gz'),
        '--reprice',
        '--sparsecore',
      )
    )
  return found


def steps(version: str) -> list[Step]:
  """Every step, in the order their inputs need: bench_memory reads the v5p plans that
  bench_maxtext writes."""
  v = version
  return [
    _bench(
      'bench_maxtext v5p',
      'bench_maxtext.py',
      (
        f'maxtext_v5p.libtpu-{v}.json',
        f'maxtext_v5p_[0-9]*B.libtpu-{v}.*',
        f'maxtext_v5p_128B-512.libtpu-{v}.*',
      ),
    ),
    _bench(
      'bench_maxtext v5p, 2 slices',
      'bench_maxtext.py',
      (f'maxtext_v5p_slices.libtpu-{v}.json', f'maxtext_v5p_*_2slices.libtpu-{v}.*'),
      '--slices',
      '2',
    ),
    _bench(
      'bench_maxtext v5e',
      'bench_maxtext.py',
      (f'maxtext_v5e.libtpu-{v}.json', f'maxtext_v5e_[0-9]*B.libtpu-{v}.*'),
      '--chip',
      'v5e',
    ),
    _bench(
      'bench_maxtext v5e, 2-32 slices',
      'bench_maxtext.py',
      (f'maxtext_v5e_slices.libtpu-{v}.json', f'maxtext_v5e_*slices.libtpu-{v}.*'),
      '--chip',
      'v5e',
      '--slices',
      '2,4,8,16,32',
    ),
    _bench('bench_recompute v5e', 'bench_recompute.py', (f'recompute_v5e.libtpu-{v}.json',)),
    _bench(
      'bench_recompute v5p',
      'bench_recompute.py',
      (f'recompute_v5p.libtpu-{v}.json',),
      '--chip',
      'v5p',
    ),
    _bench('bench_memory', 'bench_memory.py', (f'memory_v5e.libtpu-{v}.json',)),
    _bench('bench_one_chip', 'bench_one_chip.py', (f'one_chip.libtpu-{v}.json',)),
    *_maxtext_programs(version),
    *_recorded(version, 'plan_'),
    *_recorded(version, 'search_'),
  ]


def uncovered(version: str) -> list[str]:
  """The committed results of libtpu `version` that no step writes."""
  committed = set(glob.glob(os.path.join(ROOT, RESULTS, f'*.libtpu-{version}.*')))
  for step in steps(version):
    for pattern in step.writes:
      committed -= set(glob.glob(os.path.join(ROOT, RESULTS, pattern)))
  return sorted(os.path.relpath(p, ROOT) for p in committed)


def rewrite_tables() -> list[str]:
  """Writes each table under benchmarks/results that the compilers' runs share, from every
  committed run beside it (no compiling); the paths written, from the repository root."""
  if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
  import bench_maxtext
  import bench_memory
  import bench_one_chip
  import bench_recompute
  import maxtext_table

  out = os.path.join(ROOT, RESULTS)
  tables = {}
  for chip in ('v5p', 'v5e'):
    tables[f'maxtext_{chip}.md'] = bench_maxtext.table(out, chip)
    tables[f'maxtext_{chip}_slices.md'] = bench_maxtext.scaling_table(out, chip)
    tables[f'recompute_{chip}.md'] = bench_recompute.table(out, chip)
  tables['memory_v5e.md'] = bench_memory.table(out)
  tables['one_chip.md'] = bench_one_chip.markdown(out).splitlines()
  tables['maxtext_program.md'] = maxtext_table.table(out)
  for name, lines in tables.items():
    with open(os.path.join(out, name), 'w') as f:
      f.write('\n'.join(lines) + '\n')
  return [os.path.join(RESULTS, name) for name in tables]


def run(step: Step, no_cache: bool, resume: bool = False) -> float:
  """Runs one step's commands from the repository root; its time in seconds. `no_cache`
  compiles afresh in the step's first zerojax command (the others read its programs back);
  `resume` passes --resume to the scripts that save row by row (`Step.resumable`)."""
  start = time.perf_counter()
  for i, (argv, stdout_to) in enumerate(step.runs):
    argv = [*argv, '--no-cache'] if no_cache and i == 0 and argv[1:3] == ('-m', 'zerojax') else argv
    if resume and step.resumable:
      argv = [*argv, '--resume']
    if stdout_to is None:
      proc = subprocess.run(argv, cwd=ROOT)
    else:  # the committed report is replaced only by a whole one
      partial = os.path.join(ROOT, stdout_to + '.partial')
      with open(partial, 'w') as out:
        proc = subprocess.run(argv, cwd=ROOT, stdout=out)
      if not proc.returncode:
        os.replace(partial, os.path.join(ROOT, stdout_to))
    if proc.returncode:
      raise RuntimeError(f'{shlex.join(argv[1:])} exited with status {proc.returncode}')
  for written, committed in step.moves:
    os.replace(os.path.join(ROOT, written), os.path.join(ROOT, committed))
  return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--list', action='store_true', help='print the steps and what each writes')
  parser.add_argument('--from', dest='first', type=int, default=1, help='start at step N')
  parser.add_argument(
    '--only', default=None, help='comma-separated step numbers, run in that order'
  )
  parser.add_argument('--no-cache', action='store_true', help='compile every program afresh')
  parser.add_argument(
    '--resume',
    action='store_true',
    help="the searches of MaxText's rows skip the rows already at the presets' model revision",
  )
  parser.add_argument(
    '--tables', action='store_true', help='only rewrite the shared tables from the committed runs'
  )
  args = parser.parse_args(argv)
  if args.tables:
    for path in rewrite_tables():
      print(f'wrote {path}')
    return 0
  version = libtpu_version()
  todo = list(enumerate(steps(version), 1))
  missing = uncovered(version)
  if missing:
    raise SystemExit(f'error: no step writes these committed results: {missing}')
  if args.list:
    for n, step in todo:
      print(f'{n:2d}. {step.name} (writes {", ".join(step.writes)})')
      for argv, stdout_to in step.runs:
        print(f'    python {shlex.join(argv[1:])}' + (f' > {stdout_to}' if stdout_to else ''))
    return 0
  todo = [(n, s) for n, s in todo if n >= args.first]
  if args.only:  # in the order given, so that what is needed first runs first
    numbered = dict(todo)
    try:
      only = [int(n) for n in args.only.split(',')]
    except ValueError:
      parser.error(f'--only {args.only}: give step numbers separated by commas (--only 10,1,2).')
    unknown = [n for n in only if n not in numbered]
    if unknown:
      parser.error(f'--only: no step {unknown} from step {args.first} on; --list numbers them.')
    todo = [(n, numbered[n]) for n in dict.fromkeys(only)]
  start = time.perf_counter()
  for i, (n, step) in enumerate(todo, 1):
    print(
      f'[{time.perf_counter() - start:7.0f}s] step {n} ({i} of {len(todo)}): {step.name}',
      flush=True,
    )
    try:
      seconds = run(step, args.no_cache, args.resume)
    except RuntimeError as e:
      print(f'step {n} ({step.name}) failed: {e}; resume with --from {n}', file=sys.stderr)
      return 1
    print(f'[{time.perf_counter() - start:7.0f}s] step {n} done in {seconds:.0f} s', flush=True)
  print(f'libtpu {version}: {len(todo)} steps in {time.perf_counter() - start:.0f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
