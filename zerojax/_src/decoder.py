"""The decoder-only transformer zerojax trains and plans: the Llama family's architecture
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; Qwen2's query/key/value biases,
Qwen3's query/key norms, Mistral's sliding window) and GPT-2's GELU MLP, in plain JAX over a
parameter pytree.

Its blocks' parameters are stacked along a leading layer axis and run under `jax.lax.scan`, each
block gathering its own ZeRO shards just before use (cast to the compute dtype on the way) and,
with `remat`, dropping them after and gathering them again in the backward pass: per-layer
ZeRO-3, the layout the memory formulas assume. Its activations carry the names the remat and
offload policies keep (`POLICIES`). The planner's presets are this model
(`zerojax._src.planner.presets`); `hf_decoder` reads Hugging Face's checkpoints into it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import flash, gather, packing, prefetch, qbase
from zerojax._src import lora as lora_lib
from zerojax._src import plan as plan_lib
from zerojax._src.attention import chunked_attention as chunked_attention
from zerojax._src.attention import xla_attention
from zerojax._src.remat_policies import (
  ATTENTION_OUT,
  ATTENTION_RESIDUAL,
  LAYER_INPUT,
  MLP_HIDDEN,
  QKV,
  REMAT,
  remat_policy,
)
from zerojax._src.rope import Rope, rotate


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Shape of a decoder-only transformer.

  Attributes:
    vocab: vocabulary size.
    d_model: width of the residual stream.
    n_layers: number of blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (fewer than `n_heads`: grouped-query attention).
    d_ff: width of the MLP.
    seq_len: default sequence length.
    gated: SwiGLU MLP (LLaMA) rather than GELU (GPT-2).
    head_size: width of each attention head; None: `d_model // n_heads`. MaxText's
      family keeps 128 at any width, so its attention width `n_heads * head_size`
      need not be `d_model`.
    norm_eps: the RMSNorms' epsilon (`rms_norm_eps`).
    rope: rotary position embeddings of the queries and keys (the Llama family's, and the
      planner's gated presets'); None: none (GPT-2's presets, which learn no positions
      either: position-free).
    qkv_bias: biases on the query, key and value projections (Qwen2).
    out_bias: a bias on the attention's output projection (Llama's `attention_bias`).
    qk_norm: an RMSNorm of each query and key head, before the rotation (Qwen3).
    tied_head: the head is the embedding transposed (no parameter of its own).
    sliding_window: each position attends to this many positions, itself included (Mistral);
      None: every earlier position.
    lora: LoRA adapters on the projections it names (`zerojax.llama.LoraConfig`), in
      `params['layers']['lora']`; None: none.
  """

  vocab: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  seq_len: int
  gated: bool
  head_size: int | None = None
  norm_eps: float = 1e-6
  rope: Rope | None = None
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: bool = False
  tied_head: bool = False
  sliding_window: int | None = None
  lora: lora_lib.LoraConfig | None = None

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.n_heads

  def param_specs(self, tensor: str) -> dict[str, Any]:
    """Megatron-style tensor-parallel PartitionSpecs over mesh axis `tensor`: the query,
    key, value, gate and input projections split by output (heads, MLP columns), the
    output projections by input, the embedding and the head by vocabulary; norms whole.

    Raises:
      ValueError: a split that does not divide (named with the fix) is left to
        `check_tensor`; this only writes the specs.
    """
    P = jax.sharding.PartitionSpec
    cols, rows = P(None, None, tensor), P(None, tensor, None)
    layers = {
      'attn_norm': P(),
      'mlp_norm': P(),
      'wq': cols,
      'wk': cols,
      'wv': cols,
      'wo': rows,
      'w_in': cols,
      'w_out': rows,
    }
    if self.gated:
      layers['w_gate'] = cols
    layers |= {k: P(None, tensor) for k in self._extra_layer_leaves() if k in ('bq', 'bk', 'bv')}
    layers |= {k: P() for k in self._extra_layer_leaves() if k not in ('bq', 'bk', 'bv')}
    if self.lora is not None:
      layers[lora_lib.KEY] = lora_lib.specs(self.lora, tensor)
    top = {'embed': P(tensor, None), 'layers': layers, 'final_norm': P()}
    return top if self.tied_head else top | {'head': P(None, tensor)}

  def _extra_layer_leaves(self) -> dict[str, int]:
    """The Llama family's optional per-layer leaves and their widths."""
    q, kv, out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, {}
    if self.qkv_bias:
      out |= {'bq': q, 'bk': kv, 'bv': kv}
    if self.out_bias:
      out['bo'] = self.d_model
    if self.qk_norm:
      out |= {'q_norm': self.head_dim, 'k_norm': self.head_dim}
    return out

  def check_tensor(self, size: int) -> None:
    """Raises ValueError unless a tensor-parallel axis of `size` divides the heads, the
    key/value heads, the MLP width and the vocabulary (naming each that it does not)."""
    dims = {
      'n_heads': self.n_heads,
      'n_kv_heads': self.n_kv_heads,
      'd_ff': self.d_ff,
      'vocab': self.vocab,
    }
    bad = [f'{k}={v}' for k, v in dims.items() if v % size]
    if bad:
      raise ValueError(
        f'a tensor axis of {size} does not divide {", ".join(bad)}: pick a tensor size that'
        f' divides each (e.g. a divisor of {math.gcd(*dims.values())}), or drop the tensor axis.'
      )

  def shapes(self) -> dict[str, Any]:
    """Parameter shapes; block parameters carry a leading layer axis."""
    L, d, f = self.n_layers, self.d_model, self.d_ff
    q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    layers = {
      'attn_norm': (L, d),
      'wq': (L, d, q),
      'wk': (L, d, kv),
      'wv': (L, d, kv),
      'wo': (L, q, d),
      'mlp_norm': (L, d),
      'w_in': (L, d, f),
      'w_out': (L, f, d),
    }
    if self.gated:
      layers['w_gate'] = (L, d, f)
    layers |= {k: (L, width) for k, width in self._extra_layer_leaves().items()}
    if self.lora is not None:
      layers[lora_lib.KEY] = lora_lib.shapes(self.lora, layers)
    top = {'embed': (self.vocab, d), 'layers': layers, 'final_norm': (d,)}
    return top if self.tied_head else top | {'head': (d, self.vocab)}

  def stacked(self) -> dict[str, bool]:
    """Which top-level parameters are stacked layers (`zerojax.zero_stage(stacked=...)`)."""
    return {k: k == 'layers' for k in self.shapes()}

  def num_params(self) -> int:
    leaves = jax.tree.leaves(self.shapes(), is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(s) for s in leaves)


