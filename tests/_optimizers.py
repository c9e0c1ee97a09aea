"""Every optimizer that optax and optax.contrib export, discovered from the installed version.

An optimizer is a public function with a `learning_rate` (or `max_learning_rate`)
parameter and no other required argument; it is built with a learning rate of
1e-2 and kept if one plain-optax step runs. Nothing is chosen by hand, so a new
optax release brings its new optimizers into the equivalence tests.
"""

import inspect

import jax
import optax
import optax.contrib
from _models import batch, loss_fn, mlp_params

LEARNING_RATE_ARGS = ('learning_rate', 'max_learning_rate')


def _required(sig: inspect.Signature) -> set[str]:
  kinds = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
  )
  return {
    name
    for name, p in sig.parameters.items()
    if p.default is inspect.Parameter.empty and p.kind in kinds
  }


def _candidates():
  for module, prefix in ((optax, 'optax'), (optax.contrib, 'optax.contrib')):
    for name in sorted(dir(module)):
      fn = getattr(module, name)
      if name.startswith('_') or not inspect.isfunction(fn):
        continue
      try:
        sig = inspect.signature(fn)
      except (TypeError, ValueError):
        continue
      lr = [a for a in LEARNING_RATE_ARGS if a in sig.parameters]
      if lr and _required(sig) <= set(lr):
        yield f'{prefix}.{name}', fn, lr[0]


def _runs(make, extra: bool) -> bool:
  """Whether one plain-optax step of `make()` runs in the installed version."""
  params = mlp_params()
  x, y = batch()
  tx = optax.with_extra_args_support(make())

  def step(params):
    state = tx.init(params)
    value, grads = jax.value_and_grad(loss_fn)(params, x, y)
    kwargs = dict(value=value, grad=grads, value_fn=lambda p: loss_fn(p, x, y)) if extra else {}
    return tx.update(grads, state, params, **kwargs)

  try:
    jax.eval_shape(step, params)  # traced, not run: quick, and fails where a run would
  except Exception:  # noqa: BLE001 - an optimizer that fails in plain optax is not ours to test
    return False
  return True


def discover() -> dict:
  """name -> (a zero-argument factory of the optimizer, whether it needs extra args).

  Extra args are `value`, `grad` and `value_fn` (line searches, Polyak steps).
  """
  found = {}
  for name, fn, lr in _candidates():
    make = lambda fn=fn, lr=lr: fn(**{lr: 1e-2})
    if _runs(make, extra=False):
      found[name] = (make, False)
    elif _runs(make, extra=True):
      found[name] = (make, True)
  return found


OPTIMIZERS = discover()
