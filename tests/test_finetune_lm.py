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


def test_packed_rows_weigh_each_completion_and_count_real_tokens(chats_file):
  text, conversations = _text(None)
  alone = finetune_lm.tokenize(text, conversations[:12], 40)
  packed = finetune_lm.tokenize(text, conversations[:12], 40, pack=True)
  assert len(packed['tokens']) < 12 and packed['tokens'].shape[1] == 41
  # The same real tokens and the same weighted targets as the examples one per row.
  assert packed['real'].sum() == alone['real'].sum()
  assert packed['weights'].sum() == alone['weights'].sum()
  decode = lambda ids: text.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
  targets = lambda a: ''.join(decode(t[1:][w == 1]) for t, w in zip(a['tokens'], a['weights']))
  assert targets(packed) == targets(alone)
  # No target is the first token of another example than its input's.
  seg = packed['segment_ids']
  assert not np.any(packed['weights'] * (seg[:, 1:] != seg[:, :-1]))


def _qwen_folder(tmp_path):
  text, _ = _text(None)
  folder = tmp_path / 'base'
  config = small_config('qwen2', vocab_size=text.tokenizer.get_vocab_size())
  write_checkpoint(folder, config, random_tensors(config))
  text.tokenizer.save(str(folder / 'tokenizer.json'))
  (folder / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|end|>'}))
  return folder


def test_qlora_on_packed_rows_trains_the_adapters_alike_at_every_stage_and_exports_them(
  chats_file, tmp_path
):
  folder, out, adapter = _qwen_folder(tmp_path), tmp_path / 'out', tmp_path / 'adapter'
  argv = ['--pretrained', str(folder), '--data', chats_file, '--compare', '--steps', '3',
          '--batch', '8', '--seq-len', '32', '--lora', '4', '--qlora', 'nf4', '--pack',
          '--lr', '1e-2', '--out', str(out), '--export', str(adapter)]  # fmt: skip
  assert finetune_lm.main(argv) == 0
  rows = json.loads((out / 'finetune_lm_stages.json').read_text())['stages']
  losses = np.array([[loss for _, loss in r['losses']] for r in rows])
  np.testing.assert_allclose(losses, losses[:1].repeat(4, 0), rtol=2e-5)
  assert losses[0, -1] < losses[0, 0]
  assert all(r['tokens_per_second'] > 0 for r in rows)
  args = finetune_lm.parser().parse_args(argv)
  cfg, _, data, _, _ = finetune_lm.prepare(args)
  # Gradients of the adapters alone, f32: whole at stages 0 and 1, an eighth from stage 2.
  shapes = jax.eval_shape(lambda: zerojax.llama.init(cfg, jax.random.key(0)))
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  adapters = sum(x.size for path, x in leaves if zerojax.llama.is_adapter(path))
  assert [r['grads_bytes'] for r in rows[:2]] == [4 * adapters] * 2
  assert all(r['grads_bytes'] <= 4 * adapters / 8 + 4 * 64 for r in rows[2:])
  # The exported adapter (stage 3's), over the same base, gives the run's held-out loss.
  assert sorted(os.listdir(adapter)) == ['adapter_config.json', 'adapter_model.safetensors']
  tx = zerojax.zero_stage(optax.sgd(0.1), 3, mesh=jax.make_mesh((8,), ('data',)),
                          stacked={'layers': True}, trainable=zerojax.llama.is_adapter)  # fmt: skip
  params, got_cfg = zerojax.llama.load(folder, tx, cfg=cfg, adapter=adapter, base_dtype='nf4')
  assert got_cfg.lora == cfg.lora
  plan = zerojax.plan_for(tx, params)
  held = finetune_lm.evaluate(params, data['heldout'], cfg, plan, args, jnp.float32)
  assert held['heldout_loss'] == pytest.approx(rows[3]['heldout_loss'], rel=1e-5)


def test_lora_merged_export_reads_back_without_adapters(chats_file, tmp_path):
  argv = ['--data', chats_file, '--steps', '2', '--batch', '8', '--seq-len', '32', '--vocab',
          '300', '--lora', '2', '--merge', '--export', str(tmp_path / 'merged')]  # fmt: skip
  assert finetune_lm.main(argv) == 0
  tensors = load_file(str(tmp_path / 'merged' / 'model.safetensors'))
  assert (
    not [k for k in tensors if 'lora' in k] and 'model.layers.0.self_attn.q_proj.weight' in tensors
  )
  with pytest.raises(SystemExit, match='give --lora R too'):
    finetune_lm.main(['--qlora', 'nf4', '--steps', '1'])
