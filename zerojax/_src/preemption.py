"""Preemption: the SIGTERM notice of one process, and what a preempted save raises.

In one process a handler notes the notice and the next `Checkpointer.save` writes that step;
with several processes JAX's own preemption service picks the step (see `checkpoint`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

# What a preempted process exits with: 128 + SIGTERM, as if the signal had ended it.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(SystemExit):
  """Raised by `Checkpointer.save` once the checkpoint of a preemption notice is committed.

  A `SystemExit` with code 143 (`PREEMPTED_EXIT_CODE`): uncaught, the process
  ends with that code after `finally` blocks and `with` exits have run. Catch
  it to exit with another code, or to do more before exiting.

  Attributes:
    step: the step saved.
    directory: the checkpoint folder.
  """

  def __init__(self, step: int, directory: str):
    super().__init__(PREEMPTED_EXIT_CODE)
    self.step = step
    self.directory = directory

  def __str__(self) -> str:
    return (
      f'preempted: checkpoint step {self.step} is committed in {self.directory}; exiting'
      f' with code {PREEMPTED_EXIT_CODE}'
    )


class SigtermNotice:
  """One process's preemption notice: SIGTERM noted by a handler instead of ending the process.

  The previous handler comes back on `uninstall`; a notice no save acted on is
  then delivered to it, so the process still ends as it was asked to.
  """

  def __init__(self, directory: str):
    if threading.current_thread() is not threading.main_thread():
      raise ValueError(
        'Checkpointer(save_on_preemption=True) installs a SIGTERM handler, which Python allows'
        ' only in the main thread: create the Checkpointer there.'
      )
    self.directory = directory
    self.received: float | None = None  # time.monotonic() of the first SIGTERM
    self.repeats = 0
    self.acted = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum: int, frame: Any) -> None:
    del signum, frame
    if self.received is not None:
      self.repeats += 1  # a second notice changes nothing: the save is already due
      return
    self.received = time.monotonic()
    print(
      f'zerojax: SIGTERM received; the next Checkpointer.save saves that step in'
      f' {self.directory}, then the process exits with code {PREEMPTED_EXIT_CODE}',
      file=sys.stderr,
      flush=True,
    )

  def uninstall(self) -> None:
    if signal.getsignal(signal.SIGTERM) == self._handle:
      signal.signal(signal.SIGTERM, self._previous)
    if self.received is not None and not self.acted:
      print(
        'zerojax: SIGTERM arrived but no Checkpointer.save came after it; passing it on',
        file=sys.stderr,
        flush=True,
      )
      os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def interrupts_held():
  """Holds Ctrl-C (SIGINT) while a preemption save commits (the process exits after it)."""
  if threading.current_thread() is not threading.main_thread():
    yield []
    return
  held: list[int] = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
  try:
    yield held
  finally:
    signal.signal(signal.SIGINT, previous)
