"""Packed SFT rows: each example in a packed row gets the logits it has alone (attention never
crosses an example, rotary positions restart), the loss is on completion tokens only, and the
loss of a packed batch equals the examples' own under ZeRO at every stage."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax

DATA = os.path.join(os.path.dirname(__file__), 'data')


def _model(**changes):
  folder = os.path.join(
    DATA, 'hf-tiny-mistral' if changes.pop('window', False) else 'hf-tiny-llama'
  )
  tx = zerojax.zero_stage(optax.adam(1e-3), 0, mesh=jax.make_mesh((8,), ('data',)))
  params, cfg = zerojax.llama.load(folder, tx)
  return jax.tree.map(np.asarray, params), cfg


EXAMPLES = [
  ([3, 4, 5], [6, 7, 8, 9]),
  ([10, 11], [12, 13, 14]),
  ([20], [21, 22, 23, 24, 25]),
  ([30, 31, 32, 33], [34]),
]


@pytest.mark.parametrize(
  'attention',
  [dict(), dict(attention_chunk=5), dict(window=True), dict(window=True, attention_chunk=5)],
)
def test_each_packed_example_has_the_logits_it_has_alone(attention):
  attention = dict(attention)
  params, cfg = _model(window=attention.pop('window', False))
  rows = zerojax.llama.pack(EXAMPLES, seq_len=15)
  assert rows['tokens'].shape == (2, 16)
  tokens, seg = rows['tokens'][:, :-1], rows['segment_ids'][:, :-1]
  packed = zerojax.llama.logits(
    params,
    jnp.asarray(tokens),
    cfg,
    compute_dtype=jnp.float32,
    segment_ids=jnp.asarray(seg),
    **attention,
  )
  found = 0
  for r in range(tokens.shape[0]):
    for s in range(1, seg[r].max() + 1):
      where = np.flatnonzero(seg[r] == s)
      alone = zerojax.llama.logits(
        params, jnp.asarray(tokens[r, where][None]), cfg, compute_dtype=jnp.float32
      )
      np.testing.assert_allclose(
        packed[r, where], alone[0], rtol=0, atol=1e-5 * float(jnp.abs(alone).max())
      )
      found += 1
  assert found == len(EXAMPLES)
  # Unpacked, the same row would attend across examples: the check is not vacuous.
  mixed = zerojax.llama.logits(
    params, jnp.asarray(tokens), cfg, compute_dtype=jnp.float32, **attention
  )
  assert float(jnp.abs(mixed - packed).max()) > 1e-3


def test_pack_fills_rows_first_fit_and_weighs_completions():
  rows = zerojax.llama.pack(EXAMPLES, seq_len=15)
  # The third example (6 tokens) does not fit the 4 left in row 0: it opens row 1, which the
  # fourth (5) then shares.
  np.testing.assert_array_equal(rows['segment_ids'][0], [1] * 7 + [2] * 5 + [0] * 4)
  np.testing.assert_array_equal(rows['segment_ids'][1], [1] * 6 + [2] * 5 + [0] * 5)
  assert rows['loss_weights'].sum() == sum(len(c) for _, c in EXAMPLES)
  assert rows['tokens'].dtype == np.int32 and rows['loss_weights'].dtype == np.float32
  with pytest.warns(UserWarning, match=r'pack: 1 example\(s\) longer than a row of 5 tokens'):
    cut = zerojax.llama.pack([([1, 2], [3, 4, 5, 6])], seq_len=4)
  assert cut['tokens'].tolist() == [[1, 2, 3, 4, 5]]
  with pytest.raises(ValueError, match='example 0 has 6 tokens, more than a row of 5'):
    zerojax.llama.pack([([1, 2], [3, 4, 5, 6])], seq_len=4, truncate=False)
  with pytest.raises(ValueError, match='example 1 has no completion tokens'):
    zerojax.llama.pack([([1], [2]), ([3], [])], seq_len=4)


def _alone_loss(params, cfg):
  """The completions' mean next-token loss, each example run on its own (no packing)."""
  total = count = 0.0
  for prompt, completion in EXAMPLES:
    ids = jnp.asarray([prompt + completion])
    logp = jax.nn.log_softmax(
      zerojax.llama.logits(params, ids[:, :-1], cfg, compute_dtype=jnp.float32)
    )
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[0, :, 0]
    total += float(jnp.sum(nll[len(prompt) - 1 :]))
    count += len(completion)
  return total / count


def test_the_packed_loss_is_the_completions_loss(explicit_mesh):
  params, cfg = _model()
  rows = {k: jnp.asarray(v) for k, v in zerojax.llama.pack(EXAMPLES, seq_len=15).items()}
  out = zerojax.llama.loss(
    params,
    rows['tokens'],
    cfg,
    compute_dtype=jnp.float32,
    segment_ids=rows['segment_ids'],
    loss_weights=rows['loss_weights'],
  )
  assert isinstance(out, zerojax.WeightedMean)
  want = _alone_loss(params, cfg)
  assert abs(float(out.value) - want) <= 1e-5 * want
  for extra in (dict(loss_chunk=5), dict(lean_head=True)):
    again = zerojax.llama.loss(
      params,
      rows['tokens'],
      cfg,
      compute_dtype=jnp.float32,
      segment_ids=rows['segment_ids'],
      loss_weights=rows['loss_weights'],
      **extra,
    )
    assert abs(float(again.value) - want) <= 1e-5 * want, extra
  with pytest.raises(ValueError, match=r'loss_weights has shape \(2, 15\); it is per token'):
    zerojax.llama.loss(params, rows['tokens'], cfg, loss_weights=rows['loss_weights'][:, 1:])
  with pytest.raises(ValueError, match="segment_ids \\(packed rows\\) under attention='flash'"):
    zerojax.llama.loss(
      params, rows['tokens'], cfg, segment_ids=rows['segment_ids'], attention='flash'
    )


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_packed_lora_loss_under_zero_equals_the_examples_alone(stage, explicit_mesh):
  folder = os.path.join(DATA, 'hf-tiny-llama')
  tx = zerojax.zero_stage(
    optax.adam(1e-3),
    stage,
    mesh=explicit_mesh,
    stacked={'layers': True},
    trainable=zerojax.llama.is_adapter,
  )
  lora = zerojax.llama.LoraConfig(rank=4, alpha=8)
  params, cfg = zerojax.llama.load(folder, tx, lora=lora)
  plan = zerojax.plan_for(tx, params)
  # Eight rows, one per device: the examples four times over pack into 7, and a row of padding
  # (segment 0, weight 0: nothing to learn) ends the batch, as a last partial one would.
  rows = zerojax.llama.pack(EXAMPLES * 4, seq_len=15)
  assert rows['tokens'].shape[0] == 7
  rows = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in rows.items()}
  batch = {k: jnp.asarray(v) for k, v in rows.items()}

  def loss(p, b):
    return zerojax.llama.loss(
      p,
      b['tokens'],
      cfg,
      plan=plan,
      compute_dtype=jnp.float32,
      segment_ids=b['segment_ids'],
      loss_weights=b['loss_weights'],
    )

  value, grads = jax.jit(zerojax.value_and_grad(loss, tx, per_layer=True))(params, batch)
  whole = jax.tree.map(np.asarray, params)
  want = _alone_loss(whole, cfg)
  assert abs(float(value) - want) <= 1e-5 * want
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert float(jnp.abs(grads['layers']['lora']['wq']['a']).max()) == 0.0  # B = 0 at step 0
    assert float(jnp.abs(grads['layers']['lora']['wq']['b']).max()) > 0.0
