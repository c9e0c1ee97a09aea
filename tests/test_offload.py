"""ZeRO-Offload: optimizer state (and the fp32 master) in host memory, streamed through the device."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
  batch,
  loss_fn,
  make_init,
  max_rel_err,
  mlp_params,
  mp_step,
  plain_run,
  plan_of,
  shard_batch,
  train_tol,
)

import zerojax

STAGES = [0, 1, 2, 3]


def kinds(tree):
  return {
    jax.tree_util.keystr(p): x.sharding.memory_kind
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


@functools.cache
def _plain_adamw():
  """Plain optax's 10 AdamW steps: the reference of every test_memory_kinds_and_numerics."""
  return plain_run(optax.adamw(1e-2, weight_decay=0.1), 10)


@pytest.mark.parametrize('stage', STAGES)
@pytest.mark.parametrize('offload', ['opt_state', 'opt_state+master'])
@pytest.mark.parametrize('update_on', ['device', 'host'])
def test_memory_kinds_and_numerics(stage, offload, update_on, mesh):
  tx = optax.adamw(1e-2, weight_decay=0.1)
  ztx = zerojax.zero_stage(
    zerojax.mixed_precision(tx), stage, mesh=mesh, offload=offload, update_on=update_on
  )
  params = mlp_params()
  opt_state = ztx.init(params)
  plan = zerojax.plan_for(ztx, params)
  params = jax.device_put(params, plan.params)
  got = kinds(opt_state)
  master_kind = 'pinned_host' if offload == 'opt_state+master' else 'device'
  for path, kind in got.items():
    if '.master' in path:
      assert kind == master_kind, path
    elif path.endswith('.count'):
      assert kind == 'device', path  # scalars stay on device
    else:
      assert kind == 'pinned_host', path  # Adam's moments
  assert {x.sharding.memory_kind for x in jax.tree.leaves(params)} == {'device'}
  x, y = shard_batch(mesh, *batch())

  @jax.jit
  def step(params, opt_state):
    grads = jax.grad(lambda p: loss_fn(zerojax.gather(p, plan), x, y))(params)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(10):
    params, opt_state = step(params, opt_state)
  assert kinds(opt_state) == got  # still offloaded after the steps
  assert jax.tree.map(lambda a: a.sharding, opt_state) == plan.opt_state
  # fp32 parameters with an fp32 master: the same numbers as plain optax.
  assert max_rel_err(params, _plain_adamw()) <= train_tol(10)


def test_plan_counts_host_bytes(auto_mesh):
  params = mlp_params()
  psi = sum(x.size for x in jax.tree.leaves(params))
  on = plan_of(params, optax.adam(1e-3), stage=1, mesh=auto_mesh, offload='opt_state')
  off = plan_of(params, optax.adam(1e-3), stage=1, mesh=auto_mesh)
  assert on.bytes_per_device()['host'] == 8 * psi // 8  # both moments, sharded
  assert on.bytes_per_device()['opt_state'] == off.bytes_per_device()['opt_state'] - 8 * psi // 8
  assert off.bytes_per_device()['host'] == 0
  assert f'in host memory (offloaded) {8 * psi // 8 / 1024:.2f} KiB' in str(on)


def test_train_state_with_offload(auto_mesh):
  state = zerojax.create_train_state(
    lambda k: mlp_params(),
    jax.random.key(0),
    tx=zerojax.zero_stage(optax.adamw(1e-3), 2, mesh=auto_mesh, offload='opt_state'),
  )
  assert kinds(state.opt_state)["[0].mu['dense1']['kernel']"] == 'pinned_host'
  x, y = shard_batch(auto_mesh, *batch())

  @jax.jit
  def step(state):
    return state.apply_gradients(grads=jax.grad(lambda p: loss_fn(p, x, y))(state.params))

  state2 = step(state)
  assert kinds(state2.opt_state) == kinds(state.opt_state)
  assert not np.array_equal(
    np.asarray(state2.params['dense1']['kernel']), mlp_params()['dense1']['kernel']
  )


def test_bad_offload_value(auto_mesh):
  with pytest.raises(ValueError) as e:
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=auto_mesh, offload='cpu')
  assert str(e.value).startswith(
    "Options(offload=...) must be one of (None, 'opt_state', 'opt_state+master'), got 'cpu'"
  )
  with pytest.raises(
    ValueError, match=r"Options\(update_on=...\) must be 'device', 'host' or 'stream', got 'gpu'"
  ):
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=auto_mesh, offload='opt_state', update_on='gpu')
  with pytest.raises(
    ValueError, match=r"Options\(update_on='host'\) runs the update where offloaded"
  ):
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=auto_mesh, update_on='host')


