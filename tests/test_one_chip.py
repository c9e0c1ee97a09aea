"""One-chip TPU runtimes (Colab's v5e-1 and v6e-1) planned from a CPU machine: libtpu told the
host holds one chip, the one-chip VM's host memory, and a report that says one device exchanges
nothing."""

import json
import sys
from pathlib import Path

import pytest
from _models import run_cli

from zerojax._src.planner import roofline, tpu


@pytest.mark.parametrize(
  'topology, bounds',
  [
    ('v5e:1x1', {'chips_per_host_bounds': [1, 1, 1]}),
    ('v6e:1x1', {'chips_per_host_bounds': [1, 1, 1]}),
    ('v5e:1x2', {'chips_per_host_bounds': [1, 2, 1]}),
    ('v5e:2x2', {}),
    ('v6e:4x4', {}),
    ('v5p:2x2x1', {}),
    ('v4:2x2x1', {}),
  ],
)
def test_a_slice_smaller_than_a_host_is_described_as_one_host(topology, bounds):
  assert tpu._one_host_bounds(topology) == bounds


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize('chip, host_bytes', [('v5e', 48 * 10**9), ('v6e', 1536 * 2**30 // 8)])
def test_a_one_chip_runtime_is_planned_with_its_vms_host_memory(tmp_path, chip, host_bytes):
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  out = tmp_path / 'plan.json'
  r = run_cli('plan', '--model', 'tiny', '--topology', f'{chip}:1x1', '--stage', '3',
              '--seq-len', '128', '--mixed-precision', '--offload', 'opt_state+master',
              '--update-on', 'stream', '--no-cache', '--json', str(out))  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  plan = json.loads(out.read_text())
  assert plan['num_devices'] == 1 and plan['fits'] is True
  assert plan['host_limit_bytes'] == host_bytes
  assert 'ZeRO floor: 0 bytes (one device: nothing is split, nothing is exchanged)' in r.stdout
  assert 'nan' not in r.stdout
  assert plan['plan_bytes_per_chip']['host'] > 0  # the optimizer state and master on the host
  assert roofline.ONE_CHIP_VM_HOST_BYTES.get(chip, host_bytes) == host_bytes


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_a_one_chip_search_tries_every_offload_unless_told():
  """On one chip nothing is split: host memory is what fits a larger model, so `plan --search`
  tries the optimizer-state, master and parameter offloads there by default (those that can
  run), on a pod slice none, and on either what --offloads / --update-ons /
  --offload-params-options say."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  from zerojax._src.planner import cli

  def tried(*argv):
    common = ['--model', 'tiny', '--seq-len', '64', '--mixed-precision', '--stages', '3']
    space = cli.search_target([*common, '--remats', 'full', '--prefetch-options', 'off', *argv])[1]
    return {(c.offload, c.update_on, c.offload_params) for c in space}

  one = tried('--topology', 'v5e:1x1')
  assert (None, 'device', False) in one
  assert ('opt_state+master', 'stream', True) in one and ('opt_state', 'host', True) in one
  assert ('opt_state+master', 'device', True) not in one  # the update must run on the host
  assert len(one) == 11
  assert tried('--topology', 'v5e:2x4') == {(None, 'device', False)}
  told = tried('--topology', 'v5e:1x1', '--offloads', 'opt_state+master', '--update-ons', 'stream')
  assert told == {('opt_state+master', 'stream', False), ('opt_state+master', 'stream', True)}
  assert tried('--topology', 'v5e:1x1', '--offload-params-options', 'off') == one - {
    c for c in one if c[2]
  }


LLAMA_3B_SHAPE = (
  'decoder:vocab=128256,d_model=3072,n_layers=28,n_heads=24,n_kv_heads=8,d_ff=8192,head_size=128,'
  'gated=true'
)


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize(
  'model, extra, offloaded',
  [('llama2-7b', (), '75.31'), (LLAMA_3B_SHAPE, ('--offload-params',), '47.03')],
)
def test_a_model_whose_host_state_exceeds_the_one_chip_vm_is_refused_before_compiling(
  model, extra, offloaded
):
  """The v5e-1 VM's 45 GiB of host memory: llama2-7b's fp32 master and moments alone, or a
  Llama-3.2-3B shape with its bf16 parameters offloaded as well, do not fit, and the plan says
  so without compiling (the 3B shape without parameter offload fits: the committed
  plan_llama3.2-3b-shape_v5e-1x1 result)."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  r = run_cli('plan', '--model', model, '--topology', 'v5e:1x1', '--stage', '3', '--seq-len',
              '2048', '--mixed-precision', '--offload', 'opt_state+master', '--update-on',
              'stream', '--no-cache', *extra)  # fmt: skip
  assert r.returncode == 3, r.stderr[-2000:]
  assert (
    f'DOES NOT FIT: pruned: offloaded state exceeds host memory ({offloaded} GiB per chip'
    ' offloaded)'
  ) in r.stderr
  assert 'compiling' not in r.stderr + r.stdout


# --- The one-chip table (benchmarks/bench_one_chip.py, quoted in docs/planner.md)

RESULTS = Path(__file__).resolve().parent.parent / 'benchmarks' / 'results'


def _bench_one_chip():
  sys.path.insert(0, str(RESULTS.parent))
  try:
    import bench_one_chip
  finally:
    sys.path.remove(str(RESULTS.parent))
  return bench_one_chip


def _committed(version: str = '0.0.42') -> dict:
  return json.loads((RESULTS / f'one_chip.libtpu-{version}.json').read_text())


def test_the_one_chip_table_is_its_rows_verdicts_and_the_docs_quote_it():
  """Every chip, shape and setting has a row; a row refused before compiling exceeds what its
  status names (the chip's HBM, the one-chip VM's host memory); `largest` is the rows' own;
  docs/planner.md quotes the table as the rows make it."""
  bench = _bench_one_chip()
  record = _committed()
  rows = record['rows']
  assert [(r['chip'], r['shape'], r['setting']) for r in rows] == bench._all_keys()
  limits = {'v5e': (16 * 2**30, 48 * 10**9), 'v6e': (32 * 2**30, 1536 * 2**30 // 8)}
  for r in rows:
    hbm, host = limits[r['chip']]
    assert r['fits'] == (r['status'] == 'fits'), r
    if 'states alone exceed HBM' in r['status']:
      assert r['states_bytes'] > hbm, r
    elif 'offloaded state exceeds host memory' in r['status']:
      assert r['states_bytes'] <= hbm and r['host_bytes'] > host, r
    else:  # compiled: it fits, or the compiler refused it
      assert r['program_source'] in ('compiled', 'cache'), r
      assert r['fits'] or r['status'].startswith('over HBM'), r
    if r['fits']:
      assert 0 < r['peak_bytes'] <= hbm and r['step_seconds'] > 0, r
  assert record['largest'] == bench.largest(rows)
  docs = (RESULTS.parent.parent / 'docs' / 'planner.md').read_text()
  assert bench.pivot(rows) in docs


@pytest.mark.tpu
@pytest.mark.slow
@pytest.mark.xdist_group('libtpu')
def test_one_chip_rows_compile_again_to_their_committed_verdicts():
  """Two rows compiled afresh (no program cache) with libtpu 0.0.42: Llama-3.2-1B's shape with
  the state and master streamed fits v5e-1 at its committed peak; Llama-3.1-8B's does not fit
  v6e-1 that way (the compiler's refusal)."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  bench = _bench_one_chip()
  if bench.compiler_tag() != 'libtpu-0.0.42':
    pytest.skip('the committed table is libtpu 0.0.42')
  committed = {(r['chip'], r['shape'], r['setting']): r for r in _committed()['rows']}
  for chip, shape in (('v5e', '1B'), ('v6e', '8B')):
    (row,) = bench.run([chip], [shape], ['opt_state+master'], 2048, cache_dir=None)
    want = committed[chip, shape, 'opt_state+master']
    assert row['program_source'] == 'compiled'
    assert (row['fits'], row['status'], row['peak_bytes']) == (
      want['fits'],
      want['status'],
      want['peak_bytes'],
    )
