"""The Llama family's forward pass in numpy (float64), written from the published equations and
read straight from a checkpoint's tensors and its `config.json`: the reference the tests hold
zerojax's decoder to. It shares no code with zerojax.

- RMSNorm: x / sqrt(mean(x^2) + eps) * weight.
- Rotary embeddings (RoFormer, in transformers' half-split arrangement): the first and second
  halves of each head's dimensions rotate together by position * inv_freq, inv_freq_i =
  theta^(-2i / head_dim); 'linear' scaling divides every frequency by the factor, 'llama3'
  divides the low frequencies by it, keeps the high ones and blends those between.
- Grouped-query attention: query head n reads key/value head n // (heads / kv_heads), scores
  scaled by 1/sqrt(head_dim), causal (and within the sliding window, where the config has one).
- SwiGLU MLP: down(silu(gate(x)) * up(x)).
- Qwen2: biases on the query, key and value projections; Qwen3: RMSNorm of each query and key
  head before the rotation.

Random small checkpoints in each family's naming (`write_checkpoint`) come from here too.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np


def rope_settings(config: dict) -> tuple[float, dict | None]:
  """(theta, the scaling dict or None) in both spellings: transformers 5's `rope_parameters`
  and the older top-level `rope_theta` and `rope_scaling`."""
  if config.get('rope_parameters'):
    params = dict(config['rope_parameters'])
    theta = params.pop('rope_theta', config.get('rope_theta', 10000.0))
    kind = params.get('rope_type', params.get('type', 'default'))
    return theta, None if kind == 'default' else params
  return config.get('rope_theta', 10000.0), config.get('rope_scaling')


def inverse_frequencies(config: dict, head_dim: int) -> np.ndarray:
  theta, scaling = rope_settings(config)
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv
  kind = scaling.get('rope_type', scaling.get('type'))
  if kind == 'linear':
    return inv / scaling['factor']
  assert kind == 'llama3', kind
  factor, low, high = scaling['factor'], scaling['low_freq_factor'], scaling['high_freq_factor']
  old = scaling['original_max_position_embeddings']
  out = []
  for f in inv:
    wavelength = 2 * math.pi / f
    if wavelength < old / high:  # high frequency: unchanged
      out.append(f)
    elif wavelength > old / low:  # low frequency: scaled down
      out.append(f / factor)
    else:  # between: a blend of the two
      smooth = (old / wavelength - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.array(out)


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate(x, angles):
  """x (T, heads, D); angles (T, D/2)."""
  half = x.shape[-1] // 2
  cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _silu(x):
  return x / (1 + np.exp(-x))


def logits(tensors: dict[str, np.ndarray], config: dict, tokens: np.ndarray) -> np.ndarray:
  """(batch, seq, vocab) float64 logits of `tokens` (batch, seq)."""
  t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  heads, kv = config['num_attention_heads'], config.get('num_key_value_heads')
  kv = kv or heads
  d = config.get('head_dim') or config['hidden_size'] // heads
  eps = config['rms_norm_eps']
  window = config.get('sliding_window') if config['model_type'] == 'mistral' else None
  seq = tokens.shape[1]
  angles = np.arange(seq)[:, None] * inverse_frequencies(config, d)[None, :]
  i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
  allowed = (j <= i) & ((i - j < window) if window else True)
  out = []
  for row in tokens:
    x = t['model.embed_tokens.weight'][row]
    for n in range(config['num_hidden_layers']):
      p = f'model.layers.{n}.'
      h = _rms(x, t[p + 'input_layernorm.weight'], eps)
      proj = {}
      for name, count in (('q', heads), ('k', kv), ('v', kv)):
        y = h @ t[p + f'self_attn.{name}_proj.weight'].T
        if p + f'self_attn.{name}_proj.bias' in t:
          y = y + t[p + f'self_attn.{name}_proj.bias']
        y = y.reshape(seq, count, d)
        if name in 'qk' and p + f'self_attn.{name}_norm.weight' in t:
          y = _rms(y, t[p + f'self_attn.{name}_norm.weight'], eps)
        proj[name] = _rotate(y, angles) if name in 'qk' else y
      attn = np.zeros((seq, heads, d))
      for hq in range(heads):
        hk = hq // (heads // kv)
        scores = proj['q'][:, hq] @ proj['k'][:, hk].T / math.sqrt(d)
        scores = np.where(allowed, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attn[:, hq] = weights @ proj['v'][:, hk]
      o = attn.reshape(seq, heads * d) @ t[p + 'self_attn.o_proj.weight'].T
      if p + 'self_attn.o_proj.bias' in t:
        o = o + t[p + 'self_attn.o_proj.bias']
      x = x + o
      h = _rms(x, t[p + 'post_attention_layernorm.weight'], eps)
      gate = h @ t[p + 'mlp.gate_proj.weight'].T
      up = h @ t[p + 'mlp.up_proj.weight'].T
      x = x + (_silu(gate) * up) @ t[p + 'mlp.down_proj.weight'].T
    x = _rms(x, t['model.norm.weight'], eps)
    head = t.get('lm_head.weight', t['model.embed_tokens.weight'])
    out.append(x @ head.T)
  return np.stack(out)


FAMILIES = {
  'llama': 'LlamaForCausalLM',
  'mistral': 'MistralForCausalLM',
  'qwen2': 'Qwen2ForCausalLM',
  'qwen3': 'Qwen3ForCausalLM',
}


def small_config(model_type: str, **changes) -> dict:
  """A small config.json of the family, with the fields transformers writes for it."""
  config = {
    'architectures': [FAMILIES[model_type]],
    'model_type': model_type,
    'vocab_size': 96,
    'hidden_size': 48,
    'intermediate_size': 80,
    'num_hidden_layers': 2,
    'num_attention_heads': 4,
    'num_key_value_heads': 2,
    'hidden_act': 'silu',
    'max_position_embeddings': 64,
    'rms_norm_eps': 1e-6,
    'rope_theta': 10000.0,
    'rope_scaling': None,
    'tie_word_embeddings': False,
    'torch_dtype': 'float32',
    'bos_token_id': 1,
    'eos_token_id': 2,
  }
  if model_type in ('llama', 'qwen3'):
    config |= {'attention_bias': False, 'head_dim': 12}
  if model_type == 'llama':
    config['mlp_bias'] = False
  if model_type == 'mistral':
    config |= {'sliding_window': None, 'head_dim': 12}
  if model_type == 'qwen2':
    config |= {'use_sliding_window': False, 'sliding_window': 64, 'max_window_layers': 2}
  if model_type == 'qwen3':
    config |= {'head_dim': 16, 'use_sliding_window': False, 'sliding_window': None}
  return config | changes


def random_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """A checkpoint's tensors in the family's own names and PyTorch's (out, in) layout."""
  rng = np.random.default_rng(seed)
  hidden, ff, vocab = config['hidden_size'], config['intermediate_size'], config['vocab_size']
  heads, kv = config['num_attention_heads'], config['num_key_value_heads']
  d = config.get('head_dim') or hidden // heads
  normal = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
  norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  out = {'model.embed_tokens.weight': normal(vocab, hidden), 'model.norm.weight': norm(hidden)}
  if not config['tie_word_embeddings']:
    out['lm_head.weight'] = normal(vocab, hidden)
  family = config['model_type']
  for n in range(config['num_hidden_layers']):
    p = f'model.layers.{n}.'
    out |= {
      p + 'input_layernorm.weight': norm(hidden),
      p + 'post_attention_layernorm.weight': norm(hidden),
      p + 'self_attn.q_proj.weight': normal(heads * d, hidden),
      p + 'self_attn.k_proj.weight': normal(kv * d, hidden),
      p + 'self_attn.v_proj.weight': normal(kv * d, hidden),
      p + 'self_attn.o_proj.weight': normal(hidden, heads * d),
      p + 'mlp.gate_proj.weight': normal(ff, hidden),
      p + 'mlp.up_proj.weight': normal(ff, hidden),
      p + 'mlp.down_proj.weight': normal(hidden, ff),
    }
    if family == 'qwen2' or config.get('attention_bias'):
      for name, width in (('q', heads * d), ('k', kv * d), ('v', kv * d)):
        out[p + f'self_attn.{name}_proj.bias'] = normal(width)
    if config.get('attention_bias'):
      out[p + 'self_attn.o_proj.bias'] = normal(hidden)
    if family == 'qwen3':
      out[p + 'self_attn.q_norm.weight'] = norm(d)
      out[p + 'self_attn.k_norm.weight'] = norm(d)
  return out


def write_checkpoint(folder, config: dict, tensors: dict, shards: int = 1) -> None:
  """config.json and the tensors as Hugging Face writes them: `model.safetensors`, or `shards`
  files listed in `model.safetensors.index.json`."""
  from safetensors.numpy import save_file

  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  if shards == 1:
    save_file(tensors, os.path.join(folder, 'model.safetensors'), metadata={'format': 'pt'})
    return
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    file = f'model-{s + 1:05d}-of-{shards:05d}.safetensors'
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, os.path.join(folder, file), metadata={'format': 'pt'})
    weight_map |= dict.fromkeys(part, file)
  total = sum(v.nbytes for v in tensors.values())
  with open(os.path.join(folder, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
