"""The largest Llama that fine-tunes on one chip: Colab's one-chip TPU runtimes (v5e-1, v6e-1),
planned from a CPU machine with the TPU compiler of the installed libtpu (no TPU needed).

For the published shapes of Llama 3.2 1B and 3B, Llama 2 7B and 13B and Llama 3.1 8B (their
config.json fields, read by `zerojax.llama.config_from_hf`: tied heads, grouped-query attention,
llama3 rotary scaling), one sequence of `--seq-len` tokens (2048) per step, AdamW with
`zerojax.mixed_precision` (bf16 parameters and gradients, fp32 master and moments) at stage 3
with per-layer gathering, each chip and each of these settings is compiled:

- `none`: every state in HBM;
- `opt_state`: the moments in host memory, the update on the host (`offload='opt_state'`,
  `update_on='host'`);
- `opt_state+master`: the master too, the update streamed (`update_on='stream'`);
- `+activations`: that, with the layer loop's saved inputs in host memory
  (remat `offload_layer_inputs`: every block recomputed, its input kept on the host);
- `+params`: `opt_state+master` with the parameters at rest in host memory
  (`offload_params=True`).

Each row is the plan search's own evaluation of that one candidate (`search.run_search`): the
model states against HBM and host memory before compiling, then the compiled program's peak
against HBM (or the compiler's refusal), its host-link bytes per step and the predicted step
(docs/design.md, "The step-time model"), with the host link's share of it. The `largest`
entries say, per chip and setting, the largest shape that fits.

    python benchmarks/bench_one_chip.py [--chips v5e,v6e] [--shapes 1B,3B] [--settings none,...]
                                        [--seq-len 2048] [--out DIR]

Writes one_chip.libtpu-VERSION.json and one_chip.md (every compiler's rows). Minutes per
compiled row on a 2-core machine; compiled programs are kept in the planner's cache
(`~/.cache/zerojax/programs`), so a second run reads them back. Rows of a run restricted with
--chips, --shapes or --settings replace those rows of the JSON already written and keep the
others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(__file__))

import model_revision  # noqa: E402
import optax  # noqa: E402
from bench_maxtext import compiler_tag  # noqa: E402

import zerojax  # noqa: E402
import zerojax.llama  # noqa: E402
from zerojax._src.planner import presets, program_cache, search, tpu  # noqa: E402
from zerojax._src.planner.candidates import Candidate, with_default_shares  # noqa: E402
from zerojax._src.planner.lowering import make_target  # noqa: E402
from zerojax._src.planner.presets import ModelSettings  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')

_LLAMA3_ROPE = dict(
  rope_type='llama3',
  factor=32.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=8192,
)


def _llama(hidden, inter, layers, heads, kv, vocab, theta, tied, scaling=None, head_dim=None):
  """A LlamaForCausalLM config.json's fields (as the published checkpoints give them)."""
  config = dict(
    architectures=['LlamaForCausalLM'],
    model_type='llama',
    hidden_act='silu',
    hidden_size=hidden,
    intermediate_size=inter,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    vocab_size=vocab,
    rope_theta=theta,
    rms_norm_eps=1e-5,
    tie_word_embeddings=tied,
    max_position_embeddings=131072 if scaling else 4096,
  )
  if scaling:
    config['rope_scaling'] = scaling
  if head_dim:
    config['head_dim'] = head_dim
  return config


# The published config.json fields of each shape (meta-llama's Hugging Face repositories).
SHAPES = {
  '1B': ('Llama-3.2-1B', _llama(2048, 8192, 16, 32, 8, 128256, 500000.0, True, _LLAMA3_ROPE, 64)),
  '3B': ('Llama-3.2-3B', _llama(3072, 8192, 28, 24, 8, 128256, 500000.0, True, _LLAMA3_ROPE, 128)),
  '7B': ('Llama-2-7b', _llama(4096, 11008, 32, 32, 32, 32000, 10000.0, False)),
  '8B': (
    'Llama-3.1-8B',
    _llama(4096, 14336, 32, 32, 8, 128256, 500000.0, False, dict(_LLAMA3_ROPE, factor=8.0)),
  ),
  '13B': ('Llama-2-13b', _llama(5120, 13824, 40, 40, 40, 32000, 10000.0, False)),
}

_STREAM = dict(offload='opt_state+master', update_on='stream')
SETTINGS = {
  'none': Candidate(3, remat='full'),
  'opt_state': Candidate(3, remat='full', offload='opt_state', update_on='host'),
  'opt_state+master': Candidate(3, remat='full', **_STREAM),
  '+activations': Candidate(3, remat='offload_layer_inputs', **_STREAM),
  '+params': Candidate(3, remat='full', offload_params=True, **_STREAM),
}
CHIPS = ('v5e', 'v6e')


