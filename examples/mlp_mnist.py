"""MLP classifier on MNIST's IDX format, trained with zerojax.

Reads train-images-idx3-ubyte and train-labels-idx1-ubyte (optionally .gz) from
--data, and t10k-images/t10k-labels as the held-out set when they are there
(else the last 10% of the training files). Without --data it trains on
SYNTHETIC digits: a template per class, shifted by up to 3 pixels, under heavy
pixel noise, with 10% of the labels replaced at random. The rule is learnable,
the noise is not: held-out accuracy cannot exceed about 91%, and a training
loss near 0 would mean memorisation. They are written in IDX format to a
temporary folder, read back through the same reader, and the folder removed.

  python examples/mlp_mnist.py --stage 3 --data ~/datasets/mnist
  python examples/mlp_mnist.py --compare --steps 300    # stages 0-3 side by side
"""

from __future__ import annotations

import gzip
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import setup_devices  # noqa: E402

if __name__ == '__main__':
  setup_devices()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import (  # noqa: E402
  Data,
  Task,
  flip_labels,
  held_out,
  image_logits_and_labels,
  main,
  synthetic,
)
from flax import linen as nn  # noqa: E402

import zerojax  # noqa: E402

IMAGES, LABELS = 'train-images-idx3-ubyte', 'train-labels-idx1-ubyte'
TEST_IMAGES, TEST_LABELS = 't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'
LABEL_NOISE = 0.1


def _open(path: str, mode: str):
  return gzip.open(path, mode) if path.endswith('.gz') else open(path, mode)


def write_idx(path: str, array: np.ndarray) -> None:
  """Writes a uint8 array in IDX format (gzip-compressed if `path` ends in .gz)."""
  array = np.ascontiguousarray(array, dtype=np.uint8)
  with _open(path, 'wb') as f:
    f.write(bytes([0, 0, 0x08, array.ndim]))
    f.write(struct.pack(f'>{array.ndim}I', *array.shape))
    f.write(array.tobytes())


def read_idx(path: str) -> np.ndarray:
  """Reads an IDX file of unsigned bytes.

  Raises:
    ValueError: naming the file, if it is not IDX of uint8 or is truncated.
  """
  with _open(path, 'rb') as f:
    head = f.read(4)
    if len(head) != 4 or head[:2] != b'\x00\x00' or head[2] != 0x08:
      raise ValueError(f'{path}: not an IDX file of unsigned bytes (magic {head.hex()!r})')
    ndim = head[3]
    shape = struct.unpack(f'>{ndim}I', f.read(4 * ndim))
    data = f.read()
  if len(data) != int(np.prod(shape)):
    raise ValueError(
      f'{path}: expected {int(np.prod(shape))} bytes for shape {shape}, found {len(data)}'
    )
  return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _find(folder: str, name: str, required: bool = True) -> str | None:
  for candidate in (name, name + '.gz'):
    if os.path.exists(os.path.join(folder, candidate)):
      return os.path.join(folder, candidate)
  if not required:
    return None
  raise FileNotFoundError(f'{folder}: no {name} or {name}.gz (MNIST IDX files expected)')


def synthetic_digits(n: int, seed: int, label_noise: float = LABEL_NOISE):
  """n synthetic 28x28 'digits' (uint8) and labels: a rule (the class template) plus noise.

  The ten templates are fixed (seed 1234); `seed` draws the examples, so
  different seeds give independent samples of the same task.
  """
  templates = np.random.default_rng(1234).random((10, 28, 28))
  for _ in range(3):  # smooth blobs rather than salt and pepper
    templates = (templates + np.roll(templates, 1, 1) + np.roll(templates, 1, 2)) / 3
  templates = templates > np.median(templates, axis=(1, 2), keepdims=True)
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 10, n)
  rows = (np.arange(28)[None, :] - rng.integers(-3, 4, n)[:, None]) % 28
  cols = (np.arange(28)[None, :] - rng.integers(-3, 4, n)[:, None]) % 28
  shifted = templates[labels][np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
  images = np.clip(shifted * 100 + 60 + rng.normal(0, 70, (n, 28, 28)), 0, 255)
  return images.astype(np.uint8), flip_labels(rng, labels, 10, label_noise).astype(np.uint8)


def synthetic_mnist(folder: str, n: int = 8192, heldout: int = 1024, seed: int = 0) -> None:
  """Writes synthetic training and t10k IDX files (see `synthetic_digits`) to `folder`."""
  for (images_name, labels_name), count, s in (
    ((IMAGES, LABELS), n, seed),
    ((TEST_IMAGES, TEST_LABELS), heldout, seed + 1),
  ):
    images, labels = synthetic_digits(count, s)
    write_idx(os.path.join(folder, images_name), images)
    write_idx(os.path.join(folder, labels_name), labels)


def _read_pair(folder: str, images_name: str, labels_name: str) -> dict:
  images_path, labels_path = _find(folder, images_name), _find(folder, labels_name)
  images, labels = read_idx(images_path), read_idx(labels_path)
  if len(images) != len(labels):
    raise ValueError(f'{folder}: {len(images)} images in {images_name} but {len(labels)} labels')
  return {
    'image': images.reshape(len(images), -1).astype(np.float32) / 255.0,
    'label': labels.astype(np.int32),
  }


def load(folder: str | None) -> Data:
  """MNIST from `folder`, or synthetic digits (written and read back through a removed temp folder)."""
  if folder is None:
    return synthetic(
      'mnist_synthetic_',
      synthetic_mnist,
      load,
      'SYNTHETIC digits (class template + shifts + pixel noise, 10% random labels:'
      ' the best possible held-out accuracy is about 91%)',
    )
  has_test = _find(folder, TEST_IMAGES, required=False) is not None
  train, heldout, where = held_out(
    _read_pair(folder, IMAGES, LABELS),
    (lambda: _read_pair(folder, TEST_IMAGES, TEST_LABELS)) if has_test else None,
    't10k files',
  )
  return Data(train, heldout, f'{folder} ({where})', synthetic=False)


class MLP(nn.Module):
  """784 -> 512 -> 512 -> 10; each layer gathers its own ZeRO-3 shards."""

  zero: object = None  # the optimizer from zerojax.zero_stage: the axes to gather over

  @nn.compact
  def __call__(self, image):
    dense = zerojax.linen.gathered(nn.Dense, self.zero)
    x = nn.relu(dense(512)(image))
    x = nn.relu(dense(512)(x))
    return dense(10)(x)


TASK = Task(
  name='mnist',
  doc=__doc__,
  data_help='folder with MNIST IDX files (default: synthetic digits)',
  load=load,
  model=MLP,
  init_inputs=lambda data: {'image': jnp.zeros((1, data.train['image'].shape[1]))},
  logits_and_labels=image_logits_and_labels,
  tx=lambda: optax.adam(1e-3),
)


if __name__ == '__main__':
  sys.exit(main(None, TASK))
