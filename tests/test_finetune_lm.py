"""examples/finetune_lm.py: conversations in both JSONL shapes, the completion-only weights with
and without a chat template, every stage training to the same losses, and the exported folder
read back (its logits against the numpy reference of tests/_llama_reference.py)."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _llama_reference import logits as reference_logits
from _llama_reference import random_tensors, small_config, write_checkpoint
from safetensors.numpy import load_file

import zerojax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples'))
import finetune_lm  # noqa: E402

# A ChatML template of the shape Qwen's checkpoints publish (written here).
CHATML = (
  '{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}'
  '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}'
)
CHATS = [
  {'messages': [{'role': 'user', 'content': f'What is {i} plus {i}?'},
                {'role': 'assistant', 'content': f'{i} plus {i} is {2 * i}.'}]}
  for i in range(40)
] + [{'prompt': f'Name the number after {i}.', 'completion': f'It is {i + 1}.'} for i in range(40)]  # fmt: skip


def _jsonl(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


def test_both_jsonl_shapes_are_read_and_bad_lines_are_named(tmp_path):
  got = finetune_lm.read_examples(_jsonl(tmp_path / 'a.jsonl', CHATS[39:41]))
  assert got[1] == [
    {'role': 'user', 'content': 'Name the number after 0.'},
    {'role': 'assistant', 'content': 'It is 1.'},
  ]
  bad = _jsonl(tmp_path / 'b.jsonl', [CHATS[0], {'question': 'q'}])
  with pytest.raises(ValueError) as err:
    finetune_lm.read_examples(bad)
  assert str(err.value) == (
    f'{bad}:2: expected {{"prompt", "completion"}} or {{"messages": [...]}}, got keys'
    " ['question']."
  )
  last = _jsonl(tmp_path / 'c.jsonl', [{'messages': [{'role': 'user', 'content': 'hi'}]}])
  with pytest.raises(ValueError, match=r"c.jsonl:1: the last message must be the assistant's"):
    finetune_lm.read_examples(last)


TOKENIZERS = os.path.join(os.path.dirname(__file__), 'data', 'hf-tokenizers')


@pytest.mark.parametrize('saved', ['plain', 'padded', 'truncated', 'padded-truncated'])
def test_a_tokenizer_file_reads_as_transformers_reads_it(saved):
  # tools/make_hf_fixtures.py: transformers saved each folder after a call with that padding
  # and truncation (written into tokenizer.json), and recorded AutoTokenizer's ids.
  expected = json.load(open(os.path.join(TOKENIZERS, 'expected.json')))
  folder = os.path.join(TOKENIZERS, saved)
  assert (json.load(open(os.path.join(folder, 'tokenizer.json')))['padding'] is None) == (
    'padded' not in saved
  )
  text = finetune_lm.checkpoint_text(folder)
  got = [text.tokenizer.encode(t).ids for t in expected['texts']]
  assert got == expected['ids'][saved]
  pad = text.tokenizer.token_to_id('<pad>')
  ids, weights = text.encode(
    [
      {'role': 'user', 'content': expected['texts'][0]},
      {'role': 'assistant', 'content': expected['texts'][1]},
    ]
  )
  assert pad not in ids and len(ids) == len(weights)
  assert ids[: len(got[0])] == got[0]


def _text(template):
  conversations = finetune_lm.read_examples(CHATS_FILE)
  text = finetune_lm.trained_text(conversations, 300)
  return finetune_lm.Text(text.tokenizer, template, text.eos), conversations


@pytest.fixture(scope='module')
def chats_file(tmp_path_factory):
  global CHATS_FILE
  CHATS_FILE = _jsonl(tmp_path_factory.mktemp('chats') / 'chats.jsonl', CHATS)
  return CHATS_FILE


@pytest.mark.parametrize('template', [None, CHATML])
def test_only_the_completion_is_weighted(chats_file, template):
  text, conversations = _text(template)
  if template:  # as a chat checkpoint's tokenizer has them: one token each
    text.tokenizer.add_special_tokens(['<|im_start|>', '<|im_end|>'])
  arrays = finetune_lm.tokenize(text, conversations[:2], 40)
  decode = lambda ids: text.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
  tokens, weights = arrays['tokens'][0], arrays['weights'][0]
  weighted = decode(tokens[1:][weights == 1])
  # The answer and the end of it, nothing of the question, no padding.
  want = '0 plus 0 is 0.<|im_end|>\n' if template else '0 plus 0 is 0.<|end|>'
  assert weighted.replace(' ', '') == want.replace(' ', '')
  if template:
    assert decode(tokens).startswith('<|im_start|>user\nWhat is 0 plus 0?<|im_end|>')
  assert weights.shape == (40,) and weights.sum() < 20


def test_every_stage_trains_to_the_same_losses_and_writes_the_comparison(chats_file, tmp_path):
  out = tmp_path / 'out'
  argv = ['--data', chats_file, '--compare', '--steps', '3', '--batch', '8', '--seq-len', '32',
          '--vocab', '300', '--out', str(out), '--export', str(tmp_path / 'tuned')]  # fmt: skip
  assert finetune_lm.main(argv) == 0
  record = json.loads((out / 'finetune_lm_stages.json').read_text())
  rows = record['stages']
  assert [r['stage'] for r in rows] == [0, 1, 2, 3]
  losses = np.array([[loss for _, loss in r['losses']] for r in rows])
  np.testing.assert_allclose(losses, losses[:1].repeat(4, 0), rtol=2e-5)
  held = np.array([r['heldout_loss'] for r in rows])
  np.testing.assert_allclose(held, held[0], rtol=2e-5)
  assert rows[0]['heldout_perplexity'] == pytest.approx(np.exp(rows[0]['heldout_loss']))
  # ZeRO's saving: states at rest per device fall from stage 0 to stage 3.
  rest = [r['states_at_rest_bytes'] for r in rows]
  assert rest[0] > rest[1] > rest[3]
  assert (out / 'finetune_lm_stages.png').stat().st_size > 0
  # The exported stage-3 model: the Llama family's names, read back to the reference's logits.
  folder = tmp_path / 'tuned'
  config = json.loads((folder / 'config.json').read_text())
  tensors = load_file(str(folder / 'model.safetensors'))
  assert config['model_type'] == 'llama' and 'model.layers.3.mlp.down_proj.weight' in tensors
  mesh = jax.make_mesh((8,), ('data',))
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=mesh, stacked={'layers': True})
  params, cfg = zerojax.llama.load(folder, tx)
  tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % cfg.vocab
  plan = zerojax.plan_for(tx, params)
  got = zerojax.llama.logits(params, jnp.asarray(tokens), cfg, plan=plan, compute_dtype=jnp.float32)
  want = reference_logits(tensors, config, tokens)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_a_published_folder_fine_tunes_with_its_tokenizer_and_chat_template(chats_file, tmp_path):
  text, _ = _text(None)
  folder = tmp_path / 'qwen'
  config = small_config(
    'qwen2', vocab_size=text.tokenizer.get_vocab_size(), tie_word_embeddings=True
  )
  write_checkpoint(folder, config, random_tensors(config))
  text.tokenizer.add_special_tokens(['<|im_start|>', '<|im_end|>'])
  assert text.tokenizer.get_vocab_size() <= config['vocab_size'] + 2
  config['vocab_size'] = text.tokenizer.get_vocab_size()
  write_checkpoint(folder, config, random_tensors(config))
  text.tokenizer.save(str(folder / 'tokenizer.json'))
  (folder / 'tokenizer_config.json').write_text(
    json.dumps({'chat_template': CHATML, 'eos_token': '<|im_end|>'})
  )
  loaded = finetune_lm.checkpoint_text(str(folder))
  assert loaded.template == CHATML and loaded.eos == '<|im_end|>'
  argv = ['--pretrained', str(folder), '--data', chats_file, '--steps', '3', '--batch', '8',
          '--seq-len', '32', '--stage', '3', '--remat', 'minimal', '--export', str(tmp_path / 'o')]  # fmt: skip
  assert finetune_lm.main(argv) == 0
  exported = sorted(os.listdir(tmp_path / 'o'))
  assert exported == ['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
  assert 'lm_head.weight' not in load_file(str(tmp_path / 'o' / 'model.safetensors'))  # tied
