"""The examples' loaders on small files in each real format, their synthetic data, the shared
runner (held-out evaluation, per-stage comparison, --help), and short training runs."""

import dataclasses
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile

import jax
import numpy as np
import optax
import pytest
from _tolerance import reordered

import zerojax

EXAMPLES = os.path.join(os.path.dirname(__file__), '..', 'examples')
sys.path.insert(0, EXAMPLES)
import bert_mrpc  # noqa: E402
import cnn_cifar  # noqa: E402
import common  # noqa: E402
import gpt  # noqa: E402
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
  mlp_mnist.synthetic_mnist(str(tmp_path), n=64, heldout=16)
  data = mlp_mnist.load(str(tmp_path))
  images, labels = data.train['image'], data.train['label']
  assert (
    images.shape == (64, 784)
    and images.dtype == np.float32
    and 0 <= images.min() <= images.max() <= 1
  )
  assert labels.shape == (64,) and set(labels) <= set(range(10))
  assert data.heldout['image'].shape == (16, 784) and 't10k files held out' in data.source
  assert not data.synthetic  # read from a folder: the loader cannot know
  for name in ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'):
    os.remove(tmp_path / name)
  data = mlp_mnist.load(str(tmp_path))  # no test files: the last 10% is held out
  assert len(data.train['label']) == 58 and len(data.heldout['label']) == 6
  assert 'last 10% held out' in data.source


