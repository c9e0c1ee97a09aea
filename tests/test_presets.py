"""The preset decoders' memory-efficient attention: the same numbers, one chunk at a time."""

import jax
import jax.numpy as jnp
import pytest
from _models import run_cli
from _tolerance import assert_close, reordered

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
    ' attention (use zerojax.inspect.chunked_attention or'
    ' zerojax.inspect.flash_attention there, or leave it out).'
  )