def row(
  chip: str, shape: str, setting: str, r: search.Result, num_params: int, model: str | None = None
) -> dict:
  """One table row from the search's `Result` of that candidate (`model`: default the
  shape's name in `SHAPES`)."""
  out = dict(
    chip=chip,
    shape=shape,
    model=model or SHAPES[shape][0],
    params=num_params,
    setting=setting,
    candidate=r.candidate.label(),
    status=r.status,
    fits=r.fits,
    states_bytes=r.theory_bytes,
    host_bytes=r.host_bytes,
    peak_bytes=r.peak_bytes or None,
    program_source=r.program_source,
    compile_seconds=round(r.compile_seconds, 1),
    model_revision=presets.MODEL_REVISION,
  )
  if r.predicted is not None:
    p = r.predicted
    out |= dict(
      step_seconds=p.step,
      host_link_seconds=p.host,
      host_link_exposed_seconds=p.host_exposed,
      host_link_share=p.host_exposed / p.step if p.step else None,
    )
  if r.host_traffic is not None:
    out |= dict(
      host_to_device_bytes=r.host_traffic.to_device, device_to_host_bytes=r.host_traffic.to_host
    )
  return out


def run(chips, shapes, settings, seq_len: int, cache_dir: Any = 'default') -> list[dict]:
  """The rows of each chip, shape and setting ('default': the planner's program cache;
  None compiles every program afresh)."""
  cache_dir = program_cache.default_dir() if cache_dir == 'default' else cache_dir
  rows = []
  for chip in chips:
    topology = f'{chip}:1x1'
    devices = tpu.topology_devices(topology)
    for shape in shapes:
      cfg = zerojax.llama.config_from_hf(SHAPES[shape][1], seq_len=seq_len)
      target = make_target(
        cfg,
        topology,
        devices=devices,
        optimizer=lambda: optax.adamw(1e-5),
        mixed_precision=True,
        settings=ModelSettings(seq_len=seq_len),
      )
      found = with_default_shares([SETTINGS[s] for s in settings], topology, None)
      print(f'{topology} {shape} ({SHAPES[shape][0]}): {len(found)} settings', flush=True)
      report = search.run_search(target, found, cache_dir=cache_dir)
      count = cfg.num_params()
      rows += [row(chip, shape, s, r, count) for s, r in zip(settings, report.results)]
  return rows


def largest(rows: list[dict]) -> dict:
  """Per chip and setting, the largest shape (by parameters) whose row fits, or None."""
  best: dict = {}
  for r in rows:
    key = f'{r["chip"]}-1 {r["setting"]}'
    best.setdefault(key, None)
    if r['fits'] and (best[key] is None or r['params'] > best[key][1]):
      best[key] = (r['shape'], r['params'])
  return {k: (v[0] if v else None) for k, v in best.items()}


def _cell(r: dict) -> str:
  """One setting of one shape, briefly: its predicted step and the host link's exposed share,
  or why it does not fit."""
  if r['fits']:
    share = r.get('host_link_share')
    return f'{r["step_seconds"]:.2f} s' + ('' if not share else f' ({100 * share:.0f}% host)')
  status = r['status']
  if search.STATES_EXCEED_HBM in status:
    return 'states > HBM'
  if search.STATE_EXCEEDS_HOST in status:
    return 'host memory'
  return 'over HBM' if status.startswith('over HBM') else status


def pivot(rows: list[dict]) -> str:
  """The table docs/planner.md quotes: per chip and shape, each setting's predicted step (and
  the host link's exposed share of it) where it fits, else what it exceeds."""
  settings = list(dict.fromkeys(r['setting'] for r in rows))
  lines = [
    '| chip | shape | ' + ' | '.join(settings) + ' |',
    '|---|---|' + '---|' * len(settings),
  ]
  keyed = {(r['chip'], r['shape'], r['setting']): r for r in rows}
  for chip, shape in dict.fromkeys((r['chip'], r['shape']) for r in rows):
    first = keyed[chip, shape, settings[0]]
    cells = [_cell(keyed[chip, shape, t]) if (chip, shape, t) in keyed else '-' for t in settings]
    lines.append(
      f'| {chip}-1 | {first["model"]} ({first["params"] / 1e9:.2f}B) | ' + ' | '.join(cells) + ' |'
    )
  return '\n'.join(lines)


def _gib(x) -> str:
  return '-' if x is None else f'{x / 2**30:.2f}'


