"""Flax NNX: models created in their ZeRO layout, gathered where they run, and differentiated.

- `create_model(make_model, tx)`: creates a model directly in `tx`'s layout.
- `shard(model, tx)`: places an existing model's parameters in it.
- `gathered(module, tx)`: a copy of a module (a layer) with its parameters gathered.
- `value_and_grad(loss_fn, tx)`: `zerojax.value_and_grad` for `loss_fn(model, batch)`.
- `logical_param_specs(model, rules)`: mesh layouts from `nnx.with_partitioning`'s logical
  axis names, for `zero_stage(param_specs=...)`.
- `Optimizer(model, tx, wrt=...)`: `nnx.Optimizer` whose `update` keeps offloaded stage-3
  parameters' update in host memory (`zerojax.apply_gradients`).
"""

from zerojax._src.nnx_state import Optimizer as Optimizer
from zerojax._src.nnx_state import create_model as create_model
from zerojax._src.nnx_state import gathered as gathered
from zerojax._src.nnx_state import logical_param_specs as logical_param_specs
from zerojax._src.nnx_state import shard as shard
from zerojax._src.nnx_state import value_and_grad as value_and_grad

__all__ = [
  'Optimizer',
  'create_model',
  'gathered',
  'logical_param_specs',
  'shard',
  'value_and_grad',
]
