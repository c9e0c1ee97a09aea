"""CNN image classifier on the CIFAR-10 "python" batch format, trained with zerojax.

Reads data_batch_1 ... data_batch_5 (pickled dicts with b'data', N x 3072
uint8, and b'labels') from --data, a folder or one batch file; without it,
writes synthetic images in the same format to a temporary folder.

  python examples/cnn_cifar.py --stage 2 --data ~/datasets/cifar-10-batches-py
"""

from __future__ import annotations

import glob
import os
import pickle
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import example_main, make_mesh, random_batches, train  # noqa: E402
from flax import linen as nn  # noqa: E402

import zerojax  # noqa: E402


def write_cifar_batch(path: str, images: np.ndarray, labels: np.ndarray) -> None:
  """Writes (N, 32, 32, 3) uint8 images as one CIFAR-10 python batch file."""
  data = np.asarray(images, np.uint8).transpose(0, 3, 1, 2).reshape(len(images), 3072)
  batch = {b'batch_label': b'synthetic', b'labels': [int(x) for x in labels], b'data': data}
  with open(path, 'wb') as f:
    pickle.dump(batch, f, protocol=2)


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Reads one CIFAR-10 python batch: (N, 32, 32, 3) uint8 images and int labels.

  Raises:
    ValueError: naming the file when it is not such a batch.
  """
  with open(path, 'rb') as f:
    try:
      batch = pickle.load(f, encoding='bytes')
    except Exception as e:
      raise ValueError(f'{path}: not a CIFAR-10 python batch ({e})') from None
  if not isinstance(batch, dict) or b'data' not in batch or b'labels' not in batch:
    raise ValueError(f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels'")
  data = np.asarray(batch[b'data'], np.uint8)
  if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(batch[b'labels']):
    raise ValueError(f"{path}: b'data' must be N x 3072 with N labels, got {data.shape}")
  return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.asarray(batch[b'labels'], np.int32)


def synthetic_cifar(folder: str, n: int = 2048, seed: int = 0) -> None:
  """Writes two synthetic batches: a colour and stripe pattern per class, plus noise."""
  rng = np.random.default_rng(seed)
  colours = rng.integers(0, 256, (10, 3))
  stripes = (np.arange(32)[None, :] // (1 + np.arange(10)[:, None] % 4)) % 2
  for i in (1, 2):
    labels = rng.integers(0, 10, n)
    base = colours[labels][:, None, None, :] * stripes[labels][:, None, :, None]
    images = np.clip(base * 0.7 + rng.integers(0, 80, (n, 32, 32, 3)), 0, 255)
    write_cifar_batch(os.path.join(folder, f'data_batch_{i}'), images, labels)


def load(path: str | None) -> tuple[np.ndarray, np.ndarray]:
  if path is None:
    path = tempfile.mkdtemp(prefix='cifar_synthetic_')
    synthetic_cifar(path)
  files = sorted(glob.glob(os.path.join(path, 'data_batch_*'))) if os.path.isdir(path) else [path]
  if not files:
    raise FileNotFoundError(f'{path}: no data_batch_* files (CIFAR-10 python format expected)')
  parts = [read_cifar_batch(f) for f in files]
  images = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
  return images, np.concatenate([p[1] for p in parts])


class CNN(nn.Module):
  """Two conv layers and two dense layers; each gathers its own ZeRO-3 shards."""

  mesh: object = None

  @nn.compact
  def __call__(self, image):
    g = lambda cls: zerojax.gathered_linen(cls, mesh=self.mesh)
    x = nn.avg_pool(nn.relu(g(nn.Conv)(32, (3, 3))(image)), (2, 2), (2, 2))
    x = nn.avg_pool(nn.relu(g(nn.Conv)(64, (3, 3))(x)), (2, 2), (2, 2))
    x = nn.relu(g(nn.Dense)(128)(x.reshape(len(x), -1)))
    return g(nn.Dense)(10)(x)


def loss_fn(apply_fn, params, batch):
  logits = apply_fn({'params': params}, batch['image'])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()


def run(
  *,
  stage: int,
  steps: int,
  data: str | None = None,
  batch: int = 64,
  quiet: bool = False,
  checkpoint_dir: str | None = None,
) -> dict:
  images, labels = load(data)
  mesh = make_mesh()

  batch_at = random_batches({'image': images, 'label': labels}, batch)

  return train(
    model=CNN(mesh),
    init_inputs={'image': jnp.zeros((1, 32, 32, 3))},
    init_batch=batch_at(0),
    loss_fn=loss_fn,
    batch_at=batch_at,
    stage=stage,
    steps=steps,
    tx=optax.adam(1e-3),
    name='cifar',
    log_every=5,
    quiet=quiet,
    mesh=mesh,
    checkpoint_dir=checkpoint_dir,
  )


def main(argv=None) -> int:
  return example_main(
    argv,
    doc=__doc__,
    name='cifar',
    run=run,
    data_help='CIFAR-10 python batches: a folder or one file (default: synthetic)',
  )


if __name__ == '__main__':
  sys.exit(main())
