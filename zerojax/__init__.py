"""zerojax: ZeRO (the Zero Redundancy Optimizer) for JAX, as sharding layouts."""

from zerojax._src.checkpoint import Checkpointer as Checkpointer
from zerojax._src.checkpoint import export_params as export_params
from zerojax._src.checkpoint import format_checkpoint as format_checkpoint
from zerojax._src.checkpoint import restore_train_state as restore_train_state
from zerojax._src.distributed import check_mesh as check_mesh
from zerojax._src.distributed import global_batch as global_batch
from zerojax._src.distributed import initialize as initialize_distributed
from zerojax._src.distributed import process_batch_slice as process_batch_slice
from zerojax._src.distributed import to_numpy as to_numpy
from zerojax._src.estimate import MemoryEstimate as MemoryEstimate
from zerojax._src.estimate import estimate_memory as estimate_memory
from zerojax._src.estimate import format_estimates as format_estimates
from zerojax._src.gather import ShardedLeaf as ShardedLeaf
from zerojax._src.gather import gather_params as gather_params
from zerojax._src.gather import recompute_gathers as recompute_gathers
from zerojax._src.grad import value_and_grad as value_and_grad
from zerojax._src.hlo import CollectiveStats as CollectiveStats
from zerojax._src.hlo import count_collectives as count_collectives
from zerojax._src.layers import gather_leaves as gather_leaves
from zerojax._src.layers import gathered_linen as gathered_linen
from zerojax._src.layers import gathered_nnx as gathered_nnx
from zerojax._src.logical import logical_param_specs as logical_param_specs
from zerojax._src.nnx_state import create_nnx_model as create_nnx_model
from zerojax._src.nnx_state import nnx_plan as nnx_plan
from zerojax._src.nnx_state import nnx_value_and_grad as nnx_value_and_grad
from zerojax._src.nnx_state import shard_nnx as shard_nnx
from zerojax._src.plan import ZeroPlan as ZeroPlan
from zerojax._src.precision import DynamicLossScale as DynamicLossScale
from zerojax._src.precision import cast as cast
from zerojax._src.precision import loss_scale as loss_scale
from zerojax._src.precision import mixed_precision as mixed_precision
from zerojax._src.prefetch import scan_layers as scan_layers
from zerojax._src.presets import ModelSpec as ModelSpec
from zerojax._src.quantize import Quantize as Quantize
from zerojax._src.reduction import WeightedMean as WeightedMean
from zerojax._src.report import MemoryStats as MemoryStats
from zerojax._src.report import StepReport as StepReport
from zerojax._src.report import memory_stats as memory_stats
from zerojax._src.report import step_report as step_report
from zerojax._src.report import zero_floor_bytes as zero_floor_bytes
from zerojax._src.search import SearchReport as SearchReport
from zerojax._src.search import search_plans as search_plans
from zerojax._src.tpu import local_tpu as local_tpu
from zerojax._src.train_state import abstract_train_state as abstract_train_state
from zerojax._src.train_state import create_train_state as create_train_state
from zerojax._src.transform import ZeroConfig as ZeroConfig
from zerojax._src.transform import config_of as config_of
from zerojax._src.transform import make_plan as make_plan
from zerojax._src.transform import plan_for as plan_for
from zerojax._src.transform import unwrap as unwrap
from zerojax._src.version import __version__ as __version__
from zerojax._src.zero_stage import zero_stage as zero_stage

__all__ = [
  'value_and_grad',
  'search_plans',
  'SearchReport',
  'nnx_value_and_grad',
  'WeightedMean',
  'Checkpointer',
  'export_params',
  'format_checkpoint',
  'restore_train_state',
  'check_mesh',
  'global_batch',
  'initialize_distributed',
  'process_batch_slice',
  'to_numpy',
  'DynamicLossScale',
  'cast',
  'loss_scale',
  'mixed_precision',
  'logical_param_specs',
  'MemoryEstimate',
  'StepReport',
  'estimate_memory',
  'format_estimates',
  'step_report',
  'zero_floor_bytes',
  'CollectiveStats',
  'MemoryStats',
  'count_collectives',
  'memory_stats',
  'local_tpu',
  'ZeroConfig',
  'ZeroPlan',
  'ModelSpec',
  'Quantize',
  'abstract_train_state',
  'config_of',
  'create_train_state',
  'gather_params',
  'recompute_gathers',
  'ShardedLeaf',
  'scan_layers',
  'make_plan',
  'plan_for',
  'unwrap',
  'zero_stage',
]
