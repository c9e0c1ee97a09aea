"""The examples' loaders on small files in each real format, and short training runs."""

import gzip
import os
import pickle
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples'))
import bert_mrpc  # noqa: E402
import cnn_cifar  # noqa: E402
import mlp_mnist  # noqa: E402

# --- MNIST IDX


@pytest.mark.parametrize('suffix', ['', '.gz'])
def test_idx_round_trip(tmp_path, suffix):
  images = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)
  path = str(tmp_path / f'train-images-idx3-ubyte{suffix}')
  mlp_mnist.write_idx(path, images)
  raw = gzip.open(path).read() if suffix else open(path, 'rb').read()
  assert raw[:4] == bytes([0, 0, 8, 3]) and raw[4:8] == (5).to_bytes(4, 'big')
  assert np.array_equal(mlp_mnist.read_idx(path), images)


def test_idx_errors_name_the_file(tmp_path):
  bad = tmp_path / 'bad'
  bad.write_bytes(b'\x00\x00\x0d\x01\x00\x00\x00\x02ab')
  with pytest.raises(
    ValueError, match=f"{bad}: not an IDX file of unsigned bytes \\(magic '00000d01'\\)"
  ):
    mlp_mnist.read_idx(str(bad))
  short = tmp_path / 'short'
  short.write_bytes(bytes([0, 0, 8, 1]) + (10).to_bytes(4, 'big') + b'abc')
  with pytest.raises(ValueError, match=f'{short}: expected 10 bytes for shape \\(10,\\), found 3'):
    mlp_mnist.read_idx(str(short))
  with pytest.raises(
    FileNotFoundError, match='no train-images-idx3-ubyte or train-images-idx3-ubyte.gz'
  ):
    mlp_mnist.load(str(tmp_path))


def test_mnist_loads_a_folder_of_real_format_files(tmp_path):
  mlp_mnist.synthetic_mnist(str(tmp_path), n=64)
  images, labels = mlp_mnist.load(str(tmp_path))
  assert (
    images.shape == (64, 784)
    and images.dtype == np.float32
    and 0 <= images.min() <= images.max() <= 1
  )
  assert labels.shape == (64,) and set(labels) <= set(range(10))


def test_mlp_loss_decreases_over_30_steps():
  out = mlp_mnist.run(stage=3, steps=30, quiet=True)
  assert out['losses'][-1][1] < 0.5 * out['losses'][0][1]


# --- CIFAR-10 python batches


def test_cifar_batch_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  images, labels = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 6)
  path = str(tmp_path / 'data_batch_1')
  cnn_cifar.write_cifar_batch(path, images, labels)
  with open(path, 'rb') as f:
    raw = pickle.load(f, encoding='bytes')
  # The real layout: rows of 1024 red, then 1024 green, then 1024 blue values.
  assert raw[b'data'].shape == (6, 3072) and np.array_equal(
    raw[b'data'][0, :1024], images[0, :, :, 0].ravel()
  )
  got_images, got_labels = cnn_cifar.read_cifar_batch(path)
  assert np.array_equal(got_images, images) and np.array_equal(got_labels, labels)


def test_cifar_errors_name_the_file(tmp_path):
  path = tmp_path / 'data_batch_1'
  with open(path, 'wb') as f:
    pickle.dump({b'labels': [1]}, f)
  with pytest.raises(
    ValueError, match=f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels'"
  ):
    cnn_cifar.read_cifar_batch(str(path))
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='no data_batch_\\* files'):
    cnn_cifar.load(str(tmp_path / 'empty'))


def test_cnn_trains_on_a_folder(tmp_path):
  cnn_cifar.synthetic_cifar(str(tmp_path), n=128)
  images, labels = cnn_cifar.load(str(tmp_path))
  assert images.shape == (256, 32, 32, 3) and labels.shape == (256,)
  out = cnn_cifar.run(stage=2, steps=10, data=str(tmp_path), quiet=True)
  assert out['losses'][-1][1] < out['losses'][0][1]


# --- GLUE MRPC TSV


def test_mrpc_reader_and_encoding(tmp_path):
  path = tmp_path / 'train.tsv'
  path.write_text(
    '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
    '1\t702876\t702977\tAmrozi accused his brother.\tReferring to him, Amrozi accused his brother.\n'
    '0\t2108705\t2108831\tYucaipa owned Dominick\'s.\tYucaipa bought Dominick\'s in 1995 "for $ 693 million".\n',
    encoding='utf-8',
  )
  rows = bert_mrpc.read_mrpc(str(path))
  assert rows[0] == (
    1,
    'Amrozi accused his brother.',
    'Referring to him, Amrozi accused his brother.',
  )
  assert rows[1][2].endswith('"for $ 693 million".')  # quotes are text in MRPC, not quoting
  enc = bert_mrpc.encode(rows, 64)
  assert enc['tokens'][0, 0] == bert_mrpc.CLS
  first_sep = list(enc['tokens'][0]).index(bert_mrpc.SEP)
  assert first_sep == 1 + len('Amrozi accused his brother.')
  assert enc['segments'][0, first_sep] == 0 and enc['segments'][0, first_sep + 1] == 1
  assert list(enc['label']) == [1, 0]


def test_mrpc_errors_name_file_and_line(tmp_path):
  path = tmp_path / 'bad.tsv'
  path.write_text(
    'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tonly three\n', encoding='utf-8'
  )
  with pytest.raises(
    ValueError, match=f'{path}: line 2: expected 5 tab-separated fields with label 0 or 1'
  ):
    bert_mrpc.read_mrpc(str(path))
  path.write_text('label\tsentence\n', encoding='utf-8')
  with pytest.raises(ValueError, match=f'{path}: line 1 must be the MRPC header'):
    bert_mrpc.read_mrpc(str(path))


def test_bert_trains_on_synthetic_sample(tmp_path):
  path = str(tmp_path / 'train.tsv')
  bert_mrpc.write_synthetic_mrpc(path, n=64)
  assert len(bert_mrpc.read_mrpc(path)) == 64
  out = bert_mrpc.run(stage=3, steps=40, data=path, quiet=True)
  assert np.isfinite(out['losses'][-1][1])
  assert out['losses'][-1][1] < out['losses'][0][1]
