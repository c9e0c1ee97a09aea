"""Every walk over a jaxpr that zerojax makes, in one module.

- `is_gather`, `count_gathers`: the gathers a function runs (for the
  `recompute_gathers` policy, and the warning about unrolled layers);
- `dependencies`, `divisions_by`: what each value is computed from (the
  parameters, the batch), and divisions by values computed from the batch
  (`value_and_grad`'s check of a loss's normalisation);
- `traced_flops`: matmul FLOPs, loops counted per iteration (the plan search);
- `checkpoint_names`: the activation names a function tags, for a remat policy to keep.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.extend import core

# Bit flags of `dependencies`: a value computed from the parameters, from the batch.
PARAMS, BATCH = 1, 2

# The name of every gathered parameter (`checkpoint_name`), for jax.checkpoint policies.
GATHERED = 'zerojax_gathered'


def _eqns(jaxpr: Any) -> list:
  """The equations of an open or closed jaxpr."""
  return getattr(getattr(jaxpr, 'jaxpr', jaxpr), 'eqns', [])


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
  """The jaxprs (open or closed) among an equation's parameters: bodies, branches, calls."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(sub, 'eqns') or hasattr(getattr(sub, 'jaxpr', None), 'eqns'):
        yield sub


def _call_body(eqn: Any) -> Any:
  """The inner jaxpr of a call whose operands map one to one onto its inputs (pjit,
  custom_vjp, checkpoint), or None."""
  inner = eqn.params.get('jaxpr', eqn.params.get('call_jaxpr'))
  inner = getattr(inner, 'jaxpr', inner)
  if inner is not None and len(inner.invars) == len(eqn.invars):
    return inner
  return None


def _read(env: dict, v: Any) -> int:
  return 0 if isinstance(v, core.Literal) else env.get(v, 0)


# -- gathers -------------------------------------------------------------------------------


def is_gather(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr is a gather: it runs an all_gather (or names its result
  GATHERED), and no loop (a `custom_vjp` layer loop such as `scan_layers` computes)."""
  found = False
  for eqn in _eqns(jaxpr):
    name = eqn.primitive.name
    if name in ('scan', 'while'):
      return False
    found = found or name == 'all_gather' or name == 'name' and eqn.params['name'] == GATHERED
    for sub in sub_jaxprs(eqn):
      found = found or is_gather(sub)
  return found


def count_gathers(jaxpr: Any, in_loop: bool = False) -> tuple[int, int]:
  """All-gathers in a (closed) jaxpr: (outside any loop, inside a scan or while loop)."""
  outside = inside = 0
  for eqn in _eqns(jaxpr):
    name = eqn.primitive.name
    if name == 'all_gather':
      inside, outside = (inside + 1, outside) if in_loop else (inside, outside + 1)
    loop = in_loop or name in ('scan', 'while')
    for sub in sub_jaxprs(eqn):
      o, i = count_gathers(sub, loop)
      outside, inside = outside + o, inside + i
  return outside, inside


# -- what values are computed from --------------------------------------------------------


def dependencies(jaxpr: Any, in_deps: list[int]) -> dict:
  """Forward pass: for each variable of an open jaxpr, the bit flags of the inputs it is
  computed from (`in_deps`: one per input)."""
  env = dict(zip(jaxpr.invars, in_deps))
  for eqn in jaxpr.eqns:
    ins = [_read(env, v) for v in eqn.invars]
    inner = _call_body(eqn)
    if inner is not None:
      inner_env = dependencies(inner, ins)
      outs = [_read(inner_env, v) for v in inner.outvars]
    else:
      outs = [int(np.bitwise_or.reduce(ins)) if ins else 0] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return env


def _live(jaxpr: Any, live_out: list[bool]) -> set:
  """Backward pass: the variables some live output is computed from."""
  live = {v for v, keep in zip(jaxpr.outvars, live_out) if keep and not isinstance(v, core.Literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, core.Literal))
  return live


def divisions_by(jaxpr: Any, in_deps: list[int], live_out: list[bool], flag: int) -> list[str]:
  """Divisions by a scalar computed from exactly the inputs `flag` marks, on the way to the
  outputs `live_out` marks: each as 'numerator / divisor' types."""
  env, live = dependencies(jaxpr, in_deps), _live(jaxpr, live_out)
  found = []
  for eqn in jaxpr.eqns:
    if not any(v in live for v in eqn.outvars):
      continue
    if eqn.primitive.name == 'div':
      divisor = eqn.invars[1]
      if _read(env, divisor) == flag and int(np.prod(divisor.aval.shape)) == 1:
        found.append(
          f'{eqn.invars[0].aval.str_short(short_dtypes=True)} /'
          f' {divisor.aval.str_short(short_dtypes=True)}'
        )
    inner = _call_body(eqn)
    if inner is not None:
      inner_live = [v in live for v in eqn.outvars]
      found += divisions_by(inner, [_read(env, v) for v in eqn.invars], inner_live, flag)
  return found


# -- FLOPs ----------------------------------------------------------------------------------


def traced_flops(jaxpr: Any) -> float:
  """Matmul and convolution FLOPs of a traced step, per device, loops counted per iteration.

  XLA's `cost_analysis()` counts a `while` body once, so a scanned model's FLOPs
  come out about one layer's worth; this walks the jaxpr instead: a scan's body
  counts `length` times, rematerialised code as often as it runs. Inside
  `shard_map` shapes are per device, which is where `value_and_grad` runs the
  model; operations outside it count at their global size.

  Raises:
    ValueError: a `while` loop with a matmul inside (its trip count is not in the
      jaxpr, and it is not guessed).
  """
  total = 0.0
  for eqn in _eqns(jaxpr):
    name = eqn.primitive.name
    if name == 'dot_general':
      (lhs_contract, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    elif name == 'conv_general_dilated':
      rhs = eqn.invars[1].aval.shape  # kernel: out features, in features / groups, window...
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[1:])
    elif name == 'scan':
      total += eqn.params['length'] * traced_flops(eqn.params['jaxpr'])
    elif name == 'while':
      if traced_flops(eqn.params['body_jaxpr']):
        raise ValueError('a while loop with matmuls: its trip count is not in the jaxpr')
    elif name == 'cond':
      total += max(traced_flops(b) for b in eqn.params['branches'])
    else:
      total += sum(traced_flops(sub) for sub in sub_jaxprs(eqn))
  return total


def checkpoint_names(jaxpr: Any) -> set[str]:
  """The activation names a function tags (`jax.ad_checkpoint.checkpoint_name`), in its body
  and every loop, branch, call and `jax.checkpoint` inside it: what a remat policy can keep."""
  found = set()
  for eqn in _eqns(jaxpr):
    if eqn.primitive.name == 'name' and isinstance(eqn.params.get('name'), str):
      found.add(eqn.params['name'])
    for sub in sub_jaxprs(eqn):
      found |= checkpoint_names(sub)
  return found
