"""The dependency bounds: each Python gets the jax/flax pair CI tests, and CI's oldest pins are the floors."""

import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _requirements():
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  return [Requirement(r) for r in project['dependencies']]


def _admits(python: str, name: str, version: str) -> bool:
  env = {'python_version': python, 'python_full_version': f'{python}.0'}
  return all(
    r.specifier.contains(version, prereleases=True)
    for r in _requirements()
    if canonicalize_name(r.name) == name and (r.marker is None or r.marker.evaluate(env))
  )


def test_each_python_admits_only_a_working_jax_flax_pair():
  # flax <= 0.12.8 fails to import beside jax >= 0.11.1; jax >= 0.11 needs Python >= 3.12.
  assert _admits('3.11', 'jax', '0.10.2') and _admits('3.11', 'flax', '0.12.8')
  for python in ('3.12', '3.13'):
    assert not _admits(python, 'flax', '0.12.8')
    assert not _admits(python, 'jax', '0.11.1')
    assert _admits(python, 'jax', '0.12.0.1') and _admits(python, 'flax', '0.12.12')


def test_the_tpu_extra_is_jax_own():
  # jax[tpu] pins the libtpu series each jax release pairs with.
  extras = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['optional-dependencies']
  assert extras['tpu'] == ['jax[tpu]']


def test_ci_oldest_pins_are_the_floors_on_python_3_11():
  pins = {}
  for line in (ROOT / '.ci' / 'oldest.txt').read_text().splitlines():
    line = line.split('#', 1)[0].strip()
    if line:
      r = Requirement(line)
      pins[canonicalize_name(r.name)] = str(next(iter(r.specifier)).version)
  env = {'python_version': '3.11', 'python_full_version': '3.11.0'}
  for r in _requirements():
    if r.marker is not None and not r.marker.evaluate(env):
      continue
    (floor,) = [s.version for s in r.specifier if s.operator == '>=']
    name = canonicalize_name(r.name)
    assert name in pins, f'{name} has a floor ({floor}) but no pin in .ci/oldest.txt'
    assert Version(pins[name]) == Version(floor), (name, pins[name], floor)


def test_no_test_module_imports_another():
  # Shared models and helpers live in tests/_models.py (and the small _*.py beside it).
  import ast

  for path in sorted((ROOT / 'tests').glob('*.py')):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      for name in names:
        assert not name.split('.')[-1].startswith('test_'), f'{path.name} imports {name}'
