"""Flax's own MNIST examples, trimmed (smaller layers, synthetic data), under zerojax.

Two of Flax's examples, as a new user would bring them: the linen MNIST CNN with its
`TrainState`, `jax.value_and_grad(..., has_aux=True)` returning the logits and an accuracy
computed from them; and the NNX MNIST CNN with BatchNorm and Dropout, trained with
`nnx.Optimizer`. Each runs unwrapped on the global batch, then through the one-line
`zero_stage` wrap (keeping the example's own step) and through `zerojax.value_and_grad` /
`zerojax.nnx.value_and_grad`, at stages 0-3: losses, metrics and parameters must agree.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import max_rel_err
from _tolerance import reordered
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

STAGES = [0, 1, 2, 3]
STEPS = 3
ROWS = 32
# A kernel gradient of the first convolution sums 32 rows x 8 x 8 positions,
# behind it 3 x 3 x 8 and 256-wide contractions and the 32- and 10-wide dense
# layers; metrics (loss, accuracy) are of the same order, and relative to 1.
CNN_TOL = reordered(ROWS * 8 * 8 + 9 + 72 + 256 + 32 + 10, steps=STEPS)


def _data(seed=0):
  rng = np.random.default_rng(seed)
  images = rng.normal(size=(STEPS, ROWS, 8, 8, 1)).astype(np.float32)
  labels = rng.integers(0, 10, size=(STEPS, ROWS)).astype(np.int32)
  return images, labels


def _sharded(mesh, *arrays):
  return [jax.device_put(a, NamedSharding(mesh, P('data'))) for a in arrays]


# -- linen: the MNIST example's CNN and step ------------------------------------------


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), strides=(2, 2))
    x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), strides=(2, 2))
    x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
    return nn.Dense(10)(x)


def _linen_loss(apply_fn, params, images, labels):
  logits = apply_fn({'params': params}, images)
  loss = jnp.mean(optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)))
  return loss, logits


def _linen_state(tx):
  cnn = LinenCNN()
  params = cnn.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)))['params']
  return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


def _linen_train(state, step, mesh=None):
  images, labels = _data()
  history = []
  for i in range(STEPS):
    x, y = (images[i], labels[i]) if mesh is None else _sharded(mesh, images[i], labels[i])
    state, loss, accuracy = step(state, x, y)
    history.append((float(loss), float(accuracy)))
  return state, history


@jax.jit
def _linen_example_step(state, images, labels):
  # The example's own step: value_and_grad with the logits as aux, accuracy from them.
  grad_fn = jax.value_and_grad(
    lambda p: _linen_loss(state.apply_fn, p, images, labels), has_aux=True
  )
  (loss, logits), grads = grad_fn(state.params)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  return state.apply_gradients(grads=grads), loss, accuracy


@pytest.fixture(scope='module')
def linen_reference():
  return _linen_train(_linen_state(optax.sgd(0.1, momentum=0.9)), _linen_example_step)


def _check_linen(got, reference):
  (state, history), (ref_state, ref_history) = got, reference
  np.testing.assert_allclose(history, ref_history, rtol=CNN_TOL, atol=CNN_TOL)
  assert max_rel_err(state.params, ref_state.params) <= CNN_TOL


@pytest.mark.parametrize('stage', STAGES)
def test_linen_mnist_one_line_wrap(stage, auto_mesh, linen_reference):
  state = zerojax.zero_stage(_linen_state(optax.sgd(0.1, momentum=0.9)), stage, mesh=auto_mesh)
  _check_linen(_linen_train(state, _linen_example_step, auto_mesh), linen_reference)


@pytest.mark.parametrize('stage', STAGES)
def test_linen_mnist_through_value_and_grad(stage, mesh, linen_reference):
  state = zerojax.zero_stage(_linen_state(optax.sgd(0.1, momentum=0.9)), stage, mesh=mesh)
  apply_fn = LinenCNN().apply  # the loss runs per device, on whole (gathered) parameters
  grad_fn = zerojax.value_and_grad(
    lambda p, b: _linen_loss(apply_fn, p, b['images'], b['labels']), state.tx, has_aux=True
  )

  @jax.jit
  def step(state, images, labels):
    (loss, logits), grads = grad_fn(state.params, {'images': images, 'labels': labels})
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)  # logits of every row
    return state.apply_gradients(grads=grads), loss, accuracy

  _check_linen(_linen_train(state, step, mesh), linen_reference)


# -- NNX: the MNIST tutorial's CNN with BatchNorm and Dropout ----------------------------


class NNXCNN(nnx.Module):
  def __init__(self, *, rngs, axis_name=None, dropout=0.0):
    # No bias before BatchNorm: its gradient is zero but for rounding, which Adam would
    # scale up to full steps of noise, different in every run.
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.linear1 = nnx.Linear(16 * 2 * 2, 32, rngs=rngs)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    pool = lambda h: nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))
    x = pool(nnx.relu(self.bn1(self.conv1(x))))
    x = pool(nnx.relu(self.bn2(self.conv2(x))))
    x = self.dropout(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
    return self.linear2(x)


def _nnx_loss(model, batch):
  logits = model(batch['images'])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['labels']).mean()
  return loss, logits


def _nnx_train(model, tx, grad_fn=None, mesh=None):
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average('loss'))

  @nnx.jit
  def step(model, optimizer, metrics, batch):
    if grad_fn is None:  # the tutorial's own step
      (loss, logits), grads = nnx.value_and_grad(_nnx_loss, has_aux=True)(model, batch)
    else:
      (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch['labels'])
    optimizer.update(model, grads)

  images, labels = _data(1)
  history = []
  # Eager metric arithmetic on arrays typed over an Explicit mesh needs the mesh set.
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    for i in range(STEPS):
      x, y = (images[i], labels[i]) if mesh is None else _sharded(mesh, images[i], labels[i])
      step(model, optimizer, metrics, {'images': x, 'labels': y})
      history.append({k: float(v) for k, v in metrics.compute().items()})
      metrics.reset()
  return model, history


@pytest.fixture(scope='module')
def nnx_reference():
  model, history = _nnx_train(NNXCNN(rngs=nnx.Rngs(0)), optax.adamw(1e-3))
  return _trained(model), history


def _trained(model):
  return nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)


def _check_nnx(model, history, reference):
  ref_state, ref_history = reference
  for got, want in zip(history, ref_history):
    assert got.keys() == want.keys()
    for k in got:
      assert abs(got[k] - want[k]) <= CNN_TOL * max(1.0, abs(want[k])), (k, got, want)
  # Parameters and BatchNorm's running statistics alike.
  assert max_rel_err(_trained(model), ref_state) <= CNN_TOL


@pytest.mark.parametrize('stage', STAGES)
def test_nnx_mnist_one_line_wrap(stage, auto_mesh, nnx_reference):
  model = NNXCNN(rngs=nnx.Rngs(0))
  tx = zerojax.zero_stage(optax.adamw(1e-3), stage, mesh=auto_mesh)
  if stage == 3:
    zerojax.nnx.shard(model, tx)
  _check_nnx(*_nnx_train(model, tx, mesh=auto_mesh), nnx_reference)


@pytest.mark.parametrize('stage', STAGES)
def test_nnx_mnist_through_nnx_value_and_grad(stage, mesh, nnx_reference):
  # BatchNorm names the ZeRO axis: its statistics are then the global batch's per device.
  model = NNXCNN(rngs=nnx.Rngs(0), axis_name='data')
  tx = zerojax.zero_stage(optax.adamw(1e-3), stage, mesh=mesh)
  if stage == 3:
    zerojax.nnx.shard(model, tx)
  grad_fn = zerojax.nnx.value_and_grad(_nnx_loss, tx, has_aux=True)
  model, history = _nnx_train(model, tx, grad_fn, mesh)
  _check_nnx(model, history, nnx_reference)
  params = nnx.state(model, nnx.Param)
  plan = zerojax.plan_for(tx, params)
  assert params['linear1']['kernel'][...].sharding.spec == plan.params['linear1']['kernel'].spec


def test_nnx_dropout_draws_per_device(auto_mesh):
  # With dropout on, every device and micro-batch draws its own mask from the model's
  # RNG stream; the unwrapped run draws one mask for the whole batch: equal in
  # distribution, so the logits differ but the fraction of dropped units agrees.
  model = NNXCNN(rngs=nnx.Rngs(0), axis_name='data', dropout=0.5)
  tx = zerojax.zero_stage(optax.adamw(1e-3), 2, mesh=auto_mesh)

  def loss(model, batch):
    h = model.linear1(batch['images'].reshape(batch['images'].shape[0], -1)[:, :64])
    dropped = model.dropout(jnp.ones_like(h)) == 0
    return jnp.mean(h**2), dropped

  grad_fn = zerojax.nnx.value_and_grad(loss, tx, has_aux=True, micro_batches=2)
  x, y = _sharded(auto_mesh, *(a[0] for a in _data()))
  (_, dropped), _ = nnx.jit(lambda m, b: grad_fn(m, b))(model, {'images': x, 'labels': y})
  parts = np.asarray(dropped).reshape(16, -1)
  assert len({p.tobytes() for p in parts}) == 16
  assert abs(float(np.mean(dropped)) - 0.5) < 0.05
