"""Counts the bytes `zerojax.checkpoint.load_safetensors` reads, tensor by tensor.

`count_reads(log)` replaces `safetensors.safe_open` with a wrapper whose slices append
(tensor name, bytes returned) to `log` each time they are read; it returns a function that
puts the original back. What is counted is what the safetensors library hands over.
"""

import numpy as np
import safetensors


class _Slice:
  def __init__(self, name, piece, log):
    self._name, self._piece, self._log = name, piece, log

  def __getitem__(self, index):
    value = self._piece[index]
    self._log.append((self._name, np.asarray(value).nbytes))
    return value

  def get_shape(self):
    return self._piece.get_shape()

  def get_dtype(self):
    return self._piece.get_dtype()


class _Handle:
  def __init__(self, handle, log):
    self._handle, self._log = handle, log

  def get_slice(self, name):
    return _Slice(name, self._handle.get_slice(name), self._log)

  def keys(self):
    return self._handle.keys()


def count_reads(log: list):
  real = safetensors.safe_open

  class Counting:
    def __init__(self, *args, **kwargs):
      self._inner = real(*args, **kwargs)

    def __enter__(self):
      return _Handle(self._inner.__enter__(), log)

    def __exit__(self, *exc):
      return self._inner.__exit__(*exc)

  safetensors.safe_open = Counting
  return lambda: setattr(safetensors, 'safe_open', real)
