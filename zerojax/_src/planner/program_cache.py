"""Compiled programs kept between plans and between a search's candidates.

A TPU compile of a 70B step takes half a minute or more of a small machine, and
what the planner reads from it (the optimized HLO text, `memory_analysis()`,
`cost_analysis()`) is a few hundred kilobytes. `compile_program` keeps that
record, keyed by everything that decides the compiled program: the lowered
module's text, the topology, the jax, jaxlib and libtpu versions and the XLA
flags. A plan or search that lowers the same program again (the same command
run twice, a search's winner planned on its own, a search widened by one option,
two candidates that happen to lower alike) reads the record instead of
compiling. The planner's analyses (collectives, FLOPs, step time) always run on
the record's text, so a newer zerojax reads an older record afresh.

The compiler's refusal of a program that does not fit (RESOURCE_EXHAUSTED) is
kept too, with its message. Nothing else is: any other error raises as it did.

jax's own persistent compilation cache keeps executables, which a compile-only
TPU client cannot load again (measured with libtpu 0.0.42: the second run
compiles anew), and the planner needs only the analyses.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import importlib.metadata
import json
import os
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import jax

from zerojax._src import runtime
from zerojax._src.planner import report as report_lib

FORMAT = 3  # bump when the record's fields change
ENV = 'ZEROJAX_CACHE_DIR'


def default_dir() -> Path:
  """`$ZEROJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/zerojax/programs` (~/.cache/...)."""
  if os.environ.get(ENV):
    return Path(os.environ[ENV]).expanduser()
  base = os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
  return Path(base) / 'zerojax' / 'programs'


@dataclasses.dataclass(frozen=True)
class CachedProgram:
  """What the planner reads from a compiled program, read back from the cache.

  It answers the three calls the planner makes on a compiled program
  (`memory_analysis`, `cost_analysis`, `as_text`); it cannot run.
  """

  text: str
  memory: dict[str, int]
  cost: dict[str, float] | None
  compile_seconds: float  # what the first compile took
  platform: str  # where the program runs ('tpu', 'cpu', ...)

  def memory_analysis(self) -> Any:
    return types.SimpleNamespace(**self.memory)

  def cost_analysis(self) -> dict[str, float] | None:
    return self.cost

  def as_text(self) -> str:
    return self.text


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One compile's outcome: the program (compiled, or read back), its optimized HLO text,
  and where it came from."""

  program: Any
  text: str
  source: str  # 'compiled', 'cache' (the disk cache) or 'memo' (earlier in this run)
  seconds: float  # XLA compile seconds of this call (0 when read back)
  first_compile_seconds: float  # what compiling it took when it was compiled
  platform: str  # where the program runs ('tpu', 'cpu', ...)


def _versions() -> dict[str, str]:
  found = {}
  for dist in ('jax', 'jaxlib', 'libtpu'):
    try:
      found[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      found[dist] = ''
  return found


def program_key(lowered: Any, topology: str, compiler_options: dict[str, Any] | None = None) -> str:
  """sha256 of what decides the compiled program: the lowered module, the topology,
  the jax, jaxlib and libtpu versions, the flags XLA and libtpu read and the compiler
  options passed with the program."""
  h = hashlib.sha256()
  context = {
    'format': FORMAT,
    'topology': topology,
    'versions': _versions(),
    'flags': {k: os.environ.get(k, '') for k in ('XLA_FLAGS', 'LIBTPU_INIT_ARGS')},
  }
  if compiler_options:  # keys written before options existed stay the same without them
    context['compiler_options'] = {k: str(v) for k, v in compiler_options.items()}
  h.update(json.dumps(context, sort_keys=True).encode())
  h.update(lowered.as_text().encode())
  return h.hexdigest()


def _memory(compiled: Any) -> dict[str, int]:
  m = compiled.memory_analysis()
  names = ('argument', 'output', 'alias', 'temp', 'generated_code')
  names += tuple(f'host_{n}' for n in names)
  sizes = {f'{n}_size_in_bytes': int(getattr(m, f'{n}_size_in_bytes', 0)) for n in names}
  for name in ('peak_memory_in_bytes', 'total_allocation_bytes'):  # where jax reports them
    sizes[name] = int(getattr(m, name, 0) or 0)
  return sizes


def _cost(compiled: Any) -> dict[str, float] | None:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else None
  if cost is None:
    return None
  return {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))}


def _path(cache_dir: Path, key: str) -> Path:
  return cache_dir / key[:2] / f'{key}.json.gz'


def _read(path: Path) -> dict | None:
  try:
    with gzip.open(path, 'rt', encoding='utf-8') as f:
      record = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError, EOFError):  # a record cut short: compile again, rewrite it
    return None
  return record if record.get('format') == FORMAT else None


