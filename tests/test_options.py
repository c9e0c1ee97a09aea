"""zerojax.Options: one home for every ZeRO option, its defaults and its checks."""

import dataclasses
import inspect
import re

import jax
import optax
import pytest

import zerojax
from zerojax._src import options as options_lib


def test_defaults_and_one_spelling_per_choice():
  o = zerojax.Options()
  assert dataclasses.asdict(o) == {
    'axis': 'data',
    'policy': 'error',
    'replicate_below_bytes': 256 * 1024,
    'param_specs': None,
    'stacked': None,
    'param_axis': None,
    'offload': None,
    'update_on': 'device',
    'offload_params': False,
    'quantize': None,
    'replica_axis': None,
    'trainable': None,
  }
  # Frozen and keyword-only: an options object cannot change under a plan that used it.
  with pytest.raises(dataclasses.FrozenInstanceError):
    o.policy = 'pad'
  with pytest.raises(TypeError):
    zerojax.Options('data')
  assert o.replace(policy='pad').policy == 'pad' and o.policy == 'error'


@pytest.mark.parametrize(
  'kwargs, kind, message',
  [
    (
      {'policy': 'shard'},
      ValueError,
      "Options(policy=...) must be one of ('error', 'replicate', 'pad'), got 'shard'.",
    ),
    (
      {'offload': 'none'},
      ValueError,
      "Options(offload=...) must be one of (None, 'opt_state', 'opt_state+master'), got 'none':"
      " None keeps everything on the device, 'opt_state' moves the optimizer state to host"
      " memory, 'opt_state+master' also the mixed_precision master copy.",
    ),
    (
      {'update_on': 'host'},
      ValueError,
      "Options(update_on='host') runs the update where offloaded state lives: pass"
      " offload='opt_state' (or 'opt_state+master') too.",
    ),
    (
      {'replicate_below_bytes': -1},
      ValueError,
      'Options(replicate_below_bytes=...) must be a whole number of bytes >= 0, got -1.',
    ),
    (
      {'axis': ('data', 'data')},
      ValueError,
      "Options(axis=('data', 'data')) names an axis more than once.",
    ),
    (
      {'param_axis': 3},
      TypeError,
      'Options(param_axis=...) must be a mesh axis name or a tuple of names, got 3.',
    ),
    (
      {'quantize': 'int8'},
      TypeError,
      'Options(quantize=...) must be a zerojax.Quantize or None, got str; e.g.'
      " zerojax.Quantize(weights='int8', grads='int4').",
    ),
  ],
)
def test_each_field_is_checked_when_made(kwargs, kind, message):
  with pytest.raises(kind, match=re.escape(message) + '$'):
    zerojax.Options(**kwargs)
  # zero_stage builds its Options from its keywords: the same check, the same words.
  with pytest.raises(kind, match=re.escape(message) + '$'):
    zerojax.zero_stage(optax.adam(1e-3), 1, mesh=jax.make_mesh((8,), ('data',)), **kwargs)


def test_stage_is_checked_against_the_options():
  o = zerojax.Options()
  assert o.check_stage(3) == 3
  for bad in (4, True, '1', 1.0):
    with pytest.raises(ValueError, match=re.escape('`stage` must be 0, 1, 2 or 3')):
      o.check_stage(bad)


def test_zero_stage_names_an_unknown_option_and_every_known_one():
  # No separate list of names: zero_stage takes **options and Options says which exist.
  params = inspect.signature(zerojax.zero_stage).parameters
  assert list(params) == ['target', 'stage', 'mesh', 'options']
  with pytest.raises(TypeError) as e:
    zerojax.zero_stage(optax.adam(1e-3), 2, mesh=None, shard_axis='data')
  assert str(e.value) == (
    'zerojax.zero_stage got unknown option(s) shard_axis; the ZeRO options (zerojax.Options) are'
    ' axis, policy, replicate_below_bytes, param_specs, stacked, param_axis, offload, update_on, offload_params, quantize,'
    ' replica_axis, trainable.'
  )
  assert options_lib.NAMES == tuple(f.name for f in dataclasses.fields(zerojax.Options))


def test_the_config_embeds_the_options(mesh):
  tx = zerojax.zero_stage(optax.adam(1e-3), 2, mesh=mesh, policy='pad', replicate_below_bytes=0)
  config = zerojax.config_of(tx)
  assert config.options == zerojax.Options(policy='pad', replicate_below_bytes=0)
  assert (config.stage, config.mesh, config.axes) == (2, mesh, ('data',))


def test_the_estimator_takes_the_same_options():
  params = {'w': jax.ShapeDtypeStruct((63, 33), 'float32')}
  est = zerojax.inspect.estimate_memory(
    params, optax.adam(1e-3), num_devices=8, stages=(1,), options=zerojax.Options(policy='pad')
  )
  assert est[0].stage == 1
  with pytest.raises(TypeError, match=re.escape('options must be a zerojax.Options')):
    zerojax.inspect.estimate_memory(
      params, optax.adam(1e-3), num_devices=8, stages=(1,), options={'policy': 'pad'}
    )
