"""The preset decoders' memory-efficient attention: the same numbers, one chunk at a time."""

import functools

import jax
import jax.numpy as jnp
import pytest
from _models import run_cli
from _tolerance import assert_close, reordered

from zerojax._src import attention, decoder
from zerojax._src.planner import presets


def _qkv(t=64, heads=4, kv_heads=2, d=8):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k1, (2, t, heads, d))
  k = jax.random.normal(k2, (2, t, kv_heads, d))
  v = jax.random.normal(k3, (2, t, kv_heads, d))
  return q, k, v


@pytest.mark.parametrize('chunk', [8, 16, 32])
def test_chunked_attention_equals_causal_attention_and_its_gradient(chunk):
  q, k, v = _qkv()
  whole = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  chunked = lambda q, k, v: presets.chunked_attention(q, k, v, chunk)
  # Softmax over 64 keys of 8-wide heads, accumulated chunk by chunk: each chunk
  # rescales the running sums once more (an exp and a multiply).
  chunks = 64 // chunk
  assert_close(chunked(q, k, v), whole(q, k, v), reordered(64 + 8 + 2 * chunks))
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  got = jax.grad(loss(chunked), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    # Backward: the forward chain, then sums over 64 queries and 64 keys again.
    assert_close(g, w, reordered(3 * 64 + 2 * 8 + 4 * chunks))


def test_chunked_attention_holds_one_chunk_of_scores():
  # Temporaries of the gradient: the whole (batch, heads, t, t) score matrix
  # without chunks; a quarter of it with four chunks, and less than half.
  q, k, v = _qkv(t=512, heads=8, kv_heads=8, d=16)
  temp = lambda f: (
    (
      jax.jit(jax.grad(lambda q: jnp.sum(f(q, k, v)))).lower(q).compile().memory_analysis()
    ).temp_size_in_bytes
  )
  whole = temp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
  chunked = temp(lambda q, k, v: presets.chunked_attention(q, k, v, 128))
  scores = 2 * 8 * 512 * 512 * 4
  assert whole >= scores
  assert chunked < whole / 2, (chunked, whole)


def test_a_chunk_that_does_not_divide_the_sequence_is_refused():
  q, k, v = _qkv(t=64)
  with pytest.raises(ValueError) as info:
    presets.chunked_attention(q, k, v, 24)
  assert str(info.value) == 'attention_chunk=24 does not divide the sequence length 64.'


def test_decoder_loss_with_chunked_attention_equals_the_plain_loss():
  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab)
  plain = presets.decoder_loss(params, tokens, cfg, compute_dtype=jnp.float32)
  chunked = presets.decoder_loss(params, tokens, cfg, compute_dtype=jnp.float32, attention_chunk=16)
  # 2 x 64 token rows through 4 blocks (128-wide attention over 64 keys, a
  # 512-wide MLP) and the 256-way vocabulary.
  terms = 2 * 64 + cfg.n_layers * (cfg.d_model + 64 + cfg.d_ff) + cfg.vocab
  assert abs(float(chunked) - float(plain)) <= reordered(terms) * abs(float(plain))


def test_attention_chunk_is_refused_for_a_users_model():
  proc = run_cli(
    'plan', '--model', '_custom_model:spec', '--topology', 'cpu:8', '--attention-chunk', '16'
  )
  assert proc.returncode != 0
  assert proc.stderr.strip().endswith(
    'error: --attention-chunk is for the presets; --model _custom_model:spec computes its own'
    ' attention and loss (use zerojax.inspect.chunked_attention or'
    ' zerojax.inspect.flash_attention there, or leave it out).'
  )


@pytest.mark.parametrize('chunk', [8, 16, 32])
def test_chunked_cross_entropy_equals_the_loss_and_gradient_over_all_logits(chunk):
  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab)
  loss = lambda p, c: presets.decoder_loss(p, tokens, cfg, compute_dtype=jnp.float32, loss_chunk=c)
  plain, want = jax.value_and_grad(loss)(params, None)
  chunked, got = jax.value_and_grad(loss)(params, chunk)
  # The mean over 2 x 64 tokens of a logsumexp over the 256-way vocabulary, after 4 blocks
  # (128-wide attention over 64 keys, a 512-wide MLP).
  terms = 2 * 64 + cfg.n_layers * (cfg.d_model + 64 + cfg.d_ff) + cfg.vocab
  assert abs(float(chunked) - float(plain)) <= reordered(terms) * abs(float(plain))
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    w = dict(jax.tree_util.tree_leaves_with_path(want))[path]
    # Backward: the forward chain, then the sums over the tokens again.
    assert_close(g, w, reordered(3 * terms), jax.tree_util.keystr(path))


