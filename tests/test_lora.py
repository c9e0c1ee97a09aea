"""LoRA on `zerojax.llama`'s decoder, under ZeRO at every stage, and Hugging Face PEFT's adapters.

tests/data/peft-tiny-{llama,qwen2,qwen3} were written by peft itself (tools/make_hf_fixtures.py
--peft: `get_peft_model` on the transformers-written tiny checkpoints, A and B drawn wide,
`save_pretrained`), with the logits `peft.PeftModel.from_pretrained` computed on fixed tokens.
Neither peft nor torch is needed here.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

import zerojax

DATA = os.path.join(os.path.dirname(__file__), 'data')
ADAPTERS = {
  'peft-tiny-llama': 'hf-tiny-llama',
  'peft-tiny-qwen2': 'hf-tiny-qwen2',
  'peft-tiny-qwen3': 'hf-tiny-qwen3',
}


def _tx(stage, mesh, **kw):
  return zerojax.zero_stage(
    optax.adam(1e-2), stage, mesh=mesh, stacked={'layers': True}, replicate_below_bytes=0, **kw
  )


def _logits(params, cfg, tx, tokens):
  plan = zerojax.plan_for(tx, params)
  run = jax.jit(lambda p, t: zerojax.llama.logits(p, t, cfg, plan=plan, compute_dtype=jnp.float32))
  return np.asarray(run(params, jnp.asarray(tokens, jnp.int32)))


def _close(got, want):
  scale = np.abs(want).max()
  assert scale > 1.0
  np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
@pytest.mark.parametrize('name', sorted(ADAPTERS))
def test_adapters_peft_wrote_give_peft_logits(mesh, name, stage):
  want = np.load(os.path.join(DATA, name, 'expected.npz'))
  tx = _tx(stage, mesh)
  params, cfg = zerojax.llama.load(
    os.path.join(DATA, ADAPTERS[name]), tx, adapter=os.path.join(DATA, name)
  )
  assert cfg.lora == zerojax.llama.lora_from_peft(os.path.join(DATA, name))
  got = _logits(params, cfg, tx, want['tokens'])
  _close(got, want['logits'])
  # The adapter is what changes them: the base alone is transformers' own base logits.
  base = np.load(os.path.join(DATA, ADAPTERS[name], 'expected.npz'))['logits']
  assert np.abs(want['logits'] - base).max() > 0.1


def test_peft_config_is_read_exactly():
  llama = zerojax.llama.lora_from_peft(os.path.join(DATA, 'peft-tiny-llama'))
  assert llama == zerojax.llama.LoraConfig(
    rank=4, alpha=8, targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down'), dropout=0.05
  )
  qwen3 = zerojax.llama.lora_from_peft(os.path.join(DATA, 'peft-tiny-qwen3'))
  assert qwen3.rslora and qwen3.scale == 4 / 2  # alpha / sqrt(rank)
  assert qwen3.targets == ('q', 'o', 'up', 'down')


def test_a_new_adapter_starts_as_the_base_model(explicit_mesh):
  folder = os.path.join(DATA, 'hf-tiny-llama')
  want = np.load(os.path.join(folder, 'expected.npz'))
  tx = _tx(3, explicit_mesh)
  lora = zerojax.llama.LoraConfig(rank=8, alpha=16, targets=('q', 'v', 'down'))
  params, cfg = zerojax.llama.load(folder, tx, lora=lora)
  layers = params['layers']['lora']
  assert sorted(layers) == ['w_out', 'wq', 'wv']
  assert layers['wq']['a'].shape == (2, 48, 8) and layers['wq']['b'].shape == (2, 8, 64)
  assert float(jnp.abs(layers['wq']['b']).max()) == 0.0  # B = 0, as PEFT initialises it
  bound = 1 / np.sqrt(48)  # A: Kaiming-uniform with a = sqrt(5), U(-1/sqrt(in), 1/sqrt(in))
  a = np.asarray(layers['wq']['a'])
  assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
  _close(_logits(params, cfg, tx, want['tokens']), want['logits'])


def test_saved_adapter_is_the_file_peft_wrote(tmp_path, auto_mesh):
  """Read and written again, a peft adapter is the same tensors under the same names, in the
  same layout and dtype, with a config whose LoRA settings peft reads as its own."""
  src = os.path.join(DATA, 'peft-tiny-llama')
  tx = _tx(3, auto_mesh)
  params, cfg = zerojax.llama.load(os.path.join(DATA, 'hf-tiny-llama'), tx, adapter=src)
  written = zerojax.llama.save_adapter(params, tmp_path, cfg, base_model='hf-tiny-llama')
  assert sorted(os.path.basename(f) for f in written) == [
    'adapter_config.json',
    'adapter_model.safetensors',
  ]
  ours, theirs = (load_file(os.path.join(d, 'adapter_model.safetensors')) for d in (tmp_path, src))
  assert sorted(ours) == sorted(theirs)
  for k in theirs:
    assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
    np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
  mine = json.loads((tmp_path / 'adapter_config.json').read_text())
  peft = json.load(open(os.path.join(src, 'adapter_config.json')))
  for key in ('peft_type', 'task_type', 'r', 'lora_alpha', 'lora_dropout', 'bias', 'use_rslora'):
    assert mine[key] == peft[key], key
  assert sorted(mine['target_modules']) == sorted(peft['target_modules'])
  assert zerojax.llama.lora_from_peft(tmp_path) == cfg.lora


@pytest.mark.parametrize('name', sorted(ADAPTERS))
def test_merged_export_gives_peft_logits_without_adapters(tmp_path, auto_mesh, name):
  want = np.load(os.path.join(DATA, name, 'expected.npz'))
  base = os.path.join(DATA, ADAPTERS[name])
  tx = _tx(3, auto_mesh)
  params, cfg = zerojax.llama.load(base, tx, adapter=os.path.join(DATA, name))
  with pytest.raises(ValueError, match='merge_lora'):
    zerojax.llama.save(params, tmp_path / 'refused', cfg)
  merged, plain = zerojax.llama.merge_lora(params, cfg)
  assert plain.lora is None and 'lora' not in merged['layers']
  zerojax.llama.save(merged, tmp_path / 'merged', plain, source=base)
  assert sorted(load_file(str(tmp_path / 'merged' / 'model.safetensors'))) == sorted(
    load_file(os.path.join(base, 'model.safetensors'))
  )
  again, cfg2 = zerojax.llama.load(tmp_path / 'merged', tx)
  _close(_logits(again, cfg2, tx, want['tokens']), want['logits'])


def _copy(tmp_path, name='peft-tiny-llama'):
  dst = tmp_path / name
  shutil.copytree(os.path.join(DATA, name), dst)
  return dst


def test_bad_adapters_are_refused_by_name(tmp_path, auto_mesh):
  base = os.path.join(DATA, 'hf-tiny-llama')
  tx = _tx(1, auto_mesh)
  # An adapter of another model: Qwen2's fixture has another head width.
  with pytest.raises(
    ValueError, match=r'q_proj.lora_B.weight.*checkpoint shape \(48, 8\), model expects \(64, 8\)'
  ):
    zerojax.llama.load(base, tx, adapter=os.path.join(DATA, 'peft-tiny-qwen2'))
  # A missing tensor, named.
  bad = _copy(tmp_path)
  tensors = load_file(str(bad / 'adapter_model.safetensors'))
  gone = 'base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight'
  save_file({k: v for k, v in tensors.items() if k != gone}, str(bad / 'adapter_model.safetensors'))
  with pytest.raises(ValueError, match=f"'{gone}' -> layers/lora/wk/b: not in the checkpoint"):
    zerojax.llama.load(base, tx, adapter=bad)
  # A rank that disagrees with the config.
  shutil.rmtree(bad)
  bad = _copy(tmp_path)
  config = json.loads((bad / 'adapter_config.json').read_text())
  (bad / 'adapter_config.json').write_text(json.dumps(config | {'r': 2}))
  with pytest.raises(ValueError, match=r'has rank 4, and adapter_config.json says r=2'):
    zerojax.llama.load(base, tx, adapter=bad)
  # What the decoder does not compute.
  (bad / 'adapter_config.json').write_text(json.dumps(config | {'use_dora': True}))
  with pytest.raises(ValueError, match=r'use_dora=True \(DoRA'):
    zerojax.llama.lora_from_peft(bad)
  (bad / 'adapter_config.json').write_text(json.dumps(config | {'peft_type': 'IA3'}))
  with pytest.raises(ValueError, match="peft_type 'IA3'; zerojax reads LoRA adapters"):
    zerojax.llama.lora_from_peft(bad)
  with pytest.raises(ValueError, match="no projection 'fc1'"):
    zerojax.llama.LoraConfig(rank=4, alpha=8, targets=('fc1',))


def _lora_cfg(dropout=0.0):
  lora = zerojax.llama.LoraConfig(
    rank=4, alpha=8, targets=tuple('qkvo') + ('gate', 'up', 'down'), dropout=dropout
  )
  return zerojax.llama.DecoderConfig(
    96, 32, 2, 4, 2, 64, 16, gated=True, rope=zerojax.llama.Rope(), lora=lora
  )


def _train(cfg, stage, mesh, steps=3, per_layer=False, micro_batches=1, key=None):
  tx = _tx(stage, mesh, trainable=zerojax.llama.is_adapter)
  params = zerojax.create_train_state(
    lambda k: zerojax.llama.init(cfg, k), jax.random.key(0), tx=tx
  ).params
  # B = 0 trains nothing at first but B: give it a value, the same at every stage.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.05 if jax.tree_util.keystr(p).endswith("['b']") else x, params
  )
  plan = zerojax.plan_for(tx, params)
  state = tx.init(params)
  start = jax.tree.map(np.asarray, params)
  tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 96)
  opts = dict(plan=plan, compute_dtype=jnp.float32, remat='full')
  loss = lambda p, t, k=None: zerojax.llama.loss(p, t, cfg, **opts, dropout_key=k)
  args = () if key is None else (key,)
  vg = zerojax.value_and_grad(loss, tx, per_layer=per_layer, micro_batches=micro_batches)

  @jax.jit
  def step(p, s):
    value, g = vg(p, tokens, *args)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, value

  losses = []
  for _ in range(steps):
    params, state, value = step(params, state)
    losses.append(float(value))
  return params, state, losses, plan, start


@pytest.mark.parametrize('per_layer', [False, True])
def test_lora_losses_equal_across_stages_and_the_base_never_moves(explicit_mesh, per_layer):
  cfg = _lora_cfg()
  runs = {s: _train(cfg, s, explicit_mesh, per_layer=per_layer) for s in (0, 1, 2, 3)}
  first = runs[0][2]
  assert first[-1] < first[0]
  for stage, (params, state, losses, plan, start) in runs.items():
    np.testing.assert_allclose(losses, first, rtol=2e-6, err_msg=f'stage {stage}')
    frozen = [f for f in plan.frozen]
    assert sum(not f for f in frozen) == 14  # 7 projections x (A, B)
    assert isinstance(state[0].mu['layers']['wq'], optax.MaskedNode)
    for w in ('wq', 'w_out', 'embed'):
      leaf = params['layers'][w] if w != 'embed' else params[w]
      np.testing.assert_array_equal(leaf, start['layers'][w] if w != 'embed' else start[w])
    assert (
      np.abs(
        np.asarray(params['layers']['lora']['wq']['a']) - start['layers']['lora']['wq']['a']
      ).max()
      > 0
    )


def test_lora_gradient_equals_jax_grad_on_one_device(explicit_mesh):
  cfg = _lora_cfg()
  tx = _tx(3, explicit_mesh, trainable=zerojax.llama.is_adapter)
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.05 if jax.tree_util.keystr(p).endswith("['b']") else x,
    zerojax.llama.init(cfg, jax.random.key(0)),
  )
  tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 96)
  one = jax.grad(lambda p: zerojax.llama.loss(p, tokens, cfg, compute_dtype=jnp.float32))(params)
  placed = jax.device_put(params, zerojax.plan_for(tx, params).params)
  plan = zerojax.plan_for(tx, placed)
  loss = lambda p, t: zerojax.llama.loss(p, t, cfg, plan=plan, compute_dtype=jnp.float32)
  _, got = jax.jit(zerojax.value_and_grad(loss, tx, per_layer=True))(placed, tokens)
  for w in cfg.lora.weights:
    for ab in 'ab':
      want = one['layers']['lora'][w][ab]
      np.testing.assert_allclose(got['layers']['lora'][w][ab], want, atol=1e-6 * np.abs(want).max())
  # A frozen leaf's gradient comes back as zeros, computed by no one.
  assert float(jnp.abs(got['layers']['wq']).max()) == 0.0


def test_lora_dropout_draws_and_is_off_without_a_key(explicit_mesh):
  cfg = _lora_cfg(dropout=0.5)
  params = zerojax.llama.init(cfg, jax.random.key(0))
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.05 if jax.tree_util.keystr(p).endswith("['b']") else x, params
  )
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 96)
  run = lambda key: float(
    zerojax.llama.loss(params, tokens, cfg, compute_dtype=jnp.float32, dropout_key=key)
  )
  off = float(zerojax.llama.loss(params, tokens, cfg, compute_dtype=jnp.float32))
  a, b = run(jax.random.key(5)), run(jax.random.key(6))
  assert a != off and b != off and a != b
  assert run(jax.random.key(5)) == a
  plain = zerojax.llama.loss(
    params, tokens, dataclasses_replace(cfg, lora=None), compute_dtype=jnp.float32
  )
  assert float(plain) != off  # the adapters (B != 0) change the model


def dataclasses_replace(cfg, **kw):
  import dataclasses

  return dataclasses.replace(cfg, **kw)
