"""The compiled programs of zerojax's update paths, fingerprinted: a change inside the core that
means to move nothing for users (a refactor) leaves each one the same, to the instruction.

Each program below is built the way users build it (the optimizer line, `value_and_grad`, a
train state, `nnx.Optimizer`, a tensor-parallel mesh, Explicit axes, offload on the host) at
stages 0-3, compiled, and its optimized HLO text, with debug information stripped, hashed. The
hashes are recorded per jax and jaxlib version in `tests/data/programs.json`:

  ZEROJAX_RECORD_PROGRAMS=1 .venv/bin/python -m pytest tests/test_same_programs.py

records them (run it before the change, and commit the file); afterwards the test asserts that
every program is what was recorded. A version with no record is skipped, saying so.
"""

import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import batch, loss_fn, mlp_apply, mlp_params
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import presets

RECORD = os.path.join(os.path.dirname(__file__), 'data', 'programs.json')
VERSION = f'jax {jax.__version__} / jaxlib {jax.lib.__version__}'
STAGES = (0, 1, 2, 3)


_DEBUG_TABLES = ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames')


def stripped(text: str) -> str:
  """Optimized HLO text without what names the Python source: each instruction's metadata and
  the tables of files, functions and stack frames it points into."""
  kept, skipping = [], False
  for line in text.splitlines():
    if line.strip() in _DEBUG_TABLES:
      skipping = True
    elif skipping and not line.strip():
      skipping = False
    elif not skipping:
      kept.append(re.sub(r',?\s*metadata=\{[^}]*\}', '', line))
  return '\n'.join(kept)


def fingerprint(compiled) -> str:
  return hashlib.sha256(stripped(compiled.as_text()).encode()).hexdigest()[:20]


def _mesh(shape=(8,), names=('data',), kind=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _data(mesh):
  return jax.device_put(batch(), NamedSharding(mesh, PartitionSpec('data')))


def _compiled_plain_step(tx, params, mesh):
  """jax's gradient, `tx.update` and `optax.apply_updates` in one jitted step, compiled."""
  state = tx.init(params)

  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, state, *_data(mesh)).compile()


def _optimizer_line(stage, mesh):
  """On Explicit axes the parameters stay replicated: a plain loss reads them as typed."""
  tx = zerojax.zero_stage(optax.adamw(1e-2, weight_decay=0.1), stage, mesh=mesh)
  params = jax.device_put(mlp_params(), zerojax.plan_for(tx, mlp_params()).params)
  if jax.sharding.AxisType.Explicit in mesh.axis_types:
    params = jax.device_put(mlp_params(), NamedSharding(mesh, PartitionSpec()))
  return _compiled_plain_step(tx, params, mesh)


def _value_and_grad(stage, mesh):
  tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh)
  params = jax.device_put(mlp_params(), zerojax.plan_for(tx, mlp_params()).params)
  state = tx.init(params)
  grad_fn = zerojax.value_and_grad(lambda p, b: loss_fn(p, *b), tx, micro_batches=2)

  def step(params, state, x, y):
    loss, grads = grad_fn(params, (x, y))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step).lower(params, state, *_data(mesh)).compile()


def _tensor_parallel(stage, _):
  """A 4x2 Auto mesh, the kernels split over 'model' by the program, no param_specs: the layouts
  travel in the state `tx.init` returns."""
  mesh = _mesh((4, 2), ('data', 'model'))
  specs = {
    'dense1': {'kernel': PartitionSpec(None, 'model'), 'bias': PartitionSpec('model')},
    'dense2': {'kernel': PartitionSpec('model', None), 'bias': PartitionSpec()},
  }
  params = jax.device_put(mlp_params(), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh)
  params = jax.device_put(params, zerojax.plan_for(tx, params).params)
  return _compiled_plain_step(tx, params, mesh)


def _train_state(stage, mesh):
  state = zerojax.create_train_state(
    lambda k: mlp_params(),
    jax.random.key(0),
    tx=zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh),
    apply_fn=mlp_apply,
  )

  def step(state, x, y):
    grads = jax.grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads)

  return jax.jit(step).lower(state, *_data(mesh)).compile()


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.dense1 = nnx.Linear(16, 64, rngs=rngs)
    self.dense2 = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.dense2(jnp.tanh(self.dense1(x)))


