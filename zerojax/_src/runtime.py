"""Where zerojax reaches below a public API: every such place, and why, in one module.

Each entry names what it does, why no public API does it, and which test holds
it to its contract (`tests/test_runtime.py`). Nothing else in zerojax uses a
private Python or JAX API, exits the process, or reads an error's text to decide
what to do.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any


def before_thread_pools_stop(fn: Callable[[], Any]) -> None:
  """Runs `fn` at interpreter exit, before `concurrent.futures` stops its thread pools.

  An asynchronous checkpoint save finishes on orbax's threads. `atexit`
  callbacks run after the thread pools have been shut down, too late to finish
  one; Python runs `threading._register_atexit` callbacks before that, and
  has no public hook at that point (CPython 3.9+). Where the private function
  is missing, `atexit` is the fallback (a save then still finishes, or fails
  with orbax's own error, when the interpreter exits).
  """
  register = getattr(threading, '_register_atexit', atexit.register)
  register(fn)


def exit_from_watchdog(message: str, code: int) -> None:
  """Writes `message` to stderr and ends the process at once with `code`, from a thread.

  `jax.distributed.initialize` blocks the main thread inside JAX's C++ runtime
  while it waits for the other processes; neither an exception nor
  `sys.exit` from another thread can reach it there. `os._exit` is the only
  way to end the process with a message of zerojax's instead of a hang or the
  runtime's own later abort.
  """
  sys.stderr.write(message)
  sys.stderr.flush()
  os._exit(code)


def is_out_of_memory(error: BaseException) -> bool:
  """Whether an XLA error says the program does not fit (status RESOURCE_EXHAUSTED).

  `jax.errors.JaxRuntimeError` carries XLA's status only as the first word of
  its message (`RESOURCE_EXHAUSTED: ...`, absl's status code names); JAX has
  no attribute or subclass for it.
  """
  return str(error).startswith('RESOURCE_EXHAUSTED')


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
  """The TPU compiler's own figures from its out-of-memory message.

  Attributes:
    needed: what it needed, as it writes it ('15.85G'); None where the message gives none.
    available: what the chip has, as it writes it ('15.75G').
    what: what needed it ('The 3 buffers ... '), where the message names it.
    first_line: the message's first line.
  """

  needed: str | None
  available: str | None
  what: str
  first_line: str

  @classmethod
  def parse(cls, message: str) -> OutOfMemory:
    first = message.splitlines()[0][:120]
    found = re.search(
      r'required for ([^(]*)\(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)', message
    )
    if found:
      return cls(found.group(2), found.group(3), found.group(1).strip(), first)
    found = re.search(r'Used ([\d.]+\w?) of ([\d.]+\w?) hbm', message)
    if found:
      return cls(found.group(1), found.group(2), '', first)
    return cls(None, None, '', first)

  @property
  def needed_gigabytes(self) -> float | None:
    """`needed` in the compiler's G, where it writes it so."""
    return float(self.needed[:-1]) if self.needed and self.needed.endswith('G') else None

  def summary(self) -> str:
    """E.g. 'needs 15.85G of 15.75G (compiler)', for a search table; the message's first line
    where it gives no figures."""
    if self.needed is None:
      return self.first_line
    if self.what:
      return f'{self.what} need {self.needed} of {self.available} (compiler)'
    return f'needs {self.needed} of {self.available} (compiler)'


def out_of_memory_summary(message: str) -> str:
  """The TPU compiler's own figures from its out-of-memory message (`OutOfMemory.summary`)."""
  return OutOfMemory.parse(message).summary()


def is_manual_axis_layout_error(error: BaseException) -> bool:
  """Whether JAX refused a layout that names a mesh axis that is manual where it was asked
  for (inside `jax.shard_map`): an `out_sharding=` or `jax.sharding.reshard` over such an axis.

  JAX raises it as a plain ValueError or NotImplementedError with no attribute or subclass of
  its own (jax 0.10: "... cannot contain axis names that are of type Auto or Manual ...";
  later releases: "Going from Manual AxisType to Auto or Explicit AxisType is not allowed"):
  only its text tells it from the loss's own errors, and zerojax uses it only to word a note.
  """
  text = str(error)
  return isinstance(error, (ValueError, NotImplementedError)) and (
    'Manual' in text and 'AxisType' in text
  )
