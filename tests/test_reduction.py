"""How the parts of a loss and its aux combine into the global batch's (zerojax/_src/reduction.py)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax._src import reduction


def test_aux_kinds_say_how_each_leaf_combines():
  aux = {
    'logits': jnp.ones((4, 8)),
    'accuracy': jnp.float32(0.5),
    'tokens': zerojax.Sum(jnp.float32(3.0)),
    'rate': zerojax.WeightedMean(jnp.float32(1.0), jnp.float32(2.0)),
  }
  # Leaves in key order: accuracy, logits, rate, tokens.
  assert reduction.aux_kinds(aux, rows=4) == ['scalar', 'rows', 'mean', 'sum']
  # A plain scalar is checked for a division by a batch count, as a scalar loss is; a
  # WeightedMean's two sums are not divided; Sum and per-row values have nothing to check.
  # Each flattened output (a WeightedMean is two): the plain scalar is named by its path.
  assert reduction.aux_output_names(aux, ['scalar', 'rows', 'mean', 'sum']) == [
    "aux['accuracy']",
    None,
    None,
    None,
    None,
  ]


def test_a_leaf_that_is_neither_is_named_with_every_form():
  with pytest.raises(ValueError, match=re.escape("aux['head'] (shape (3, 2))")):
    reduction.aux_kinds({'head': np.ones((3, 2)), 'ok': np.ones((4,))}, rows=4)


def test_the_legacy_key_check_names_the_path():
  with pytest.raises(TypeError, match=re.escape("args[1]['seed'] is a uint32[2] array")):
    reduction.check_raw_keys((jnp.ones(3), {'seed': jnp.zeros((2,), jnp.uint32)}))
  reduction.check_raw_keys((jnp.zeros((3,), jnp.uint32), jnp.zeros((2,), jnp.int32)))  # data


def test_sum_and_weighted_mean_are_pytrees_of_their_parts():
  import jax

  assert jax.tree.leaves(zerojax.Sum(jnp.float32(2.0))) == [jnp.float32(2.0)]
  assert len(jax.tree.leaves(zerojax.WeightedMean(1.0, 2.0))) == 2
