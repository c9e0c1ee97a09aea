"""count_collectives on hand-written HLO of each form, and on programs whose counts are known."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import zerojax
from zerojax._src.planner.collectives import CollectiveCountWarning

GROUPS = 'replica_groups={{0,1,2,3}}'


def hlo(*computations: str, entry: str) -> str:
  return '\n\n'.join(computations + (entry,))


def module(body: str) -> str:
  return 'ENTRY %main (p: f32[8]) -> f32[8] {\n' + body + '\n}'


LOOP_BODY = """%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %i = s32[] get-tuple-element(%t), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8]{0}) tuple(%next, %ar)
}"""
LOOP_COND = """%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""


def loop_module(backend_config: str, start: str = 'constant(0)') -> str:
  return hlo(
    LOOP_BODY,
    LOOP_COND,
    entry=module(
      '  %p = f32[8]{0} parameter(0)\n'
      f'  %z = s32[] {start}\n'
      '  %c = s32[] copy(%z)\n'
      '  %init = (s32[], f32[8]{0}) tuple(%c, %p)\n'
      f'  %w = (s32[], f32[8]{{0}}) while(%init), condition=%cond, body=%body{backend_config}\n'
      '  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1'
    ),
  )


def test_while_with_known_trip_count_counts_each_iteration():
  text = loop_module(', backend_config={"known_trip_count":{"n":"5"}}')
  stats = zerojax.inspect.count_collectives(text)
  assert stats['all-reduce'] == 5
  assert stats.result_bytes['all-reduce'] == 5 * 32
  assert stats.exact


def test_while_trip_count_from_condition_and_known_start_and_step():
  text = loop_module(', backend_config={"known_init_step":{"init":"0","step":"2"}}')
  stats = zerojax.inspect.count_collectives(text)
  assert stats['all-reduce'] == 3  # i = 0, 2, 4 < 6
  assert stats.exact


def test_while_trip_count_from_the_loop_itself():
  # The TPU compiler's form: no backend config; `i` starts at a constant in the
  # initial tuple, the body adds a constant, the condition compares with one.
  stats = zerojax.inspect.count_collectives(loop_module(''))
  assert stats['all-reduce'] == 6  # i = 0..5 < 6
  assert stats.exact
  assert zerojax.inspect.count_collectives(loop_module('', 'constant(4)'))['all-reduce'] == 2


def test_while_trip_count_with_an_unsigned_counter():
  # The TPU compiler's windowed matmuls (tensor-parallel collective matmuls)
  # count with u32: read as the signed form, not left uncounted.
  text = loop_module('').replace('s32[]', 'u32[]')
  stats = zerojax.inspect.count_collectives(text)
  assert stats['all-reduce'] == 6 and stats.exact


def test_while_without_trip_count_says_so_and_does_not_guess():
  text = loop_module('', start='parameter(1)')  # starts where the program is called
  with pytest.warns(CollectiveCountWarning, match='while loop %w in %main has no known trip'):
    stats = zerojax.inspect.count_collectives(text)
  assert stats['all-reduce'] == 1  # counted once per step, flagged as a lower bound
  assert not stats.exact
  assert stats.uncertain == (
    'while loop %w in %main has no known trip count in the HLO; the collectives of its'
    ' body are counted once',
  )


