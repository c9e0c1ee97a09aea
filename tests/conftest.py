"""Test set-up: one faked 8-device CPU mesh for the whole suite."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

# Before jax initialises its backend: eight CPU devices, and no TPU probing by
# libtpu (installed for ahead-of-time TPU compilation only).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# libtpu is only used to compile for TPU topologies ahead of time; test workers
# may each load it.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
# The CPU programs' machine code is built without LLVM's optimisations: most of the suite's
# time is compiling small programs that then run a few steps, and this compiles them in about
# two thirds of the time. What the tests assert is above it (values, layouts, the optimized HLO's
# collectives and buffer sizes); the TPU compiler is not affected. Set the flag in XLA_FLAGS
# (`--xla_backend_optimization_level=2`, XLA's default) to test with optimised machine code.
if '--xla_backend_optimization_level' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_backend_optimization_level=0'


def _xla_takes(flag: str) -> bool:
  """Whether this jaxlib's XLA knows `flag` (it ends the process on a flag it does not know, so
  a child process asks)."""
  env = {**os.environ, 'XLA_FLAGS': f'{os.environ["XLA_FLAGS"]} {flag}'}
  probe = [sys.executable, '-c', 'import jax; jax.devices()']
  return subprocess.run(probe, env=env, capture_output=True).returncode == 0


# And with XLA:CPU's elemental emitters, not its MLIR fusion emitters: they compile the suite's
# programs in about two thirds of the time again (the whole suite on 2 cores: 9.7 min against
# 14 min). Both are XLA's own code generators; the optimized HLO keeps its collectives and
# differs in how lone instructions are wrapped for the emitter, and results in the order of
# rounding. XLA_FLAGS that name the flag are kept as they are.
# The test workers inherit the verdict: the flag in XLA_FLAGS, or this variable where XLA lacks it.
_EMITTERS, _LACKED = '--xla_cpu_use_fusion_emitters', 'ZEROJAX_TEST_XLA_LACKS_EMITTERS_FLAG'
if _EMITTERS not in os.environ['XLA_FLAGS'] and _LACKED not in os.environ:
  if _xla_takes(f'{_EMITTERS}=false'):
    os.environ['XLA_FLAGS'] += f' {_EMITTERS}=false'
  else:
    os.environ[_LACKED] = '1'

# The planner's compiled TPU programs (`program_cache`) are kept for this run only, in one
# folder the test workers share (they inherit this variable), never in ~/.cache.
if 'ZEROJAX_CACHE_DIR' not in os.environ:
  os.environ['ZEROJAX_CACHE_DIR'] = tempfile.mkdtemp(prefix='zerojax-test-programs-')
  atexit.register(shutil.rmtree, os.environ['ZEROJAX_CACHE_DIR'], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

NUM_DEVICES = 8

# Modules whose tests share work: test_distributed.py's session fixture trains once for all its
# tests behind a lock (the other worker would wait on it), test_zero_stage.py compiles each form
# of every optimizer's run as one program (the other worker would compile it again). Each runs
# whole on one worker. pytest-xdist's
# own `xdist_group` marks do not group on pytest 9.2 (the group is written into `_nodeid`, which
# pytest 9.2 no longer reads), so the groups are given here, by module, to its scheduler.
GROUPED_MODULES = ('test_distributed.py', 'test_zero_stage.py')


def pytest_xdist_make_scheduler(config, log):
  """`--dist loadgroup`, with `GROUPED_MODULES` each sent whole to one worker."""
  if config.getvalue('dist') != 'loadgroup':
    return None
  from xdist.scheduler import LoadGroupScheduling

  class ModuleGroups(LoadGroupScheduling):
    def _split_scope(self, nodeid: str) -> str:
      module = nodeid.split('::', 1)[0]
      if module.endswith(GROUPED_MODULES):
        return module
      return super()._split_scope(nodeid)

  return ModuleGroups(config, log)


@pytest.fixture(scope='session', autouse=True)
def _check_devices():
  assert len(jax.devices()) == NUM_DEVICES, jax.devices()


def needs_devices(n: int):
  return pytest.mark.skipif(len(jax.devices()) < n, reason=f'needs {n} devices')


@pytest.fixture(params=['explicit', 'auto'])
def mesh(request):
  """An 8-device mesh with one axis 'data', of Explicit or Auto type."""
  kind = AxisType.Explicit if request.param == 'explicit' else AxisType.Auto
  return jax.make_mesh((NUM_DEVICES,), ('data',), axis_types=(kind,))


@pytest.fixture
def auto_mesh():
  return jax.make_mesh((NUM_DEVICES,), ('data',), axis_types=(AxisType.Auto,))


@pytest.fixture
def explicit_mesh():
  return jax.make_mesh((NUM_DEVICES,), ('data',))


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  doctest_namespace['jax'] = jax


def _unset_mesh(where: str) -> None:
  left = [m for m in (jax.sharding.get_abstract_mesh(), jax.sharding.get_mesh()) if not m.empty]
  if left:
    jax.set_mesh(None)
    warnings.warn(f'a mesh was left set {where}: {left[0]}; unset', stacklevel=2)


@pytest.fixture(autouse=True)
def _no_mesh_left_set(request):
  """Each test starts with no mesh set, whatever ran before it on this worker, and one that
  leaves a mesh set (`jax.set_mesh` called without `with`, a context entered and never left) is
  named in the warnings summary. Without this a later test runs under that mesh (its eager
  arrays placed on it), and which test fails depends on how the tests were distributed."""
  _unset_mesh(f'before {request.node.nodeid}')
  yield
  _unset_mesh(f'by {request.node.nodeid}')
