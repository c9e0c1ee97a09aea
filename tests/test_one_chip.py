"""One-chip TPU runtimes (Colab's v5e-1 and v6e-1) planned from a CPU machine: libtpu told the
host holds one chip, the one-chip VM's host memory, and a report that says one device exchanges
nothing."""

import json

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
