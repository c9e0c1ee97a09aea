"""ZeRO++ quantized collectives: qwZ (int8 weight gathers) and qgZ (int8/int4 gradient
reduce-scatters through an all-to-all), against numpy references and exact collectives."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import collective_ops
from _tolerance import assert_close, reordered
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._src import quantize as quantize_lib
from zerojax._src.planner import collectives, hlo

N = 8
ULP = float(np.finfo(np.float32).eps)


@pytest.fixture(scope='module')
def mesh():
  return jax.make_mesh((N,), ('data',))


# A numpy reference, written from the description in zerojax.Quantize: each shard or
# chunk flattened in the leaf's own row-major order, padded to whole blocks, scale = absmax / qmax per block, round half to even,
# clip; dequantize = values * scale.


def np_quantize(x, qmax, block):
  flat = np.asarray(x, np.float32).reshape(-1)
  flat = np.concatenate([flat, np.zeros((-flat.size) % block, np.float32)]).reshape(-1, block)
  scale = (np.abs(flat).max(axis=1) / np.float32(qmax)).astype(np.float32)
  safe = np.where(scale > 0, scale, np.float32(1))
  q = np.clip(np.round(flat / safe[:, None]), -qmax, qmax).astype(np.int8)
  return q, scale


def np_dequantize(q, scale, shape):
  flat = (q.astype(np.float32) * scale[:, None]).reshape(-1)[: int(np.prod(shape))]
  return flat.reshape(shape)


def np_gather(x, dim, qmax, block):
  """Each of N devices quantizes its shard of `x` along `dim`; all dequantize all."""
  parts = []
  for shard in np.split(np.asarray(x, np.float32), N, axis=dim):
    q, s = np_quantize(shard, qmax, block)
    parts.append(np_dequantize(q, s, shard.shape))
  return np.concatenate(parts, axis=dim)


def np_reduce_scatter(xs, dim, qmax, block):
  """Device k's part: the float32 sum over devices j of dequantize(chunk k of xs[j])."""
  out = []
  for k in range(N):
    total = 0
    for x in xs:
      chunk = np.split(np.asarray(x, np.float32), N, axis=dim)[k]
      q, s = np_quantize(chunk, qmax, block)
      total = total + np_dequantize(q, s, chunk.shape)
    out.append(total)
  return np.concatenate(out, axis=dim)


def heavy_tailed(key, shape):
  """Student-t with 2 degrees of freedom: rare values hundreds of times the typical one."""
  k1, k2 = jax.random.split(key)
  z = jax.random.normal(k1, shape)
  chi2 = jax.random.gamma(k2, 1.0, shape) * 2  # chi-squared, 2 degrees of freedom
  return z / jnp.sqrt(chi2 / 2)


DATA = {
  'normal': lambda key, shape: jax.random.normal(key, shape),
  'heavy-tailed': heavy_tailed,
}


@pytest.mark.parametrize('fmt, qmax', [('int8', 127), ('int4', 7)])
@pytest.mark.parametrize('shape', [(3, 100), (512,), (4, 8, 33)])
def test_block_quantization_matches_numpy(fmt, qmax, shape):
  x = 3 * jax.random.normal(jax.random.key(1), shape)
  q, scale = quantize_lib.quantize_blocks(x, fmt, 64)
  if fmt == 'int4':  # two values per byte
    assert q.dtype == jnp.uint8 and q.shape[1] == 32
  else:
    assert q.dtype == jnp.int8 and q.shape[1] == 64
  ref_q, ref_scale = np_quantize(x, qmax, 64)
  # XLA divides by the constant qmax as a multiply by its reciprocal: one ulp.
  np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=ULP, atol=0)
  back = quantize_lib.dequantize_blocks(q, scale, fmt, shape, jnp.float32)
  np.testing.assert_allclose(
    np.asarray(back), np_dequantize(ref_q, ref_scale, shape), rtol=2 * ULP, atol=0
  )


def _gather(mesh, x, dim, q):
  spec = [None] * x.ndim
  spec[dim] = 'data'
  fn = jax.shard_map(
    lambda s: quantize_lib.quantized_all_gather(s, ('data',), dim, q),
    mesh=mesh,
    in_specs=P(*spec),
    out_specs=P(),
    check_vma=False,
  )
  return jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P(*spec))))


