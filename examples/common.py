"""The runner every example shares: devices, data, training, held-out evaluation, reports.

An example describes its job as a `Task` (how to load its data, its model, its
logits and labels, its optimizer); `run` trains it under one ZeRO stage,
`compare_stages` under each stage with the same data and seed, and `main` is
the command line of every example (`--help` shows the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any


def setup_devices(n: int | None = None) -> None:
  """Fakes `n` CPU devices unless real accelerators are asked for (JAX_PLATFORMS).

  `n` defaults to the command line's `--devices` (8 without it). Must run
  before jax initialises its backend.
  """
  if n is None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument('--devices', type=int, default=8)
    n = pre.parse_known_args()[0].devices
  if os.environ.get('JAX_PLATFORMS', 'cpu') == 'cpu':
    os.environ['JAX_PLATFORMS'] = 'cpu'
    flag = f'--xla_force_host_platform_device_count={n}'
    if flag not in os.environ.get('XLA_FLAGS', ''):
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()


def make_mesh(slices: int = 1):
  """One 'data' axis over every device; with `slices` > 1, an outer 'slice' axis of that many
  data-parallel groups (TPU slices; on CPU, `jax.make_mesh` keeps each process's devices
  together, so with one slice per process the axis runs across the processes)."""
  import jax
  from jax.sharding import AxisType

  n = len(jax.devices())
  if slices == 1:
    return jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,))
  return jax.make_mesh((slices, n // slices), ('slice', 'data'), axis_types=(AxisType.Auto,) * 2)


# --- Data


@dataclasses.dataclass(frozen=True)
class Data:
  """A task's data: what training reads, a held-out set, and where it came from.

  `heldout` maps names to arrays whose leading dimension is the example; the
  task's `logits_and_labels` reads a batch of them. `source` is printed with
  every run, so a reader always knows whether the numbers come from real or
  synthetic data.
  """

  train: dict
  heldout: dict
  source: str
  synthetic: bool


def synthetic(prefix: str, write: Callable[[str], None], load: Callable[[str], Data], source: str):
  """Synthetic data through the real reader: `write(folder)` to a temporary folder, read back
  with `load(folder)`, the folder removed; marked synthetic, described by `source`."""
  import tempfile

  with tempfile.TemporaryDirectory(prefix=prefix) as folder:
    write(folder)
    data = load(folder)
  return Data(data.train, data.heldout, source, synthetic=True)


def held_out(train: dict, test: Callable[[], dict] | None, test_name: str) -> tuple:
  """(train, held-out, how): the data's own test split when there is one, else its last 10%."""
  if test is not None:
    return train, test(), f'{test_name} held out'
  return *split_heldout(train), 'last 10% held out'


def split_heldout(arrays: dict, fraction: float = 0.1) -> tuple[dict, dict]:
  """The last `fraction` of the examples as a held-out set (for data with no test split)."""
  n = len(next(iter(arrays.values())))
  cut = n - max(1, int(n * fraction))
  return {k: v[:cut] for k, v in arrays.items()}, {k: v[cut:] for k, v in arrays.items()}


def flip_labels(rng, labels, num_classes: int, fraction: float):
  """Replaces `fraction` of the labels by uniformly drawn ones: noise no model can learn."""
  import numpy as np

  labels = np.array(labels)
  noisy = rng.random(len(labels)) < fraction
  labels[noisy] = rng.integers(0, num_classes, int(noisy.sum()))
  return labels


def random_batches(arrays: dict, batch: int, seed: int = 0):
  """step -> a batch of `batch` random rows of `arrays` (deterministic per step and seed)."""
  import numpy as np

  n = len(next(iter(arrays.values())))

  def batch_at(step: int) -> dict:
    idx = np.random.default_rng((seed, step)).integers(0, n, batch)
    return {k: v[idx] for k, v in arrays.items()}

  return batch_at


