"""LoRA adapters on the decoder's projections (Hu et al., 2021), as Hugging Face PEFT defines
them: a projection `y = x @ W` gains `scale * (x @ A) @ B`, with A (in, rank), B (rank, out),
`scale = alpha / rank` (`alpha / sqrt(rank)` with rsLoRA), dropout on the adapter's input only.
A starts as PEFT's (Kaiming-uniform, PyTorch's `nn.Linear` default: U(-1/sqrt(in), 1/sqrt(in)))
and B as zeros, so step 0 is the base model.

The adapters live in the parameter tree beside the weights they adapt, stacked along the layer
axis like them: `params['layers']['lora'][w] = {'a': (L, in, rank), 'b': (L, rank, out)}`, so the
scanned layer loop slices and gathers them with their layer. `is_adapter` says which leaves they
are, for `zero_stage(trainable=...)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import qbase

# The decoder's projections, by the short names LoRA configs use, and PEFT's module names.
TARGETS: Mapping[str, str] = {
  'q': 'wq',
  'k': 'wk',
  'v': 'wv',
  'o': 'wo',
  'gate': 'w_gate',
  'up': 'w_in',
  'down': 'w_out',
}
PEFT_MODULES: Mapping[str, str] = {
  'q': 'self_attn.q_proj',
  'k': 'self_attn.k_proj',
  'v': 'self_attn.v_proj',
  'o': 'self_attn.o_proj',
  'gate': 'mlp.gate_proj',
  'up': 'mlp.up_proj',
  'down': 'mlp.down_proj',
}
# Projections split by their input dimension under tensor parallelism (the rest by output).
ROW_SPLIT = ('wo', 'w_out')
KEY = 'lora'


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which projections get adapters, and their rank, alpha and dropout (PEFT's `LoraConfig`).

  Attributes:
    rank: the adapters' rank r (PEFT's `r`).
    alpha: PEFT's `lora_alpha`; the adapter's output is scaled by alpha / rank.
    targets: any of 'q', 'k', 'v', 'o', 'gate', 'up', 'down' (PEFT's `q_proj` ... `down_proj`
      are read too); default the attention's four.
    dropout: the rate of dropout on the adapters' input (PEFT's `lora_dropout`); applied only
      where the loss is given a key (`dropout_key=`).
    rslora: scale by alpha / sqrt(rank) (PEFT's `use_rslora`).

  >>> LoraConfig(rank=8, alpha=16, targets=('q_proj', 'v')).targets
  ('q', 'v')
  """

  rank: int
  alpha: float
  targets: tuple[str, ...] = ('q', 'k', 'v', 'o')
  dropout: float = 0.0
  rslora: bool = False

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f'LoraConfig(rank=...) must be a whole number >= 1, got {self.rank!r}.')
    if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
      raise ValueError(f'LoraConfig(alpha=...) must be a number > 0, got {self.alpha!r}.')
    if not 0 <= self.dropout < 1:
      raise ValueError(f'LoraConfig(dropout=...) must be in [0, 1), got {self.dropout!r}.')
    if isinstance(self.targets, str):
      raise TypeError(
        f'LoraConfig(targets=...) is a tuple of names, got the string {self.targets!r}; write'
        f' targets=({self.targets!r},).'
      )
    short = tuple(_short_name(t) for t in self.targets)
    if not short or len(set(short)) != len(short):
      raise ValueError(f'LoraConfig(targets={self.targets!r}): name each projection once.')
    order = tuple(t for t in TARGETS if t in short)
    object.__setattr__(self, 'targets', order)

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

  @property
  def weights(self) -> tuple[str, ...]:
    """The decoder's weight names that get adapters ('wq', ...)."""
    return tuple(TARGETS[t] for t in self.targets)


def _short_name(name: str) -> str:
  if name in TARGETS:
    return name
  for short, module in PEFT_MODULES.items():
    if name == module.split('.')[-1]:
      return short
  raise ValueError(
    f"LoraConfig: no projection {name!r}; the targets are {list(TARGETS)} (or PEFT's"
    f' {[m.split(".")[-1] for m in PEFT_MODULES.values()]}).'
  )


