"""zerojax.checkpoint.load_safetensors / save_safetensors: published checkpoints in and out."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors
from _pretrained_model import CLASSES, LAYERS, NAMES, D, init_fn, published_tensors
from _read_counter import count_reads
from safetensors.numpy import load_file, save_file

import zerojax
from zerojax.checkpoint import Tensor


def _expected(tensors) -> dict:
  """The Flax tree the checkpoint stands for, built by hand from the tensors."""
  f32 = lambda a: np.asarray(a, np.float32)
  layer = lambda name: np.stack([f32(tensors[name.format(i)]) for i in range(LAYERS)])
  layerT = lambda name: np.stack([f32(tensors[name.format(i)]).T for i in range(LAYERS)])
  return {
    'embed': {'kernel': f32(tensors['enc.embed.weight']).T, 'bias': f32(tensors['enc.embed.bias'])},
    'layers': {
      'intermediate': {
        'kernel': layerT('enc.layer.{}.intermediate.weight'),
        'bias': layer('enc.layer.{}.intermediate.bias'),
      },
      'output': {
        'kernel': layerT('enc.layer.{}.output.weight'),
        'bias': layer('enc.layer.{}.output.bias'),
      },
      'norm': {'scale': layer('enc.layer.{}.norm.weight'), 'bias': layer('enc.layer.{}.norm.bias')},
    },
    'classifier': {
      'kernel': f32(tensors['classifier.weight']).T,
      'bias': f32(tensors['classifier.bias']),
    },
  }


@pytest.fixture
def folder(tmp_path):
  save_file(published_tensors(), str(tmp_path / 'model.safetensors'))
  return tmp_path


def _tx(stage, mesh):
  return zerojax.zero_stage(optax.adam(1e-3), stage, mesh=mesh, stacked={'layers': True})


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_loads_into_the_stage_layout(folder, mesh, stage):
  tx = _tx(stage, mesh)
  params = zerojax.checkpoint.load_safetensors(
    folder, init_fn, jax.random.key(0), tx=tx, names=NAMES
  )
  plan = zerojax.plan_for(tx, params)
  jax.tree.map(lambda x, s: _assert_sharding(x, s), params, plan.params)
  jax.tree.map(np.testing.assert_array_equal, params, _expected(published_tensors()))
  if stage == 3:
    assert params['layers']['intermediate']['kernel'].sharding.spec[0] is None
    assert 'data' in params['embed']['kernel'].sharding.spec


def _assert_sharding(x, s):
  assert x.sharding == s, (x.sharding, s)


def test_a_sharded_index_and_bf16_cast_to_the_model_dtype(tmp_path, mesh):
  tensors = published_tensors(ml_dtypes.bfloat16)
  names = sorted(tensors)
  save_file({n: tensors[n] for n in names[:7]}, str(tmp_path / 'model-00001-of-00002.safetensors'))
  save_file({n: tensors[n] for n in names[7:]}, str(tmp_path / 'model-00002-of-00002.safetensors'))
  weight_map = {
    n: f'model-0000{1 if i < 7 else 2}-of-00002.safetensors' for i, n in enumerate(names)
  }
  (tmp_path / 'model.safetensors.index.json').write_text(json.dumps({'weight_map': weight_map}))
  params = zerojax.checkpoint.load_safetensors(
    tmp_path, init_fn, jax.random.key(0), tx=_tx(3, mesh), names=NAMES
  )
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  jax.tree.map(np.testing.assert_array_equal, params, _expected(tensors))


def test_each_device_slice_is_read_once_and_only_its_bytes(folder, mesh):
  # At stage 3 on 8 devices of one process: every byte of the model is read exactly once
  # (slices are what the devices hold; nothing is read whole and cut up afterwards).
  read = []
  restore = count_reads(read)
  try:
    _load(folder, mesh)
  finally:
    restore()
  total = sum(a.nbytes for a in published_tensors().values())
  assert sum(n for _, n in read) == total
  # A split leaf is read in eight parts, one per device; a replicated one once.
  parts = {}
  for name, _ in read:
    parts[name] = parts.get(name, 0) + 1
  assert parts['enc.embed.weight'] == 8
  assert parts['classifier.bias'] == 1


def _load(folder, mesh, **kw):
  return zerojax.checkpoint.load_safetensors(
    folder, init_fn, jax.random.key(0), tx=_tx(3, mesh), **({'names': NAMES} | kw)
  )


def test_every_mismatch_is_listed_in_one_error_before_anything_is_placed(tmp_path, mesh):
  tensors = published_tensors()
  tensors['enc.layer.1.output.weight'] = tensors['enc.layer.1.output.weight'].T.copy()  # (H, D)
  tensors['enc.embed.bias'] = np.zeros((D + 1,), np.float32)
  tensors['classifier.bias'] = np.zeros((CLASSES,), np.int32)
  del tensors['enc.layer.2.norm.bias']
  tensors['cls.predictions.bias'] = np.zeros((5,), np.float32)
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError) as e:
    _load(tmp_path, mesh)
  assert str(e.value) == (
    'the checkpoint does not fit the model (5 problem(s)):\n'
    "  'classifier.bias' -> classifier/bias: checkpoint dtype int32 cannot be cast to the"
    " model's float32\n"
    "  'enc.embed.bias' -> embed/bias: checkpoint shape (65,), model expects (64,)\n"
    "  'enc.layer.2.norm.bias' -> layers/norm/bias: not in the checkpoint (the model expects"
    ' shape (64,))\n'
    "  'enc.layer.1.output.weight' -> layers/output/kernel: checkpoint shape (128, 64), model"
    " expects (64, 128); it matches transposed: Tensor('enc.layer.{layer}.output.weight',"
    ' transpose=False)\n'
    "  'cls.predictions.bias' -> (none): the model has no place for it (shape (5,))\n"
    'Fix the name map (zerojax.checkpoint.Tensor: name, transpose), or opt out by name:'
    ' `skip=[pattern, ...]` for checkpoint tensors not to read, `init=[pattern, ...]` for'
    ' model leaves to keep at their initial values (e.g. a new classification head).'
  )


def test_a_leaf_the_map_does_not_name_and_a_map_key_that_is_no_leaf(folder, mesh):
  partial = {k: v for k, v in NAMES.items() if k != 'classifier/bias'}
  with pytest.raises(ValueError, match=r'\(none\) -> classifier/bias: the name map gives'):
    _load(folder, mesh, names=partial)
  with pytest.raises(ValueError, match="key\\(s\\) that are not model leaves, e.g. 'head/bias'"):
    _load(folder, mesh, names=NAMES | {'head/bias': 'x'})


def test_opting_out_lists_what_was_skipped_and_left_at_init(tmp_path, mesh, caplog):
  # A new classification head: the pretraining head is skipped, the new one initialised.
  tensors = published_tensors()
  tensors['cls.predictions.bias'] = np.zeros((5,), np.float32)
  del tensors['classifier.weight'], tensors['classifier.bias']
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  with caplog.at_level(logging.INFO, logger='zerojax'):
    params = _load(tmp_path, mesh, skip=['cls.*'], init=['classifier/*'])
  said = [
    r.getMessage()
    for r in caplog.records
    if '(skip=)' in r.getMessage() or '(init=)' in r.getMessage()
  ]
  assert said == [
    'load_safetensors: 1 checkpoint tensor(s) not read (skip=): cls.predictions.bias',
    'load_safetensors: 2 model leaf(s) left at their initial values (init=):'
    ' classifier/bias, classifier/kernel',
  ]
  want = init_fn(jax.random.key(0))['classifier']
  jax.tree.map(np.testing.assert_array_equal, params['classifier'], want)
  plan = zerojax.plan_for(_tx(3, mesh), params)
  assert params['classifier']['kernel'].sharding == plan.params['classifier']['kernel']


def test_missing_shard_files_and_truncated_files_are_named(tmp_path, mesh):
  save_file(published_tensors(), str(tmp_path / 'model-00001-of-00002.safetensors'))
  index = {
    'weight_map': {
      'enc.embed.bias': 'model-00001-of-00002.safetensors',
      'enc.embed.weight': 'model-00002-of-00002.safetensors',
    }
  }
  (tmp_path / 'model.safetensors.index.json').write_text(json.dumps(index))
  with pytest.raises(FileNotFoundError) as e:
    _load(tmp_path, mesh)
  assert str(e.value) == (
    f'1 shard file(s) named in {tmp_path / "model.safetensors.index.json"} are missing from'
    f' {tmp_path}:\n  model-00002-of-00002.safetensors: 1 tensors, e.g. enc.embed.weight\n'
    'Download the whole checkpoint folder again.'
  )
  whole = tmp_path / 'whole'
  whole.mkdir()
  save_file(published_tensors(), str(whole / 'model.safetensors'))
  data = (whole / 'model.safetensors').read_bytes()
  (whole / 'model.safetensors').write_bytes(data[: len(data) // 2])
  with pytest.raises(safetensors.SafetensorError) as e:
    _load(whole, mesh)
  assert e.value.__notes__ == [
    f'{whole / "model.safetensors"} is truncated or corrupted: download it again.'
  ]


@pytest.mark.parametrize('shard_bytes', [1 << 30, 40_000])
def test_saved_parameters_read_back_by_safetensors_alone_and_by_the_loader(
  folder, tmp_path, mesh, shard_bytes
):
  params = _load(folder, mesh)
  out = tmp_path / 'out'
  files = zerojax.checkpoint.save_safetensors(params, out, names=NAMES, max_shard_bytes=shard_bytes)
  published = published_tensors()
  if shard_bytes > 1 << 20:
    assert files == [str(out / 'model.safetensors')]
  else:
    assert len(files) > 1 and (out / 'model.safetensors.index.json').exists()
    index = json.loads((out / 'model.safetensors.index.json').read_text())
    assert sorted(index['weight_map']) == sorted(published)
    assert index['metadata']['total_size'] == sum(a.nbytes for a in published.values())
  back = {}
  for f in files:
    back |= load_file(f)
  assert sorted(back) == sorted(published)
  for name, value in published.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  again = _load(out, mesh)
  jax.tree.map(np.testing.assert_array_equal, again, params)
  assert not [p for p in os.listdir(out) if p.endswith('.partial')]


@pytest.mark.slow
def test_two_processes_read_their_halves_and_get_the_one_process_parameters(folder, tmp_path):
  # 2 processes x 4 devices (JAX's distributed runtime, gloo) against 1 x 8: the same
  # parameters bit for bit, and each of the two processes reads only its devices' slices:
  # half of every split tensor, all of a replicated one.
  import socket
  import subprocess
  import sys

  from _models import child_env

  worker = os.path.join(os.path.dirname(__file__), '_pretrained_worker.py')
  env = child_env()
  one, two = tmp_path / 'one', tmp_path / 'two'
  one.mkdir(), two.mkdir()
  subprocess.run(
    [sys.executable, worker, str(folder), str(one), '8'],
    env=env,
    check=True,
    timeout=300,
    capture_output=True,
  )
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  procs = [
    subprocess.Popen(
      [sys.executable, worker, str(folder), str(two), '4', f'127.0.0.1:{port}', '2', str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  a, b = np.load(one / 'params.npz'), np.load(two / 'params.npz')
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert a[k].tobytes() == b[k].tobytes(), k
  specs = json.loads((two / 'specs.json').read_text())
  assert json.loads((one / 'specs.json').read_text()) == specs
  # What each process should read, from the layout: half of a split leaf, all of another.
  published = published_tensors()
  by_leaf = {k: v for k, v in NAMES.items()}
  want = {}
  for leaf, spec in specs.items():
    path = '/'.join(part.strip("[]'") for part in leaf.split('][')).strip("[]'")
    tensor = by_leaf[path] if isinstance(by_leaf[path], Tensor) else Tensor(by_leaf[path])
    for name in tensor.names(LAYERS):
      want[name] = published[name].nbytes // (2 if "'data'" in spec else 1)
  total = sum(a.nbytes for a in published.values())
  for process in (0, 1):
    reads = json.loads((two / f'reads-{process}.json').read_text())
    assert reads == want, process
  assert sum(want.values()) < 0.6 * total
  single = json.loads((one / 'reads-0.json').read_text())
  assert single == {n: a.nbytes for n, a in published.items()}
  # Saved by process 0 of two: the same files as one process writes.
  assert load_file(str(two / 'saved' / 'model.safetensors')).keys() == published.keys()
  for name, value in load_file(str(two / 'saved' / 'model.safetensors')).items():
    np.testing.assert_array_equal(value, published[name], err_msg=name)
