"""value_and_grad means what the loss means on the global batch: aux, weighted losses, keys.

Each test compares with `jax.value_and_grad` of the same loss on the whole batch under
`jax.jit`, or asserts the exact error for a loss whose per-device parts cannot be combined.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _errors import zerojax_note
from _models import BATCH, GRAD_TOL, batch, max_rel_err, mlp_apply, mlp_params, shard_batch
from _tolerance import EPS32, assert_close, reordered
from jax.sharding import NamedSharding, PartitionSpec

import zerojax

STAGES = [0, 1, 2, 3]


def _placed(mesh, stage, **options):
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, **options)
  return tx, jax.device_put(mlp_params(), zerojax.plan_for(tx, mlp_params()).params)


def _padding_mask():
  # Uneven padding: the devices' parts hold 1 to 4 real rows of 4, so per-device
  # normalisation would weigh the rows of sparse parts up.
  keep = np.zeros(BATCH, np.float32)
  for part in range(8):
    keep[part * 4 : part * 4 + [1, 4, 2, 4, 1, 3, 4, 1][part]] = 1.0
  return jnp.asarray(keep)


def _weighted_loss(p, b):
  err = jnp.sum((mlp_apply(p, b['x']) - b['y']) ** 2, axis=-1)
  return zerojax.WeightedMean(jnp.sum(err * b['mask']), jnp.sum(b['mask']))


@pytest.mark.parametrize('stage', STAGES)
@pytest.mark.parametrize('micro', [1, 2])
def test_aux_comes_back_with_every_row(stage, micro, mesh):
  x, y = batch()

  def loss_aux(p, b):
    logits = mlp_apply(p, b['x'])
    return jnp.mean((logits - b['y']) ** 2), {'logits': logits, 'err': (logits - b['y']) ** 2}

  (want_loss, want_aux), want = jax.jit(jax.value_and_grad(loss_aux, has_aux=True))(
    mlp_params(), {'x': x, 'y': y}
  )
  tx, params = _placed(mesh, stage)
  xs, ys = shard_batch(mesh, x, y)
  grad_fn = zerojax.value_and_grad(loss_aux, tx, has_aux=True, micro_batches=micro)
  (loss, aux), grads = jax.jit(grad_fn)(params, {'x': xs, 'y': ys})
  assert aux['logits'].shape == (BATCH, 8)
  # Per-row outputs: the same sums per row, blocked differently per device.
  assert_close(aux['logits'], want_aux['logits'], GRAD_TOL)
  assert_close(aux['err'], want_aux['err'], GRAD_TOL)
  assert abs(float(loss) - float(want_loss)) <= GRAD_TOL * abs(float(want_loss))
  assert max_rel_err(grads, want) <= GRAD_TOL


@pytest.mark.parametrize('stage', STAGES)
@pytest.mark.parametrize('micro', [1, 4])
def test_weighted_loss_is_normalised_over_the_global_batch(stage, micro, mesh):
  x, y = batch()
  y = y * jnp.repeat(jnp.array([4.0, 1, 1, 1, 4, 1, 1, 4]), 4)[:, None]  # sparse parts err more
  b = {'x': x, 'y': y, 'mask': _padding_mask()}
  want_loss, want = jax.jit(jax.value_and_grad(lambda p, b: _weighted_loss(p, b).value))(
    mlp_params(), b
  )

  def with_metrics(p, b):
    loss = _weighted_loss(p, b)
    hits = (jnp.argmax(mlp_apply(p, b['x']), -1) == jnp.argmax(b['y'], -1)) * b['mask']
    return loss, {'accuracy': zerojax.WeightedMean(jnp.sum(hits), jnp.sum(b['mask']))}

  tx, params = _placed(mesh, stage)
  xs, ys, ms = shard_batch(mesh, x, y, b['mask'])
  grad_fn = zerojax.value_and_grad(with_metrics, tx, micro_batches=micro, has_aux=True)
  (loss, aux), grads = jax.jit(grad_fn)(params, {'x': xs, 'y': ys, 'mask': ms})
  assert abs(float(loss) - float(want_loss)) <= GRAD_TOL * abs(float(want_loss))
  assert max_rel_err(grads, want) <= GRAD_TOL
  hits = np.argmax(mlp_apply(mlp_params(), x), -1) == np.argmax(y, -1)
  want_accuracy = float(np.sum(hits * b['mask']) / np.sum(b['mask']))
  # Sums of 0/1 hits and mask entries are exact in float32; the division rounds once.
  assert abs(float(aux['accuracy']) - want_accuracy) <= EPS32 * want_accuracy
  # What averaging the devices' own normalised losses gave (the old behaviour): not this.
  parts = [
    _weighted_loss(mlp_params(), jax.tree.map(lambda v, i=i: v[i * 4 : i * 4 + 4], b)).value
    for i in range(8)
  ]
  assert abs(float(np.mean(parts)) - float(want_loss)) > 0.05 * float(want_loss)


LOCAL_NORMALISATION = (
  'zerojax.value_and_grad: the loss divides by a value computed from its batch'
  ' (f32[] / f32[]), such as a count of tokens that are not padding. The loss runs per'
  " device, on part of the batch, so it would be normalised by that part's count, not the"
  " whole batch's. Return zerojax.WeightedMean(total, count) (the sums before dividing) and"
  ' value_and_grad divides the global sums, as jax.value_and_grad on the whole batch would.'
)


@pytest.mark.parametrize(
  'normalise',
  [
    lambda err, mask: jnp.sum(err * mask) / jnp.sum(mask),
    lambda err, mask: jnp.mean(err, where=mask > 0),
  ],
  ids=['sum-over-count', 'mean-where'],
)
def test_a_loss_normalised_by_its_own_batch_is_refused(normalise, auto_mesh):
  tx, params = _placed(auto_mesh, 2)

  def loss(p, b):
    return normalise(jnp.sum((mlp_apply(p, b['x']) - b['y']) ** 2, axis=-1), b['mask'])

  x, y = batch()
  xs, ys, ms = shard_batch(auto_mesh, x, y, _padding_mask())
  with pytest.raises(ValueError, match=re.escape(LOCAL_NORMALISATION)):
    jax.jit(zerojax.value_and_grad(loss, tx))(params, {'x': xs, 'y': ys, 'mask': ms})


def test_normalising_by_constants_and_activations_passes(auto_mesh):
  # jnp.mean divides by a constant, softmax and layer norms by activations: per-row, exact.
  tx, params = _placed(auto_mesh, 3)

  def loss(p, b):
    logits = mlp_apply(p, b['x'])
    logits = logits / jnp.linalg.norm(logits, axis=-1, keepdims=True)
    return jnp.mean(optax.softmax_cross_entropy(logits, jax.nn.softmax(b['y'])))

  x, y = batch()
  want_loss, want = jax.jit(jax.value_and_grad(loss))(mlp_params(), {'x': x, 'y': y})
  xs, ys = shard_batch(auto_mesh, x, y)
  got_loss, grads = jax.jit(zerojax.value_and_grad(loss, tx))(params, {'x': xs, 'y': ys})
  assert abs(float(got_loss) - float(want_loss)) <= GRAD_TOL * abs(float(want_loss))
  assert max_rel_err(grads, want) <= GRAD_TOL


def test_a_weight_that_depends_on_the_parameters_is_refused(auto_mesh):
  tx, params = _placed(auto_mesh, 1)

  def loss(p, b):
    out = mlp_apply(p, b['x'])
    return zerojax.WeightedMean(jnp.sum(out**2), jnp.sum(jnp.abs(out)))

  xs, ys = shard_batch(auto_mesh, *batch())
  with pytest.raises(ValueError, match='whose weight depends on the parameters'):
    jax.jit(zerojax.value_and_grad(loss, tx))(params, {'x': xs, 'y': ys})


def test_aux_that_is_neither_per_row_nor_scalar_is_refused(auto_mesh):
  tx, params = _placed(auto_mesh, 2)

  def loss(p, b):
    err = jnp.mean((mlp_apply(p, b['x']) - b['y']) ** 2)
    return err, {'mse': err, 'head': b['x'][:3]}

  xs, ys = shard_batch(auto_mesh, *batch())
  msg = (
    'zerojax.value_and_grad(has_aux=True): the loss runs per device on 4 rows at a time, and'
    ' these aux values are neither per-row nor scalars, so they cannot be combined into the'
    " global batch's: aux['head'] (shape (3, 16)). Return per-row values (leading dimension 4;"
    ' they come back with every row of the batch), a scalar mean over the rows, a'
    ' zerojax.Sum(total) of a sum over the rows, or a zerojax.WeightedMean(total, weight) of'
    ' sums over the rows.'
  )
  with pytest.raises(ValueError, match=re.escape(msg)):
    jax.jit(zerojax.value_and_grad(loss, tx, has_aux=True))(params, {'x': xs, 'y': ys})


@pytest.mark.parametrize('micro', [1, 2])
def test_scalar_and_sum_aux_mean_what_they_mean_on_the_global_batch(micro, mesh):
  # Flax's examples return accuracy as jnp.mean(pred == label): a mean over the rows, as a
  # scalar loss is; a token count is a sum over the rows.
  tx, params = _placed(mesh, 2)
  x, y = batch()
  mask = _padding_mask()

  def loss(p, b):
    out = mlp_apply(p, b['x'])
    hits = jnp.argmax(out, -1) == jnp.argmax(b['y'], -1)
    metrics = {'accuracy': jnp.mean(hits), 'tokens': zerojax.Sum(jnp.sum(b['mask']))}
    return jnp.mean((out - b['y']) ** 2), metrics

  (_, want), _ = jax.jit(jax.value_and_grad(loss, has_aux=True))(
    mlp_params(), {'x': x, 'y': y, 'mask': mask}
  )
  xs, ys, ms = shard_batch(mesh, x, y, mask)
  grad_fn = zerojax.value_and_grad(loss, tx, has_aux=True, micro_batches=micro)
  (_, aux), _ = jax.jit(grad_fn)(params, {'x': xs, 'y': ys, 'mask': ms})
  # Sums of 0/1 values are exact in float32; the mean divides once.
  assert float(aux['tokens']) == float(want['tokens'].total) == float(np.sum(mask))
  assert abs(float(aux['accuracy']) - float(want['accuracy'])) <= EPS32

  # A scalar aux is a mean over the rows, under the rule a scalar loss follows: one divided
  # by a count computed from the batch is refused, as the loss would be, and named. Here the
  # loss is a WeightedMean (it does not divide) and the aux holds sum / count, as nanodo's
  # log_perplexity does.
  def per_device_rate(p, b):
    err = jnp.sum((mlp_apply(p, b['x']) - b['y']) ** 2, axis=-1)
    total, count = jnp.sum(err * b['mask']), jnp.sum(b['mask'])
    aux = {'log_perplexity': total / count, 'tokens': zerojax.Sum(count)}
    return zerojax.WeightedMean(total, count), aux

  with pytest.raises(ValueError) as e:
    jax.jit(zerojax.value_and_grad(per_device_rate, tx, has_aux=True))(
      params, {'x': xs, 'y': ys, 'mask': ms}
    )
  assert str(e.value) == (
    "zerojax.value_and_grad: aux['log_perplexity'], a scalar aux output, divides by a value"
    ' computed from its batch (f32[] / f32[]), such as a count of tokens that are not padding.'
    ' A scalar aux value is averaged over the parts of the batch as the loss is, so it would be'
    " normalised by each part's count, not the whole batch's. Return aux['log_perplexity'] as"
    ' zerojax.WeightedMean(total, count) (the sums before dividing) and value_and_grad divides'
    ' the global sums.'
  )


def _dropout_loss(p, b, key):
  h = jnp.tanh(b['x'] @ p['dense1']['kernel'] + p['dense1']['bias'])
  keep = jax.random.bernoulli(key, 0.5, h.shape)
  h = jnp.where(keep, h / 0.5, 0.0)
  out = h @ p['dense2']['kernel'] + p['dense2']['bias']
  return jnp.mean((out - b['y']) ** 2), keep


@pytest.mark.parametrize('stage', [0, 3])
def test_keys_draw_independently_per_device_and_micro_batch(stage, mesh):
  tx, params = _placed(mesh, stage)
  x, y = batch()
  xs, ys = shard_batch(mesh, x, y)
  grad_fn = jax.jit(zerojax.value_and_grad(_dropout_loss, tx, has_aux=True, micro_batches=2))
  key = jax.random.key(0)
  (loss, keep), grads = grad_fn(params, {'x': xs, 'y': ys}, key)
  parts = np.asarray(keep).reshape(16, 2, 64)  # 8 devices x 2 micro-batches, 2 rows each
  distinct = {parts[i].tobytes() for i in range(16)}
  assert len(distinct) == 16, 'two parts drew the same dropout mask'
  # Equal in distribution to one key over the whole batch: Bernoulli(0.5) per unit.
  (_, want_keep), _ = jax.jit(jax.value_and_grad(_dropout_loss, has_aux=True))(
    mlp_params(), {'x': x, 'y': y}, key
  )
  n = keep.size
  for mask in (keep, want_keep):
    assert abs(float(np.mean(mask)) - 0.5) < 4 * np.sqrt(0.25 / n)
  # The same key gives the same step (the folding is deterministic) and the loss is the
  # loss of the masks drawn.
  (loss2, keep2), _ = grad_fn(params, {'x': xs, 'y': ys}, key)
  assert float(loss2) == float(loss) and np.array_equal(keep, keep2)


def test_a_legacy_key_is_refused_with_the_fix(auto_mesh):
  # Flax's examples pass jax.random.PRNGKey; unchanged, every device would draw one mask.
  tx, params = _placed(auto_mesh, 2)
  xs, ys = shard_batch(auto_mesh, *batch())

  def loss(p, b, key):
    return _dropout_loss(p, b, jax.random.wrap_key_data(key))[0]

  grad_fn = jax.jit(zerojax.value_and_grad(loss, tx))
  with pytest.raises(TypeError) as e:
    grad_fn(params, {'x': xs, 'y': ys}, jax.random.PRNGKey(0))
  assert str(e.value) == (
    'zerojax.value_and_grad: args[0] is a uint32[2] array, the form of a legacy'
    ' jax.random.PRNGKey. The loss runs once per device and micro-batch, and value_and_grad'
    " folds each part's index into typed keys only: a legacy key cannot be told from data,"
    ' and passed unchanged it would give every part the same numbers (the same dropout'
    ' mask). Pass jax.random.key(seed), or jax.random.wrap_key_data(key) for a key you'
    ' already have. If it is data, not a key, give it another dtype or shape.'
  )
  # The fix it names: the same key, wrapped, draws a mask per part.
  key = jax.random.wrap_key_data(jax.random.PRNGKey(0))
  grad_fn = jax.jit(zerojax.value_and_grad(_dropout_loss, tx, has_aux=True))
  (_, keep), _ = grad_fn(params, {'x': xs, 'y': ys}, key)
  parts = np.asarray(keep).reshape(8, -1)
  assert len({part.tobytes() for part in parts}) == 8


def test_a_captured_batch_array_names_the_fix(auto_mesh):
  tx, params = _placed(auto_mesh, 2)
  x, y = batch()
  weights = jnp.linspace(0.0, 1.0, BATCH)

  def loss(p, b):  # `weights` has the global batch's rows, captured from outside
    return jnp.mean(jnp.sum((mlp_apply(p, b['x']) - b['y']) ** 2, -1) * weights)

  xs, ys = shard_batch(auto_mesh, x, y)
  # JAX's own error keeps its type; zerojax adds a note on what it changed.
  with pytest.raises(TypeError, match=re.escape('(4,), (32,)')) as e:
    jax.jit(zerojax.value_and_grad(loss, tx))(params, {'x': xs, 'y': ys})
  assert zerojax_note(e.value) == (
    "zerojax.value_and_grad ran the loss on one part of the batch (4 rows: one device's"
    " micro-batch). An array the loss closes over keeps the whole batch's rows: pass"
    ' batch-shaped arrays (weights, masks, targets) inside `batch`.'
  )
  # The fix, as the message says: in `batch`, it is exact.
  want = jax.grad(loss)(mlp_params(), {'x': x, 'y': y})
  ws = shard_batch(auto_mesh, weights)[0]

  def fixed(p, b):
    return jnp.mean(jnp.sum((mlp_apply(p, b['x']) - b['y']) ** 2, -1) * b['w'])

  _, grads = jax.jit(zerojax.value_and_grad(fixed, tx))(params, {'x': xs, 'y': ys, 'w': ws})
  assert max_rel_err(grads, want) <= GRAD_TOL


def test_a_scalar_batch_leaf_is_refused(auto_mesh):
  tx, params = _placed(auto_mesh, 1)
  xs, ys = shard_batch(auto_mesh, *batch())
  with pytest.raises(ValueError, match=re.escape("batch['t'] is a scalar")):
    jax.jit(zerojax.value_and_grad(lambda p, b: jnp.mean(b['x']), tx))(
      params, {'x': xs, 'y': ys, 't': jnp.ones(())}
    )


def test_a_loss_that_closes_over_its_batch_names_the_fix(auto_mesh):
  # The swap a user makes first: jax.value_and_grad(loss) -> zerojax.value_and_grad(loss, tx).
  tx, params = _placed(auto_mesh, 2)
  x, y = batch()
  xs, ys = shard_batch(auto_mesh, x, y)
  with pytest.raises(TypeError) as e:
    jax.jit(zerojax.value_and_grad(lambda p: jnp.mean((mlp_apply(p, xs) - ys) ** 2), tx))(params)
  assert str(e.value) == (
    'zerojax.value_and_grad(loss_fn, tx) returns fn(params, batch, *args): it splits'
    ' `batch` over the devices and runs loss_fn(params, batch, *args) on each part, so the'
    ' batch is an argument, not something the loss closes over. Write the loss as'
    ' loss_fn(params, batch) and call fn(params, batch).'
  )

  # A loss that takes `batch` but reads the global one from its closure would run the whole
  # batch on every device: refused.
  def closes_over(p, b):
    return jnp.mean((mlp_apply(p, xs) - ys) ** 2)

  with pytest.raises(ValueError) as e:
    jax.jit(zerojax.value_and_grad(closes_over, tx))(params, {'x': xs, 'y': ys})
  assert str(e.value) == (
    'zerojax.value_and_grad: the loss does not read the `batch` it is given. It runs on each'
    " device's part of the batch, so a loss that closes over a batch instead would run the"
    ' whole of it on every device. Compute the loss from its `batch` argument:'
    ' loss_fn(params, batch), called as fn(params, batch).'
  )


def test_stage0_all_reduces_a_small_3d_kernel_at_once(mesh):
  # An attention kernel (d_model, heads, head_dim) is not a stack of layers: it is all-reduced
  # at once, as jax.jit's data parallelism does, not as a loop of one tiny all-reduce per row.
  # A leaf over zerojax's slice size (8 MiB, stacked) is reduced in two 4 MiB slices in place.
  params = {
    'attn': 0.1 * jnp.ones((64, 4, 16)),
    'stack': 0.01 * jnp.ones((8, 512, 512)),
  }

  def loss(p, b):
    h = jnp.einsum('bd,dhk->bhk', b['x'], p['attn']).reshape(b['x'].shape[0], 64)
    h = h @ p['stack'].mean(0)[:64, :64]
    return jnp.mean((h - b['y']) ** 2)

  rows = NamedSharding(mesh, PartitionSpec('data'))
  b = jax.device_put({'x': jnp.ones((BATCH, 64)), 'y': jnp.zeros((BATCH, 64))}, rows)
  tx = zerojax.zero_stage(optax.sgd(0.1), 0, mesh=mesh)
  placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  ours = jax.jit(zerojax.value_and_grad(loss, tx)).lower(placed, b).compile()
  got = zerojax.inspect.count_collectives(ours)
  assert got.exact
  # The loss and the small kernel at most one each (XLA may combine them), the stacked leaf
  # two slices: 73 all-reduces before (one per row of the kernel, one per layer).
  assert got['all-reduce'] <= 4, got
  # Every gradient byte reduced once, and the float32 loss.
  assert got.result_bytes['all-reduce'] == 4 * (64 * 4 * 16 + 8 * 512 * 512) + 4
  # The same gradients.
  _, grads = jax.jit(zerojax.value_and_grad(loss, tx))(placed, b)
  _, want_grads = jax.jit(jax.value_and_grad(loss))(params, jax.device_get(b))
  assert max_rel_err(grads, want_grads) <= reordered(BATCH + 64 + 512)
