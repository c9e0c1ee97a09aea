"""The roofline: a predicted step time from the stated formula and the chips' published figures."""

import optax
import pytest

from zerojax._src.planner import candidates, lowering, roofline, search


def test_roofline_prediction_is_the_stated_formula():
  chip = roofline.CHIPS['v5e']
  # 0.5 s of compute at peak, as a program with no kernel times counts it.
  r = roofline.StepCost(
    flops=197e12 * 0.5, kernel_seconds=0.0, ring_bytes=4e9, overlapped_bytes=1e9
  )
  parts = roofline.predict(chip, r, host_transfer_bytes=64e9)
  comm = 4e9 / (400e9 / 2)  # one torus axis: half of v5e's 400 GB/s
  # float64 arithmetic on the stated formula: approx only for its roundings.
  assert parts.compute == pytest.approx(0.5)
  assert parts.collectives == pytest.approx(comm)
  assert parts.exposed == pytest.approx(comm * 0.75)
  assert parts.host == pytest.approx(64e9 / 32e9)
  assert parts.step == pytest.approx(0.5 + comm * 0.75 + 2.0)
  # Offloaded state streamed through the device crosses the link twice; updated on the host,
  # the gradients go down and the updates come up.
  c = candidates.Candidate(3, offload='opt_state', update_on='device')
  assert roofline.host_transfer_bytes(c, host_bytes=10, param_bytes=3) == 20
  c = candidates.Candidate(3, offload='opt_state', update_on='host')
  assert roofline.host_transfer_bytes(c, host_bytes=10, param_bytes=3) == 6


def test_a_topology_without_roofline_constants_is_named():
  with pytest.raises(ValueError) as err:
    lowering.make_target('tiny', 'v4:2x2x1', devices=[], optimizer=optax.sgd)
  assert str(err.value) == (
    "`topology`='v4:2x2x1': no roofline constants for 'v4'; the search knows"
    " ['v5e', 'v5p', 'v6e'] and cpu:N."
  )


def test_overlapped_host_transfers_hide_under_compute():
  """The share of host-link bytes that overlap compute (from the compiled schedule) hides
  under it, as the overlapped ring bytes do; the rest adds to the step."""
  chip = roofline.CHIPS['v5e']
  # 0.5 s of compute, no collectives.
  r = roofline.StepCost(
    flops=197e12 * 0.5, kernel_seconds=0.0, ring_bytes=0.0, overlapped_bytes=0.0
  )
  parts = roofline.predict(chip, r, host_transfer_bytes=32e9, host_overlap=0.25)
  assert parts.host == pytest.approx(1.0)
  assert parts.host_exposed == pytest.approx(0.75)
  assert parts.step == pytest.approx(max(0.5, 0.25) + 0.75)


def test_host_traffic_is_counted_in_the_program_or_said_to_be_a_formula():
  c = candidates.Candidate(3, offload='opt_state+master', update_on='stream')
  tpu = '\n'.join([
    'HloModule m',
    'ENTRY %main (a: f32[16]) -> f32[16] {',
    '  %a = f32[16]{0} parameter(0)',
    '  %cs = (f32[16]{0:S(5)}, f32[16]{0}, u32[]) copy-start(%a)',
    '  ROOT %cd = f32[16]{0:S(5)} copy-done(%cs)',
    '}',
  ])  # fmt: skip
  counted = search.host_traffic(tpu, c, host_bytes=1000, param_bytes=100)
  assert (counted.source, counted.to_host, counted.to_device) == ('hlo', 64, 0)
  cpu = tpu.replace('S(5)', '')  # XLA:CPU's programs carry no memory spaces
  assumed = search.host_traffic(cpu, c, host_bytes=1000, param_bytes=100)
  assert (assumed.source, assumed.to_host, assumed.to_device) == ('formula', 100, 100)
  assert assumed.overlapped == 0.0
  none = search.host_traffic(cpu, candidates.Candidate(3), host_bytes=0, param_bytes=100)
  assert (none.source, none.to_host + none.to_device) == ('none', 0)