# The per-layer biases (Qwen2's query/key/value, Llama's `attention_bias` output).
BIASES = ('bq', 'bk', 'bv', 'bo')


def init_decoder(cfg: DecoderConfig, key: jax.Array, dtype=jnp.float32) -> dict[str, Any]:
  """Initialises the parameters: normal(0, 0.02) matrices, unit norms, zero biases; LoRA
  adapters as PEFT does (`lora.init`: B = 0, so the model is the base's)."""
  if cfg.lora is not None:
    key, adapters = jax.random.split(key)
    params = init_decoder(dataclasses.replace(cfg, lora=None), key, dtype)
    shaped = cfg.shapes()['layers'][lora_lib.KEY]
    params['layers'][lora_lib.KEY] = lora_lib.init(cfg.lora, shaped, adapters, dtype)
    return params
  shapes = cfg.shapes()
  leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(leaves))
  out = []
  for k, (path, shape) in zip(keys, leaves):
    name = jax.tree_util.keystr(path)
    if 'norm' in name:
      out.append(jnp.ones(shape, dtype))
    elif path[-1].key in BIASES:
      out.append(jnp.zeros(shape, dtype))
    else:
      out.append(0.02 * jax.random.normal(k, shape, dtype))
  return jax.tree.unflatten(treedef, out)


