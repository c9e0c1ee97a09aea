"""The one place where zerojax follows an API that moved between JAX releases.

zerojax supports the JAX releases its `pyproject.toml` admits and tests both
ends of that range in CI. Where JAX renamed or reshaped a public API inside the
range, the choice is made here, once, by JAX's version (never by catching the
error of the other form), and each entry says which release changed what.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import compute_on as _compute_on

# jax 0.11.1 removed the context-manager `compute_on(compute_type)` and gave its
# name to the function form that jax 0.10 called `compute_on2`; both take
# `compute_type=` and `out_memory_spaces=` (a prefix of the outputs' tree).
COMPUTE_ON_RENAMED = jax.__version_info__ >= (0, 11, 1)


def compute_on_host(
  fn: Callable[..., Any], out_memory_spaces: Any, typed_as_device: bool = True
) -> Callable[..., Any]:
  """`fn` compiled to run on the host (`compute_type='device_host'`).

  Args:
    fn: the function to run on the host; its inputs should be in host memory.
    out_memory_spaces: a `jax.memory.Space` for every output, or a prefix of
      the outputs' tree.
    typed_as_device: type the inputs as device memory inside `fn` (needed when
      `fn` creates arrays, see below). A function of its inputs alone can leave
      it off. Either way the TPU compiler keeps an output in device memory when
      another host computation reads it: chain host work inside one call.

  Returns:
    A function with `fn`'s signature, to be called inside `jax.jit`.
  """
  form = _compute_on.compute_on if COMPUTE_ON_RENAMED else _compute_on.compute_on2

  if not typed_as_device:
    return form(fn, compute_type='device_host', out_memory_spaces=out_memory_spaces)

  def device_typed(*args):
    # Inside, arrays are typed as device memory: JAX types the arrays a body
    # creates (`zeros_like` in optax's clipping and norms, constants) as device
    # memory and refuses to mix them with host-typed inputs. The compiler places
    # the whole computation in host memory all the same (compiled for TPU, it
    # has no device temporaries).
    device = jax.memory.Space.Device
    out = fn(*jax.tree.map(lambda x: jax.device_put(x, device), args))
    put = lambda space, tree: jax.tree.map(lambda x: jax.device_put(x, space), tree)
    return jax.tree.map(put, out_memory_spaces, out)

  return form(device_typed, compute_type='device_host', out_memory_spaces=out_memory_spaces)


# jax 0.12 fails to lower `psum_scatter` inside a `shard_map` that leaves an Explicit mesh axis
# automatic (manual over the ZeRO axis, Explicit over a tensor axis): the lowering gives the
# reduction's scalar the operand's sharding ("Length of sharding.spec (2) must be equal to
# aval's ndim (0)"), and `all_gather`'s transpose is that same `psum_scatter`. jax 0.10 lowers
# it; 0.11 is taken to share 0.12's lowering. There zerojax reduce-scatters with an all-to-all
# and a local sum, which moves the same bytes.
PSUM_SCATTER_BESIDE_EXPLICIT_FAILS = jax.__version_info__ >= (0, 11)


def psum_scatter_fails_here() -> bool:
  """Whether `psum_scatter` cannot be lowered where it is being traced (see above)."""
  if not PSUM_SCATTER_BESIDE_EXPLICIT_FAILS:
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
