"""CNN image classifier on the CIFAR-10 "python" batch format, trained with zerojax.

Reads data_batch_1 ... data_batch_5 (pickled dicts with b'data', N x 3072
uint8, and b'labels') from --data, a folder or one batch file, and test_batch
as the held-out set when the folder has it (else the last 10% of the training
batches). Without --data it trains on SYNTHETIC images: a colour and a stripe
pattern per class, shifted at random, under heavy noise, with 10% of the
labels replaced at random, so held-out accuracy cannot exceed about 91% and
a training loss near 0 would mean memorisation. They are written as CIFAR
batches to a temporary folder, read back through the same reader, and the
folder removed.

  python examples/cnn_cifar.py --stage 2 --data ~/datasets/cifar-10-batches-py
  python examples/cnn_cifar.py --compare --steps 200    # stages 0-3 side by side
"""

from __future__ import annotations

import glob
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':  # before jax starts
  setup_devices()

import common  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import zerojax  # noqa: E402

LABEL_NOISE = 0.1


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


def synthetic_images(n: int, seed: int, label_noise: float = LABEL_NOISE):
  """n synthetic 32x32 RGB images (uint8) and labels: a rule (colour and stripes) plus noise.

  The class patterns are fixed; `seed` draws the examples.
  """
  patterns = np.random.default_rng(1234)
  colours = patterns.integers(40, 256, (10, 3))
  period = 2 + np.arange(10) % 5  # stripe period 2-6 pixels
  vertical = np.arange(10) >= 5  # classes 0-4 horizontal stripes, 5-9 vertical
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 10, n)
  position = (np.arange(32)[None, :] + rng.integers(0, 32, n)[:, None]) // period[labels][:, None]
  stripes = (position % 2).astype(np.float64)  # (n, 32)
  grid = np.where(
    vertical[labels][:, None, None], stripes[:, None, :], stripes[:, :, None]
  )  # (n, 32, 32)
  base = grid[..., None] * colours[labels][:, None, None, :]
  images = np.clip(0.6 * base + 50 + rng.normal(0, 60, (n, 32, 32, 3)), 0, 255)
  return images.astype(np.uint8), common.flip_labels(rng, labels, 10, label_noise)


def synthetic_cifar(folder: str, n: int = 2048, heldout: int = 1024, seed: int = 0) -> None:
  """Writes two synthetic training batches of n images and a test_batch (see `synthetic_images`)."""
  for name, count, s in (
    ('data_batch_1', n, seed),
    ('data_batch_2', n, seed + 1),
    ('test_batch', heldout, seed + 2),
  ):
    write_cifar_batch(os.path.join(folder, name), *synthetic_images(count, s))


def _read_all(files: list[str]) -> dict:
  parts = [read_cifar_batch(f) for f in files]
  return {
    'image': np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0,
    'label': np.concatenate([p[1] for p in parts]),
  }


def load(path: str | None) -> common.Data:
  """CIFAR-10 from `path`, or synthetic images (written and read back through a removed temp folder)."""
  if path is None:
    return common.synthetic(
      'cifar_synthetic_',
      synthetic_cifar,
      load,
      'SYNTHETIC images (colour + stripes per class, random shifts, pixel noise,'
      ' 10% random labels: the best possible held-out accuracy is about 91%)',
    )
  files = sorted(glob.glob(os.path.join(path, 'data_batch_*'))) if os.path.isdir(path) else [path]
  if not files:
    raise FileNotFoundError(f'{path}: no data_batch_* files (CIFAR-10 python format expected)')
  test = os.path.join(path, 'test_batch')
  has_test = os.path.isdir(path) and os.path.exists(test)
  train, heldout, where = common.held_out(
    _read_all(files), (lambda: _read_all([test])) if has_test else None, 'test_batch'
  )
  return common.Data(train, heldout, f'{path} ({where})', synthetic=False)


class CNN(nn.Module):
  """Two conv layers and two dense layers; each gathers its own ZeRO-3 shards."""

  zero: object = None  # the optimizer from zerojax.zero_stage: the axes to gather over

  @nn.compact
  def __call__(self, image):
    g = lambda cls: zerojax.linen.gathered(cls, self.zero)
    x = nn.avg_pool(nn.relu(g(nn.Conv)(32, (3, 3))(image)), (2, 2), (2, 2))
    x = nn.avg_pool(nn.relu(g(nn.Conv)(64, (3, 3))(x)), (2, 2), (2, 2))
    x = nn.relu(g(nn.Dense)(128)(x.reshape(len(x), -1)))
    return g(nn.Dense)(10)(x)


TASK = common.Task(
  name='cifar',
  doc=__doc__,
  data_help='CIFAR-10 python batches: a folder or one file (default: synthetic images)',
  load=load,
  model=CNN,
  init_inputs=lambda data: {'image': jnp.zeros((1, 32, 32, 3))},
  logits_and_labels=common.image_logits_and_labels,
  tx=lambda: optax.adam(1e-3),
)


if __name__ == '__main__':
  sys.exit(common.main(None, TASK))