@dataclasses.dataclass(frozen=True)
class Task:
  """One example's job.

  Attributes:
    name: a short name ('mnist'), used in progress bars and file names.
    doc: the example's module docstring (its first line is the --help text).
    data_help: what --data takes.
    load: path or None -> `Data` (None: the example's synthetic data).
    model: the optimizer wrapped by zerojax.zero_stage -> a linen module (which gathers
      its parameters over that optimizer's axes).
    init_inputs: `Data` -> keyword inputs of `model.init` (one example is enough).
    logits_and_labels: (apply_fn, params, batch) -> (logits, integer labels);
      the loss is their mean cross-entropy, the accuracy their argmax match.
    tx: () -> the optax optimizer.
    batch: global batch size.
    batches: (`Data`, batch, seed) -> (step -> training batch).
    log_every: steps between logged losses.
    rngs: the Flax RNG streams the model draws from in training (e.g.
      ('dropout',)); then `logits_and_labels` also takes `rngs=` in training,
      and the run carries a key chain that its checkpoints save.
    init_params: None (parameters from the model's init), or (optimizer from
      zero_stage, init_fn, key) -> parameters already in its layout (a published
      checkpoint through `zerojax.checkpoint.load_safetensors`).
    f1: also report the held-out F1 of class 1 (a binary task's GLUE metric).
  """

  name: str
  doc: str
  data_help: str
  load: Callable[[str | None], Data]
  model: Callable[[Any], Any]
  init_inputs: Callable[[Data], dict]
  logits_and_labels: Callable
  tx: Callable[[], Any]
  batch: int = 64
  batches: Callable = lambda data, batch, seed: random_batches(data.train, batch, seed)
  log_every: int = 5
  rngs: tuple[str, ...] = ()
  init_params: Callable | None = None
  f1: bool = False


def image_logits_and_labels(apply_fn, params, batch):
  """`Task.logits_and_labels` of an image classifier: batches of 'image' and 'label'."""
  return apply_fn({'params': params}, batch['image']), batch['label']


def f1_score(true_positives: float, predicted: float, actual: float) -> float:
  """F1 of the positive class from its counts (0 when nothing is predicted or present)."""
  return 2 * true_positives / (predicted + actual) if predicted + actual else 0.0


def _cross_entropy(task: Task, apply_fn, params, batch, key=None, counts=False):
  """Per-example losses and hits (averaged over any non-batch label positions).

  With `key` (training a task with `rngs`), each of the task's RNG streams
  draws from its own fold of it. With `counts`, also a function of the
  examples' weights giving class 1's (true positive, predicted, actual) counts.
  """
  import jax
  import jax.numpy as jnp
  import optax

  if key is None:
    logits, labels = task.logits_and_labels(apply_fn, params, batch)
  else:
    rngs = {name: jax.random.fold_in(key, i) for i, name in enumerate(task.rngs)}
    logits, labels = task.logits_and_labels(apply_fn, params, batch, rngs=rngs)
  logits = logits.astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  hits = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  axes = tuple(range(1, losses.ndim))
  if not counts:
    return losses.mean(axes), hits.mean(axes)
  predicted, actual = jnp.argmax(logits, -1) == 1, labels == 1

  def positives(weight):
    total = lambda x: jnp.sum(x.reshape(x.shape[0], -1).mean(-1) * weight)
    return jnp.stack([total(predicted & actual), total(predicted), total(actual)])

  return losses.mean(axes), hits.mean(axes), positives


def heldout_batches(arrays: dict, batch: int):
  """The held-out set in batches of `batch`; the last one padded, with weight 0 on the padding."""
  import numpy as np

  n = len(next(iter(arrays.values())))
  for start in range(0, n, batch):
    idx = np.arange(start, start + batch)
    weight = (idx < n).astype(np.float32)
    idx = np.minimum(idx, n - 1)
    yield {k: v[idx] for k, v in arrays.items()}, weight


# --- Training


def progress(iterable, **kwargs):
  from tqdm import tqdm

  return tqdm(iterable, file=sys.stdout, dynamic_ncols=True, **kwargs)


