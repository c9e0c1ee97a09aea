"""Causal flash attention for TPU as Pallas kernels, each stating its exact cost.

The decoder preset's `attention='flash'` (MaxText's attention: a fused kernel,
the scores never written to HBM). Three kernels: the forward, and the backward
as two (one accumulates the keys' and values' gradients over the queries, one
the queries' over the keys). Each skips the blocks above the causal diagonal
and carries a `pl.CostEstimate` of exactly the blocks it runs: the TPU
compiler has no estimate of its own for a custom kernel, and the planner reads
these (`cost.program_cost`) as the kernels' FLOPs and bytes.

Every kernel works on transposed scores (keys x queries), so that the row
statistics (log-sum-exp, and the backward's `sum(dO * O)`) are rows of one
lane-dense array per head, and every matmul is a plain or right-transposed one.
On a backend other than TPU the kernels run in Pallas's interpreter (slow,
for checking the arithmetic).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DEFAULT_BLOCK = 512
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_NEG = -1e30


def _pairs(t: int, block: int) -> int:
  """Query-block x key-block pairs a causal kernel runs (on or below the diagonal)."""
  n = t // block
  return n * (n + 1) // 2


def _scores_t(q, k, scale, qi, kj, block):
  """Scaled scores, keys x queries, with the causal mask (key index > query index: -inf)."""
  s = jax.lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32) * scale
  keys = kj * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
  queries = qi * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
  return jnp.where(keys <= queries, s, _NEG)


def _weights_and_grads_t(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, scale, qi, kj, block):
  """The backward's attention weights and score gradients, keys x queries: P from the saved
  log-sum-exp, and dS = P * (dO V^T - sum(dO * O)), times the scale for the raw scores."""
  p = jnp.exp(_scores_t(q_ref[0, 0], k_ref[0, 0], scale, qi, kj, block) - lse_ref[0, 0])
  dp = jax.lax.dot_general(v_ref[0, 0], do_ref[0, 0], _NT, preferred_element_type=jnp.float32)
  return p, p * (dp - delta_ref[0, 0]) * scale


def _forward_kernel(q_ref, k_ref, vt_ref, ot_ref, lse_ref, m_sc, l_sc, acc_sc, *, scale, block):
  qi, kj = pl.program_id(2), pl.program_id(3)

  @pl.when(kj == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(kj <= qi)
  def _():
    s = _scores_t(q_ref[0, 0], k_ref[0, 0], scale, qi, kj, block)  # (keys, queries)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=0, keepdims=True)
    pv = jax.lax.dot_general(
      vt_ref[0, 0], p.astype(vt_ref.dtype), _NN, preferred_element_type=jnp.float32
    )  # (head, queries)
    acc_sc[...] = alpha * acc_sc[...] + pv
    m_sc[...] = m_new

  @pl.when(kj == qi)
  def _():
    ot_ref[0, 0] = (acc_sc[...] / l_sc[...]).astype(ot_ref.dtype)
    lse_ref[0, 0] = m_sc[...] + jnp.log(l_sc[...])


def _dkv_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, scale, block
):
  kj, qi = pl.program_id(2), pl.program_id(3)

  @pl.when(qi == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(qi >= kj)
  def _():
    q, do = q_ref[0, 0], do_ref[0, 0]
    p, ds = _weights_and_grads_t(
      q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, scale, qi, kj, block
    )
    dv_sc[...] += jax.lax.dot_general(
      p.astype(do.dtype), do, _NN, preferred_element_type=jnp.float32
    )
    dk_sc[...] += jax.lax.dot_general(
      ds.astype(q.dtype), q, _NN, preferred_element_type=jnp.float32
    )

  @pl.when(qi == pl.num_programs(3) - 1)
  def _():
    dk_ref[0, 0] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(
  q_ref, k_ref, kt_ref, v_ref, do_ref, lse_ref, delta_ref, dqt_ref, dq_sc, *, scale, block
):
  qi, kj = pl.program_id(2), pl.program_id(3)

  @pl.when(kj == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(kj <= qi)
  def _():
    _, ds = _weights_and_grads_t(
      q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, scale, qi, kj, block
    )
    dq_sc[...] += jax.lax.dot_general(
      kt_ref[0, 0], ds.astype(kt_ref.dtype), _NN, preferred_element_type=jnp.float32
    )  # (head, queries)

  @pl.when(kj == qi)
  def _():
    dqt_ref[0, 0] = dq_sc[...].astype(dqt_ref.dtype)


def _params():
  return pltpu.CompilerParams(dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary'))


def _cost(b, h, t, d, block, itemsize, *, matmuls, reads_per_pair, once) -> pl.CostEstimate:
  """The blocks a kernel runs: `matmuls` (block x block x d) products per pair, the
  exponentials of each pair's scores, and the bytes it moves: `reads_per_pair` (block x d)
  blocks fetched per pair, `once` (t x d) arrays read or written once per head."""
  pairs = b * h * _pairs(t, block)
  return pl.CostEstimate(
    flops=int(2 * matmuls * pairs * block * block * d),
    transcendentals=int(pairs * block * block),
    bytes_accessed=int(itemsize * d * (reads_per_pair * pairs * block + once * b * h * t)),
  )


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, cost, interpret):
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    scratch_shapes=scratch,
    compiler_params=_params(),
    cost_estimate=cost,
    interpret=interpret,
  )


def _specs(block, d):
  """Block specs, for a grid (batch, head, outer, inner), of (batch, head, seq, d) arrays
  (`seq`), their transposes (`seq_t`) and the (batch, head, 1, seq) row statistics (`row`);
  each takes which grid index picks the operand's sequence block: the outer one, or the
  inner one clamped to the causal diagonal ('keys' for the forward and query kernels,
  'queries' for the key/value kernel), so that a block past it is not fetched again."""
  by = {
    'outer': lambda i, j: i,
    'keys': lambda i, j: jnp.minimum(j, i),  # forward/dq: no fetch past the diagonal
    'queries': lambda i, j: jnp.maximum(j, i),  # dkv: no fetch before it
  }
  seq = lambda w: pl.BlockSpec((1, 1, block, d), lambda b, h, i, j: (b, h, by[w](i, j), 0))
  seq_t = lambda w: pl.BlockSpec((1, 1, d, block), lambda b, h, i, j: (b, h, 0, by[w](i, j)))
  row = lambda w: pl.BlockSpec((1, 1, 1, block), lambda b, h, i, j: (b, h, 0, by[w](i, j)))
  return seq, seq_t, row


def _forward(q, k, v, scale, block, interpret):
  b, h, t, d = q.shape
  seq, seq_t, row = _specs(block, d)
  out_shape = [
    jax.ShapeDtypeStruct((b, h, d, t), q.dtype),
    jax.ShapeDtypeStruct((b, h, 1, t), jnp.float32),
  ]
  scratch = [
    pltpu.VMEM((1, block), jnp.float32),
    pltpu.VMEM((1, block), jnp.float32),
    pltpu.VMEM((d, block), jnp.float32),
  ]
  cost = _cost(b, h, t, d, block, q.dtype.itemsize, matmuls=2, reads_per_pair=2, once=2)
  ot, lse = _call(
    functools.partial(_forward_kernel, scale=scale, block=block),
    (b, h, t // block, t // block),
    [seq('outer'), seq('keys'), seq_t('keys')],
    [seq_t('outer'), row('outer')],
    out_shape,
    scratch,
    cost,
    interpret,
  )(q, k, jnp.swapaxes(v, 2, 3))
  return jnp.swapaxes(ot, 2, 3), lse


def _backward(q, k, v, o, lse, do, scale, block, interpret):
  b, h, t, d = q.shape
  seq, seq_t, row = _specs(block, d)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)[:, :, None, :]
  size = q.dtype.itemsize
  dk, dv = _call(
    functools.partial(_dkv_kernel, scale=scale, block=block),
    (b, h, t // block, t // block),
    [seq('queries'), seq('outer'), seq('outer'), seq('queries'), row('queries'), row('queries')],
    [seq('outer'), seq('outer')],
    [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    [pltpu.VMEM((block, d), jnp.float32), pltpu.VMEM((block, d), jnp.float32)],
    _cost(b, h, t, d, block, size, matmuls=4, reads_per_pair=2, once=4),
    interpret,
  )(q, k, v, do, lse, delta)
  dqt = _call(
    functools.partial(_dq_kernel, scale=scale, block=block),
    (b, h, t // block, t // block),
    [
      seq('outer'),
      seq('keys'),
      seq_t('keys'),
      seq('keys'),
      seq('outer'),
      row('outer'),
      row('outer'),
    ],
    [seq_t('outer')],
    [jax.ShapeDtypeStruct((b, h, d, t), q.dtype)],
    [pltpu.VMEM((d, block), jnp.float32)],
    _cost(b, h, t, d, block, size, matmuls=3, reads_per_pair=3, once=3),
    interpret,
  )(q, k, jnp.swapaxes(k, 2, 3), v, do, lse, delta)[0]
  return jnp.swapaxes(dqt, 2, 3), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, scale, block, interpret):
  return _forward(q, k, v, scale, block, interpret)[0]


def _attention_fwd(q, k, v, scale, block, interpret):
  o, lse = _forward(q, k, v, scale, block, interpret)
  return o, (q, k, v, o, lse)


def _attention_bwd(scale, block, interpret, res, do):
  q, k, v, o, lse = res
  return _backward(q, k, v, o, lse, do, scale, block, interpret)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, *, block: int = DEFAULT_BLOCK, interpret: bool | None = None):
  """Causal attention of (batch, seq, heads, head_dim) arrays, as
  `jax.nn.dot_product_attention(q, k, v, is_causal=True)` computes it.

  Key/value heads fewer than the query heads (grouped-query attention) are
  repeated to match. `block` queries and keys per step (the sequence length if
  shorter); `interpret`: None runs Pallas's interpreter off TPU.
  """
  b, t, h, d = q.shape
  if k.shape[2] != h:
    if h % k.shape[2]:
      raise ValueError(f'flash_attention: {k.shape[2]} key/value heads do not divide {h} heads.')
    k, v = (jnp.repeat(x, h // k.shape[2], axis=2) for x in (k, v))
  block = min(block, t)
  if t % block:
    raise ValueError(
      f'flash_attention: block={block} does not divide the sequence length {t}; choose a block'
      ' that does (128 and 512 are the sizes TPU kernels like).'
    )
  if interpret is None:
    interpret = jax.devices()[0].platform != 'tpu'
  to_heads = lambda x: jnp.swapaxes(x, 1, 2)
  out = _attention(to_heads(q), to_heads(k), to_heads(v), 1.0 / math.sqrt(d), block, interpret)
  return to_heads(out)
