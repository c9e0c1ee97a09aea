"""The roofline: a predicted step time from the stated formula and the chips' published figures."""

import optax
import pytest

from zerojax._src import search


def test_roofline_prediction_is_the_stated_formula():
  chip = search.CHIPS['v5e']
  r = search.Result(search.Candidate(3), 'fits', ring_bytes=4e9, overlapped_bytes=1e9)
  r.flops, r.bytes_accessed = 197e12 * 0.5, 819e9 * 0.1  # 0.5 s of compute, 0.1 s of HBM
  parts = search.predict(chip, r, host_transfer_bytes=64e9)
  comm = 4e9 / (400e9 / 2)  # one torus axis: half of v5e's 400 GB/s
  # float64 arithmetic on the stated formula: approx only for its roundings.
  assert parts['compute'] == pytest.approx(0.5)
  assert parts['collectives'] == pytest.approx(comm)
  assert parts['exposed'] == pytest.approx(comm * 0.75)
  assert parts['host'] == pytest.approx(64e9 / 32e9)
  assert parts['step'] == pytest.approx(0.5 + comm * 0.75 + 2.0)
  # Offloaded state streamed through the device crosses the link twice; updated on the host,
  # the gradients go down and the updates come up.
  c = search.Candidate(3, offload='opt_state', update_on='device')
  assert search.host_transfer_bytes(c, host_bytes=10, param_bytes=3) == 20
  c = search.Candidate(3, offload='opt_state', update_on='host')
  assert search.host_transfer_bytes(c, host_bytes=10, param_bytes=3) == 6


def test_a_topology_without_roofline_constants_is_named():
  with pytest.raises(ValueError) as err:
    search.make_target('tiny', 'v4:2x2x1', devices=[], optimizer=optax.sgd)
  assert str(err.value) == (
    "`topology`='v4:2x2x1': no roofline constants for 'v4'; the search knows"
    " ['v5e', 'v5p', 'v6e'] and cpu:N."
  )
