"""Published BERT and GPT-2 in Flax, with the name maps that load their Hugging Face checkpoints.

The models follow the published architectures exactly (so the published weights mean what
they meant): BERT is a post-LayerNorm encoder with token, position and segment embeddings, exact
GELU, a tanh pooler over [CLS] and a classification head; GPT-2 is a pre-LayerNorm decoder with
learned positions, tanh-approximated GELU and its head tied to the token embedding. Their
layers are one `nn.scan` (stacked along a leading layer axis, which ZeRO never splits) whose
block gathers its own ZeRO-3 shards (`zerojax.linen.gathered`). Dropout is left out: these
examples fine-tune deterministically.

`bert_names` and `gpt2_names` map each Flax leaf to its checkpoint tensor
(`zerojax.checkpoint.Tensor`): PyTorch `Linear` weights are (out, in), transposed into Flax's
(in, out); GPT-2's `Conv1D` weights are (in, out) already; per-layer tensors are stacked. Which
of a name's published spellings a checkpoint uses (`LayerNorm.gamma` or `.weight`, GPT-2 with or
without its `transformer.` prefix) is read from the checkpoint's own tensor names, never assumed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

import zerojax
from zerojax.checkpoint import Tensor


def _config(folder: str) -> dict:
  path = os.path.join(folder, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{folder} has no config.json: pass a Hugging Face model folder.')
  with open(path) as f:
    return json.load(f)


def _require(config: dict, keys: tuple[str, ...], folder: str) -> None:
  missing = [k for k in keys if k not in config]
  if missing:
    raise ValueError(f'{folder}/config.json lacks {", ".join(missing)}.')


# --- BERT


@dataclasses.dataclass(frozen=True)
class BertConfig:
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  intermediate_size: int
  max_position_embeddings: int
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  num_labels: int = 2

  @classmethod
  def from_folder(cls, folder: str, num_labels: int = 2) -> BertConfig:
    """The shape from a Hugging Face BERT folder's config.json (any size).

    Raises:
      ValueError: a field the model needs is missing, or the activation is not BERT's GELU.
    """
    c = _config(folder)
    names = tuple(f.name for f in dataclasses.fields(cls) if f.name != 'num_labels')
    _require(c, names[:6], folder)
    if c.get('hidden_act', 'gelu') != 'gelu':
      raise ValueError(
        f"{folder}/config.json: hidden_act {c['hidden_act']!r}; this BERT runs 'gelu'."
      )
    return cls(**{k: c[k] for k in names if k in c}, num_labels=num_labels)


def _layer_norm(eps: float, name: str) -> nn.LayerNorm:
  # Two-pass variance, as PyTorch computes it.
  return nn.LayerNorm(epsilon=eps, use_fast_variance=False, name=name)


def _attention(q, k, v, bias, heads: int):
  b, t, d = q.shape
  split = lambda x: x.reshape(b, x.shape[1], heads, d // heads)
  scores = jnp.einsum('bqhd,bkhd->bhqk', split(q), split(k)) / jnp.sqrt(d // heads).astype(q.dtype)
  weights = jax.nn.softmax(scores + bias, axis=-1)
  return jnp.einsum('bhqk,bkhd->bqhd', weights, split(v)).reshape(b, t, d)


class BertLayer(nn.Module):
  cfg: BertConfig

  @nn.compact
  def __call__(self, x, bias):
    cfg = self.cfg
    dense = lambda n, name: nn.Dense(n, name=name)
    q, k, v = (dense(cfg.hidden_size, n)(x) for n in ('query', 'key', 'value'))
    attn = dense(cfg.hidden_size, 'attention_output')(
      _attention(q, k, v, bias, cfg.num_attention_heads)
    )
    x = _layer_norm(cfg.layer_norm_eps, 'attention_norm')(x + attn)
    h = nn.gelu(dense(cfg.intermediate_size, 'intermediate')(x), approximate=False)
    return _layer_norm(cfg.layer_norm_eps, 'output_norm')(
      x + dense(cfg.hidden_size, 'output')(h)
    ), None


class Bert(nn.Module):
  """BERT with a classification head on the pooled [CLS] token (BertForSequenceClassification)."""

  cfg: BertConfig
  zero: Any = None  # the optimizer from zerojax.zero_stage, for stage 3's per-layer gathers

  @nn.compact
  def __call__(self, tokens, segments, mask):
    cfg = self.cfg
    g = (
      (lambda cls: cls)
      if self.zero is None
      else (lambda cls: zerojax.linen.gathered(cls, self.zero))
    )
    x = g(nn.Embed)(cfg.vocab_size, cfg.hidden_size, name='word_embeddings')(tokens)
    x = x + g(nn.Embed)(cfg.max_position_embeddings, cfg.hidden_size, name='position_embeddings')(
      jnp.arange(tokens.shape[1])[None]
    )
    x = x + g(nn.Embed)(cfg.type_vocab_size, cfg.hidden_size, name='token_type_embeddings')(
      segments
    )
    x = g(nn.LayerNorm)(
      epsilon=cfg.layer_norm_eps, use_fast_variance=False, name='embeddings_norm'
    )(x)
    bias = jnp.where(mask[:, None, None, :], 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)
    block = nn.remat(g(BertLayer), prevent_cse=False, policy=zerojax.recompute_gathers)
    scan = nn.scan(
      block,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      in_axes=nn.broadcast,
      length=cfg.num_hidden_layers,
    )
    x, _ = scan(cfg, name='layers')(x, bias)
    pooled = jnp.tanh(g(nn.Dense)(cfg.hidden_size, name='pooler')(x[:, 0]))
    return g(nn.Dense)(cfg.num_labels, name='classifier')(pooled)


def _spelling(headers, stem: str) -> tuple[str, str]:
  """A LayerNorm's (scale, bias) suffixes as the checkpoint spells them: BERT's original
  release says gamma/beta, later saves weight/bias."""
  if any(n.startswith(stem) and n.endswith('.gamma') for n in headers):
    return 'gamma', 'beta'
  return 'weight', 'bias'


def bert_names(headers) -> dict[str, Tensor | str]:
  """The Flax leaf -> checkpoint tensor map of `Bert`.

  BertForSequenceClassification's checkpoints name the encoder `bert.embeddings...`; a bare
  BertModel's (sentence encoders, for one) `embeddings...`: the prefix, like the LayerNorm
  spelling, is read from `headers`, the checkpoint's tensor names. The classifier is
  `classifier.weight`/`.bias` (absent from a checkpoint that was never fine-tuned: load it
  with `init=['classifier/*']`).
  """
  p = 'bert.' if any(n.startswith('bert.') for n in headers) else ''
  layer = f'{p}encoder.layer.{{layer}}.'
  scale, shift = _spelling(headers, p)
  linear = lambda flax, torch: {
    f'{flax}/kernel': Tensor(f'{torch}.weight', transpose=True),
    f'{flax}/bias': f'{torch}.bias',
  }
  norm = lambda flax, torch: {
    f'{flax}/scale': f'{torch}.{scale}',
    f'{flax}/bias': f'{torch}.{shift}',
  }
  out = {
    'word_embeddings/embedding': f'{p}embeddings.word_embeddings.weight',
    'position_embeddings/embedding': f'{p}embeddings.position_embeddings.weight',
    'token_type_embeddings/embedding': f'{p}embeddings.token_type_embeddings.weight',
    **norm('embeddings_norm', f'{p}embeddings.LayerNorm'),
    **linear('pooler', f'{p}pooler.dense'),
    **linear('classifier', 'classifier'),
  }
  for flax, torch in (
    ('query', 'attention.self.query'),
    ('key', 'attention.self.key'),
    ('value', 'attention.self.value'),
    ('attention_output', 'attention.output.dense'),
    ('intermediate', 'intermediate.dense'),
    ('output', 'output.dense'),
  ):
    out |= linear(f'layers/{flax}', layer + torch)
  out |= norm('layers/attention_norm', layer + 'attention.output.LayerNorm')
  out |= norm('layers/output_norm', layer + 'output.LayerNorm')
  return out


# --- GPT-2


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  vocab_size: int
  n_positions: int
  n_embd: int
  n_layer: int
  n_head: int
  layer_norm_epsilon: float = 1e-5

  @classmethod
  def from_folder(cls, folder: str) -> GPT2Config:
    c = _config(folder)
    names = tuple(f.name for f in dataclasses.fields(cls))
    _require(c, names[:5], folder)
    if c.get('activation_function', 'gelu_new') != 'gelu_new':
      raise ValueError(
        f"{folder}/config.json: activation {c['activation_function']!r}; GPT-2 runs 'gelu_new'."
      )
    return cls(**{k: c[k] for k in names if k in c})


class GPT2Block(nn.Module):
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    b, t, d = x.shape
    h = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_fast_variance=False, name='ln_1')(x)
    q, k, v = jnp.split(nn.Dense(3 * d, name='c_attn')(h), 3, axis=-1)
    causal = jnp.tril(jnp.ones((t, t), bool))
    bias = jnp.where(causal, 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)
    x = x + nn.Dense(d, name='attn_c_proj')(_attention(q, k, v, bias, cfg.n_head))
    h = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_fast_variance=False, name='ln_2')(x)
    h = nn.gelu(nn.Dense(4 * d, name='c_fc')(h), approximate=True)
    return x + nn.Dense(d, name='mlp_c_proj')(h), None


class GPT2(nn.Module):
  """GPT-2 (GPT2LMHeadModel): next-token logits, the head tied to the token embedding."""

  cfg: GPT2Config
  zero: Any = None

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    g = (
      (lambda cls: cls)
      if self.zero is None
      else (lambda cls: zerojax.linen.gathered(cls, self.zero))
    )
    wte = g(nn.Embed)(cfg.vocab_size, cfg.n_embd, name='wte')
    x = wte(tokens) + g(nn.Embed)(cfg.n_positions, cfg.n_embd, name='wpe')(
      jnp.arange(tokens.shape[1])[None]
    )
    block = nn.remat(g(GPT2Block), prevent_cse=False, policy=zerojax.recompute_gathers)
    scan = nn.scan(
      block, variable_axes={'params': 0}, split_rngs={'params': True}, length=cfg.n_layer
    )
    x, _ = scan(cfg, name='h')(x, None)
    x = g(nn.LayerNorm)(epsilon=cfg.layer_norm_epsilon, use_fast_variance=False, name='ln_f')(x)
    return wte.attend(x)


def gpt2_names(headers) -> dict[str, Tensor | str]:
  """The Flax leaf -> checkpoint tensor map of `GPT2`.

  GPT-2's `Conv1D` weights are (in, out), Flax's layout: nothing is transposed. The original
  release names tensors `h.0.attn.c_attn.weight`; `GPT2LMHeadModel.save_pretrained` prefixes
  `transformer.`: which one is read from `headers`. The head is the token embedding (tied).
  """
  p = 'transformer.' if any(n.startswith('transformer.') for n in headers) else ''
  layer = f'{p}h.{{layer}}.'
  dense = lambda flax, torch: {f'{flax}/kernel': f'{torch}.weight', f'{flax}/bias': f'{torch}.bias'}
  norm = lambda flax, torch: {f'{flax}/scale': f'{torch}.weight', f'{flax}/bias': f'{torch}.bias'}
  out = {'wte/embedding': f'{p}wte.weight', 'wpe/embedding': f'{p}wpe.weight'}
  out |= norm('ln_f', f'{p}ln_f')
  out |= dense('h/c_attn', layer + 'attn.c_attn') | dense('h/attn_c_proj', layer + 'attn.c_proj')
  out |= dense('h/c_fc', layer + 'mlp.c_fc') | dense('h/mlp_c_proj', layer + 'mlp.c_proj')
  out |= norm('h/ln_1', layer + 'ln_1') | norm('h/ln_2', layer + 'ln_2')
  return out


# Buffers some GPT-2 releases store beside the weights (the causal mask), not parameters.
GPT2_BUFFERS = ('*.attn.bias', '*.attn.masked_bias', 'lm_head.weight')
# BERT's pretraining heads and its position-id buffer.
BERT_UNUSED = ('cls.*', '*.position_ids')
