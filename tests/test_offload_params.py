"""Parameter offload (`offload_params=True`): parameters at rest in host memory, brought to the
device layer by layer inside zerojax.value_and_grad, updated where they live."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_apply, mlp_params, plan_of
from flax import nnx

import zerojax
from zerojax._src.planner import presets


def _decoder_run(mesh, stage, *, offload_params, update_on, micro_batches=1, steps=3, fused=True):
  """`steps` AdamW steps of the tiny scanned bf16 decoder (mixed_precision, fp32 master and
  moments in host memory): the losses, the parameters and the optimizer state. `fused` takes
  the new parameters through `tx.update.apply_gradients`, else `tx.update` and
  `optax.apply_updates`."""
  cfg = presets.PRESETS['tiny']
  ztx = zerojax.zero_stage(
    zerojax.mixed_precision(optax.adamw(1e-2, weight_decay=0.1)),
    stage,
    mesh=mesh,
    offload='opt_state+master',
    update_on=update_on,
    offload_params=offload_params,
  )
  master = presets.init_decoder(cfg, jax.random.key(0))
  plan = zerojax.plan_for(ztx, master)
  master = jax.device_put(master, jax.tree.map(lambda s: s.with_memory_kind('device'), plan.params))
  opt_state = ztx.init(master)
  params = jax.device_put(zerojax.cast(master, jnp.bfloat16), plan.params)
  loss = lambda p, b: presets.decoder_loss(p, b, cfg, plan=plan)
  grad_fn = zerojax.value_and_grad(loss, ztx, per_layer=stage >= 2, micro_batches=micro_batches)

  @jax.jit
  def step(params, opt_state, tokens):
    value, grads = grad_fn(params, tokens)
    if fused:
      params, opt_state = zerojax.apply_gradients(ztx, grads, opt_state, params)
      return params, opt_state, value
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, cfg.vocab)
  tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.P('data')))
  losses = []
  for _ in range(steps):
    params, opt_state, value = step(params, opt_state, tokens)
    losses.append(float(value))
  return np.array(losses), params, opt_state


@functools.cache
def _without_offload(stage, micro_batches):
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  return _decoder_run(
    mesh, stage, offload_params=False, update_on='stream', micro_batches=micro_batches, fused=False
  )


# Stage 0-1 bring every parameter to the device whole at the step's start; stage 2 streams
# gradients layer by layer; stage 3 also fetches each layer's shard inside the layer loop.
@pytest.mark.filterwarnings('ignore:update_on=.stream.. every gradient arrived')
@pytest.mark.parametrize(
  'stage, update_on, micro_batches',
  [(0, 'host', 1), (2, 'stream', 2), (3, 'stream', 1), (3, 'host', 2)],
)
def test_trains_bit_for_bit_like_parameters_on_the_device(
  stage, update_on, micro_batches, auto_mesh
):
  """The same losses, parameters and fp32 master as with the parameters on the device, and the
  parameters stay in host memory from step to step."""
  base = _without_offload(stage, micro_batches)
  got = _decoder_run(
    auto_mesh, stage, offload_params=True, update_on=update_on, micro_batches=micro_batches
  )
  assert base[0][-1] < 0.98 * base[0][0], ('the run does not learn', base[0])
  np.testing.assert_array_equal(got[0], base[0])
  for a, b in zip(
    jax.tree.leaves((got[1], got[2].master)), jax.tree.leaves((base[1], base[2].master))
  ):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got[1])} == {'pinned_host'}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(base[1])} == {'device'}


# The exact warning of `tx.update` on offloaded stage-3 parameters.
UPDATE_WARNING = (
  'offload_params=True at stage 3: tx.update returns the updates for optax.apply_updates,'
  ' and the compiler holds them, every layer at once, in device memory for that add; the'
  " device's peak then grows with the layer count. Take the new parameters in the update's"
  ' own host computation instead: params, opt_state = zerojax.apply_gradients(tx, grads,'
  ' opt_state, params) (a train state from zerojax.create_train_state does this in'
  ' state.apply_gradients; for Flax NNX, zerojax.nnx.Optimizer in place of nnx.Optimizer).'
)


@pytest.mark.parametrize('update_on', ['stream', 'host'])
def test_update_and_its_add_equal_apply_gradients_and_warn(update_on, auto_mesh):
  """`tx.update` + `optax.apply_updates` on offloaded stage-3 parameters: bit for bit what
  `tx.update.apply_gradients` makes in the update's host computation, with the warning naming
  that call (tracing the step warns once)."""
  fused = _decoder_run(auto_mesh, 3, offload_params=True, update_on=update_on, steps=2)
  with pytest.warns(UserWarning) as caught:
    split = _decoder_run(
      auto_mesh, 3, offload_params=True, update_on=update_on, steps=2, fused=False
    )
  assert [str(w.message) for w in caught if 'offload_params' in str(w.message)] == [UPDATE_WARNING]
  np.testing.assert_array_equal(fused[0], split[0])
  for a, b in zip(jax.tree.leaves(fused[1:]), jax.tree.leaves(split[1:])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(fused[1])} == {'pinned_host'}


def test_apply_gradients_needs_params_and_elsewhere_is_update_then_add(auto_mesh):
  params = mlp_params()
  ztx = zerojax.zero_stage(optax.adam(1e-2), 2, mesh=auto_mesh)
  state = ztx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.raises(TypeError) as e:
    ztx.update.apply_gradients(grads, state, None)
  assert str(e.value) == (
    'apply_gradients(grads, state, params): params is None; pass the parameters the'
    ' gradients are of (the new ones are made from them).'
  )
  assert not ztx.update.fuses
  new, new_state = jax.jit(ztx.update.apply_gradients)(grads, state, params)
  updates, ref_state = jax.jit(ztx.update)(grads, state, params)
  ref = optax.apply_updates(params, updates)
  for a, b in zip(jax.tree.leaves((new, new_state)), jax.tree.leaves((ref, ref_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_state_takes_offloaded_parameters_in_one_call(auto_mesh):
  """`zerojax.create_train_state`'s state: `apply_gradients` on offloaded stage-3 parameters
  goes through `tx.update.apply_gradients` (no warning; the split call's values, to fp32
  rounding)."""
  from flax.training import train_state as flax_train_state

  tx = zerojax.zero_stage(
    optax.adamw(1e-2), 3, mesh=auto_mesh, offload='opt_state', update_on='host', offload_params=True
  )
  state = zerojax.create_train_state(lambda: mlp_params(), tx=tx, apply_fn=None)
  assert isinstance(state, flax_train_state.TrainState)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), state.params)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
  with pytest.warns(UserWarning, match='offload_params=True at stage 3'):
    updates, _ = jax.jit(tx.update)(grads, state.opt_state, state.params)
  ref = jax.jit(optax.apply_updates)(state.params, updates)
  assert int(new.step) == 1
  # The add compiled inside the update's host computation may be contracted with it: XLA:CPU
  # with jax 0.12 rounds one of these fp32 values one ulp apart.
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-7, atol=0)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(new.params)} == {'pinned_host'}


def test_plain_optimizer_updates_on_the_host(auto_mesh):
  """Without mixed_precision (fp32 parameters, update_on='host'): equal to plain optax on the
  same gradients, parameters in host memory."""
  params = mlp_params()
  tx = optax.adamw(1e-2, weight_decay=0.1)
  ztx = zerojax.zero_stage(
    tx, 3, mesh=auto_mesh, offload='opt_state', update_on='host', offload_params=True
  )
  plan = zerojax.plan_for(ztx, params)
  placed = jax.device_put(params, plan.params)
  state = ztx.init(
    jax.device_put(params, jax.tree.map(lambda s: s.with_memory_kind('device'), plan.params))
  )
  x = jax.random.normal(jax.random.key(0), (32, 16))
  x = jax.device_put(x, jax.sharding.NamedSharding(auto_mesh, jax.P('data')))

  def loss(p, x):
    return jnp.mean(mlp_apply(p, x) ** 2)

  grad_fn = zerojax.value_and_grad(loss, ztx)

  @jax.jit
  def step(p, s, x):
    _, g = grad_fn(p, x)
    return ztx.update.apply_gradients(g, s, p)

  new, _ = step(placed, state, x)
  ref_state = tx.init(params)
  g = jax.grad(loss)(params, np.asarray(x))
  u, _ = tx.update(g, ref_state, params)
  ref = optax.apply_updates(params, u)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(new)} == {'pinned_host'}


def test_plan_counts_parameters_in_host_memory(auto_mesh):
  params = mlp_params()
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  kw = dict(stage=3, mesh=auto_mesh, offload='opt_state', update_on='host')
  on = plan_of(params, optax.adam(1e-3), offload_params=True, **kw)
  off = plan_of(params, optax.adam(1e-3), **kw)
  assert on.bytes_per_device()['params'] == 0
  assert off.bytes_per_device()['params'] == nbytes // 8
  assert on.bytes_per_device()['host'] == off.bytes_per_device()['host'] + nbytes // 8
  assert {s.memory_kind for s in jax.tree.leaves(on.params)} == {'pinned_host'}
  assert {s.memory_kind for s in jax.tree.leaves(on.param_shards)} == {'device'}


def test_options_say_what_offloaded_parameters_need():
  with pytest.raises(ValueError) as e:
    zerojax.Options(offload_params=True)
  assert str(e.value) == (
    'Options(offload_params=True) keeps the parameters in host memory, so the optimizer update'
    " runs there too: pass offload='opt_state' (or 'opt_state+master') and update_on='stream'"
    " (or 'host'), not update_on='device'."
  )
  with pytest.raises(TypeError, match=r"must be True or False, got 'yes'"):
    zerojax.Options(offload='opt_state', update_on='host', offload_params='yes')
  with pytest.raises(ValueError, match=r'offload_params=True\) does not pad'):
    zerojax.Options(offload='opt_state', update_on='host', offload_params=True, policy='pad')


def _tpu_compiled(
  n_layers, offload_params, topology='v5e:2x4', remat='gathers', model=None, prefetch=False
):
  """A decoder's stage-3 streamed step (bf16 parameters, fp32 master and moments in host
  memory, per-layer gathers) compiled for a TPU: by default the tiny preset with remat
  'gathers' on v5e:2x4. The planner's train state takes offloaded parameters through
  `tx.update.apply_gradients`."""
  import dataclasses

  from zerojax._src.planner import candidates, lowering, tpu

  model = dataclasses.replace(model or presets.PRESETS['tiny'], n_layers=n_layers)
  target = lowering.make_target(
    model,
    topology,
    devices=tpu.topology_devices(topology),
    optimizer=lambda: optax.adamw(1e-4, weight_decay=0.1),
    mixed_precision=True,
    settings=presets.ModelSettings(seq_len=64),
  )
  candidate = candidates.Candidate(
    3,
    remat=remat,
    offload='opt_state+master',
    update_on='stream',
    offload_params=offload_params,
    prefetch=prefetch,
  )
  lowered = lowering.lower(target, candidate)
  compiled = lowered.lowered.compile()
  stats = compiled.memory_analysis()
  device = (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )
  flat = jax.tree_util.tree_flatten_with_path(lowered.state.params)[0]
  shards = [
    int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    for (_, x), s in zip(flat, jax.tree.leaves(lowered.plan.param_shards))
  ]
  moved = zerojax.inspect.count_host_transfers(compiled)
  return dict(
    device=device,
    args=stats.argument_size_in_bytes,
    shards=sum(shards),
    # The leaves fetched layer by layer: the stacked matrices (16-bit stacks of norm scales
    # come to the device whole, docs/design.md).
    per_layer_leaves=sum(b for (_, x), b in zip(flat, shards) if x.ndim >= 3),
    moved=moved,
    host_temp=stats.host_temp_size_in_bytes,
  )


@pytest.mark.tpu
@pytest.mark.slow
@pytest.mark.xdist_group('libtpu')
def test_tpu_parameters_leave_device_memory_and_its_peak_stops_growing_with_depth():
  """Compiled for a TPU v5e:2x4 at 4 and 8 layers: the parameters are no longer device
  arguments, their shards come to the device from inside the layer loops, and the device's
  peak (arguments + outputs - aliased + temporaries) grows by at least one layer's parameter
  shards less per layer than with the parameters on the device (measured with libtpu
  0.0.42: not at all, against 98,816 bytes per layer)."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  got = {(op, n): _tpu_compiled(n, op) for op in (False, True) for n in (4, 8)}
  for n in (4, 8):
    base, off = got[False, n], got[True, n]
    assert off['args'] <= base['args'] - base['shards'], (n, off['args'], base['args'])
    assert off['moved'].in_loops > base['moved'].in_loops
    assert off['moved'].uncertain == ()
  per_layer = (got[False, 8]['shards'] - got[False, 4]['shards']) // 4
  base_slope = (got[False, 8]['device'] - got[False, 4]['device']) / 4
  slope = (got[True, 8]['device'] - got[True, 4]['device']) / 4
  assert slope <= base_slope - per_layer, (slope, base_slope, per_layer)


