"""Hugging Face PEFT's LoRA adapters in and out of `zerojax.llama`'s decoder.

A PEFT adapter folder holds `adapter_config.json` (PEFT's `LoraConfig`: `r`, `lora_alpha`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (rank, in) and
`...lora_B.weight` (out, rank), PyTorch's Linear layout. Here an adapter is
`params['layers']['lora'][w] = {'a': (L, in, rank), 'b': (L, rank, out)}` (see `lora`), so
each tensor is one layer of a stacked leaf, transposed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import optax

from zerojax._src import lora as lora_lib
from zerojax._src import plan as plan_lib
from zerojax._src import pretrained, transform
from zerojax._src.decoder import DecoderConfig
from zerojax._src.pretrained import Tensor

CONFIG = 'adapter_config.json'
WEIGHTS = 'adapter_model.safetensors'
PREFIX = 'base_model.model.model.layers.{layer}.'
# PEFT settings this reader computes only at their defaults: (key, default, what it would need).
UNSUPPORTED = (
  ('use_dora', False, 'DoRA (weight-decomposed LoRA)'),
  ('fan_in_fan_out', False, "Conv1D-shaped weights (GPT-2's)"),
  ('modules_to_save', None, 'fully trained modules beside the adapters'),
  ('layers_to_transform', None, 'adapters on some layers only'),
  ('rank_pattern', {}, 'a rank per module'),
  ('alpha_pattern', {}, 'an alpha per module'),
  ('layer_replication', None, 'replicated layers'),
  ('trainable_token_indices', None, 'trained token embeddings'),
  ('lora_bias', False, 'biases on the adapters'),
  ('use_qalora', False, 'QA-LoRA'),
  ('target_parameters', None, 'adapters on parameters rather than modules'),
  ('exclude_modules', None, 'modules excluded by pattern'),
)


def adapter_names(lora: lora_lib.LoraConfig) -> dict[str, Tensor]:
  """The PEFT tensor of each adapter leaf (`'layers/lora/wq/a'` -> `...q_proj.lora_A.weight`)."""
  out = {}
  for short, w in zip(lora.targets, lora.weights):
    module = PREFIX + lora_lib.PEFT_MODULES[short]
    out[f'layers/{lora_lib.KEY}/{w}/a'] = Tensor(module + '.lora_A.weight', transpose=True)
    out[f'layers/{lora_lib.KEY}/{w}/b'] = Tensor(module + '.lora_B.weight', transpose=True)
  return out


def _read_json(folder: str) -> dict:
  path = os.path.join(folder, CONFIG)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{folder}: no {CONFIG}; a PEFT adapter folder has one.')
  with open(path) as f:
    return json.load(f)


def lora_from_peft(folder: str | os.PathLike) -> lora_lib.LoraConfig:
  """The `LoraConfig` of a PEFT adapter folder's `adapter_config.json`.

  Raises:
    ValueError: not a LoRA adapter, or one that uses what this decoder does not compute
      (DoRA, per-module ranks, biases, ...), each named with its key.
  """
  folder = os.fspath(folder)
  config = _read_json(folder)
  where = os.path.join(folder, CONFIG)
  kind = config.get('peft_type')
  if kind != 'LORA':
    raise ValueError(f'{where}: peft_type {kind!r}; zerojax reads LoRA adapters (LORA).')
  if config.get('bias', 'none') != 'none':
    raise ValueError(
      f'{where}: bias={config["bias"]!r} trains biases too; zerojax reads adapters with'
      " bias='none'."
    )
  used = [
    f'{key}={config[key]!r} ({what})'
    for key, default, what in UNSUPPORTED
    if config.get(key) not in (default, None, {}, [], False)
  ]
  if used:
    raise ValueError(f'{where}: {"; ".join(used)}: not computed by zerojax.llama.')
  targets = config.get('target_modules')
  if isinstance(targets, str):
    raise ValueError(
      f'{where}: target_modules is the pattern {targets!r}; zerojax reads a list of module'
      ' names (q_proj, k_proj, ...).'
    )
  try:
    return lora_lib.LoraConfig(
      rank=int(config['r']),
      alpha=config['lora_alpha'],
      targets=tuple(sorted(targets or ())),
      dropout=float(config.get('lora_dropout') or 0.0),
      rslora=bool(config.get('use_rslora', False)),
    )
  except (KeyError, ValueError, TypeError) as e:
    raise ValueError(f'{where}: {e}') from None


def _check_rank(folder: str, lora: lora_lib.LoraConfig) -> None:
  """Refuses tensors whose rank is not the config's `r`, naming the first."""
  entries = pretrained.read_headers(os.path.join(folder, WEIGHTS))
  for name, entry in entries.items():
    if name.endswith('.lora_A.weight') and entry.shape and entry.shape[0] != lora.rank:
      raise ValueError(
        f'{os.path.join(folder, WEIGHTS)}: {name!r} has rank {entry.shape[0]}, and'
        f' {CONFIG} says r={lora.rank}: the adapter and its config disagree.'
      )


