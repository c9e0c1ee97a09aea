"""BERT-style encoder for sentence pairs on the GLUE MRPC TSV format, trained with zerojax.

Reads msr_paraphrase_train.txt / train.tsv (columns: Quality, #1 ID, #2 ID,
#1 String, #2 String) from --data; without it, writes a small synthetic sample
in the same format to a temporary file. Byte-level tokens, so no vocabulary
is downloaded: [CLS] sentence-1 bytes [SEP] sentence-2 bytes [SEP].

  python examples/bert_mrpc.py --stage 3 --data ~/glue/MRPC/train.tsv
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
from common import example_main, make_mesh, random_batches, train  # noqa: E402
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


def write_synthetic_mrpc(path: str, n: int = 1024, seed: int = 0) -> None:
  """Writes n sentence pairs in MRPC TSV format: half paraphrases (synonym swaps)."""
  rng = np.random.default_rng(seed)
  verbs = list(VERBS)
  with open(path, 'w', encoding='utf-8', newline='') as f:
    f.write('\t'.join(HEADER) + '\n')
    for i in range(n):
      s, v, o = rng.choice(SUBJECTS), rng.choice(verbs), rng.choice(OBJECTS)
      first = f'{s} {v} {o}'
      if i % 2 == 0:
        label, second = 1, f'{s} {VERBS[v]} {o}'
      else:
        label, second = 0, f'{rng.choice(SUBJECTS)} {rng.choice(verbs)} {rng.choice(OBJECTS)}'
        if second == first:
          label = 1
      f.write(f'{label}\t{2 * i}\t{2 * i + 1}\t{first}\t{second}\n')


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
  mesh: object = None

  @nn.compact
  def __call__(self, tokens, segments):
    cfg = self.cfg
    g = lambda cls: zerojax.gathered_linen(cls, mesh=self.mesh)
    x = g(nn.Embed)(cfg.vocab, cfg.d_model, name='tokens')(tokens)
    x = x + g(nn.Embed)(8, cfg.d_model, name='segments')(segments)
    pos = self.param('pos', nn.initializers.normal(0.02), (cfg.max_len, cfg.d_model))
    x = x + zerojax.gather_leaves(pos, mesh=self.mesh)[: tokens.shape[1]]
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


def loss_fn(apply_fn, params, batch):
  logits = apply_fn({'params': params}, batch['tokens'], batch['segments'])[:, :2]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()


def run(
  *,
  stage: int,
  steps: int,
  data: str | None = None,
  batch: int = 32,
  quiet: bool = False,
  checkpoint_dir: str | None = None,
) -> dict:
  if data is None:
    data = os.path.join(tempfile.mkdtemp(prefix='mrpc_synthetic_'), 'train.tsv')
    write_synthetic_mrpc(data)
  cfg = Config()
  encoded = encode(read_mrpc(data), cfg.max_len)
  mesh = make_mesh()
  batch_at = random_batches(encoded, batch)

  return train(
    model=Encoder(cfg, mesh),
    init_inputs={
      'tokens': jnp.zeros((1, cfg.max_len), jnp.int32),
      'segments': jnp.zeros((1, cfg.max_len), jnp.int32),
    },
    init_batch=batch_at(0),
    loss_fn=loss_fn,
    batch_at=batch_at,
    stage=stage,
    steps=steps,
    tx=optax.adamw(1e-3),
    name='mrpc',
    log_every=5,
    quiet=quiet,
    mesh=mesh,
    checkpoint_dir=checkpoint_dir,
  )


def main(argv=None) -> int:
  return example_main(
    argv,
    doc=__doc__,
    name='mrpc',
    run=run,
    data_help='an MRPC TSV file (default: a synthetic sample)',
  )


if __name__ == '__main__':
  sys.exit(main())