def test_stream_refuses_padding(auto_mesh):
  with pytest.raises(ValueError) as e:
    zerojax.Options(offload='opt_state', update_on='stream', policy='pad')
  assert str(e.value) == (
    "Options(update_on='stream') does not pad: its gradients reach host memory in the layout"
    " they were reduce-scattered into. Use policy='replicate' (or 'error') with it, or"
    " update_on='host'."
  )


def test_host_update_runs_optimizers_that_make_arrays(auto_mesh):
  """clip_by_global_norm builds zeros inside its update: in a host computation JAX typed them
  as device memory and refused to add them to host-memory gradients."""
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1))
  got = {}
  for offload, update_on in ((None, 'device'), ('opt_state', 'host'), ('opt_state', 'stream')):
    ztx = zerojax.zero_stage(tx, 2, mesh=auto_mesh, offload=offload, update_on=update_on)
    params = mlp_params()
    opt_state = ztx.init(params)
    params = jax.device_put(params, zerojax.plan_for(ztx, params).params)
    x, y = shard_batch(auto_mesh, *batch())

    @jax.jit
    def step(params, opt_state, x, y, ztx=ztx):
      grads = jax.grad(lambda p: loss_fn(p, x, y))(params)
      updates, opt_state = ztx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      for _ in range(5):
        params, opt_state = step(params, opt_state, x, y)
    said = [str(w.message) for w in caught if 'update_on' in str(w.message)]
    # Without mixed_precision there is no master step to stream through: said, once (a trace).
    assert said == ([NO_MASTER_STEP] if update_on == 'stream' else [])
    got[update_on] = params
  assert max_rel_err(got['host'], got['device']) <= train_tol(5)
  assert max_rel_err(got['stream'], got['device']) <= train_tol(5)


NO_MASTER_STEP = (
  "update_on='stream' sends back only the new parameters through the master step of"
  ' zerojax.mixed_precision, which this optimizer does not have. The update runs as with'
  " update_on='host': updates come back in full. Wrap the optimizer as"
  ' zero_stage(zerojax.mixed_precision(tx), ...) and pass params to update().'
)


def test_stream_says_when_gradients_arrive_on_the_device(auto_mesh):
  """jax.grad's gradients are in device memory: nothing streamed, and the update says so."""
  ztx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.adamw(1e-2)),
    3,
    mesh=auto_mesh,
    offload='opt_state+master',
    update_on='stream',
  )
  master = mlp_params()
  opt_state = ztx.init(master)
  params = jax.device_put(zerojax.cast(master, jnp.bfloat16), zerojax.plan_for(ztx, master).params)
  x, y = shard_batch(auto_mesh, *batch())
  grads = jax.jit(jax.grad(lambda p: loss_fn(p, x, y).astype(jnp.float32)))(params)
  with pytest.warns(UserWarning) as caught:
    jax.jit(ztx.update)(grads, opt_state, params)
  assert [str(w.message) for w in caught if 'update_on' in str(w.message)] == [
    "update_on='stream': every gradient arrived in device memory, so none was streamed during"
    " the backward pass; they go to host memory at once, as with update_on='host'. Take them"
    ' with zerojax.value_and_grad(loss_fn, tx, per_layer=True) at stage 2 or 3 to stream them'
    ' layer by layer.'
  ]


def _tiny_decoder_run(
  mesh,
  stage,
  micro_batches,
  offload,
  update_on,
  steps,
  tx,
  compute_dtype=jnp.bfloat16,
  start=None,
  between=None,
  compiler_options=None,
):
  """`steps` steps of the tiny scanned decoder; from `start` ((params, opt_state) of another
  run, placed in this run's layouts and memories) if given; `between(grads)` applied to the
  gradients before the update if given."""
  from zerojax._src.planner import presets

  cfg = presets.PRESETS['tiny']
  ztx = zerojax.zero_stage(
    zerojax.mixed_precision(tx), stage, mesh=mesh, offload=offload, update_on=update_on
  )
  master = presets.init_decoder(cfg, jax.random.key(0))
  opt_state = ztx.init(master)
  plan = zerojax.plan_for(ztx, master)
  params = jax.device_put(zerojax.cast(master, compute_dtype), plan.params)
  if start is not None:
    params = jax.device_put(start[0], plan.params)
    opt_state = jax.device_put(start[1], jax.tree.map(lambda x: x.sharding, opt_state))
  loss = lambda p, b: presets.decoder_loss(p, b, cfg, plan=plan, prefetch_next=True)
  grad_fn = zerojax.value_and_grad(loss, ztx, per_layer=stage >= 2, micro_batches=micro_batches)

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def step(params, opt_state, tokens):
    value, grads = grad_fn(params, tokens)
    if between is not None:
      grads = between(grads)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, cfg.vocab)
  tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.P('data')))
  losses = []
  for _ in range(steps):
    params, opt_state, value = step(params, opt_state, tokens)
    losses.append(float(value))
  return np.array(losses), params, opt_state


