"""zerojax/_src/jaxprs.py: every jaxpr walk, on small programs whose answer is known."""

import jax
import jax.numpy as jnp
import pytest

from zerojax._src import jaxprs


def test_dependencies_follow_values_through_calls_and_loops():
  def f(p, b):
    h = jax.jit(lambda p, b: p * b)(p, b)  # a call: followed inside
    s = jax.lax.fori_loop(0, 3, lambda i, c: c + p, 0.0)  # a loop: carried
    return h, s, b + 1.0, 2.0

  closed = jax.make_jaxpr(f)(1.0, 2.0)
  env = jaxprs.dependencies(closed.jaxpr, [jaxprs.PARAMS, jaxprs.BATCH])
  outs = [env.get(v, 0) for v in closed.jaxpr.outvars[:3]]
  assert outs[0] == jaxprs.PARAMS | jaxprs.BATCH
  assert outs[1] & jaxprs.PARAMS and not outs[1] & jaxprs.BATCH
  assert outs[2] == jaxprs.BATCH


def test_divisions_by_a_batch_count_are_found_and_others_are_not():
  def loss(p, b):
    err = (p * b['x']) ** 2
    by_count = jnp.sum(err * b['mask']) / jnp.sum(b['mask'])  # batch-computed divisor: found
    by_const = jnp.mean(err)  # a constant divisor: not
    by_params = jnp.sum(err) / jnp.sum(p**2)  # a parameter-computed divisor: not
    return by_count, by_const, by_params

  b = {'x': jnp.ones(4), 'mask': jnp.ones(4)}
  closed = jax.make_jaxpr(loss)(jnp.ones(4), b)
  deps = [jaxprs.PARAMS] + [jaxprs.BATCH] * 2
  find = lambda live: jaxprs.divisions_by(closed.jaxpr, deps, live, jaxprs.BATCH)
  assert find([True, False, False]) == ['f32[] / f32[]']
  assert find([False, True, False]) == []
  assert find([False, False, True]) == []


def test_gathers_are_counted_inside_and_outside_loops():
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))

  def f(w, ws):
    g = jax.lax.all_gather(w, 'data', tiled=True)
    _, ys = jax.lax.scan(lambda c, x: (c, jax.lax.all_gather(x, 'data', tiled=True)), 0, ws)
    return g.sum() + ys.sum()

  P = jax.sharding.PartitionSpec
  smap = jax.shard_map(
    f, mesh=mesh, in_specs=(P('data'), P(None, 'data')), out_specs=P(), check_vma=False
  )
  closed = jax.make_jaxpr(smap)(jnp.ones(8), jnp.ones((3, 8)))
  assert jaxprs.count_gathers(closed) == (1, 1)
  assert jaxprs.is_gather(
    jax.make_jaxpr(lambda w: jax.lax.all_gather(w, 'i'), axis_env=[('i', 2)])(1.0)
  )
  assert not jaxprs.is_gather(closed)  # it loops: a layer loop, not a gather


def test_traced_flops_count_loop_iterations_and_refuse_an_unknown_trip_count():
  a, b = jnp.ones((4, 8)), jnp.ones((8, 16))
  one = 2 * 4 * 16 * 8
  assert jaxprs.traced_flops(jax.make_jaxpr(lambda a, b: a @ b)(a, b)) == one
  scanned = jax.make_jaxpr(lambda a, b: jax.lax.scan(lambda c, _: (c, a @ b), 0.0, None, length=5))
  assert jaxprs.traced_flops(scanned(a, b)) == 5 * one
  n = jnp.int32(3)
  unknown = jax.make_jaxpr(
    lambda a, b, n: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, a @ b), (0, a @ b))
  )
  with pytest.raises(ValueError, match='while'):
    jaxprs.traced_flops(unknown(a, b, n))
