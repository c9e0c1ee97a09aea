"""What the plan search prints: the winner as lines that run as pasted, and its JSON."""

import jax
import optax
import pytest

import zerojax
from zerojax._src.planner import candidates, lowering, roofline, search, search_report


def _report(candidate, mixed_precision=False):
  target = lowering.Target(
    topology='cpu:8',
    devices=tuple(jax.devices()),
    grid=(2, 4),
    chip=None,
    model='tiny',
    optimizer=optax.adamw,
    mixed_precision=mixed_precision,
  )
  predicted = roofline.Prediction(
    compute=1.0,
    collectives=0.0,
    exposed=0.0,
    dcn=0.0,
    dcn_exposed=0.0,
    host=0.0,
    host_exposed=0.0,
    step=1.0,
  )
  result = search.Result(
    candidate,
    search.Outcome.FITS,
    ring_bytes=1e6,
    overlapped_bytes=0.0,
    flops=1e9,
    bytes_accessed=1e6,
    predicted=predicted,
  )
  return search.SearchReport(target, [result], invalid=[], seconds=1.0)


@pytest.mark.parametrize(
  'candidate, mixed',
  [
    (candidates.Candidate(3, layout='torus', remat='gathers', prefetch=True), False),
    (candidates.Candidate(2, offload='opt_state', update_on='host', micro_batches=2), True),
    (candidates.Candidate(3, quantize='w8g4', remat='full'), False),
    (candidates.Candidate(3, layout='hpz'), False),
    (candidates.Candidate(3, remat='minimal', tensor=2), False),
  ],
)
def test_the_winners_lines_run_as_pasted(candidate, mixed):
  report = _report(candidate, mixed)
  assert report.winner is not None
  code = search_report.winner_code(report)
  namespace = {'jax': jax, 'optax': optax, 'zerojax': zerojax, 'lr': 1e-3}
  namespace['loss_fn'] = lambda params, batch: 0.0
  namespace['param_specs'] = None  # the model's tensor-parallel specs, where it has a tensor axis
  exec(code, namespace)  # the mesh, the wrapped optimizer and the gradient function
  config = zerojax.config_of(namespace['tx'])
  mesh = namespace['mesh']
  if candidate.tensor > 1:  # ZeRO over 'data', the compiler's collectives over 'tensor'
    assert dict(mesh.shape) == {'data': 8 // candidate.tensor, 'tensor': candidate.tensor}
    assert config.options.axis == 'data' and 'grad_fn = jax.value_and_grad(loss_fn)' in code
  else:
    assert 'zerojax.value_and_grad(loss_fn, tx' in code
  assert config.stage == candidate.stage
  assert config.options.offload == candidate.offload
  assert (config.options.quantize is None) == (candidate.quantize is None)


def test_the_json_spells_no_offload_as_null():
  report = _report(candidates.Candidate(3))
  data = search_report.search_json(report)
  assert data['results'][0]['candidate']['offload'] is None
  assert data['results'][0]['candidate']['quantize'] is None