def run(
  task: Task,
  *,
  stage: int,
  steps: int,
  data: str | Data | None = None,
  seed: int = 0,
  quiet: bool = False,
  mesh=None,
  checkpoint_dir: str | None = None,
  save_every: int = 50,
  save_on_preemption: bool = False,
  micro_batches: int = 1,
  losses_file: str | None = None,
  tx=None,
  param_dtype=None,
  grad: str = 'auto',
  **zero_options,
) -> dict:
  """Trains `task` under ZeRO `stage`, then evaluates it on the held-out set.

  Args:
    task: what to train.
    stage: the ZeRO stage.
    steps: training steps.
    data: a path for `task.load`, a loaded `Data`, or None for synthetic data.
    seed: seeds the initial parameters and the order of the batches.
    checkpoint_dir: if given, save there every `save_every` steps (async,
      keeping the last 3) and resume from the latest checkpoint: state, data
      position, the key chain of the task's `rngs` and the micro-batch size,
      on any device count and stage, with the same global batch.
    save_on_preemption: on SIGTERM, save at the next step and exit with code
      143 (`zerojax.checkpoint.Preempted`); needs `checkpoint_dir`.
    micro_batches: micro-batches per device (through `zerojax.value_and_grad`).
      A resumed run takes the checkpoint's micro-batch size instead, so that
      each micro-batch holds the rows (and draws the random numbers) it did.
    losses_file: append each step's loss to this file as a JSON line
      (process 0), interrupted or not.
    tx: the optax optimizer (default: `task.tx()`).
    param_dtype: compute dtype of the parameters (with a mixed_precision tx).
    grad: 'jax' differentiates with `jax.value_and_grad` (the compiler places
      the gradient reduction), 'zerojax' with `zerojax.value_and_grad`
      (explicit per-layer reduce-scatters from stage 2); 'auto': zerojax when
      `quantize` is given (ZeRO++ needs zerojax's own collectives) or with
      more than one micro-batch, else jax.
    **zero_options: more options of `zerojax.zero_stage` (offload, update_on,
      quantize, ...).

  Returns:
    a dict: stage, losses [(step, loss)], heldout_loss, heldout_accuracy,
    step_seconds (one per step this run took), the final state, the plan,
    the compiled step, num_params, batch_bytes (this device's batch) and data
    (the `Data`).
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  import zerojax

  data = data if isinstance(data, Data) else task.load(data)
  mesh = mesh or make_mesh()
  zerojax.distributed.check_mesh(mesh)
  ztx = zerojax.zero_stage(tx or task.tx(), stage, mesh=mesh, **zero_options)
  model = task.model(ztx)
  init_fn = lambda k: model.init(k, **task.init_inputs(data))['params']
  if task.init_params is not None:
    # Published weights, read straight into the layout; the state starts from them.
    params = task.init_params(ztx, init_fn, jax.random.key(seed))
    init_fn, init_arg = (lambda p: p), params
  else:
    init_arg = jax.random.key(seed)
  state = zerojax.create_train_state(
    init_fn, init_arg, tx=ztx, apply_fn=model.apply, param_dtype=param_dtype
  )
  plan = zerojax.plan_for(state.tx, state.params)
  batch_at = task.batches(data, task.batch, seed)
  # The batch's rows over the data-parallel axes beside ZeRO's (several slices), then ZeRO's.
  config = zerojax.config_of(ztx)
  axes = config.replica_axes + config.axes
  rows = zerojax.distributed.process_batch_slice(task.batch, mesh, axis=axes)

  def to_devices(batch):
    # Each process contributes its rows; with one process this is a device_put.
    return zerojax.distributed.global_batch({k: v[rows] for k, v in batch.items()}, mesh, axis=axes)

  if grad not in ('auto', 'jax', 'zerojax'):
    raise ValueError(f"grad must be 'auto', 'jax' or 'zerojax', got {grad!r}")
  if save_on_preemption and not checkpoint_dir:
    raise ValueError('save_on_preemption saves into checkpoint_dir: pass checkpoint_dir too')
  # The task's RNG streams draw from a key chain split at every step: saved
  # with each checkpoint, so a resumed run draws what the uninterrupted one would.
  rng = jax.random.key(seed + 1) if task.rngs else None
  start, ckpt = 0, None
  if checkpoint_dir:
    ckpt = zerojax.checkpoint.Checkpointer(
      checkpoint_dir,
      max_to_keep=3,
      save_interval_steps=save_every,
      save_on_preemption=save_on_preemption,
    )
    if ckpt.latest_step() is not None:
      state, extra = ckpt.restore(state, global_batch=task.batch)
      start = int(extra['data_position'])
      rng = extra.get('rng', rng) if task.rngs else None
      how = ''
      if ckpt.metadata().get('run'):
        # The saved micro-batch size, on this device count: each micro-batch
        # holds the rows, and draws the random numbers, it did before.
        micro_batches = ckpt.micro_batches_for(state.tx)
        how = f', {micro_batches} micro-batch(es) per device on {jax.device_count()} devices'
      if jax.process_index() == 0:
        print(f'resumed from {checkpoint_dir} at step {start}{how}', flush=True)
  if grad == 'auto':
    use_zerojax = zero_options.get('quantize') is not None or micro_batches > 1
    grad = 'zerojax' if use_zerojax else 'jax'
  if grad == 'jax' and zero_options.get('quantize') is not None:
    raise ValueError("quantize= needs zerojax's own collectives: use grad='zerojax'")
  if grad == 'jax' and micro_batches > 1:
    raise ValueError("micro_batches needs zerojax.value_and_grad: use grad='zerojax'")

  def batch_loss(params, batch, key=None):
    return _cross_entropy(task, state.apply_fn, params, batch, key)[0].mean()

  if grad == 'zerojax':
    value_and_grad = zerojax.value_and_grad(
      batch_loss, state.tx, per_layer=stage >= 2, micro_batches=micro_batches
    )
  else:
    jax_grad = jax.value_and_grad(lambda p, b, k, scale: batch_loss(p, b, k) * scale)

    def value_and_grad(params, batch, key=None, loss_scale=None):
      loss, grads = jax_grad(params, batch, key, loss_scale)
      return loss / loss_scale, grads

  def train_step(state, batch, rng):
    # A loss scale (zerojax.mixed_precision) is 1.0 unless the optimizer keeps one.
    scale = zerojax.loss_scale(state.opt_state)
    if rng is None:
      loss, grads = value_and_grad(state.params, batch, loss_scale=scale)
    else:
      rng, key = jax.random.split(rng)
      loss, grads = value_and_grad(state.params, batch, key, loss_scale=scale)
    return state.apply_gradients(grads=grads), loss, rng

  @jax.jit
  def eval_step(params, batch, weight):
    losses, hits, positives = _cross_entropy(task, state.apply_fn, params, batch, counts=True)
    return jnp.sum(losses * weight), jnp.sum(hits * weight), positives(weight)

  step_fn = jax.jit(train_step, donate_argnums=0)
  first = to_devices(batch_at(0))
  compiled = step_fn.lower(state, first, rng).compile()
  split = {'global_batch': task.batch, 'micro_batches': micro_batches}

  def extra_at(position):
    extra = {'data_position': jnp.array(position)}
    return extra if rng is None else {**extra, 'rng': rng}

  losses, seconds = [], []
  main = jax.process_index() == 0
  quiet = quiet or not main  # one progress bar per run, not per process
  if not quiet:
    print(f'{task.name} data: {data.source}')
  if main and save_on_preemption:
    print(
      f'{task.name} stage {stage}: training steps {start}..{steps - 1} on'
      f' {jax.device_count()} devices; SIGTERM saves the next step and exits',
      flush=True,
    )
  log = open(losses_file, 'a') if losses_file and main else None  # noqa: SIM115
  bar = progress(range(start, steps), desc=f'{task.name} stage {stage}', disable=quiet)
  try:
    for step in bar:
      batch = to_devices(batch_at(step))
      t0 = time.perf_counter()
      state, loss, rng = compiled(state, batch, rng)  # compiled above, not compiled again
      loss = float(loss)  # waits for the step: its time is the step's own
      seconds.append(time.perf_counter() - t0)
      if log is not None:
        log.write(json.dumps({'step': step, 'loss': loss, 'devices': jax.device_count()}) + '\n')
        log.flush()
      if step % task.log_every == 0 or step == steps - 1:
        losses.append((step, loss))
        bar.set_postfix(loss=f'{loss:.4f}')
      if ckpt is not None:
        # Saved after step `step`: resume at the next batch. On a preemption
        # notice this saves now and raises zerojax.checkpoint.Preempted.
        ckpt.save(step + 1, state, extra=extra_at(step + 1), **split)
  finally:
    bar.close()
    if log is not None:
      log.close()
  if ckpt is not None:
    ckpt.wait_until_finished()
    if steps not in ckpt.all_steps():  # the end of the run, if not saved already
      ckpt.save(steps, state, extra=extra_at(steps), force=True, **split)
    ckpt.close()
  total_loss = total_hits = 0.0
  positives = np.zeros(3)  # class 1: predicted and true, predicted, true
  for batch, weight in heldout_batches(data.heldout, task.batch):
    part = to_devices({**batch, '_weight': weight})
    loss_sum, hit_sum, pos = eval_step(state.params, part, part.pop('_weight'))
    total_loss, total_hits = total_loss + float(loss_sum), total_hits + float(hit_sum)
    positives += np.asarray(pos)
  count = len(next(iter(data.heldout.values())))
  return {
    'stage': stage,
    'losses': losses,
    'heldout_loss': total_loss / count,
    'heldout_accuracy': total_hits / count,
    **({'heldout_f1': f1_score(*positives)} if task.f1 else {}),
    'step_seconds': seconds,
    'state': state,
    'plan': plan,
    'compiled': compiled,
    'num_params': sum(x.size for x in jax.tree.leaves(state.params)),
    'batch_bytes': sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(first)),
    'data': data,
    'grad': grad,
  }


# --- Reports


def memory_table(plan, compiled) -> str:
  """Per-device bytes: the plan's model states and the compiled step's memory."""
  import zerojax

  sizes = plan.bytes_per_device()
  mem = zerojax.inspect.memory_stats(compiled)
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


def median_step_seconds(out: dict, warmup: int = 3) -> float:
  """Median step time after `warmup` steps (all of them on a short run)."""
  import numpy as np

  times = out['step_seconds']
  return float(np.median(times[warmup:] if len(times) > warmup else times))


def report(out: dict, name: str) -> None:
  """Prints the data's source, the losses, the held-out figures and the memory table."""
  import jax

  if jax.process_index() != 0:  # every process has the same figures
    return
  print(f'{name} data: {out["data"].source}')
  if not out['losses']:
    print(f'{name} stage {out["stage"]}: nothing to train (resumed at the last step)')
    return
  print(
    f'{name} stage {out["stage"]}: {out["num_params"]:,} parameters; training loss'
    f' {out["losses"][0][1]:.4f} -> {out["losses"][-1][1]:.4f}; held-out loss'
    f' {out["heldout_loss"]:.4f}, accuracy {out["heldout_accuracy"]:.1%}'
    + (f', F1 {out["heldout_f1"]:.1%}' if 'heldout_f1' in out else '')
    + ';'
    f' {median_step_seconds(out) * 1e3:.1f} ms/step (median)'
  )
  print(f'per device ({len(jax.devices())} devices):')
  print(memory_table(out['plan'], out['compiled']))


