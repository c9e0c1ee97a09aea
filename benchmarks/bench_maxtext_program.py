"""MaxText's own programs for its published rows, compiled by MaxText and priced by zerojax's model.

For each of MaxText's published TPU rows (v5e-256: 16B, 32B and 64B at 6, 4 and 2 sequences
per chip; v5p: 32B, 64B, 128B and 256B; and llama2-70b at the README plan's settings, one
sequence per chip on v5e-256 with full rematerialisation), this runs MaxText's own
ahead-of-time compiler (`maxtext.trainers.pre_train.train_compile`, MaxText 0.2.5 from PyPI,
pinned in `benchmarks/maxtext-requirements.txt`) on the arguments of MaxText's own run script
for that row (`maxtext/configs/tpu/<chip>/<model>.sh`, read from the installed package: its
`base.yml` overrides and its `LIBTPU_INIT_ARGS`), for the row's topology, then applies to the
compiled program the analysis zerojax gives its own candidates (`search.price_program`: the
compiler's memory figures, the collectives, the kernels' work and the host transfers counted
in the optimized HLO, and the step predicted by the same step-time model).

MaxText needs Python >= 3.12 and jax >= 0.11.1, so this runs in the newest CI end's root:

    tools/maxtext-root python benchmarks/bench_maxtext_program.py [--chip v5e] [--rows 32B]

What it changes in MaxText to run, none of which alters the compiled program:
- `base_output_directory` is a temporary folder (the scripts write to a bucket), and
  `gcs_metrics=false` (metrics are uploaded to a bucket while training, not compiled);
- `tokenizer_path` (llama2-70b's script) points at the tokenizer inside the installed package
  (the synthetic data set never reads it);
- `per_device_batch_size` is the published table's where the script's differs (v5p 32B: the
  table's 7, the script's 6), so that both sides run the same global batch;
- llama2-70b takes `remat_policy=full` and `per_device_batch_size=1` (its v5e script runs 2 with
  `qkv_proj_offloaded`; the comparison is with the README's 70B plan, which runs 1 with full);
- the compiled program is taken from `train_compile.jit_and_compile`, wrapped to keep what it
  returns (MaxText prints the program's memory and cost analysis but does not return it).

And one that does, where the compiler leaves no choice: a libtpu flag of the script that libtpu
refuses for the chip (FAILED_PRECONDITION, "Please disable it with NAME=false") is set as it asks
and the row compiled again in a new process, and every other row of that chip with it; the
record names the flag and what libtpu said. On v5p, libtpu 0.0.50 refuses the scripts'
`--xla_tpu_enable_async_collective_fusion=true` ("Continuation fusion for AllGather ... is not
supported/recommended on platforms other than TPU v5e"). A row whose program does not fit HBM is
recorded as such, with what the compiler needed.

Writes, per compiler (`--out`, default benchmarks/results):
- maxtext_program.libtpu-V.json: per row, the MaxText command, the compiler's memory figures,
  the step's figures and the predicted step by part, MaxText's model FLOPs and the TFLOP/s
  predicted for its program;
- maxtext_program_ROW.libtpu-V.hlo.gz: the program's optimized HLO, so that the figures can be
  priced again without MaxText (tests/test_maxtext_program.py does);
- maxtext_program.md: MaxText's programs against zerojax's default and searched plans of the
  same rows on the same compiler (bench_memory.py's and bench_recompute.py's results in --out).

`--sparsecore` compiles the v5p rows again with zerojax's SparseCore collective options
(`candidates.SPARSECORE_OPTIONS`, which a v5p plan search tries) added to each script's flags,
and writes maxtext_program.sparsecore.libtpu-V.json and its programs beside the others: not
MaxText's published setting (only its 32B script sets one of them), but what the same options
would give MaxText's own program, so that a ratio that rests on them can be read against it.

Each row is compiled in its own process (libtpu reads its flags once per process): about half
a minute per row on a 2-core machine. `--reprice` prices the committed programs again with this
checkout's model where the model changed (no MaxText needed; `tools/regenerate_tpu_results.py`
runs it for the compiler the programs were made with).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_maxtext import ROWS, V5E_ROWS, chip_count, compiler_tag, maxtext_flops  # noqa: E402

GiB = 2**30
OUTPUT = 'base_output_directory='


@dataclasses.dataclass(frozen=True)
class Row:
  """One of MaxText's rows: its script and what this benchmark sets beside it."""

  name: str
  chip: str  # 'v5e' or 'v5p'
  script: str  # under maxtext/configs/tpu/
  topology: str  # MaxText's compile_topology: '<chip>-<TensorCores>'
  zerojax_topology: str  # the same slice as zerojax names it
  batch: int  # sequences per chip, the published table's
  overrides: tuple[tuple[str, str], ...] = ()  # beyond the batch (documented above)
  published: float | None = None  # MaxText's measured TFLOP/s per chip
  dims: tuple[int, int, int, int] | None = None  # width, heads, MLP, layers (MaxText's FLOPs)


