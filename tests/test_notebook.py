"""The quickstart notebook executes top to bottom (on the faked CPU mesh)."""

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / 'notebooks' / 'quickstart.ipynb'


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path):
  nbformat = pytest.importorskip('nbformat')
  nbclient = pytest.importorskip('nbclient')
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel starts its own jax: give it a clean environment for the fake devices.
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
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
  assert '8 devices: cpu' in text
  assert 'ZeroPlan: stage 2' in text and 'loss ' in text
  assert any(
    o.get('output_type') == 'display_data'
    for c in nb.cells
    if c.cell_type == 'code'
    for o in c.outputs
  )