def stage_row(out: dict) -> dict:
  """The figures of one run that the per-stage comparison shows."""
  import zerojax

  sizes = out['plan'].bytes_per_device()
  mem = zerojax.inspect.memory_stats(out['compiled'])
  return {
    'stage': out['stage'],
    'final_loss': out['losses'][-1][1],
    'heldout_loss': out['heldout_loss'],
    'heldout_accuracy': out['heldout_accuracy'],
    **({'heldout_f1': out['heldout_f1']} if 'heldout_f1' in out else {}),
    'step_ms': median_step_seconds(out) * 1e3,
    'states_at_rest_bytes': sizes['params'] + sizes['opt_state'],
    'grads_bytes': sizes['grads'],
    'temp_bytes': mem.temp,
    'peak_bytes': mem.peak,
    'losses': out['losses'],
  }


def compare_stages(
  task: Task,
  *,
  steps: int,
  out_dir: str,
  data: str | None = None,
  stages=(0, 1, 2, 3),
  quiet: bool = False,
  **run_options,
) -> dict:
  """Trains `task` under each stage on the same data and seed; writes JSON, a table and a PNG.

  Writes `<out_dir>/<name>_stages.json`, `.md` and `.png`; returns the record.
  """

  started = time.perf_counter()
  loaded = task.load(data)
  runs = [run(task, stage=s, steps=steps, data=loaded, quiet=quiet, **run_options) for s in stages]
  rows = [stage_row(r) for r in runs]
  record = _record(task, loaded, steps, started, num_params=runs[0]['num_params'], stages=rows)
  _write(record, os.path.join(out_dir, f'{task.name}_stages'), stage_table, plot_stages)
  return record


