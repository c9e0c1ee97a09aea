"""The TPU contract, compiled ahead of time for a v5e:2x4 pod slice with no TPU.

libtpu (the `tpu` extra) gives the real TPU compiler on a CPU-only machine; its
program shows what a pod would run: per-chip bytes and the collectives.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import collective_ops, make_init, step
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import zerojax
from zerojax._src import quantize as zerojax_quantize

pytest.importorskip('libtpu', reason='needs the tpu extra (libtpu) for ahead-of-time compilation')
from jax.experimental import topologies  # noqa: E402

# libtpu takes a lock per process; the tests only compile, so several may load it.
pytestmark = [pytest.mark.tpu, pytest.mark.xdist_group('libtpu')]
TPU_SCALAR_BYTES = 512  # the TPU pads each scalar argument to 512 bytes
# With d = 1024 every shard is a whole number of TPU tiles (a bias shard is 128
# floats), so the arrays' bytes per chip are exactly the formula's.
D = 1024
PSI = 2 * D * D + 2 * D
AT_REST = {0: 12 * PSI, 1: 4 * PSI + 8 * PSI // 8, 2: 4 * PSI + 8 * PSI // 8, 3: 12 * PSI // 8}


init_fn = make_init(D)


@pytest.fixture(scope='module')
def topology():
  return topologies.get_topology_desc(topology_name='v5e:2x4', platform='tpu')


@pytest.fixture(params=['explicit', 'auto'])
def tpu_mesh(request, topology):
  assert len(topology.devices) == 8
  kind = AxisType.Explicit if request.param == 'explicit' else AxisType.Auto
  return Mesh(np.array(topology.devices), ('data',), axis_types=(kind,))


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_per_chip_bytes_and_reduce_scatter(stage, tpu_mesh):
  state = zerojax.inspect.abstract_train_state(
    init_fn, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-3), stage, mesh=tpu_mesh)
  )
  x = jax.ShapeDtypeStruct(
    (64, D), jnp.float32, sharding=NamedSharding(tpu_mesh, PartitionSpec('data'))
  )
  compiled = jax.jit(step).lower(state, x).compile()

  arrays = AT_REST[stage] + 64 * D * 4 // 8
  assert (
    arrays + 2 * 4
    <= zerojax.inspect.memory_stats(compiled).argument
    <= arrays + 2 * TPU_SCALAR_BYTES
  )

  stats = zerojax.inspect.count_collectives(compiled)
  grad_bytes = 4 * PSI
  if stage == 0:
    assert stats.result_bytes['all-reduce'] == grad_bytes
    assert stats['reduce-scatter'] == 0 and stats['all-gather'] == 0
  else:
    # The weight gradients are reduced into shards by a real reduce-scatter on
    # TPU (the compiler may all-reduce the small bias gradients instead)...
    matrices = 4 * 2 * D * D
    assert stats['reduce-scatter'] >= 1
    assert stats.result_bytes['reduce-scatter'] >= matrices // 8
    # ...and no weight gradient is all-reduced at full size.
    assert stats.result_bytes.get('all-reduce', 0) < 4 * D * D
  if stage in (1, 2):
    # The updated fp32 parameters are gathered: all of them, once.
    assert grad_bytes <= stats.result_bytes['all-gather'] < grad_bytes + 4 * 2 * D
  if stage == 3:
    # Each weight is gathered whole for the forward pass (the TPU compiler
    # moves its default-precision bf16 cast before the gather, halving the
    # bytes), and at most once more for the backward pass.
    matrices_bf16 = 2 * 2 * D * D
    assert matrices_bf16 <= stats.result_bytes['all-gather'] <= 2 * grad_bytes


@pytest.mark.parametrize('stage', [2, 3])
def test_scanned_model_moves_at_most_the_floor_on_tpu(stage, topology):
  # A scanned model through zerojax.value_and_grad(per_layer=True): the TPU compiler's
  # own program reduce-scatters each layer's gradient (no per-layer all-reduce) and
  # moves no more than ZeRO's floor.
  import os
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))
  import recipes

  mesh = Mesh(np.array(topology.devices), ('data',), axis_types=(AxisType.Auto,))
  layers, width = 4, 1024
  ztx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)
  params = jax.eval_shape(lambda: recipes.init_params(jax.random.key(0), layers, width))
  plan = zerojax.plan_for(ztx, params)
  gather = lambda w: zerojax.gather(w, ztx)
  policy = zerojax.recompute_gathers if stage == 3 else None

  def loss_fn(p, b):
    return recipes.mse(recipes.forward(p, b['x'], gather, policy), b['y'])

  grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=True)

  def train_step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with_sharding = lambda tree, sh: jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
  )
  args = with_sharding(params, plan.params)
  opt_state = with_sharding(jax.eval_shape(ztx.init, params), plan.opt_state)
  rows = NamedSharding(mesh, PartitionSpec('data'))
  batch = {k: jax.ShapeDtypeStruct((64, width), jnp.float32, sharding=rows) for k in 'xy'}
  compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(args, opt_state, batch).compile()
  stats = zerojax.inspect.count_collectives(compiled)
  assert stats.exact
  floor = zerojax.inspect.zero_floor_bytes(stage, layers * width * width, 8)
  assert stats.total_ring_bytes <= floor * 1.001, (stats, floor)
  assert stats['reduce-scatter'] >= layers, stats
  assert stats.result_bytes.get('all-reduce', 0) <= 64
  if stage == 3:
    # The TPU compiler runs the backward pass's re-gathers asynchronously, each
    # overlapping the weight-gradient matmul scheduled before its done.
    assert stats.overlapped_ring_bytes.get('all-gather', 0) >= stats.ring_bytes['all-gather'] / 2
    assert 'asynchronous, with compute scheduled before their done' in str(
      zerojax.inspect.step_report(compiled)
    )


@pytest.mark.parametrize('stage', [2, 3])
def test_two_axis_mesh_keeps_reduce_scatters_on_a_2d_torus(stage):
  # Over a whole 2-D torus (v5e:4x4) the TPU compiler lowers one reduce-scatter
  # to an all-reduce; zerojax runs multi-axis collectives one axis at a time,
  # so a ('a', 'b') mesh keeps real reduce-scatters and stays within the floor.
  import os
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))
  import recipes

  desc = topologies.get_topology_desc(topology_name='v5e:4x4', platform='tpu')
  mesh = Mesh(np.array(desc.devices).reshape(4, 4), ('a', 'b'), axis_types=(AxisType.Auto,) * 2)
  layers, width = 4, 1024
  ztx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, axis=('a', 'b'))
  params = jax.eval_shape(lambda: recipes.init_params(jax.random.key(0), layers, width))
  plan = zerojax.plan_for(ztx, params)
  gather = lambda w: zerojax.gather(w, ztx)
  policy = zerojax.recompute_gathers if stage == 3 else None

  def loss_fn(p, b):
    return recipes.mse(recipes.forward(p, b['x'], gather, policy), b['y'])

  grad_fn = zerojax.value_and_grad(loss_fn, ztx, per_layer=True)

  def train_step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    updates, opt_state = ztx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with_sharding = lambda tree, sh: jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
  )
  rows = NamedSharding(mesh, PartitionSpec(('a', 'b')))
  batch = {k: jax.ShapeDtypeStruct((64, width), jnp.float32, sharding=rows) for k in 'xy'}
  compiled = (
    jax.jit(train_step, donate_argnums=(0, 1))
    .lower(
      with_sharding(params, plan.params),
      with_sharding(jax.eval_shape(ztx.init, params), plan.opt_state),
      batch,
    )
    .compile()
  )
  stats = zerojax.inspect.count_collectives(compiled)
  assert stats['reduce-scatter'] == 2 * layers  # one per axis, per layer
  assert not stats['all-reduce'], stats
  assert stats.total_ring_bytes <= zerojax.inspect.zero_floor_bytes(
    stage, layers * width * width, 16
  )


@pytest.mark.parametrize('fmt, limit', [('int8', 0.27), ('int4', 0.14)])
def test_quantized_collectives_compile_for_tpu(fmt, limit, topology):
  # ZeRO++ on the TPU compiler's own program: the weight gathers move int8
  # values and float32 scales (<= 0.53x bf16), the gradient exchange is an
  # all-to-all of int8 / packed int4 blocks (<= 0.27x / 0.14x float32).

  mesh = Mesh(np.array(topology.devices), ('data',), axis_types=(AxisType.Explicit,))
  params = {'w1': jax.ShapeDtypeStruct((D, D), jnp.float32)}
  params['w2'] = params['w1']

  def loss(p, x, *, tx):
    p = zerojax.gather(p, tx, dtype=jnp.bfloat16)
    h = jnp.tanh(x.astype(jnp.bfloat16) @ p['w1']) @ p['w2']
    return jnp.mean(h.astype(jnp.float32) ** 2)

  def compile_with(quantize):
    tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, quantize=quantize)
    plan = zerojax.plan_for(tx, params)
    p = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), params, plan.params
    )
    x = jax.ShapeDtypeStruct(
      (64, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data'))
    )
    fn = jax.jit(zerojax.value_and_grad(functools.partial(loss, tx=tx), tx, per_layer=True))
    return fn.lower(p, x).compile().as_text()

  exact = compile_with(None)
  quant = compile_with(zerojax.Quantize(weights='int8', grads=fmt))
  big = D * D
  # TPU gathers the bf16 weights as bf16 (CPU widens them to f32); counted once
  # per async collective (the HLO repeats each inside its fusions).
  full = zerojax.inspect.count_collectives(exact)
  assert full['all-gather'] == 2 and full.result_bytes['all-gather'] == 2 * big * 2
  assert {dtype for dtype, _ in collective_ops(exact, 'all-gather')} == {'bf16'}
  stats = zerojax.inspect.count_collectives(quant)
  # Per matrix: its int8 values and its float32 scales (one per 256 values).
  assert stats['all-gather'] == 4
  assert stats.result_bytes['all-gather'] == 2 * (big + big // 256 * 4)
  assert {dtype for dtype, _ in collective_ops(quant, 'all-gather')} == {'s8', 'f32'}
  assert stats.result_bytes['all-gather'] / (2 * big * 2) <= 0.53
  packed = 's8' if fmt == 'int8' else 'u8'
  # One all-to-all per matrix: its values and, after them, its scales' bytes.
  assert {dtype for dtype, _ in collective_ops(quant, 'all-to-all')} == {packed}
  assert stats['all-to-all'] == 2
  per_value = 1 if fmt == 'int8' else 0.5
  assert stats.result_bytes['all-to-all'] == 2 * (int(big * per_value) + big // 256 * 4)
  assert stats.result_bytes['all-to-all'] / (2 * big * 4) <= limit
  assert stats['reduce-scatter'] == 0  # no full-precision gradient collective left


def _laid_out_bytes(type_str):
  """Bytes of an HLO array type as the TPU compiler lays it out: its two minor dimensions
  padded to the first tile of its layout (`s8[8,94,256]{2,1,0:T(8,128)(4,1)}`)."""
  import re

  dtype, dims, tile = re.match(r'(\w+)\[([\d,]*)\]\{[\d,]*:T\(([\d,]+)\)', type_str).groups()
  dims, tile = [int(d) for d in dims.split(',')], [int(t) for t in tile.split(',')]
  for i, t in enumerate(tile, start=len(dims) - len(tile)):
    dims[i] = -(-dims[i] // t) * t
  return int(np.prod(dims)) * {'s8': 1, 'u8': 1, 'f32': 4}[dtype]


def test_gradient_scales_take_one_per_block_as_laid_out_on_tpu(topology):
  # A leaf whose share per peer holds fewer than 128 blocks (here 94): sent on their own, its
  # scales filled a row of 128 float32 lanes per peer (f32[8,1,94] laid out as [8,1,128]) and
  # its values whole tiles of 8 blocks (s8[8,94,256] as [8,96,256]): 200,704 bytes. Sent in
  # one buffer, values then scales, what the compiler lays out is the values and one scale
  # per block rounded up to its tile, at most 512 bytes per peer: 196,608 bytes.
  mesh = Mesh(np.array(topology.devices), ('data',), axis_types=(AxisType.Explicit,))
  shape, n = (376, 512), 8
  grad = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  scatter = jax.jit(
    jax.shard_map(
      lambda g: zerojax_quantize.reduce_scatter(g, ('data',), 0, zerojax.Quantize(grads='int8')),
      mesh=mesh,
      in_specs=PartitionSpec(),
      out_specs=PartitionSpec('data'),
    )
  )
  text = scatter.lower(grad).compile().as_text()
  blocks = shape[0] * shape[1] // n // 256
  assert blocks == 94
  sent = [line for line in text.splitlines() if ' all-to-all(' in line]
  assert len(sent) == 1, sent
  type_str = sent[0].split('=', 1)[1].strip().split(' ')[0]
  logical = n * blocks * (256 + 4)  # int8 values and one float32 scale per block, per peer
  assert collective_ops(text, 'all-to-all') == [('s8', logical)]
  assert logical <= _laid_out_bytes(type_str) <= logical + 512 * n, type_str


def test_scan_layers_prefetches_the_next_layers_gather_on_tpu(topology):
  # Without prefetching, the TPU compiler runs each forward gather and the
  # layer that uses it back to back (synchronous); zerojax.scan_layers issues
  # layer i+1's gather before layer i runs, and the compiler makes it an async
  # collective with that layer's matmul scheduled before its done.
  import os
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))
  import recipes

  mesh = Mesh(np.array(topology.devices), ('data',), axis_types=(AxisType.Auto,))
  layers, width = 4, 1024
  ztx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  params = jax.eval_shape(lambda: recipes.init_params(jax.random.key(0), layers, width))
  plan = zerojax.plan_for(ztx, params)
  args = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, plan.params
  )
  rows = NamedSharding(mesh, PartitionSpec('data'))
  batch = {k: jax.ShapeDtypeStruct((64, width), jnp.float32, sharding=rows) for k in 'xy'}

  def overlap(loss_fn):
    grad_fn = jax.jit(zerojax.value_and_grad(loss_fn, ztx, per_layer=True))
    stats = zerojax.inspect.count_collectives(grad_fn.lower(args, batch).compile())
    assert stats['all-gather'] == 2 * layers and stats['reduce-scatter'] == layers
    return stats.overlapped_ring_bytes.get('all-gather', 0) / stats.ring_bytes['all-gather']

  gather = lambda w: zerojax.gather(w, ztx)
  per_layer = overlap(
    lambda p, b: recipes.mse(recipes.forward(p, b['x'], gather, zerojax.recompute_gathers), b['y'])
  )
  prefetched = overlap(
    lambda p, b: recipes.mse(zerojax.scan_layers(recipes.layer, b['x'], p['w'], ztx), b['y'])
  )
  # Forward gathers synchronous: only the backward pass's overlap (half).
  assert per_layer == pytest.approx(0.5)
  # Prefetched: the forward loop's gathers overlap too; the first layer's
  # gather in each pass has nothing before it to overlap.
  assert prefetched == pytest.approx(0.75)


def test_the_peak_is_the_tpu_compilers_own_and_holds_what_the_program_gathers(topology):
  """On TPU the peak is the compiler's own figure (its allocation total where jax reports it,
  else its peak of live bytes), which holds every buffer the program makes: here a whole
  gathered 4096 x 4096 bf16 matrix (32 MiB) beside the shards it came from. The compiler's
  `temp_size_in_bytes` does not count such buffers on every libtpu (0.0.42 reports 0 for
  this program), so arguments + outputs + temporaries would understate the peak. On CPU the
  peak stays that sum."""
  from zerojax._src.planner import report

  mesh = Mesh(np.array(topology.devices), ('d',), axis_types=(AxisType.Auto,))
  n = 4096
  x = jax.ShapeDtypeStruct(
    (8 * n, n), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec('d'))
  )
  w = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec('d')))

  def f(x, w):
    whole = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec()))
    for _ in range(3):
      x = jnp.tanh(x @ whole) + x
    return x

  compiled = jax.jit(f).trace(x, w).lower().compile()
  raw = compiled.memory_analysis()
  m = report.memory_stats(compiled)
  assert m.compiler_peak == raw.peak_memory_in_bytes > 0
  assert m.allocated == int(getattr(raw, 'total_allocation_bytes', 0) or 0)
  assert m.peak == max(m.allocated, m.compiler_peak)
  gathered = n * n * 2
  assert m.peak >= m.argument + m.output + gathered
  assert m.source.startswith("the TPU compiler's")
  # With state in host memory the compiler's figures count host memory too: the device's
  # peak is then the sum, device only.
  on_host = NamedSharding(mesh, PartitionSpec('d'), memory_kind='pinned_host')
  h = jax.ShapeDtypeStruct((8 * n, n), jnp.float32, sharding=on_host)
  to_device = NamedSharding(mesh, PartitionSpec('d'), memory_kind='device')
  offloaded = jax.jit(lambda x, w, h: f(x, w) + jax.device_put(h, to_device).astype(x.dtype))
  compiled = offloaded.trace(x, w, h).lower().compile()
  assert compiled.memory_analysis().host_argument_size_in_bytes > 0
  m = report.memory_stats(compiled)
  assert (m.compiler_peak, m.allocated) == (0, 0) and m.host_held >= 8 * n * n * 4 // 8
  assert m.peak == m.formula_peak and m.source == 'arguments + outputs - aliased + temporaries'
  assert 'it reports no device-only peak' in report.format_report(
    report.StepReport(m, report.count_collectives(compiled))
  )
  # The same on CPU: the compiler's figure is not used there.
  cpu = jax.jit(lambda a: jnp.tanh(a @ a.T)).trace(jax.ShapeDtypeStruct((64, 32), jnp.float32))
  c = report.memory_stats(cpu.lower().compile())
  assert (c.compiler_peak, c.allocated) == (0, 0)
  assert c.peak == c.formula_peak == c.argument + c.output - c.alias + c.temp