def table(rows: list[dict], compiler: str) -> str:
  # A row kept from a run of an earlier model revision is marked (the note under the tables).
  old = lambda r: model_revision.mark({}, r)
  lines = [
    f'### {compiler}',
    '',
    '| chip | shape | params | setting | states in HBM GiB | host GiB | peak GiB | fits |'
    ' predicted step s | host link exposed |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    step = r.get('step_seconds')
    share = r.get('host_link_share')
    lines.append(
      f'| {r["chip"]}-1{old(r)} | {r["shape"]} ({r["model"]}) | {r["params"] / 1e9:.2f}B |'
      f' {r["setting"]} |'
      f' {_gib(r["states_bytes"])} | {_gib(r["host_bytes"])} | {_gib(r["peak_bytes"])} |'
      f' {"yes" if r["fits"] else r["status"]} | {"-" if step is None else f"{step:.3f}"} |'
      f' {"-" if share is None else f"{100 * share:.0f}%"} |'
    )
  return '\n'.join(lines)


def markdown(out: str) -> str:
  """one_chip.md: each compiler's committed run in `out` (one_chip.libtpu-*.json), its pivot
  and its full table."""
  tables, seq_lens = [], {}
  for p in sorted(os.listdir(out)):
    if p.startswith('one_chip.libtpu-') and p.endswith('.json'):
      with open(os.path.join(out, p)) as f:
        rec = json.load(f)
      seq_lens[p] = rec['seq_len']
      tables.append(pivot(rec['rows']))
      tables.append(table(rec['rows'], f'libtpu {rec["libtpu"]}, jax {rec["jax"]}'))
  if not seq_lens:
    raise ValueError(f'{out}: no one_chip.libtpu-*.json to tabulate (run bench_one_chip.py).')
  if len(set(seq_lens.values())) != 1:
    raise ValueError(
      f'{out}: the one-chip runs have sequence lengths {seq_lens}; one table needs one length'
      ' (run bench_one_chip.py again with the same --seq-len for each compiler).'
    )
  return (
    f'# One chip: what fine-tunes where (bench_one_chip.py)\n\n{seq_lens.popitem()[1]} tokens,'
    ' one sequence per step, AdamW in mixed precision at stage 3; "fits" is the compiled'
    ' program against HBM, after the states against HBM and host memory.\n\n'
    + '\n\n'.join(tables)
    + ''.join('\n' + line for line in model_revision.note(out, ('one_chip.libtpu-',), marked=True))
    + '\n'
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--chips', default=','.join(CHIPS))
  parser.add_argument('--shapes', default=','.join(SHAPES))
  parser.add_argument('--settings', default=','.join(SETTINGS))
  parser.add_argument('--seq-len', type=int, default=2048)
  parser.add_argument('--out', default=RESULTS)
  args = parser.parse_args(argv)
  chips, shapes, settings = (
    args.chips.split(','),
    args.shapes.split(','),
    args.settings.split(','),
  )
  named = (
    (chips, CHIPS, '--chips'),
    (shapes, SHAPES, '--shapes'),
    (settings, SETTINGS, '--settings'),
  )
  for given, known, flag in named:
    unknown = sorted(set(given) - set(known))
    if unknown:
      parser.error(f'{flag}: unknown {unknown}; choose from {list(known)}.')
  version = compiler_tag().removeprefix('libtpu-')
  start = time.perf_counter()
  rows = run(chips, shapes, settings, args.seq_len)
  path = os.path.join(args.out, f'one_chip.libtpu-{version}.json')
  done = set((r['chip'], r['shape'], r['setting']) for r in rows)
  if os.path.exists(path):  # a restricted run keeps the rows it did not compute
    with open(path) as f:
      kept = [r for r in json.load(f)['rows'] if (r['chip'], r['shape'], r['setting']) not in done]
    order = {(c, s, t): i for i, (c, s, t) in enumerate(_all_keys())}
    rows = sorted(kept + rows, key=lambda r: order[(r['chip'], r['shape'], r['setting'])])
  record = dict(
    libtpu=version,
    jax=__import__('jax').__version__,
    model_revision=min(r.get('model_revision', 1) for r in rows),
    seq_len=args.seq_len,
    batch_per_chip=1,
    optimizer='adamw, zerojax.mixed_precision (bf16 parameters, fp32 master and moments)',
    settings={k: dataclasses.asdict(v) for k, v in SETTINGS.items()},
    largest=largest(rows),
    rows=rows,
    seconds=round(time.perf_counter() - start, 1),
  )
  with open(path, 'w') as f:
    json.dump(record, f, indent=1)
  text = markdown(args.out)  # before opening: a refused table leaves the committed one whole
  with open(os.path.join(args.out, 'one_chip.md'), 'w') as f:
    f.write(text)
  print(table(rows, f'libtpu {version}'))
  print(pivot(rows))
  print(f'largest that fits: {record["largest"]}')
  print(f'wrote {path} and one_chip.md in {record["seconds"]:.0f} s')
  return 0


def _all_keys():
  return [(c, s, t) for c in CHIPS for s in SHAPES for t in SETTINGS]


if __name__ == '__main__':
  sys.exit(main())
