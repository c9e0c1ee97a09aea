"""zerojax: ZeRO (the Zero Redundancy Optimizer) for JAX, as sharding layouts.

The core is here; framework adapters, checkpoints, inspection and planning, and
multi-process helpers live in submodules, imported when first used:
`zerojax.linen`, `zerojax.nnx`, `zerojax.checkpoint`, `zerojax.inspect`,
`zerojax.distributed`.
"""

import importlib as _importlib

from zerojax._src.config import ZeroConfig as ZeroConfig
from zerojax._src.config import config_of as config_of
from zerojax._src.gather import ShardedLeaf as ShardedLeaf
from zerojax._src.gather import gather as gather
from zerojax._src.gather import recompute_gathers as recompute_gathers
from zerojax._src.grad import value_and_grad as value_and_grad
from zerojax._src.layouts import specs_of as specs_of
from zerojax._src.options import Options as Options
from zerojax._src.plan import ZeroPlan as ZeroPlan
from zerojax._src.precision import DynamicLossScale as DynamicLossScale
from zerojax._src.precision import cast as cast
from zerojax._src.precision import loss_scale as loss_scale
from zerojax._src.precision import mixed_precision as mixed_precision
from zerojax._src.prefetch import scan_layers as scan_layers
from zerojax._src.quantize import Quantize as Quantize
from zerojax._src.reduction import Sum as Sum
from zerojax._src.reduction import WeightedMean as WeightedMean
from zerojax._src.train_state import create_train_state as create_train_state
from zerojax._src.transform import apply_gradients as apply_gradients
from zerojax._src.transform import plan_for as plan_for
from zerojax._src.version import __version__ as __version__
from zerojax._src.zero_stage import zero_stage as zero_stage

__all__ = [
  # Wrap an optimizer (or a Flax TrainState), with its options, config and plan.
  'zero_stage',
  'Options',
  'ZeroConfig',
  'config_of',
  'ZeroPlan',
  'plan_for',
  'apply_gradients',
  'create_train_state',
  'specs_of',
  # Gradients, and how a loss's values combine over devices.
  'value_and_grad',
  'WeightedMean',
  'Sum',
  # Gathering stage-3 parameters where they are used, layer by layer.
  'gather',
  'ShardedLeaf',
  'recompute_gathers',
  'scan_layers',
  # Precision and ZeRO++ quantized collectives.
  'mixed_precision',
  'cast',
  'loss_scale',
  'DynamicLossScale',
  'Quantize',
]

SUBMODULES = ('linen', 'nnx', 'checkpoint', 'inspect', 'distributed', 'llama', 'remat')

# Names of zerojax 0.x before one name per concept, and where each went (CHANGELOG: 0.2.0).
MOVED = {
  'gather_params': 'zerojax.gather(params, tx)',
  'gather_leaves': 'zerojax.gather(tree, tx)',
  'gathered_linen': 'zerojax.linen.gathered(ModuleClass, tx)',
  'gathered_nnx': 'zerojax.nnx.gathered(module, tx)',
  'logical_param_specs': 'zerojax.linen.logical_param_specs',
  'create_nnx_model': 'zerojax.nnx.create_model(make_model, tx)',
  'shard_nnx': 'zerojax.nnx.shard(model, tx)',
  'nnx_plan': 'zerojax.plan_for(tx, nnx.state(model, nnx.Param))',
  'nnx_value_and_grad': 'zerojax.nnx.value_and_grad',
  'make_plan': 'zerojax.plan_for(zerojax.zero_stage(tx, stage, mesh=mesh), params)',
  'unwrap': 'zerojax.config_of(tx).inner',
  'abstract_train_state': 'zerojax.inspect.abstract_train_state',
  'Checkpointer': 'zerojax.checkpoint.Checkpointer',
  'restore_train_state': 'zerojax.checkpoint.restore_train_state',
  'export_params': 'zerojax.checkpoint.export_params',
  'format_checkpoint': 'zerojax.checkpoint.format_checkpoint',
  'initialize_distributed': 'zerojax.distributed.initialize',
  'check_mesh': 'zerojax.distributed.check_mesh',
  'global_batch': 'zerojax.distributed.global_batch',
  'process_batch_slice': 'zerojax.distributed.process_batch_slice',
  'to_numpy': 'zerojax.distributed.to_numpy',
  'estimate_memory': 'zerojax.inspect.estimate_memory',
  'MemoryEstimate': 'zerojax.inspect.MemoryEstimate',
  'format_estimates': 'zerojax.inspect.format_estimates',
  'memory_stats': 'zerojax.inspect.memory_stats',
  'MemoryStats': 'zerojax.inspect.MemoryStats',
  'step_report': 'zerojax.inspect.step_report',
  'StepReport': 'zerojax.inspect.StepReport',
  'zero_floor_bytes': 'zerojax.inspect.zero_floor_bytes',
  'count_collectives': 'zerojax.inspect.count_collectives',
  'CollectiveStats': 'zerojax.inspect.CollectiveStats',
  'search_plans': 'zerojax.inspect.search_plans',
  'SearchReport': 'zerojax.inspect.SearchReport',
  'ModelSpec': 'zerojax.inspect.ModelSpec',
  'local_tpu': 'zerojax.inspect.local_tpu',
}


def __getattr__(name: str):
  # PEP 562: the submodules are imported when first used (orbax and flax only then).
  if name in SUBMODULES:
    return _importlib.import_module(f'zerojax.{name}')
  if name in MOVED:
    raise AttributeError(
      f'zerojax.{name} is gone since zerojax 0.2: use {MOVED[name]} (see the migration table in'
      ' CHANGELOG.md).'
    )
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted([*__all__, *SUBMODULES, '__version__'])
