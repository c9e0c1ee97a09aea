"""The quickstart notebook executes top to bottom (on the faked CPU mesh)."""

import os
import re
import sys
from pathlib import Path

import pytest
from _models import child_env

import zerojax
from zerojax._src.planner.tpu import _probe

NOTEBOOK = Path(__file__).resolve().parent.parent / 'notebooks' / 'quickstart.ipynb'


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path):
  nbformat = pytest.importorskip('nbformat')
  nbclient = pytest.importorskip('nbclient')
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel starts its own jax: give it a clean environment for the fake devices.
  env = child_env()
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(tmp_path)}}
  )
  old = dict(os.environ)
  os.environ.clear()
  os.environ.update(env)
  try:
    client.execute()
  finally:
    os.environ.clear()
    os.environ.update(old)
  outputs = [
    o.get('text', '') for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])
  ]
  text = ''.join(outputs)
  assert 'no TPU attached: 8 faked CPU devices' in text and '8 devices: cpu' in text
  assert 'ZeroPlan: stage 2' in text and 'loss ' in text
  # The pod slice, compiled ahead of time by the TPU compiler on this CPU machine.
  assert 'gpt2-small | 0.16B params | ZeRO stage 3 | adamw | v5e:2x4 (8 chips)' in text
  assert 'reduce-scatter' in text and 'FITS' in text
  # One chip (here one CPU device against a pretend 64 MiB chip): the smallest decoder whose
  # states at rest exceed it by a quarter, planned for a v5e-1 with and without the offload,
  # fine-tuned with the offload, its measured step beside the prediction.
  assert 'chip: cpu, 0.06 GiB; planned as v5e:1x1' in text
  sized = re.search(r'model: (\d+) layers, [\d,]+M parameters; states at rest ([\d.]+) GiB', text)
  assert sized and float(sized[2]) * 2**30 >= 1.25 * 64 * 2**20, text
  offloaded = text[text.index('--offload opt_state+master --update-on stream') :]
  assert re.search(r'host memory [\d.]+ GiB per chip of 45 GiB: FITS', offloaded)
  assert re.search(r'step: predicted [\d.]+ s on v5e:1x1, measured [\d.]+ s here \(cpu\)', text)
  assert any(
    o.get('output_type') == 'display_data'
    for c in nb.cells
    if c.cell_type == 'code'
    for o in c.outputs
  )


def _install_cell() -> str:
  """The notebook's first code cell: how it installs zerojax where the runtime lacks it."""
  import json

  cells = json.loads(NOTEBOOK.read_text())['cells']
  return ''.join(next(c for c in cells if c['cell_type'] == 'code')['source'])


@pytest.mark.parametrize('given', ['wheel', 'checkout', 'env', 'nothing'])
def test_the_notebook_installs_zerojax_from_its_own_source(given, tmp_path, monkeypatch):
  """Without zerojax, the first cell installs it from this project's source (an uploaded wheel,
  the checkout the notebook sits in, or ZEROJAX_SOURCE), never by name from the package index;
  with none of them it stops, saying how to build the wheel."""
  import importlib.util
  import subprocess

  work = tmp_path / 'notebooks'
  work.mkdir()
  monkeypatch.chdir(work)
  monkeypatch.delenv('ZEROJAX_SOURCE', raising=False)
  if given == 'wheel':
    (work / 'zerojax-0.3.0-py3-none-any.whl').touch()
  elif given == 'checkout':
    (tmp_path / 'zerojax').mkdir()
    (tmp_path / 'zerojax' / '__init__.py').touch()
  elif given == 'env':
    monkeypatch.setenv('ZEROJAX_SOURCE', 'git+https://example.org/zerojax.git')
  ran = []
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  monkeypatch.setattr(subprocess, 'run', lambda cmd, check: ran.append(cmd))
  if given == 'nothing':
    with pytest.raises(RuntimeError, match=r'python -m pip wheel --no-deps -w dist \.'):
      exec(_install_cell(), {})
    assert ran == []
    return
  exec(_install_cell(), {})
  want = {
    'wheel': 'zerojax-0.3.0-py3-none-any.whl',
    'checkout': '..',
    'env': 'git+https://example.org/zerojax.git',
  }[given]
  assert ran == [[sys.executable, '-m', 'pip', 'install', '--quiet', want]]


# --- Finding a TPU VM before jax starts (what the notebook's first cell asks)


def _dev(tmp_path, *names):
  for name in names:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).touch()
  return str(tmp_path)


def test_tpu_vm_with_accel_devices_is_found(tmp_path):
  dev = _dev(tmp_path, 'accel0', 'accel1', 'accel2', 'accel3', 'accelerometer')
  assert _probe({'TPU_ACCELERATOR_TYPE': 'v2-8'}, dev, False) == (
    f'TPU VM v2-8: 4 chip(s) at {dev}/accel*'
  )
  assert _probe({}, dev, False) == f'TPU VM (type not set): 4 chip(s) at {dev}/accel*'


def test_tpu_vm_with_vfio_devices_is_found_only_with_libtpu(tmp_path):
  dev = _dev(tmp_path, 'vfio/0', 'vfio/vfio')  # v5e-1 / v6e-1: one chip behind vfio
  assert _probe({}, dev, True) == f'TPU VM (type not set): 1 chip(s) at {dev}/vfio'
  assert _probe({}, dev, False) is None  # vfio alone is not a TPU (GPU passthrough uses it)
  assert _probe({'TPU_ACCELERATOR_TYPE': 'v5litepod-1'}, dev, True).startswith(
    'TPU VM v5litepod-1: 1 chip(s)'
  )


def test_no_tpu_and_the_retired_node_runtime(tmp_path):
  dev = _dev(tmp_path, 'null', 'vfio/vfio')
  assert _probe({}, dev, True) is None
  assert _probe({}, str(tmp_path / 'missing'), True) is None
  with pytest.raises(RuntimeError) as e:
    _probe({'COLAB_TPU_ADDR': '10.0.0.2:8470'}, dev, True)
  assert str(e.value) == (
    'COLAB_TPU_ADDR is set: this is the retired TPU-node runtime, which current jax cannot'
    ' use. Pick a TPU VM runtime instead (in Colab: Runtime > Change runtime type > v5e-1,'
    ' v6e-1 or v2-8).'
  )
  assert zerojax.inspect.local_tpu() is None  # this machine
