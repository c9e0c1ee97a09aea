"""What the planner draws in a terminal (rich): a search's progress, and a spinner while one
program compiles. The only module that imports rich."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


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