def _record(task: Task, loaded: Data, steps: int, started: float, **fields) -> dict:
  """What every comparison records: the task, its data, the machine, and `fields`."""
  import jax

  return {
    'task': task.name,
    'data': loaded.source,
    'synthetic': loaded.synthetic,
    'devices': len(jax.devices()),
    'device_kind': jax.devices()[0].device_kind,
    'steps': steps,
    'batch': task.batch,
    'machine': f'{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}',
    'wall_seconds': round(time.perf_counter() - started, 1),
    **fields,
  }


def _write(record: dict, base: str, table: Callable, plot: Callable) -> None:
  """`base`.json, .md (the table) and .png (the plot)."""
  os.makedirs(os.path.dirname(base) or '.', exist_ok=True)
  with open(base + '.json', 'w') as f:
    json.dump(record, f, indent=2)
  with open(base + '.md', 'w') as f:
    f.write(table(record) + '\n')
  plot(record, base + '.png')


def stage_table(record: dict) -> str:
  """The comparison as a Markdown table (memory in MiB per device)."""
  mib = lambda b: f'{b / 2**20:.2f}'
  f1 = all('heldout_f1' in row for row in record['stages'])
  lines = [
    f'{record["task"]}: {record["num_params"]:,} parameters, {record["steps"]} steps of'
    f' batch {record["batch"]} on {record["devices"]} x {record["device_kind"]}'
    f' ({record["machine"]}); data: {record["data"]}',
    '',
    '| stage | final training loss | held-out loss | held-out accuracy |'
    + (' held-out F1 |' if f1 else '')
    + ' step (ms, median) | states at rest (MiB/device) | gradients (MiB/device)'
    ' | step peak (MiB/device) |',
    '|---|---|---|---|' + ('---|' if f1 else '') + '---|---|---|---|',
  ]
  for row in record['stages']:
    lines.append(
      f'| {row["stage"]} | {row["final_loss"]:.4f} | {row["heldout_loss"]:.4f}'
      f' | {row["heldout_accuracy"]:.1%}'
      + (f' | {row["heldout_f1"]:.1%}' if f1 else '')
      + f' | {row["step_ms"]:.1f}'
      f' | {mib(row["states_at_rest_bytes"])} | {mib(row["grads_bytes"])}'
      f' | {mib(row["peak_bytes"])} |'
    )
  return '\n'.join(lines)