@pytest.mark.parametrize(
  'make', [mlp_mnist.synthetic_digits, cnn_cifar.synthetic_images], ids=['mnist', 'cifar']
)
def test_synthetic_images_are_a_rule_plus_noise(make):
  # Learnable: the class is a deterministic function of the clean image, and the
  # same rule holds across seeds (a nearest class mean from one sample classifies
  # another). Not memorisable: about 10% of the labels are random.
  images, labels = make(2000, seed=0)
  clean, clean_labels = make(2000, seed=0, label_noise=0.0)
  assert np.array_equal(images, clean)  # the noise is in the labels, not the rule
  flipped = np.mean(labels != clean_labels)
  assert 0.06 < flipped < 0.12  # 10% replaced, a tenth of them by the same label
  x = clean.reshape(len(clean), -1).astype(np.float64)
  means = np.stack([x[clean_labels == c].mean(0) for c in range(10)])
  other, other_labels = make(1000, seed=5, label_noise=0.0)
  y = other.reshape(len(other), -1).astype(np.float64)
  nearest = np.argmin(((y[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
  assert np.mean(nearest == other_labels) > 0.5  # far above chance (10%)


def test_synthetic_data_leaves_no_folder_behind(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
  for load in (mlp_mnist.load, cnn_cifar.load, bert_mrpc.load):
    data = load(None)
    assert data.synthetic and data.source.startswith('SYNTHETIC')
    assert len(next(iter(data.heldout.values()))) >= 512
  assert list(tmp_path.iterdir()) == []


def test_mlp_learns_the_rule_and_reports_held_out_figures():
  out = common.run(mlp_mnist.TASK, stage=3, steps=60, quiet=True)
  assert out['losses'][-1][1] < 0.7 * out['losses'][0][1]
  assert out['data'].synthetic
  # Learned: far above chance (10%); not above the ~91% the label noise allows
  # (1024 held-out examples: +-3% of sampling error at most).
  assert 0.3 < out['heldout_accuracy'] < 0.94
  assert np.isfinite(out['heldout_loss']) and len(out['step_seconds']) == 60


def test_held_out_batches_weigh_the_padding_zero():
  arrays = {'x': np.arange(10)}
  batches = list(common.heldout_batches(arrays, 4))
  assert [len(b['x']) for b, _ in batches] == [4, 4, 4]
  assert np.array_equal(batches[-1][0]['x'], [8, 9, 9, 9])
  assert np.array_equal(batches[-1][1], [1, 1, 0, 0])
  assert sum(w.sum() for _, w in batches) == 10


def test_held_out_figures_are_the_mean_over_examples():
  # A model that outputs fixed logits: loss and accuracy are known in closed form.
  task = dataclasses.replace(mlp_mnist.TASK, batch=8)
  data = common.Data(
    train={'image': np.zeros((16, 4), np.float32), 'label': np.zeros(16, np.int32)},
    heldout={'image': np.zeros((13, 4), np.float32), 'label': np.array([0] * 10 + [1] * 3)},
    source='hand-made',
    synthetic=True,
  )
  out = common.run(task, stage=2, steps=0, data=data, quiet=True)
  # With zero inputs an MLP's logits are its output bias path: the same for every
  # example, so the figures are the label mix's, computed here independently.
  import jax

  logits = np.asarray(
    jax.jit(lambda p: out['state'].apply_fn({'params': p}, np.zeros((1, 4), np.float32)))(
      out['state'].params
    )
  )[0].astype(np.float64)
  log_p = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
  labels = data.heldout['label']
  # The example's float32 log-softmax over the 4 classes and mean over the held-out
  # rows against this float64 one: float32 rounding of those sums.
  rows = len(labels)
  assert out['heldout_loss'] == pytest.approx(-np.mean(log_p[labels]), rel=reordered(rows + 4))
  # A count of hits over a count of rows: exact but for one division.
  assert out['heldout_accuracy'] == pytest.approx(np.mean(labels == np.argmax(logits)))


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
  cnn_cifar.synthetic_cifar(str(tmp_path), n=128, heldout=32)
  data = cnn_cifar.load(str(tmp_path))
  assert data.train['image'].shape == (256, 32, 32, 3) and data.train['label'].shape == (256,)
  assert data.heldout['image'].shape == (32, 32, 32, 3) and 'test_batch held out' in data.source
  out = common.run(cnn_cifar.TASK, stage=2, steps=10, data=str(tmp_path), quiet=True)
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
  bert_mrpc.write_synthetic_mrpc(path, n=80)
  rows = bert_mrpc.read_mrpc(path)
  assert len(rows) == 80 and 0.3 < np.mean([r[0] for r in rows]) < 0.7
  data = bert_mrpc.load(path)
  assert len(data.train['label']) == 72 and len(data.heldout['label']) == 8
  out = common.run(bert_mrpc.TASK, stage=3, steps=40, data=data, quiet=True)
  assert np.isfinite(out['losses'][-1][1]) and np.isfinite(out['heldout_loss'])
  assert out['losses'][-1][1] < out['losses'][0][1]


HF_BERT = os.path.join(os.path.dirname(__file__), 'data', 'hf-tiny-bert')
HF_GPT2 = os.path.join(os.path.dirname(__file__), 'data', 'hf-tiny-gpt2')


def test_pretrained_bert_tokenizes_pairs_as_its_wordpiece_vocabulary_does():
  # The fixture's expected.npz holds the pairs as tokenizers' BertWordPieceTokenizer over
  # vocab.txt encoded them when the checkpoint was made; the example reads tokenizer.json.
  want = np.load(os.path.join(HF_BERT, 'expected.npz'))
  text = ['The company said its shares rose by 5 percent on Monday.',
          'Shares of the company increased 5 percent on Monday, it stated.',
          'The court ruled against the minister in March.',
          'Analysts expect the team to win the final next year.']  # fmt: skip
  tok = bert_mrpc.wordpiece(HF_BERT, 48)
  got = bert_mrpc.encode_wordpiece([(1, text[0], text[1]), (0, text[2], text[3])], tok)
  np.testing.assert_array_equal(got['tokens'], want['tokens'])
  np.testing.assert_array_equal(got['segments'], want['segments'])
  np.testing.assert_array_equal(got['mask'], want['mask'])
  cls, sep = tok.token_to_id('[CLS]'), tok.token_to_id('[SEP]')
  row = list(got['tokens'][0])
  assert row[0] == cls and row.count(sep) == 2
  second = row.index(sep) + 1
  assert set(got['segments'][0][:second]) == {0} and got['segments'][0][second] == 1


def test_pretrained_bert_fine_tunes_and_reports_f1(tmp_path):
  path = str(tmp_path / 'train.tsv')
  bert_mrpc.write_synthetic_mrpc(path, n=96)
  task = bert_mrpc.pretrained_task(HF_BERT, max_len=48, heldout=None, steps=12, lr=1e-3)
  out = common.run(task, stage=3, steps=12, data=path, quiet=True, stacked={'layers': True})
  assert np.isfinite(out['losses'][-1][1]) and 0.0 <= out['heldout_f1'] <= 1.0
  # The encoder starts from the checkpoint (the classifier is new): its first layer's query
  # kernel was read from bert.encoder.layer.0.attention.self.query.weight, transposed.
  from safetensors.numpy import load_file

  published = load_file(os.path.join(HF_BERT, 'model.safetensors'))
  fresh = task.init_params(
    zerojax.zero_stage(optax.adam(1e-3), 3, mesh=common.make_mesh(), stacked={'layers': True}),
    lambda k: task.model(None).init(k, **task.init_inputs(None))['params'],
    jax.random.key(0),
  )
  np.testing.assert_array_equal(
    np.asarray(fresh['layers']['query']['kernel'][0]),
    published['bert.encoder.layer.0.attention.self.query.weight'].T,
  )


def test_pretrained_gpt2_fine_tunes_on_bpe_tokens():
  cfg = gpt.Config(seq_len=32, batch=16)
  task = gpt.pretrained_task(HF_GPT2, cfg, lr=1e-3)
  out = common.run(task, stage=3, steps=10, quiet=True, stacked={'h': True})
  assert out['losses'][-1][1] < out['losses'][0][1]
  assert 'tokens held out' in out['data'].source


# --- The shared command line and the per-stage comparison


def _help(script: str) -> str:
  """What `examples/<script>.py --help` prints."""
  command = [sys.executable, os.path.join(EXAMPLES, f'{script}.py'), '--help']
  return subprocess.run(command, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize('script', ['mlp_mnist', 'cnn_cifar', 'bert_mrpc', 'gpt'])
def test_help_shows_every_default(script):
  out = _help(script)
  flat = ' '.join(out.split())
  for shown in ('--stage', '(default: 3)', '--steps', '(default: 200)', '(default: None)'):
    assert shown in flat, (shown, out)
  assert '--compare' in flat and '--seed' in flat
  if script == 'gpt':
    assert '--d-model D_MODEL model width (default: 128)' in flat


@pytest.mark.parametrize('script', ['nnx_minigpt', 'finetune_lm'])
def test_every_option_of_a_script_shows_its_default(script):
  out = _help(script)
  # Each option's entry: its line of `  --name ...` and the help lines indented below it.
  options, lines = [], out.split('options:', 1)[1].splitlines()
  for line in lines:
    if line.startswith('  -'):
      options.append(line.strip())
    elif options:
      options[-1] += ' ' + line.strip()
  assert len(options) > 3, out
  for option in options:
    if not option.startswith('-h, --help'):
      assert '(default: ' in option, (option, out)
  if script == 'nnx_minigpt':
    flat = ' '.join(out.split())
    for shown in ('--devices DEVICES faked CPU devices (default: 8)', '(default: 4x2)'):
      assert shown in flat, out
    assert '--stage {0,1,2,3} ZeRO stage (default: 2)' in flat


def test_compare_writes_a_table_a_figure_and_json(tmp_path):
  task = dataclasses.replace(mlp_mnist.TASK, log_every=1)
  record = common.compare_stages(task, steps=4, out_dir=str(tmp_path), quiet=True)
  base = tmp_path / 'mnist_stages'
  assert json.loads((base.with_suffix('.json')).read_text()) == json.loads(json.dumps(record))
  assert [r['stage'] for r in record['stages']] == [0, 1, 2, 3]
  assert record['synthetic'] and record['data'].startswith('SYNTHETIC')
  # Same data and seed: the same losses under every stage.
  losses = [[loss for _, loss in r['losses']] for r in record['stages']]
  # The MNIST MLP: 64 rows through 784-, 512-, 512- and 10-wide layers, 4 steps.
  tol = reordered(64 + 784 + 512 + 512 + 10, steps=4)
  assert all(np.allclose(x, losses[0], rtol=tol, atol=0) for x in losses[1:])
  # ZeRO's saving shows: stage 3 holds an eighth of stage 0's model states.
  rest = [r['states_at_rest_bytes'] for r in record['stages']]
  assert rest[3] * 8 == pytest.approx(rest[0], rel=0.01) and rest[1] < rest[0]
  table = base.with_suffix('.md').read_text()
  assert table.count('\n| ') == 5 and 'held-out accuracy' in table
  assert base.with_suffix('.png').read_bytes()[:4] == b'\x89PNG'


def test_gpt_holds_out_the_end_of_its_text(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_bytes(bytes(range(256)) * 100)
  data = gpt.load(str(path))
  window = gpt.Config().seq_len + 1
  assert len(data.train['text']) == 256 * 100 * 95 // 100
  assert data.heldout['tokens'].shape == (
    len(path.read_bytes()[len(data.train['text']) :]) // window,
    window,
  )
  assert not data.synthetic and 'real text' in data.source


def test_compare_quantized_writes_a_table_a_figure_and_json(tmp_path):
  # ZeRO++ on the GPT example: the same data and seed with full-precision,
  # int8 and int4 collectives, through zerojax.value_and_grad.
  cfg = gpt.Config(d_model=64, n_layers=2, batch=8)
  text = bytes(range(256)) * 40
  path = tmp_path / 'corpus.txt'
  path.write_bytes(text)
  record = common.compare_quantized(
    gpt.task(cfg, log_every=1), stage=3, steps=3, out_dir=str(tmp_path), data=str(path), quiet=True
  )
  base = tmp_path / 'gpt_quantized'
  assert json.loads(base.with_suffix('.json').read_text()) == json.loads(json.dumps(record))
  labels = [r['label'] for r in record['runs']]
  assert labels == [
    'full precision',
    'weights int8, gradients int8',
    'weights int8, gradients int4',
  ]
  full, int8, int4 = record['runs']
  assert 'all-to-all' not in full['collectives'] and int8['collectives']['all-to-all'] > 0
  # int8 weight gathers and int8 / int4 gradient exchanges: about a quarter of
  # the bytes, a third here where the small model's norms and biases (below
  # Quantize.min_size) stay full precision.
  assert int4['ring_bytes'] < int8['ring_bytes'] < 0.35 * full['ring_bytes']
  # The first loss is the same model on the same batch, quantized weights aside.
  # int8 rounds each weight by at most 1/254 of its block's largest magnitude: a
  # relative change of the loss below 1% (not float rounding: quantization).
  assert int8['losses'][0][1] == pytest.approx(full['losses'][0][1], rel=1e-2)
  table = base.with_suffix('.md').read_text()
  assert table.count('\n| ') == 4 and 'vs the ZeRO floor' in table
  assert base.with_suffix('.png').read_bytes()[:4] == b'\x89PNG'


def test_committed_quantized_gpt_run_is_within_two_percent():
  with open(os.path.join(EXAMPLES, 'results', 'gpt_quantized.json')) as f:
    record = json.load(f)
  assert record['steps'] == 200 and record['stage'] == 3 and not record['synthetic']
  full, *quantized = record['runs']
  for run in quantized:
    assert run['heldout_loss'] <= 1.02 * full['heldout_loss'], run['label']
    assert run['final_loss'] <= 1.02 * full['final_loss'], run['label']
    assert run['ring_bytes'] < 0.3 * full['ring_bytes']