# Rounding every bf16 value the program asks for. By default XLA may carry a bf16
# intermediate in fp32 (`xla_allow_excess_precision`), and where it does so depends on
# the program; with clipping by the global norm the two programs then differ by bf16
# roundings (about 3e-4 relative in the loss after 20 steps, measured).
EXACT_BF16 = {'xla_allow_excess_precision': False}


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('micro_batches', [1, 2])
def test_stream_equals_no_offload(stage, micro_batches, auto_mesh):
  """ZeRO-Offload's streamed schedule on a scanned bf16 decoder (scan_layers, mixed_precision,
  AdamW with weight decay): the same losses, bf16 parameters and fp32 master weights as
  without offload, bit for bit (a difference in any step's rounding would show in every later
  loss).

  With one micro-batch: 4 steps, compiled as XLA compiles by default. With two: 4 steps with
  `clip_by_global_norm` (max norm 0.5; the first steps' norms, 0.54 to 1.5, all clip), which
  couples every leaf's update to every gradient, compiled with every bf16 value rounded
  (EXACT_BF16)."""
  adamw = optax.adamw(1e-2, weight_decay=0.1)
  if micro_batches == 1:
    tx, steps, options = adamw, 4, None
  else:
    tx, steps, options = optax.chain(optax.clip_by_global_norm(0.5), adamw), 4, EXACT_BF16
  run = functools.partial(_tiny_decoder_run, auto_mesh, stage, micro_batches, steps=steps, tx=tx)
  base = run(None, 'device', compiler_options=options)
  got = run('opt_state+master', 'stream', compiler_options=options)
  assert base[0][1:].min() < 0.98 * base[0][0], ('the run does not learn', base[0])
  np.testing.assert_array_equal(got[0], base[0])
  for a, b in zip(
    jax.tree.leaves((got[1], got[2].master)), jax.tree.leaves((base[1], base[2].master))
  ):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  master = got[2].master
  assert {x.sharding.memory_kind for x in jax.tree.leaves(master)} == {'pinned_host'}


