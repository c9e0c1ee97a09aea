"""The docstring examples run, and the README's main job runs."""

import doctest
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import zerojax

ROOT = Path(__file__).resolve().parent.parent


def _modules():
  import zerojax._src as src

  return [f'zerojax._src.{m.name}' for m in pkgutil.iter_modules(src.__path__)]


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
  table = proc.stdout.split('match  collectives')[1].splitlines()[1:5]
  assert [line.split()[0] for line in table] == ['0', '1', '2', '3']
  assert all(line.split()[4] == 'yes' for line in table)
  # The loss is the same under every stage.
  assert len({line.split()[1] for line in table}) == 1
  assert 'largest loss difference between stages: 0.00e+00' in proc.stdout
  assert (tmp_path / 'zero_stages.png').stat().st_size > 10_000
