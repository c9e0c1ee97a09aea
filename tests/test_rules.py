"""Per-leaf layout rules (zerojax/_src/rules.py): specs and bytes per device."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zerojax._src import rules


def test_normalize_spec_pads_drops_and_keeps():
  mesh = jax.make_mesh((2, 4), ('model', 'data'))
  # One entry per dimension; the ZeRO axis dropped; an axis of another mesh dropped.
  assert rules.normalize_spec(P('model'), 3, mesh, drop=()) == P('model', None, None)
  assert rules.normalize_spec(P(('model', 'data'), None), 2, mesh, drop=('data',)) == P(
    'model', None
  )
  assert rules.normalize_spec(P('tensor', 'data'), 2, mesh, drop=()) == P(None, 'data')
  assert rules.normalize_spec(None, 1, mesh, drop=()) == P(None)


def test_bytes_per_device_rounds_up_each_split_dimension():
  mesh = jax.make_mesh((2, 4), ('model', 'data'))
  assert rules.bytes_per_device((8, 6), np.float32, P('data', None), mesh) == 2 * 6 * 4
  assert rules.bytes_per_device((9, 6), np.float32, P('data', 'model'), mesh) == 3 * 3 * 4
  assert rules.bytes_per_device((9,), np.int8, P(('model', 'data')), mesh) == 2
  assert rules.spec_axes(('model', 'data')) == ('model', 'data') and rules.spec_axes(None) == ()


def test_the_minor_dimension_is_split_last_unless_its_shards_are_whole_pairs_of_lanes():
  mesh = jax.make_mesh((8,), ('data',))
  rule = lambda shape, stacked=False: rules.leaf_rule(
    shape, np.float32, None, mesh=mesh, axes=('data',), replicate_below_bytes=0, stacked=stacked
  )
  # 7168 / 8 = 896: seven 128-lane tiles, an odd number (an all-reduce on TPU): the rows, on a
  # leaf marked as no layer stack (`Options.stacked`). Unmarked, its leading dimension may be
  # the axis a layer loop walks, and lane alignment never promotes it over a larger one.
  assert rule((1024, 7168)).sharded == P('data', None)
  assert rule((1024, 7168), None).sharded == P(None, 'data')
  assert rule((1024, 7168), True).sharded == P(None, 'data')
  # Unmarked, the larger leading dimension is still the largest: split.
  assert rule((7168, 1024), None).sharded == P('data', None)
  # 8192 / 8 = 1024: eight tiles; the larger dimension is split.
  assert rule((1024, 8192)).sharded == P(None, 'data')
  # When only the minor dimension divides, it is split all the same.
  assert rule((12, 7168)).sharded == P(None, 'data')


@pytest.mark.tpu
@pytest.mark.xdist_group('libtpu')
def test_tpu_keeps_a_minor_dimension_reduce_scatter_only_in_whole_pairs_of_lanes():
  """What MINOR_SHARD rests on: the TPU compiler (v5e:4x8, one ring of 8) lowers a bf16
  reduce-scatter along the minor dimension into 896-wide shards to an all-reduce, and keeps
  one into 1024-wide shards. Checked on the installed libtpu so that a compiler that stops
  doing so shows here."""
  pytest.importorskip('libtpu')
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding

  from zerojax._src.planner import collectives, tpu

  mesh = Mesh(np.array(tpu.topology_devices('v5e:4x8')).reshape(4, 8), ('x', 'y'))
  kinds = {}
  for shard in (896, 1024):

    def scatter(g):
      inner = lambda g: jax.lax.psum_scatter(g, 'y', scatter_dimension=1, tiled=True)
      return jax.shard_map(inner, mesh=mesh, in_specs=P(), out_specs=P(None, 'y'))(g)

    x = jax.ShapeDtypeStruct((1024, 8 * shard), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    text = jax.jit(scatter).lower(x).compile().as_text()
    kinds[shard] = sorted(collectives.count_collectives(text).counts)
  assert kinds == {896: ['all-reduce'], 1024: ['reduce-scatter']}
  assert rules.MINOR_SHARD == 256