def _reduce_scatter(mesh, xs, dim, q):
  spec = [None] * (xs.ndim - 1)
  spec[dim] = 'data'
  fn = jax.shard_map(
    lambda s: quantize_lib.reduce_scatter(s[0], ('data',), dim, q),
    mesh=mesh,
    in_specs=P('data'),
    out_specs=P(*spec),
    check_vma=False,
  )
  return jax.jit(fn)(jax.device_put(xs, NamedSharding(mesh, P('data'))))


@pytest.mark.parametrize('dim', [0, 1])
def test_quantized_gather_equals_the_numpy_reference(mesh, dim):
  x = jax.random.normal(jax.random.key(2), (64, 48))
  q = zerojax.Quantize(weights='int8', grads=None, block_size=32)
  out = _gather(mesh, x, dim, q)
  # The scale's one ulp (see above) and the product's rounding: two ulps.
  np.testing.assert_allclose(np.asarray(out), np_gather(x, dim, 127, 32), rtol=2 * ULP, atol=0)


@pytest.mark.parametrize('fmt, qmax', [('int8', 127), ('int4', 7)])
def test_quantized_reduce_scatter_equals_the_numpy_reference(mesh, fmt, qmax):
  xs = jax.random.normal(jax.random.key(3), (N, 16, 40))
  q = zerojax.Quantize(weights=None, grads=fmt, block_size=16)
  out = _reduce_scatter(mesh, xs, 1, q)
  # The same quantized values; the dequantized sum of N=8 parts in another order.
  assert_close(out, np_reduce_scatter(np.asarray(xs), 1, qmax, 16), reordered(N))


# Relative errors (Frobenius norm) measured on 2**16 values: normal data 0.59 /
# 0.69 / 0.78% for blocks of 64 / 256 / 1024, Student-t(2) 1.0 / 2.0 / 3.7%.
# The bounds sit about 1.3x above, far below what a wrong scale gives.
GATHER_BOUND = {
  ('normal', 64): 0.008,
  ('normal', 256): 0.009,
  ('normal', 1024): 0.010,
  ('heavy-tailed', 64): 0.014,
  ('heavy-tailed', 256): 0.026,
  ('heavy-tailed', 1024): 0.05,
}


@pytest.mark.parametrize('data', sorted(DATA))
@pytest.mark.parametrize('block', [64, 256, 1024])
def test_quantized_gather_error_is_bounded(mesh, data, block):
  x = DATA[data](jax.random.key(4), (256, 256))
  q = zerojax.Quantize(weights='int8', grads=None, block_size=block)
  out = np.asarray(_gather(mesh, x, 0, q))
  x = np.asarray(x)
  # Elementwise: at most half a step of the block's scale (absmax / 127 / 2).
  shards = np.split(x, N, axis=0)
  step = np.concatenate(
    [np.repeat(np_quantize(s, 127, block)[1], block)[: s.size].reshape(s.shape) for s in shards]
  )
  # Half a step, and the float32 rounding of the dequantizing multiply (1 + eps).
  assert np.all(np.abs(out - x) <= step / 2 * (1 + reordered(1)) + 1e-30)
  rel = np.linalg.norm(out - x) / np.linalg.norm(x)
  assert rel < GATHER_BOUND[(data, block)], rel


# Measured (the sum over 8 devices of 2**13 values each): int8 0.59 / 0.68 /
# 0.77% on normal data, 1.5 / 2.9 / 5.1% on Student-t(2); int4 10.7 / 12.4 /
# 14.4% and 16 / 26 / 36%. Bounds about 1.3x above.
REDUCE_BOUND = {
  ('normal', 64, 'int8'): 0.008,
  ('normal', 256, 'int8'): 0.009,
  ('normal', 1024, 'int8'): 0.010,
  ('heavy-tailed', 64, 'int8'): 0.02,
  ('heavy-tailed', 256, 'int8'): 0.04,
  ('heavy-tailed', 1024, 'int8'): 0.07,
  ('normal', 64, 'int4'): 0.14,
  ('normal', 256, 'int4'): 0.16,
  ('normal', 1024, 'int4'): 0.19,
  ('heavy-tailed', 64, 'int4'): 0.21,
  ('heavy-tailed', 256, 'int4'): 0.33,
  ('heavy-tailed', 1024, 'int4'): 0.47,
}