def _rms_norm(x, scale, eps: float = 1e-6):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def _named(x, name: str):
  return jax.ad_checkpoint.checkpoint_name(x, name)


def _no_constraint(x, kind: str):
  del kind
  return x


def tensor_constraint(plan: plan_lib.ZeroPlan, tensor: str = 'tensor'):
  """Activation layouts for a mesh with a tensor-parallel axis: the batch over the replica
  axes (several slices) and the ZeRO axes, and over `tensor` the residual stream's width, the
  heads and the MLP's columns (as MaxText lays them out), so that no activation a block keeps
  is whole on a chip."""
  P, axes = jax.sharding.PartitionSpec, plan.replica_axes + plan.axes
  specs = {
    'residual': P(axes, None, tensor),
    'heads': P(axes, None, tensor, None),
    'hidden': P(axes, None, tensor),
  }

  def constrain(x, kind: str):
    # Inside zerojax.value_and_grad the ZeRO axes are manual: the constraint names the rest.
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), 'manual_axes', ()))
    if manual:
      spec = gather.free_spec(specs[kind], manual, None) or P()
      return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(plan.mesh, specs[kind]))

  return constrain


# How the presets compute attention: 'xla' (plain JAX: all queries at once, or
# `attention_chunk` at a time) or 'flash' (`flash.flash_attention`, fused Pallas kernels
# on TPU: MaxText's choice).
ATTENTION = ('xla', 'flash')


def _flash_attention(plan: plan_lib.ZeroPlan | None):
  """Flash attention, run per device under `plan`'s mesh (a Pallas kernel is not split by
  the compiler): the heads over a tensor-parallel 'tensor' axis and the batch over every other
  axis (the ZeRO axes and any replica axis), in `jax.shard_map` over the axes not already
  manual (inside `zerojax.value_and_grad`)."""
  if plan is None:
    return flash.flash_attention
  mesh = plan.mesh
  interpret = mesh.devices.flat[0].platform != 'tpu'
  attend = functools.partial(flash.flash_attention, interpret=interpret)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), 'manual_axes', ()))
  free = [a for a in mesh.axis_names if a not in manual]
  if not free:
    return attend
  if manual:  # nested in zerojax.value_and_grad's shard_map: the context's mesh
    mesh = jax.sharding.get_abstract_mesh()
  tensor = 'tensor' if 'tensor' in free and 'tensor' not in plan.axes else None
  batch = tuple(a for a in free if a != tensor) or None
  spec = jax.sharding.PartitionSpec(batch, None, tensor, None)
  return jax.shard_map(
    attend,
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=spec,
    axis_names=set(free),
    check_vma=False,
  )


def _projection(cfg: DecoderConfig, h, p, name: str, heads: int, constrain, key=None, pos=None):
  """One of the query, key and value projections, (batch, seq, heads, head_dim): its bias
  (Qwen2), its per-head norm (Qwen3) and its rotation added where the config has them."""
  b, t, _ = h.shape
  y = lora_lib.project(h, p, 'w' + name, cfg.lora, key)
  if 'b' + name in p:
    y = y + p['b' + name]
  y = y.reshape(b, t, heads, cfg.head_dim)
  if name in 'qk' and cfg.qk_norm:
    y = _rms_norm(y, p[name + '_norm'], cfg.norm_eps)
  if name in 'qk' and cfg.rope is not None:
    y = rotate(y, cfg.rope, positions=pos)
  return _named(constrain(y, 'heads'), QKV)


