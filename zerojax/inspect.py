"""Before launching: what fits in memory, and what the collectives cost.

From theory (no device needed):
- `estimate_memory(params, tx, num_devices=N)`: bytes per device of each stage.

An abstract train state (nothing allocated) to compile against:
- `abstract_train_state(init_fn, key, tx=...)`.

A wrapped state's layouts for `jax.jit(in_shardings=..., out_shardings=...)`:
- `jit_shardings(state)`, and `check_jit_shardings(shardings, state)`, which says in
  zerojax's words why shardings taken elsewhere (before the wrap) do not fit.

From a compiled step (`jax.jit(step).lower(...).compile()`), on any backend
or for a TPU topology with no TPU:
- `step_report(compiled, plan=...)`: memory and collectives beside the ZeRO floor.
- `memory_stats(compiled)`, `count_collectives(compiled)`, `zero_floor_bytes(...)`.

Choosing a configuration:
- `search_plans(model, topology)`: every candidate compiled ahead of time and
  ranked (also `python -m zerojax plan --search`); `ModelSpec` describes a model
  of your own; `local_tpu()` names the TPU this machine has, if any. The presets'
  attention, for a `ModelSpec` of your own: `chunked_attention(q, k, v, chunk)` (a chunk of
  queries at a time) and `flash_attention(q, k, v)` (fused Pallas kernels on TPU).
"""

from zerojax._src.flash import flash_attention as flash_attention
from zerojax._src.planner.collectives import CollectiveStats as CollectiveStats
from zerojax._src.planner.collectives import count_collectives as count_collectives
from zerojax._src.planner.estimate import MemoryEstimate as MemoryEstimate
from zerojax._src.planner.estimate import estimate_memory as estimate_memory
from zerojax._src.planner.estimate import format_estimates as format_estimates
from zerojax._src.planner.host_link import count_host_transfers as count_host_transfers
from zerojax._src.planner.presets import ModelSpec as ModelSpec
from zerojax._src.planner.presets import chunked_attention as chunked_attention
from zerojax._src.planner.report import MemoryStats as MemoryStats
from zerojax._src.planner.report import StepReport as StepReport
from zerojax._src.planner.report import memory_stats as memory_stats
from zerojax._src.planner.report import step_report as step_report
from zerojax._src.planner.report import zero_floor_bytes as zero_floor_bytes
from zerojax._src.planner.search import SearchReport as SearchReport
from zerojax._src.planner.search import search_plans as search_plans
from zerojax._src.planner.tpu import local_tpu as local_tpu
from zerojax._src.train_state import abstract_train_state as abstract_train_state
from zerojax._src.train_state import check_jit_shardings as check_jit_shardings
from zerojax._src.train_state import jit_shardings as jit_shardings

__all__ = [
  'abstract_train_state',
  'jit_shardings',
  'check_jit_shardings',
  'estimate_memory',
  'MemoryEstimate',
  'format_estimates',
  'step_report',
  'StepReport',
  'memory_stats',
  'MemoryStats',
  'count_collectives',
  'count_host_transfers',
  'CollectiveStats',
  'zero_floor_bytes',
  'search_plans',
  'SearchReport',
  'ModelSpec',
  'chunked_attention',
  'flash_attention',
  'local_tpu',
]
