"""Which committed TPU runs were compiled before the presets' programs last changed.

Every run records `model_revision` (`zerojax._src.planner.presets.MODEL_REVISION`: at its top
level, in its `versions`, or on each row of a run that keeps rows of an earlier one); a run that
records none is of revision 1. A table built from a run of an earlier revision says so under it,
so that a figure of a program the library no longer compiles is never read as a current one.
"""

from __future__ import annotations

import json
import os

from zerojax._src.planner import presets

# What each revision changed, for the notes under the tables.
CHANGES = {
  2: "before the gated presets rotated their queries and keys in the activations' dtype (Llama"
  " 2's presets and `decoder:` shapes were position-free, `hf:` configs rotated in float32)"
}


def of(record: dict) -> int:
  """The revision a run was compiled at: its own record (a run that keeps rows of an earlier
  one records the oldest), or the oldest of its rows' where older."""
  own = record.get('model_revision', record.get('versions', {}).get('model_revision', 1))
  rows = [r for r in record.get('rows', ()) if isinstance(r, dict) and 'model_revision' in r]
  return min([own, *(r['model_revision'] for r in rows)])


def row_of(record: dict, row: dict) -> int:
  """The revision one row of a run was compiled at: its own, else the run's."""
  return row.get('model_revision', of(record))


def current(row: dict) -> bool:
  """Whether a row records that it was compiled at the presets' revision (what `--reuse` and
  `--resume` keep; a row without a revision is of an earlier one)."""
  return row.get('model_revision') == presets.MODEL_REVISION


def mark(record: dict, row: dict) -> str:
  """' †' after a row of an earlier revision than the presets' (the note under the table)."""
  return ' †' if row_of(record, row) < presets.MODEL_REVISION else ''


def stale(out: str, prefixes: tuple[str, ...]) -> dict[str, int]:
  """{file name: revision} of each run in `out` whose name starts with one of `prefixes`
  (a .json) and whose revision is older than the presets'."""
  found = {}
  for name in sorted(os.listdir(out)):
    if name.endswith('.json') and name.startswith(prefixes):
      with open(os.path.join(out, name)) as f:
        revision = of(json.load(f))
      if revision < presets.MODEL_REVISION:
        found[name] = revision
  return found


def note(out: str, prefixes: tuple[str, ...], marked: bool = False) -> list[str]:
  """Lines to put under a table built from those runs (whose rows of an earlier revision are
  `marked` with †, or not): none when every run is current."""
  old = stale(out, prefixes)
  if not old:
    return []
  changes = sorted(
    {CHANGES[k] for r in old.values() for k in range(r + 1, presets.MODEL_REVISION + 1)}
  )
  return [
    '',
    f'{"The rows marked † were" if marked else "These runs were"} compiled'
    f' {" and ".join(changes)}: not the programs the presets compile now (model revision'
    f' {min(old.values())}; now {presets.MODEL_REVISION}). They are being compiled again'
    f' (`tools/regenerate_tpu_results.py`): {", ".join(old)}.',
  ]