@pytest.mark.tpu
@pytest.mark.slow
@pytest.mark.xdist_group('libtpu')
def test_one_chip_device_peak_is_flat_in_depth_with_parameters_offloaded():
  """Compiled for one v5e chip (a 512-wide gated decoder, 64 tokens, remat 'full'): with the
  parameters offloaded, the device's peak (arguments + outputs - aliased + temporaries, host
  memory apart) is the same at 4 and at 8 layers (libtpu 0.0.42: 23,708,672 and 23,571,456
  bytes, where it grows by 16,946,560 bytes per layer with them on the device); the gradients'
  host stand-ins are what grows, in host memory. The host link carries what the formula of
  docs/design.md says."""
  pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu)')
  model = presets.DecoderConfig(4096, 512, 4, 8, 8, 2048, 128, gated=True)
  got = {
    (op, n): _tpu_compiled(n, op, 'v5e:1x1', 'full', model) for op in (False, True) for n in (4, 8)
  }
  per_layer = (got[False, 8]['shards'] - got[False, 4]['shards']) / 4
  base_slope = (got[False, 8]['device'] - got[False, 4]['device']) / 4
  slope = (got[True, 8]['device'] - got[True, 4]['device']) / 4
  assert base_slope >= per_layer, (base_slope, per_layer)
  assert abs(slope) <= 0.002 * got[True, 4]['device'], (slope, got[True, 4]['device'])
  assert got[True, 4]['args'] <= got[False, 4]['args'] - got[False, 4]['shards']
  assert got[True, 8]['host_temp'] - got[True, 4]['host_temp'] >= 4 * per_layer
  # The host link, per step: each layer's matrices come up twice (forward and backward
  # passes), the other leaves once (whole, at the step's start), besides a scalar; the
  # streamed gradients go down as without parameter offload, and nothing else does.
  for n in (4, 8):
    up, base, fetched = (
      got[True, n]['moved'],
      got[False, n]['moved'],
      got[True, n]['per_layer_leaves'],
    )
    formula = 2 * fetched + (got[True, n]['shards'] - fetched)
    assert 0 <= up.to_device - formula <= 64, (n, up.to_device, formula)
    assert up.to_host == base.to_host, (n, up.to_host, base.to_host)
  # Prefetched (`scan_layers`: layer i+1 fetched while layer i computes): at most a layer's
  # parameters above, growing by under a quarter of a layer's per layer (libtpu 0.0.42: 0.95 MB
  # at 64 tokens), and the host link overlaps compute more.
  ahead = {n: _tpu_compiled(n, True, 'v5e:1x1', 'full', model, prefetch=True) for n in (4, 8)}
  assert (ahead[8]['device'] - ahead[4]['device']) / 4 <= per_layer / 4
  assert 0 < ahead[4]['device'] - got[True, 4]['device'] <= 1.1 * per_layer
  assert ahead[4]['moved'].overlapped >= 0.9 > got[False, 4]['moved'].overlapped


