"""Per-layer ZeRO-3 (linen, NNX, hand-written), the GPT example, and NNX optimizers."""

import os
import sys
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import SCANNED_TERMS, ScannedNNX, max_rel_err, nnx_train
from _tolerance import reordered
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples'))
import gpt  # noqa: E402


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))


def compile_gpt_step(mesh, n_layers, per_layer):
  cfg = gpt.Config(d_model=1024, n_layers=n_layers, n_heads=8, seq_len=32, batch=8)
  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)
  model = gpt.GPT(cfg, tx, per_layer=per_layer)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  state = zerojax.inspect.abstract_train_state(
    lambda k: model.init(k, jnp.zeros((1, cfg.seq_len), jnp.int32))['params'],
    key,
    tx=tx,
    apply_fn=model.apply,
  )
  plan = zerojax.plan_for(state.tx, state.params)
  tokens = jax.ShapeDtypeStruct(
    (cfg.batch, cfg.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P('data'))
  )

  def step(state, tokens):
    def loss(p):
      if not per_layer:
        p = zerojax.gather(p, plan)
      return gpt.loss_fn(state.apply_fn, p, {'tokens': tokens})

    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  compiled = jax.jit(step).lower(state, tokens).compile()
  psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  return zerojax.inspect.memory_stats(compiled), psi


@pytest.mark.slow
def test_per_layer_gathering_keeps_temp_flat(mesh):
  d = 1024
  layer_bytes = 4 * (12 * d * d + 13 * d)  # qkv, out, mlp in/out kernels and biases, 2 norms
  grow = {}
  for per_layer in (True, False):
    (m2, psi2), (m6, psi6) = (
      compile_gpt_step(mesh, 2, per_layer),
      compile_gpt_step(mesh, 6, per_layer),
    )
    grow[per_layer] = (m6.temp - m2.temp) / 4
    # Arguments follow the stage-3 formula: 12Ψ/N + the batch + two counters.
    for m, psi in ((m2, psi2), (m6, psi6)):
      assert m.argument == 12 * psi // 8 + 8 * 33 * 4 // 8 + 8
  # Gathering each layer inside the loop: temp grows by less than a quarter of a
  # layer per added layer. Gathering everything up front: at least a layer.
  assert grow[True] < layer_bytes / 4, grow
  assert grow[False] >= layer_bytes, grow


def test_gpt_stage3_per_layer_equals_stage0():
  # SGD with momentum, so that a gradient's rounding reaches the parameters scaled by the
  # learning rate. AdamW divides each step by the root of the gradient's second moment: an entry
  # whose gradient is rounding noise takes steps of up to the learning rate either way in either
  # run (the key projection's bias is one: a constant added to every key leaves each softmax as
  # it is, so its gradient is zero in exact arithmetic). test_zero_stage checks AdamW itself
  # against plain optax.
  tx = optax.sgd(0.03, momentum=0.9)
  runs = {s: gpt.run(stage=s, steps=20, log_every=1, quiet=True, tx=tx) for s in (0, 3)}
  # The example GPT (examples/gpt.py): a gradient entry sums 16 x 64 token rows
  # through 4 blocks of 128-wide attention and 512-wide MLP contractions and the
  # 256-way vocabulary; 20 steps.
  tol = reordered(16 * 64 + 4 * (128 + 64 + 512) + 256, steps=20)
  got, want = runs[3]['state'].params, runs[0]['state'].params
  assert max_rel_err(got, want) <= tol
  # Not vacuous: every leaf that starts away from zero moved by over 10 x the tolerance (the
  # least, a LayerNorm scale, by about 20 x).
  init = gpt.run(stage=0, steps=0, quiet=True)['state'].params
  moved = jax.tree.leaves(
    jax.tree.map(
      lambda u, v: float(np.linalg.norm(u - v) / np.linalg.norm(v)) if np.any(v) else np.inf,
      *(jax.tree.map(np.asarray, t) for t in (want, init)),
    )
  )
  assert min(moved) > 10 * tol, moved
  final = runs[0]['losses'][-1][1]
  assert abs(runs[3]['losses'][-1][1] - final) <= tol * abs(final)
  plan = runs[3]['plan']
  assert jax.tree.map(lambda a: a.sharding, runs[3]['state'].params) == plan.params


def test_gpt_loss_decreases():
  out = gpt.run(stage=2, steps=30, log_every=1, quiet=True)
  first, last = out['losses'][0][1], np.mean([loss for _, loss in out['losses'][-5:]])
  assert last < first - 1.0  # from ~5.5 (uniform over bytes) down to ~3


