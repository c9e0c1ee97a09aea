"""QLoRA: frozen base weights stored as NF4 (as bitsandbytes stores them) or int8, split and
gathered in that form under ZeRO-3, dequantized inside the layer, with LoRA adapters trained.

tests/data/bnb-nf4 was written by bitsandbytes itself (tools/make_hf_fixtures.py --bnb: its
`quantize_4bit(quant_type='nf4', blocksize=64)` and `dequantize_4bit`).
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax._src import qbase
from zerojax._src.planner import hlo as hlo_lib

DATA = os.path.join(os.path.dirname(__file__), 'data')
BNB = np.load(os.path.join(DATA, 'bnb-nf4', 'expected.npz'))


def _scales(q):
  return np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.float32))


def test_nf4_is_bitsandbytes_nf4():
  assert np.array_equal(qbase.NF4_LEVELS, BNB['code'])
  # bitsandbytes quantizes PyTorch's (out, in) weight; the decoder uses its transpose.
  q = zerojax.llama.QuantizedWeight and qbase.quantize(jnp.asarray(BNB['weight']).T, 'nf4')
  np.testing.assert_array_equal(np.asarray(q.codes), BNB['single_packed'].reshape(-1))
  np.testing.assert_array_equal(_scales(q), BNB['single_absmax'])
  got = np.asarray(zerojax.llama.dequantize(q)).T
  np.testing.assert_allclose(got, BNB['single_dequantized'], rtol=0, atol=1e-7)
  # Blocks that run across rows: the same codes and scales as bitsandbytes'.
  u = qbase.quantize(jnp.asarray(BNB['unaligned']).T, 'nf4')
  np.testing.assert_array_equal(np.asarray(u.codes), BNB['unaligned_packed'].reshape(-1))
  np.testing.assert_array_equal(_scales(u), BNB['unaligned_absmax'])


@pytest.mark.parametrize('shape', [(64, 8), (8, 64), (3, 128, 48), (80, 48)])
def test_round_trips_stay_within_half_a_level(shape):
  w = jax.random.normal(jax.random.key(0), shape) * 0.1
  blocks = lambda x: np.swapaxes(np.asarray(x), -1, -2).reshape(-1, 64)
  absmax = np.abs(blocks(w)).max(1, keepdims=True)
  i8 = qbase.dequantize(qbase.quantize(w, 'int8'))
  assert i8.shape == w.shape
  assert (np.abs(blocks(i8) - blocks(w)) <= absmax / 254 + 1e-7).all()
  nf4 = qbase.dequantize(qbase.quantize(w, 'nf4'))
  widest = np.diff(qbase.NF4_LEVELS).max() / 2
  assert (np.abs(blocks(nf4) - blocks(w)) <= absmax * widest + 1e-7).all()


def test_weights_that_are_not_whole_blocks_are_refused():
  with pytest.raises(ValueError, match=r'holds 30 values, not a whole number of blocks of 64'):
    qbase.quantize(jnp.ones((5, 6)))
  with pytest.raises(ValueError, match="base_dtype must be one of \\('nf4', 'int8'\\)"):
    qbase.quantize(jnp.ones((8, 8)), 'fp4')


def _tx(stage, mesh):
  return zerojax.zero_stage(
    optax.adam(1e-2),
    stage,
    mesh=mesh,
    stacked={'layers': True},
    replicate_below_bytes=0,
    policy='replicate',
    trainable=zerojax.llama.is_adapter,
  )


@pytest.mark.parametrize('kind', ['nf4', 'int8'])
@pytest.mark.parametrize('stage', [0, 3])
def test_a_quantized_checkpoint_computes_its_dequantized_weights(mesh, stage, kind):
  folder = os.path.join(DATA, 'hf-tiny-llama')
  tokens = np.load(os.path.join(folder, 'expected.npz'))['tokens']
  tx = _tx(stage, mesh)
  lora = zerojax.llama.LoraConfig(rank=4, alpha=8)
  params, cfg = zerojax.llama.load(folder, tx, lora=lora, base_dtype=kind)
  assert isinstance(params['layers']['wq'], zerojax.llama.QuantizedWeight)
  assert params['layers']['wq'].codes.dtype == (jnp.uint8 if kind == 'nf4' else jnp.int8)
  plan = zerojax.plan_for(tx, params)
  run = jax.jit(lambda p, t: zerojax.llama.logits(p, t, cfg, plan=plan, compute_dtype=jnp.float32))
  got = np.asarray(run(params, jnp.asarray(tokens)))
  # The reference: the full-precision model whose projections are the stored weights
  # dequantized, on one device.
  plain, _ = zerojax.llama.load(
    folder, zerojax.zero_stage(optax.adam(1e-2), 0, mesh=mesh), lora=lora
  )
  ref = jax.tree.map(np.asarray, plain)
  for w in ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_in', 'w_out'):
    ref['layers'][w] = np.asarray(
      zerojax.llama.dequantize(qbase.quantize(jnp.asarray(ref['layers'][w]), kind))
    )
  want = np.asarray(zerojax.llama.logits(ref, jnp.asarray(tokens), cfg, compute_dtype=jnp.float32))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  base = np.load(os.path.join(folder, 'expected.npz'))['logits']
  assert np.abs(got - base).max() > 1e-3  # quantization changed them: the check is not vacuous


def _qlora_run(stage, mesh, kind='nf4', steps=3):
  folder = os.path.join(DATA, 'hf-tiny-llama')
  tx = _tx(stage, mesh)
  lora = zerojax.llama.LoraConfig(rank=4, alpha=8, targets=('q', 'v', 'up', 'down'))
  params, cfg = zerojax.llama.load(folder, tx, lora=lora, base_dtype=kind)
  plan = zerojax.plan_for(tx, params)
  state = tx.init(params)
  tokens = jax.random.randint(jax.random.key(1), (8, 13), 0, 96)
  loss = lambda p, t: zerojax.llama.loss(p, t, cfg, plan=plan, compute_dtype=jnp.float32)
  vg = zerojax.value_and_grad(loss, tx, per_layer=True)

  @jax.jit
  def step(p, s):
    value, g = vg(p, tokens)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, value

  compiled = step.lower(params, state).compile()
  start = np.asarray(params['layers']['wq'].codes)
  losses = []
  for _ in range(steps):
    params, state, value = step(params, state)
    losses.append(float(value))
  np.testing.assert_array_equal(np.asarray(params['layers']['wq'].codes), start)
  return losses, plan, state, compiled


def test_qlora_losses_equal_across_stages(explicit_mesh):
  runs = {s: _qlora_run(s, explicit_mesh) for s in (0, 1, 2, 3)}
  first = runs[0][0]
  assert first[-1] < first[0]
  for stage, (losses, _, state, _) in runs.items():
    np.testing.assert_allclose(losses, first, rtol=2e-6, err_msg=f'stage {stage}')
    stored = state[0].mu['layers']['wq']  # no moment of a frozen stored weight
    assert isinstance(stored.codes, optax.MaskedNode) and isinstance(
      stored.scales, optax.MaskedNode
    )


def test_stage_3_gathers_the_stored_form_and_holds_its_share(explicit_mesh):
  losses, plan, state, compiled = _qlora_run(3, explicit_mesh, steps=1)
  rows = {r.path: r for r in plan.rows if r.group == 'params'}
  codes = rows["['layers']['wq'].codes"]
  assert codes.dtype == np.uint8 and codes.shape == (2, 48 * 64 // 2) and codes.frozen
  assert 'data' in str(codes.at_rest) and codes.grads is None
  # Bytes per device of the stored base: codes and scales split 8 ways where they divide.
  quantized = [r for p, r in rows.items() if '.codes' in p or '.scales' in p]
  per_device = sum(
    np.prod(r.shape) * r.dtype.itemsize // (8 if 'data' in str(r.at_rest) else 1) for r in quantized
  )
  from zerojax._src import rules

  assert per_device == sum(
    rules.bytes_per_device(r.shape, r.dtype, r.at_rest, plan.mesh) for r in quantized
  )
  # The layer loop all-gathers uint8 codes, and no projection-sized float weight.
  gathers = []
  for line in compiled.as_text().splitlines():
    found = hlo_lib.collective(line)
    if found and found[0].startswith('all-gather'):
      gathers.append(found[2])
  assert any(re.search(r'u8\[(1,)?1536\]', g) for g in gathers), gathers
  float_sizes = {'48,64', '64,48', '48,32', '32,48', '48,80', '80,48', '1,48,64', '1,48,80'}
  floats = [g for g in gathers if re.search(r'f32\[([\d,]+)\]', g)]
  assert not [g for g in floats if set(re.findall(r'f32\[([\d,]+)\]', g)) & float_sizes], floats


@pytest.mark.parametrize('kind', ['nf4', 'int8'])
@pytest.mark.parametrize('shape', [(128, 48), (64, 256), (80, 48)])
def test_the_layer_multiplies_by_the_stored_weight_as_dequantized(kind, shape):
  from zerojax._src import qbase

  w = jax.random.normal(jax.random.key(3), shape)
  q = qbase.quantize(w, kind)
  h = jax.random.normal(jax.random.key(4), (2, 5, shape[0]))
  want = np.asarray(h @ qbase.dequantize(q, jnp.float32))
  got = np.asarray(qbase.matmul(h, q))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # In bf16 each value is dequantize's, rounded once; the products summed in float32.
  hb = h.astype(jnp.bfloat16)
  ref = np.asarray(hb.astype(jnp.float32) @ qbase.dequantize(q, jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_allclose(
    np.asarray(qbase.matmul(hb, q)).astype(np.float32),
    ref,
    rtol=2e-2,
    atol=1e-2 * np.abs(ref).max(),
  )
  # No table lookup (a gather) and no interleave of the weight where blocks keep to rows.
  text = jax.jit(qbase.matmul).lower(h, q).as_text()
  assert ('gather' in text) == (shape[0] % 64 != 0 and kind == 'nf4')