@pytest.mark.slow
def test_the_one_chip_benchmark_runs_tiny_and_every_setting_trains_alike(tmp_path):
  """benchmarks/bench_one_chip_gpu.py at a tiny size on the CPU: its JSON and table are written,
  and the settings (everything on the device; the parameters in host memory too) train to the
  same losses."""
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).parents[1] / 'benchmarks' / 'bench_one_chip_gpu.py'
  spec = importlib.util.spec_from_file_location('bench_one_chip_gpu', path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  argv = ['--tiny', '--settings', 'plain,+params', '--seq-len', '16', '--batch', '2']
  assert bench.main([*argv, '--steps', '2', '--out', str(tmp_path)]) == 0
  import json

  run = json.loads((tmp_path / 'one_chip_gpu.json').read_text())
  rows = {r['setting']: r for r in run['rows']}
  assert set(rows) == {'plain', '+params'} and run['device'] == 'cpu'
  assert len(rows['plain']['losses']) == 4  # two warm-up steps and two timed
  assert rows['+params']['losses'] == rows['plain']['losses']
  assert rows['plain']['losses'][-1] < rows['plain']['losses'][0]
  table = (tmp_path / 'one_chip_gpu.md').read_text()
  assert '| +params | tiny-a | 106,816 |' in table
  assert 'Largest that trained: plain tiny-a, +params tiny-a' in table


def test_a_mesh_with_replica_axes_refuses_offloaded_parameters_per_layer():
  """Offloaded parameters send gradient shards down from inside the backward pass, before the
  sum over replica axes: refused, with the fix, before anything is placed."""
  mesh = jax.make_mesh((2, 4), ('replica', 'data'), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  tx = zerojax.zero_stage(
    optax.adam(1e-3), 3, mesh=mesh, replica_axis='replica', offload='opt_state',
    update_on='host', offload_params=True,
  )  # fmt: skip
  grad_fn = zerojax.value_and_grad(lambda p, x: jnp.mean(mlp_apply(p, x) ** 2), tx, per_layer=True)
  with pytest.raises(ValueError) as e:
    jax.eval_shape(grad_fn, mlp_params(), jnp.zeros((32, 16)))
  assert str(e.value) == (
    'offload_params=True sends gradient shards to host memory from inside the backward pass,'
    " before they could be summed over the replica axes ('replica',); keep the parameters on"
    ' the device (offload_params=False) on a mesh with replica axes (e.g. several TPU slices).'
  )


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(16, 32, rngs=rngs)
    self.b = nnx.Linear(32, 16, rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))


def _nnx_steps(mesh, optimizer_class, steps=2, **options):
  tx = zerojax.zero_stage(optax.adamw(1e-2, weight_decay=0.1), 3, mesh=mesh, **options)
  model = zerojax.nnx.shard(_MLP(nnx.Rngs(0)), tx)
  optimizer = optimizer_class(model, tx, wrt=nnx.Param)
  grad_fn = zerojax.nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2), tx)

  @nnx.jit
  def step(model, optimizer, x):
    loss, grads = grad_fn(model, x)
    return loss, optimizer.update(model, grads)

  x = jax.random.normal(jax.random.key(0), (32, 16))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P('data')))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    out = [step(model, optimizer, x) for _ in range(steps)]
  said = [str(w.message) for w in caught if 'offload_params' in str(w.message)]
  return model, optimizer, out, said


