"""Published BERT and GPT-2 checkpoints, loaded into ZeRO layouts, compute what Hugging Face's
own classes computed from the same files.

tests/data/hf-tiny-{bert,gpt2} were written by `tools/make_hf_fixtures.py` with transformers
(`save_pretrained`, safetensors): randomly initialised models of a few layers, with the logits
transformers computed on fixed inputs (`expected.npz`). Neither torch nor transformers is
needed here.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import reordered
from safetensors.numpy import load_file, save_file

import zerojax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples'))
import pretrained  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), 'data')
BERT = os.path.join(DATA, 'hf-tiny-bert')
GPT2 = os.path.join(DATA, 'hf-tiny-gpt2')


def _headers(folder):
  return zerojax.checkpoint.read_tensor_names(folder)


def _bert_logits(folder, mesh, stage):
  cfg = pretrained.BertConfig.from_folder(folder)
  want = np.load(os.path.join(BERT, 'expected.npz'))
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, stacked={'layers': True})
  tokens, segments, mask = (jnp.asarray(want[k]) for k in ('tokens', 'segments', 'mask'))
  init = lambda key: pretrained.Bert(cfg).init(key, tokens, segments, mask.astype(bool))['params']
  names = pretrained.bert_names(_headers(folder))
  params = zerojax.checkpoint.load_safetensors(folder, init, jax.random.key(0), tx=tx, names=names)
  model = pretrained.Bert(cfg, tx)  # each module gathers its own parameters
  logits = jax.jit(lambda p: model.apply({'params': p}, tokens, segments, mask.astype(bool)))(
    params
  )
  return np.asarray(logits), want['logits'], cfg


@pytest.mark.parametrize('stage', [0, 3])
def test_bert_loaded_from_a_published_checkpoint_computes_hugging_faces_logits(mesh, stage):
  got, want, cfg = _bert_logits(BERT, mesh, stage)
  # Each logit passes through the layers' contractions over the hidden and MLP widths.
  terms = cfg.num_hidden_layers * (3 * cfg.hidden_size + cfg.intermediate_size) + 48
  np.testing.assert_allclose(got, want, atol=reordered(terms) * np.abs(want).max(), rtol=0)


def test_bert_original_spelling_gamma_beta_and_no_prefix(tmp_path, mesh):
  # BERT's first release says LayerNorm.gamma/.beta, and a bare BertModel (a sentence
  # encoder) has no 'bert.' prefix: both are read from the checkpoint's own names.
  tensors = load_file(os.path.join(BERT, 'model.safetensors'))
  renamed = {}
  for name, value in tensors.items():
    name = name.removeprefix('bert.')
    if 'LayerNorm' in name:
      name = name.replace('LayerNorm.weight', 'LayerNorm.gamma').replace(
        'LayerNorm.bias', 'LayerNorm.beta'
      )
    renamed[name] = value
  save_file(renamed, str(tmp_path / 'model.safetensors'))
  (tmp_path / 'config.json').write_text(open(os.path.join(BERT, 'config.json')).read())
  names = pretrained.bert_names(list(renamed))
  assert names['layers/output_norm/scale'] == 'encoder.layer.{layer}.output.LayerNorm.gamma'
  got, want, cfg = _bert_logits(tmp_path, mesh, 3)
  terms = cfg.num_hidden_layers * (3 * cfg.hidden_size + cfg.intermediate_size) + 48
  np.testing.assert_allclose(got, want, atol=reordered(terms) * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize('stage', [0, 3])
def test_gpt2_loaded_from_a_published_checkpoint_computes_hugging_faces_logits(mesh, stage):
  cfg = pretrained.GPT2Config.from_folder(GPT2)
  want = np.load(os.path.join(GPT2, 'expected.npz'))
  tokens = jnp.asarray(want['tokens'])
  tx = zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, stacked={'h': True})
  init = lambda key: pretrained.GPT2(cfg).init(key, tokens)['params']
  names = pretrained.gpt2_names(_headers(GPT2))
  params = zerojax.checkpoint.load_safetensors(GPT2, init, jax.random.key(0), tx=tx, names=names)
  model = pretrained.GPT2(cfg, tx)
  logits = jax.jit(lambda p: model.apply({'params': p}, tokens))(params)
  terms = cfg.n_layer * 5 * cfg.n_embd + cfg.n_embd
  np.testing.assert_allclose(
    np.asarray(logits), want['logits'], atol=reordered(terms) * np.abs(want['logits']).max(), rtol=0
  )