def _block(cfg: DecoderConfig, x, p, attend, constrain=_no_constraint, key=None, pos=None):
  """One block; `key` draws the LoRA adapters' dropout (None: none); `pos`: each token's
  rotary position (batch, seq), for packed rows (None: 0, 1, ...)."""
  b, t, _ = x.shape
  proj = functools.partial(lora_lib.project, lora=cfg.lora, key=key)
  x = _named(constrain(x, 'residual'), LAYER_INPUT)
  h = _rms_norm(x, p['attn_norm'], cfg.norm_eps)
  q = _projection(cfg, h, p, 'q', cfg.n_heads, constrain, key, pos)
  k = _projection(cfg, h, p, 'k', cfg.n_kv_heads, constrain, key, pos)
  v = _projection(cfg, h, p, 'v', cfg.n_kv_heads, constrain, key)
  attn = _named(attend(q, k, v), ATTENTION_OUT)
  out = proj(attn.reshape(b, t, cfg.n_heads * cfg.head_dim), p, 'wo')
  if 'bo' in p:
    out = out + p['bo']
  x = constrain(x + out, 'residual')
  x = _named(x, ATTENTION_RESIDUAL)
  h = _rms_norm(x, p['mlp_norm'], cfg.norm_eps)
  if cfg.gated:
    gate = _named(constrain(proj(h, p, 'w_gate'), 'hidden'), MLP_HIDDEN)
    h = jax.nn.silu(gate) * _named(constrain(proj(h, p, 'w_in'), 'hidden'), MLP_HIDDEN)
  else:
    h = jax.nn.gelu(_named(constrain(proj(h, p, 'w_in'), 'hidden'), MLP_HIDDEN))
  return constrain(x + proj(h, p, 'w_out'), 'residual')


GatherFn = Callable[[Any, str, bool], Any]


def plan_gather(plan: plan_lib.ZeroPlan, compute_dtype=None) -> GatherFn:
  """A `decoder_loss` gather hook that all-gathers ZeRO shards per `plan`."""

  def gather_fn(tree, group: str, scanned: bool):
    layouts = plan.params['layers'] if group == 'layers' else {k: plan.params[k] for k in tree}
    return gather.gather(tree, plan, layouts=layouts, scanned=scanned, dtype=compute_dtype)

  return gather_fn


def _gathered_top(params: dict, gather_fn: GatherFn | None, per_layer: bool):
  """(params with the top-level leaves laid out for use, and the layers too unless gathered
  per layer; the gather still to run per layer, or None)."""
  if gather_fn is None:
    return params, None
  top = gather_fn({k: v for k, v in params.items() if k != 'layers'}, 'top', False)
  if not per_layer:
    return dict(top, layers=gather_fn(params['layers'], 'layers', False)), None
  return dict(top, layers=params['layers']), gather_fn


def _split_layers(params: dict) -> bool:
  """Whether any layer leaf rests split (a `ShardedLeaf`, inside `value_and_grad`)."""
  leaves = jax.tree.leaves(params['layers'], is_leaf=gather.is_sharded_leaf)
  return any(gather.is_sharded_leaf(x) for x in leaves)