def maxtext_topology(topology: str) -> str:
  """MaxText's name for a zerojax slice: 'v5e:16x16' -> 'v5e-256', 'v5p:4x4x4' -> 'v5p-128'
  (v5p counts TensorCores, two a chip)."""
  chip = topology.split(':')[0]
  cores = chip_count(topology) * (2 if chip == 'v5p' else 1)
  return f'{chip}-{cores}'


def rows() -> list[Row]:
  """Every row this compiles, in the order of its results."""
  out = []
  for chip, table in (('v5e', V5E_ROWS), ('v5p', ROWS)):
    for name, width, heads, mlp, layers, topology, _, batch, published in table:
      script = name.split('-')[0].lower() + '.sh'
      out.append(
        Row(
          name=f'{chip} {name}',
          chip=chip,
          script=f'{chip}/{script}',
          topology=maxtext_topology(topology),
          zerojax_topology=topology,
          batch=batch,
          published=published,
          dims=(width, heads, mlp, layers),
        )
      )
  # MaxText's v5p 32B script runs 6 sequences per chip where its table publishes 7.
  width, heads, mlp, layers, topology = ROWS[0][1:6]
  out.append(
    Row(
      name='v5p 32B-b6',
      chip='v5p',
      script='v5p/32b.sh',
      topology=maxtext_topology(topology),
      zerojax_topology=topology,
      batch=6,
      dims=(width, heads, mlp, layers),
    )
  )
  out.append(
    Row(
      name='v5e llama2-70b',
      chip='v5e',
      script='v5e/llama2_70b.sh',
      topology='v5e-256',
      zerojax_topology='v5e:16x16',
      batch=1,
      overrides=(('remat_policy', 'full'),),
    )
  )
  return out


def read_script(path: str) -> tuple[list[str], str]:
  """(the `key=value` arguments after base.yml, LIBTPU_INIT_ARGS) of one MaxText run script."""
  with open(path) as f:
    text = f.read()
  flags = re.search(r'^export LIBTPU_INIT_ARGS="([^"]*)"', text, re.M)
  call = re.search(
    r'^python3 -m maxtext\.trainers\.pre_train\.\$EXECUTABLE (.*?[^\\])$', text, re.M | re.S
  )
  if flags is None or call is None:
    raise ValueError(
      f'{path}: no LIBTPU_INIT_ARGS export or train call found; has its form changed?'
    )
  words = shlex.split(call.group(1).replace('\\\n', ' '), posix=False)
  args = [w for w in words[1:] if '=' in w]  # words[0] is the path of base.yml
  return args, flags.group(1)


