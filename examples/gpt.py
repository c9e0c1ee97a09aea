"""GPT-style byte-level language model trained with zerojax (the main example).

Scanned transformer blocks; under stage 3 each block gathers its own parameter
shards inside the layer loop (zerojax.linen.gathered) and, rematerialised, drops
them after use. Trains on any text file (--data), or by default on the
docstrings of Python's standard library, gathered at run time: real text, not
synthetic. The last 5% of the text is held out; the held-out figures are the
loss and the accuracy of predicting each next byte.

  python examples/gpt.py --stage 3 --steps 200
  python examples/gpt.py --compare --steps 100    # stages 0-3 side by side

Preempted and resumed elsewhere: SIGTERM saves the next step and exits with 143;
the same folder then resumes on any device count and stage, the same run
(data position, dropout keys and micro-batch size carried over):

  python examples/gpt.py --stage 2 --dropout 0.1 --micro-batches 2 --checkpoint-dir ckpt \
      --save-on-preemption
  python examples/gpt.py --stage 3 --dropout 0.1 --devices 4 --checkpoint-dir ckpt

With --pretrained DIR (a Hugging Face GPT-2 folder: config.json, model.safetensors or its
shards, tokenizer.json or vocab.json + merges.txt) it fine-tunes that GPT-2, of any size, on the
same text tokenized with the checkpoint's byte-level BPE (`tokenizers`): the architecture from
config.json (examples/pretrained.py), the weights read straight into the stage's layout by
zerojax.checkpoint.load_safetensors (GPT-2's Conv1D (in, out) weights as they are, the head
tied to the token embedding), and the held-out figures are per token:

  python examples/gpt.py --pretrained ~/gpt2 --stage 3 --steps 200 --seq-len 128
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import os
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pretrained  # noqa: E402
from flax import linen as nn  # noqa: E402

import zerojax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256  # bytes
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  seq_len: int = 64
  batch: int = 16
  lr: float = 3e-3
  dropout: float = 0.0  # in training, after attention and the MLP


# --- Data: bytes of a text file, or of the standard library's docstrings.
CORPUS_FORMAT = 1  # bump when the extraction below changes what it returns


def corpus_path(max_bytes: int = 2_000_000) -> str:
  """Where the docstring corpus of this Python installation is kept once built:
  `$ZEROJAX_CACHE_DIR/text/`, else `$XDG_CACHE_HOME/zerojax/text/` (~/.cache/...). The name
  holds a hash of the Python version, the standard library's folder and `max_bytes`."""
  base = os.environ.get('ZEROJAX_CACHE_DIR') or os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'zerojax'
  )
  key = f'{CORPUS_FORMAT}|{sys.version}|{sysconfig.get_paths()["stdlib"]}|{max_bytes}'
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  return os.path.join(base, 'text', f'stdlib-docstrings-{digest}.bin')


def extract_stdlib_docstrings(max_bytes: int = 2_000_000) -> bytes:
  """Docstrings of Python's standard library modules, classes and functions, in a fixed
  order (folders and files sorted, each file's tree breadth first), up to `max_bytes`."""
  root = sysconfig.get_paths()['stdlib']
  chunks, total = [], 0
  for dirpath, dirnames, filenames in sorted(os.walk(root)):
    dirnames[:] = sorted(
      d for d in dirnames if d not in ('test', 'tests', 'site-packages', 'idlelib')
    )
    for name in sorted(filenames):
      if not name.endswith('.py'):
        continue
      try:
        with open(os.path.join(dirpath, name), encoding='utf-8') as f:
          tree = ast.parse(f.read())
      except (SyntaxError, UnicodeDecodeError, OSError):
        continue
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
          doc = ast.get_docstring(node)
          if doc:
            chunks.append(doc.encode('utf-8') + b'\n\n')
            total += len(chunks[-1])
            if total >= max_bytes:
              return b''.join(chunks)
  return b''.join(chunks)


@functools.lru_cache(maxsize=1)
def stdlib_docstrings(max_bytes: int = 2_000_000) -> bytes:
  """The standard library's docstrings (`extract_stdlib_docstrings`): parsing the library
  takes seconds, so the bytes are kept at `corpus_path()` after the first run and read back
  from there. A folder that cannot be written only means parsing again next time."""
  path = corpus_path(max_bytes)
  try:
    with open(path, 'rb') as f:
      return f.read()
  except OSError:
    pass
  print(f"building the training text from the standard library's docstrings (kept in {path})")
  data = extract_stdlib_docstrings(max_bytes)
  tmp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.tmp')
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)  # whole or not at all: a reader never sees half a file
  except OSError as e:
    print(f'(not kept: {e})')
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
  return data


def load_text(path: str | None) -> np.ndarray:
  data = open(path, 'rb').read() if path else stdlib_docstrings()
  if len(data) < 1024:
    raise ValueError(f'need at least 1024 bytes of text, got {len(data)} from {path or "stdlib"}')
  return np.frombuffer(data, dtype=np.uint8)


