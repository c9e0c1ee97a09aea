"""Rematerialisation and activation-offload policies by name, for any model.

A layer tags its activations with the names below (`jax.ad_checkpoint.checkpoint_name(x,
zerojax.remat.QKV)`), and `jax.checkpoint(layer, policy=zerojax.remat.policy('minimal'))` keeps
those a policy names in HBM (or, for an `offload_` policy, in host memory between the forward
and the backward pass) and recomputes the rest. `zerojax.llama`'s decoder tags all of them,
and `python -m zerojax plan --remat NAME` (and the plan search) take the same names, for its
presets and for a model of your own that tags its activations.

- `QKV`: the query, key and value projections; `ATTENTION_OUT`: the attention's output;
  `MLP_HIDDEN`: the MLP's hidden activations (gate and input projections); `LAYER_INPUT`: each
  layer's input; `ATTENTION_RESIDUAL`: the residual stream after the attention.
- `POLICIES`: each named policy's kept (`save`) and offloaded (`offload`) names; `NAMES`: every
  remat name the planner takes ('gathers', 'full', the policies, 'none').
- `policy(name)`: the `jax.checkpoint` policy; `names(name)`: what it needs tagged.
"""

from zerojax._src.remat_policies import ATTENTION_OUT as ATTENTION_OUT
from zerojax._src.remat_policies import ATTENTION_RESIDUAL as ATTENTION_RESIDUAL
from zerojax._src.remat_policies import LAYER_INPUT as LAYER_INPUT
from zerojax._src.remat_policies import MLP_HIDDEN as MLP_HIDDEN
from zerojax._src.remat_policies import POLICIES as POLICIES
from zerojax._src.remat_policies import QKV as QKV
from zerojax._src.remat_policies import REMAT as NAMES
from zerojax._src.remat_policies import policy_names as names
from zerojax._src.remat_policies import remat_policy as policy

__all__ = [
  'policy',
  'names',
  'POLICIES',
  'NAMES',
  'QKV',
  'ATTENTION_OUT',
  'MLP_HIDDEN',
  'LAYER_INPUT',
  'ATTENTION_RESIDUAL',
]
