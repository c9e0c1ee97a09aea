"""Decoder-only transformer presets (GPT-2 sizes, LLaMA-2 shapes) for planning.

A plain-JAX decoder over a parameter pytree: its blocks' parameters are stacked
along a leading layer axis and run under `jax.lax.scan`, each block gathering its
own ZeRO shards just before use (cast to the compute dtype on the way) and,
with `remat`, dropping them after and gathering them again in the backward pass:
per-layer ZeRO-3, the layout the memory formulas assume.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import gather, prefetch
from zerojax._src import plan as plan_lib


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
  """

  vocab: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  seq_len: int
  gated: bool

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def shapes(self) -> dict[str, Any]:
    """Parameter shapes; block parameters carry a leading layer axis."""
    L, d, f = self.n_layers, self.d_model, self.d_ff
    kv = self.n_kv_heads * self.head_dim
    layers = {
      'attn_norm': (L, d),
      'wq': (L, d, d),
      'wk': (L, d, kv),
      'wv': (L, d, kv),
      'wo': (L, d, d),
      'mlp_norm': (L, d),
      'w_in': (L, d, f),
      'w_out': (L, f, d),
    }
    if self.gated:
      layers['w_gate'] = (L, d, f)
    return {'embed': (self.vocab, d), 'layers': layers, 'final_norm': (d,), 'head': (d, self.vocab)}

  def num_params(self) -> int:
    leaves = jax.tree.leaves(self.shapes(), is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(s) for s in leaves)


PRESETS: dict[str, DecoderConfig] = {
  # Vocabularies rounded up to a multiple of 128, as trainers do for speed.
  'tiny': DecoderConfig(256, 128, 4, 4, 4, 512, 64, gated=False),
  'gpt2-small': DecoderConfig(50304, 768, 12, 12, 12, 3072, 1024, gated=False),
  'gpt2-medium': DecoderConfig(50304, 1024, 24, 16, 16, 4096, 1024, gated=False),
  'gpt2-large': DecoderConfig(50304, 1280, 36, 20, 20, 5120, 1024, gated=False),
  'gpt2-xl': DecoderConfig(50304, 1600, 48, 25, 25, 6400, 1024, gated=False),
  'llama2-7b': DecoderConfig(32000, 4096, 32, 32, 32, 11008, 4096, gated=True),
  'llama2-13b': DecoderConfig(32000, 5120, 40, 40, 40, 13824, 4096, gated=True),
  'llama2-70b': DecoderConfig(32000, 8192, 80, 64, 8, 28672, 4096, gated=True),
}