def test_gpt_mixed_precision_with_host_offload_trains():
  cfg = gpt.Config(d_model=64, n_layers=2)
  out = gpt.run(
    stage=3,
    steps=30,
    cfg=cfg,
    log_every=1,
    quiet=True,
    mixed_precision=True,
    offload='opt_state+master',
    update_on='host',
  )
  losses = [loss for _, loss in out['losses']]
  assert np.mean(losses[-5:]) < losses[0] - 1.0
  state = out['state']
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim}
  assert kinds == {'pinned_host'}
  assert out['plan'].bytes_per_device()['host'] == 12 * out['num_params'] // 8


def test_gpt_text_file_and_loader(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_bytes(b'hello zerojax ' * 200)
  data = gpt.load_text(str(path))
  assert data.dtype == np.uint8 and len(data) == 14 * 200
  batch = gpt.batch_at(data, 3, gpt.Config())
  assert batch.shape == (16, 65) and batch.dtype == np.int32
  assert np.array_equal(batch, gpt.batch_at(data, 3, gpt.Config()))  # deterministic per step
  with pytest.raises(ValueError, match='need at least 1024 bytes of text, got 5'):
    (tmp_path / 'tiny.txt').write_bytes(b'short')
    gpt.load_text(str(tmp_path / 'tiny.txt'))


def test_stdlib_corpus_is_text():
  data = gpt.load_text(None)
  assert len(data) > 100_000
  assert b'Return' in data.tobytes()[:200_000]


def test_stdlib_corpus_is_built_once_and_kept(tmp_path, monkeypatch, capsys):
  """The corpus is parsed on the first call, kept under $ZEROJAX_CACHE_DIR/text, and read
  back after (the same bytes, no parsing); a folder that cannot be written still trains."""
  monkeypatch.setenv('ZEROJAX_CACHE_DIR', str(tmp_path / 'cache'))
  parsed = []
  extract = gpt.extract_stdlib_docstrings
  monkeypatch.setattr(gpt, 'extract_stdlib_docstrings', lambda n: parsed.append(n) or extract(n))
  gpt.stdlib_docstrings.cache_clear()
  try:
    first = gpt.stdlib_docstrings(50_000)
    path = gpt.corpus_path(50_000)
    assert path.startswith(str(tmp_path / 'cache' / 'text')) and parsed == [50_000]
    assert 'building the training text' in capsys.readouterr().out
    gpt.stdlib_docstrings.cache_clear()
    assert gpt.stdlib_docstrings(50_000) == first == open(path, 'rb').read()
    assert parsed == [50_000] and os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert len(first) >= 50_000 and b'Return' in first
    blocked = tmp_path / 'file'
    blocked.write_text('not a folder')
    monkeypatch.setenv('ZEROJAX_CACHE_DIR', str(blocked))
    gpt.stdlib_docstrings.cache_clear()
    assert gpt.stdlib_docstrings(50_000) == first and parsed == [50_000, 50_000]
    assert '(not kept: ' in capsys.readouterr().out
  finally:
    gpt.stdlib_docstrings.cache_clear()


# --- NNX


def test_linen_and_nnx_versions_agree(mesh):
  # The same scanned two-block model in linen and NNX, same weights, stage 3
  # with per-layer gathering: the parameters after 5 steps agree.
  from flax import linen as nn

  class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.Dense(32, name='fc2')(jnp.tanh(nn.Dense(128, name='fc1')(x))), None

  class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = nn.remat(zerojax.linen.gathered(LinenBlock, ztx), prevent_cse=False)
      return nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True}, length=2)(
        name='blocks'
      )(x, None)[0]

  ztx = zerojax.zero_stage(optax.adam(1e-2), 3, mesh=mesh)
  nnx_model = ScannedNNX(32, 2, nnx.Rngs(0), zero=ztx)
  weights = nnx.state(nnx_model, nnx.Param)
  linen_params = {
    'blocks': {
      name: {k: weights['blocks'][name][k][...] for k in ('kernel', 'bias')}
      for name in ('fc1', 'fc2')
    }
  }
  x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), NamedSharding(mesh, P('data')))

  state = zerojax.zero_stage(
    train_state.TrainState.create(
      apply_fn=LinenModel().apply, params=linen_params, tx=optax.adam(1e-2)
    ),
    3,
    mesh=mesh,
  )

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({'params': p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(5):
    state = step(state)
  zerojax.nnx.shard(nnx_model, ztx)
  nnx_model, _ = nnx_train(nnx_model, ztx, x)
  after = nnx.state(nnx_model, nnx.Param)
  for name in ('fc1', 'fc2'):
    for k in ('kernel', 'bias'):
      a, b = np.asarray(state.params['blocks'][name][k]), np.asarray(after['blocks'][name][k][...])
      assert np.linalg.norm(a - b) / np.linalg.norm(b) <= reordered(SCANNED_TERMS, steps=5)


def test_gpt_resume_from_checkpoint_is_bitwise_exact(tmp_path):
  whole = gpt.run(stage=3, steps=8, log_every=1, quiet=True)
  gpt.run(stage=3, steps=5, log_every=1, quiet=True, checkpoint_dir=str(tmp_path), save_every=3)
  resumed = gpt.run(
    stage=3, steps=8, log_every=1, quiet=True, checkpoint_dir=str(tmp_path), save_every=3
  )
  assert resumed['losses'][0][0] == 5  # continued at the saved data position
  for a, b in zip(jax.tree.leaves(resumed['state'].params), jax.tree.leaves(whole['state'].params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert resumed['losses'][-1] == whole['losses'][-1]


def test_gather_inside_jit_and_its_gradient_back_into_shards():
  mesh = jax.make_mesh((8,), ('data',))
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh)
  w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P('data')))
  whole = jax.jit(lambda w: zerojax.gather(w, tx))(w)
  grad = jax.jit(jax.grad(lambda w: jnp.sum(zerojax.gather(w, tx) ** 2)))(w)
  assert whole.sharding.spec == P(None, None)
  np.testing.assert_array_equal(np.asarray(whole), np.arange(32.0).reshape(8, 4))
  assert grad.sharding.spec == P('data', None)
  np.testing.assert_array_equal(np.asarray(grad), 2 * np.arange(32.0).reshape(8, 4))


# -- NNX recipes and per-layer helpers on real model code --------------------------------


def test_linen_parameter_used_without_a_gather_is_named(mesh):
  from flax import linen as nn

  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = zerojax.linen.gathered(nn.Dense, tx)(64)(x)
      return nn.Dense(8, name='head')(jnp.tanh(h))  # not gathered

  model = Model()
  params = model.init(jax.random.key(0), jnp.ones((1, 16)))['params']
  params = jax.device_put(params, zerojax.plan_for(tx, params).params)
  grad_fn = zerojax.value_and_grad(
    lambda p, b: jnp.mean(model.apply({'params': p}, b['x']) ** 2), tx, per_layer=True
  )
  x = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P('data')))
  # linen checks the parameter's shape first: its own error, with zerojax's note on the fix.
  with pytest.raises(flax.errors.ScopeParamShapeError) as err:
    jax.jit(grad_fn)(params, {'x': x})
  note = err.value.__notes__[0]
  assert note.startswith('zerojax.value_and_grad(per_layer=True) handed the loss 4 split')
  assert 'wrap linen blocks in zerojax.linen.gathered' in note


