"""Shared set-up for the examples: faked devices, the mesh, logging, the memory table."""

from __future__ import annotations

import os
import sys


def setup_devices(n: int = 8) -> None:
  """Fakes `n` CPU devices unless real accelerators are asked for (JAX_PLATFORMS).

  Must run before jax initialises its backend.
  """
  if os.environ.get('JAX_PLATFORMS', 'cpu') == 'cpu':
    os.environ['JAX_PLATFORMS'] = 'cpu'
    flag = f'--xla_force_host_platform_device_count={n}'
    if flag not in os.environ.get('XLA_FLAGS', ''):
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()


def make_mesh():
  import jax
  from jax.sharding import AxisType

  return jax.make_mesh((len(jax.devices()),), ('data',), axis_types=(AxisType.Auto,))


def memory_table(plan, compiled) -> str:
  """Per-device bytes: the plan's model states and the compiled step's memory."""
  import zerojax

  sizes = plan.bytes_per_device()
  mem = zerojax.memory_stats(compiled)
  mib = lambda n: f'{n / 2**20:10.2f} MiB'
  rows = [
    ('params at rest', sizes['params']),
    ('grads (reduced)', sizes['grads']),
    ('optimizer state', sizes['opt_state']),
    *([('  + in host memory', sizes['host'])] if sizes['host'] else []),
    ('step arguments', mem.argument),
    ('step temporaries', mem.temp),
    ('step peak (est.)', mem.peak),
  ]
  return '\n'.join(f'  {name:<18}{mib(value)}' for name, value in rows)


def progress(iterable, **kwargs):
  from tqdm import tqdm

  return tqdm(iterable, file=sys.stdout, dynamic_ncols=True, **kwargs)


def train(
  *,
  model,
  init_inputs: dict,
  init_batch: dict,
  loss_fn,
  batch_at,
  stage: int,
  steps: int,
  tx,
  name: str = 'train',
  log_every: int = 10,
  quiet: bool = False,
  mesh=None,
  checkpoint_dir: str | None = None,
  save_every: int = 50,
  param_dtype=None,
  **zero_kwargs,
) -> dict:
  """Trains `model` under ZeRO `stage`: the loop every example shares.

  Args:
    model: a linen module; `model.init(key, **init_inputs)` builds it.
    init_inputs: keyword inputs for `model.init` (one example is enough).
    init_batch: a batch (dict of arrays) used to compile the step.
    loss_fn: (apply_fn, params, batch) -> scalar loss.
    batch_at: step -> batch (dict of numpy arrays, leading dimension the batch).
    stage: the ZeRO stage.
    steps: training steps.
    tx: the optax optimizer.
    checkpoint_dir: if given, save there every `save_every` steps (async,
      keeping the last 3) and resume from the latest checkpoint: state and
      data position, so the resumed run is bitwise the uninterrupted one.
    param_dtype: compute dtype of the parameters (with a mixed_precision tx).
    **zero_kwargs: more options of `zerojax.zero_stage` (offload, update_on, ...).

  Returns:
    losses [(step, loss)], the final state, the plan, the compiled step, the
    parameter count and this device's batch bytes.
  """
  import time

  import jax

  import zerojax

  mesh = mesh or make_mesh()
  zerojax.check_mesh(mesh)
  state = zerojax.create_train_state(
    lambda k: model.init(k, **init_inputs)['params'],
    jax.random.key(0),
    tx=zerojax.zero_stage(tx, stage, mesh=mesh, **zero_kwargs),
    apply_fn=model.apply,
    param_dtype=param_dtype,
  )
  plan = zerojax.plan_for(state.tx, state.params)
  rows = zerojax.process_batch_slice(len(next(iter(init_batch.values()))), mesh)

  def to_devices(batch):
    # Each process contributes its rows; with one process this is a device_put.
    return zerojax.global_batch({k: v[rows] for k, v in batch.items()}, mesh)

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), loss

  step_fn = jax.jit(train_step, donate_argnums=0)
  first = to_devices(init_batch)
  compiled = step_fn.lower(state, first).compile()
  batch_size = len(next(iter(init_batch.values())))
  start, ckpt = 0, None
  if checkpoint_dir:
    ckpt = zerojax.Checkpointer(checkpoint_dir, max_to_keep=3, save_interval_steps=save_every)
    if ckpt.latest_step() is not None:
      state, extra = ckpt.restore(state)
      start = int(extra['data_position'])
      if jax.process_index() == 0:
        print(f'resumed from {checkpoint_dir} at step {start}')
  losses, seen, t0 = [], 0, time.perf_counter()
  quiet = quiet or jax.process_index() != 0  # one progress bar per run, not per process
  bar = progress(range(start, steps), desc=f'{name} stage {stage}', disable=quiet)
  for step in bar:
    batch = to_devices(batch_at(step))
    state, loss = step_fn(state, batch)
    seen += batch_size
    if step % log_every == 0 or step == steps - 1:
      losses.append((step, float(loss)))
      bar.set_postfix(loss=f'{float(loss):.4f}', ex_s=f'{seen / (time.perf_counter() - t0):,.0f}')
    if ckpt is not None:
      # Saved after step `step`: resume at the next batch.
      ckpt.save(step + 1, state, extra={'data_position': jax.numpy.array(step + 1)})
  if ckpt is not None:
    ckpt.wait_until_finished()
    if steps not in ckpt.all_steps():  # the end of the run, if not saved already
      ckpt.save(steps, state, extra={'data_position': jax.numpy.array(steps)}, force=True)
    ckpt.close()
  return {
    'stage': stage,
    'losses': losses,
    'state': state,
    'plan': plan,
    'compiled': compiled,
    'num_params': sum(x.size for x in jax.tree.leaves(state.params)),
    'batch_bytes': sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(first)),
  }


def report(out: dict, name: str) -> None:
  """Prints the final loss and the per-device memory table."""
  import jax

  if jax.process_index() != 0:  # every process has the same figures
    return
  if not out['losses']:
    print(f'{name} stage {out["stage"]}: nothing to train (resumed at the last step)')
    return
  print(
    f'{name} stage {out["stage"]}: {out["num_params"]:,} parameters; loss'
    f' {out["losses"][0][1]:.4f} -> {out["losses"][-1][1]:.4f}'
  )
  print(f'per device ({len(jax.devices())} devices):')
  print(memory_table(out['plan'], out['compiled']))


def random_batches(arrays: dict, batch: int):
  """step -> a batch of `batch` random rows of `arrays` (deterministic per step)."""
  import numpy as np

  n = len(next(iter(arrays.values())))

  def batch_at(step: int) -> dict:
    idx = np.random.default_rng(step).integers(0, n, batch)
    return {k: v[idx] for k, v in arrays.items()}

  return batch_at


def example_main(argv, *, doc: str, name: str, run, data_help: str) -> int:
  """The command line every classification example shares: --stage, --steps, --data."""
  import argparse

  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3))
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--data', help=data_help)
  parser.add_argument('--checkpoint-dir', help='save here and resume from the latest checkpoint')
  args = parser.parse_args(argv)
  report(
    run(stage=args.stage, steps=args.steps, data=args.data, checkpoint_dir=args.checkpoint_dir),
    name,
  )
  return 0