@pytest.mark.parametrize('data', sorted(DATA))
@pytest.mark.parametrize('block', [64, 256, 1024])
@pytest.mark.parametrize('fmt', ['int8', 'int4'])
def test_quantized_reduce_scatter_error_is_bounded(mesh, data, block, fmt):
  xs = DATA[data](jax.random.key(5), (N, 128, 64))
  q = zerojax.Quantize(weights=None, grads=fmt, block_size=block)
  out = np.asarray(_reduce_scatter(mesh, xs, 0, q))
  exact = np.asarray(xs).sum(axis=0)
  rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
  assert rel < REDUCE_BOUND[(data, block, fmt)], rel
  # Each device's contribution is off by at most half its block's step.
  qmax = quantize_lib._qmax(fmt)
  bound = 0
  for x in np.asarray(xs):
    parts = []
    for chunk in np.split(x, N, axis=0):
      scale = np_quantize(chunk, qmax, block)[1]
      parts.append(np.repeat(scale, block)[: chunk.size].reshape(chunk.shape))
    bound = bound + np.concatenate(parts) / 2
  # Beside the quantization, the float32 sums of the N parts round in another order.
  assert np.all(np.abs(out - exact) <= bound + reordered(N) * np.abs(np.asarray(xs)).sum(axis=0))


# In a training step: zerojax.value_and_grad with quantize= on zero_stage.


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(6), 3)
  return {
    'w1': 0.05 * jax.random.normal(k1, (256, 512)),
    'w2': 0.05 * jax.random.normal(k2, (512, 256)),
    'b': jnp.zeros((256,)),  # small: stays full precision
  }


def _loss(p, x, *, tx):
  p = zerojax.gather(p, tx, dtype=jnp.bfloat16)
  h = jnp.tanh(x.astype(jnp.bfloat16) @ p['w1']) @ p['w2'] + p['b']
  return jnp.mean(h.astype(jnp.float32) ** 2)


def _step(mesh, stage, quantize, **options):
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, quantize=quantize, **options)
  params = _params()
  plan = zerojax.plan_for(tx, params)
  params = jax.device_put(params, plan.params)
  x = jax.device_put(
    jax.random.normal(jax.random.key(7), (64, 256)),
    NamedSharding(mesh, P(options.get('axis', 'data'))),
  )
  fn = jax.jit(zerojax.value_and_grad(functools.partial(_loss, tx=tx), tx, per_layer=stage >= 2))
  return fn, params, x, plan


def _hlo(mesh, stage, quantize, **options):
  fn, params, x, _ = _step(mesh, stage, quantize, **options)
  return fn.lower(params, x).compile().as_text()


