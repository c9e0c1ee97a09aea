"""Flash attention (`zerojax._src.flash`): causal attention's numbers, and the cost its kernels
state, which the planner reads."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import run_cli
from _tolerance import assert_close, reordered

from zerojax._src import flash
from zerojax._src.planner import cost, presets


def _qkv(t=128, heads=4, kv_heads=2, d=16, b=1):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k1, (b, t, heads, d))
  k = jax.random.normal(k2, (b, t, kv_heads, d))
  v = jax.random.normal(k3, (b, t, kv_heads, d))
  return q, k, v


def test_flash_attention_equals_causal_attention_and_its_gradient():
  # Pallas's interpreter on CPU: the kernels' arithmetic, block by block (4 blocks of 32).
  q, k, v = _qkv()
  whole = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  fused = lambda q, k, v: flash.flash_attention(q, k, v, block=32)
  blocks = 128 // 32
  # Softmax over 128 keys of 16-wide heads, rescaled once per block of keys.
  assert_close(fused(q, k, v), whole(q, k, v), reordered(128 + 16 + 2 * blocks))
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  got = jax.grad(loss(fused), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    # The forward's chain, then sums over 128 queries, 128 keys and the repeated heads.
    assert_close(g, w, reordered(3 * 128 + 2 * 16 + 4 * blocks + 2))


def test_what_flash_attention_refuses():
  q, k, v = _qkv(t=96, heads=4, kv_heads=3)
  with pytest.raises(ValueError) as info:
    flash.flash_attention(q, k, v)
  assert str(info.value) == 'flash_attention: 3 key/value heads do not divide 4 heads.'
  q, k, v = _qkv(t=96)
  with pytest.raises(ValueError) as info:
    flash.flash_attention(q, k, v, block=64)
  assert str(info.value) == (
    'flash_attention: block=64 does not divide the sequence length 96; choose a block that'
    ' does (128 and 512 are the sizes TPU kernels like).'
  )


def test_the_decoders_flash_attention_equals_its_plain_attention():
  cfg = presets.DecoderConfig(64, 32, 2, 2, 2, 64, 64, gated=True)
  params = presets.init_decoder(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab)
  loss = lambda attention: (
    lambda p: presets.decoder_loss(
      p, tokens, cfg, compute_dtype=jnp.float32, attention=attention, remat='minimal'
    )
  )
  plain, plain_grads = jax.value_and_grad(loss('xla'))(params)
  fused, fused_grads = jax.value_and_grad(loss('flash'))(params)
  terms = 2 * 64 + cfg.n_layers * (cfg.d_model + 64 + cfg.d_ff) + cfg.vocab
  assert abs(float(fused) - float(plain)) <= reordered(terms) * abs(float(plain))
  for g, w in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
    assert_close(g, w, reordered(3 * terms))


def test_flash_and_chunks_together_are_refused():
  cfg = presets.PRESETS['tiny']
  params = presets.init_decoder(cfg, jax.random.key(0))
  tokens = jnp.zeros((2, cfg.seq_len + 1), jnp.int32)
  with pytest.raises(ValueError) as info:
    presets.decoder_loss(params, tokens, cfg, attention='flash', attention_chunk=16)
  assert str(info.value) == (
    "decoder_loss: attention_chunk is for attention='xla'; flash attention works in blocks"
    ' of its own.'
  )
  with pytest.raises(ValueError) as info:
    presets.decoder_loss(params, tokens, cfg, attention='splash')
  assert str(info.value) == (
    "decoder_loss: attention must be one of ('xla', 'flash'), got 'splash'."
  )


def test_attention_flash_is_refused_for_a_users_model():
  done = run_cli(
    'plan', '--model', '_custom_model:spec', '--topology', 'cpu:8', '--attention', 'flash'
  )  # fmt: skip
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1] == (
    'error: --attention is for the presets; --model _custom_model:spec computes its own'
    ' attention and loss (use zerojax.inspect.chunked_attention or'
    ' zerojax.inspect.flash_attention there, or leave it out).'
  )


def _causal_pairs(t, block):
  """(query block, key block) pairs with some key at or before some query, counted one by one."""
  n = t // block
  return sum(1 for i in range(n) for j in range(n) if j * block <= i * block + block - 1)


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_each_tpu_kernel_states_the_flops_of_the_blocks_it_runs():
  """The TPU compiler has no estimate for a Pallas kernel: the kernels state their own, and
  `program_cost` counts them. Per causal block pair and head: the forward's scores and
  weighted values (2 products), the key/value gradients' scores, dV, dP and dK (4), the
  query gradient's scores, dP and dQ (3), each 2 x block x block x head FLOPs."""
  pytest.importorskip('libtpu')
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from zerojax._src.planner import tpu

  mesh = Mesh(np.array(tpu.topology_devices('v5e:2x4')[:1]), ('x',))
  b, t, h, d, block = 2, 1024, 4, 128, 256
  x = jax.ShapeDtypeStruct(
    (b, t, h, d), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec())
  )
  grads = jax.grad(
    lambda q, k, v: jnp.sum(flash.flash_attention(q, k, v, block=block, interpret=False)),
    argnums=(0, 1, 2),
  )
  text = jax.jit(grads).lower(x, x, x).compile().as_text()
  stated = [
    int(m) for m in re.findall(r'custom_call_target="tpu_custom_call".*?"flops":"(\d+)"', text)
  ]
  per_product = b * h * _causal_pairs(t, block) * 2 * block * block * d
  assert sorted(stated) == sorted([2 * per_product, 4 * per_product, 3 * per_product])
  counted = cost.program_cost(text, clock_hz=None, peak_flops=197e12, hbm_bandwidth=819e9)
  assert counted.matmul_flops == 9 * per_product
  # Skipping the blocks above the diagonal: 10 of the 16 pairs run.
  assert _causal_pairs(t, block) == 10