def init_decoder(cfg: DecoderConfig, key: jax.Array, dtype=jnp.float32) -> dict[str, Any]:
  """Initialises the parameters: normal(0, 0.02) matrices, unit norms."""
  shapes = cfg.shapes()
  leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(leaves))
  out = []
  for k, (path, shape) in zip(keys, leaves):
    name = jax.tree_util.keystr(path)
    if 'norm' in name:
      out.append(jnp.ones(shape, dtype))
    else:
      out.append(0.02 * jax.random.normal(k, shape, dtype))
  return jax.tree.unflatten(treedef, out)


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def chunked_attention(q, k, v, chunk: int):
  """Causal attention computed `chunk` queries at a time, each chunk rematerialised.

  The same arithmetic as `jax.nn.dot_product_attention(q, k, v, is_causal=True)`
  (every chunk scores against all keys, masked), but only one chunk's scores
  (batch, heads, chunk, keys) are live at a time, forward and backward: a
  memory-efficient formulation in plain JAX, as flash attention kernels are in
  fused form.
  """
  b, t, h, d = q.shape
  if t % chunk:
    raise ValueError(f'attention_chunk={chunk} does not divide the sequence length {t}.')
  keys = jnp.arange(k.shape[1])

  @jax.checkpoint
  def one(args):
    i, qi = args
    rows = i * chunk + jnp.arange(chunk)
    mask = (rows[:, None] >= keys[None, :])[None, None]
    return jax.nn.dot_product_attention(qi, k, v, mask=mask)

  chunks = q.reshape(b, t // chunk, chunk, h, d).swapaxes(0, 1)
  out = jax.lax.map(one, (jnp.arange(t // chunk), chunks))
  return out.swapaxes(0, 1).reshape(b, t, h, d)


def _block(cfg: DecoderConfig, x, p, attention_chunk: int | None = None):
  b, t, _ = x.shape
  h = _rms_norm(x, p['attn_norm'])
  q = (h @ p['wq']).reshape(b, t, cfg.n_heads, cfg.head_dim)
  k = (h @ p['wk']).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  v = (h @ p['wv']).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  if attention_chunk and attention_chunk < t:
    attn = chunked_attention(q, k, v, attention_chunk)
  else:
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  x = x + attn.reshape(b, t, cfg.d_model) @ p['wo']
  h = _rms_norm(x, p['mlp_norm'])
  if cfg.gated:
    h = jax.nn.silu(h @ p['w_gate']) * (h @ p['w_in'])
  else:
    h = jax.nn.gelu(h @ p['w_in'])
  return x + h @ p['w_out']


GatherFn = Callable[[Any, str, bool], Any]


def plan_gather(plan: plan_lib.ZeroPlan, compute_dtype=None) -> GatherFn:
  """A `decoder_loss` gather hook that all-gathers ZeRO shards per `plan`."""

  def gather_fn(tree, group: str, scanned: bool):
    layouts = plan.params['layers'] if group == 'layers' else {k: plan.params[k] for k in tree}
    return gather.gather(tree, plan, layouts=layouts, scanned=scanned, dtype=compute_dtype)

  return gather_fn


# What a block recomputes in the backward pass (the plan search's `remat` too).
REMAT = ('gathers', 'full', 'none')


def decoder_loss(
  params: dict[str, Any],
  tokens: jax.Array,
  cfg: DecoderConfig,
  *,
  plan: plan_lib.ZeroPlan | None = None,
  gather_fn: GatherFn | None = None,
  compute_dtype=jnp.bfloat16,
  remat: str = 'full',
  per_layer: bool = True,
  prefetch_next: bool = False,
  attention_chunk: int | None = None,
) -> jax.Array:
  """Next-token cross-entropy of `tokens` (batch, seq + 1).

  Args:
    params: from `init_decoder`, laid out as `plan.params`.
    tokens: int32 token ids.
    cfg: the model's shape.
    plan: the ZeRO plan; when given, parameters are gathered where used.
    gather_fn: instead of `plan`, a function (tree, 'top' or 'layers',
      scanned) -> tree that lays parameters out for use.
    compute_dtype: dtype of the matrix multiplies (parameters are cast before
      they are gathered).
    remat: what each block recomputes in the backward pass: 'full' (the
      default) drops its gathered parameters and activations and recomputes
      them; 'gathers' (`zerojax.recompute_gathers`) drops only the gathered
      parameters and gathers them again; 'none' keeps everything.
    per_layer: gather each block's parameters inside the scan; False gathers
      the whole model up front (simple, and ZeRO-3 then saves nothing at peak).
    prefetch_next: inside `zerojax.value_and_grad(per_layer=True)` with
      `remat`, run the blocks through `zerojax.scan_layers`: block i+1's
      parameters are gathered while block i computes (one more block's
      parameters live at a time).
    attention_chunk: compute attention this many queries at a time
      (`chunked_attention`; one chunk's scores live at a time); None: at once.
  """
  if remat not in REMAT:
    raise ValueError(f'decoder_loss: remat must be one of {REMAT}, got {remat!r}.')
  if plan is not None:
    gather_fn = plan_gather(plan, compute_dtype)
  if gather_fn is not None and not per_layer:
    params = dict(
      gather_fn({k: v for k, v in params.items() if k != 'layers'}, 'top', False),
      layers=gather_fn(params['layers'], 'layers', False),
    )
    gather_fn = None
  elif gather_fn is not None:
    params = dict(
      gather_fn({k: v for k, v in params.items() if k != 'layers'}, 'top', False),
      layers=params['layers'],
    )
  cast = lambda t: jax.tree.map(lambda x: x.astype(compute_dtype), t)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  x = jnp.take(cast(params['embed']), inputs, axis=0)

  def body(x, layer):
    if gather_fn is not None:
      layer = gather_fn(layer, 'layers', True)
    return _block(cfg, x, cast(layer), attention_chunk), None

  if (
    prefetch_next
    and plan is not None
    and remat != 'none'
    and any(
      gather.is_sharded_leaf(x)
      for x in jax.tree.leaves(params['layers'], is_leaf=gather.is_sharded_leaf)
    )
  ):
    # Inside zerojax.value_and_grad(per_layer=True): the same rematerialised
    # loop, with layer i+1's gather issued while layer i computes.
    x = prefetch.scan_layers(
      lambda x, layer: _block(cfg, x, cast(layer), attention_chunk),
      x,
      params['layers'],
      plan,
      dtype=compute_dtype,
      remat=remat,
    )
  else:
    if remat != 'none':
      policy = gather.recompute_gathers if remat == 'gathers' else None
      body = jax.checkpoint(body, policy=policy or jax.checkpoint_policies.nothing_saveable)
    x, _ = jax.lax.scan(body, x, params['layers'])
  x = _rms_norm(x, params['final_norm'])
  logits = (x @ cast(params['head'])).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model for `python -m zerojax plan --model package.module:function`.

  The function named on the command line returns one; the planner builds the
  train state abstractly from `init_fn`, differentiates `loss_fn` and compiles
  the step for the topology asked for.

  Attributes:
    name: for reports.
    init_fn: key -> parameter tree.
    loss_fn: (params, batch, plan) -> scalar loss; gathers its own parameters
      (e.g. `zerojax.gather(params, plan)`, or per layer).
    batch: a function of the global batch size returning the batch's
      ShapeDtypeStruct (without sharding).

  >>> import jax, jax.numpy as jnp, zerojax
  >>> spec = zerojax.inspect.ModelSpec(
  ...     name='linear',
  ...     init_fn=lambda key: {'w': jax.random.normal(key, (64, 64))},
  ...     loss_fn=lambda p, x, plan: jnp.mean(x @ zerojax.gather(p, plan)['w']),
  ...     batch=lambda rows: jax.ShapeDtypeStruct((rows, 64), jnp.float32))
  >>> spec.batch(16).shape
  (16, 64)
  """

  name: str
  init_fn: Callable[[jax.Array], Any]
  loss_fn: Callable[[Any, Any, plan_lib.ZeroPlan], jax.Array]
  batch: Callable[[int], jax.ShapeDtypeStruct]


def decoder_spec(
  name: str,
  *,
  seq_len: int | None = None,
  compute_dtype=jnp.bfloat16,
  remat: str = 'full',
  per_layer: bool = True,
  prefetch_next: bool = False,
  attention_chunk: int | None = None,
) -> ModelSpec:
  """A `ModelSpec` for a preset in `PRESETS`.

  Raises:
    ValueError: for an unknown preset name.
  """
  if name not in PRESETS:
    raise ValueError(f'`model`={name!r} is not a preset; choose one of {sorted(PRESETS)}.')
  cfg = PRESETS[name]
  seq = seq_len or cfg.seq_len
  loss = functools.partial(
    decoder_loss,
    cfg=cfg,
    compute_dtype=compute_dtype,
    remat=remat,
    per_layer=per_layer,
    prefetch_next=prefetch_next,
    attention_chunk=attention_chunk,
  )
  return ModelSpec(
    name=name,
    init_fn=functools.partial(init_decoder, cfg),
    loss_fn=lambda params, tokens, plan: loss(params, tokens, plan=plan),
    batch=lambda global_batch: jax.ShapeDtypeStruct((global_batch, seq + 1), jnp.int32),
  )
