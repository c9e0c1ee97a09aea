"""A miniGPT in Flax NNX on a tensor-parallel mesh, where the optimizer line is the only change.

The model is written the way the JAX AI Stack's NNX tutorial writes one: layers annotated with
`nnx.with_partitioning` over a 'model' axis, an unannotated token embedding, an `nnx.jit` step
with Flax's own `nnx.value_and_grad`, an `nnx.Optimizer`. This script trains it twice on the
same bytes of text, with `optax.adam` and with `zerojax.zero_stage(optax.adam, stage,
axis='batch')`, and prints both losses and the optimizer state each device holds.

`--scan` is stage 3 layer by layer: the blocks are created with `nnx.vmap`, run under
`nnx.scan` and rematerialised, each gathered where it runs (`zerojax.nnx.gathered`), and the
gradients taken with `zerojax.nnx.value_and_grad(..., per_layer=True)`, so one layer's
weights are whole at a time.

  python examples/nnx_minigpt.py --stage 2 --mesh 4x2
  python examples/nnx_minigpt.py --stage 3 --scan --layers 4
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import common

common.setup_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256  # bytes
  width: int = 64
  heads: int = 4
  hidden: int = 256
  layers: int = 2
  seq_len: int = 32
  batch: int = 16
  lr: float = 3e-3


def _cols():
  return nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model'))


def _rows():
  return nnx.with_partitioning(nnx.initializers.xavier_uniform(), ('model', None))


class Block(nnx.Module):
  """Pre-norm attention and MLP; heads and the MLP's hidden units split over 'model'."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=cfg.heads,
      in_features=cfg.width,
      kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model', None)),
      out_kernel_init=nnx.with_partitioning(
        nnx.initializers.xavier_uniform(), ('model', None, None)
      ),
      decode=False,
      rngs=rngs,
    )
    self.norm2 = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.up = nnx.Linear(cfg.width, cfg.hidden, kernel_init=_cols(), rngs=rngs)
    self.down = nnx.Linear(cfg.hidden, cfg.width, kernel_init=_rows(), rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class MiniGPT(nnx.Module):
  """Blocks in a list (`scan=False`), or stacked by `nnx.vmap` and run by `nnx.scan`.

  With `tx` (a stage-3 `zero_stage` optimizer) each module gathers its own weights where it
  runs: `zerojax.nnx.gathered`, inside the rematerialised scan body for the blocks.
  """

  def __init__(self, cfg: Config, rngs: nnx.Rngs, *, scan: bool = False, tx=None):
    self.scan, self.tx = scan, tx
    self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)  # unannotated, as in the tutorial
    if scan:

      @nnx.split_rngs(splits=cfg.layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def make(rngs):
        return Block(cfg, rngs)

      self.blocks = make(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.head = nnx.Linear(cfg.width, cfg.vocab, kernel_init=_cols(), rngs=rngs)

  def _gathered(self, module):
    return module if self.tx is None else zerojax.nnx.gathered(module, self.tx)

  def __call__(self, tokens):
    x = self._gathered(self.embed)(tokens)
    if self.scan:

      @nnx.remat(policy=zerojax.recompute_gathers)
      def layer(block, x):
        return self._gathered(block)(x)

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(x, block):
        return layer(block, x)

      x = run(x, self.blocks)
    else:
      for block in self.blocks:
        x = self._gathered(block)(x)
    return self._gathered(self.head)(self._gathered(self.norm)(x))


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def create(cfg: Config, mesh, *, scan: bool, tx=None):
  """The tutorial's way: created under jit, each parameter constrained to its annotation."""

  @nnx.jit
  def make():
    model = MiniGPT(cfg, nnx.Rngs(0), scan=scan, tx=tx)
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model

  with jax.set_mesh(mesh):
    return make()


def batches(cfg: Config, mesh, steps: int, text: np.ndarray):
  rng = np.random.default_rng(0)
  rows = NamedSharding(mesh, P('batch'))
  for _ in range(steps):
    starts = rng.integers(0, len(text) - cfg.seq_len - 1, cfg.batch)
    tokens = np.stack([text[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int32)
    yield jax.device_put(tokens, rows)


def state_bytes(optimizer) -> int:
  """The optimizer state one device holds (device 0's shards)."""
  leaves = jax.tree.leaves(nnx.as_pure(nnx.state(optimizer.opt_state)))
  return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def train(cfg: Config, mesh, tx, steps: int, text: np.ndarray, *, scan=False, per_layer=False):
  """Trains with `tx`: returns (losses, model, optimizer)."""
  model = create(cfg, mesh, scan=scan, tx=tx if per_layer else None)
  if per_layer:
    grad_fn = zerojax.nnx.value_and_grad(loss_fn, tx, per_layer=True)
  else:
    grad_fn = nnx.value_and_grad(loss_fn)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = grad_fn(model, tokens)
    optimizer.update(model, grads)
    return loss

  losses = []
  with jax.set_mesh(mesh):
    if per_layer:
      zerojax.nnx.shard(model, tx)  # split from step 0
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for tokens in common.progress(batches(cfg, mesh, steps, text), total=steps, desc='steps'):
      losses.append(float(step(model, optimizer, tokens)))
  return losses, model, optimizer


def compile_step(cfg: Config, mesh, stage: int, *, scan: bool, grads: str):
  """The training step compiled ahead of time (Flax's split/merge around `jax.jit`, the state
  donated), for its memory and collectives: `grads` is 'flax' (`nnx.value_and_grad`),
  'zerojax' (`zerojax.nnx.value_and_grad`, the model gathered before the loss) or 'zerojax
  per layer' (each module gathers its own where it runs)."""
  tx = zerojax.zero_stage(optax.adam(cfg.lr), stage, mesh=mesh, axis='batch')
  per_layer = grads == 'zerojax per layer'
  with jax.set_mesh(mesh):
    model = create(cfg, mesh, scan=scan, tx=tx if per_layer else None)
    zerojax.nnx.shard(model, tx)  # at stage 3, split from the start
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    if grads == 'flax':
      grad_fn = nnx.value_and_grad(loss_fn)
    else:
      grad_fn = zerojax.nnx.value_and_grad(loss_fn, tx, per_layer=per_layer)

    def step(state, tokens):
      model, optimizer = nnx.merge(graphdef, state)
      loss, grads = grad_fn(model, tokens)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    tokens = jax.device_put(
      jnp.zeros((cfg.batch, cfg.seq_len + 1), jnp.int32), NamedSharding(mesh, P('batch'))
    )
    return jax.jit(step, donate_argnums=0).lower(state, tokens).compile()


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument('--devices', type=int, default=8, help='faked CPU devices')
  parser.add_argument('--stage', type=int, default=2, choices=(0, 1, 2, 3), help='ZeRO stage')
  parser.add_argument('--mesh', default='4x2', help="('batch', 'model') sizes, e.g. 4x2 or 8x1")
  parser.add_argument('--layers', type=int, default=Config.layers, help='transformer blocks')
  parser.add_argument('--steps', type=int, default=20, help='training steps')
  parser.add_argument('--scan', action='store_true', help='stage 3 layer by layer (see above)')
  parser.add_argument('--text', default=None, help="a text file; None: Python's docstrings")
  args = parser.parse_args(argv)
  if args.scan and args.stage != 3:
    parser.error('--scan gathers layer by layer, which is stage 3: pass --stage 3.')
  shape = tuple(int(s) for s in args.mesh.split('x'))
  if len(shape) != 2 or shape[0] * shape[1] != len(jax.devices()):
    parser.error(f'--mesh {args.mesh} must be two sizes whose product is {len(jax.devices())}.')
  mesh = jax.make_mesh(shape, ('batch', 'model'), axis_types=(AxisType.Auto,) * 2)
  cfg = Config(layers=args.layers)
  import gpt  # the examples' text loader

  text = gpt.load_text(args.text)
  print(f'miniGPT (NNX), {cfg.layers} layers, mesh {dict(mesh.shape)}, {args.steps} steps')
  plain_losses, _, plain_opt = train(
    cfg, mesh, optax.adam(cfg.lr), args.steps, text, scan=args.scan
  )
  tx = zerojax.zero_stage(optax.adam(cfg.lr), args.stage, mesh=mesh, axis='batch')
  zero_losses, zero_model, zero_opt = train(
    cfg, mesh, tx, args.steps, text, scan=args.scan, per_layer=args.scan
  )
  plan = zerojax.plan_for(tx, nnx.state(zero_model, nnx.Param))
  out = {
    'stage': args.stage,
    'mesh': dict(mesh.shape),
    'plain': {'final_loss': plain_losses[-1], 'state_bytes': state_bytes(plain_opt)},
    'zerojax': {
      'final_loss': zero_losses[-1],
      'state_bytes': state_bytes(zero_opt),
      'plan_state_bytes': plan.bytes_per_device()['opt_state'],
    },
  }
  print(f"ZeRO plan's optimizer state per device: {out['zerojax']['plan_state_bytes']:,} B")
  print('| optimizer | final loss | optimizer state per device |')
  print('|---|---|---|')
  print(f'| optax.adam | {plain_losses[-1]:.4f} | {out["plain"]["state_bytes"]:,} B |')
  print(
    f'| zero_stage(optax.adam, stage={args.stage}) | {zero_losses[-1]:.4f} |'
    f' {out["zerojax"]["state_bytes"]:,} B |'
  )
  return out


if __name__ == '__main__':
  sys.exit(main() and 0)