def test_chunked_cross_entropy_holds_one_chunk_of_logits():
  # Temporaries of the gradient: the whole (batch, t, vocab) f32 logits at once; with eight
  # chunks one chunk's, and less than half.
  x = jax.random.normal(jax.random.key(0), (2, 512, 64))
  head = jax.random.normal(jax.random.key(1), (64, 4096))
  targets = jax.random.randint(jax.random.key(2), (2, 512), 0, 4096)

  def whole(x):
    logp = jax.nn.log_softmax(x @ head, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

  def temp(f):
    compiled = jax.jit(jax.grad(f)).lower(x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits = 2 * 512 * 4096 * 4
  assert temp(whole) >= logits
  chunked = temp(lambda x: presets.chunked_cross_entropy(x, head, targets, 64))
  assert chunked < temp(whole) / 2, (chunked, temp(whole))


def test_a_loss_chunk_that_does_not_divide_the_sequence_is_refused():
  x, head = jnp.zeros((2, 64, 8)), jnp.zeros((8, 16))
  with pytest.raises(ValueError) as info:
    presets.chunked_cross_entropy(x, head, jnp.zeros((2, 64), jnp.int32), 24)
  assert str(info.value) == 'loss_chunk=24 does not divide the sequence length 64.'


@pytest.mark.parametrize('remat', presets.REMAT)
def test_every_remat_policy_keeps_the_loss_and_its_gradient(remat):
  """What a block keeps for the backward pass changes what is recomputed, never the numbers
  (on CPU the offloading policies run with their offload names kept in memory)."""
  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab)
  if presets.offloads_activations(remat):
    pytest.skip('host offload of activations compiles for TPU and GPU only')
  loss = lambda p, r: presets.decoder_loss(p, tokens, cfg, compute_dtype=jnp.float32, remat=r)
  want = jax.value_and_grad(loss)(params, 'none')
  got = jax.value_and_grad(loss)(params, remat)
  assert float(got[0]) == float(want[0])
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    # Recomputing runs the same operations again: the same results, bit for bit, except
    # where the compiler fuses a recomputed chain differently.
    assert_close(g, w, reordered(cfg.d_ff))


@pytest.mark.parametrize(
  'remat, kept, offloaded',
  [
    ('full', {}, 0),
    ('save_qkv', {presets.QKV: 3}, 0),
    ('save_attention', {presets.ATTENTION_OUT: 1}, 0),
    ('save_mlp', {presets.MLP_HIDDEN: 1}, 0),
    ('minimal', {presets.QKV: 3, presets.MLP_HIDDEN: 1}, 0),
    ('save_qkv_attention', {presets.QKV: 3, presets.ATTENTION_OUT: 1}, 0),
    ('offload_qkv', {}, 3),
    ('offload_minimal', {}, 4),
    ('save_qkv_offload_mlp', {presets.QKV: 3}, 1),
    ('save_attention_offload_minimal', {presets.ATTENTION_OUT: 1}, 4),
    ('offload_all', {}, 5),
    ('offload_layer_inputs', {}, 1),
    ('offload_minimal_inputs', {}, 5),
    ('save_attention_offload_minimal_inputs', {presets.ATTENTION_OUT: 1}, 5),
    ('minimal_residual', {presets.QKV: 3, presets.MLP_HIDDEN: 1, presets.ATTENTION_RESIDUAL: 1}, 0),
    ('offload_minimal_residual', {}, 5),
    ('offload_all_residual', {}, 6),
  ],
)
def test_each_policy_keeps_what_it_names_and_moves_what_it_offloads(remat, kept, offloaded, capsys):
  """The residuals one block keeps for its backward pass, beside its arguments: exactly the
  activations its policy names (the tiny preset's MLP is not gated: one hidden activation),
  and those it offloads as host arrays."""
  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  layer = jax.tree.map(lambda x: x[0], params['layers'])
  x = jnp.ones((2, cfg.seq_len, cfg.d_model))
  block = lambda x, layer: jnp.sum(decoder._block(cfg, x, layer, attention.xla_attention(None)))
  policy = presets.remat_policy(remat)
  jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(block, policy=policy), x, layer)
  lines = capsys.readouterr().out.splitlines()
  named = [line.split("'")[1] for line in lines if ' named ' in line]
  assert {n: named.count(n) for n in set(named)} == kept
  assert sum('<host>' in line for line in lines) == offloaded
  assert all('from the argument' in line or ' named ' in line or '<host>' in line for line in lines)


