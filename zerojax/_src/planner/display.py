"""What the planner draws in a terminal (rich): a search's progress, each candidate's phases and
where its time went, and a spinner while one program compiles. The only module that imports
rich."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def candidate_progress(total: int, *, enabled: bool) -> Iterator[tuple[Callable, Callable]]:
  """A progress bar over a search's candidates: yields (starting(label), finished(line)), to
  call before and after each candidate; `finished` prints its line above the bar."""
  from rich.progress import Progress

  with Progress(disable=not enabled, transient=False) as bar:
    task = bar.add_task('compiling candidates', total=total)

    def starting(label: str) -> None:
      bar.update(task, description=f'{label:<60}')

    def finished(line: str) -> None:
      bar.console.print(line, soft_wrap=True)
      bar.advance(task)

    yield starting, finished


@contextlib.contextmanager
def working(message: str) -> Iterator[None]:
  """A spinner with `message` on stderr while the block runs."""
  from rich.console import Console

  with Console(stderr=True).status(message):
    yield


_SOURCE = {'cache': 'read back from the cache', 'memo': 'the same program as an earlier one'}


def phases(r: Any) -> str:
  """'(lower 0.4 s, compile 31.2 s, analyse 0.9 s)', or how the program was reused."""
  if not r.phase_seconds:
    return ''
  parts = [f'{k} {v:.1f} s' for k, v in r.phase_seconds.items()]
  if r.program_source in _SOURCE:
    parts[1:2] = [_SOURCE[r.program_source]]
  return '(' + ', '.join(parts) + ')'


def phase_totals(report: Any) -> tuple[dict[str, float], dict[str, int]]:
  """(seconds by phase, programs by where they came from: compiled, cache, memo) of a
  `search.SearchReport`."""
  totals: dict[str, float] = {}
  for r in report.results:
    for k, v in r.phase_seconds.items():
      totals[k] = totals.get(k, 0.0) + v
  sources = [r.program_source for r in report.results if r.program_source]
  return totals, {s: sources.count(s) for s in ('compiled', 'cache', 'memo')}


def phase_summary(report: Any) -> str:
  """Where a search's time went, by phase, and how many programs it compiled or reused."""
  totals, counts = phase_totals(report)
  return (
    f'search: {report.seconds:.1f} s for {len(report.results)} candidates: '
    + ', '.join(f'{k} {v:.1f} s' for k, v in totals.items())
    + f'; {counts["compiled"]} programs compiled, {counts["cache"]} read back from the cache,'
    f" {counts['memo']} the same as an earlier candidate's"
  )
