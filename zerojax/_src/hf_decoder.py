"""Hugging Face's Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) as zerojax's decoder.

`config_from_hf` reads a checkpoint folder's `config.json` into a `decoder.DecoderConfig` (the
model the planner's presets compute too); `names` maps the decoder's parameter tree onto the
checkpoint's own tensor names, for `load_safetensors` and `save_safetensors`; `load` and `save`
are those two with the folder's config, and `save` copies the config and tokenizer files so
that transformers' `from_pretrained` reads the fine-tuned folder.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zerojax._src import hf_adapter, pretrained, qbase, transform
from zerojax._src import lora as lora_lib
from zerojax._src import mesh as mesh_lib
from zerojax._src import plan as plan_lib
from zerojax._src.decoder import DecoderConfig, Rope, init_decoder
from zerojax._src.pretrained import Tensor

# The architectures read here, by `config.json`'s `model_type`.
FAMILIES = {
  'llama': 'LlamaForCausalLM',
  'mistral': 'MistralForCausalLM',
  'qwen2': 'Qwen2ForCausalLM',
  'qwen3': 'Qwen3ForCausalLM',
}
# What `save` copies beside the weights: the config and the tokenizer's files.
COPIED = (
  'config.json',
  'generation_config.json',
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'tokenizer.model',
  'vocab.json',
  'merges.txt',
  'chat_template.jinja',
)


def read_config(folder: str | os.PathLike) -> dict:
  """A checkpoint folder's `config.json` (or the file itself) as a dict."""
  path = os.fspath(folder)
  if os.path.isdir(path):
    path = os.path.join(path, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(
      f'{path}: no config.json; give the folder of a Hugging Face checkpoint (the one'
      ' `huggingface-cli download` or `save_pretrained` writes).'
    )
  with open(path) as f:
    return json.load(f)


def _rope(config: Mapping[str, Any], where: str) -> Rope:
  """The rotary embedding of a config in either spelling: `rope_parameters` (transformers 5)
  or the top-level `rope_theta` and `rope_scaling` (earlier releases)."""
  params = config.get('rope_parameters')
  if params:
    params = dict(params)
    theta = params.pop('rope_theta', config.get('rope_theta', 10000.0))
    scaling = params
  else:
    theta, scaling = config.get('rope_theta', 10000.0), dict(config.get('rope_scaling') or {})
  kind = scaling.get('rope_type', scaling.get('type', 'default'))
  if kind == 'default':
    return Rope(float(theta))
  if kind == 'linear':
    return Rope(float(theta), 'linear', float(scaling['factor']))
  if kind == 'llama3':
    missing = [
      k
      for k in ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings')
      if k not in scaling
    ]
    if missing:
      raise ValueError(f'{where}: llama3 rope scaling without {", ".join(missing)}.')
    return Rope(
      float(theta),
      'llama3',
      float(scaling['factor']),
      float(scaling['low_freq_factor']),
      float(scaling['high_freq_factor']),
      int(scaling['original_max_position_embeddings']),
    )
  raise ValueError(
    f"{where}: rope type {kind!r} is not supported; zerojax's decoder computes 'default',"
    " 'linear' and 'llama3' rotary embeddings."
  )


def _check(config: Mapping[str, Any], where: str) -> str:
  """The family (`model_type`), after refusing what the decoder does not compute."""
  family = config.get('model_type')
  if family not in FAMILIES:
    raise ValueError(
      f'{where}: model_type {family!r} is not one of the Llama family zerojax reads'
      f' ({", ".join(f"{k} ({v})" for k, v in FAMILIES.items())}).'
    )
  act = config.get('hidden_act', 'silu')
  if act != 'silu':
    raise ValueError(f"{where}: hidden_act {act!r}; the decoder's SwiGLU MLP uses 'silu'.")
  if config.get('mlp_bias'):
    raise ValueError(f'{where}: mlp_bias true: the decoder has no MLP biases.')
  if family in ('qwen2', 'qwen3') and config.get('use_sliding_window'):
    raise ValueError(
      f'{where}: use_sliding_window true: per-layer sliding windows (max_window_layers) are'
      ' not computed; zerojax reads Qwen configs with full attention.'
    )
  return family


def config_from_hf(
  config: str | os.PathLike | Mapping[str, Any], seq_len: int | None = None
) -> DecoderConfig:
  """The `DecoderConfig` of a Hugging Face Llama, Mistral, Qwen2 or Qwen3 `config.json` (a
  folder, the file, or its dict): any size, grouped-query attention, `head_dim` apart from
  `hidden_size / heads`, rotary embeddings as transformers computes them, tied or untied head,
  Qwen2's query/key/value biases, Qwen3's query/key norms, Mistral's sliding window.

  Args:
    config: the checkpoint folder, its config.json, or the dict.
    seq_len: the training sequence length; default the config's `max_position_embeddings`.

  Raises:
    ValueError: a family or setting the decoder does not compute (named, with what it does).
  """
  where = 'config.json'
  if not isinstance(config, Mapping):
    where = os.fspath(config)
    config = read_config(config)
  family = _check(config, where)
  try:
    heads = int(config['num_attention_heads'])
    hidden = int(config['hidden_size'])
    window = config.get('sliding_window') if family == 'mistral' else None
    return DecoderConfig(
      vocab=int(config['vocab_size']),
      d_model=hidden,
      n_layers=int(config['num_hidden_layers']),
      n_heads=heads,
      n_kv_heads=int(config.get('num_key_value_heads') or heads),
      d_ff=int(config['intermediate_size']),
      seq_len=int(seq_len or config.get('max_position_embeddings', 2048)),
      gated=True,
      head_size=int(config.get('head_dim') or hidden // heads),
      norm_eps=float(config.get('rms_norm_eps', 1e-6)),
      rope=_rope(config, where),
      qkv_bias=family == 'qwen2' or bool(config.get('attention_bias')),
      out_bias=bool(config.get('attention_bias')),
      qk_norm=family == 'qwen3',
      tied_head=bool(config.get('tie_word_embeddings', False)),
      sliding_window=int(window) if window else None,
    )
  except KeyError as e:
    raise ValueError(f'{where}: no {e.args[0]!r}, which the {family} config needs.') from None


def names(cfg: DecoderConfig) -> dict[str, Tensor]:
  """The checkpoint tensor of each leaf of `init_decoder(cfg, ...)`, in the family's own
  names (`model.layers.{layer}.self_attn.q_proj.weight`, ...), PyTorch's (out, in) Linear
  weights transposed; with a tied head there is no `lm_head.weight`."""
  layer = 'model.layers.{layer}.'
  out = {
    'embed': Tensor('model.embed_tokens.weight'),
    'final_norm': Tensor('model.norm.weight'),
    'layers/attn_norm': Tensor(layer + 'input_layernorm.weight'),
    'layers/mlp_norm': Tensor(layer + 'post_attention_layernorm.weight'),
    'layers/wq': Tensor(layer + 'self_attn.q_proj.weight', transpose=True),
    'layers/wk': Tensor(layer + 'self_attn.k_proj.weight', transpose=True),
    'layers/wv': Tensor(layer + 'self_attn.v_proj.weight', transpose=True),
    'layers/wo': Tensor(layer + 'self_attn.o_proj.weight', transpose=True),
    'layers/w_gate': Tensor(layer + 'mlp.gate_proj.weight', transpose=True),
    'layers/w_in': Tensor(layer + 'mlp.up_proj.weight', transpose=True),
    'layers/w_out': Tensor(layer + 'mlp.down_proj.weight', transpose=True),
  }
  if not cfg.tied_head:
    out['head'] = Tensor('lm_head.weight', transpose=True)
  if cfg.qkv_bias:
    for p in 'qkv':
      out[f'layers/b{p}'] = Tensor(layer + f'self_attn.{p}_proj.bias')
  if cfg.out_bias:
    out['layers/bo'] = Tensor(layer + 'self_attn.o_proj.bias')
  if cfg.qk_norm:
    out['layers/q_norm'] = Tensor(layer + 'self_attn.q_norm.weight')
    out['layers/k_norm'] = Tensor(layer + 'self_attn.k_norm.weight')
  return out


def load(
  folder: str | os.PathLike,
  tx: optax.GradientTransformation,
  *,
  cfg: DecoderConfig | None = None,
  dtype=jnp.float32,
  lora: Any = None,
  adapter: str | os.PathLike | None = None,
  base_dtype: str | None = None,
) -> tuple[Any, DecoderConfig]:
  """(the parameters, the config) of a Llama-family checkpoint folder, each process reading
  only its devices' slices, placed in `tx`'s ZeRO layout (`load_safetensors`, strict: a
  missing, extra or misshapen tensor is refused, named with both shapes).

  Args:
    folder: the checkpoint's folder (config.json and model.safetensors, or shards listed in
      model.safetensors.index.json).
    tx: the optimizer from `zerojax.zero_stage` (stacked={'layers': True}, or `cfg.stacked()`).
    cfg: default `config_from_hf(folder)`.
    dtype: the parameters' dtype (bf16 checkpoints are cast).
    lora: new LoRA adapters (`zerojax.llama.LoraConfig`), initialised as PEFT does (B = 0:
      the model starts as the checkpoint's); the config returned has it.
    adapter: a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) to
      read the adapters from instead (its `LoraConfig`; `lora`, if given, must equal it).
    base_dtype: 'nf4' or 'int8': the projections' weights stored quantized (QLoRA; see
      `quantize_base`), each quantized as soon as it is read, in its devices' slices; None:
      as `dtype`.

  Raises:
    ValueError: the checkpoint or the adapter does not fit (every problem named).
  """
  cfg = cfg or config_from_hf(folder)
  if adapter is not None:
    found = hf_adapter.lora_from_peft(adapter)
    if lora is not None and lora != found:
      raise ValueError(f'load: lora={lora} disagrees with the adapter in {adapter}: {found}.')
    lora = found
  if lora is not None:
    cfg = hf_adapter.with_lora(cfg, lora)
  init = lambda key: init_decoder(cfg, key, dtype)
  fresh = (f'layers/{lora_lib.KEY}/*',) if cfg.lora is not None else ()
  convert = None if base_dtype is None else _quantizer(init, tx, base_dtype)
  params = pretrained.load_safetensors(
    folder, init, jax.random.key(0), tx=tx, names=names(cfg), init=fresh, convert=convert
  )
  if adapter is not None:
    params = hf_adapter.load_adapter(adapter, params, cfg, tx)
  return params, cfg


PROJECTIONS = lora_lib.PROJECTIONS
_quantized = lora_lib.quantized_base


def _quantizer(init, tx, kind: str):
  """`load_safetensors`' `convert`: each projection stack quantized in the plan's layout of the
  quantized tree as it is read (its full-precision copy is dropped as soon as it is done)."""
  abstract = jax.eval_shape(lambda k: _quantized(init(k), kind), jax.random.key(0))
  config = transform.require_config(tx)
  layouts = plan_lib.plan_of(config, abstract).params['layers']

  def convert(path: str, x: jax.Array):
    name = path.split('/')
    if len(name) != 2 or name[0] != 'layers' or name[1] not in PROJECTIONS:
      return x
    return _in_layout(functools.partial(qbase.quantize, kind=kind), layouts[name[1]], config)(x)

  return convert


def quantize_base(params: Any, tx: optax.GradientTransformation, kind: str = 'nf4') -> Any:
  """`params` with every block projection's weight stored quantized (`kind`: 'nf4', as
  bitsandbytes' NF4 in blocks of 64, or 'int8'), in `tx`'s layout. The full-precision tree is
  live beside the quantized one while this runs: to quantize on load instead, one leaf at a
  time, use `load(..., base_dtype=kind)`. Train the adapters alone
  (`zero_stage(..., trainable=zerojax.llama.is_adapter)`): quantized weights are frozen.

  Raises:
    ValueError: `kind` is not 'nf4' or 'int8'.
  """
  if kind not in qbase.KINDS:
    raise ValueError(f'quantize_base: kind must be one of {qbase.KINDS}, got {kind!r}.')
  run = functools.partial(_quantized, kind=kind)
  config = transform.require_config(tx)
  layouts = plan_lib.plan_of(config, jax.eval_shape(run, params)).params
  return _in_layout(run, layouts, config)(params)


def _in_layout(fn, layouts: Any, config: Any):
  """`fn` jitted into `layouts`, its body free to reshape split arrays on any mesh (the
  compiler places each device's blocks)."""

  def body(x):
    return mesh_lib.constrain(fn(x), layouts, config.mesh)

  return jax.jit(mesh_lib.run_in_layout(body, config.mesh, layouts), out_shardings=layouts)


def save(
  params: Any,
  directory: str | os.PathLike,
  cfg: DecoderConfig,
  *,
  source: str | os.PathLike | None = None,
  max_shard_bytes: int = 1 << 30,
) -> list[str]:
  """Writes `params` as the family's checkpoint (`save_safetensors`), with `source`'s config
  and tokenizer files (`COPIED`) beside them, so that transformers' `from_pretrained` and
  `load` read the folder; without a source config, `to_hf_config(cfg)` is written. Every
  process must call it; process 0 writes.

  Returns:
    The files written (on process 0).

  Raises:
    ValueError: `cfg` has LoRA adapters: merge them first (`zerojax.llama.merge_lora`), or
      save them alone (`zerojax.llama.save_adapter`).
  """
  if cfg.lora is not None:
    raise ValueError(
      'save: this model has LoRA adapters, which a transformers checkpoint has no place for.'
      ' Fold them into the weights first, params, cfg = zerojax.llama.merge_lora(params, cfg),'
      ' or write them as a PEFT adapter: zerojax.llama.save_adapter(params, folder, cfg).'
    )
  written = pretrained.save_safetensors(
    params, directory, names=names(cfg), max_shard_bytes=max_shard_bytes
  )
  if jax.process_index() != 0:
    return written
  for name in COPIED if source is not None else ():
    src = os.path.join(os.fspath(source), name)
    if os.path.exists(src):
      shutil.copyfile(src, os.path.join(os.fspath(directory), name))
      written.append(os.path.join(os.fspath(directory), name))
  config = os.path.join(os.fspath(directory), 'config.json')
  if source is None or not os.path.exists(os.path.join(os.fspath(source), 'config.json')):
    with open(config, 'w') as f:
      json.dump(to_hf_config(cfg), f, indent=2)
    written.append(config)
  return written


def to_hf_config(cfg: DecoderConfig, **fields: Any) -> dict:
  """A `config.json` for `cfg` (a model made here rather than read, for `save`): the family
  its features name (Qwen3 with query/key norms, Qwen2 with query/key/value biases only,
  Mistral with a sliding window, else Llama), in the spelling transformers has read since
  its 4.x releases (`rope_theta`, `rope_scaling`); `fields` (token ids, say) are added.

  >>> to_hf_config(DecoderConfig(96, 48, 2, 4, 2, 80, 64, gated=True, rope=Rope()))['model_type']
  'llama'
  """
  if not cfg.gated or cfg.rope is None:
    raise ValueError(
      'to_hf_config: the Llama family has a SwiGLU MLP and rotary embeddings; this config has'
      f' gated={cfg.gated}, rope={cfg.rope}.'
    )
  if cfg.qk_norm:
    family = 'qwen3'
  elif cfg.qkv_bias and not cfg.out_bias:
    family = 'qwen2'
  elif cfg.sliding_window is not None:
    family = 'mistral'
  else:
    family = 'llama'
  rope = cfg.rope
  scaling = None
  if rope.kind == 'linear':
    scaling = {'rope_type': 'linear', 'factor': rope.factor}
  elif rope.kind == 'llama3':
    scaling = {
      'rope_type': 'llama3',
      'factor': rope.factor,
      'low_freq_factor': rope.low_freq_factor,
      'high_freq_factor': rope.high_freq_factor,
      'original_max_position_embeddings': rope.original,
    }
  out = {
    'architectures': [FAMILIES[family]],
    'model_type': family,
    'vocab_size': cfg.vocab,
    'hidden_size': cfg.d_model,
    'intermediate_size': cfg.d_ff,
    'num_hidden_layers': cfg.n_layers,
    'num_attention_heads': cfg.n_heads,
    'num_key_value_heads': cfg.n_kv_heads,
    'head_dim': cfg.head_dim,
    'hidden_act': 'silu',
    'max_position_embeddings': cfg.seq_len,
    'rms_norm_eps': cfg.norm_eps,
    'rope_theta': rope.theta,
    'rope_scaling': scaling,
    'tie_word_embeddings': cfg.tied_head,
    'torch_dtype': 'float32',
  }
  if family in ('llama', 'qwen3'):
    out['attention_bias'] = cfg.out_bias
  if family == 'mistral':
    out['sliding_window'] = cfg.sliding_window
  return out | fields