def test_quantized_gathers_move_int8_and_scales(mesh):
  exact = _hlo(mesh, 3, None)
  quant = _hlo(mesh, 3, zerojax.Quantize(weights='int8', grads=None))
  big = 256 * 512  # the two matrices' elements, gathered once each
  # Exact: the bf16 matrices (which XLA:CPU gathers widened to float32) and the bias.
  assert sorted(collective_ops(exact, 'all-gather')) == [('f32', 256 * 4)] + [('f32', big * 4)] * 2
  gathered = collective_ops(quant, 'all-gather')
  # Per matrix: its int8 values and its float32 scales (one per 256 values).
  assert sorted(gathered) == sorted([('f32', 256 * 4)] + [('s8', big), ('f32', big // 256 * 4)] * 2)
  matrices = sum(b for _, b in gathered) - 256 * 4
  assert matrices / (2 * big * 2) <= 0.53  # int8 + scales against bf16: 0.508
  # The gradients stay full-precision reduce-scatters (no all-to-all).
  assert not collective_ops(quant, 'all-to-all')
  assert len(collective_ops(quant, 'reduce-scatter')) == len(
    collective_ops(exact, 'reduce-scatter')
  )


@pytest.mark.parametrize('fmt, packed, limit', [('int8', 's8', 0.27), ('int4', 'u8', 0.14)])
def test_quantized_gradients_move_an_all_to_all_of_blocks(mesh, fmt, packed, limit):
  exact = _hlo(mesh, 2, None)
  quant = _hlo(mesh, 2, zerojax.Quantize(weights=None, grads=fmt))
  big = 256 * 512
  # Exact: each matrix's gradient is one float32 reduce-scatter into its shard.
  assert (
    sorted(b for _, b in collective_ops(exact, 'reduce-scatter') if b > 1024) == [big * 4 // N] * 2
  )
  # Quantized: one all-to-all per matrix of its values and their float32 scales' bytes (one
  # per 256 values) together, and no full-precision reduce-scatter of them.
  assert all(b <= 1024 for _, b in collective_ops(quant, 'reduce-scatter'))
  moved = collective_ops(quant, 'all-to-all')
  per_value = 1 if fmt == 'int8' else 0.5
  assert sorted(moved) == [(packed, int(big * per_value) + big // 256 * 4)] * 2
  ratio = sum(b for _, b in moved) / (2 * big * 4)
  assert ratio <= limit, ratio


def test_quantize_none_leaves_the_program_unchanged(mesh):
  for stage in (1, 2, 3):
    default = _hlo(mesh, stage, None)
    fn, params, x, _ = _step(mesh, stage, None)
    assert 's8[' not in default and not collective_ops(default, 'all-to-all')
    tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh)  # no quantize option at all
    plain = jax.jit(
      zerojax.value_and_grad(functools.partial(_loss, tx=tx), tx, per_layer=stage >= 2)
    )
    assert _canonical(plain.lower(params, x).compile().as_text()) == _canonical(default)


def _canonical(hlo):
  """The program without its source locations (which name the calling functions)."""
  hlo = hlo.split('\nFileNames', 1)[0]
  return re.sub(r', metadata=\{[^}]*\}', '', hlo)


@pytest.mark.parametrize(
  'stage, quantize',
  [
    (3, zerojax.Quantize()),
    (3, zerojax.Quantize(grads='int4')),
    (2, zerojax.Quantize(weights=None)),
    (1, zerojax.Quantize(weights=None, grads='int4')),
  ],
)
def test_quantized_step_stays_close_to_the_exact_one(mesh, stage, quantize):
  fn, params, x, _ = _step(mesh, stage, None)
  loss, grads = fn(params, x)
  qfn, qparams, qx, plan = _step(mesh, stage, quantize)
  qloss, qgrads = qfn(qparams, qx)
  # int8 weights move each weight by at most half a step, 1/254 of its block's
  # largest magnitude; over the thousands of weights behind the loss those
  # independent errors average out well below a tenth of that.
  assert abs(float(qloss) - float(loss)) < 1e-3 * abs(float(loss))
  bound = 0.02 if quantize.grads == 'int8' else 0.2
  for name in ('w1', 'w2'):
    rel = jnp.linalg.norm(qgrads[name] - grads[name]) / jnp.linalg.norm(grads[name])
    assert float(rel) < bound, (name, float(rel))
  # The bias is below min_size: its gradient is exact unless quantized weights feed it.
  if quantize.weights is None:
    np.testing.assert_array_equal(np.asarray(qgrads['b']), np.asarray(grads['b']))
  assert qgrads['w1'].sharding == grads['w1'].sharding


@pytest.mark.parametrize('stage', [2, 3])
def test_two_axis_mesh_reduces_within_hosts_first(stage):
  # ZeRO++'s hierarchy: with the axis inside a host named first,
  # axis=('chip', 'host'), gradients are reduce-scattered over 'chip' first and
  # only a quarter of them crosses hosts; parameter shards cross hosts first,
  # before they are gathered within the host.
  mesh = jax.make_mesh((2, 4), ('host', 'chip'))
  axis = ('chip', 'host')
  fn, params, x, _ = _step(mesh, stage, None, axis=axis)
  qfn, *_ = _step(mesh, stage, zerojax.Quantize(weights='int8' if stage == 3 else None), axis=axis)
  text = qfn.lower(params, x).compile().as_text()
  by_group = {}
  for line in text.splitlines():
    found = hlo.collective(line)
    if found and found[0] in ('all-to-all', 'all-gather'):
      key = (found[0], collectives.group_size(line, 8))
      by_group[key] = by_group.get(key, 0) + hlo.type_bytes(found[2])
  # One collective per mesh axis, not one over all 8 devices.
  assert {g for _, g in by_group} == {2, 4}
  # Gradients: what crosses hosts (groups of 2) is a quarter of what moves within them.
  assert by_group[('all-to-all', 2)] * 4 == by_group[('all-to-all', 4)]
  if stage == 3:  # weights: hosts exchange shards, chips then gather 4x the bytes
    assert by_group[('all-gather', 2)] * 4 == by_group[('all-gather', 4)]
  _, grads = fn(params, x)
  _, qgrads = qfn(params, x)
  rel = jnp.linalg.norm(qgrads['w1'] - grads['w1']) / jnp.linalg.norm(grads['w1'])
  assert float(rel) < 0.02


def test_plan_lists_what_stays_full_precision(mesh):
  params = dict(_params(), step=jnp.zeros((4096, 8), jnp.int32), odd=jnp.ones((1001, 33)))
  tx = zerojax.zero_stage(
    optax.sgd(0.1), 3, mesh=mesh, quantize=zerojax.Quantize(grads='int4'), policy='replicate'
  )
  plan = zerojax.plan_for(tx, params)
  text = str(plan)
  assert (
    'ZeRO++ quantized collectives (weights int8, gradients int4, blocks of 256): 2 of 5'
    ' parameter leaves'
  ) in text
  assert "  params['b']: 256 elements < min_size=16384" in text
  assert "  params['step']: int32 values are not quantized" in text
  assert (
    "  params['odd']: kept whole (not split over the ZeRO axes): no ZeRO collective to quantize"
  ) in text
  assert plan.quantized() == (
    None,
    None,
    None,
    plan.quantize,
    plan.quantize,
  )  # b, odd, step, w1, w2


@pytest.mark.parametrize(
  'stage, quantize, error, message',
  [
    (
      0,
      zerojax.Quantize(),
      ValueError,
      'quantize= needs ZeRO stage 1-3: stage 0 all-reduces whole gradients, and ZeRO++'
      ' quantizes the reduce-scatter and all-gather of sharded ones.',
    ),
    (
      2,
      zerojax.Quantize(),
      ValueError,
      "Quantize(weights='int8') quantizes stage-3 parameter gathers, and at stage 2"
      ' parameters are whole where they are used. Pass'
      " zerojax.Quantize(weights=None, grads='int8') or use stage 3.",
    ),
    (
      3,
      'int8',
      TypeError,
      'Options(quantize=...) must be a zerojax.Quantize or None, got str;'
      " e.g. zerojax.Quantize(weights='int8', grads='int4').",
    ),
  ],
)
def test_a_quantized_setting_that_cannot_apply_raises(mesh, stage, quantize, error, message):
  with pytest.raises(error) as info:
    zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, quantize=quantize)
  assert str(info.value) == message


@pytest.mark.parametrize(
  'kwargs, message',
  [
    (
      dict(weights='int4'),
      "Quantize(weights='int4'): weights quantize to one of ('int8',), or None.",
    ),
    (
      dict(weights=None, grads=None),
      'Quantize(weights=None, grads=None) quantizes nothing; pass quantize=None to'
      ' zero_stage instead.',
    ),
    (dict(block_size=0), 'Quantize(block_size=0) must be a positive int.'),
    (
      dict(block_size=33),
      'Quantize(block_size=33) must be even: int4 packs two values per byte.',
    ),
  ],
)
def test_quantize_options_are_checked(kwargs, message):
  with pytest.raises(ValueError) as info:
    zerojax.Quantize(**kwargs)
  assert str(info.value) == message


def test_recompute_gathers_regathers_quantized_weights(mesh):
  # A scanned stack under recompute_gathers: the backward pass gathers each
  # layer's int8 weights again rather than keeping the dequantized ones.
  layers = {'w': 0.05 * jax.random.normal(jax.random.key(8), (4, 256, 256))}
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh, quantize=zerojax.Quantize(grads=None))
  plan = zerojax.plan_for(tx, layers)
  layers = jax.device_put(layers, plan.params)

  def loss(p, x):
    def body(h, layer):
      w = zerojax.gather(layer, tx)['w']
      return jnp.tanh(h @ w), None

    body = jax.checkpoint(body, policy=zerojax.recompute_gathers)
    h, _ = jax.lax.scan(body, x, p)
    return jnp.mean(h**2)

  x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P('data')))
  fn = jax.jit(zerojax.value_and_grad(loss, tx, per_layer=True))
  stats = zerojax.inspect.count_collectives(fn.lower(layers, x).compile())
  # Per layer and pass: the int8 values and the scales, forward and backward.
  assert stats['all-gather'] == 4 * 2 * 2
  assert stats['all-to-all'] == 0


def test_step_report_shows_quantized_traffic_against_the_full_precision_floor(mesh):
  fn, params, x, plan = _step(mesh, 3, zerojax.Quantize(grads='int4'))
  exact_fn, *_ = _step(mesh, 3, None)
  quantized = zerojax.inspect.step_report(
    fn.lower(params, x).compile(), plan=plan, bytes_per_param=2
  )
  exact = zerojax.inspect.step_report(
    exact_fn.lower(params, x).compile(), plan=plan, bytes_per_param=2
  )
  text = str(quantized)
  assert (
    'ZeRO++ quantized collectives (weights int8, gradients int4, blocks of 256, on 2 of 3'
    ' parameter leaves): the floor counts full precision'
  ) in text
  ring = quantized.collectives.total_ring_bytes
  assert ring / quantized.floor_bytes < 0.5 * exact.collectives.total_ring_bytes / exact.floor_bytes
  assert f'measured/floor = {ring / quantized.floor_bytes:.3f}' in text


def test_gather_params_outside_value_and_grad_refuses_a_quantized_plan(mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, quantize=zerojax.Quantize())
  params = _params()
  plan = zerojax.plan_for(tx, params)
  with pytest.raises(ValueError) as info:
    zerojax.gather(jax.device_put(params, plan.params), plan)
  assert str(info.value) == (
    'this plan asks for ZeRO++ quantized collectives (quantize=...), which zerojax places'
    ' itself inside zerojax.value_and_grad; here the compiler would gather in full'
    ' precision. Differentiate with zerojax.value_and_grad(loss_fn, tx, per_layer=True),'
    ' or build the optimizer without quantize.'
  )


def test_whole_tree_gather_is_quantized_too(mesh):
  # Stage 3 without per_layer: value_and_grad gathers every parameter before
  # the loss, through the same quantized gather.
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh, quantize=zerojax.Quantize(grads=None))
  params = _params()
  plan = zerojax.plan_for(tx, params)
  placed = jax.device_put(params, plan.params)
  x = jax.device_put(
    jax.random.normal(jax.random.key(7), (64, 256)), NamedSharding(mesh, P('data'))
  )

  def loss(p, x):  # whole parameters arrive: no gather of its own
    h = jnp.tanh(x @ p['w1']) @ p['w2'] + p['b']
    return jnp.mean(h**2)

  fn = jax.jit(zerojax.value_and_grad(loss, tx))
  text = fn.lower(placed, x).compile().as_text()
  assert sorted(d for d, _ in collective_ops(text, 'all-gather')) == [
    'f32',
    'f32',
    'f32',
    's8',
    's8',
  ]
  _, grads = fn(placed, x)
  _, exact = jax.value_and_grad(loss)(params, np.asarray(x))
  # Compared on the host: one tree is placed on the test's mesh and one is not, and eager jax
  # arithmetic between the two once failed in CI with a mesh mismatch that depended on which
  # tests ran before on the worker.
  got, want = np.asarray(grads['w1']), np.asarray(exact['w1'])
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert float(rel) < 0.02


