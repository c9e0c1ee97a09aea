"""The planner's models: decoder presets (GPT-2 sizes, Llama 2 shapes) of zerojax's decoder
(`zerojax._src.decoder`), how a plan computes them (`ModelSettings`), and `ModelSpec`, a model
of the user's own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zerojax._src import lora as lora_lib
from zerojax._src import plan as plan_lib
from zerojax._src.decoder import ATTENTION as ATTENTION
from zerojax._src.decoder import DecoderConfig as DecoderConfig
from zerojax._src.decoder import DecoderOptions as DecoderOptions
from zerojax._src.decoder import Rope as Rope
from zerojax._src.decoder import chunked_attention as chunked_attention
from zerojax._src.decoder import chunked_cross_entropy as chunked_cross_entropy
from zerojax._src.decoder import decoder_loss as decoder_loss
from zerojax._src.decoder import init_decoder as init_decoder
from zerojax._src.decoder import one_hot_cross_entropy as one_hot_cross_entropy
from zerojax._src.remat_policies import ATTENTION_OUT as ATTENTION_OUT
from zerojax._src.remat_policies import ATTENTION_RESIDUAL as ATTENTION_RESIDUAL
from zerojax._src.remat_policies import MLP_HIDDEN as MLP_HIDDEN
from zerojax._src.remat_policies import POLICIES as POLICIES
from zerojax._src.remat_policies import QKV as QKV
from zerojax._src.remat_policies import REMAT as REMAT
from zerojax._src.remat_policies import offloads_activations as offloads_activations
from zerojax._src.remat_policies import policy_code as policy_code
from zerojax._src.remat_policies import remat_policy as remat_policy

# The revision of the presets' programs, which every committed TPU result records
# (`model_revision`; absent: 1), so that a result compiled before a change to what the presets
# compute is told from one compiled after it. 1: the presets were position-free; 2: the gated
# (Llama-shaped) presets, and `decoder:` shapes, rotate their queries and keys (`rotate`: in
# the activations' dtype, the halves swapped by a product with a signed permutation).
MODEL_REVISION = 2

# Llama 2's rotary embedding and norm epsilon (its config.json: rope_theta 10000, rms_norm_eps
# 1e-5); GPT-2's presets learn no positions here (position-free).
_LLAMA2: dict[str, Any] = {'rope': Rope(10000.0), 'norm_eps': 1e-5}

PRESETS: dict[str, DecoderConfig] = {
  # Vocabularies rounded up to a multiple of 128, as trainers do for speed.
  'tiny': DecoderConfig(256, 128, 4, 4, 4, 512, 64, gated=False),
  'gpt2-small': DecoderConfig(50304, 768, 12, 12, 12, 3072, 1024, gated=False),
  'gpt2-medium': DecoderConfig(50304, 1024, 24, 16, 16, 4096, 1024, gated=False),
  'gpt2-large': DecoderConfig(50304, 1280, 36, 20, 20, 5120, 1024, gated=False),
  'gpt2-xl': DecoderConfig(50304, 1600, 48, 25, 25, 6400, 1024, gated=False),
  'llama2-7b': DecoderConfig(32000, 4096, 32, 32, 32, 11008, 4096, gated=True, **_LLAMA2),
  'llama2-13b': DecoderConfig(32000, 5120, 40, 40, 40, 13824, 4096, gated=True, **_LLAMA2),
  'llama2-70b': DecoderConfig(32000, 8192, 80, 64, 8, 28672, 4096, gated=True, **_LLAMA2),
}


# How a LoRA model's frozen base is stored (`ModelSettings.base_dtype`).
BASE_DTYPES = (None, 'bf16', 'int8', 'nf4')


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """How the presets compute, the same for every candidate of a plan or a search: the settings
  a `lowering.Target` holds and `decoder_spec` reads (a candidate adds its remat, prefetch and
  head). Each value is checked when the record is made.

  Attributes:
    seq_len: the sequence length; None: the preset's.
    compute_dtype: the dtype of the matrix multiplies.
    attention: 'xla' or 'flash' (`ATTENTION`).
    attention_chunk: 'xla' attention this many queries at a time; None: all at once.
    loss_chunk: the head's logits and loss this many positions at a time; None: at once.
    per_layer: gather each block's parameters inside the layer loop; False gathers every
      parameter up front.
    base_dtype: for a decoder with LoRA adapters (`DecoderConfig.lora`), how its frozen base
      is stored: 'nf4' or 'int8' (QLoRA: the projections quantized, `QuantizedWeight`),
      'bf16', or None (the parameters' dtype).
  """

  seq_len: int | None = None
  compute_dtype: Any = jnp.bfloat16
  attention: str = 'xla'
  attention_chunk: int | None = None
  loss_chunk: int | None = None
  per_layer: bool = True
  base_dtype: str | None = None

  def __post_init__(self):
    if self.attention not in ATTENTION:
      raise ValueError(f'`attention`={self.attention!r}: choose one of {ATTENTION}.')
    if self.attention == 'flash' and self.attention_chunk:
      raise ValueError(
        "`attention_chunk` is for attention='xla'; flash attention works in blocks of its own."
      )
    for field in ('seq_len', 'attention_chunk', 'loss_chunk'):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f'`{field}` must be a whole number >= 1 or None, got {value!r}.')
    jnp.dtype(self.compute_dtype)  # an unknown dtype raises here, naming it
    if self.base_dtype not in BASE_DTYPES:
      raise ValueError(f'`base_dtype`={self.base_dtype!r}: choose one of {BASE_DTYPES}.')

  def decoder_options(self, **candidate: Any) -> DecoderOptions:
    """The decoder's options record (`DecoderOptions`, checked there) these settings give, with
    a candidate's `remat`, `prefetch_next` and `lean_head`."""
    return DecoderOptions(
      compute_dtype=jnp.dtype(self.compute_dtype),
      per_layer=self.per_layer,
      attention_chunk=self.attention_chunk,
      attention=self.attention,
      loss_chunk=self.loss_chunk,
      **candidate,
    )

  def given(self) -> tuple[str, ...]:
    """The settings that differ from the defaults, by name (a model function of its own
    computes its attention and loss, and takes none of the presets' ways of doing it)."""
    defaults = ModelSettings()
    return tuple(
      f
      for f in ('attention_chunk', 'attention', 'loss_chunk', 'base_dtype')
      if getattr(self, f) != getattr(defaults, f)
    )


# The keys of `parse_decoder`: a decoder's shape and its rotation's base (hf:DIR reads the
# Llama family's other settings, rope scaling, biases and norms, from a config.json).
SHAPE_KEYS = ('vocab', 'd_model', 'n_layers', 'n_heads', 'n_kv_heads', 'd_ff', 'seq_len')
SHAPE_KEYS += ('gated', 'head_size', 'rope_theta')


def parse_decoder(text: str, seq_len: int | None = None) -> DecoderConfig:
  """A `DecoderConfig` from 'key=value,...' (its field names; `gated` true/false) or a
  JSON file of the same keys: a decoder of any shape, planned without writing code. A gated
  (Llama-shaped) decoder rotates its queries and keys by `rope_theta` (10000 unless given;
  `rope_theta=none`: position-free), an ungated (GPT-2-shaped) one only where it is given.

  >>> parse_decoder('vocab=32000,d_model=8192,n_layers=32,n_heads=64,n_kv_heads=64,'
  ...               'd_ff=28672,head_size=128', seq_len=2048).head_dim
  128

  Raises:
    ValueError: an unknown or missing key, or a value that is not a number (each named).
  """
  import json
  import os

  if text.endswith('.json') and '=' not in text and not os.path.exists(text):
    raise ValueError(
      f'decoder shape: no file {text!r}; give the path of a JSON file of the keys, or the keys'
      ' as key=value pairs (decoder:vocab=32000,d_model=4096,...).'
    )
  if text.endswith('.json') and os.path.exists(text):
    with open(text) as f:
      given = {k: str(v) for k, v in json.load(f).items()}
  else:
    given = {}
    for part in filter(None, (p.strip() for p in text.split(','))):
      key, eq, value = part.partition('=')
      if not eq:
        raise ValueError(f'decoder shape: expected key=value, got {part!r}.')
      given[key.strip()] = value.strip()
  fields = set(SHAPE_KEYS)
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ValueError(f'decoder shape: unknown {unknown}; the keys are {sorted(fields)}.')
  given.setdefault('gated', 'true')
  if seq_len is not None or 'seq_len' not in given:
    given['seq_len'] = str(seq_len or 2048)
  required = {'vocab', 'd_model', 'n_layers', 'n_heads', 'd_ff'}
  missing = sorted(required - set(given))
  if missing:
    raise ValueError(f'decoder shape: {missing} missing; give each as key=value.')
  given.setdefault('n_kv_heads', given['n_heads'])
  out: dict[str, Any] = {}
  theta = given.pop('rope_theta', '10000' if given['gated'].lower() in ('true', '1') else 'none')
  if theta.lower() != 'none':
    try:
      base = float(theta)
    except ValueError:
      base = -1.0
    if not base > 0:
      raise ValueError(
        f'decoder shape: rope_theta={theta!r}; give the rotation base, a number > 0 (10000),'
        ' or none.'
      )
    out['rope'] = Rope(base)
  for key, value in given.items():
    if key == 'gated':
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(f'decoder shape: gated={value!r}; give true or false.')
      out[key] = value.lower() in ('true', '1')
    else:
      try:
        out[key] = int(float(value))
      except ValueError:
        raise ValueError(f'decoder shape: {key}={value!r} is not a number.') from None
  return DecoderConfig(**out)


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
    tensor_specs: optional, for a mesh with a tensor-parallel axis: a function
      (axis name, axis size) -> PartitionSpecs of the parameters over it (a
      prefix tree, as `zerojax.Options.param_specs`), raising ValueError where
      the size does not divide the model.
    stacked: which parameters are stacked layers (`zerojax.Options.stacked`, a
      prefix tree of bools), or None to leave it to the default rule.
    trainable: which parameters train (`zerojax.Options.trainable`); None: all of them.

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
  tensor_specs: Callable[[str, int], Any] | None = None
  stacked: Any = None
  trainable: Any = None


def decoder_spec(
  name: str | DecoderConfig,
  settings: ModelSettings = ModelSettings(),
  *,
  remat: str = 'full',
  prefetch_next: bool = False,
  lean_head: bool = False,
) -> ModelSpec:
  """A `ModelSpec` for a preset in `PRESETS`, or for a `DecoderConfig` of any shape, computed
  as `settings` says, with a candidate's `remat`, `prefetch_next` and `lean_head`
  (`decoder_loss`).

  Raises:
    ValueError: for an unknown preset name.
  """
  if isinstance(name, DecoderConfig):
    cfg, name = name, 'decoder'
  elif name not in PRESETS:
    raise ValueError(f'`model`={name!r} is not a preset; choose one of {sorted(PRESETS)}.')
  else:
    cfg = PRESETS[name]
  seq = settings.seq_len or cfg.seq_len
  options = settings.decoder_options(remat=remat, prefetch_next=prefetch_next, lean_head=lean_head)

  def loss_fn(params, tokens, plan):
    return decoder_loss(params, tokens, cfg, **dataclasses.replace(options, plan=plan).as_kwargs())

  if settings.base_dtype is not None and cfg.lora is None:
    raise ValueError(
      f'`base_dtype`={settings.base_dtype!r} stores the frozen base of a LoRA model; the'
      ' decoder has no adapters (DecoderConfig.lora; --lora R on the command line).'
    )
  return ModelSpec(
    name=name,
    init_fn=functools.partial(_init_stored, cfg, settings.base_dtype),
    loss_fn=loss_fn,
    batch=lambda global_batch: jax.ShapeDtypeStruct((global_batch, seq + 1), jnp.int32),
    tensor_specs=lambda axis, size: (cfg.check_tensor(size), cfg.param_specs(axis))[1],
    stacked=cfg.stacked(),
    trainable=None if cfg.lora is None else lora_lib.is_adapter,
  )


def _init_stored(cfg: DecoderConfig, base_dtype: str | None, key: jax.Array) -> dict[str, Any]:
  """`init_decoder`'s parameters, a LoRA model's frozen base stored as `base_dtype` says (the
  adapters in float32)."""
  if base_dtype is None:
    return init_decoder(cfg, key)
  if base_dtype == 'bf16':
    params = init_decoder(cfg, key, jnp.bfloat16)
    adapters = params['layers'][lora_lib.KEY]
    params['layers'][lora_lib.KEY] = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)
    return params
  return lora_lib.quantized_base(init_decoder(cfg, key), base_dtype)