@pytest.mark.parametrize(
  'remat', ['minimal_residual', 'offload_minimal_residual', 'offload_all_residual']
)
def test_keeping_the_residual_after_the_attention_runs_no_output_projection_again(remat):
  """A `_residual` policy keeps what its namesake keeps and the residual stream after the
  attention: the backward pass runs exactly one matmul fewer, the attention's output projection,
  which the policy without it runs again to rebuild the MLP norm's input."""
  from jax.extend.core import jaxprs_in_params

  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  layer = jax.tree.map(lambda x: x[0], params['layers'])
  x = jnp.ones((2, cfg.seq_len, cfg.d_model))
  block = lambda x, layer: jnp.sum(decoder._block(cfg, x, layer, attention.xla_attention(None)))

  def matmuls(jaxpr) -> list:
    found = []
    for e in jaxpr.eqns:
      found += [e] if e.primitive.name == 'dot_general' else []
      found += [m for inner in jaxprs_in_params(e.params) for m in matmuls(inner)]
    return found

  def step(policy):
    grad = jax.grad(jax.checkpoint(block, policy=presets.remat_policy(policy)), argnums=(0, 1))
    return matmuls(jax.make_jaxpr(grad)(x, layer).jaxpr)

  without = step(remat.removesuffix('_residual'))
  kept = step(remat)
  assert len(kept) == len(without) - 1
  # the one left out multiplies by the output projection, a (heads x head_dim, d_model) weight
  shapes = lambda found: sorted(tuple(v.aval.shape for v in e.invars) for e in found)
  gone = [s for s in shapes(without) if shapes(without).count(s) > shapes(kept).count(s)]
  assert {s[1] for s in gone} == {(cfg.n_heads * cfg.head_dim, cfg.d_model)}, gone


@pytest.mark.parametrize('remat, where', [('full', 'f32['), ('offload_layer_inputs', 'f32<host>[')])
def test_the_layer_loop_keeps_its_stack_of_block_inputs_where_the_policy_says(remat, where, capsys):
  """Full rematerialisation keeps one input per block (layers x batch x seq x d_model) for the
  backward pass; `offload_layer_inputs` keeps that stack in host memory and nothing else."""
  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  x = jnp.ones((2, cfg.seq_len, cfg.d_model))
  block = lambda x, layer: decoder._block(cfg, x, layer, attention.xla_attention(None))
  loop = lambda params, x: jnp.sum(decoder._layer_loop(block, x, params['layers'], None, remat))
  jax.ad_checkpoint.print_saved_residuals(loop, params, x)
  kept = [line for line in capsys.readouterr().out.splitlines() if 'from the argument' not in line]
  assert len(kept) == 1, kept
  assert kept[0].startswith(f'{where}{cfg.n_layers},2,{cfg.seq_len},{cfg.d_model}] output of scan')


def test_one_hot_cross_entropy_is_the_integer_label_cross_entropy():
  """The lean head's loss against optax's cross-entropy of integer labels, value and gradient:
  the same per-token terms (logsumexp less the target's logit), summed over the vocabulary."""
  import optax

  logits = 4 * jax.random.normal(jax.random.key(0), (2, 16, 50))
  targets = jax.random.randint(jax.random.key(1), (2, 16), 0, 50)
  want = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, targets).mean()
  got = lambda z: presets.one_hot_cross_entropy(z, targets)
  assert_close(got(logits), want(logits), reordered(50))
  assert_close(jax.grad(got)(logits), jax.grad(want)(logits), reordered(50))


def _lean_program(lean_head: bool, mesh):
  """(loss, gradients, lowered text) of the tiny decoder at stage 3 over `mesh`, per layer."""
  import zerojax

  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  ztx = zerojax.zero_stage(__import__('optax').sgd(0.1), 3, mesh=mesh)
  plan = zerojax.plan_for(ztx, params)
  params = jax.device_put(params, plan.params)
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab)
  loss = lambda p, b: presets.decoder_loss(
    p, b, cfg, plan=plan, compute_dtype=jnp.float32, lean_head=lean_head
  )
  grad_fn = jax.jit(zerojax.value_and_grad(loss, ztx, per_layer=True))
  value, grads = grad_fn(params, tokens)
  return value, grads, grad_fn.lower(params, tokens).as_text()


def test_the_lean_head_keeps_the_loss_and_gathers_the_head_after_the_layer_loop(auto_mesh):
  """`lean_head`: the same loss and gradients (to the rounding of a sum over the vocabulary in
  another order), and in the lowered program the head's first all-gather comes after the
  layer loop, where without it the head is gathered before the loop with the embedding."""
  cfg = presets.PRESETS['tiny']
  want, want_grads, plain = _lean_program(False, auto_mesh)
  got, got_grads, lean = _lean_program(True, auto_mesh)
  assert_close(got, want, reordered(cfg.vocab))
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert_close(g, w, reordered(cfg.vocab + cfg.d_ff))
  head = f'tensor<{cfg.d_model}x{cfg.vocab}xf32>'

  def head_gathered_after_loop(text):
    gathers = [
      i for i, line in enumerate(text.splitlines()) if 'all_gather' in line and head in line
    ]
    loop = next(i for i, line in enumerate(text.splitlines()) if 'stablehlo.while' in line)
    assert gathers, f'no all-gather to {head} in the program'
    return gathers[0] > loop

  assert head_gathered_after_loop(lean)
  assert not head_gathered_after_loop(plain)