def test_nested_loops_multiply_their_trip_counts():
  outer_body = """%outer_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %ag = f32[32]{0} all-gather(f32[8]{0} %x), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %x)
}"""
  text = hlo(
    LOOP_BODY,
    LOOP_COND,
    outer_body,
    entry=module(
      '  %p = f32[8]{0} parameter(0)\n'
      '  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%outer_body,'
      ' backend_config={"known_trip_count":{"n":"3"}}\n'
      '  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1'
    ),
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats['all-reduce'] == 12 and stats['all-gather'] == 3
  assert stats.result_bytes['all-gather'] == 3 * 128


@pytest.mark.parametrize(
  'line, kind, nbytes',
  [
    # all-gather-start: (operand, result).
    ('%s = (f32[8]{0}, f32[32]{0}) all-gather-start(%p), dimensions={0}', 'all-gather', 128),
    # Variadic all-gather-start: ((operands), (results)).
    (
      '%s = ((f32[8]{0}, f32[4]{0}), (f32[32]{0}, f32[16]{0})) all-gather-start(%p, %q),'
      ' dimensions={0}',
      'all-gather',
      192,
    ),
    # all-reduce-start: results only, a tuple when variadic (not halved).
    ('%s = (f32[8]{0}, f32[16]{0}) all-reduce-start(%p, %q), to_apply=%add', 'all-reduce', 96),
    ('%s = f32[8]{0} all-reduce-start(%p), to_apply=%add', 'all-reduce', 32),
    # collective-permute-start: (operand, result, context, context).
    (
      '%s = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p),'
      ' source_target_pairs={{0,1},{1,0}}',
      'collective-permute',
      32,
    ),
    # The generic async form: ((operands), result, context).
    (
      '%s = ((f32[32]{0}), f32[8]{0}, s32[]) reduce-scatter-start(%p), dimensions={0},'
      ' to_apply=%add',
      'reduce-scatter',
      32,
    ),
  ],
)
def test_async_start_counts_once_with_the_bytes_it_delivers(line, kind, nbytes):
  start = '  ' + line.replace('%s', '%start') + ', ' + GROUPS
  done = f'  ROOT %done = f32[8]{{0}} {kind}-done(%start)'
  stats = zerojax.inspect.count_collectives(
    module(f'  %p = f32[8]{{0}} parameter(0)\n{start}\n{done}')
  )
  assert stats.counts == {kind: 1}
  assert stats.result_bytes == {kind: nbytes}


def test_variadic_all_reduce_is_one_op_with_all_its_bytes():
  text = module(
    '  %p = f32[8]{0} parameter(0)\n'
    '  ROOT %ar = (f32[8]{0}, bf16[16]{0}) all-reduce(%p, %q), replica_groups={{0,1,2,3}},'
    ' to_apply=%add'
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'all-reduce': 1}
  assert stats.result_bytes == {'all-reduce': 32 + 32}
  # Integer bytes times (N-1)/N in float64: approx only for the division's rounding.
  assert stats.ring_bytes['all-reduce'] == pytest.approx(2 * 64 * 3 / 4)


def branch(name: str, collective: str) -> str:
  return f"""%{name} (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  ROOT %y = f32[8]{{0}} {collective}
}}"""


def test_conditional_with_equal_branches_counts_once():
  ar = 'all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add'
  text = hlo(
    branch('b0', ar),
    branch('b1', ar),
    entry=module('  ROOT %c = f32[8]{0} conditional(%i, %p, %p), branch_computations={%b0, %b1}'),
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'all-reduce': 1} and stats.exact


def test_conditional_with_different_branches_counts_the_costliest_and_says_so():
  text = hlo(
    branch('b0', 'all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add'),
    branch('b1', 'multiply(%x, %x)'),
    branch('b2', 'all-gather(%x), replica_groups={{0,1}}, dimensions={0}'),
    entry=module(
      '  ROOT %c = f32[8]{0} conditional(%i, %p, %p, %p), branch_computations={%b0, %b1, %b2}'
    ),
  )
  with pytest.warns(CollectiveCountWarning, match='3 branches run different collectives'):
    stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'all-reduce': 1}  # not all-reduce + all-gather
  assert not stats.exact


def test_tpu_fused_all_reduce_scatter_counts_as_one_reduce_scatter():
  text = module(
    '  %p = f32[64]{0} parameter(0)\n'
    '  %rs = f32[8]{0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.1, channel_id=7,'
    " replica_groups=mesh['x'=8] {'x'}\n"
    '  %rs.1 = f32[8]{0} fusion(%rs), kind=kCustom, calls=%all-reduce-scatter.2, channel_id=7,'
    " replica_groups=mesh['x'=8] {'x'}\n"
    '  ROOT %r = f32[8]{0} copy(%rs.1)'
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'reduce-scatter': 1}
  assert stats.ring_bytes['reduce-scatter'] == 32 * 7


def test_tpu_fused_all_reduce_scatter_takes_its_group_from_inside():
  # The fusion line names no replica groups; its computation's all-reduce does
  # (here groups of 4 of 16 devices, as over one axis of a 4x4 torus).
  text = (
    'HloModule m, num_partitions=16\n\n'
    '%all-reduce-scatter (input: f32[64]) -> f32[16] {\n'
    '  %input = f32[64]{0} parameter(0)\n'
    '  %ar = f32[64]{0} all-reduce(%input), channel_id=2,'
    ' replica_groups={{0,1,2,3},{4,5,6,7},{8,9,10,11},{12,13,14,15}}, to_apply=%add\n'
    '  ROOT %ds = f32[16]{0} slice(%ar), slice={[0:16]}\n'
    '}\n\n'
    'ENTRY %main (p: f32[64]) -> f32[16] {\n'
    '  %p = f32[64]{0} parameter(0)\n'
    '  ROOT %rs = f32[16]{0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter\n'
    '}\n'
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'reduce-scatter': 1}
  assert stats.ring_bytes['reduce-scatter'] == 64 * 3  # S(n-1) with n = 4, not 16


