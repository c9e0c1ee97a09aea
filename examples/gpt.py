"""GPT-style byte-level language model trained with zerojax (the main example).

Scanned transformer blocks; under stage 3 each block gathers its own parameter
shards inside the layer loop (zerojax.gathered_linen) and, rematerialised, drops
them after use. Trains on any text file (--text), or by default on the
docstrings of Python's standard library, gathered at run time.

  python examples/gpt.py --stage 3 --steps 200
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import make_mesh, report, train  # noqa: E402
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


# --- Data: bytes of a text file, or of the standard library's docstrings.
@functools.lru_cache(maxsize=1)
def stdlib_docstrings(max_bytes: int = 2_000_000) -> bytes:
  """Docstrings of Python's standard library modules, classes and functions."""
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
    x = x + nn.Dense(d)(attn.reshape(b, t, d))
    h = nn.Dense(4 * d)(nn.LayerNorm()(x))
    return x + nn.Dense(d)(nn.gelu(h)), None


class GPT(nn.Module):
  """Byte-level GPT.

  With `per_layer` (the default), each module gathers its own ZeRO-3 shards when
  it runs, inside the scanned and rematerialised layer loop; it is a no-op below
  stage 3, where parameters are replicated at rest. Without it the caller
  gathers everything up front (`zerojax.gather_params`), which keeps the whole
  model live on every device.
  """

  cfg: Config
  mesh: object = None
  per_layer: bool = True

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg

    def gathered(cls):
      return zerojax.gathered_linen(cls, mesh=self.mesh) if self.per_layer else cls

    x = gathered(nn.Embed)(cfg.vocab, cfg.d_model, name='embed')(tokens)
    pos = self.param('pos', nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
    if self.per_layer:
      pos = zerojax.gather_leaves(pos, mesh=self.mesh)
    x = x + pos[: tokens.shape[1]]
    block = nn.remat(gathered(Block), prevent_cse=False)
    x, _ = nn.scan(
      block, variable_axes={'params': 0}, split_rngs={'params': True}, length=cfg.n_layers
    )(cfg, name='blocks')(x, None)
    x = gathered(nn.LayerNorm)(name='final_norm')(x)
    return gathered(nn.Dense)(cfg.vocab, name='head')(x)


def loss_fn(apply_fn, params, batch):
  tokens = batch['tokens']
  logits = apply_fn({'params': params}, tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def run(
  *,
  stage: int,
  steps: int,
  cfg: Config = Config(),
  text: str | None = None,
  log_every: int = 10,
  quiet: bool = False,
  checkpoint_dir: str | None = None,
  save_every: int = 50,
  tx=None,
  mixed_precision: bool = False,
  **zero_kwargs,
) -> dict:
  """Trains for `steps` steps; returns losses, the state, the plan and the compiled step.

  `tx` defaults to AdamW with the config's learning rate. With
  `mixed_precision`, parameters are bf16 and the optimizer keeps an fp32
  master copy (`zerojax.mixed_precision`); `zero_kwargs` go to
  `zerojax.create_train_state` (e.g. offload='opt_state', update_on='host').
  """
  data = load_text(text)
  mesh = make_mesh()
  tx = tx or optax.adamw(cfg.lr, weight_decay=0.01)
  return train(
    model=GPT(cfg, mesh),
    init_inputs={'tokens': jnp.zeros((1, cfg.seq_len), jnp.int32)},
    init_batch={'tokens': batch_at(data, 0, cfg)},
    loss_fn=lambda apply_fn, p, batch: loss_fn(apply_fn, p, batch),
    batch_at=lambda step: {'tokens': batch_at(data, step, cfg)},
    stage=stage,
    steps=steps,
    tx=zerojax.mixed_precision(tx) if mixed_precision else tx,
    param_dtype=jnp.bfloat16 if mixed_precision else None,
    name='gpt',
    log_every=log_every,
    quiet=quiet,
    mesh=mesh,
    checkpoint_dir=checkpoint_dir,
    save_every=save_every,
    **zero_kwargs,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--stage', type=int, default=3, choices=(0, 1, 2, 3))
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--text', help='a text file to train on (default: stdlib docstrings)')
  parser.add_argument('--d-model', type=int, default=128)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--checkpoint-dir', help='save here and resume from the latest checkpoint')
  parser.add_argument('--save-every', type=int, default=50)
  parser.add_argument(
    '--mixed-precision', action='store_true', help='bf16 parameters, fp32 master copy'
  )
  parser.add_argument(
    '--offload', choices=('opt_state', 'opt_state+master'), help='optimizer state in host memory'
  )
  parser.add_argument(
    '--update-on', default='device', choices=('device', 'host'), help='with --offload'
  )
  args = parser.parse_args(argv)
  cfg = Config(d_model=args.d_model, n_layers=args.layers, batch=args.batch)
  out = run(
    stage=args.stage,
    steps=args.steps,
    cfg=cfg,
    text=args.text,
    checkpoint_dir=args.checkpoint_dir,
    save_every=args.save_every,
    mixed_precision=args.mixed_precision,
    offload=args.offload,
    update_on=args.update_on,
  )
  report(out, 'gpt')
  return 0


if __name__ == '__main__':
  sys.exit(main())
