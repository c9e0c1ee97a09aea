"""Per-leaf layout rules (zerojax/_src/rules.py): specs and bytes per device."""

import jax
import numpy as np
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
