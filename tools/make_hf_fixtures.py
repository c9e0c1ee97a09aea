"""Writes the tiny Hugging Face checkpoints the tests load, with Hugging Face's own outputs.

    python tools/make_hf_fixtures.py tests/data

Run once, in an environment with torch and transformers (not the project's: neither is a
dependency): `pip install torch==2.13.0 transformers tokenizers`. It builds a randomly
initialised BertForSequenceClassification and GPT2LMHeadModel of a few layers with
transformers' own classes, saves each with `save_pretrained` (safetensors, Hugging Face's
names and layouts), writes a WordPiece vocabulary for BERT and a byte-level BPE for GPT-2
(trained with `tokenizers` on a few sentences), and records the logits transformers computes
on fixed inputs in `expected.npz`: what zerojax's Flax models must reproduce from those files.
The Llama family's (`DECODERS`: Llama, Mistral, Qwen2, Qwen3) are made the same way with
`AutoModelForCausalLM`, for `zerojax.llama`.

`hf-tokenizers/` holds tokenizer folders written by transformers' `save_pretrained` after a
call with padding, truncation, both or neither (which transformers writes into tokenizer.json),
and the ids `AutoTokenizer` reads back from each on fixed texts (`expected.json`). They need
transformers and tokenizers only: `python tools/make_hf_fixtures.py tests/data --tokenizers`.

`peft-tiny-*/` hold LoRA adapters written by peft's own `save_pretrained` on the Llama, Qwen2
and Qwen3 fixtures above (their A and B drawn wide, so the adapter changes every logit), with
the logits `peft.PeftModel` computes on the base's tokens: `--peft` (needs `pip install peft`).
`bnb-nf4/` holds a weight quantized by bitsandbytes' own NF4 (`quantize_4bit`, blocks of 64,
with and without double quantization of the scales) and its dequantized values: `--bnb`
(needs `pip install bitsandbytes`; its CPU backend is enough).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

TEXT = [
  'The company said its shares rose by 5 percent on Monday.',
  'Shares of the company increased 5 percent on Monday, it stated.',
  'The court ruled against the minister in March.',
  'Analysts expect the team to win the final next year.',
  'Police acquired a rival firm last year, the report said.',
] * 20


def bert(out: str) -> None:
  import torch
  from transformers import BertConfig, BertForSequenceClassification

  os.makedirs(out, exist_ok=True)
  wordpiece = BertWordPieceTokenizer(lowercase=True)
  wordpiece.train_from_iterator(TEXT, vocab_size=120, min_frequency=1)
  wordpiece.save_model(out)  # vocab.txt
  # tokenizer.json (the tokenizers library's own file) and tokenizer_config.json, as a
  # published folder has them.
  BertWordPieceTokenizer(os.path.join(out, 'vocab.txt'), lowercase=True).save(
    os.path.join(out, 'tokenizer.json')  # with BERT's [CLS] a [SEP] b [SEP] post-processor
  )
  _json(out, 'tokenizer_config.json', {'do_lower_case': True, 'tokenizer_class': 'BertTokenizer'})
  vocab = sum(1 for _ in open(os.path.join(out, 'vocab.txt')))
  torch.manual_seed(0)
  config = BertConfig(
    vocab_size=vocab,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=2,
  )
  model = BertForSequenceClassification(config).eval()
  model.save_pretrained(out, safe_serialization=True)
  tokenizer = BertWordPieceTokenizer(os.path.join(out, 'vocab.txt'), lowercase=True)
  tokenizer.enable_truncation(max_length=48)
  tokenizer.enable_padding(length=48)
  encoded = tokenizer.encode_batch([(TEXT[0], TEXT[1]), (TEXT[2], TEXT[3])])
  ids = torch.tensor([e.ids for e in encoded])
  segments = torch.tensor([e.type_ids for e in encoded])
  mask = torch.tensor([e.attention_mask for e in encoded])
  with torch.no_grad():
    logits = model(input_ids=ids, token_type_ids=segments, attention_mask=mask).logits
  _expected(out, tokens=ids, segments=segments, mask=mask, logits=logits)


def gpt2(out: str) -> None:
  import torch
  from transformers import GPT2Config, GPT2LMHeadModel

  os.makedirs(out, exist_ok=True)
  bpe = ByteLevelBPETokenizer()
  bpe.train_from_iterator(TEXT, vocab_size=300, min_frequency=1)
  bpe.save_model(out)  # vocab.json, merges.txt
  bpe.save(os.path.join(out, 'tokenizer.json'))
  torch.manual_seed(0)
  config = GPT2Config(
    vocab_size=bpe.get_vocab_size(),
    n_positions=64,
    n_embd=32,
    n_layer=3,
    n_head=4,
    bos_token_id=0,
    eos_token_id=0,
  )
  model = GPT2LMHeadModel(config).eval()
  model.save_pretrained(out, safe_serialization=True)
  tokens = torch.tensor([bpe.encode(TEXT[0]).ids[:12], bpe.encode(TEXT[2]).ids[:12]])
  with torch.no_grad():
    logits = model(input_ids=tokens).logits
  _expected(out, tokens=tokens, logits=logits)


# The Llama family's fixtures: (folder, model_type, config changes). Together they hold each
# feature the decoder reads: head_dim apart from hidden / heads, llama3 and linear rope scaling,
# tied and untied heads, Mistral's sliding window, Qwen2's biases, Qwen3's q/k norms.
DECODERS = [
  ('hf-tiny-llama', 'llama', dict(head_dim=16, rope_theta=500000.0, rope_scaling={
    'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
    'original_max_position_embeddings': 16})),
  ('hf-tiny-llama-tied', 'llama', dict(tie_word_embeddings=True, attention_bias=True,
                                       rope_scaling={'rope_type': 'linear', 'factor': 2.0})),
  ('hf-tiny-mistral', 'mistral', dict(sliding_window=6)),
  ('hf-tiny-qwen2', 'qwen2', dict(tie_word_embeddings=True)),
  ('hf-tiny-qwen3', 'qwen3', dict(head_dim=16)),
]  # fmt: skip


def decoder(out: str, model_type: str, changes: dict) -> None:
  """A randomly initialised Llama-family model, its weights drawn wide (biases and norms too,
  which transformers' init leaves at 0 and 1), saved with `save_pretrained`, and its logits on
  fixed tokens."""
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM

  os.makedirs(out, exist_ok=True)
  torch.manual_seed(0)
  config = AutoConfig.for_model(
    model_type, vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-6, attn_implementation='eager', **changes,
  )  # fmt: skip
  model = AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.copy_(1 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  model.save_pretrained(out, safe_serialization=True)
  tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    logits = model(input_ids=tokens).logits
  _expected(out, tokens=tokens, logits=logits)


# Texts each saved tokenizer encodes, and the calls whose settings save_pretrained then writes
# into tokenizer.json (name: the call's keyword arguments).
TOKENIZER_TEXTS = ['the cat sat on the mat', 'Shares of the company increased 5 percent on Monday.']
TOKENIZER_CALLS = {
  'plain': {},
  'padded': dict(padding='max_length', max_length=16),
  'truncated': dict(truncation=True, max_length=4),
  'padded-truncated': dict(padding='max_length', truncation=True, max_length=8),
}


def tokenizers(out: str) -> None:
  """A byte-level BPE wrapped as transformers' fast tokenizer, called once with each of
  `TOKENIZER_CALLS`' settings and saved after it; the ids AutoTokenizer reads back from each
  folder with a plain call (no padding, no truncation asked for)."""
  from transformers import AutoTokenizer, PreTrainedTokenizerFast

  bpe = ByteLevelBPETokenizer()
  special = ['<pad>', '<|end|>']
  bpe.train_from_iterator(TEXT, vocab_size=300, min_frequency=1, special_tokens=special)
  expected = {}
  for name, call in TOKENIZER_CALLS.items():
    folder = os.path.join(out, name)
    tok = PreTrainedTokenizerFast(
      tokenizer_object=bpe._tokenizer, pad_token='<pad>', eos_token='<|end|>'
    )
    tok(TOKENIZER_TEXTS, **call)
    tok.save_pretrained(folder)
    with open(os.path.join(folder, 'tokenizer.json')) as f:
      saved = json.load(f)
    # The point of the fixture: the file keeps the call's settings.
    assert (saved['padding'] is not None) == ('padding' in call), (name, saved['padding'])
    assert (saved['truncation'] is not None) == ('truncation' in call), (name, saved['truncation'])
    read = AutoTokenizer.from_pretrained(folder)
    expected[name] = [read(t)['input_ids'] for t in TOKENIZER_TEXTS]
  with open(os.path.join(out, 'expected.json'), 'w') as f:
    json.dump({'texts': TOKENIZER_TEXTS, 'ids': expected}, f)


# The adapters' fixtures: (folder, base fixture, peft LoraConfig keywords). Together they hold
# every projection as a target, a subset, rsLoRA and a dropout rate (no effect in eval).
ADAPTERS = [
  ('peft-tiny-llama', 'hf-tiny-llama', dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=[
    'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'])),
  ('peft-tiny-qwen2', 'hf-tiny-qwen2', dict(r=8, lora_alpha=16, target_modules=['q_proj', 'v_proj'])),
  ('peft-tiny-qwen3', 'hf-tiny-qwen3', dict(r=4, lora_alpha=4, use_rslora=True, target_modules=[
    'q_proj', 'o_proj', 'up_proj', 'down_proj'])),
]  # fmt: skip


def adapter(out: str, base: str, lora: dict) -> None:
  """A LoRA adapter of the base fixture's model, made and saved by peft itself, A and B drawn
  wide; the logits peft's model gives on the base's tokens."""
  import torch
  from peft import LoraConfig, PeftModel, get_peft_model
  from transformers import AutoModelForCausalLM

  torch.manual_seed(2)
  model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(base, attn_implementation='eager'),
    LoraConfig(task_type='CAUSAL_LM', **lora),
  )
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'lora_' in name:
        p.copy_(0.3 * torch.randn_like(p))
  model.save_pretrained(out)
  tokens = torch.from_numpy(np.load(os.path.join(base, 'expected.npz'))['tokens'])
  reread = PeftModel.from_pretrained(
    AutoModelForCausalLM.from_pretrained(base, attn_implementation='eager'), out
  ).eval()
  with torch.no_grad():
    logits = reread(input_ids=tokens).logits
  _expected(out, tokens=tokens, logits=logits)


def nf4(out: str) -> None:
  """Weights quantized by bitsandbytes' NF4 (blocks of 64 of the row-major flattened (out, in)
  weight), with and without double quantization, and dequantized by it. 'weight' is (48, 128),
  rows a whole number of blocks as in every published model; 'unaligned' is (48, 80), blocks
  running across rows, recorded quantized only: bitsandbytes 0.50.2's CPU `dequantize_4bit`
  places the scales by row there (its packed codes and scales are the same either way)."""
  import torch
  from bitsandbytes import functional as F

  os.makedirs(out, exist_ok=True)
  torch.manual_seed(3)
  w = torch.randn(48, 128) * 0.05
  w[3, 7], w[40, 70] = 1.5, -2.0  # outliers in two blocks
  arrays = {'weight': w, 'unaligned': torch.randn(48, 80) * 0.05}
  for name, double in (('single', False), ('double', True)):
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type='nf4', compress_statistics=double)
    arrays[f'{name}_packed'] = packed
    arrays[f'{name}_dequantized'] = F.dequantize_4bit(packed, state)
    arrays[f'{name}_absmax'] = state.absmax
    if double:
      arrays['double_offset'] = state.offset.reshape(1)
      arrays['double_absmax2'] = state.state2.absmax
      arrays['double_code2'] = state.state2.code
  packed, state = F.quantize_4bit(arrays['unaligned'], blocksize=64, quant_type='nf4')
  arrays['unaligned_packed'], arrays['unaligned_absmax'] = packed, state.absmax
  arrays['code'] = F.get_4bit_type('nf4', device='cpu')
  _expected(out, **arrays)


def _json(out: str, name: str, value: dict) -> None:
  with open(os.path.join(out, name), 'w') as f:
    json.dump(value, f, indent=2)


def _expected(out: str, **arrays) -> None:
  np.savez(os.path.join(out, 'expected.npz'), **{k: np.asarray(v) for k, v in arrays.items()})


if __name__ == '__main__':
  args = [a for a in sys.argv[1:] if not a.startswith('--')]
  root = args[0] if args else 'tests/data'
  if '--peft' in sys.argv:
    for folder, base, lora in ADAPTERS:
      adapter(os.path.join(root, folder), os.path.join(root, base), lora)
  if '--bnb' in sys.argv:
    nf4(os.path.join(root, 'bnb-nf4'))
  if '--peft' in sys.argv or '--bnb' in sys.argv:
    sys.exit(0)
  tokenizers(os.path.join(root, 'hf-tokenizers'))
  if '--tokenizers' in sys.argv:
    sys.exit(0)
  bert(os.path.join(root, 'hf-tiny-bert'))
  gpt2(os.path.join(root, 'hf-tiny-gpt2'))
  for folder, model_type, changes in DECODERS:
    decoder(os.path.join(root, folder), model_type, changes)