# Outlier rows on every split dimension. One row of a leaf 1000x larger than the rest (a
# rare token's embedding row, a layer whose rows differ in scale) must spoil only the blocks
# it shares, whichever dimension ZeRO splits: blocks hold neighbouring values of the leaf's
# last dimension. The split dimension is the plan's own choice for each shape, so the sweep
# follows the leaf rule (shapes from tests/test_layer_axis.py: plain matrices split along
# their rows or their columns, stacked layers along their second or third dimension).
OUTLIER_SHAPES = [(512, 64), (64, 512), (4, 1024, 32), (4, 32, 1024), (12, 768, 32), (2, 32, 4096)]
# Per-row relative error outside the outlier row, median over rows: the quantizer's level
# on normal data (measured on 8 devices: 0.0069-0.0070 in int8, 0.126-0.127 in int4, weights
# 0.0069-0.0070, on every case here), bounds about 1.5x above. Blocked with the split
# dimension moved first, as before, a leaf split along its last dimension measured 0.35
# (int8), 0.37 (int4) and 0.99 (weights).
ROW_BOUND = {'int8': 0.011, 'int4': 0.18}


def _split_dim(mesh, shape):
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh)
  spec = zerojax.plan_for(tx, {'w': jax.ShapeDtypeStruct(shape, jnp.float32)}).params['w'].spec
  (dim,) = [i for i, entry in enumerate(spec) if entry is not None]
  return dim


