"""FLOPs and kernel time per chip, counted in the compiled program (`cost.program_cost`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zerojax._src import grad as grad_lib
from zerojax._src import train_state, transform, zero_stage
from zerojax._src.planner import cost, presets, roofline, search

KW = dict(clock_hz=None, peak_flops=1e12, hbm_bandwidth=1e9)


def _module(*lines, params='(a: f32[8])'):
  return '\n'.join(['HloModule m', f'ENTRY %main {params} -> f32[8] {{', *lines, '}'])


def test_a_dot_counts_two_flops_per_multiply_add_of_its_contraction():
  text = _module(
    '  %a = bf16[4,32,16]{2,1,0} parameter(0)',
    '  %b = bf16[4,16,8]{2,1,0} parameter(1)',
    '  ROOT %d = bf16[4,32,8]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2},'
    ' rhs_batch_dims={0}, rhs_contracting_dims={1}',
  )
  assert cost.program_cost(text, **KW).matmul_flops == 2 * 4 * 32 * 8 * 16


def test_the_tpu_compilers_batched_matmul_convolutions_count_their_real_taps_only():
  # Forms copied from programs the TPU compiler wrote for attention and weight gradients:
  # batch dimensions made spatial with the input dilated by the window (one real tap each),
  # and a window padded past its input (the padding's taps read nothing).
  batched = _module(
    '  %q = bf16[2,4,32,128]{3,2,1,0} parameter(0)',
    '  %k = bf16[2,128,4,32]{3,2,1,0} parameter(1)',
    '  ROOT %c = f32[2,4,128,128]{3,2,1,0} convolution(%q, %k), window={size=2x4 stride=1x3'
    ' lhs_dilate=2x4}, dim_labels=01fb_0o1i->01bf',
  )
  assert cost.program_cost(batched, **KW).matmul_flops == 2 * (2 * 4 * 128 * 128) * 32
  padded = _module(
    '  %a = bf16[128,128,1]{2,1,0} parameter(0)',
    '  %b = bf16[2,128,128]{2,1,0} parameter(1)',
    '  ROOT %c = bf16[2,128,128]{2,1,0} convolution(%a, %b), window={size=2 pad=1_1'
    ' rhs_reversal=1}, dim_labels=fb0_0oi->0fb',
  )
  assert cost.program_cost(padded, **KW).matmul_flops == 2 * (2 * 128 * 128) * 128
  plain = _module(  # a real convolution: 3 taps on a 10-wide input, no padding
    '  %x = f32[1,10,4]{2,1,0} parameter(0)',
    '  %w = f32[3,4,5]{2,1,0} parameter(1)',
    '  ROOT %c = f32[1,8,5]{2,1,0} convolution(%x, %w), window={size=3}, dim_labels=b0f_0io->b0f',
  )
  assert cost.program_cost(plain, **KW).matmul_flops == 2 * (8 * 5) * 4 * 3


def test_kernels_in_a_loop_count_per_iteration_at_the_compilers_estimate_or_their_roofline():
  text = '\n'.join([
    'HloModule m',
    '%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {',
    '  %p = (s32[], f32[64,64]{1,0}) parameter(0)',
    '  %i = s32[] get-tuple-element(%p), index=0',
    '  %x = f32[64,64]{1,0} get-tuple-element(%p), index=1',
    '  %one = s32[] constant(1)',
    '  %j = s32[] add(%i, %one)',
    '  %f = f32[64,64]{1,0} fusion(%x), kind=kOutput, calls=%mm,'
    ' backend_config={"estimated_cycles":"3000"}',
    '  ROOT %t = (s32[], f32[64,64]{1,0}) tuple(%j, %f)',
    '}',
    '%mm (a: f32[64,64]) -> f32[64,64] {',
    '  %a = f32[64,64]{1,0} parameter(0)',
    '  ROOT %d = f32[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
    '}',
    '%cond (p: (s32[], f32[64,64])) -> pred[] {',
    '  %p = (s32[], f32[64,64]{1,0}) parameter(0)',
    '  %i = s32[] get-tuple-element(%p), index=0',
    '  %n = s32[] constant(5)',
    '  ROOT %lt = pred[] compare(%i, %n), direction=LT',
    '}',
    'ENTRY %main (x: f32[64,64]) -> f32[64,64] {',
    '  %x = f32[64,64]{1,0} parameter(0)',
    '  %zero = s32[] constant(0)',
    '  %init = (s32[], f32[64,64]{1,0}) tuple(%zero, %x)',
    '  %w = (s32[], f32[64,64]{1,0}) while(%init), condition=%cond, body=%body,'
    ' backend_config={"known_trip_count":{"n":"5"}}',
    '  %y = f32[64,64]{1,0} get-tuple-element(%w), index=1',
    '  ROOT %e = f32[64,64]{1,0} exponential(%y)',
    '}',
  ])  # fmt: skip
  c = cost.program_cost(text, clock_hz=1e9, peak_flops=1e12, hbm_bandwidth=1e9)
  assert c.matmul_flops == 5 * 2 * 64**3
  # The fusion and the counter's add run 5 times, the exponential once.
  assert (c.kernels, c.estimated_kernels) == (5 + 5 + 1, 5)
  assert c.estimated_seconds == pytest.approx(5 * 3000 / 1e9)
  # Without an estimate a kernel costs its roofline: the exponential moves 2 x 16 KiB, each
  # of the 5 adds 12 bytes, at 1 GB/s.
  assert c.roofline_seconds == pytest.approx((2 * 64 * 64 * 4 + 5 * 12) / 1e9)
  assert c.matmul_seconds == pytest.approx(5 * 3000 / 1e9)
  # Read without the clock, the fusion's roofline replaces the estimate.
  c = cost.program_cost(text, clock_hz=None, peak_flops=1e12, hbm_bandwidth=1e9)
  assert c.estimated_kernels == 0 and c.matmul_flops == 5 * 2 * 64**3


def test_a_loop_without_a_trip_count_is_counted_once_and_said():
  text = '\n'.join([
    'HloModule m',
    '%body (p: f32[8,8]) -> f32[8,8] {',
    '  %p = f32[8,8]{1,0} parameter(0)',
    '  ROOT %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
    '}',
    '%cond (p: f32[8,8]) -> pred[] {',
    '  %p = f32[8,8]{1,0} parameter(0)',
    '  ROOT %c = pred[] custom-call(%p), custom_call_target="stop"',
    '}',
    'ENTRY %main (x: f32[8,8]) -> f32[8,8] {',
    '  %x = f32[8,8]{1,0} parameter(0)',
    '  ROOT %w = f32[8,8]{1,0} while(%x), condition=%cond, body=%body',
    '}',
  ])  # fmt: skip
  with pytest.warns(cost.CostCountWarning, match='has no known trip count in the HLO'):
    c = cost.program_cost(text, **KW)
  assert c.matmul_flops == 2 * 8**3 and len(c.uncertain) == 1


def test_the_chips_clock_comes_from_the_published_peak_and_matrix_units():
  assert roofline.CHIPS['v5e'].clock_hz == pytest.approx(197e12 / (2 * 1 * 4 * 128**2))  # 1.50 GHz
  assert roofline.CHIPS['v5p'].clock_hz == pytest.approx(459e12 / (2 * 2 * 4 * 128**2))  # 1.75 GHz
  assert roofline.CHIPS['v6e'].clock_hz == pytest.approx(918e12 / (2 * 1 * 2 * 256**2))  # 3.50 GHz


def _independent_flops(cfg, tokens, seq, remat, attention='xla', block=512):
  """Matmul FLOPs per chip of `presets.decoder_loss`, from the model's shape alone: forward
  2 x tokens x (layer and head weights) + attention 4 x tokens x seq x width per layer (the
  full square: no causal skipping), backward twice the forward; remat 'full' runs each
  block's forward again but for its last projection, whose output the backward does not
  read. Flash attention runs only the (block x block) squares on or below the diagonal: two
  products of 2 x block x block x head FLOPs per square and head forward, seven backward."""
  d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  layer = d * q + 2 * d * kv + q * d + (3 if cfg.gated else 2) * d * f
  if attention == 'flash':
    n = seq // min(block, seq)
    squares = n * (n + 1) // 2 * min(block, seq) ** 2  # query x key pairs computed
    product = 2 * (tokens // seq) * squares * q
    attention_fwd, attention_bwd = 2 * product, 7 * product
  else:
    attention_fwd = 4 * tokens * seq * q
    attention_bwd = 2 * attention_fwd
  forward_layers = cfg.n_layers * (2 * tokens * layer + attention_fwd)
  backward_layers = cfg.n_layers * (2 * 2 * tokens * layer + attention_bwd)
  head = 2 * tokens * d * cfg.vocab
  total = forward_layers + backward_layers + 3 * head
  if remat == 'full':
    total += forward_layers - cfg.n_layers * 2 * tokens * f * d
  return total


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
@pytest.mark.parametrize(
  'remat, attention, seq', [('none', 'xla', 128), ('full', 'xla', 128), ('full', 'flash', 1024)]
)
def test_flops_per_chip_are_the_same_on_both_gradient_paths_and_equal_the_models(
  remat, attention, seq
):
  """Issue 36: jax.value_and_grad outside shard_map once counted the whole mesh's FLOPs
  (256x on 256 chips). Counted in the compiled program, both paths give one chip's work."""
  pytest.importorskip('libtpu')
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

  from zerojax._src.planner import tpu

  devices = tpu.topology_devices('v5e:2x4')
  mesh = Mesh(np.array(devices), ('data',), axis_types=(AxisType.Auto,))
  cfg, rows = presets.PRESETS['tiny'], 16
  spec = presets.decoder_spec(
    'tiny', presets.ModelSettings(seq_len=seq, attention=attention), remat=remat
  )
  tx = zero_stage.zero_stage(optax.adamw(1e-4), 3, mesh=mesh)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  state = train_state.abstract_train_state(spec.init_fn, key, tx=tx)
  plan = transform.plan_for(state.tx, state.params)
  batch = jax.ShapeDtypeStruct(
    (rows, seq + 1), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec('data'))
  )
  paths = {
    'jax': lambda p, b: jax.value_and_grad(lambda q: spec.loss_fn(q, b, plan))(p),
    'zerojax': grad_lib.value_and_grad(
      lambda p, b: spec.loss_fn(p, b, plan), state.tx, per_layer=True
    ),
  }
  counted = {}
  for name, grad_fn in paths.items():

    def step(s, b, grad_fn=grad_fn):
      loss, grads = grad_fn(s.params, b)
      return s.apply_gradients(grads=grads), loss

    compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    counted[name] = search.program_cost(roofline.CHIPS['v5e'], compiled.as_text()).matmul_flops
  expected = _independent_flops(
    cfg, tokens=rows // 8 * seq, seq=seq, remat=remat, attention=attention
  )
  assert counted['jax'] == pytest.approx(counted['zerojax'], rel=0.02)
  assert counted['zerojax'] == pytest.approx(expected, rel=0.02), (counted, expected)


