"""Per-device bytes against the ZeRO formulas, and the collectives in the compiled step."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import (
  SCALARS,
  TWO_LAYER_D,
  TWO_LAYER_N,
  TWO_LAYER_PSI,
  compile_step,
  init_fn,
  plan_of,
  step,
)
from jax.sharding import NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner import arrays as arrays_lib

N, D, PSI = TWO_LAYER_N, TWO_LAYER_D, TWO_LAYER_PSI


# Model states at rest per device for fp32 Adam (docs/design.md), grads excluded.
AT_REST = {0: 12 * PSI, 1: 4 * PSI + 8 * PSI // N, 2: 4 * PSI + 8 * PSI // N, 3: 12 * PSI // N}


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_argument_bytes_equal_formula(stage, mesh):
  compiled, batch_bytes = compile_step(mesh, stage)
  assert zerojax.inspect.memory_stats(compiled).argument == AT_REST[stage] + batch_bytes + SCALARS


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_plan_bytes_equal_formula(stage, mesh):
  plan = plan_of(init_fn(jax.random.key(0)), optax.adam(1e-3), stage=stage, mesh=mesh)
  sizes = plan.bytes_per_device()
  assert sizes['params'] + sizes['opt_state'] == AT_REST[stage] + 4  # + Adam's count
  assert sizes['grads'] == (4 * PSI // N if stage >= 2 else 4 * PSI)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_collectives(stage, mesh):
  compiled, _ = compile_step(mesh, stage)
  stats = zerojax.inspect.count_collectives(compiled)
  text = compiled.as_text()
  grad_bytes = 4 * PSI
  if stage == 0:
    # Gradients all-reduced; nothing gathered.
    assert stats['all-reduce'] >= 1 and stats.result_bytes['all-reduce'] == grad_bytes
    assert stats['all-gather'] == 0 and stats['reduce-scatter'] == 0
  else:
    # XLA:CPU lowers the gradient reduction into shards as all-reduce +
    # dynamic-slice (docs/design.md); TPU makes it a reduce-scatter (tests/test_tpu.py).
    assert stats['reduce-scatter'] + stats['all-reduce'] >= 1
    assert stats.result_bytes.get('all-reduce', 0) <= grad_bytes
    assert 'dynamic-slice' in text or stats['reduce-scatter'] >= 1
    # Stages 1-2 gather the updated parameters: all of them, once.
    # Stage 3 gathers the parameters for use.
    assert stats['all-gather'] >= 1
    assert stats.result_bytes['all-gather'] >= grad_bytes


def test_counts_ops_inside_loops_by_trip_count(auto_mesh):
  def f(ws):
    def body(carry, w):
      full = jax.lax.with_sharding_constraint(w, NamedSharding(auto_mesh, PartitionSpec()))
      return carry + full.sum(), None

    return jax.lax.scan(body, 0.0, ws)[0]

  ws = jax.ShapeDtypeStruct(
    (5, 64), jnp.float32, sharding=NamedSharding(auto_mesh, PartitionSpec(None, 'data'))
  )
  stats = zerojax.inspect.count_collectives(jax.jit(f).lower(ws).compile())
  # One all-gather of 64 floats per scanned layer, five layers.
  assert stats['all-gather'] == 5
  assert stats.result_bytes['all-gather'] == 5 * 64 * 4


def test_donated_step_aliases_the_state(auto_mesh):
  state = zerojax.inspect.abstract_train_state(
    init_fn, jax.random.key(0), tx=zerojax.zero_stage(optax.adam(1e-3), 2, mesh=auto_mesh)
  )
  x = jax.ShapeDtypeStruct(
    (64, D), jnp.float32, sharding=NamedSharding(auto_mesh, PartitionSpec('data'))
  )
  compiled = jax.jit(step, donate_argnums=0).lower(state, x).compile()
  assert zerojax.inspect.memory_stats(compiled).alias == AT_REST[2] + SCALARS


def test_count_host_transfers_reads_memory_space_5():
  """A copy to host memory (S(5)) in the entry, a slice written into a host buffer in a loop
  of 4 iterations, and a copy back: bytes per step by direction, the largest of each."""
  text = '\n'.join([
    'HloModule m',
    '%body (p: (s32[], bf16[4,8]{1,0:S(5)})) -> (s32[], bf16[4,8]{1,0:S(5)}) {',
    '  %p = (s32[], bf16[4,8]{1,0:S(5)}) parameter(0)',
    '  %i = s32[] get-tuple-element(%p), index=0',
    '  %buf = bf16[4,8]{1,0:S(5)} get-tuple-element(%p), index=1',
    '  %g = bf16[1,8]{1,0} broadcast(%i), dimensions={}',
    '  %dus = ((bf16[4,8]{1,0:S(5)}, bf16[1,8]{1,0}, s32[], s32[]), bf16[4,8]{1,0:S(5)}, u32[])'
    ' dynamic-update-slice-start(%buf, %g, %i, %i)',
    '  %m = bf16[1,8]{1,0} multiply(%g, %g)',
    '  %done = bf16[4,8]{1,0:S(5)} dynamic-update-slice-done(%dus)',
    '  ROOT %t = (s32[], bf16[4,8]{1,0:S(5)}) tuple(%i, %done)',
    '}',
    '%cond (p: (s32[], bf16[4,8]{1,0:S(5)})) -> pred[] {',
    '  %p = (s32[], bf16[4,8]{1,0:S(5)}) parameter(0)',
    '  ROOT %c = pred[] constant(true)',
    '}',
    'ENTRY %main (a: f32[16]) -> f32[16] {',
    '  %a = f32[16]{0} parameter(0)',
    '  %cs = (f32[16]{0:S(5)}, f32[16]{0}, u32[]) copy-start(%a)',
    '  %cd = f32[16]{0:S(5)} copy-done(%cs)',
    '  %back = (f32[16]{0}, f32[16]{0:S(5)}, u32[]) copy-start(%cd)',
    '  %bd = f32[16]{0} copy-done(%back)',
    '  %w = (s32[], bf16[4,8]{1,0:S(5)}) while(%x), condition=%cond, body=%body,'
    ' backend_config={"known_trip_count":{"n":"4"}}',
    '  ROOT %r = f32[16]{0} add(%bd, %bd)',
    '}',
  ])  # fmt: skip
  got = zerojax.inspect.count_host_transfers(text)
  assert got.to_host == 64 + 4 * 16  # the copy, and one bf16[1,8] row per iteration
  assert got.to_device == 64
  assert got.largest_to_host == 64 and got.largest_to_device == 64
  assert got.in_loops == 4 * 16
  assert got.overlapped == pytest.approx(64 / (128 + 64))  # the loop's writes overlap a multiply
  assert got.uncertain == ()


def test_count_host_transfers_counts_what_a_host_computation_reads_and_writes():
  """A host computation (HostExecute) reading one operand from host memory (S(5)) and one
  from device memory, and writing one result to each: only the device-memory ones cross
  the link (read: to the host; written: to the device)."""
  text = '\n'.join([
    'HloModule m',
    '%host_fn (x: f32[8], y: bf16[4]) -> (f32[8], bf16[4]) {',
    '  %x = f32[8]{0} parameter(0)',
    '  %y = bf16[4]{0} parameter(1)',
    '  ROOT %t = (f32[8]{0}, bf16[4]{0}) tuple(%x, %y)',
    '}',
    'ENTRY %main (a: f32[8], b: bf16[4]) -> (f32[8], bf16[4]) {',
    '  %a = f32[8]{0:S(5)} parameter(0)',
    '  %b = bf16[4]{0} parameter(1)',
    '  %s = ((f32[8]{0:S(5)}, bf16[4]{0:T(1)L(1024)}), (f32[8]{0:S(5)}, bf16[4]{0:T(1)L(1024)}),'
    ' u32[]{:S(2)}) custom-call-start(%a, %b), async_execution_thread="host",'
    ' custom_call_target="HostExecute", called_computations={%host_fn}',
    '  ROOT %d = (f32[8]{0:S(5)}, bf16[4]{0:T(1)L(1024)}) custom-call-done(%s)',
    '}',
  ])  # fmt: skip
  got = zerojax.inspect.count_host_transfers(text)
  assert (got.to_host, got.to_device) == (8, 8)  # the bf16[4] operand down, the result back
  assert got.host_computations == 1


def test_largest_arrays_names_what_a_loop_stacks_per_iteration():
  # A scanned, rematerialised 6-layer stack: the forward loop stacks each layer's input for
  # the backward pass (f32[6,512,256]) and the backward loop stacks the weights' gradients.
  def f(ws, x):
    def body(h, w):
      return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(jax.checkpoint(body), x, ws)
    return jnp.sum(h)

  text = jax.jit(jax.grad(f)).lower(jnp.ones((6, 256, 256)), jnp.ones((512, 256))).compile()
  arrays = arrays_lib.largest_arrays(text, count=50)
  assert [a.nbytes for a in arrays] == sorted((a.nbytes for a in arrays), reverse=True)
  stacked = {a.type for a in arrays if a.stacked}
  assert {'f32[6,512,256]', 'f32[6,256,256]'} <= stacked
  assert all(a.loop_trips == 6 for a in arrays if a.stacked)
  assert arrays[0].nbytes == 6 * 512 * 256 * 4