def test_tpu_async_collective_counts_once_at_its_start():
  # The TPU form: the start, a continuation fusion (the matmul it overlaps) and
  # the done each carry a copy of the all-gather. Every explicit collective of
  # a shard_map has channel_id=1, so a reduce-scatter shares that channel.
  gather = (
    '  %x = f32[8]{0} parameter(0)\n'
    '  ROOT %ag = f32[64]{0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}},'
    ' dimensions={0}\n'
  )
  text = (
    'HloModule m\n\n'
    f'%ag_start (x: f32[8]) -> f32[64] {{\n{gather}}}\n\n'
    f'%async_collective_fusion.1 (x: f32[8]) -> f32[64] {{\n{gather}}}\n\n'
    f'%ag_done (x: f32[8]) -> f32[64] {{\n{gather}}}\n\n'
    '%add (a: f32[], b: f32[]) -> f32[] {\n'
    '  %a = f32[] parameter(0)\n'
    '  %b = f32[] parameter(1)\n'
    '  ROOT %s = f32[] add(%a, %b)\n'
    '}\n\n'
    'ENTRY %main (p: f32[8], g: f32[64]) -> f32[8] {\n'
    '  %p = f32[8]{0} parameter(0)\n'
    '  %g = f32[64]{0} parameter(1)\n'
    '  %async-collective-start = f32[64]{0} fusion(%p), kind=kCustom, calls=%ag_start\n'
    '  %c = f32[64]{0} fusion(%async-collective-start), kind=kCustom,'
    ' calls=%async_collective_fusion.1\n'
    '  %async-collective-done = f32[64]{0} fusion(%c), kind=kCustom, calls=%ag_done\n'
    '  ROOT %rs = f32[8]{0} reduce-scatter(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}},'
    ' dimensions={0}, to_apply=%add\n'
    '}\n'
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'all-gather': 1, 'reduce-scatter': 1}
  # The continuation's matmul runs between the start and its done: overlapped.
  assert stats.overlapped_ring_bytes == {'all-gather': 256 * 7 / 8}


@pytest.mark.parametrize('between, overlapped', [(True, True), (False, False)])
def test_async_collective_overlaps_compute_scheduled_before_its_done(between, overlapped):
  compute = '  %y = f32[8]{0} multiply(%p, %p)\n' if between else ''
  text = module(
    '  %p = f32[8]{0} parameter(0)\n'
    '  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%p), replica_groups={{0,1,2,3,4,5,6,7}},'
    ' dimensions={0}\n' + compute + '  %agd = f32[64]{0} all-gather-done(%ags)\n'
    '  %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add\n'
    '  ROOT %r = f32[8]{0} copy(%ar)'
  )
  stats = zerojax.inspect.count_collectives(text)
  assert stats.counts == {'all-gather': 1, 'all-reduce': 1}
  gather_ring = 256 * 7 / 8
  assert stats.overlapped_ring_bytes == ({'all-gather': gather_ring} if overlapped else {})
  assert stats.overlap_fraction == pytest.approx(  # float64 ratios of byte counts
    gather_ring / stats.total_ring_bytes if overlapped else 0.0
  )


@pytest.fixture
def mesh8():
  return jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))


def test_compiled_scan_counts_a_gather_per_layer(mesh8):
  layers = 5

  def f(ws, x):
    def body(x, w):
      w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh8, PartitionSpec()))
      return jnp.tanh(x @ w), None

    return jax.lax.scan(body, x, ws)[0].sum()

  ws = jax.ShapeDtypeStruct(
    (layers, 64, 64), jnp.float32, sharding=NamedSharding(mesh8, PartitionSpec(None, 'data'))
  )
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh8, PartitionSpec()))
  stats = zerojax.inspect.count_collectives(jax.jit(f).lower(ws, x).compile())
  assert stats['all-gather'] == layers
  assert stats.result_bytes['all-gather'] == layers * 64 * 64 * 4
  assert stats.exact


def psum_loop(mesh, trips):
  def g(n, x):
    def body(i, x):
      return jax.lax.psum(x, 'data') / 8

    return jax.lax.fori_loop(0, trips if n is None else n, body, x)

  return jax.shard_map(
    g,
    mesh=mesh,
    in_specs=(PartitionSpec(), PartitionSpec('data')),
    out_specs=PartitionSpec('data'),
    check_vma=False,
  )


def test_compiled_loops_with_static_and_dynamic_trip_counts(mesh8):
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh8, PartitionSpec()))
  static = jax.jit(lambda x: psum_loop(mesh8, 7)(None, x)).lower(x).compile()
  stats = zerojax.inspect.count_collectives(static)
  assert stats['all-reduce'] == 7 and stats.exact
  n = jax.ShapeDtypeStruct((), jnp.int32)
  dynamic = jax.jit(psum_loop(mesh8, None)).lower(n, x).compile()
  with pytest.warns(CollectiveCountWarning, match='no known trip count'):
    stats = zerojax.inspect.count_collectives(dynamic)
  assert stats['all-reduce'] == 1 and not stats.exact