def shapes(lora: LoraConfig, base: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
  """The adapters' shapes, from the stacked base weights' `base` (name -> (L, in, out)).

  Raises:
    ValueError: a target the model does not have (e.g. 'gate' on a GELU MLP).
  """
  missing = [t for t, w in zip(lora.targets, lora.weights) if w not in base]
  if missing:
    raise ValueError(
      f'LoraConfig(targets=...): this model has no {missing} projection (a GELU MLP has no'
      " 'gate'); choose among those it has."
    )
  out = {}
  for w in lora.weights:
    layers, din, dout = base[w]
    out[w] = {'a': (layers, din, lora.rank), 'b': (layers, lora.rank, dout)}
  return out


def specs(lora: LoraConfig, tensor: str) -> dict[str, Any]:
  """Tensor-parallel layouts of the adapters: laid out like their base weight where that
  saves a collective, else whole (they are small). A column-split weight (split by output)
  has its B split by output too, so the adapter's output lands split as the base's does, and
  its A whole; a row-split one (`wo`, `w_out`, split by input) has its A split by input, so it
  reads the split input where it lies (the rank-sized partial sums are added by the compiler,
  with the base's), and its B whole."""
  P = jax.sharding.PartitionSpec
  whole, rows, cols = P(), P(None, tensor, None), P(None, None, tensor)
  return {
    w: {'a': rows, 'b': whole} if w in ROW_SPLIT else {'a': whole, 'b': cols} for w in lora.weights
  }


def init(lora: LoraConfig, shaped: Mapping[str, Any], key: jax.Array, dtype=jnp.float32) -> dict:
  """PEFT's initialisation: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a = sqrt(5),
  as PEFT's `init_lora_weights=True`), B = 0: the adapted model starts as the base."""
  keys = jax.random.split(key, len(shaped))
  out = {}
  for k, (w, s) in zip(keys, shaped.items()):
    bound = 1.0 / math.sqrt(s['a'][1])
    a = jax.random.uniform(k, s['a'], jnp.float32, -bound, bound).astype(dtype)
    out[w] = {'a': a, 'b': jnp.zeros(s['b'], dtype)}
  return out


# The projections whose weights QLoRA stores quantized (every Linear of a block).
PROJECTIONS = ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_in', 'w_out')


def quantized_base(params: Mapping[str, Any], kind: str) -> dict[str, Any]:
  """The decoder's parameters with every block projection's weight stored quantized as `kind`
  ('nf4' or 'int8', `qbase.quantize`); one already quantized is kept."""
  layers = dict(params['layers'])
  for w in PROJECTIONS:
    if w in layers and not qbase.is_quantized(layers[w]):
      layers[w] = qbase.quantize(layers[w], kind)
  return {**params, 'layers': layers}


def is_adapter(path: tuple, leaf: Any = None) -> bool:
  """Whether the parameter at key path `path` is a LoRA adapter: the predicate for
  `zero_stage(trainable=zerojax.llama.is_adapter)`, which freezes everything else."""
  del leaf
  return any(getattr(k, 'key', None) == KEY for k in path)


def project(h: jax.Array, p: Mapping[str, Any], name: str, lora: LoraConfig | None, key=None):
  """`h @ p[name]` (a stored quantized weight dequantized to `h`'s dtype first), plus its
  adapter's `scale * (dropout(h) @ A) @ B` where `p` has one."""
  y = qbase.matmul(h, p[name])
  adapters = p.get(KEY) if lora is not None else None
  if adapters is None or name not in adapters:
    return y
  x = h
  if key is not None and lora.dropout > 0:
    keep = jax.random.bernoulli(
      jax.random.fold_in(key, lora.weights.index(name)), 1 - lora.dropout, h.shape
    )
    x = jnp.where(keep, h / (1 - lora.dropout), 0).astype(h.dtype)
  a, b = adapters[name]['a'], adapters[name]['b']
  return y + ((x @ a) @ b * jnp.asarray(lora.scale, y.dtype)).astype(y.dtype)


def merged(params: Mapping[str, Any], lora: LoraConfig) -> dict[str, Any]:
  """The parameters with each adapter folded into its weight (W + scale * A @ B, in float32,
  rounded to W's dtype; a quantized W dequantized, the sum kept in float32) and the adapters
  dropped: the base model's tree, for `zerojax.llama.save` (a full checkpoint transformers
  reads). Quantized weights without an adapter are dequantized too."""
  layers = dict(params['layers'])
  adapters = layers.pop(KEY)
  for w in [k for k, v in layers.items() if qbase.is_quantized(v)]:
    layers[w] = qbase.dequantize(layers[w], jnp.float32)
  for w, ab in adapters.items():
    base = layers[w]
    delta = jnp.einsum('lir,lro->lio', ab['a'].astype(jnp.float32), ab['b'].astype(jnp.float32))
    layers[w] = (base.astype(jnp.float32) + lora.scale * delta).astype(base.dtype)
  return {**params, 'layers': layers}