def test_nnx_optimizer_takes_offloaded_parameters_in_one_call(auto_mesh):
  """zerojax.nnx.Optimizer: with offloaded stage-3 parameters its update is apply_gradients
  (no warning, nothing returned, parameters stay in host memory), equal to nnx.Optimizer's
  update + add to fp32 rounding; without offload it is nnx.Optimizer's own, bit for bit."""
  offload = dict(offload='opt_state', update_on='host', offload_params=True)
  model, optimizer, out, said = _nnx_steps(auto_mesh, zerojax.nnx.Optimizer, **offload)
  ref_model, ref_optimizer, ref_out, ref_said = _nnx_steps(auto_mesh, nnx.Optimizer, **offload)
  assert (said, set(ref_said)) == ([], {UPDATE_WARNING})
  assert [u for _, u in out] == [None, None]
  assert int(optimizer.step[...]) == 2
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert {p.sharding.memory_kind for p in params} == {'pinned_host'}
  for a, b in zip(params, jax.tree.leaves(nnx.state(ref_model, nnx.Param))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-7, atol=0)
  np.testing.assert_allclose(float(out[1][0]), float(ref_out[1][0]), rtol=1e-6)

  model, _, out, said = _nnx_steps(auto_mesh, zerojax.nnx.Optimizer)
  ref_model, _, ref_out, _ = _nnx_steps(auto_mesh, nnx.Optimizer)
  assert said == [] and all(u is not None for _, u in out)
  for a, b in zip(
    jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(ref_model, nnx.Param))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