def command(row: Row, package: str, output_dir: str) -> tuple[list[str], str]:
  """MaxText's arguments for `row` (its script's, with the changes the module docstring lists)
  and its LIBTPU_INIT_ARGS."""
  args, flags = read_script(os.path.join(package, 'configs', 'tpu', row.script))
  values = dict(a.split('=', 1) for a in args)
  values['base_output_directory'] = output_dir
  if 'gcs_metrics' in values:
    values['gcs_metrics'] = 'false'
  if 'tokenizer_path' in values:
    values['tokenizer_path'] = os.path.join(package, 'assets', 'tokenizers', 'tokenizer.llama2')
  values['per_device_batch_size'] = str(row.batch)
  values.update(row.overrides)
  values.update(
    compile_topology=row.topology, compile_topology_num_slices='1', run_name='zerojax-bench'
  )
  out = [f'{k}={v.strip(chr(39))}' for k, v in values.items()]
  return [os.path.join(package, 'configs', 'base.yml'), *out], flags


def with_flags(flags: str, changed: dict[str, str]) -> str:
  """LIBTPU_INIT_ARGS `flags` with each of `changed` set to its value."""
  kept = [f for f in flags.split() if f.lstrip('-').split('=')[0] not in changed]
  return ' '.join(kept + [f'--{k}={v}' for k, v in changed.items()])


# libtpu refusing one of a script's flags for the chip (FAILED_PRECONDITION), and the setting
# it asks for instead.
REFUSED_FLAG = re.compile(r'Please disable it with (\w+)=(false|true)')


def compile_row(row: Row, out: str, tag: str, changed: dict[str, str]) -> dict:
  """Compiles `row` with MaxText in this process and prices its program (run by --one), with
  the libtpu flags `changed` set as libtpu asked."""
  import maxtext

  package = os.path.dirname(maxtext.__file__)
  with tempfile.TemporaryDirectory() as tmp:
    argv, flags = command(row, package, tmp)
    flags = with_flags(flags, changed)
    os.environ['LIBTPU_INIT_ARGS'] = flags  # MaxText's script exports it before running
    from maxtext.trainers.pre_train import train_compile

    kept = {}
    original = train_compile.jit_and_compile

    def keep(*args, **kwargs):
      kept['compiled'] = original(*args, **kwargs)
      return kept['compiled']

    train_compile.jit_and_compile = keep
    start = time.perf_counter()
    try:
      train_compile.main(['train_compile', *argv])
    except Exception as e:  # MaxText's own program does not fit: that is the row's result
      from zerojax._src import runtime

      refused = REFUSED_FLAG.search(str(e))
      if refused:  # run again in a new process, the flag set as libtpu asks
        return dict(row=row.name, status='refused flag', flag=refused.groups(), message=str(e))
      if not runtime.is_out_of_memory(e):
        raise
      refusal = runtime.OutOfMemory.parse(str(e))
      rec = record(row, argv, flags, time.perf_counter() - start, None, None)
      rec.update(status='over HBM: ' + refusal.summary(), needed_gigabytes=refusal.needed_gigabytes)
      return rec
    seconds = time.perf_counter() - start
  compiled = kept['compiled']
  text = compiled.as_text()
  with gzip.open(hlo_path(out, row, tag), 'wt') as f:
    f.write(text)

  from zerojax._src.planner import report as report_lib

  memory = report_lib.memory_stats(compiled)
  return record(row, argv, flags, seconds, memory, price(row, memory, text))


def price(row: Row, memory, text: str):
  """`row`'s program priced by zerojax's analysis for its chip (`search.price_program`)."""
  from zerojax._src.planner import roofline, search

  return search.price_program(roofline.CHIPS[row.chip], memory, text)


def reprice(out: str, tag: str) -> int:
  """Prices the committed programs of compiler `tag` again with this checkout's model (no
  MaxText needed: the HLO and the compiler's memory figures are committed) and rewrites their
  figures; the number of programs priced."""
  from zerojax._src.planner import report as report_lib

  path = os.path.join(out, f'maxtext_program.{tag}.json')
  with open(path) as f:
    run = json.load(f)
  by_name = {r.name: r for r in rows()}
  count = 0
  for i, rec in enumerate(run['rows']):
    if rec['status'] != 'fits':
      continue
    row = by_name[rec['row']]
    with gzip.open(hlo_path(out, row, tag), 'rt') as f:
      text = f.read()
    memory = report_lib.MemoryStats(**rec['memory'])
    priced = price(row, memory, text)
    fresh = record(
      row, ['base.yml'], rec['libtpu_init_args'], rec['compile_seconds'], memory, priced
    )
    keep = ('maxtext_args', 'libtpu_flags_changed', 'compile_seconds')
    run['rows'][i] = {**fresh, **{k: rec[k] for k in keep if k in rec}}
    count += 1
  with open(path, 'w') as f:
    json.dump(run, f, indent=1)
    f.write('\n')
  return count


