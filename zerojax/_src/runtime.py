"""Where zerojax reaches below a public API: every such place, and why, in one module.

Each entry names what it does, why no public API does it, and which test holds
it to its contract (`tests/test_runtime.py`). Nothing else in zerojax uses a
private Python or JAX API, exits the process, or reads an error's text to decide
what to do.
"""

from __future__ import annotations

import atexit
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


def out_of_memory_summary(message: str) -> str:
  """The TPU compiler's own figures from its out-of-memory message, e.g. 'needs 15.85G of
  15.75G (compiler)', for a search table; the message's first line where it gives none."""
  found = re.search(
    r'required for ([^(]*)\(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)', message
  )
  if found:
    return f'{found.group(1).strip()} need {found.group(2)} of {found.group(3)} (compiler)'
  found = re.search(r'Used ([\d.]+\w?) of ([\d.]+\w?) hbm', message)
  if found:
    return f'needs {found.group(1)} of {found.group(2)} (compiler)'
  return message.splitlines()[0][:120]