def _nnx_optimizer(stage, mesh):
  tx = zerojax.zero_stage(optax.adam(1e-2), stage, mesh=mesh)
  model = zerojax.nnx.create_model(lambda: _MLP(nnx.Rngs(0)), tx)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  return jax.jit(step).lower(state, *_data(mesh)).compile()


def _offload(stage, mesh, update_on='host', offload_params=False):
  """The tiny scanned bf16 decoder under mixed_precision, its master and moments in host memory,
  the update on the host (or streamed), the new parameters from `apply_gradients`."""
  cfg = presets.PRESETS['tiny']
  tx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.adamw(1e-2, weight_decay=0.1)),
    stage,
    mesh=mesh,
    offload='opt_state+master',
    update_on=update_on,
    offload_params=offload_params,
  )
  master = presets.init_decoder(cfg, jax.random.key(0))
  plan = zerojax.plan_for(tx, master)
  master = jax.device_put(master, jax.tree.map(lambda s: s.with_memory_kind('device'), plan.params))
  opt_state = tx.init(master)
  params = jax.device_put(zerojax.cast(master, jnp.bfloat16), plan.params)
  loss = lambda p, b: presets.decoder_loss(p, b, cfg, plan=plan)
  grad_fn = zerojax.value_and_grad(loss, tx, per_layer=stage >= 2)

  def step(params, opt_state, tokens):
    value, grads = grad_fn(params, tokens)
    params, opt_state = _apply_gradients(tx, grads, opt_state, params)
    return params, opt_state, value

  tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, cfg.vocab)
  tokens = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec('data')))
  return jax.jit(step).lower(params, opt_state, tokens).compile()


def _apply_gradients(tx, grads, opt_state, params):
  return zerojax.apply_gradients(tx, grads, opt_state, params)


PROGRAMS = {
  **{f'optimizer line, stage {s}': (_optimizer_line, s, AxisType.Auto) for s in STAGES},
  **{
    f'optimizer line, Explicit, stage {s}': (_optimizer_line, s, AxisType.Explicit) for s in STAGES
  },
  **{f'value_and_grad, stage {s}': (_value_and_grad, s, AxisType.Auto) for s in STAGES},
  **{f'tensor-parallel 4x2, stage {s}': (_tensor_parallel, s, AxisType.Auto) for s in STAGES},
  **{f'train state, stage {s}': (_train_state, s, AxisType.Auto) for s in STAGES},
  **{f'nnx.Optimizer, stage {s}': (_nnx_optimizer, s, AxisType.Auto) for s in STAGES},
  'offload on the host, stage 2': (_offload, 2, AxisType.Auto),
  'offload streamed, stage 3': (lambda s, m: _offload(s, m, 'stream'), 3, AxisType.Auto),
  'offloaded parameters, stage 3': (
    lambda s, m: _offload(s, m, 'host', offload_params=True),
    3,
    AxisType.Auto,
  ),
}


def _recorded() -> dict:
  if not os.path.exists(RECORD):
    return {}
  with open(RECORD) as f:
    return json.load(f)


@pytest.mark.parametrize('name', list(PROGRAMS))
def test_the_compiled_program_is_the_recorded_one(name):
  build, stage, kind = PROGRAMS[name]
  compiled = build(stage, _mesh(kind=kind))
  got = fingerprint(compiled)
  if os.environ.get('ZEROJAX_RECORD_PROGRAMS'):
    records = _recorded()
    records.setdefault(VERSION, {})[name] = got
    with open(RECORD, 'w') as f:
      json.dump(records, f, indent=1, sort_keys=True)
      f.write('\n')
    return
  recorded = _recorded().get(VERSION)
  if recorded is None or name not in recorded:
    pytest.skip(f'no fingerprint of {name!r} recorded for {VERSION}')
  assert got == recorded[name], f'{name}: the compiled program changed'