def record(row: Row, argv, flags, seconds, memory, priced) -> dict:
  """A row's JSON record: MaxText's command and its program's figures (None where MaxText's
  program did not fit: then only the command)."""
  model = maxtext_flops(*row.dims, row.batch) if row.dims else None
  head = dict(
    row=row.name,
    chip=row.chip,
    topology=row.topology,
    zerojax_topology=row.zerojax_topology,
    batch_per_chip=row.batch,
    script=f'maxtext/configs/tpu/{row.script}',
    maxtext_args=[
      'base.yml',
      *(a.split('=')[0] + '=<a temporary folder>' if a.startswith(OUTPUT) else a for a in argv[1:]),
    ],
    libtpu_init_args=flags,
    compile_seconds=round(seconds, 1),
    published_tflops=row.published,
    model_flops=model,
  )
  if priced is None:
    return head
  step = priced.predicted.step
  return dict(
    head,
    status='fits',
    memory=dataclasses.asdict(memory),
    peak_bytes=memory.peak,
    peak_source=memory.source,
    step=dataclasses.asdict(priced.step),
    predicted=dataclasses.asdict(priced.predicted),
    host_traffic=dataclasses.asdict(priced.host_traffic),
    step_seconds=step,
    # What the HLO does not determine (MaxText's splash attention kernels state no cost: their
    # time is a lower bound, so is the step's).
    uncertain=list(priced.work.uncertain),
    unpriced_kernels=priced.work.unpriced_kernels,
    unpriced_seconds=priced.work.unpriced_seconds,
    predicted_tflops=model / step / 1e12 if model else None,
    executed_over_model=priced.step.flops / model if model else None,
  )


def hlo_path(out: str, row: Row, tag: str) -> str:
  return os.path.join(out, f'maxtext_program_{row.name.replace(" ", "_")}.{tag}.hlo.gz')


def versions() -> dict:
  names = ('maxtext', 'jax', 'jaxlib', 'libtpu', 'flax')
  return {n: importlib.metadata.version(n) for n in names}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--chip', choices=('v5e', 'v5p'), help='only this chip family (default: both)')
  p.add_argument('--rows', help='comma-separated row names within the chip (e.g. 32B,llama2-70b)')
  p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results'))
  p.add_argument('--one', help=argparse.SUPPRESS)  # compile one row in this process
  p.add_argument('--flag', action='append', default=[], help=argparse.SUPPRESS)  # NAME=VALUE
  p.add_argument('--table', action='store_true', help='only write maxtext_program.md')
  p.add_argument(
    '--sparsecore',
    action='store_true',
    help="compile the v5p rows with zerojax's SparseCore collective options added to the"
    " script's flags (candidates.SPARSECORE_OPTIONS): what MaxText's own program gains from"
    ' them, beside the results (maxtext_program.sparsecore.libtpu-V.json)',
  )
  p.add_argument(
    '--reprice',
    action='store_true',
    help="price the committed programs of the installed libtpu's compiler again with this"
    " checkout's model (no MaxText needed), then write maxtext_program.md",
  )
  args = p.parse_args()
  tag = variant_tag(args.sparsecore)
  if args.one:
    row = next(r for r in rows() if r.name == args.one)
    changed = dict(f.split('=', 1) for f in args.flag)
    print(json.dumps(compile_row(row, args.out, tag, changed)), file=sys.stdout)
    return 0
  if args.reprice:
    print(f'priced {reprice(args.out, tag)} programs of {tag} again', flush=True)
  elif not args.table:
    run(args)
  import maxtext_table

  maxtext_table.write(args.out)
  return 0