def _layer_loop(block, x, layers, gather_fn: GatherFn | None, remat: str, keys=None):
  """The blocks as one `lax.scan`, each gathering its layer (if `gather_fn`) and
  rematerialised per `remat`; `keys`, one per layer, draw each block's dropout."""

  def body(x, xs):
    layer, key = xs
    if gather_fn is not None:
      layer = gather_fn(layer, 'layers', True)
    return (block(x, layer) if key is None else block(x, layer, key)), None

  if remat != 'none':
    body = jax.checkpoint(body, policy=remat_policy(remat))
  x, _ = jax.lax.scan(body, x, (layers, keys))
  return x


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
  """How `decoder_loss`, `decoder_hidden` and `decoder_logits` run the decoder: one record,
  checked in one place (the planner's `ModelSettings` holds one too).

  Attributes:
    plan: the ZeRO plan; when given, parameters are gathered where used.
    gather_fn: instead of `plan`, a function (tree, 'top' or 'layers',
      scanned) -> tree that lays parameters out for use.
    compute_dtype: dtype of the matrix multiplies (parameters are cast before
      they are gathered).
    remat: what each block recomputes in the backward pass: 'full' (the
      default) drops its gathered parameters and activations and recomputes
      them; 'gathers' (`zerojax.recompute_gathers`) drops only the gathered
      parameters and gathers them again; a policy of `POLICIES` keeps the
      activations it names ('minimal', as MaxText's: the query, key, value and MLP
      input projections) and recomputes the rest, its 'offload' names moved to
      host memory in the forward pass and back in the backward; 'none' keeps
      everything.
    per_layer: gather each block's parameters inside the scan; False gathers
      the whole model up front (simple, and ZeRO-3 then saves nothing at peak).
    prefetch_next: inside `zerojax.value_and_grad(per_layer=True)` with
      `remat`, run the blocks through `zerojax.scan_layers`: block i+1's
      parameters are gathered while block i computes (one more block's
      parameters live at a time).
    attention_chunk: compute attention this many queries at a time
      (`chunked_attention`; one chunk's scores live at a time); None: at once.
    attention: 'xla' (plain JAX, `attention_chunk` applies) or 'flash'
      (`zerojax._src.flash.flash_attention`: fused Pallas kernels, causal
      blocks skipped, scores never in HBM; TPU, or Pallas's interpreter elsewhere).
    loss_chunk: compute the head's logits and the cross-entropy this many positions at a
      time (`chunked_cross_entropy`: one chunk's f32 logits live at a time); None: at once.
    lean_head: gather the head only after the layer loop (its shards pass an optimization
      barrier beside the loop's output, so the compiler cannot start the gather earlier) and
      take each target's logit with a one-hot mask (`one_hot_cross_entropy`) rather than a
      gather, whose backward scatters into f32 logits kept live through the step. The same
      loss; less memory at the step's peak. `loss_chunk` has its own cross-entropy.
    dropout_key: a PRNG key for the LoRA adapters' dropout (`LoraConfig.dropout`), one draw
      per layer (the key folded with the layer's index); None (evaluation): no dropout.
    segment_ids: packed rows (batch, seq) of ints, equal within one example: attention stays
      within each example and rotary positions restart at each (`zerojax.llama.pack`).
    loss_weights: `decoder_loss` only: each token's weight as a target, shaped like its
      tokens (SFT: 1 on completions, 0 on prompts and padding).

  Raises:
    ValueError: an option's value, named (`remat`, `attention`, `attention_chunk` under flash,
      `prefetch_next` with a policy, `loss_chunk`).
  """

  plan: plan_lib.ZeroPlan | None = None
  gather_fn: GatherFn | None = None
  compute_dtype: Any = jnp.bfloat16
  remat: str = 'full'
  per_layer: bool = True
  prefetch_next: bool = False
  attention_chunk: int | None = None
  attention: str = 'xla'
  loss_chunk: int | None = None
  lean_head: bool = False
  dropout_key: Any = None
  segment_ids: Any = None
  loss_weights: Any = None

  def __post_init__(self):
    remat, attention, loss_chunk = self.remat, self.attention, self.loss_chunk
    if remat not in REMAT:
      raise ValueError(f'decoder_loss: remat must be one of {REMAT}, got {remat!r}.')
    if attention not in ATTENTION:
      raise ValueError(f'decoder_loss: attention must be one of {ATTENTION}, got {attention!r}.')
    if attention == 'flash' and self.attention_chunk:
      raise ValueError(
        "decoder_loss: attention_chunk is for attention='xla'; flash attention works in blocks"
        ' of its own.'
      )
    if self.prefetch_next and remat not in ('gathers', 'full', 'none'):
      raise ValueError(
        f"decoder_loss: prefetch_next runs remat 'gathers' or 'full', not {remat!r}: its layer"
        ' loop (zerojax.scan_layers) keeps no named activations.'
      )
    if self.segment_ids is not None and attention == 'flash':
      raise ValueError(
        "decoder_loss: segment_ids (packed rows) under attention='flash': zerojax's flash"
        " kernels do not yet mask between examples; use attention='xla' (with"
        ' attention_chunk=... for memory), which does.'
      )
    if self.dropout_key is not None and self.prefetch_next:
      raise ValueError(
        'decoder_loss: dropout_key draws in the layer loop of lax.scan; prefetch_next runs'
        " zerojax.scan_layers' loop, which takes no keys: drop one of them."
      )
    if loss_chunk is not None and (not isinstance(loss_chunk, int) or loss_chunk < 1):
      raise ValueError(f'decoder_loss: loss_chunk must be a whole number >= 1, got {loss_chunk!r}.')

  def as_kwargs(self) -> dict[str, Any]:
    """The record as `decoder_loss`'s keyword arguments."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def of(cls, where: str, options: dict) -> DecoderOptions:
    """The record of keyword arguments `options`, an unknown keyword named with the known ones.

    Raises:
      TypeError: a keyword that is not an option.
    """
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in options if k not in known]
    if unknown:
      raise TypeError(f'{where}: no option {unknown[0]!r}; the options are {known}.')
    return cls(**options)


def decoder_loss(
  params: dict[str, Any], tokens: jax.Array, cfg: DecoderConfig, **options: Any
) -> jax.Array:
  """Next-token cross-entropy of `tokens` (batch, seq + 1).

  Args:
    params: from `init_decoder`, laid out as `plan.params`.
    tokens: int32 token ids.
    cfg: the model's shape.
    **options: `DecoderOptions`' fields (`plan=`, `compute_dtype=`, `remat=`, `attention=`,
      `loss_chunk=`, `lean_head=`...). Here `segment_ids` and `loss_weights` are shaped like
      `tokens`: packed rows, and each token's weight as a target (0 for a prompt's).

  Returns:
    The mean over every target; with `segment_ids` or `loss_weights`, a
    `zerojax.WeightedMean` of the targets' weighted sum over their total weight (targets of
    another example than their input's weigh 0), which `zerojax.value_and_grad` combines
    over devices exactly (`.value` outside it).
  """
  o = DecoderOptions.of('decoder_loss', options)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  weights = packing.target_weights(tokens, o.segment_ids, o.loss_weights)
  if o.segment_ids is not None:
    o = dataclasses.replace(o, segment_ids=o.segment_ids[:, :-1])
  x, head = _hidden(params, inputs, cfg, o)
  if o.loss_chunk and o.loss_chunk < x.shape[1]:
    return chunked_cross_entropy(x, head, targets, o.loss_chunk, weights)
  logits = (x @ head).astype(jnp.float32)
  if o.lean_head:
    return one_hot_cross_entropy(logits, targets, weights)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)
  if weights is None:
    return -jnp.mean(picked)
  return packing.mean_of(-picked[..., 0], weights)


def decoder_hidden(
  params: dict[str, Any], inputs: jax.Array, cfg: DecoderConfig, **options: Any
) -> tuple[jax.Array, jax.Array]:
  """(the final norm's output (batch, seq, d_model), the head (d_model, vocab)), both in
  `compute_dtype`, for token ids `inputs` (batch, seq); the options as `decoder_loss`'s
  (`DecoderOptions`; `loss_chunk` is the loss's and is not used here).
  Raises ValueError for a sliding window shorter than the sequence under flash attention."""
  return _hidden(params, inputs, cfg, DecoderOptions.of('decoder_hidden', options))


def _hidden(params: dict[str, Any], inputs: jax.Array, cfg: DecoderConfig, o: DecoderOptions):
  t = inputs.shape[1]
  if o.attention == 'flash' and cfg.sliding_window is not None and cfg.sliding_window < t:
    raise ValueError(
      f"sliding_window={cfg.sliding_window} under {t} positions: flash attention's kernels"
      " attend to every earlier position; use attention='xla' (attention_chunk for memory)."
    )
  plan, gather_fn, compute_dtype = o.plan, o.gather_fn, o.compute_dtype
  if plan is not None:
    gather_fn = plan_gather(plan, compute_dtype)
  late_gather = gather_fn if o.lean_head and 'head' in params else None
  head = params.get('head')
  if late_gather is not None:
    params = {k: v for k, v in params.items() if k != 'head'}
  params, gather_fn = _gathered_top(params, gather_fn, o.per_layer)
  constrain = _no_constraint
  if plan is not None and 'tensor' in plan.mesh.axis_names and 'tensor' not in plan.axes:
    constrain = tensor_constraint(plan)
  cast = lambda t: qbase.floating_cast(t, compute_dtype)
  x = jnp.take(cast(params['embed']), inputs, axis=0)
  pos = None if o.segment_ids is None else packing.positions_of(o.segment_ids)
  if o.attention == 'flash':
    attend = _flash_attention(plan)
  else:
    attend = xla_attention(o.attention_chunk, cfg.sliding_window, o.segment_ids)
  block = lambda x, layer, key=None: _block(cfg, x, cast(layer), attend, constrain, key, pos)
  if o.prefetch_next and plan is not None and o.remat != 'none' and _split_layers(params):
    # Inside zerojax.value_and_grad(per_layer=True): the same rematerialised
    # loop, with layer i+1's gather issued while layer i computes.
    x = prefetch.scan_layers(
      lambda x, layer: _block(cfg, x, cast(layer), attend, pos=pos),
      x,
      params['layers'],
      plan,
      dtype=compute_dtype,
      remat=o.remat,
    )
  else:
    keys = None
    if o.dropout_key is not None and cfg.lora is not None and cfg.lora.dropout > 0:
      keys = jax.vmap(functools.partial(jax.random.fold_in, o.dropout_key))(
        jnp.arange(cfg.n_layers)
      )
    x = _layer_loop(block, x, params['layers'], gather_fn, o.remat, keys)
  if late_gather is not None:
    x, head = jax.lax.optimization_barrier((x, head))
    params = dict(params, head=late_gather({'head': head}, 'top', False)['head'])
  x = _rms_norm(x, params['final_norm'], cfg.norm_eps)
  head = cast(params['embed']).T if cfg.tied_head else cast(params['head'])
  return x, head


def decoder_logits(
  params: dict[str, Any], inputs: jax.Array, cfg: DecoderConfig, **kw
) -> jax.Array:
  """float32 logits (batch, seq, vocab) of token ids `inputs` (batch, seq); the keywords as
  `decoder_hidden`'s (plan=, compute_dtype=, remat=, attention=, ...)."""
  x, head = decoder_hidden(params, inputs, cfg, **kw)
  return (x @ head).astype(jnp.float32)


def one_hot_cross_entropy(logits: jax.Array, targets: jax.Array, weights=None) -> Any:
  """Mean of logsumexp(logits) - logits[target] over positions, the target's logit taken by
  a one-hot mask: elementwise forward and backward, no gather of `logits` (batch, seq, vocab)
  and no scatter into its gradient. With `weights` (batch, seq): their `WeightedMean`."""
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
  return packing.mean_of(jax.nn.logsumexp(logits, axis=-1) - picked, weights)


def chunked_cross_entropy(x, head, targets, chunk: int, weights=None):
  """Mean next-token cross-entropy of `x @ head` against `targets`, `chunk` positions at a
  time, each chunk rematerialised: the logits of one chunk (batch, chunk, vocab) are live at a
  time, forward and backward, never those of the whole sequence.

  The same arithmetic as `log_softmax` over all the logits in f32 (a sum of the same
  per-token terms, taken in another order). With `weights` (batch, seq): their `WeightedMean`.

  Raises:
    ValueError: `chunk` does not divide the sequence length.
  """
  b, t, d = x.shape
  if t % chunk:
    raise ValueError(f'loss_chunk={chunk} does not divide the sequence length {t}.')

  w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights

  @jax.checkpoint
  def one(args):
    xi, ti, wi = args
    logits = (xi @ head).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, ti[..., None], axis=-1)[..., 0]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * wi)

  xs = x.reshape(b, t // chunk, chunk, d).swapaxes(0, 1)
  ts, ws = (a.reshape(b, t // chunk, chunk).swapaxes(0, 1) for a in (targets, w))
  total = jnp.sum(jax.lax.map(one, (xs, ts, ws)))
  return total / (b * t) if weights is None else packing.WeightedMean(total, jnp.sum(w))