def load_adapter(
  folder: str | os.PathLike, params: Any, cfg: DecoderConfig, tx: optax.GradientTransformation
) -> Any:
  """`params` (a `zerojax.llama` tree with adapters of `cfg.lora`) with its adapters read from
  the PEFT folder, in `tx`'s layout, each process reading its devices' slices.

  Raises:
    ValueError: the folder's LoRA config is not `cfg.lora`; a tensor missing, extra, of
      another shape or rank (all listed).
  """
  folder = os.fspath(folder)
  lora = lora_from_peft(folder)
  if cfg.lora != lora:
    raise ValueError(
      f'{folder}: the adapter is {lora}, and the model config has {cfg.lora}; build the'
      " config with the adapter's (zerojax.llama.load(..., adapter=folder) does)."
    )
  _check_rank(folder, lora)
  config = transform.require_config(tx)
  shardings = plan_lib.plan_of(config, params).params['layers'][lora_lib.KEY]
  ours = {'layers': {lora_lib.KEY: params['layers'][lora_lib.KEY]}}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ours)
  read = pretrained.read_placed(
    os.path.join(folder, WEIGHTS),
    abstract,
    {'layers': {lora_lib.KEY: shardings}},
    adapter_names(lora),
  )
  layers = dict(params['layers'], **{lora_lib.KEY: read['layers'][lora_lib.KEY]})
  return {**params, 'layers': layers}


def peft_config(lora: lora_lib.LoraConfig, base_model: str | None = None) -> dict:
  """PEFT's `adapter_config.json` for `lora`."""
  return {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'base_model_name_or_path': base_model,
    'r': lora.rank,
    'lora_alpha': lora.alpha,
    'lora_dropout': lora.dropout,
    'target_modules': [lora_lib.PEFT_MODULES[t].split('.')[-1] for t in lora.targets],
    'bias': 'none',
    'use_rslora': lora.rslora,
    'use_dora': False,
    'fan_in_fan_out': False,
    'init_lora_weights': True,
    'modules_to_save': None,
    'inference_mode': True,
  }


def save_adapter(
  params: Any, directory: str | os.PathLike, cfg: DecoderConfig, *, base_model: str | None = None
) -> list[str]:
  """Writes the adapters of `params` as a PEFT adapter folder that
  `peft.PeftModel.from_pretrained(base, directory)` reads: the adapters only, not the base.
  Every process must call it; process 0 writes.

  Raises:
    ValueError: `cfg` has no LoRA config.
  """
  if cfg.lora is None:
    raise ValueError('save_adapter: cfg.lora is None: this model has no adapters to save.')
  adapters = {'layers': {lora_lib.KEY: params['layers'][lora_lib.KEY]}}
  written = pretrained.save_safetensors(
    adapters, directory, names=adapter_names(cfg.lora), file_name=WEIGHTS
  )
  if jax.process_index() != 0:
    return written
  path = os.path.join(os.fspath(directory), CONFIG)
  with open(path, 'w') as f:
    json.dump(peft_config(cfg.lora, base_model), f, indent=2)
  return [*written, path]


def with_lora(cfg: DecoderConfig, lora: lora_lib.LoraConfig | None) -> DecoderConfig:
  return dataclasses.replace(cfg, lora=lora)


def merge(params: Mapping[str, Any], cfg: DecoderConfig) -> tuple[dict, DecoderConfig]:
  """(the parameters with the adapters folded into their weights, the base config): what
  `zerojax.llama.save` writes as a full checkpoint transformers reads.

  Raises:
    ValueError: `cfg` has no LoRA config.
  """
  if cfg.lora is None:
    raise ValueError('merge: cfg.lora is None: there are no adapters to merge.')
  return lora_lib.merged(params, cfg.lora), with_lora(cfg, None)