def _loss_curves(ax, rows: list[dict], labels: list[str]) -> None:
  """One training-loss curve per run, in line styles that survive greyscale."""
  import numpy as np

  for r, label, style in zip(rows, labels, ['-', '--', ':', '-.']):
    steps, losses = np.array(r['losses']).T
    ax.plot(steps, losses, style, label=label)
  ax.set(xlabel='step', ylabel='training loss', title='training loss')
  ax.legend()


def plot_stages(record: dict, path: str) -> None:
  """Loss curves, held-out accuracy, step time and memory per device, by stage."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  rows = record['stages']
  labels = [f'stage {r["stage"]}' for r in rows]
  fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
  _loss_curves(axes[0], rows, labels)
  axes[1].bar(labels, [100 * r['heldout_accuracy'] for r in rows])
  axes[1].set(ylabel='%', title='held-out accuracy')
  axes[2].bar(labels, [r['step_ms'] for r in rows])
  axes[2].set(ylabel='ms', title='step time (median)')
  parts = [
    ('states_at_rest_bytes', 'params + optimizer state at rest'),
    ('temp_bytes', 'temporaries of the step (gradients live here)'),
  ]
  bottom = np.zeros(len(rows))
  for key, label in parts:
    values = np.array([r[key] / 2**20 for r in rows])
    axes[3].bar(labels, values, bottom=bottom, label=label)
    bottom += values
  axes[3].set(ylabel='MiB per device', title=f'memory per device ({record["devices"]} devices)')
  axes[3].legend(fontsize=8)
  kind = 'synthetic data' if record['synthetic'] else 'data: ' + record['data']
  fig.suptitle(f'{record["task"]}: ZeRO stages compared ({kind})', fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def compare_quantized(
  task: Task,
  *,
  stage: int,
  steps: int,
  out_dir: str,
  data: str | None = None,
  formats=('int8', 'int4'),
  quiet: bool = False,
  **run_options,
) -> dict:
  """Trains `task` at `stage` with full-precision collectives and with ZeRO++ quantized
  ones (int8 weight gathers at stage 3; int8 or int4 gradient reduce-scatters), on the
  same data and seed, all through `zerojax.value_and_grad`.

  Writes `<out_dir>/<name>_quantized.json`, `.md` and `.png` (loss curves and
  traffic); returns the record.
  """
  import numpy as np

  import zerojax

  if stage < 1:
    raise ValueError(f'ZeRO++ quantizes the collectives of stages 1-3, not stage {stage}')
  started = time.perf_counter()
  loaded = task.load(data)
  configs = [('full precision', None)] + [
    (
      f'weights int8, gradients {fmt}' if stage == 3 else f'gradients {fmt}',
      zerojax.Quantize(weights='int8' if stage == 3 else None, grads=fmt),
    )
    for fmt in formats
  ]
  rows = []
  for label, quantize in configs:
    out = run(
      task,
      stage=stage,
      steps=steps,
      data=loaded,
      quiet=quiet,
      grad='zerojax',
      quantize=quantize,
      **run_options,
    )
    stats = zerojax.inspect.step_report(out['compiled'], plan=out['plan'])
    rows.append(
      stage_row(out)
      | {
        'label': label,
        'ring_bytes': stats.collectives.total_ring_bytes,
        'floor_bytes': stats.floor_bytes,
        'collectives': stats.collectives.counts,
      }
    )
  base_loss = rows[0]['final_loss']
  for row in rows:
    row['final_loss_vs_full_precision'] = row['final_loss'] / base_loss
    row['heldout_loss_vs_full_precision'] = row['heldout_loss'] / rows[0]['heldout_loss']
    row['ring_bytes_vs_full_precision'] = row['ring_bytes'] / rows[0]['ring_bytes']
  num_params = sum(int(np.prod(r.shape)) for r in out['plan'].rows if r.group == 'params')
  record = _record(task, loaded, steps, started, stage=stage, num_params=num_params, runs=rows)
  _write(record, os.path.join(out_dir, f'{task.name}_quantized'), quantized_table, plot_quantized)
  return record


def quantized_table(record: dict) -> str:
  """The quantized comparison as a Markdown table."""
  lines = [
    f'{record["task"]} at ZeRO stage {record["stage"]}: {record["num_params"]:,} parameters,'
    f' {record["steps"]} steps of batch {record["batch"]} on {record["devices"]} x'
    f' {record["device_kind"]} ({record["machine"]}); data: {record["data"]}',
    '',
    '| collectives | final training loss | vs full precision | held-out loss | vs full precision'
    ' | step (ms, median) | ring bytes/device/step | vs full precision | vs the ZeRO floor |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for row in record['runs']:
    lines.append(
      f'| {row["label"]} | {row["final_loss"]:.4f} | {row["final_loss_vs_full_precision"]:.4f}'
      f' | {row["heldout_loss"]:.4f} | {row["heldout_loss_vs_full_precision"]:.4f}'
      f' | {row["step_ms"]:.1f} | {row["ring_bytes"]:,.0f}'
      f' | {row["ring_bytes_vs_full_precision"]:.3f} | {row["ring_bytes"] / row["floor_bytes"]:.3f} |'
    )
  return '\n'.join(lines)


def plot_quantized(record: dict, path: str) -> None:
  """Loss curves and traffic per step, full precision against quantized."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  rows = record['runs']
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  _loss_curves(axes[0], rows, [r['label'] for r in rows])
  labels = [r['label'].replace(', ', '\n') for r in rows]
  axes[1].bar(labels, [r['ring_bytes'] / 2**20 for r in rows])
  axes[1].axhline(rows[0]['floor_bytes'] / 2**20, color='k', ls=':', label='full-precision floor')
  axes[1].set(ylabel='MiB per device per step', title='collective traffic (ring bytes)')
  axes[1].legend(fontsize=8)
  kind = 'synthetic data' if record['synthetic'] else 'data: ' + record['data']
  fig.suptitle(
    f'{record["task"]}: ZeRO++ quantized collectives at stage {record["stage"]} ({kind})',
    fontsize=11,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


# --- Command line


def make_parser(task: Task) -> argparse.ArgumentParser:
  """The options every example takes; --help shows each default."""
  parser = argparse.ArgumentParser(
    description=task.doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3), help='ZeRO stage')
  parser.add_argument('--steps', type=int, default=200, help='training steps')
  parser.add_argument('--data', default=None, help=task.data_help)
  parser.add_argument('--seed', type=int, default=0, help='initial parameters and batch order')
  parser.add_argument(
    '--checkpoint-dir', default=None, help='save here and resume from the latest checkpoint'
  )
  parser.add_argument('--save-every', type=int, default=50, help='steps between checkpoints')
  parser.add_argument(
    '--save-on-preemption',
    action='store_true',
    help='on SIGTERM, save the next step to --checkpoint-dir and exit with code 143; run again'
    ' with the same folder (on any device count) to resume',
  )
  parser.add_argument(
    '--micro-batches',
    type=int,
    default=1,
    help='micro-batches per device (zerojax.value_and_grad); a resumed run keeps the'
    " checkpoint's micro-batch size instead",
  )
  parser.add_argument('--devices', type=int, default=8, help='CPU only: how many devices to fake')
  parser.add_argument('--losses', default=None, help="append each step's loss to this JSONL file")
  parser.add_argument(
    '--compare',
    action='store_true',
    help='train under stages 0-3 on the same data; write a table, a PNG and JSON to --out',
  )
  parser.add_argument('--out', default=f'{task.name}_out', help='folder for --compare')
  return parser


