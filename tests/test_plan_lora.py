"""`python -m zerojax plan --lora R --base-dtype nf4|int8|bf16`: a LoRA or QLoRA step planned
as zerojax.llama's decoder trains it (the adapters alone, the base frozen and stored as asked),
its state and ZeRO floor counted for frozen leaves, and bad combinations refused by name."""

import jax
import numpy as np
import pytest
from _models import run_cli

from zerojax._src import lora as lora_lib
from zerojax._src import qbase
from zerojax._src.planner import cli, search

SMALL = (
  'decoder:vocab=512,d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,d_ff=256,seq_len=128,gated=true'
)


def _plan(*flags):
  target, candidate, hbm = cli.plan_target(['--topology', 'cpu:8', '--model', SMALL, *flags])
  return target, search.evaluate(target, candidate, hbm_bytes=hbm, keep=True)


def _size(x) -> int:
  return int(np.prod(x.shape))


@pytest.mark.parametrize('stage', [1, 3])
@pytest.mark.parametrize('base', ['nf4', 'int8', 'bf16'])
def test_a_lora_plan_holds_state_for_the_adapters_alone(base, stage):
  target, result = _plan('--lora', '4', '--base-dtype', base, '--stage', str(stage))
  assert result.error is None and result.priced is not None
  cfg = target.model
  assert cfg.lora == lora_lib.LoraConfig(4, 8.0, ('q', 'k', 'v', 'o', 'gate', 'up', 'down'))
  assert target.settings.base_dtype == base
  params = result.lowered.state.params
  layers = params['layers']
  for w in lora_lib.PROJECTIONS:
    if base == 'bf16':
      assert layers[w].dtype == jax.numpy.bfloat16
    else:
      assert isinstance(layers[w], qbase.QuantizedWeight) and layers[w].kind == base
  adapters = sum(_size(x) for x in jax.tree.leaves(layers[lora_lib.KEY]))
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(layers[lora_lib.KEY]))
  # AdamW's two f32 moments for the adapters, split over the 8 devices from stage 1; its count.
  sizes = result.lowered.plan.bytes_per_device()
  assert sizes['opt_state'] == 2 * adapters * 4 // 8 + 4
  assert sizes['grads'] == adapters * 4 // (8 if stage >= 2 else 1)


def _floor(plan, unit: int, n: int = 8) -> float:
  """The floor written from the stage table: trainable values reduced (and gathered below
  stage 3), every parameter gathered twice at stage 3 (floating ones in the compute dtype,
  the quantized base's codes and scales as stored)."""
  rows = [r for r in plan.rows if r.group == 'params']
  trained = sum(_size(r) for r in rows if not r.frozen) * unit
  if plan.stage < 3:
    return 2 * trained * (n - 1) / n
  stored = sum(
    _size(r) * (unit if np.issubdtype(r.dtype, np.floating) else np.dtype(r.dtype).itemsize)
    for r in rows
  )
  return (2 * stored + trained) * (n - 1) / n


@pytest.mark.parametrize('stage', [1, 3])
def test_the_floor_of_a_qlora_step_counts_no_frozen_gradient(stage):
  _, result = _plan('--lora', '4', '--base-dtype', 'nf4', '--stage', str(stage))
  report = result.priced.report
  plan = result.lowered.plan
  assert report.frozen_params == sum(
    _size(r) for r in plan.rows if r.group == 'params' and r.frozen
  )
  assert report.floor_bytes == pytest.approx(_floor(plan, result.lowered.unit))
  # The compiled step moves at least its floor, and no full-model gradient reduction: under
  # 2x the floor, where reducing the frozen base's gradients too would be several times it.
  assert report.floor_bytes <= result.ring_bytes < 2 * report.floor_bytes
  text = str(report)
  assert 'trained values reduced' in text and 'frozen' in text


@pytest.mark.parametrize(
  'flags, message',
  [
    (
      ['--base-dtype', 'nf4'],
      'error: --base-dtype stores the frozen base of a LoRA model: give --lora R.',
    ),
    (['--lora', '4', '--lora-targets', 'q,embed'], 'error: --lora-targets:'),
    (['--lora', '4', '--base-dtype', 'fp8'], "argument --base-dtype: invalid choice: 'fp8'"),
  ],
)
def test_a_lora_flag_that_cannot_work_is_refused_by_name(flags, message):
  proc = run_cli('plan', '--topology', 'cpu:8', '--model', SMALL, *flags)
  assert proc.returncode != 0
  assert message in proc.stderr.replace('"', "'"), proc.stderr[-2000:]


def test_lora_on_a_users_own_model_names_its_spelling():
  proc = run_cli('plan', '--topology', 'cpu:8', '--model', '_custom_model:spec', '--lora', '4')
  assert proc.returncode != 0
  assert 'zerojax.inspect.ModelSpec(trainable=...)' in proc.stderr, proc.stderr[-2000:]


def _bench():
  import sys
  from pathlib import Path

  folder = str(Path(__file__).resolve().parent.parent / 'benchmarks')
  sys.path.insert(0, folder)
  try:
    import bench_one_chip_lora
  finally:
    sys.path.remove(folder)
  return bench_one_chip_lora


def test_the_lora_table_rows_are_named_and_checked():
  pytest.importorskip('libtpu', reason='the benchmark compiles for TPU (the tpu extra)')
  bench = _bench()
  assert bench.parse_rows('v5e-1:8B:qlora,v6e-1:70B:qlora+params') == [
    ('v5e-1', '8B', 'qlora'),
    ('v6e-1', '70B', 'qlora+params'),
  ]
  with pytest.raises(ValueError, match="unknown setting 'qlora4'; choose from"):
    bench.parse_rows('v5e-1:8B:qlora4')
  with pytest.raises(ValueError, match='is not runtime:shape:setting'):
    bench.parse_rows('v5e-1:8B')
  # The 70B shape is Llama 3.1 70B's published config.
  cfg = bench.zerojax.llama.config_from_hf(bench.SHAPES['70B'][1])
  assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == (
    8192,
    80,
    64,
    8,
    28672,
  )
  assert 70.4e9 < cfg.num_params() < 70.7e9
