"""Flax linen: modules whose parameters are gathered where they run, and logical axis names.

- `gathered(ModuleClass, tx)`: the module class, with its 'params' gathered
  (`zerojax.gather`) each time it runs; wrap the block of a scanned model.
- `logical_param_specs(params, rules)`: mesh PartitionSpecs from
  `nn.with_logical_partitioning` names, for `zero_stage(param_specs=...)`.
"""

from zerojax._src.linen import gathered as gathered
from zerojax._src.linen import logical_param_specs as logical_param_specs

__all__ = ['gathered', 'logical_param_specs']