def test_gathered_linen_gathers_for_every_method(mesh):
  # A tied embedding: `attend` reuses the table that `__call__` looks up.
  from flax import linen as nn

  tx = zerojax.zero_stage(optax.adam(1e-3), 3, mesh=mesh)

  class TiedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = zerojax.linen.gathered(nn.Embed, tx)(64, 16)
      return embed.attend(jnp.tanh(embed(tokens)))

  model, tokens = TiedLM(), jnp.arange(64).reshape(16, 4) % 64
  params = model.init(jax.random.key(0), tokens)['params']
  loss = lambda p, b: jnp.mean(model.apply({'params': p}, b['t']) ** 2)
  want_loss, want = jax.value_and_grad(loss)(params, {'t': tokens})
  sharded = jax.device_put(params, zerojax.plan_for(tx, params).params)
  t = jax.device_put(tokens, NamedSharding(mesh, P('data')))
  got_loss, grads = jax.jit(zerojax.value_and_grad(loss, tx, per_layer=True))(sharded, {'t': t})
  tol = reordered(64 + 16 + 64)  # rows, the 16-wide embedding, the 64-token vocabulary
  assert abs(float(got_loss) - float(want_loss)) <= tol * abs(float(want_loss))
  assert max_rel_err(grads, want) <= tol


def test_unrolled_per_layer_gathers_warn(mesh):
  layers = {f'l{i}': 0.1 * jnp.ones((32, 32)) for i in range(4)}
  stacked = {'w': 0.1 * jnp.ones((4, 32, 32))}
  tx = zerojax.zero_stage(optax.sgd(1e-3), 3, mesh=mesh)
  layers = jax.device_put(layers, zerojax.plan_for(tx, layers).params)
  stacked = jax.device_put(stacked, zerojax.plan_for(tx, stacked).params)
  x = {'x': jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P('data')))}

  def unrolled(p, b):
    h = b['x']
    for i in range(4):  # a Python loop: four separate gathers
      h = jnp.tanh(h @ zerojax.gather(p[f'l{i}'], tx))
    return jnp.mean(h**2)

  def scanned(p, b):
    h = zerojax.scan_layers(lambda h, layer: jnp.tanh(h @ layer['w']), b['x'], p, tx)
    return jnp.mean(h**2)

  with pytest.warns(UserWarning, match='the loss gathers 4 split parameters, none of them inside'):
    jax.jit(zerojax.value_and_grad(unrolled, tx, per_layer=True))(layers, x)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    jax.jit(zerojax.value_and_grad(scanned, tx, per_layer=True))(stacked, x)
