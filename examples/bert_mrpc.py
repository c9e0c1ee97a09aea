"""BERT-style encoder for sentence pairs on the GLUE MRPC TSV format, trained with zerojax.

Reads msr_paraphrase_train.txt / train.tsv (columns: Quality, #1 ID, #2 ID,
#1 String, #2 String) from --data and holds out its last 10%. Without --data
it trains on SYNTHETIC pairs: short news-like sentences where a paraphrase
swaps the verb for its synonym and a non-paraphrase is another sentence from
the same words, with 10% of the labels flipped at random, so held-out
accuracy cannot exceed about 90%. They are written in MRPC format to a
temporary folder, read back through the same reader, and the folder removed.
Byte-level tokens, so no vocabulary is downloaded:
[CLS] sentence-1 bytes [SEP] sentence-2 bytes [SEP].

  python examples/bert_mrpc.py --stage 3 --data ~/glue/MRPC/train.tsv
  python examples/bert_mrpc.py --compare --steps 200    # stages 0-3 side by side
"""

from __future__ import annotations

import csv
import dataclasses
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
)


if __name__ == '__main__':
  sys.exit(main(None, TASK))
