"""A small encoder and a checkpoint of it in PyTorch's layout, for the safetensors tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zerojax.checkpoint import Tensor

D, H, LAYERS, CLASSES = 64, 128, 3, 2


class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    u = nn.Dense(D, name='output')(jax.nn.gelu(nn.Dense(H, name='intermediate')(h)))
    return nn.LayerNorm(name='norm')(h + u), None


class Encoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, name='embed')(x)
    scan = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True}, length=LAYERS)
    h = scan(name='layers')(h, None)[0]
    return nn.Dense(CLASSES, name='classifier')(h[:, 0])


MODEL = Encoder()
X = jnp.ones((8, 4, 16))
init_fn = lambda key: MODEL.init(key, X)['params']

# The checkpoint's names, PyTorch style: Linear weights (out, in), one tensor per layer.
NAMES = {
  'embed/kernel': Tensor('enc.embed.weight', transpose=True),
  'embed/bias': 'enc.embed.bias',
  'layers/intermediate/kernel': Tensor('enc.layer.{layer}.intermediate.weight', transpose=True),
  'layers/intermediate/bias': 'enc.layer.{layer}.intermediate.bias',
  'layers/output/kernel': Tensor('enc.layer.{layer}.output.weight', transpose=True),
  'layers/output/bias': 'enc.layer.{layer}.output.bias',
  'layers/norm/scale': 'enc.layer.{layer}.norm.weight',
  'layers/norm/bias': 'enc.layer.{layer}.norm.bias',
  'classifier/kernel': Tensor('classifier.weight', transpose=True),
  'classifier/bias': 'classifier.bias',
}


def published_tensors(dtype=np.float32) -> dict[str, np.ndarray]:
  """A checkpoint as PyTorch would publish it: its own random values, not the model's init."""
  rng = np.random.default_rng(0)
  t = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)
  out = {'enc.embed.weight': t(D, 16), 'enc.embed.bias': t(D)}
  for i in range(LAYERS):
    out |= {
      f'enc.layer.{i}.intermediate.weight': t(H, D),
      f'enc.layer.{i}.intermediate.bias': t(H),
      f'enc.layer.{i}.output.weight': t(D, H),
      f'enc.layer.{i}.output.bias': t(D),
      f'enc.layer.{i}.norm.weight': t(D),
      f'enc.layer.{i}.norm.bias': t(D),
    }
  return out | {'classifier.weight': t(CLASSES, D), 'classifier.bias': t(CLASSES)}