def test_the_llama_presets_rotate_as_llama_2_does_and_gpt_2s_learn_no_positions():
  """Llama 2's presets carry its config.json's rotation (rope_theta 10000) and norm epsilon
  (1e-5); GPT-2's are position-free; the rotation is in the lowered program (its cosines and
  sines) only where the config has one."""
  for name in ('llama2-7b', 'llama2-13b', 'llama2-70b'):
    cfg = presets.PRESETS[name]
    assert (cfg.rope, cfg.norm_eps) == (decoder.Rope(10000.0), 1e-5), name
  assert all(presets.PRESETS[n].rope is None for n in ('tiny', 'gpt2-small', 'gpt2-xl'))
  small = presets.parse_decoder('vocab=64,d_model=32,n_layers=1,n_heads=2,d_ff=64', seq_len=8)
  for rope, rotated in ((small.rope, True), (None, False)):
    cfg = presets.DecoderConfig(**{**small.__dict__, 'rope': rope})
    params = decoder.init_decoder(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    loss = functools.partial(decoder.decoder_loss, cfg=cfg)
    text = jax.jit(loss).lower(params, tokens).as_text()
    # The angles' cosines and sines: constants of (1, positions, 1, head_dim), 7 and 16 here.
    assert ('tensor<1x7x1x16xf32>' in text) == rotated, rope


def test_a_decoder_shape_rotates_by_rope_theta_when_gated():
  """`decoder:` shapes: gated ones rotate by 10000 unless `rope_theta` says otherwise (a number,
  or none), ungated ones only where it is given; anything else is refused, naming it."""
  base = 'vocab=64,d_model=32,n_layers=1,n_heads=2,d_ff=64'
  assert presets.parse_decoder(base).rope == decoder.Rope(10000.0)
  assert presets.parse_decoder(base + ',rope_theta=500000').rope == decoder.Rope(500000.0)
  assert presets.parse_decoder(base + ',rope_theta=none').rope is None
  assert presets.parse_decoder(base + ',gated=false').rope is None
  assert presets.parse_decoder(base + ',gated=false,rope_theta=1e4').rope == decoder.Rope(1e4)
  for bad in ('x', '0', '-5'):
    with pytest.raises(ValueError) as err:
      presets.parse_decoder(f'{base},rope_theta={bad}')
    assert str(err.value) == (
      f"decoder shape: rope_theta='{bad}'; give the rotation base, a number > 0 (10000), or none."
    )


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('offset', [0, 5])
def test_rotate_is_transformers_rotation_in_the_activations_dtype(dtype, offset):
  """x * cos + rotate_half(x) * sin with the angles' cosines and sines cast to x's dtype, the
  arithmetic in that dtype (transformers' apply_rotary_pos_emb), written here in numpy on the
  bfloat16 values: equal in float32, within one bfloat16 rounding of each product in bfloat16."""
  import ml_dtypes
  import numpy as np

  rope = decoder.Rope(10000.0, 'llama3', 8.0, 1.0, 4.0, 16)
  x = jax.random.normal(jax.random.key(1), (2, 7, 3, 16), jnp.float32).astype(dtype)
  got = np.asarray(decoder.rotate(x, rope, offset).astype(jnp.float32))
  inv = rope.inverse_frequencies(16)
  angles = np.arange(offset, offset + 7, dtype=np.float32)[:, None] * inv[None, :]
  angles = np.concatenate([angles, angles], -1)[None, :, None, :]
  np_dtype = np.float32 if dtype == jnp.float32 else ml_dtypes.bfloat16
  cos, sin = np.cos(angles).astype(np_dtype), np.sin(angles).astype(np_dtype)
  xs = np.asarray(x).astype(np_dtype)
  half = np.concatenate([-xs[..., 8:], xs[..., :8]], -1)
  want = (xs * cos + half * sin).astype(np.float32)
  assert decoder.rotate(x, rope, offset).dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 2 * 2.0**-8 * np.abs(np.asarray(x, np.float32)).max()
  np.testing.assert_allclose(got, want, rtol=0, atol=tol)
  if dtype == jnp.bfloat16:  # not a float32 rotation rounded once at the end
    assert np.abs(got - want).max() <= tol