def _row_error(out, exact, outlier):
  """Median over the leaf's rows (all but the last dimension) of each row's relative error,
  leaving out the outlier row."""
  out = np.asarray(out).reshape(-1, exact.shape[-1])
  exact = exact.reshape(-1, exact.shape[-1])
  rel = np.linalg.norm(out - exact, axis=1) / np.linalg.norm(exact, axis=1)
  return float(np.median(np.delete(rel, outlier)))


def _outlier_row(shape):
  """A row near the middle of the leaf (flat row index over all but the last dimension)."""
  return int(np.prod(shape[:-1])) // 2 - 1


def _with_outlier(x, row):
  flat = np.array(x, np.float32).reshape(-1, x.shape[-1])
  flat[row] *= 1000
  return flat.reshape(x.shape)


@pytest.mark.parametrize('n', [2, 4, 8])
def test_outlier_rows_spoil_only_their_blocks_on_every_split(n):
  mesh = jax.make_mesh((n,), ('data',), devices=jax.devices()[:n])
  dims = set()
  for shape in OUTLIER_SHAPES:
    dim = _split_dim(mesh, shape)
    dims.add(dim)
    row = _outlier_row(shape)
    spec = [None] * len(shape)
    spec[dim] = 'data'
    # qgZ: every device's gradient, one of them with the outlier row.
    xs = np.array(jax.random.normal(jax.random.key(9), (n, *shape)))
    xs[n // 2] = _with_outlier(xs[n // 2], row)
    exact = xs.sum(axis=0)
    for fmt in ('int8', 'int4'):
      q = zerojax.Quantize(weights=None, grads=fmt)
      reduce = jax.shard_map(
        lambda s, q=q, dim=dim: quantize_lib.reduce_scatter(s[0], ('data',), dim, q),
        mesh=mesh,
        in_specs=P('data'),
        out_specs=P(*spec),
        check_vma=False,
      )
      out = jax.jit(reduce)(jax.device_put(xs, NamedSharding(mesh, P('data'))))
      err = _row_error(out, exact, row)
      assert err < ROW_BOUND[fmt], (n, shape, dim, fmt, err)
    # qwZ: a weight with the outlier row, gathered from its shards.
    w = _with_outlier(jax.random.normal(jax.random.key(10), shape), row)
    q = zerojax.Quantize(weights='int8', grads=None)
    gather = jax.shard_map(
      lambda s, dim=dim, q=q: quantize_lib.quantized_all_gather(s, ('data',), dim, q),
      mesh=mesh,
      in_specs=P(*spec),
      out_specs=P(),
      check_vma=False,
    )
    out = jax.jit(gather)(jax.device_put(w, NamedSharding(mesh, P(*spec))))
    err = _row_error(out, w, row)
    assert err < ROW_BOUND['int8'], (n, shape, dim, 'weights', err)
  # The sweep reached every split: rows, columns, and a stacked leaf's third dimension.
  assert dims == {0, 1, 2}, dims


@pytest.mark.parametrize('fmt', ['int8', 'int4'])
def test_a_stage_2_gradient_with_an_outlier_row_on_a_column_split_leaf(mesh, fmt):
  # The case through zerojax.value_and_grad: a (64, 512) leaf, which the plan splits
  # along its columns, whose gradient on one device has a row 1000x the rest.
  tx = zerojax.zero_stage(
    optax.adam(1e-3), 2, mesh=mesh, quantize=zerojax.Quantize(weights=None, grads=fmt)
  )
  params = {'w': jnp.zeros((64, 512))}
  plan = zerojax.plan_for(tx, params)
  assert tuple(plan.grads['w'].spec) == (None, 'data')
  coef = np.array(jax.random.normal(jax.random.key(11), (N, 64, 512)))
  coef[3, 31] *= 1000

  def loss(p, c):  # the mean over examples: the gradient is the mean of their c
    return jnp.mean(jnp.sum(p['w'][None] * c, axis=(1, 2)))

  fn = jax.jit(zerojax.value_and_grad(loss, tx))
  _, grads = fn(
    jax.device_put(params, plan.params), jax.device_put(coef, NamedSharding(mesh, P('data')))
  )
  assert grads['w'].sharding.spec == plan.grads['w'].spec
  err = _row_error(grads['w'], coef.mean(axis=0), 31)
  assert err < ROW_BOUND[fmt], err
