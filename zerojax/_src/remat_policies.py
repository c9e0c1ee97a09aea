"""The remat vocabulary: the names a layer tags its activations with, the policies that keep or
offload them, and how each is spelled in a training loop. `zerojax.remat` exposes it; the
decoder (`decoder.py`) and the planner use it."""

from __future__ import annotations

import jax

from zerojax._src import gather

# Names a block gives its activations (`jax.ad_checkpoint.checkpoint_name`) for the remat
# policies below (docs/planner.md has their table): the query, key and value projections, the
# attention's output, the MLP's hidden activations, and the block's input, which the layer loop
# keeps for every layer (layers x batch x seq x d_model) unless a policy offloads that stack.
# ATTENTION_RESIDUAL is the residual stream after the attention (the MLP norm's input): a policy
# that keeps it need not run the output projection again in the backward pass.
QKV, ATTENTION_OUT, MLP_HIDDEN = 'zerojax_qkv', 'zerojax_attention', 'zerojax_mlp_hidden'
LAYER_INPUT, ATTENTION_RESIDUAL = 'zerojax_layer_input', 'zerojax_attention_residual'
_MINIMAL_INPUTS = (QKV, MLP_HIDDEN, LAYER_INPUT)
# What each policy keeps for the backward pass (the rest is recomputed) and what it offloads.
POLICIES = {
  'minimal': dict(save=(QKV, MLP_HIDDEN)),  # MaxText's 'minimal'
  'save_qkv': dict(save=(QKV,)),
  'save_attention': dict(save=(ATTENTION_OUT,)),
  'save_qkv_attention': dict(save=(QKV, ATTENTION_OUT)),
  'save_mlp': dict(save=(MLP_HIDDEN,)),
  'offload_qkv': dict(offload=(QKV,)),
  'offload_minimal': dict(offload=(QKV, MLP_HIDDEN)),
  'save_qkv_offload_mlp': dict(save=(QKV,), offload=(MLP_HIDDEN,)),
  'save_attention_offload_minimal': dict(save=(ATTENTION_OUT,), offload=(QKV, MLP_HIDDEN)),
  'offload_all': dict(offload=(QKV, ATTENTION_OUT, MLP_HIDDEN)),
  'offload_layer_inputs': dict(offload=(LAYER_INPUT,)),  # 'full', the stack on the host
  'offload_minimal_inputs': dict(offload=_MINIMAL_INPUTS),
  'save_attention_offload_minimal_inputs': dict(save=(ATTENTION_OUT,), offload=_MINIMAL_INPUTS),
  'minimal_residual': dict(save=(QKV, MLP_HIDDEN, ATTENTION_RESIDUAL)),
  'offload_minimal_residual': dict(offload=(QKV, MLP_HIDDEN, ATTENTION_RESIDUAL)),
  'offload_all_residual': dict(offload=(QKV, ATTENTION_OUT, MLP_HIDDEN, ATTENTION_RESIDUAL)),
}


def policy_names(remat: str) -> tuple[str, ...]:
  """The activation names a remat policy keeps or offloads (none for 'gathers', 'full' and
  'none'): what a model must tag (`jax.ad_checkpoint.checkpoint_name`) for the policy to keep
  anything.

  >>> policy_names('minimal')
  ('zerojax_qkv', 'zerojax_mlp_hidden')
  """
  if remat not in REMAT:
    raise ValueError(f'remat {remat!r}: choose one of {REMAT}.')
  kept = POLICIES.get(remat, {})
  return tuple(dict.fromkeys((*kept.get('save', ()), *kept.get('offload', ()))))


def remat_policy(remat: str):
  """The `jax.checkpoint` policy of a remat name ('gathers', 'full' or one of `POLICIES`):
  `jax.checkpoint(layer, policy=remat_policy('offload_minimal'))` keeps (or moves to host
  memory) the activations the layer tags with the names `policy_names` gives, and recomputes
  the rest in the backward pass. ('none' keeps everything: no `jax.checkpoint` at all.)"""
  if remat not in REMAT or remat == 'none':
    raise ValueError(
      f"remat {remat!r}: choose one of {REMAT[:-1]} (for 'none', call the layer without"
      ' jax.checkpoint).'
    )
  if remat == 'gathers':
    return gather.recompute_gathers
  if remat == 'full':
    return jax.checkpoint_policies.nothing_saveable
  kept = POLICIES[remat]
  if not kept.get('offload'):
    return jax.checkpoint_policies.save_only_these_names(*kept['save'])
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=list(kept.get('save', ())),
    names_which_can_be_offloaded=list(kept['offload']),
    offload_src='device',
    offload_dst='pinned_host',
  )


def policy_code(remat: str) -> str:
  """How a training loop spells a remat name's layer loop (for a search winner's lines)."""
  fixed = {
    'gathers': 'policy=zerojax.recompute_gathers',
    'full': 'a full jax.checkpoint',
    'none': 'no rematerialisation',
  }
  if remat in fixed:
    return fixed[remat]
  kept = POLICIES[remat]
  tagged = ' (activations tagged with jax.ad_checkpoint.checkpoint_name)'
  if not kept.get('offload'):
    names = ', '.join(repr(n) for n in kept['save'])
    return f'policy=jax.checkpoint_policies.save_only_these_names({names})' + tagged
  return (
    'policy=jax.checkpoint_policies.save_and_offload_only_these_names('
    f'names_which_can_be_saved={list(kept.get("save", ()))!r},'
    f' names_which_can_be_offloaded={list(kept["offload"])!r},'
    " offload_src='device', offload_dst='pinned_host')" + tagged
  )


def offloads_activations(remat: str) -> bool:
  """Whether a remat policy moves saved activations to host memory."""
  return bool(POLICIES.get(remat, {}).get('offload'))


# What a block recomputes in the backward pass (the plan search's `remat` too).
REMAT = ('gathers', 'full', *POLICIES, 'none')