def batch_at(data: np.ndarray, step: int, cfg: Config, seed: int = 0) -> np.ndarray:
  """The batch of step `step`: deterministic, so a run can resume at any step."""
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, len(data) - cfg.seq_len - 1, size=cfg.batch)
  return np.stack([data[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int32)


def load(
  path: str | None, cfg: Config = Config(), max_windows: int = 256, encode=None
) -> common.Data:
  """The text's first 95% for training; up to `max_windows` windows of the rest held out.

  The text is bytes, or with `encode` (bytes -> token ids) the tokens it returns."""
  text = load_text(path)
  if encode is not None:
    text = encode(text.tobytes())
  window = cfg.seq_len + 1
  cut = min(len(text) * 95 // 100, len(text) - 8 * window)
  if cut < 2 * window:
    raise ValueError(
      f'{path or "stdlib"}: {len(text)} bytes is too little text for a training part and'
      f' 8 held-out windows of {window} bytes'
    )
  rest = text[cut:]
  count = min(max_windows, len(rest) // window)
  heldout = rest[: count * window].reshape(count, window).astype(np.int32)
  where = path or "Python's standard-library docstrings"
  unit = 'bytes' if encode is None else 'tokens'
  return common.Data(
    {'text': text[:cut]},
    {'tokens': heldout},
    f'{where} (real text; last {len(rest):,} {unit} held out)',
    synthetic=False,
  )


# --- Model.
class Block(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    b, t, d = x.shape
    h = nn.LayerNorm()(x)
    qkv = nn.Dense(3 * d)(h).reshape(b, t, 3, cfg.n_heads, d // cfg.n_heads)
    attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    # Dropout only in training, where the caller passes a 'dropout' key.
    drop = nn.Dropout(cfg.dropout, deterministic=cfg.dropout == 0 or not self.has_rng('dropout'))
    x = x + drop(nn.Dense(d)(attn.reshape(b, t, d)))
    h = nn.Dense(4 * d)(nn.LayerNorm()(x))
    return x + drop(nn.Dense(d)(nn.gelu(h))), None


class GPT(nn.Module):
  """Byte-level GPT.

  With `per_layer` (the default), each module gathers its own ZeRO-3 shards when
  it runs, inside the scanned and rematerialised layer loop; it is a no-op below
  stage 3, where parameters are replicated at rest. Without it the caller
  gathers everything up front (`zerojax.gather`), which keeps the whole
  model live on every device.
  """

  cfg: Config
  zero: object = None  # the optimizer from zerojax.zero_stage: the axes to gather over
  per_layer: bool = True

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg

    def gathered(cls):
      return zerojax.linen.gathered(cls, self.zero) if self.per_layer else cls

    x = gathered(nn.Embed)(cfg.vocab, cfg.d_model, name='embed')(tokens)
    # Learned positions as a module of their own, so that it gathers its shards too.
    pos = gathered(nn.Embed)(
      cfg.seq_len, cfg.d_model, embedding_init=nn.initializers.normal(0.02), name='pos'
    )
    x = x + pos(jnp.arange(tokens.shape[1]))
    block = nn.remat(gathered(Block), prevent_cse=False)
    x, _ = nn.scan(
      block,
      variable_axes={'params': 0},
      split_rngs={'params': True, 'dropout': True},
      length=cfg.n_layers,
    )(cfg, name='blocks')(x, None)
    x = gathered(nn.LayerNorm)(name='final_norm')(x)
    return gathered(nn.Dense)(cfg.vocab, name='head')(x)


def logits_and_labels(apply_fn, params, batch, rngs=None):
  tokens = batch['tokens']
  return apply_fn({'params': params}, tokens[:, :-1], rngs=rngs), tokens[:, 1:]


def loss_fn(apply_fn, params, batch):
  logits, labels = logits_and_labels(apply_fn, params, batch)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def task(cfg: Config = Config(), log_every: int = 10) -> common.Task:
  """The GPT as a `common.Task`."""
  return common.Task(
    name='gpt',
    doc=__doc__,
    data_help='a text file to train on (default: the standard library docstrings)',
    load=lambda path: load(path, cfg),
    model=lambda tx: GPT(cfg, tx),
    init_inputs=lambda data: {'tokens': jnp.zeros((1, cfg.seq_len), jnp.int32)},
    logits_and_labels=logits_and_labels,
    tx=lambda: optax.adamw(cfg.lr, weight_decay=0.01),
    batch=cfg.batch,
    batches=lambda data, batch, seed: (
      lambda step: {'tokens': batch_at(data.train['text'], step, cfg, seed)}
    ),
    log_every=log_every,
    rngs=('dropout',) if cfg.dropout > 0 else (),
  )


def run(
  *,
  stage: int,
  steps: int,
  cfg: Config = Config(),
  text: str | None = None,
  log_every: int = 10,
  mixed_precision: bool = False,
  **options,
) -> dict:
  """Trains for `steps` steps under `stage` (see `common.run` for the result and `options`).

  With `mixed_precision`, parameters are bf16 and the optimizer (AdamW with
  the config's learning rate unless `tx=` says otherwise) keeps an fp32 master
  copy (`zerojax.mixed_precision`). Other options go to `common.run`: quiet,
  checkpoint_dir, save_every, tx, and zero_stage's own (offload, update_on, ...).
  """
  job = task(cfg, log_every)
  if mixed_precision:
    options.update(bf16_options(options.get('tx') or job.tx()))
  return common.run(job, stage=stage, steps=steps, data=text, **options)


def bf16_options(tx) -> dict:
  """bf16 parameters, an fp32 master copy in the optimizer state."""
  return {'tx': zerojax.mixed_precision(tx), 'param_dtype': jnp.bfloat16}


# --- Fine-tuning a published GPT-2 (--pretrained).


def byte_level_bpe(folder: str):
  """The checkpoint's byte-level BPE tokenizer (`tokenizers`): tokenizer.json as published,
  else vocab.json and merges.txt."""
  from tokenizers import Tokenizer
  from tokenizers.implementations import ByteLevelBPETokenizer

  if os.path.exists(os.path.join(folder, 'tokenizer.json')):
    return Tokenizer.from_file(os.path.join(folder, 'tokenizer.json'))
  vocab, merges = os.path.join(folder, 'vocab.json'), os.path.join(folder, 'merges.txt')
  if not (os.path.exists(vocab) and os.path.exists(merges)):
    raise FileNotFoundError(f'{folder} has neither tokenizer.json nor vocab.json and merges.txt.')
  return ByteLevelBPETokenizer(vocab, merges)


def pretrained_task(folder: str, cfg: Config, lr: float) -> common.Task:
  """The language-modelling task for a published GPT-2 in `folder`."""
  gcfg = pretrained.GPT2Config.from_folder(folder)
  if cfg.seq_len > gcfg.n_positions:
    raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's {gcfg.n_positions} positions.")
  tok = byte_level_bpe(folder)

  def encode(data: bytes) -> np.ndarray:
    return np.array(tok.encode(data.decode('utf-8', errors='replace')).ids, np.int32)

  def init_params(tx, init_fn, key):
    names = pretrained.gpt2_names(zerojax.checkpoint.read_tensor_names(folder))
    return zerojax.checkpoint.load_safetensors(
      folder, init_fn, key, tx=tx, names=names, skip=pretrained.GPT2_BUFFERS
    )

  base = task(cfg)
  return dataclasses.replace(
    base,
    name='gpt2_pretrained',
    load=lambda path: load(path, cfg, encode=encode),
    model=lambda tx: pretrained.GPT2(gcfg, tx),
    tx=lambda: optax.adamw(lr, weight_decay=0.01),
    init_params=init_params,
    rngs=(),
  )


def add_arguments(parser) -> None:
  parser.add_argument('--pretrained', default=None, help='a Hugging Face GPT-2 folder to fine-tune')
  parser.add_argument('--seq-len', type=int, default=Config.seq_len, help='tokens per sequence')
  parser.add_argument(
    '--lr',
    type=float,
    default=None,
    help='learning rate (default: 3e-3, or 6e-5 with --pretrained)',
  )
  parser.add_argument('--d-model', type=int, default=Config.d_model, help='model width')
  parser.add_argument('--layers', type=int, default=Config.n_layers, help='transformer blocks')
  parser.add_argument('--batch', type=int, default=Config.batch, help='global batch size')
  parser.add_argument('--dropout', type=float, default=Config.dropout, help='dropout rate')
  parser.add_argument(
    '--mixed-precision', action='store_true', help='bf16 parameters, fp32 master copy'
  )
  parser.add_argument(
    '--offload',
    default=None,
    choices=('opt_state', 'opt_state+master'),
    help='optimizer state in host memory',
  )
  parser.add_argument(
    '--update-on', default='device', choices=('device', 'host'), help='with --offload'
  )
  parser.add_argument(
    '--quantize',
    default=None,
    choices=('int8', 'int4'),
    help='ZeRO++: gradients reduce-scattered in this format, and at stage 3 weights'
    ' all-gathered in int8 (through zerojax.value_and_grad)',
  )
  parser.add_argument(
    '--compare-quantized',
    action='store_true',
    help='train at --stage with full-precision, int8 and int4 collectives on the same'
    ' data; write a table, a PNG and JSON to --out',
  )


def configure(_, args) -> tuple[common.Task, dict]:
  cfg = Config(
    d_model=args.d_model,
    n_layers=args.layers,
    batch=args.batch,
    dropout=args.dropout,
    seq_len=args.seq_len,
    lr=args.lr or Config.lr,
  )
  job, options = task(cfg), {'offload': args.offload, 'update_on': args.update_on}
  if args.pretrained is not None:
    if args.dropout:
      raise SystemExit('--pretrained fine-tunes without dropout (examples/pretrained.py).')
    job = pretrained_task(args.pretrained, cfg, args.lr or 6e-5)
    options['stacked'] = {'h': True}
  if args.quantize:
    options['quantize'] = zerojax.Quantize(
      weights='int8' if args.stage == 3 else None, grads=args.quantize
    )
  if args.mixed_precision:
    options.update(bf16_options(job.tx()))
  return job, options


if __name__ == '__main__':
  sys.exit(common.main(None, task(), add_arguments=add_arguments, configure=configure))