def variant_tag(sparsecore: bool) -> str:
  """The tag of the programs' files: the compiler's ('libtpu-0.0.50'), after 'sparsecore.'
  for the programs compiled with the SparseCore collective options."""
  return ('sparsecore.' if sparsecore else '') + compiler_tag()


def sparsecore_flags() -> dict[str, str]:
  """zerojax's SparseCore collective options as libtpu flags (`--sparsecore`)."""
  from zerojax._src.planner import candidates

  return {k: str(v).lower() for k, v in candidates.SPARSECORE_OPTIONS.items()}


def compile_in_child(row: Row, out: str, changed: dict[str, str], sparsecore: bool) -> dict:
  """`row` compiled by MaxText in a new process (libtpu reads its flags once per process), again
  with each flag libtpu refuses for the chip set as it asks (added to `changed`)."""
  reasons = []
  given = sparsecore_flags() if sparsecore else {}
  while True:
    child = subprocess.run(
      [sys.executable, __file__, '--one', row.name, '--out', out]
      + ['--sparsecore'] * sparsecore
      + [f'--flag={k}={v}' for k, v in {**given, **changed}.items()],
      capture_output=True,
      text=True,
    )
    if child.returncode:
      sys.stderr.write(child.stderr[-4000:])
      raise SystemExit(f'{row.name}: MaxText failed to compile (exit {child.returncode})')
    rec = json.loads(child.stdout.strip().splitlines()[-1])
    if rec['status'] != 'refused flag':
      rec['libtpu_flags_changed'] = dict(changed=dict(changed), libtpu_said=reasons)
      return rec
    name, value = rec['flag']
    if name in changed:
      raise SystemExit(f'{row.name}: libtpu refuses {name}={value} again: {rec["message"]}')
    print(f"  libtpu refuses the script's {name} on this chip; again with {name}={value}")
    changed[name] = value
    reasons.append(rec['message'].split('\n')[0])


def run(args) -> None:
  wanted = args.rows.split(',') if args.rows else None
  chosen = [
    r
    for r in rows()
    if (args.chip in (None, r.chip))
    and (wanted is None or r.name.split(' ', 1)[1] in wanted)
    and (r.chip == 'v5p' or not args.sparsecore)  # v5e has no SparseCores
  ]
  if not chosen:
    raise SystemExit(f'no row matches --chip {args.chip} --rows {args.rows}')
  tag = variant_tag(args.sparsecore)
  path = os.path.join(args.out, f'maxtext_program.{tag}.json')
  done = {}
  if os.path.exists(path):
    with open(path) as f:
      done = {r['row']: r for r in json.load(f)['rows']}
  # libtpu flags a chip refused (set as libtpu asked), for every row of that chip: a row
  # compiled before one was learned is compiled again with it.
  learned: dict[str, dict[str, str]] = {}
  queue = list(chosen)
  while queue:
    row = queue.pop(0)
    print(f'[{row.name}] MaxText train_compile for {row.topology}', flush=True)
    done[row.name] = rec = compile_in_child(
      row, args.out, learned.setdefault(row.chip, {}), args.sparsecore
    )
    queue += [
      r
      for r in chosen
      if r.chip == row.chip
      and r not in queue
      and r.name in done
      and done[r.name].get('libtpu_flags_changed', {}).get('changed') != learned[row.chip]
    ]
    if rec['status'] == 'fits':
      print(
        f'  peak {rec["peak_bytes"] / GiB:.2f} GiB, predicted step {rec["step_seconds"]:.2f} s'
        f' ({rec["compile_seconds"]:.0f} s to compile)',
        flush=True,
      )
    else:
      print(f'  {rec["status"]} ({rec["compile_seconds"]:.0f} s to compile)', flush=True)
    order = [r.name for r in rows()]
    payload = dict(
      versions=versions(),
      rows=sorted(done.values(), key=lambda r: order.index(r['row'])),
    )
    with open(path, 'w') as f:
      json.dump(payload, f, indent=1)
      f.write('\n')


if __name__ == '__main__':
  sys.exit(main())
