"""The docstring examples run, and the README's main job runs."""

import doctest
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zerojax

ROOT = Path(__file__).resolve().parent.parent


def _modules():
  import zerojax._src as src

  return [m.name for m in pkgutil.walk_packages(src.__path__, 'zerojax._src.')]


@pytest.mark.parametrize('name', _modules())
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0


def test_every_public_name_is_documented():
  for name in zerojax.__all__:
    obj = getattr(zerojax, name)
    assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name


@pytest.mark.slow
def test_demo_runs_and_matches_formula(tmp_path):
  # As `make demo` runs it, with XLA's default flags (no faked-device flag, and none of the
  # suite's code-generation level: the demo prints a zero loss difference between stages for
  # the code XLA generates by default).
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run(
    [sys.executable, str(ROOT / 'examples' / 'demo.py'), '--steps', '6', '--out', str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = proc.stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if line.split()[:3] == ['stage', 'final', 'loss'])
  table = [line.split() for line in lines[start + 1 : start + 5]]
  assert [row[0] for row in table] == ['0', '1', '2', '3']
  assert all(row[4] == 'yes' for row in table)  # at rest == formula
  # The loss is the same under every stage.
  assert len({row[1] for row in table}) == 1
  assert 'largest loss difference between stages: 0.00e+00' in proc.stdout
  # The picture is drawn from the numbers printed (and saved beside it).
  import json

  saved = json.loads((tmp_path / 'zero_stages.json').read_text())['stages']
  for row, record in zip(table, saved):
    assert row[2] == f'{record["at_rest"] / 2**20:.2f}'
    assert row[5] == f'{record["grads"] / 2**20:.2f}'
    assert row[6] == f'{record["temp"] / 2**20:.2f}'
  # What separates stages 1 and 2 shows: the gradients they hold.
  assert saved[1]['at_rest'] == saved[2]['at_rest'] and saved[2]['grads'] * 8 == saved[1]['grads']
  assert (tmp_path / 'zero_stages.png').stat().st_size > 10_000


def _json(name):
  import json

  return json.loads((ROOT / 'benchmarks' / 'results' / name).read_text())


def _search_figures():
  """The sentences of docs/results.md about the committed plan searches (libtpu 0.0.42's)."""
  import re

  gib = 2**30
  seven = _json('search_llama2-7b_v5e-2x4.libtpu-0.0.42.json')
  win7 = seven['results'][0]
  refused7 = min(
    float(m.group(1))
    for r in seven['results']
    if (m := re.search(r'need[s]? ([\d.]+)G', r['status']))
  )
  big = _json('search_llama2-70b_v5e-16x16.libtpu-0.0.42.json')
  win70 = big['results'][0]
  p70 = win70['predicted_seconds']
  plan32 = _json('plan_llama2-70b_v5e-4x8.libtpu-0.0.42.json')
  t32, p32 = plan32['host_traffic'], plan32['predicted_seconds']
  cpu = _json('search_tiny_cpu-8.json')
  ratios = [r['predicted_seconds']['step'] / r['measured_seconds'] for r in cpu['results']]
  slice64 = _json('search_llama2-70b_v5e-8x8.libtpu-0.0.42.json')
  win64 = slice64['results'][0]
  assert win64['fits'] and not win64['peak_reported']  # holds host memory: the compiler's word
  progs = lambda d: (
    f'{d["programs"]["compiled"]} programs compiled, {d["programs"]["cache"]} read back from the'
    ' cache'
  )
  return [
    ('docs/results.md', f'{len(cpu["results"])} candidates): predicted / measured step time'),
    ('docs/results.md', f'step time {min(ratios):.2f}–{max(ratios):.2f}.'),
    (
      'docs/results.md',
      f'{len(seven["results"])} candidates in {seven["search_seconds"] / 60:.1f} minutes'
      f' ({progs(seven)})',
    ),
    ('docs/results.md', f'(at best {refused7:.2f}G needed of the 15.75G usable)'),
    (
      'docs/results.md',
      f'(`{win7["label"]}`): {win7["peak_bytes"] / gib:.2f} GiB'
      f' peak{"" if win7["peak_reported"] else "*"},'
      f' {win7["ring_bytes"] / win7["floor_bytes"]:.2f}× the floor, predicted'
      f' {win7["predicted_seconds"]["step"]:.2f} s per step',
    ),
    (
      'docs/results.md',
      f'{len(big["results"])} candidates in {big["search_seconds"] / 60:.1f} minutes'
      f' ({progs(big)})',
    ),
    (
      'docs/results.md',
      f'stage 3 over the torus axes, {win70["ring_bytes"] / win70["floor_bytes"]:.3f}× the floor,'
      f' {win70["peak_bytes"] / gib:.2f} GiB peak,'
      f' {100 * win70["overlapped_ring_bytes"] / win70["ring_bytes"]:.0f}% of the ring bytes'
      f' overlapped; predicted {p70["step"]:.2f} s per step, of which {p70["compute"]:.2f} s is'
      f" the kernels at the compiler's estimates ({win70['flops'] / 1e12:,.0f} TFLOP per chip)",
    ),
    (
      'docs/results.md',
      f'{plan32["memory"]["peak"] / gib:.2f} GiB peak,'
      f' {plan32["plan_bytes_per_chip"]["host"] / gib:.2f} GiB of fp32 master',
    ),
    (
      'docs/results.md',
      f'{t32["to_host"] / 1e9:.2f} GB down and {t32["to_device"] / 1e9:.2f} GB back over the host',
    ),
    (
      'docs/results.md',
      f'bf16 parameter shards and {t32["to_device"] - plan32["plan_bytes_per_chip"]["params"]}'
      f' bytes of scalars; {100 * t32["in_loops"] / t32["to_host"]:.0f}% of what goes down',
    ),
    (
      'docs/results.md',
      f'{p32["step"]:.2f} s per step, of which {p32["host_exposed"]:.2f} s is host transfer not'
      f' overlapped, at an assumed {plan32["roofline"]["host_link_bandwidth"] / 1e9:.0f} GB/s',
    ),
    (
      'docs/results.md',
      f'fits at {win64["peak_bytes"] / gib:.2f} GiB peak with {win64["host_bytes"] / gib:.2f} GiB'
      f' of optimizer state per chip in host memory (of 64 GiB), predicted'
      f' {win64["predicted_seconds"]["step"]:.2f} s per step',
    ),
  ]


def _figures():
  """(document, the sentence as the document must print it) from committed results."""
  plan = _json('plan_llama2-70b_v5e-16x16.libtpu-0.0.42.json')
  peak = plan['memory']['peak'] / 2**30
  ring = sum(plan['collectives']['ring_bytes'].values())
  ratio = ring / plan['zero_floor_bytes']
  overlap = sum(plan['collectives']['overlapped_ring_bytes'].values()) / ring
  pre = _json('plan_llama2-70b_v5e-16x16_prefetch.libtpu-0.0.42.json')
  pre_ring = sum(pre['collectives']['ring_bytes'].values())
  pre_overlap = sum(pre['collectives']['overlapped_ring_bytes'].values()) / pre_ring
  v5p = _json('plan_llama2-70b_v5p-4x4x4_chunked.libtpu-0.0.42.json')
  v5p_ring = sum(v5p['collectives']['ring_bytes'].values())
  v5p_ratio = v5p_ring / v5p['zero_floor_bytes']
  chunked = _json('plan_llama2-70b_v5e-16x16_chunked.libtpu-0.0.42.json')
  ch_ring = sum(chunked['collectives']['ring_bytes'].values())
  ch_gathered = chunked['collectives']['ring_bytes']['all-gather']
  ch_over = chunked['collectives']['overlapped_ring_bytes']
  flat = _json('plan_llama2-70b_v5e-16x16_flat.libtpu-0.0.42.json')
  flat_ratio = sum(flat['collectives']['ring_bytes'].values()) / flat['zero_floor_bytes']
  offload = {
    (r['stage'], r['offload'], r['update_on']): r for r in _json('offload_v5e-2x4.json')['rows']
  }
  decoder = {
    r['update_on']: r
    for r in _json('offload_v5e-2x4.json')['decoder_rows']
    if r['offload'] == 'opt_state+master'
  }
  cpu = _json('bench_cpu8.json')
  psi, mib = cpu['model']['params'], 2**20
  streamed = [
    offload[(3, o, 'device')]['peak_vs_no_offload'] for o in ('opt_state', 'opt_state+master')
  ]
  host_master = [offload[(s, 'opt_state', 'host')]['peak_vs_no_offload'] for s in (1, 2, 3)]
  demo = _json('demo_cpu8.json')
  gptq = json.loads((ROOT / 'examples' / 'results' / 'gpt_quantized.json').read_text())['runs']
  held = [r['heldout_loss'] for r in gptq]
  ring_q = [r['ring_bytes_vs_full_precision'] for r in gptq]
  q8, q4 = (
    cpu['ratios'][f'zerojax-3 value_and_grad {f} ring bytes vs docs-shard_map']
    for f in ('int8', 'int4')
  )
  t8, t4 = (
    cpu['ratios'][f'zerojax-3 value_and_grad {f} time vs docs-shard_map (paired median)']
    for f in ('int8', 'int4')
  )
  paths = cpu['paths']
  full, vag = paths['zerojax-3 full-remat'], paths['zerojax-3 value_and_grad']
  row = lambda name: (
    f'| {paths[name]["time vs docs-shard_map (paired median)"]:.2f}× recipe'
    f' | {paths[name]["temp vs docs-shard_map"]:.2f}× recipe |'
  )
  path_rows = [
    ('docs/results.md', row(name))
    for name in ('zerojax-3 value_and_grad', 'zerojax-3 full-remat', 'zerojax-3 jax.grad')
    + ('zerojax-3 scan_layers',)
  ]
  s2 = paths['zerojax-2 value_and_grad']
  path_rows = _search_figures() + path_rows
  return path_rows + [
    (
      'docs/results.md',
      f'takes {full["time vs maxtext-shaped (paired median)"]:.2f}× its step time (paired median),'
      f' {full["peak vs maxtext-shaped"]:.2f}× its peak and {full["ring vs maxtext-shaped"]:.2f}×'
      ' its traffic',
    ),
    (
      'docs/results.md',
      f'{vag["time vs maxtext-shaped (paired median)"]:.2f}× the time and'
      f' {vag["ring vs maxtext-shaped"]:.2f}× the traffic for {vag["peak vs maxtext-shaped"]:.2f}×'
      ' its peak',
    ),
    (
      'docs/results.md',
      f'| {s2["ring vs docs-shard_map"]:.2f}× the stage-3 traffic |'
      f' {cpu["results"]["zerojax-2 value_and_grad"]["temp_bytes"] / mib:.2f} MiB |',
    ),
    (
      'docs/results.md',
      f'{cpu["results"]["zerojax-3 value_and_grad"]["matmuls"]} matmuls against'
      f' {cpu["results"]["maxtext-shaped"]["matmuls"]})',
    ),
    (
      'docs/results.md',
      f'held-out loss {held[1]:.4f} with int8 weights and gradients and {held[2]:.4f} with int4'
      f' gradients, against {held[0]:.4f} in full precision'
      f' ({100 * (held[1] / held[0] - 1):+.2f}%, {100 * (held[2] / held[0] - 1):+.1f}%), with'
      f' {ring_q[1]:.3f}× and {ring_q[2]:.3f}× the collective bytes',
    ),
    ('docs/results.md', f'{q8:.3f}× (int8) and {q4:.3f}× (int4) the ring'),
    ('docs/results.md', f'the step is {t8:.2f}× and {t4:.2f}× slower'),
    ('README.md', f"({demo['wall_seconds']:.0f} s on this project's 2-core machine"),
    (
      'docs/results.md',
      f'runs for {plan["phase_seconds"]["total"]:.1f} s'
      + (
        ' with its program read back from the cache'
        if plan['program_source'] == 'cache'
        else ', compile included'
      ),
    ),
    ('docs/results.md', f'needs {peak:.2f} GiB of the 16 GiB per chip'),
    ('docs/results.md', f'move {ratio:.2f}× the 3Ψ(N−1)/N floor'),
    ('docs/results.md', f'{100 * overlap:.0f}% of the bytes overlapping'),
    ('docs/results.md', f'the same step moves {flat_ratio:.2f}× the floor'),
    (
      'docs/results.md',
      f'{100 * pre_overlap:.0f}% of the bytes then overlap compute, for'
      f' {pre["memory"]["peak"] / 2**30:.2f} GiB per chip',
    ),
    (
      'docs/results.md',
      f'the step then needs {chunked["memory"]["peak"] / 2**30:.2f} GiB per chip at'
      f' {ch_ring / chunked["zero_floor_bytes"]:.3f}× the floor',
    ),
    (
      'docs/results.md',
      f'{100 * sum(ch_over.values()) / ch_ring:.0f}% of the bytes overlap compute'
      f' ({100 * ch_over["all-gather"] / ch_gathered:.0f}% of the gathered ones)',
    ),
    (
      'docs/design.md',
      f'moves {v5p_ratio:.3f}× the floor at {v5p["memory"]["peak"] / 2**30:.2f} GiB per chip, but'
      f" every collective of the compiler's default program is synchronous"
      f' ({100 * sum(v5p["collectives"]["overlapped_ring_bytes"].values()) / v5p_ring:.0f}% overlap)',
    ),
    ('docs/design.md', f'the 70B step moves {ratio:.3f}× the floor'),
    ('docs/design.md', f'and needs {peak:.2f} GiB per chip'),
    (
      'docs/design.md',
      f'(`benchmarks/results/plan_llama2-70b_v5e-16x16_flat.libtpu-0.0.42.txt`: {flat_ratio:.2f}×',
    ),
    (
      'docs/results.md',
      f'lowers the stage-3 peak from {offload[(3, None, "device")]["peak_bytes"] / mib:.1f} to'
      f' {offload[(3, "opt_state+master", "host")]["peak_bytes"] / mib:.1f} MiB'
      f' ({offload[(3, "opt_state+master", "host")]["peak_vs_no_offload"]:.2f}×; stages 1–2:'
      f' {offload[(1, "opt_state+master", "host")]["peak_vs_no_offload"]:.2f}×)',
    ),
    (
      'docs/results.md',
      f'is {decoder["stream"]["peak_vs_no_offload"]:.2f}× that without offload, against'
      f' {decoder["host"]["peak_vs_no_offload"]:.2f}× updating on the host; the host link carries'
      f' {decoder["stream"]["to_host"] / 1e6:.2f} MB down and'
      f' {decoder["stream"]["to_device"] / 1e6:.2f} MB back per step (host update:'
      f' {decoder["host"]["to_host"] / 1e6:.2f} MB and {decoder["host"]["to_device"] / 1e6:.2f} MB)',
    ),
    ('benchmarks/README.md', f'Ψ = {psi:,} fp32 parameters'),
    ('benchmarks/README.md', f'2Ψ(N−1)/N = {2 * psi * 4 * 7 / 8 / mib:.2f} MiB'),
    ('benchmarks/README.md', f'3Ψ(N−1)/N = {3 * psi * 4 * 7 / 8 / mib:.2f} MiB'),
    (
      'benchmarks/README.md',
      f'{cpu["results"]["docs-shard_map"]["ring_bytes"] / mib:.2f} MiB, 24 matmuls',
    ),
    (
      'docs/results.md',
      f'takes {cpu["ratios"]["stage3 time vs docs-shard_map (paired median)"]:.2f}× the step time',
    ),
    (
      'docs/results.md',
      f'same peak memory ({cpu["ratios"]["stage3 peak vs docs-shard_map"]:.2f}×) and the same'
      f' traffic ({cpu["ratios"]["stage3 ring bytes vs docs-shard_map"]:.2f}×',
    ),
    (
      'benchmarks/README.md',
      f'({cpu["results"]["docs-gspmd"]["ring_bytes"] / mib:.2f} MiB,'
      f' {cpu["results"]["docs-gspmd"]["ring_vs_floor"]:.2f}× the floor)',
    ),
    (
      'benchmarks/README.md',
      f'({cpu["results"]["zerojax-2 value_and_grad"]["temp_bytes"] / mib:.2f} MiB against'
      f' {cpu["results"]["zerojax-2 jax.grad"]["temp_bytes"] / mib:.2f} MiB',
    ),
    (
      'benchmarks/README.md',
      f'by design ({cpu["results"]["zerojax-1 value_and_grad"]["temp_bytes"] / mib:.2f} MiB)',
    ),
    (
      'benchmarks/README.md',
      f'({offload[(3, "opt_state", "device")]["device_argument_drop"] / mib:.2f} MiB of moments,'
      f' {offload[(3, "opt_state+master", "device")]["device_argument_drop"] / mib:.2f} MiB with',
    ),
    ('benchmarks/README.md', f'(stage 3: {min(streamed):.2f}–{max(streamed):.2f}×'),
    ('benchmarks/README.md', f'({min(host_master):.2f}–{max(host_master):.2f}×)'),
  ]


@pytest.mark.parametrize('document, sentence', _figures())
def test_figures_in_the_docs_come_from_committed_results(document, sentence):
  text = ' '.join((ROOT / document).read_text().split())
  assert sentence in text


# Design notes that lived outside the repository; the project cites docs/design.md.
OLD_NOTES = 'DESIGN' + '.md'


def test_docs_cite_the_projects_own_design_notes():
  for path in [
    ROOT / 'README.md',
    ROOT / 'CONTRIBUTING.md',
    *(ROOT / 'docs').glob('*.md'),
    ROOT / 'benchmarks' / 'README.md',
    ROOT / 'CHANGELOG.md',
  ]:
    assert OLD_NOTES not in path.read_text(), path
  for folder in ('zerojax', 'tests', 'examples', 'benchmarks'):
    for path in (ROOT / folder).rglob('*.py'):
      assert OLD_NOTES not in path.read_text(), path
  assert (ROOT / 'docs' / 'design.md').is_file()


def test_no_private_module_imports_the_top_level_package():
  # zerojax/__init__.py imports zerojax/_src; the reverse would be a cycle.
  offenders = []
  for path in (ROOT / 'zerojax' / '_src').rglob('*.py'):
    for number, line in enumerate(path.read_text().splitlines(), 1):
      code = line.strip()
      if code.startswith('>>>'):
        continue  # doctests use the public package, as users do
      if code == 'import zerojax' or code.startswith('from zerojax import'):
        offenders.append(f'{path.name}:{number}')
  assert offenders == []


def _src_imports() -> dict[str, set[str]]:
  """Which zerojax._src modules each one imports, anywhere in its code (ast, not text), by their
  names below zerojax._src ('grad', 'planner.search')."""
  import ast

  src = ROOT / 'zerojax' / '_src'
  name = lambda path: '.'.join(path.relative_to(src).with_suffix('').parts)
  names = {name(p) for p in src.rglob('*.py') if p.stem != '__init__'}
  graph = {}
  for path in src.rglob('*.py'):
    if path.stem == '__init__':
      continue
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module in (
        'zerojax._src',
        'zerojax._src.planner',
      ):
        prefix = node.module.removeprefix('zerojax._src').lstrip('.')
        found |= {f'{prefix}.{a.name}'.lstrip('.') for a in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('zerojax._src.'):
        found.add(node.module.removeprefix('zerojax._src.'))
    graph[name(path)] = found & names - {name(path)}
  return graph


def test_the_library_never_imports_the_planner():
  """The planner (zerojax/_src/planner/) uses the library; no library module imports it."""
  graph = _src_imports()
  planner = {m for m in graph if m.startswith('planner.')}
  assert len(planner) >= 10
  offenders = {m: sorted(d & planner) for m, d in graph.items() if m not in planner and d & planner}
  assert offenders == {}


def test_rich_is_imported_only_where_the_planner_draws():
  import ast

  importers = set()
  for path in (ROOT / 'zerojax').rglob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
      modules += [node.module or ''] if isinstance(node, ast.ImportFrom) else []
      if any(m == 'rich' or m.startswith('rich.') for m in modules):
        importers.add(str(path.relative_to(ROOT)))
  assert importers == {'zerojax/_src/planner/display.py'}


def test_private_modules_import_each_other_without_cycles():
  graph, cycles = _src_imports(), []

  def visit(name, trail):
    if name in trail:
      cycles.append(' -> '.join(trail[trail.index(name) :] + [name]))
      return
    for other in sorted(graph[name]):
      visit(other, trail + [name])

  for name in sorted(graph):
    visit(name, [])
  assert cycles == []


def _body_lines(node) -> int:
  """Lines of a function's body, its docstring aside."""
  import ast

  body = node.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    body = body[1:]
  return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_no_function_in_the_library_is_over_60_lines_or_packed_to_fit():
  import ast

  long = []
  for path in sorted((ROOT / 'zerojax').rglob('*.py')):
    text = path.read_text()
    assert 'fmt: ' + 'skip' not in text, path
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60:
        long.append(f'{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_body_lines(node)})')
  assert long == []


def test_no_attribute_is_set_on_a_function_and_no_global_is_keyed_by_id():
  """The library's data travels as data: no `fn.attr = ...` on a function it made, and no
  module-level table keyed by `id()`."""
  import ast

  for path in sorted((ROOT / 'zerojax').rglob('*.py')):
    tree = ast.parse(path.read_text())
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Assign):
        for target in node.targets:
          if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            assert target.value.id not in functions, (path, target.value.id, target.attr)
      if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'id':
        raise AssertionError(f'{path.relative_to(ROOT)}:{node.lineno} calls id()')


def test_the_readme_is_short_and_every_guide_it_links_exists():
  import re

  text = (ROOT / 'README.md').read_text()
  assert len(text.splitlines()) <= 300
  links = re.findall(r'\]\(((?:docs/)?[\w-]+\.md)(?:#[\w-]*)?\)', text)
  assert {'docs/training.md', 'docs/checkpoints.md', 'docs/multi-host.md'} <= set(links)
  assert {'docs/planner.md', 'docs/results.md', 'docs/design.md', 'CONTRIBUTING.md'} <= set(links)
  for link in links:
    assert (ROOT / link).is_file(), link


def test_the_readme_reads_in_one_screen_width():
  # Tables included: a row a newcomer must scroll sideways to read belongs in docs/results.md.
  text = (ROOT / 'README.md').read_text()
  wide = [(n, len(line)) for n, line in enumerate(text.splitlines(), 1) if len(line) > 110]
  assert not wide, wide
  section = text[text.index("## Against MaxText's") : text.index('## Where to go next')]
  assert len(section.splitlines()) <= 36


def test_the_top_level_is_what_the_readme_documents():
  # The README's API table lists every top-level name, and nothing else is exported.
  import re

  text = (ROOT / 'README.md').read_text()
  table = text[text.index('## API') : text.index('Submodules, imported on first use')]
  documented = set(re.findall(r'`(\w+)`', table))
  assert documented == set(zerojax.__all__)
  assert len(zerojax.__all__) <= 21
  for name in zerojax.SUBMODULES:
    assert f'`zerojax.{name}`' in text


def test_every_moved_name_says_where_it_went_and_the_changelog_lists_it():
  changelog = (ROOT / 'CHANGELOG.md').read_text()
  for old, new in zerojax.MOVED.items():
    with pytest.raises(AttributeError) as e:
      getattr(zerojax, old)
    assert str(e.value) == (
      f'zerojax.{old} is gone since zerojax 0.2: use {new} (see the migration table in'
      ' CHANGELOG.md).'
    )
    assert f'| `zerojax.{old}` | `{new}` |' in changelog


def test_import_zerojax_loads_neither_flax_nor_orbax():
  code = (
    'import sys, zerojax\n'
    'print(sorted(m for m in ("flax", "orbax", "orbax.checkpoint") if m in sys.modules))\n'
  )
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == '[]'


def test_the_committed_70b_plan_on_32_chips_holds_what_issue_27_asks():
  """`benchmarks/results/plan_llama2-70b_v5e-4x8.*`: llama2-70b (AdamW, fp32 master and moments
  in host memory, bf16 compute, 1x2048 tokens per chip) on v5e:4x8 within the compiler's 15.75
  GiB and 64 GiB of host memory per chip; its command on a line of its own; only the bf16
  parameter shards come back from the host, the layer gradients go down from inside the loop;
  and the plan is the paired compiler's (libtpu 0.0.42)."""
  import shlex

  plan = _json('plan_llama2-70b_v5e-4x8.libtpu-0.0.42.json')
  text = (ROOT / 'benchmarks' / 'results' / 'plan_llama2-70b_v5e-4x8.libtpu-0.0.42.txt').read_text()
  (line,) = [x for x in text.splitlines() if x.startswith('command: python -m zerojax plan')]
  assert line + ' --json benchmarks/results/plan_llama2-70b_v5e-4x8.libtpu-0.0.42.json' == (
    f'command: {plan["command"]}'
  )
  words = shlex.split(plan['command'])
  for flag, value in [('--model', 'llama2-70b'), ('--topology', 'v5e:4x8'), ('--stage', '3'),
                      ('--offload', 'opt_state+master'), ('--update-on', 'stream'),
                      ('--seq-len', '2048')]:  # fmt: skip
    assert words[words.index(flag) + 1] == value
  assert '--mixed-precision' in words
  assert plan['num_params'] == 68_976_648_192 and plan['batch_per_chip'] >= 1
  assert plan['memory']['peak'] <= 15.75 * 2**30
  assert plan['plan_bytes_per_chip']['host'] <= plan['host_limit_bytes'] == 64 * 2**30
  traffic = plan['host_traffic']
  assert traffic['source'] == 'hlo'
  assert 0 <= traffic['to_device'] - plan['plan_bytes_per_chip']['params'] <= 64
  assert traffic['in_loops'] >= 0.9 * traffic['to_host']
  assert plan['predicted_seconds']['host'] > 0


def test_the_streamed_70b_plan_with_chunked_attention_is_committed_for_both_compilers():
  """`plan_llama2-70b_v5e-4x8_chunked.libtpu-*`: the streamed 4x8 plan with attention 512
  queries at a time, on each paired compiler: the same command plus `--attention-chunk 512`, a
  lower peak than the plain one, and the ring bytes docs/results.md quotes (1.006x the floor,
  the compiler's re-gathers of the key and value weights, which the `_noregather` plan's
  compiler option removes)."""
  floor_ratio = lambda p: sum(p['collectives']['ring_bytes'].values()) / p['zero_floor_bytes']
  gib = lambda p: f'{p["memory"]["peak"] / 2**30:.2f}'
  plain = _json('plan_llama2-70b_v5e-4x8.libtpu-0.0.42.json')
  readme = ' '.join((ROOT / 'docs' / 'planner.md').read_text().split())
  assert f'{gib(plain)} GiB per chip, {floor_ratio(plain):.3f}x the' in readme
  for version in ('0.0.42', '0.0.50'):
    plan = _json(f'plan_llama2-70b_v5e-4x8_chunked.libtpu-{version}.json')
    command = plan['command'].split(' --json ')[0]
    assert command == plain['command'].split(' --json ')[0] + ' --attention-chunk 512'
    assert plan['fits'] and plan['memory']['peak'] < plain['memory']['peak']
    assert f'{floor_ratio(plan):.3f}' == '1.006', (version, floor_ratio(plan))
    assert f'| {gib(plan)} / {gib(plan)} | 1.006 |' in (ROOT / 'docs' / 'results.md').read_text()
    # The README quotes the 0.0.42 file; the 0.0.50 one gives the same figures.
    assert f'with `--attention-chunk 512`, {gib(plan)} GiB at 1.006x' in readme


def test_the_streamed_70b_plan_without_the_compilers_regathers_is_at_the_floor():
  """`plan_llama2-70b_v5e-4x8_noregather.libtpu-*`: the chunked streamed plan compiled with
  `--compiler-option xla_tpu_rematerialization_min_size_in_bytes=33554432`, on each paired
  compiler: 160 all-gathers fewer (each layer's key and value weights, re-gathered), at or under the ZeRO
  floor, and a peak at most 64 MiB above (the weights it keeps: a layer's key and value
  projections are 32 MiB in bf16); docs/results.md and the README quote it."""
  floor_ratio = lambda p: sum(p['collectives']['ring_bytes'].values()) / p['zero_floor_bytes']
  gib = lambda p: f'{p["memory"]["peak"] / 2**30:.2f}'
  option = 'xla_tpu_rematerialization_min_size_in_bytes'
  readme = ' '.join((ROOT / 'docs' / 'planner.md').read_text().split())
  results = (ROOT / 'docs' / 'results.md').read_text()
  for version in ('0.0.42', '0.0.50'):
    chunked = _json(f'plan_llama2-70b_v5e-4x8_chunked.libtpu-{version}.json')
    plan = _json(f'plan_llama2-70b_v5e-4x8_noregather.libtpu-{version}.json')
    command = plan['command'].split(' --json ')[0]
    assert (
      command == chunked['command'].split(' --json ')[0] + f' --compiler-option {option}=33554432'
    )
    assert plan['compiler_options'] == {option: 33554432}
    gathers = lambda p: p['collectives']['counts']['all-gather']
    assert gathers(chunked) - gathers(plan) == 160, (gathers(chunked), gathers(plan))
    assert floor_ratio(plan) <= 1.0 and f'{floor_ratio(plan):.3f}' == '0.999'
    assert plan['fits'] and 0 <= plan['memory']['peak'] - chunked['memory']['peak'] < 64 * 2**20
    assert f'| {gib(plan)} / {gib(plan)} | 0.999 |' in results
  assert f'{gib(plan)} GiB at 0.999x' in readme and option in readme


def test_the_committed_searches_are_those_of_both_supported_compilers():
  """Each TPU search is committed once per supported end's compiler (libtpu 0.0.42 with jax
  0.10.2, 0.0.50 with jax 0.12), with the same command, and none from another compiler is left
  beside them."""
  results = ROOT / 'benchmarks' / 'results'
  stems = ['search_llama2-7b_v5e-2x4', 'search_llama2-70b_v5e-16x16', 'search_llama2-70b_v5e-8x8']
  for stem in stems:
    old, new = (_json(f'{stem}.libtpu-{v}.json') for v in ('0.0.42', '0.0.50'))
    assert old['command'].split(' --out ')[0] == new['command'].split(' --out ')[0], stem
    assert [r['label'] for r in old['results']] and [r['label'] for r in new['results']]
  # (bench_offload's table records its compiler inside: libtpu 0.0.42.)
  tpu_files = [
    p.name
    for p in results.glob('*_v5[ep]-*')
    if 'libtpu-' not in p.name and 'offload_' not in p.name
  ]
  assert tpu_files == [], tpu_files


def _committed_table_in(md: str, doc: str, runs: str) -> list[Path]:
  """Asserts that every row of `benchmarks/results/MD`'s table is a line of DOC; returns the
  committed runs (`benchmarks/results/RUNS`, a glob) behind it, at least one."""
  table = (ROOT / 'benchmarks' / 'results' / md).read_text().splitlines()
  rows = [line for line in table if line.startswith('| ') and not line.startswith('| row')]
  lines = (ROOT / doc).read_text().splitlines()
  assert rows and all(line in lines for line in rows)
  found = sorted((ROOT / 'benchmarks' / 'results').glob(runs))
  assert found
  return found


def _table_is_rendered_from_the_runs(chip: str) -> None:
  """`benchmarks/results/recompute_CHIP.md` is what `bench_recompute.table` writes from the
  committed runs now: no column left from an earlier rendering or an earlier run."""
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import bench_recompute

  results = ROOT / 'benchmarks' / 'results'
  written = (results / f'recompute_{chip}.md').read_text().splitlines()
  assert bench_recompute.table(str(results), chip) == written


def test_the_table_of_maxtexts_v5e_rows_is_the_committed_benchmark():
  """docs/results.md's table of MaxText's v5e rows is `bench_recompute.py`'s, row for row, and
  each committed row holds what the table claims: the default plan is full rematerialisation
  (MaxText's setting), the searched plan fits and is no slower than it, also with the host
  link at half its assumed bandwidth."""
  runs = _committed_table_in('recompute_v5e.md', 'docs/results.md', 'recompute_v5e.libtpu-*.json')
  _table_is_rendered_from_the_runs('v5e')
  for path in runs:
    for r in json.loads(path.read_text())['rows']:
      default, searched = r['default'], r['searched']
      assert default['remat'] == 'full' and default['fits'], (path.name, r['row'])
      assert searched['fits'], (path.name, r['row'])
      assert searched['predicted_step_seconds'] <= default['predicted_step_seconds']
      assert searched['step_at_host_share']['0.5'] <= default['predicted_step_seconds']


def test_the_memory_table_is_the_committed_benchmark_and_under_maxtexts_peaks():
  """docs/results.md's memory table is `bench_memory.py`'s, row for row, and each committed row
  holds what it claims: with the layer inputs offloaded, the device memory space of the
  compiler's buffer assignment is under the peak of MaxText's own program for the row (where
  MaxText compiled it, `bench_maxtext_program.py`), the recomputation is `full`'s (the same
  matmul FLOPs), and the host link carries the stack of block inputs each way; the default
  plan (`full`, the scheduler held to `candidates.LEAN_SHARE`) peaks at or under MaxText's too,
  and that share is the largest of those swept for which it does."""
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import maxtext_table

  from zerojax._src.planner import candidates

  results = str(ROOT / 'benchmarks' / 'results')
  runs = _committed_table_in('memory_v5e.md', 'docs/results.md', 'memory_v5e.libtpu-*.json')
  compared = []
  for path in runs:
    run = json.loads(path.read_text())
    compiled = maxtext_table.programs(results, run['versions']['libtpu'], 'v5e')
    over: dict[str, list[bool]] = {}  # share -> for each row MaxText compiled: over its peak
    for r in run['rows']:
      full, offloaded = r['plans']['full'], r['plans']['offload_layer_inputs']
      maxtext = maxtext_table.peak_gib(compiled.get(r['row'].split(' ')[0]))
      assert full['fits'] and offloaded['fits'], (path.name, r['row'])
      assert offloaded['matmul_flops_per_chip'] == full['matmul_flops_per_chip']
      assert offloaded['device_space_gib'] < full['device_space_gib']
      assert offloaded['host_bytes_per_step'] > 0
      if maxtext is not None:
        assert offloaded['device_space_gib'] <= maxtext, (path.name, r['row'])
      # The default plan, `full` compiled lean (its scheduler held to `LEAN_SHARE` of HBM): at
      # or under MaxText's compiler peak on every row, against the same program at the other
      # shares swept (the same matmul FLOPs), at a predicted step within 3% of the fastest.
      assert full['lean'] and full['scheduler_share'] == candidates.LEAN_SHARE, path.name
      assert sorted(r['scheduler_shares']) == ['50', '60', '70', 'compiler']
      if maxtext is not None:
        compared.append(r['row'])
        assert full['peak_gib'] <= maxtext, (path.name, r['row'], full['peak_gib'], maxtext)
      fastest = full['predicted_step_seconds']
      for share, other in r['scheduler_shares'].items():
        assert other['fits'] and other['matmul_flops_per_chip'] == full['matmul_flops_per_chip']
        assert f' --scheduler-share {share} ' in other['command']
        fastest = min(fastest, other['predicted_step_seconds'])
        if maxtext is not None and (share == 'compiler' or int(share) > candidates.LEAN_SHARE):
          over.setdefault(share, []).append(other['peak_gib'] > maxtext)
      assert full['predicted_step_seconds'] <= 1.03 * fastest, (path.name, r['row'])
    # `LEAN_SHARE` is the largest share swept under which every row is at or under MaxText's
    # peak: each larger one (and the compiler's own) is over it on some row.
    assert all(any(flags) for flags in over.values()), (path.name, over)
    # The v5p rows, whose programs need most of HBM: the same share is not free there (why it
    # is not the default), and every row still fits.
    v5p = run['v5p']
    assert [r['row'] for r in v5p] == ['32B', '64B', '128B', '128B-512', '256B']
    held = f' --scheduler-share {candidates.LEAN_SHARE} '
    assert all(r['held']['fits'] and held in r['held']['command'] for r in v5p)
    slower = [r['held']['predicted_step_seconds'] / r['default_step_seconds'] for r in v5p]
    assert max(slower) > 1.03, (path.name, slower)
  # MaxText's programs were compiled for every row on one compiler at least.
  rows = ['16B', '32B', '64B', 'llama2-70b chunked', 'llama2-70b flash']
  assert sorted(set(compared)) == sorted(rows)


def test_the_table_of_maxtexts_v5p_rows_is_the_committed_benchmark():
  """docs/results.md's v5p table is `bench_recompute.py --chip v5p`'s, row for row: the default plan
  is MaxText's `minimal` at the row's mesh, every policy of the script was searched at the
  row's tensor axis and at half of it by the command the table prints, and the searched plan
  is the fastest that fits (no slower than the default at the assumed host link; the table
  shows where half of it undoes that)."""
  import sys

  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import bench_recompute
  from bench_maxtext import ROWS

  runs = _committed_table_in('recompute_v5p.md', 'docs/results.md', 'recompute_v5p.libtpu-*.json')
  _table_is_rendered_from_the_runs('v5p')
  written = (ROOT / 'benchmarks' / 'results' / 'recompute_v5p.md').read_text()
  rows = {row[0]: row for row in ROWS}
  for path in runs:
    for r in json.loads(path.read_text())['rows']:
      default, searched, row = r['default'], r['searched'], rows[r['row']]
      assert r['command'] == bench_recompute.search_command(row, 'v5p')
      assert f'`{r["command"]}`' in written, r['row']
      tensors = sorted({max(1, row[6] // 2), row[6]})
      # each policy and tensor axis with the collectives where the compiler puts them, then on
      # the SparseCores (a v5p search tries both)
      assert [(c['remat'], c['tensor'], c.get('collective_offload')) for c in r['candidates']] == [
        (remat, t, offload)
        for remat in bench_recompute.V5P_REMATS
        for t in tensors
        for offload in (None, 'sparsecore')
      ]
      assert (default['remat'], default['tensor']) == ('minimal', row[6]), r['row']
      assert default.get('collective_offload') is None, r['row']
      assert default['fits'], (path.name, r['row'])
      fitting = [c for c in r['candidates'] if c.get('fits')]
      fastest = min(c['predicted_step_seconds'] for c in fitting)
      assert searched['fits'] and searched['predicted_step_seconds'] == fastest
      assert searched['predicted_step_seconds'] <= default['predicted_step_seconds']


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_each_committed_v5e_search_is_the_command_its_table_prints():
  """`bench_recompute.py` searches each of MaxText's v5e rows by the search of `python -m
  zerojax plan --search FLAGS` (`cli.search_target`), and its table prints that command: the
  same policies in the committed order, and, for the default plan and the committed winner,
  the same lowered program (the program cache's key) as the search the committed runs made
  from the row's decoder, written out here on its own."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  import optax

  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import bench_recompute
  from bench_maxtext import V5E_ROWS

  from zerojax._src.planner import cli, lowering, presets, program_cache

  written = (ROOT / 'benchmarks' / 'results' / 'recompute_v5e.md').read_text()
  runs = [json.loads(p.read_text()) for p in ROOT.glob('benchmarks/results/recompute_v5e.*.json')]
  for row in V5E_ROWS:
    name, width, heads, mlp, layers, topology, _, batch, _ = row
    assert f'`{bench_recompute.search_command(row)}`' in written, name
    target, space, run = bench_recompute.search_setup(row)
    # the Python API's search is the command's its table prints
    _, flagged, flagged_run = cli.search_target(bench_recompute.search_flags(row))
    assert flagged == space and flagged_run == run, name
    assert [c.remat for c in space] == list(bench_recompute.REMATS)
    assert {(c.stage, c.layout, c.prefetch, c.batch_per_chip, c.micro_batches) for c in space} == {
      (3, 'torus', False, batch, 1)
    }
    assert run['hbm_bytes'] is None and run['compiler_options'] == {}
    records = [r for doc in runs for r in doc['rows'] if r['row'] == name]
    assert records and all([c['remat'] for c in r['candidates']] == [c.remat for c in space]
                           for r in records)  # fmt: skip
    decoder = presets.DecoderConfig(
      vocab=32000, d_model=width, n_layers=layers, n_heads=heads, n_kv_heads=heads, d_ff=mlp,
      head_size=128, seq_len=2048, gated=True, rope=presets.Rope(10000.0),
    )  # fmt: skip
    committed = lowering.make_target(
      decoder, topology, devices=target.devices, optimizer=lambda: optax.adamw(1e-4),
      settings=presets.ModelSettings(attention='flash'),
    )  # fmt: skip
    key = lambda t, c: program_cache.program_key(lowering.lower(t, c).lowered, t.topology)
    for remat in {'full'} | {r['searched']['remat'] for r in records}:
      c = next(c for c in space if c.remat == remat)
      assert key(target, c) == key(committed, c), (name, remat)


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_each_committed_v5p_search_is_its_command_and_its_plans_are_single_plans():
  """`bench_recompute.py --chip v5p` searches each of MaxText's v5p rows by `python -m zerojax
  plan --search FLAGS` (a tensor axis of MaxText's size and of half of it): the committed records
  hold the command's candidates in its order, and the default plan and the committed winners
  lower to the same program (the program cache's key) as the single plan of that mesh and policy,
  `--mesh data=N,tensor=T --remat R`: a plan is a search of one."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import bench_recompute
  from bench_maxtext import ROWS, chip_count, decoder_model

  from zerojax._src.planner import cli, lowering, program_cache

  runs = [json.loads(p.read_text()) for p in ROOT.glob('benchmarks/results/recompute_v5p.*.json')]
  assert runs
  key = lambda t, c: program_cache.program_key(lowering.lower(t, c).lowered, t.topology)
  for row in ROWS:
    name, width, heads, mlp, layers, topology, tensor, batch, _ = row
    target, space, run = bench_recompute.search_setup(row, 'v5p')
    _, flagged, flagged_run = cli.search_target(bench_recompute.search_flags(row, 'v5p'))
    assert flagged == space and flagged_run == run, name
    assert run['hbm_bytes'] is None and run['compiler_options'] == {}
    records = [r for doc in runs for r in doc['rows'] if r['row'] == name]
    ident = lambda c: (c['remat'], c['tensor'], c.get('collective_offload'))
    assert records and all(
      [ident(c) for c in r['candidates']]
      == [(c.remat, c.tensor, c.collective_offload) for c in space]
      for r in records
    )
    picked = {('minimal', tensor, None)} | {ident(r['searched']) for r in records}
    for remat, t, offload in sorted(picked, key=str):
      c = next(c for c in space if (c.remat, c.tensor, c.collective_offload) == (remat, t, offload))
      single, one, _ = cli.plan_target(
        ['--model', decoder_model(width, heads, mlp, layers), '--topology', topology,
         '--mesh', f'data={chip_count(topology) // t},tensor={t}', '--stage', '3',
         '--batch-per-chip', str(batch), '--seq-len', '2048', '--remat', remat,
         '--attention', 'flash', '--collective-offload', offload or 'none']
      )  # fmt: skip
      assert key(target, c) == key(single, one), (name, remat, t, offload)
      # the options the single plan compiles with are the candidate's
      assert one.compiler_options() == c.compiler_options(), (name, remat, t, offload)


def test_the_regeneration_tool_rewrites_every_committed_tpu_result(tmp_path, monkeypatch):
  """tools/regenerate_tpu_results.py has a step that writes each committed result of each
  supported TPU compiler, each plan's report made again by the command it begins with, each
  search's files moved to their committed names, and names a committed result no step
  writes."""
  import shutil

  sys.path.insert(0, str(ROOT / 'tools'))
  import regenerate_tpu_results as regen

  results = ROOT / 'benchmarks' / 'results'
  versions = sorted(
    {re.search(r'\.libtpu-(\d+\.\d+\.\d+)\.', p.name).group(1) for p in results.glob('*.libtpu-*')}
  )
  assert versions == ['0.0.42', '0.0.50']
  for version in versions:
    assert regen.uncovered(version) == []
    plans = [s for s in regen.steps(version) if s.name.startswith('plan_')]
    assert len(plans) == len(list(results.glob(f'plan_*.libtpu-{version}.txt'))) > 0
    for step in plans:
      (argv, report), (json_argv, _) = step.runs
      first = (ROOT / report).read_text().splitlines()[0]
      assert first == 'command: python ' + ' '.join(argv[1:]), step.name
      assert json_argv[-2:] == ('--json', f'benchmarks/results/{step.name}.json')
    # A search's --out names its files by model and topology: each is moved to its committed
    # name, so that the two compilers' runs neither overwrite each other nor leave a stray file.
    searches = [s for s in regen.steps(version) if s.name.startswith('search_')]
    assert len(searches) == len(list(results.glob(f'search_*.libtpu-{version}.json'))) > 0
    for step in searches:
      written = step.name.removesuffix(f'.libtpu-{version}')
      assert step.moves == tuple(
        (f'benchmarks/results/{written}.{ext}', f'benchmarks/results/{step.name}.{ext}')
        for ext in ('txt', 'json', 'png')
      )
      ((argv, _),) = step.runs
      assert argv[-2:] == ('--out', 'benchmarks/results'), step.name
  copy = tmp_path / 'benchmarks' / 'results'
  shutil.copytree(results, copy)
  (copy / 'stray.libtpu-0.0.42.json').write_text('{}')
  monkeypatch.setattr(regen, 'ROOT', str(tmp_path))
  assert regen.uncovered('0.0.42') == ['benchmarks/results/stray.libtpu-0.0.42.json']


def test_the_shared_tables_are_rendered_from_every_compilers_committed_runs(tmp_path, monkeypatch):
  """Each table under benchmarks/results that the compilers' runs share (MaxText's rows, the
  searches of them, the memory table, the one-chip table, MaxText's programs) is, byte for byte,
  what `tools/regenerate_tpu_results.py --tables` writes from the committed runs alone: none
  keeps a row of an earlier run, or of only one compiler's."""
  import shutil

  sys.path.insert(0, str(ROOT / 'tools'))
  import regenerate_tpu_results as regen

  results = ROOT / 'benchmarks' / 'results'
  copy = tmp_path / 'benchmarks' / 'results'
  copy.mkdir(parents=True)
  for path in results.glob('*.json'):
    shutil.copy(path, copy / path.name)
  monkeypatch.setattr(regen, 'ROOT', str(tmp_path))
  written = regen.rewrite_tables()
  assert len(written) == 9
  for path in written:
    name = os.path.basename(path)
    assert (copy / name).read_text() == (results / name).read_text(), name


def test_a_table_of_runs_compiled_before_the_presets_changed_says_so(tmp_path):
  """A run that records no `model_revision` (or an older one than the presets', or that keeps a
  row of an older one) is named under the table built from it, and such a row is marked; a
  current run is not, and a table of current runs carries no note."""
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import model_revision

  from zerojax._src.planner import presets

  now = presets.MODEL_REVISION
  runs = {
    'maxtext_v5e.libtpu-0.0.42.json': {'versions': {'libtpu': '0.0.42'}, 'rows': []},
    'maxtext_v5e.libtpu-0.0.50.json': {'versions': {'model_revision': now}, 'rows': []},
    'one_chip.libtpu-0.0.42.json': {'model_revision': 1, 'rows': [{'model_revision': now}]},
    'one_chip.libtpu-0.0.50.json': {'rows': [{'model_revision': now}, {'chip': 'v5e'}]},
  }
  for name, run in runs.items():
    (tmp_path / name).write_text(json.dumps(run))
  assert [model_revision.of(r) for r in runs.values()] == [1, now, 1, 1]
  assert model_revision.stale(str(tmp_path), ('maxtext_v5e.',)) == {
    'maxtext_v5e.libtpu-0.0.42.json': 1
  }
  (_, line) = model_revision.note(str(tmp_path), ('maxtext_v5e.',))
  assert line.startswith('These runs were compiled before the gated presets rotated their')
  assert line.endswith(f'(model revision 1; now {now}). They are being compiled again'
                       ' (`tools/regenerate_tpu_results.py`): maxtext_v5e.libtpu-0.0.42.json.')  # fmt: skip
  marked = model_revision.note(str(tmp_path), ('one_chip.',), marked=True)[1]
  assert marked.startswith('The rows marked † were compiled before')
  assert marked.endswith(': one_chip.libtpu-0.0.42.json, one_chip.libtpu-0.0.50.json.')
  # A row is marked by its own revision, else its run's.
  run = runs['one_chip.libtpu-0.0.50.json']
  assert [model_revision.mark(run, r) for r in run['rows']] == ['', ' †']
  assert model_revision.mark(runs['maxtext_v5e.libtpu-0.0.50.json'], {}) == ''
  (tmp_path / 'maxtext_v5e.libtpu-0.0.42.json').write_text(
    json.dumps({'versions': {'model_revision': now}, 'rows': []})
  )
  assert model_revision.note(str(tmp_path), ('maxtext_v5e.',)) == []


def test_every_committed_tpu_run_records_a_revision_no_newer_than_the_presets():
  """Each committed TPU run of zerojax's programs is of a revision the presets have had, and
  the documents say whether any is of an earlier revision than the presets'."""
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import model_revision

  from zerojax._src.planner import presets

  seen = {}
  for path in sorted((ROOT / 'benchmarks' / 'results').glob('*.libtpu-*.json')):
    if path.name.startswith('maxtext_program'):  # MaxText's own programs, not the presets'
      continue
    record = json.loads(path.read_text())
    seen[path.name] = model_revision.of(record)
    assert 1 <= seen[path.name] <= presets.MODEL_REVISION, path.name
  assert len(seen) >= 60
  # The README and the results page say that figures of earlier runs remain, while some do.
  stale = sorted(n for n, r in seen.items() if r < presets.MODEL_REVISION)
  for document in ('README.md', 'docs/results.md'):
    text = ' '.join((ROOT / document).read_text().split())
    assert ('being compiled again' in text) == bool(stale), (document, stale)
  # and no other document says so once none remains
  if not stale:
    for path in (ROOT / 'docs').glob('*.md'):
      assert 'being compiled again' not in ' '.join(path.read_text().split()), path.name
  # The results page names the kinds of run still to be compiled again, and only those.
  results = ' '.join((ROOT / 'docs' / 'results.md').read_text().split())
  kinds = sorted({name.split('.libtpu-')[0] for name in stale})
  if kinds:
    assert 'Still to be compiled again: ' in results, kinds
    said = results.split('Still to be compiled again: ')[1].split('.')[0]
    assert sorted(re.findall(r'\(`([\w.-]+)`\)', said)) == kinds, (said, kinds)


def test_the_regeneration_tool_runs_the_steps_in_the_order_given_and_resumes_searches(
  monkeypatch, capsys
):
  """`--only` runs its steps in the order given, refusing a number no step has; `--resume`
  reaches the searches of MaxText's rows (bench_recompute.py) and no other script."""
  sys.path.insert(0, str(ROOT / 'tools'))
  import regenerate_tpu_results as regen

  monkeypatch.setattr(regen, 'libtpu_version', lambda: '0.0.42')
  run, ran = regen.run, []
  monkeypatch.setattr(regen, 'run', lambda step, no_cache, resume: ran.append(step.name) or 0.0)
  assert regen.main(['--only', '6,1,6']) == 0
  assert ran == ['bench_recompute v5p', 'bench_maxtext v5p']
  with pytest.raises(SystemExit):
    regen.main(['--only', '1,99'])
  assert (
    'error: --only: no step [99] from step 1 on; --list numbers them.' in capsys.readouterr().err
  )
  calls = []
  monkeypatch.setattr(
    regen.subprocess,
    'run',
    lambda argv, **kw: calls.append(argv) or subprocess.CompletedProcess(argv, 0),
  )
  steps = regen.steps('0.0.42')
  for step in steps[0], steps[5]:  # bench_maxtext v5p, bench_recompute v5p
    run(step, no_cache=False, resume=True)
  assert [list(argv[1:]) for argv in calls] == [
    ['benchmarks/bench_maxtext.py'],
    ['benchmarks/bench_recompute.py', '--chip', 'v5p', '--resume'],
  ]