def _write(path: Path, record: dict) -> None:
  """Writes `record` whole or not at all (a temporary file renamed into place), so a
  run stopped mid-write, or two runs writing at once, leave no half record."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix='.tmp')
  try:
    with os.fdopen(fd, 'wb') as raw, gzip.GzipFile(fileobj=raw, mode='wb') as f:
      f.write(json.dumps(record).encode('utf-8'))
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


class RecordedCompileError(jax.errors.JaxRuntimeError):
  """The compiler's error for a program, read back from its record instead of compiled again.

  Attributes:
    source: where the record came from ('cache' or 'memo').
  """

  def __init__(self, message: str, source: str):
    super().__init__(message)
    self.source = source


def _from_record(record: dict, source: str) -> Compiled:
  if 'error' in record:
    raise RecordedCompileError(record['error'], source)
  program = CachedProgram(
    record['text'], record['memory'], record['cost'], record['compile_seconds'], record['platform']
  )
  return Compiled(program, program.text, source, 0.0, program.compile_seconds, program.platform)


def compile_with_text(
  lowered: Any, compiler_options: dict[str, Any] | None = None
) -> tuple[Any, str]:
  """Compiles `lowered` (with `compiler_options`, as `jax.jit(..., compiler_options=...)`
  takes them) and returns the program with its optimized HLO text.

  The text is `as_text()`'s where it can print the program. Some jax and
  libtpu pairs (jax 0.10 with libtpu 0.0.52) cannot print v5p and v6e programs
  that hold asynchronous updates (an XLA RET_CHECK on their arity); where
  `as_text()` fails, the text is read from XLA's dump (`dumped_hlo_text`).
  """
  compiled = lowered.compile(compiler_options=compiler_options or None)
  try:
    return compiled, compiled.as_text()
  except jax.errors.JaxRuntimeError as e:
    try:
      return dumped_hlo_text(lowered, compiler_options)
    except Exception as dump_error:
      e.add_note(f"zerojax: reading the program from XLA's dump failed too: {dump_error}")
      raise e from None


def dumped_hlo_text(
  lowered: Any, compiler_options: dict[str, Any] | None = None
) -> tuple[Any, str]:
  """Compiles `lowered` with XLA's dump options and reads the optimized HLO it wrote.

  The same program as `as_text()` prints, as written by the compiler itself.
  jax 0.12's dump leaves out the loops' known trip counts, so
  `count_collectives` warns and counts a loop body once there.

  Raises:
    RuntimeError: XLA did not dump exactly one optimized module.
  """
  with tempfile.TemporaryDirectory() as folder:
    options = {**(compiler_options or {}), 'xla_dump_to': folder, 'xla_dump_hlo_as_text': True}
    compiled = lowered.compile(compiler_options=options)
    dumped = glob.glob(os.path.join(folder, '*after_optimizations.txt'))
    if len(dumped) != 1:
      raise RuntimeError(
        f'the compiled program cannot be printed here and XLA dumped {len(dumped)} optimized'
        ' modules for it (one expected), so its collectives cannot be counted.'
      )
    with open(dumped[0]) as f:
      return compiled, f.read()


def compile_program(
  lowered: Any,
  *,
  topology: str,
  cache_dir: str | os.PathLike | None = None,
  memo: dict[str, dict] | None = None,
  compiler_options: dict[str, Any] | None = None,
) -> Compiled:
  """Compiles `lowered`, or reads back the record of the same program compiled before.

  Args:
    lowered: `jax.jit(f).trace(...).lower()`.
    topology: the topology it is compiled for (part of the key).
    cache_dir: where records are kept between runs; None keeps none.
    memo: records of this run (a search's earlier candidates), by key.
    compiler_options: XLA or libtpu options for this compile (part of the key).

  Returns:
    A `Compiled`; its `program` is the executable when it was compiled here.

  Raises:
    jax.errors.JaxRuntimeError: the compiler's own error, or a kept refusal
      (RESOURCE_EXHAUSTED) of the same program.
  """
  if cache_dir is None and memo is None:
    start = time.perf_counter()
    program, text = compile_with_text(lowered, compiler_options)
    seconds = time.perf_counter() - start
    return Compiled(program, text, 'compiled', seconds, seconds, report_lib.platform_of(program))
  key = program_key(lowered, topology, compiler_options)
  if memo is not None and key in memo:
    return _from_record(memo[key], 'memo')
  path = None if cache_dir is None else _path(Path(cache_dir).expanduser(), key)
  record = None if path is None else _read(path)
  if record is not None:
    if memo is not None:
      memo[key] = record
    return _from_record(record, 'cache')
  start = time.perf_counter()
  base = {'format': FORMAT, 'topology': topology, 'versions': _versions()}
  try:
    program, text = compile_with_text(lowered, compiler_options)
  except jax.errors.JaxRuntimeError as e:
    if runtime.is_out_of_memory(e):
      _keep(path, memo, key, base | {'error': str(e)})
    raise
  seconds = time.perf_counter() - start
  record = base | {
    'platform': report_lib.platform_of(program),
    'compile_seconds': seconds,
    'text': text,
    'memory': _memory(program),
    'cost': _cost(program),
  }
  _keep(path, memo, key, record)
  return Compiled(program, text, 'compiled', seconds, seconds, record['platform'])


def _keep(path: Path | None, memo: dict | None, key: str, record: dict) -> None:
  if memo is not None:
    memo[key] = record
  if path is not None:
    try:
      _write(path, record)
    except OSError as e:  # a read-only or full disk costs the reuse, never the plan
      import warnings

      warnings.warn(
        f'zerojax: could not keep the compiled program in {path.parent} ({e}); the plan is'
        f' unaffected. Set {ENV} to a writable folder, or pass --no-cache.',
        stacklevel=3,
      )