def test_the_compilers_no_estimate_sentinel_costs_the_kernels_roofline():
  # The TPU compiler writes INT64_MAX as the estimate of a kernel it has none for (a 70B plan
  # on v5p:4x4x4 was predicted at 5.3e9 s per step from one such kernel).
  text = '\n'.join([
    'HloModule m',
    'ENTRY %main (x: f32[64,64]) -> f32[64,64] {',
    '  %x = f32[64,64]{1,0} parameter(0)',
    '  ROOT %e = f32[64,64]{1,0} exponential(%x),'
    ' backend_config={"estimated_cycles":"9223372036854775807"}',
    '}',
  ])  # fmt: skip
  c = cost.program_cost(text, clock_hz=1e9, peak_flops=1e12, hbm_bandwidth=1e9)
  assert (c.kernels, c.estimated_kernels) == (1, 0)
  assert c.kernel_seconds == pytest.approx(2 * 64 * 64 * 4 / 1e9)


def test_a_tpu_kernel_costs_what_it_states_and_one_that_states_nothing_is_said_and_counted():
  """A Pallas kernel's stated cost (`pl.CostEstimate`) is its FLOPs at the roofline; one that
  states none (MaxText's splash attention) is costed at its bytes over HBM bandwidth, its
  FLOPs uncounted, and the count says so: the kernels' time is then a lower bound."""
  stated = _module(
    '  %a = bf16[1024]{0} parameter(0)',
    '  ROOT %flash.3 = bf16[1024]{0} custom-call(%a), custom_call_target="tpu_custom_call",'
    ' backend_config={"custom_call_config": {"cost_estimate":{"flops":"4000000000",'
    '"transcendentals":"0","bytes_accessed":"4096"}}}',
  )
  c = cost.program_cost(stated, **KW)
  assert c.matmul_flops == 4e9 and c.kernel_seconds == 4e9 / 1e12
  assert c.unpriced_kernels == 0 and c.uncertain == ()
  silent = _module(
    '  %a = bf16[1024]{0} parameter(0)',
    '  ROOT %splash_mha_fwd.7 = bf16[1024]{0} custom-call(%a),'
    ' custom_call_target="tpu_custom_call"',
  )
  with pytest.warns(cost.CostCountWarning) as said:
    c = cost.program_cost(silent, **KW)
  assert c.matmul_flops == 0 and c.unpriced_kernels == 1
  assert c.unpriced_seconds == c.kernel_seconds == 4096 / 1e9  # its operand and result bytes
  assert str(said[0].message) == (
    'program_cost: 1 runs per step of TPU custom kernels that state no cost (splash_mha_fwd: no'
    ' pl.CostEstimate and no compiler estimate) are costed at their bytes over HBM bandwidth,'
    " 0.000 s, their FLOPs uncounted: the kernels' time is a lower bound for them."
  )
