"""Llama, Mistral, Qwen2 and Qwen3 checkpoints in Hugging Face's naming, loaded at stages 0 and 3
on 8 devices: zerojax's decoder computes the logits of a numpy reference written from the
published equations (tests/_llama_reference.py, float64), within 1e-5 in float32.

The checkpoints are small and random, written here in each family's exact tensor names and
config.json fields (both rope spellings, tied and untied heads, sharded with an index)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _llama_reference import logits as reference_logits
from _llama_reference import random_tensors, small_config, write_checkpoint
from safetensors.numpy import load_file

import zerojax

LLAMA3_SCALING = {
  'factor': 8.0,
  'low_freq_factor': 1.0,
  'high_freq_factor': 4.0,
  'original_max_position_embeddings': 8,
}
CASES = {
  'llama': small_config('llama'),
  # Llama 3.1 as earlier transformers releases wrote it: rope_theta and rope_scaling at the top.
  'llama3-tied': small_config(
    'llama',
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling={'rope_type': 'llama3', **LLAMA3_SCALING},
  ),
  # The same as transformers 5 writes it: under rope_parameters.
  'llama3-rope-parameters': {
    k: v for k, v in small_config('llama').items() if k not in ('rope_theta', 'rope_scaling')
  }
  | {'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 500000.0, **LLAMA3_SCALING}},
  'llama-linear-bias': small_config(
    'llama', rope_scaling={'type': 'linear', 'factor': 4.0}, attention_bias=True
  ),
  'mistral-window': small_config('mistral', sliding_window=5),
  'qwen2-tied': small_config('qwen2', tie_word_embeddings=True),
  'qwen3': small_config('qwen3'),
}
TOKENS = np.random.default_rng(1).integers(0, 96, size=(8, 16)).astype(np.int32)


def _logits(folder, mesh, stage):
  tx = zerojax.zero_stage(optax.adamw(1e-4), stage, mesh=mesh, stacked={'layers': True})
  params, cfg = zerojax.llama.load(folder, tx)
  plan = zerojax.plan_for(tx, params)
  run = jax.jit(
    lambda p, t: zerojax.llama.logits(p, t, cfg, plan=plan, compute_dtype=jnp.float32, remat='none')
  )
  return np.asarray(run(params, jnp.asarray(TOKENS))), params, cfg


@pytest.mark.parametrize('stage', [0, 3])
@pytest.mark.parametrize('case', sorted(CASES))
def test_each_family_computes_the_reference_logits(tmp_path, mesh, case, stage):
  config = CASES[case]
  tensors = random_tensors(config)
  write_checkpoint(tmp_path, config, tensors)
  got, params, cfg = _logits(tmp_path, mesh, stage)
  want = reference_logits(tensors, config, TOKENS)
  assert np.abs(want).max() > 1.0  # logits of a size a wrong rotation or norm would change
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
  assert ('head' in params) == (not config['tie_word_embeddings'])
  if stage == 3:  # each leaf split over the 8 devices where its shape allows
    wq = params['layers']['wq']
    assert wq.addressable_shards[0].data.size * 8 == wq.size


def test_the_family_features_each_change_the_logits(tmp_path):
  """The reference is sensitive to what each case tests: dropping the rotation, the window,
  the biases or the norms changes its logits far beyond the tolerance."""
  base = small_config('llama')
  tensors = random_tensors(base)
  plain = reference_logits(tensors, base, TOKENS)
  scaled = reference_logits(tensors, CASES['llama3-tied'] | {'tie_word_embeddings': False}, TOKENS)
  spelled = reference_logits(tensors, CASES['llama3-rope-parameters'], TOKENS)
  assert np.abs(plain - scaled).max() > 1e-2
  np.testing.assert_array_equal(scaled, spelled)
  window = CASES['mistral-window']
  t = random_tensors(window)
  full = reference_logits(t, window | {'sliding_window': None}, TOKENS)
  assert np.abs(full - reference_logits(t, window, TOKENS)).max() > 1e-2


def test_a_sharded_checkpoint_with_an_index_loads_as_one_file(tmp_path, auto_mesh):
  config = CASES['qwen3']
  tensors = random_tensors(config)
  write_checkpoint(tmp_path / 'one', config, tensors)
  write_checkpoint(tmp_path / 'three', config, tensors, shards=3)
  assert (tmp_path / 'three' / 'model.safetensors.index.json').exists()
  one, _, _ = _logits(tmp_path / 'one', auto_mesh, 3)
  three, _, _ = _logits(tmp_path / 'three', auto_mesh, 3)
  np.testing.assert_array_equal(one, three)


def test_config_from_hf_reads_each_setting():
  cfg = zerojax.llama.config_from_hf(CASES['llama3-tied'])
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model) == (4, 2, 12, 48)
  assert cfg.rope == zerojax.llama.Rope(500000.0, 'llama3', 8.0, 1.0, 4.0, 8)
  assert cfg.tied_head and not cfg.qkv_bias and not cfg.qk_norm
  assert zerojax.llama.config_from_hf(CASES['llama3-rope-parameters']).rope == cfg.rope
  qwen2 = zerojax.llama.config_from_hf(CASES['qwen2-tied'])
  assert qwen2.qkv_bias and not qwen2.out_bias and qwen2.sliding_window is None
  assert zerojax.llama.config_from_hf(CASES['qwen3']).qk_norm
  assert zerojax.llama.config_from_hf(CASES['mistral-window']).sliding_window == 5
  assert zerojax.llama.config_from_hf(CASES['llama'], seq_len=128).seq_len == 128


@pytest.mark.parametrize(
  'change, message',
  [
    (
      {'model_type': 'gemma'},
      "config.json: model_type 'gemma' is not one of the Llama family zerojax reads (llama"
      ' (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3'
      ' (Qwen3ForCausalLM)).',
    ),
    (
      {'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0}},
      "config.json: rope type 'yarn' is not supported; zerojax's decoder computes 'default',"
      " 'linear' and 'llama3' rotary embeddings.",
    ),
    (
      {'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}},
      'config.json: llama3 rope scaling without low_freq_factor, high_freq_factor,'
      ' original_max_position_embeddings.',
    ),
    (
      {'hidden_act': 'gelu'},
      "config.json: hidden_act 'gelu'; the decoder's SwiGLU MLP uses 'silu'.",
    ),
  ],
)
def test_a_config_the_decoder_does_not_compute_is_refused(change, message):
  with pytest.raises(ValueError) as err:
    zerojax.llama.config_from_hf(small_config('llama') | change)
  assert str(err.value) == message


def test_a_misnamed_tensor_is_refused_with_both_names_and_shapes(tmp_path, auto_mesh):
  config = CASES['llama']
  tensors = random_tensors(config)
  tensors['model.layers.1.mlp.up.weight'] = tensors.pop('model.layers.1.mlp.up_proj.weight')
  write_checkpoint(tmp_path, config, tensors)
  tx = zerojax.zero_stage(optax.adamw(1e-4), 3, mesh=auto_mesh, stacked={'layers': True})
  with pytest.raises(ValueError) as err:
    zerojax.llama.load(tmp_path, tx)
  assert str(err.value).splitlines()[1:3] == [
    "  'model.layers.1.mlp.up_proj.weight' -> layers/w_in: not in the checkpoint (the model"
    ' expects shape (80, 48))',
    "  'model.layers.1.mlp.up.weight' -> (none): the model has no place for it (shape (80, 48))",
  ]


def test_saved_parameters_are_the_checkpoint_again_with_its_config_and_tokenizer(
  tmp_path, auto_mesh
):
  config = CASES['qwen2-tied']
  tensors = random_tensors(config)
  write_checkpoint(tmp_path / 'src', config, tensors)
  (tmp_path / 'src' / 'tokenizer.json').write_text('{"version": "1.0"}')
  tx = zerojax.zero_stage(optax.adamw(1e-4), 3, mesh=auto_mesh, stacked={'layers': True})
  params, cfg = zerojax.llama.load(tmp_path / 'src', tx)
  zerojax.llama.save(params, tmp_path / 'out', cfg, source=tmp_path / 'src')
  saved = load_file(str(tmp_path / 'out' / 'model.safetensors'))
  assert sorted(saved) == sorted(tensors)  # the family's names; no lm_head.weight (tied)
  for name, value in tensors.items():
    np.testing.assert_array_equal(saved[name], value, err_msg=name)
  assert json.loads((tmp_path / 'out' / 'config.json').read_text()) == config
  assert (tmp_path / 'out' / 'tokenizer.json').read_text() == '{"version": "1.0"}'
  assert not os.path.exists(tmp_path / 'out' / 'merges.txt')  # only what the source had


DATA = os.path.join(os.path.dirname(__file__), 'data')
# Written by transformers itself (tools/make_hf_fixtures.py: `save_pretrained`, and the logits
# its own classes computed on fixed tokens).
TRANSFORMERS_WRITTEN = [
  'hf-tiny-llama',
  'hf-tiny-llama-tied',
  'hf-tiny-mistral',
  'hf-tiny-qwen2',
  'hf-tiny-qwen3',
]


@pytest.mark.parametrize('stage', [0, 3])
@pytest.mark.parametrize('name', TRANSFORMERS_WRITTEN)
def test_checkpoints_transformers_wrote_give_its_logits(mesh, name, stage):
  folder = os.path.join(DATA, name)
  want = np.load(os.path.join(folder, 'expected.npz'))
  tx = zerojax.zero_stage(optax.adamw(1e-4), stage, mesh=mesh, stacked={'layers': True})
  params, cfg = zerojax.llama.load(folder, tx)
  plan = zerojax.plan_for(tx, params)
  got = jax.jit(lambda p, t: zerojax.llama.logits(p, t, cfg, plan=plan, compute_dtype=jnp.float32))(
    params, jnp.asarray(want['tokens'], jnp.int32)
  )
  scale = np.abs(want['logits']).max()
  assert scale > 1.0
  np.testing.assert_allclose(np.asarray(got), want['logits'], atol=1e-5 * scale, rtol=0)
  # and the reference, from the same files, agrees with transformers
  tensors = load_file(os.path.join(folder, 'model.safetensors'))
  with open(os.path.join(folder, 'config.json')) as f:
    config = json.load(f)
  ref = reference_logits(tensors, config, want['tokens'])
  np.testing.assert_allclose(ref, want['logits'], atol=1e-5 * scale, rtol=0)


def test_the_planner_plans_a_published_model_from_its_config_alone(tmp_path):
  """`python -m zerojax plan --model hf:DIR`: the decoder of the folder's config.json, with
  every parameter the checkpoint holds (the weights themselves are not read)."""
  from _models import run_cli

  folder = tmp_path / 'qwen3'
  folder.mkdir()
  (folder / 'config.json').write_text(
    open(os.path.join(DATA, 'hf-tiny-qwen3', 'config.json')).read()
  )
  out = tmp_path / 'plan.json'
  proc = run_cli('plan', '--model', f'hf:{folder}', '--topology', 'cpu:8', '--stage', '3',
                 '--seq-len', '32', '--json', str(out))  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  tensors = load_file(os.path.join(DATA, 'hf-tiny-qwen3', 'model.safetensors'))
  assert json.loads(out.read_text())['num_params'] == sum(t.size for t in tensors.values())
  proc = run_cli('plan', '--model', f'hf:{tmp_path}', '--topology', 'cpu:8')
  assert proc.stderr.strip().splitlines()[-1] == (
    f'error: --model: {tmp_path}/config.json: no config.json; give the folder of a Hugging Face'
    ' checkpoint (the one `huggingface-cli download` or `save_pretrained` writes).'
  )
