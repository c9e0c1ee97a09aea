"""Every Python block of README.md runs as written, in order, in one namespace.

The README's first block is the prelude the others assume (a model, its loss, a
batch); later blocks may use what earlier ones defined, as a reader running them
in order would. They run in a temporary folder (checkpoints are written there).
"""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / 'README.md'


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(line number, code) of each ```python block."""
  blocks = []
  for m in re.finditer(r'^```python\n(.*?)^```', text, flags=re.S | re.M):
    blocks.append((text[: m.start()].count('\n') + 1, m.group(1)))
  return blocks


def test_readme_has_python_blocks():
  assert len(python_blocks(README.read_text())) >= 8


@pytest.mark.slow
def test_every_python_block_runs_as_written(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  namespace = {'__name__': '__readme__'}
  for line, code in python_blocks(README.read_text()):
    try:
      exec(compile(code, f'README.md:{line}', 'exec'), namespace)
    except Exception as e:
      raise AssertionError(
        f'the README block at line {line} failed: {type(e).__name__}: {e}'
      ) from e
  assert os.listdir(tmp_path) is not None