def main(
  argv,
  task: Task,
  *,
  add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
  configure: Callable[[Task, argparse.Namespace], tuple[Task, dict]] | None = None,
) -> int:
  """The command line of every example: one stage, or all of them compared.

  `add_arguments` adds an example's own options; `configure(task, args)`
  returns the task they describe and more keyword options for `run`.
  """
  parser = make_parser(task)
  if add_arguments is not None:
    add_arguments(parser)
  args = parser.parse_args(argv)
  task, options = configure(task, args) if configure is not None else (task, {})
  if getattr(args, 'compare_quantized', False):
    options.pop('quantize', None)
    record = compare_quantized(
      task,
      stage=args.stage,
      steps=args.steps,
      out_dir=args.out,
      data=args.data,
      seed=args.seed,
      **options,
    )
    print(quantized_table(record))
    print(f'wrote {os.path.join(args.out, task.name)}_quantized.{{json,md,png}}')
    return 0
  if args.compare:
    if args.checkpoint_dir:
      parser.error('--compare trains four fresh runs; it does not take --checkpoint-dir')
    record = compare_stages(
      task, steps=args.steps, out_dir=args.out, data=args.data, seed=args.seed, **options
    )
    print(stage_table(record))
    print(f'wrote {os.path.join(args.out, task.name)}_stages.{{json,md,png}}')
    return 0
  out = run(
    task,
    stage=args.stage,
    steps=args.steps,
    data=args.data,
    seed=args.seed,
    checkpoint_dir=args.checkpoint_dir,
    save_every=args.save_every,
    save_on_preemption=args.save_on_preemption,
    micro_batches=args.micro_batches,
    losses_file=args.losses,
    **options,
  )
  report(out, task.name)
  return 0
