"""Tolerances for floating-point comparisons, derived from the arithmetic.

zerojax computes what plain JAX and optax compute, but not in the same order: a
gradient is summed per device and then across devices, a scanned layer stack is
a loop instead of unrolled code, XLA blocks a matmul differently once its
operands are sharded, and the CPU's vector width changes the order again. Two
float32 programs that add the same numbers in different orders round
differently, so equal results agree to within rounding, not bit for bit, and
the rounding differs from one CPU to another. A tolerance here is therefore a
bound on rounding, stated in the terms that produce it, never a number that
happened to pass on one machine:

- every float32 addition rounds its result with a relative error of at most
  eps/2 (eps = 2**-23 for float32);
- summing `n` terms in another order moves the result by a sum of `n` such
  roundings of either sign: about sqrt(n) * eps relative to the size of the
  terms (a random walk; the worst case, n * eps, needs every rounding to go the
  same way). `MARGIN` covers the walk's spread;
- the error is relative to the *terms*, not to the result: an element that
  cancels to near zero keeps the absolute error of its terms. So elementwise
  checks scale by the compared tensor's largest magnitude, which stands for the
  terms' size;
- a result that passes through several sums in sequence (a gradient entry sums
  the batch's rows, each a product of sums over the contraction lengths of the
  layers in between) collects each sum's rounding: independent errors add in
  quadrature, so the lengths of the sums add. `terms` is that total, the
  longest chain of additions behind one result;
- `steps` dependent updates (optimizer steps) each add their own rounding and
  carry the earlier ones forward.

A norm-relative comparison (`max_rel_err`) averages over the tensor and is
bounded by the same expression.
"""

import math

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23
EPS16 = float(np.finfo(np.float16).eps)  # 2**-10
EPSBF16 = 2.0**-7  # bfloat16 keeps 8 significant bits
# A factor on the random walk's standard size: rounding differences of 4 sigma
# and more are too rare to meet across the suite's comparisons.
MARGIN = 4.0


def reordered(terms: int, *, steps: int = 1, eps: float = EPS32) -> float:
  """Relative rounding difference of sums of `terms` terms, added in another order.

  Args:
    terms: the additions along the longest chain of sums behind one result
      (batch rows plus the contraction lengths of the layers it passes).
    steps: how many such computations run one after another, each feeding the
      next (optimizer steps, layers).
    eps: the machine epsilon of the dtype the sums are rounded to.

  Returns:
    MARGIN * sqrt(terms * steps) * eps.
  """
  return MARGIN * math.sqrt(terms * steps) * eps


def assert_close(got, want, tol: float, err_msg: str = '') -> None:
  """Every element of `got` within `tol` times the largest magnitude in `want`.

  The scale is the tensor's, not the element's: rounding errors are relative
  to the terms summed, and an element that cancels to near zero keeps theirs.
  """
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape, err_msg)
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  np.testing.assert_array_less(
    np.abs(got - want), tol * scale + np.finfo(np.float64).tiny, err_msg=err_msg
  )
