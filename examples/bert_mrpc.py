"""BERT-style encoder for sentence pairs on the GLUE MRPC TSV format, trained with zerojax.

Reads msr_paraphrase_train.txt / train.tsv (columns: Quality, #1 ID, #2 ID,
#1 String, #2 String) from --data and holds out its last 10%. Without --data
it trains on SYNTHETIC pairs: short news-like sentences where a paraphrase
swaps the verb for its synonym and a non-paraphrase is another sentence from
the same words, with 10% of the labels flipped at random, so held-out
accuracy cannot exceed about 90%. They are written in MRPC format to a
temporary folder, read back through the same reader, and the folder removed.
From scratch (the default) it trains a small pre-LayerNorm encoder on byte-level tokens, so
no vocabulary is downloaded: [CLS] sentence-1 bytes [SEP] sentence-2 bytes [SEP].

With --pretrained DIR (a Hugging Face BERT folder: config.json, model.safetensors or its
shards, vocab.txt or tokenizer.json) it fine-tunes that BERT, of any size: the architecture is
built from config.json (examples/pretrained.py), the weights are read straight into the stage's
layout by zerojax.checkpoint.load_safetensors (the classification head is new unless the
checkpoint has one), and the pairs are tokenized with the checkpoint's WordPiece vocabulary
through the `tokenizers` library ([CLS] a [SEP] b [SEP], segment ids, attention mask).
Held-out accuracy and F1 are MRPC's GLUE metrics; --heldout takes MRPC's dev.tsv.

  python examples/bert_mrpc.py --stage 3 --data ~/glue/MRPC/train.tsv
  python examples/bert_mrpc.py --compare --steps 200    # stages 0-3 side by side
  python examples/bert_mrpc.py --pretrained ~/bert-base-uncased --data ~/glue/MRPC/train.tsv \\
      --heldout ~/glue/MRPC/dev.tsv --steps 350 --compare
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pretrained  # noqa: E402
from common import Data, Task, main, split_heldout  # noqa: E402
from flax import linen as nn  # noqa: E402

import zerojax  # noqa: E402

HEADER = ['Quality', '#1 ID', '#2 ID', '#1 String', '#2 String']
PAD, CLS, SEP, OFFSET = 0, 1, 2, 3  # byte b is token b + OFFSET


@dataclasses.dataclass(frozen=True)
class Config:
  max_len: int = 96
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  vocab: int = 256 + OFFSET + 5  # bytes, specials, and padding to a multiple of 8


def read_mrpc(path: str) -> list[tuple[int, str, str]]:
  """Reads (label, sentence 1, sentence 2) rows of an MRPC TSV file.

  Raises:
    ValueError: naming the file and line of a malformed row.
  """
  rows = []
  with open(path, encoding='utf-8-sig', newline='') as f:
    reader = csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE)
    header = next(reader, None)
    if header != HEADER:
      raise ValueError(f'{path}: line 1 must be the MRPC header {HEADER}, got {header}')
    for line, row in enumerate(reader, start=2):
      if len(row) != 5 or row[0] not in ('0', '1'):
        raise ValueError(
          f'{path}: line {line}: expected 5 tab-separated fields with label 0 or 1, got {row[:5]}'
        )
      rows.append((int(row[0]), row[3], row[4]))
  if not rows:
    raise ValueError(f'{path}: no rows')
  return rows


SUBJECTS = ['the company', 'the court', 'shares', 'the minister', 'analysts', 'the team', 'police']
VERBS = {
  'said': 'stated',
  'rose': 'increased',
  'fell': 'dropped',
  'bought': 'acquired',
  'won': 'secured',
}
OBJECTS = ['on monday', 'in march', 'by 5 percent', 'a rival firm', 'the final', 'last year']


LABEL_NOISE = 0.1


def write_synthetic_mrpc(path: str, n: int = 1024, seed: int = 0) -> None:
  """Writes n sentence pairs in MRPC TSV format: a rule (is it a synonym swap?) plus noise.

  Half are paraphrases (the verb replaced by its synonym); in the other half
  the second sentence is drawn afresh (same words, another combination). Then
  10% of the labels are flipped.
  """
  rng = np.random.default_rng(seed)
  verbs = list(VERBS)
  with open(path, 'w', encoding='utf-8', newline='') as f:
    f.write('\t'.join(HEADER) + '\n')
    for i in range(n):
      s, v, o = rng.choice(SUBJECTS), rng.choice(verbs), rng.choice(OBJECTS)
      s2, v2, o2 = s, VERBS[v], o
      label = 1
      if i % 2:  # another sentence, drawn afresh until it differs
        while (s2, v2) == (s, VERBS[v]) and o2 == o:
          s2, v2, o2 = rng.choice(SUBJECTS), VERBS[rng.choice(verbs)], rng.choice(OBJECTS)
        label = 0
      if rng.random() < LABEL_NOISE:
        label = 1 - label
      f.write(f'{label}\t{2 * i}\t{2 * i + 1}\t{s} {v} {o}\t{s2} {v2} {o2}\n')


def encode(rows, max_len: int) -> dict[str, np.ndarray]:
  """Byte-level pair encoding: token ids, segment ids, and labels."""
  tokens = np.full((len(rows), max_len), PAD, np.int32)
  segments = np.zeros((len(rows), max_len), np.int32)
  for i, (_, a, b) in enumerate(rows):
    ta = [CLS] + [c + OFFSET for c in a.encode()] + [SEP]
    tb = [c + OFFSET for c in b.encode()] + [SEP]
    ids = (ta + tb)[:max_len]
    tokens[i, : len(ids)] = ids
    segments[i, len(ta) : len(ids)] = 1
  return {'tokens': tokens, 'segments': segments, 'label': np.array([r[0] for r in rows], np.int32)}


class EncoderBlock(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, mask):
    b, t, d = x.shape
    h = nn.LayerNorm()(x)
    qkv = nn.Dense(3 * d)(h).reshape(b, t, 3, self.cfg.n_heads, d // self.cfg.n_heads)
    attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask=mask)
    x = x + nn.Dense(d)(attn.reshape(b, t, d))
    return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x)))), None


class Encoder(nn.Module):
  """Scanned, rematerialised blocks that gather their own ZeRO-3 shards."""

  cfg: Config
  zero: object = None  # the optimizer from zerojax.zero_stage: the axes to gather over

  @nn.compact
  def __call__(self, tokens, segments):
    cfg = self.cfg
    g = lambda cls: zerojax.linen.gathered(cls, self.zero)
    x = g(nn.Embed)(cfg.vocab, cfg.d_model, name='tokens')(tokens)
    x = x + g(nn.Embed)(8, cfg.d_model, name='segments')(segments)
    pos = self.param('pos', nn.initializers.normal(0.02), (cfg.max_len, cfg.d_model))
    x = x + zerojax.gather(pos, self.zero)[: tokens.shape[1]]
    mask = (tokens != PAD)[:, None, None, :]  # (batch, heads, query, key)
    block = nn.remat(g(EncoderBlock), prevent_cse=False)
    x, _ = nn.scan(
      block,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      in_axes=nn.broadcast,
      length=cfg.n_layers,
    )(cfg, name='blocks')(x, mask)
    return g(nn.Dense)(8, name='classifier')(g(nn.LayerNorm)(name='final_norm')(x[:, 0]))


def load(path: str | None) -> Data:
  """MRPC pairs from `path` (last 10% held out), or synthetic pairs through a removed temp folder."""
  max_len = Config().max_len
  if path is None:
    with tempfile.TemporaryDirectory(prefix='mrpc_synthetic_') as tmp:
      train, heldout = os.path.join(tmp, 'train.tsv'), os.path.join(tmp, 'heldout.tsv')
      write_synthetic_mrpc(train, n=2048, seed=0)
      write_synthetic_mrpc(heldout, n=512, seed=1)
      train, heldout = read_mrpc(train), read_mrpc(heldout)
    source = (
      'SYNTHETIC sentence pairs (synonym swap or another sentence, 10% flipped labels:'
      ' the best possible held-out accuracy is about 90%)'
    )
    return Data(encode(train, max_len), encode(heldout, max_len), source, synthetic=True)
  train, heldout = split_heldout(encode(read_mrpc(path), max_len))
  return Data(train, heldout, f'{path} (last 10% held out)', synthetic=False)


def logits_and_labels(apply_fn, params, batch):
  logits = apply_fn({'params': params}, batch['tokens'], batch['segments'])[:, :2]
  return logits, batch['label']


TASK = Task(
  name='mrpc',
  doc=__doc__,
  data_help='an MRPC TSV file (default: synthetic pairs)',
  load=load,
  model=lambda tx: Encoder(Config(), tx),
  init_inputs=lambda data: {
    'tokens': jnp.zeros((1, Config().max_len), jnp.int32),
    'segments': jnp.zeros((1, Config().max_len), jnp.int32),
  },
  logits_and_labels=logits_and_labels,
  tx=lambda: optax.adamw(optax.linear_schedule(0.0, 3e-3, 30)),  # 30 steps of warm-up
  batch=32,
  f1=True,
)


# --- Fine-tuning a published BERT (--pretrained).


def wordpiece(folder: str, max_len: int, lowercase: bool | None = None):
  """The checkpoint's WordPiece tokenizer (`tokenizers`), encoding pairs as
  [CLS] a [SEP] b [SEP], truncated and padded to `max_len`.

  tokenizer.json, where the folder has it, is the tokenizer as published. Otherwise
  vocab.txt, lowercased as tokenizer_config.json's `do_lower_case` says, or as `lowercase`.

  Raises:
    ValueError: neither file, nor `lowercase`, says whether to lowercase.
  """
  from tokenizers import Tokenizer
  from tokenizers.implementations import BertWordPieceTokenizer

  if os.path.exists(os.path.join(folder, 'tokenizer.json')) and lowercase is None:
    tok = Tokenizer.from_file(os.path.join(folder, 'tokenizer.json'))
  else:
    vocab = os.path.join(folder, 'vocab.txt')
    if not os.path.exists(vocab):
      raise FileNotFoundError(f'{folder} has neither tokenizer.json nor vocab.txt.')
    if lowercase is None:
      config = os.path.join(folder, 'tokenizer_config.json')
      lowercase = json.load(open(config)).get('do_lower_case') if os.path.exists(config) else None
    if lowercase is None:
      raise ValueError(
        f'{folder}: nothing says whether its vocabulary is lowercased (no tokenizer.json, no'
        ' do_lower_case in tokenizer_config.json): pass --lowercase or --no-lowercase.'
      )
    tok = BertWordPieceTokenizer(vocab, lowercase=lowercase)
  probe = tok.encode('a', 'b')
  cls, sep = tok.token_to_id('[CLS]'), tok.token_to_id('[SEP]')
  if probe.ids[:1] != [cls] or probe.ids.count(sep) != 2:
    raise ValueError(
      f'{folder}: its tokenizer does not encode a pair as [CLS] a [SEP] b [SEP] (it gave'
      f' {probe.tokens}); pass --lowercase or --no-lowercase to build it from vocab.txt.'
    )
  tok.enable_truncation(max_length=max_len)
  tok.enable_padding(length=max_len, pad_id=tok.token_to_id('[PAD]'), pad_token='[PAD]')
  return tok


def encode_wordpiece(rows, tok) -> dict[str, np.ndarray]:
  """Token ids, segment ids, attention mask and labels of MRPC rows."""
  encoded = tok.encode_batch([(a, b) for _, a, b in rows])
  arrays = lambda field: np.array([getattr(e, field) for e in encoded], np.int32)
  return {
    'tokens': arrays('ids'),
    'segments': arrays('type_ids'),
    'mask': arrays('attention_mask'),
    'label': np.array([r[0] for r in rows], np.int32),
  }


def load_rows(path: str | None, heldout: str | None):
  """(train rows, held-out rows, description): MRPC files, or synthetic pairs."""
  if path is None:
    with tempfile.TemporaryDirectory(prefix='mrpc_synthetic_') as tmp:
      write_synthetic_mrpc(os.path.join(tmp, 'train.tsv'), n=2048, seed=0)
      write_synthetic_mrpc(os.path.join(tmp, 'heldout.tsv'), n=512, seed=1)
      rows = read_mrpc(os.path.join(tmp, 'train.tsv')), read_mrpc(os.path.join(tmp, 'heldout.tsv'))
    return (
      *rows,
      'SYNTHETIC sentence pairs (synonym swap or another sentence, 10% flipped labels)',
    )
  rows = read_mrpc(path)
  if heldout is not None:
    return rows, read_mrpc(heldout), f'{path}, held out: {heldout}'
  cut = len(rows) - max(1, len(rows) // 10)
  return rows[:cut], rows[cut:], f'{path} (last 10% held out)'


def pretrained_task(
  folder: str, *, max_len: int, heldout: str | None, steps: int, lowercase=None, lr: float = 2e-5
) -> Task:
  """The MRPC task for a published BERT in `folder`."""
  cfg = pretrained.BertConfig.from_folder(folder, num_labels=2)
  if max_len > cfg.max_position_embeddings:
    raise ValueError(
      f"--max-len {max_len} exceeds the model's {cfg.max_position_embeddings} positions."
    )
  tok = wordpiece(folder, max_len, lowercase)

  def load(path):
    train, held, source = load_rows(path, heldout)
    return Data(
      encode_wordpiece(train, tok), encode_wordpiece(held, tok), source, synthetic=path is None
    )

  def init_params(tx, init_fn, key):
    headers = zerojax.checkpoint.read_tensor_names(folder)
    fresh = [] if 'classifier.weight' in headers else ['classifier/*']
    return zerojax.checkpoint.load_safetensors(
      folder,
      init_fn,
      key,
      tx=tx,
      names=pretrained.bert_names(headers),
      skip=pretrained.BERT_UNUSED,
      init=fresh,
    )

  zeros = jnp.zeros((1, max_len), jnp.int32)
  return dataclasses.replace(
    TASK,
    name='mrpc_pretrained',
    load=load,
    model=lambda tx: pretrained.Bert(cfg, tx),
    init_inputs=lambda data: {'tokens': zeros, 'segments': zeros, 'mask': zeros.astype(bool)},
    logits_and_labels=lambda apply_fn, params, batch: (
      apply_fn({'params': params}, batch['tokens'], batch['segments'], batch['mask'].astype(bool)),
      batch['label'],
    ),
    # BERT's fine-tuning recipe: AdamW, a linear warm-up over the first 10% of the steps,
    # then a linear decay to zero.
    tx=lambda: optax.adamw(_warmup_decay(lr, steps), weight_decay=0.01),
    init_params=init_params,
  )


def _warmup_decay(peak: float, steps: int):
  warmup = max(1, steps // 10)
  return optax.join_schedules(
    [optax.linear_schedule(0.0, peak, warmup), optax.linear_schedule(peak, 0.0, steps - warmup)],
    [warmup],
  )


def add_arguments(parser) -> None:
  parser.add_argument('--pretrained', default=None, help='a Hugging Face BERT folder to fine-tune')
  parser.add_argument(
    '--heldout', default=None, help="MRPC's dev.tsv (default: last 10%% of --data)"
  )
  parser.add_argument('--max-len', type=int, default=128, help='--pretrained: tokens per pair')
  parser.add_argument('--lr', type=float, default=2e-5, help='--pretrained: peak learning rate')
  parser.add_argument(
    '--lowercase',
    action=argparse.BooleanOptionalAction,
    default=None,
    help='--pretrained: lowercase before WordPiece (default: as the folder says)',
  )


def configure(task: Task, args) -> tuple[Task, dict]:
  if args.pretrained is None:
    if args.heldout is not None:
      raise SystemExit('--heldout is for --pretrained runs (the from-scratch run holds out 10%).')
    return task, {}
  task = pretrained_task(
    args.pretrained,
    max_len=args.max_len,
    heldout=args.heldout,
    steps=args.steps,
    lowercase=args.lowercase,
    lr=args.lr,
  )
  return task, {'stacked': {'layers': True}}


if __name__ == '__main__':
  sys.exit(main(None, TASK, add_arguments=add_arguments, configure=configure))
