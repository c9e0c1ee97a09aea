"""The version: one place, read by pyproject.toml and the package alike."""

import importlib.metadata

import zerojax
from zerojax._src import version


def test_the_package_and_its_metadata_agree():
  assert zerojax.__version__ == version.__version__ == '0.2.0'
  assert importlib.metadata.version('zerojax') == zerojax.__version__
