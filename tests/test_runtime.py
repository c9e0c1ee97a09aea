"""zerojax/_src/runtime.py: the one module that reaches below a public API, held to its contract."""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import pytest

from zerojax._src import runtime


def test_before_thread_pools_stop_runs_while_thread_pools_still_take_work():
  # An atexit callback is too late to finish work on a ThreadPoolExecutor; this one is not.
  code = (
    'import concurrent.futures\n'
    'from zerojax._src import runtime\n'
    'pool = concurrent.futures.ThreadPoolExecutor(1)\n'
    'def finish():\n'
    '  print("finished", pool.submit(lambda: 6 * 7).result(), flush=True)\n'
    'runtime.before_thread_pools_stop(finish)\n'
  )
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == 'finished 42'
  # The private hook it relies on is still there on this Python (else it falls back to atexit).
  assert hasattr(threading, '_register_atexit')


def test_exit_from_watchdog_ends_a_blocked_process_with_its_message_and_code():
  code = (
    'import threading, time\n'
    'from zerojax._src import runtime\n'
    'threading.Thread(target=runtime.exit_from_watchdog, args=("zerojax: gave up\\n", 17)).start()\n'
    'time.sleep(60)\n'  # the main thread blocked, as inside jax.distributed.initialize
    'print("not reached")\n'
  )
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 17
  assert proc.stderr == 'zerojax: gave up\n' and proc.stdout == ''


def test_out_of_memory_is_read_from_xla_status():
  assert runtime.is_out_of_memory(RuntimeError('RESOURCE_EXHAUSTED: Ran out of memory'))
  assert not runtime.is_out_of_memory(RuntimeError('INVALID_ARGUMENT: RESOURCE_EXHAUSTED later'))
  tpu = (
    'RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm.'
    ' Used 16.06G of 15.75G hbm. Exceeded hbm capacity by 318.5M.'
  )
  assert runtime.out_of_memory_summary(tpu) == 'needs 16.06G of 15.75G (compiler)'
  other = 'RESOURCE_EXHAUSTED: something else\nsecond line'
  assert runtime.out_of_memory_summary(other) == 'RESOURCE_EXHAUSTED: something else'


@pytest.mark.skipif(os.environ.get('JAX_PLATFORMS', 'cpu') != 'cpu', reason='CPU status text')
def test_a_real_allocation_failure_is_recognised():
  # What XLA:CPU raises for an allocation it cannot make: the status is the message's first word.
  try:
    jax.block_until_ready(jnp.zeros((1 << 62,), jnp.int8))
  except Exception as e:  # jax.errors.JaxRuntimeError, or a ValueError before allocation
    if 'RESOURCE_EXHAUSTED' in str(e):
      assert runtime.is_out_of_memory(e)
    else:
      assert not runtime.is_out_of_memory(e)
  else:
    pytest.fail('allocating 4 EiB succeeded')


def test_no_other_module_uses_what_runtime_isolates():
  import pathlib

  src = pathlib.Path(runtime.__file__).parent
  for path in sorted(src.glob('*.py')):
    if path.name == 'runtime.py':
      continue
    text = path.read_text()
    for needle in (
      'os._exit',
      'threading._',
      "'RESOURCE_EXHAUSTED",
      '__signature__',
      '__class__ =',
    ):
      assert needle not in text, f'{path.name} uses {needle}'