def test_stream_takes_gradients_the_user_changed_as_they_are(monkeypatch):
  """Gradients changed between value_and_grad and the update (here halved) are not the ones
  value_and_grad noted: the update takes them as they are (finished on their own, then moved),
  and the run still equals the run without offload. Unchanged, they are taken from their
  noted parts."""
  from zerojax._src import streaming

  found = []
  take = streaming.take
  monkeypatch.setattr(streaming, 'take', lambda grads: found.append(take(grads)) or found[-1])
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  tx = optax.adamw(1e-2, weight_decay=0.1)
  half = lambda grads: jax.tree.map(lambda g: g * 0.5, grads)
  _tiny_decoder_run(mesh, 3, 2, 'opt_state+master', 'stream', 1, tx)
  # At stage 3 every leaf of the tiny decoder is split by its own gathers, so all 11 stream.
  assert all(x is not None for x in found[-1]) and len(found[-1]) == 11
  base = _tiny_decoder_run(mesh, 3, 2, None, 'device', 5, tx, between=half)
  got = _tiny_decoder_run(mesh, 3, 2, 'opt_state+master', 'stream', 5, tx, between=half)
  assert found[-1] == [None] * 11
  np.testing.assert_array_equal(got[0], base[0])
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(base[1])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- Ahead of time for a TPU v5e:2x4: device bytes per chip drop by the offloaded bytes.
D = 1024
PSI = 2 * D * D + 2 * D


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize('stage', [1, 3])
def test_tpu_device_bytes_drop_by_offloaded_bytes(stage):
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  from jax.experimental import topologies
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

  init_fn = make_init(D)  # d = 1024: every shard is whole TPU tiles, so no padding

  topology = topologies.get_topology_desc(topology_name='v5e:2x4', platform='tpu')
  mesh = Mesh(np.array(topology.devices), ('data',), axis_types=(AxisType.Auto,))
  x = jax.ShapeDtypeStruct(
    (64, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )
  out = {}
  for offload, update_on in [
    (None, 'device'),
    ('opt_state', 'device'),
    ('opt_state+master', 'device'),
    ('opt_state+master', 'host'),
  ]:
    state = zerojax.inspect.abstract_train_state(
      init_fn,
      jax.random.key(0),
      tx=zerojax.zero_stage(
        zerojax.mixed_precision(optax.adam(1e-3)),
        stage,
        mesh=mesh,
        offload=offload,
        update_on=update_on,
      ),
      param_dtype=jnp.bfloat16,
    )
    compiled = jax.jit(mp_step, donate_argnums=0).lower(state, x).compile()
    out[offload, update_on] = compiled.memory_analysis()
    if update_on == 'host':
      # The host runs the update alone: the all-gather of the updated shards
      # stays on the device (inside the host computation it would run as
      # host-side MegaScale transfers and double the device temporaries).
      assert 'MegaScaleCollective' not in compiled.as_text()
  moments, master = 8 * PSI // 8, 4 * PSI // 8
  base = out[None, 'device']
  assert base.host_argument_size_in_bytes == 0
  for key, host in [
    (('opt_state', 'device'), moments),
    (('opt_state+master', 'device'), moments + master),
    (('opt_state+master', 'host'), moments + master),
  ]:
    m = out[key]
    assert m.host_argument_size_in_bytes == host
    assert base.argument_size_in_bytes - m.argument_size_in_bytes == host

  def peak(m):
    return (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes
      + m.temp_size_in_bytes
    )

  # Streaming the state through the device brings it all down at once: temporaries grow
  # by about what the arguments lost. Updating on the host keeps it off the device:
  # only gradient shards go down and updates come back, so its peak stays well below
  # the streamed one. (Against no offload at all it depends on the compiler: this
  # model's 3 MiB of state per chip is about what the transfers stage on the device,
  # below it with libtpu 0.0.52, above it with 0.0.42, jax 0.10.2's pair.)
  streamed = peak(out['opt_state+master', 'device'])
  assert streamed > peak(base)
  assert peak(out['opt_state+master', 'host']) < streamed - master


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize('stage', [2, 3])
@pytest.mark.parametrize('micro_batches', [1, 2])
def test_tpu_stream_moves_layers_down_and_compute_dtype_parameters_back(stage, micro_batches):
  """update_on='stream' compiled for a TPU v5e:2x4 (the tiny scanned decoder, AdamW,
  mixed_precision, fp32 master and moments in host memory), bytes read off the HLO:

  - what comes back to the device is the new bf16 parameter shards and nothing
    else (a few bytes of scalars), one leaf at a time: no fp32 state or update;
  - the layer stacks' gradients go down from inside the backward layer loop, and
    nothing goes down more than once per micro-batch, in fp32 at most.
  """
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  from zerojax._src.planner import candidates, lowering, presets, tpu

  target = lowering.make_target(
    'tiny',
    'v5e:2x4',
    devices=tpu.topology_devices('v5e:2x4'),
    optimizer=lambda: optax.adamw(1e-4, weight_decay=0.1),
    mixed_precision=True,
    settings=presets.ModelSettings(seq_len=64),
  )
  candidate = candidates.Candidate(
    stage,
    micro_batches=micro_batches,
    offload='opt_state+master',
    update_on='stream',
    batch_per_chip=micro_batches,
  )
  lowered = lowering.lower(target, candidate)
  plan, state = lowered.plan, lowered.state
  moved = zerojax.inspect.count_host_transfers(lowered.lowered.compile())

  flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
  shard_bytes = {
    jax.tree_util.keystr(path): int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    for (path, x), s in zip(flat, jax.tree.leaves(plan.param_shards))
  }
  assert {x.dtype for _, x in flat} == {jnp.dtype(jnp.bfloat16)}
  layers = sum(b for k, b in shard_bytes.items() if k.startswith("['layers']"))
  depth = jax.tree.leaves(state.params['layers'])[0].shape[0]

  assert 0 <= moved.to_device - sum(shard_bytes.values()) <= 64
  assert moved.largest_to_device == max(shard_bytes.values())
  assert moved.in_loops >= micro_batches * layers * (depth - 1) // depth
  assert micro_batches * layers <= moved.to_host <= micro_batches * 2 * sum(shard_bytes.values())
  assert moved.uncertain == ()
