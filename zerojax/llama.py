"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3): one decoder, read from and
written to Hugging Face checkpoints, at any ZeRO stage. The planner's decoder presets are the
same model.

- `config_from_hf(folder)`: the `DecoderConfig` of a checkpoint's `config.json` (either rope
  spelling: `rope_parameters`, or `rope_theta` and `rope_scaling`).
- `load(folder, tx)`: (parameters in `tx`'s layout, config), each process reading its slices.
- `logits(params, tokens, cfg, plan=...)` and `loss(params, tokens, cfg, plan=...)`: the model,
  gathering each layer's parameters inside its scanned layer loop (`plan`: `zerojax.plan_for`).
- `save(params, folder, cfg, source=...)`: the family's safetensors with the source's config
  and tokenizer files, read back by transformers' `from_pretrained`.
- `to_hf_config(cfg)`: a `config.json` for a model made here (saved beside its weights).
- `names(cfg)`: the name map, for `zerojax.checkpoint.load_safetensors`/`save_safetensors`.
- `init(cfg, key)`: random parameters (a model from scratch, or for tests).
- `LoraConfig(rank, alpha, targets=...)`: LoRA adapters (`DecoderConfig.lora`, or
  `load(..., lora=...)`); `is_adapter`, the predicate that trains them alone
  (`zero_stage(..., trainable=zerojax.llama.is_adapter)`).
- `save_adapter(params, folder, cfg)` and `load(..., adapter=folder)`: Hugging Face PEFT's adapter
  folders out and in; `lora_from_peft(folder)` their config; `merge_lora(params, cfg)` folds the
  adapters into the weights, for `save`.
- `load(..., base_dtype='nf4' | 'int8')` and `quantize_base(params, tx)`: QLoRA's base, the
  projections stored quantized (`QuantizedWeight`: NF4 as bitsandbytes stores it), gathered in
  that form at stage 3 and dequantized inside the layer (`dequantize`).
- `pack(examples, seq_len)`: supervised fine-tuning's packed rows (tokens, segment ids, loss
  weights on completions), for `loss(..., segment_ids=..., loss_weights=...)`.
"""

from zerojax._src.decoder import DecoderConfig as DecoderConfig
from zerojax._src.decoder import Rope as Rope
from zerojax._src.decoder import decoder_hidden as hidden
from zerojax._src.decoder import decoder_logits as logits
from zerojax._src.decoder import decoder_loss as loss
from zerojax._src.decoder import init_decoder as init
from zerojax._src.hf_adapter import lora_from_peft as lora_from_peft
from zerojax._src.hf_adapter import merge as merge_lora
from zerojax._src.hf_adapter import save_adapter as save_adapter
from zerojax._src.hf_decoder import FAMILIES as FAMILIES
from zerojax._src.hf_decoder import config_from_hf as config_from_hf
from zerojax._src.hf_decoder import load as load
from zerojax._src.hf_decoder import names as names
from zerojax._src.hf_decoder import quantize_base as quantize_base
from zerojax._src.hf_decoder import save as save
from zerojax._src.hf_decoder import to_hf_config as to_hf_config
from zerojax._src.lora import LoraConfig as LoraConfig
from zerojax._src.lora import is_adapter as is_adapter
from zerojax._src.packing import pack as pack
from zerojax._src.qbase import QuantizedWeight as QuantizedWeight
from zerojax._src.qbase import dequantize as dequantize

__all__ = [
  'DecoderConfig',
  'Rope',
  'FAMILIES',
  'config_from_hf',
  'load',
  'save',
  'to_hf_config',
  'names',
  'init',
  'logits',
  'hidden',
  'loss',
  'LoraConfig',
  'is_adapter',
  'save_adapter',
  'lora_from_peft',
  'merge_lora',
  'quantize_base',
  'pack',
  'QuantizedWeight',
  'dequantize',
]
