"""MLP classifier on MNIST's IDX format, trained with zerojax.

Reads train-images-idx3-ubyte and train-labels-idx1-ubyte (optionally .gz) from
--data; without it, writes synthetic digits in the same IDX format to a
temporary folder and reads them back.

  python examples/mlp_mnist.py --stage 3 --data ~/datasets/mnist
"""

from __future__ import annotations

import gzip
import os
import struct
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

IMAGES, LABELS = 'train-images-idx3-ubyte', 'train-labels-idx1-ubyte'


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


def _find(folder: str, name: str) -> str:
  for candidate in (name, name + '.gz'):
    if os.path.exists(os.path.join(folder, candidate)):
      return os.path.join(folder, candidate)
  raise FileNotFoundError(f'{folder}: no {name} or {name}.gz (MNIST IDX files expected)')


def synthetic_mnist(folder: str, n: int = 4096, seed: int = 0) -> None:
  """Writes n synthetic 28x28 'digits' (a noisy template per class) as IDX files."""
  rng = np.random.default_rng(seed)
  templates = rng.random((10, 28, 28)) > 0.7
  labels = rng.integers(0, 10, n).astype(np.uint8)
  images = templates[labels] * 120 + rng.integers(0, 135, (n, 28, 28))
  write_idx(os.path.join(folder, IMAGES), images.astype(np.uint8))
  write_idx(os.path.join(folder, LABELS), labels)


def load(folder: str | None) -> tuple[np.ndarray, np.ndarray]:
  if folder is None:
    folder = tempfile.mkdtemp(prefix='mnist_synthetic_')
    synthetic_mnist(folder)
  images, labels = read_idx(_find(folder, IMAGES)), read_idx(_find(folder, LABELS))
  if len(images) != len(labels):
    raise ValueError(f'{folder}: {len(images)} images but {len(labels)} labels')
  return images.reshape(len(images), -1).astype(np.float32) / 255.0, labels.astype(np.int32)


class MLP(nn.Module):
  """784 -> 512 -> 512 -> 10; each layer gathers its own ZeRO-3 shards."""

  mesh: object = None

  @nn.compact
  def __call__(self, image):
    dense = zerojax.gathered_linen(nn.Dense, mesh=self.mesh)
    x = nn.relu(dense(512)(image))
    x = nn.relu(dense(512)(x))
    return dense(10)(x)


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
    model=MLP(mesh),
    init_inputs={'image': jnp.zeros((1, images.shape[1]))},
    init_batch=batch_at(0),
    loss_fn=loss_fn,
    batch_at=batch_at,
    stage=stage,
    steps=steps,
    tx=optax.adam(1e-3),
    name='mnist',
    log_every=5,
    quiet=quiet,
    mesh=mesh,
    checkpoint_dir=checkpoint_dir,
  )


def main(argv=None) -> int:
  return example_main(
    argv,
    doc=__doc__,
    name='mnist',
    run=run,
    data_help='folder with MNIST IDX files (default: synthetic)',
  )


if __name__ == '__main__':
  sys.exit(main())
