"""tf_adacomp.scaling: the all-gather's and the ring's bytes per step, their crossover and
the warning past it, against closed forms in exact (Fraction) and NumPy arithmetic."""

import fractions
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tiers
from tf_adacomp import scaling

F = fractions.Fraction
SENDERS = st.integers(1, 100_000)
BYTES = st.integers(1, 10**12)


def _gathered(n, p):
  return (n - 1) * F(p)


def _ring(n, d):
  return F(2 * (n - 1), n) * F(d)


# --- The bytes ----------------------------------------------------------------------


@settings(max_examples=tiers.examples(200), deadline=None)
@given(SENDERS, BYTES, BYTES)
def test_bytes_received_are_the_closed_forms(n, p, d):
  assert scaling.allgather_bytes_received(n, p) == _gathered(n, p)
  assert scaling.ring_allreduce_bytes_received(n, d) == pytest.approx(float(_ring(n, d)),
                                                                     rel=1e-12)


def test_bytes_received_against_numpy_over_a_grid_of_senders():
  n = np.arange(1, 2049)
  p, d = 6801.0, 1686568.0
  np.testing.assert_allclose([scaling.allgather_bytes_received(int(k), p) for k in n],
                             (n - 1) * p, rtol=0)
  np.testing.assert_allclose([scaling.ring_allreduce_bytes_received(int(k), d) for k in n],
                             2 * (n - 1) / n * d, rtol=1e-15)


def test_one_sender_receives_nothing_and_the_ring_stays_under_twice_dense():
  assert scaling.allgather_bytes_received(1, 123) == 0
  assert scaling.ring_allreduce_bytes_received(1, 123) == 0
  assert scaling.ring_allreduce_bytes_received(2, 100) == 100
  assert scaling.ring_allreduce_bytes_received(10**9, 100) < 200


# --- The crossover ------------------------------------------------------------------


@settings(max_examples=tiers.examples(400), deadline=None)
@given(BYTES, BYTES)
def test_crossover_is_the_first_n_where_the_gather_receives_more(d, p):
  n = scaling.crossover_senders(d, p)
  assert n >= 2
  assert _gathered(n, p) > _ring(n, d)
  if n > 2:  # the one before it receives no more than the ring
    assert _gathered(n - 1, p) <= _ring(n - 1, d)
  # The closed form N > 2d/p, in integers.
  assert n == max(2, 2 * d // p + 1)


def test_crossover_counts_a_tie_as_no_loss():
  # 2d/p = 3 exactly: at N = 3 both receive 4 bytes (a tie), N = 4 is the first loss.
  assert scaling.crossover_senders(3, 2) == 4
  assert (scaling.allgather_bytes_received(3, 2)
          == scaling.ring_allreduce_bytes_received(3, 3) == 4)
  assert scaling.crossover_senders(3.0, 2.0) == 4
  assert scaling.crossover_senders(np.float32(3), np.int64(2)) == 4


def test_crossover_of_the_readme_figures():
  # The demo's CNN: 6,801 bytes per step instead of 1,686,568.
  assert scaling.crossover_senders(1686568, 6801) == math.floor(2 * 1686568 / 6801) + 1 == 496
  assert scaling.crossover_senders(100, 1000) == 2  # a payload above dense loses at once


def test_crossover_does_not_round_the_quotient():
  # 2 * 108.0 / 3.6 rounds to 60.0 in floats (a tie, which would give 61); in the
  # floats' exact binary values it is just under 60: the gather receives more at N = 60.
  assert 2 * 108.0 / 3.6 == 60
  assert scaling.crossover_senders(108.0, 3.6) == 60
  assert _gathered(60, 3.6) > _ring(60, 108.0) and _gathered(59, 3.6) <= _ring(59, 108.0)


@settings(max_examples=tiers.examples(200), deadline=None)
@given(st.floats(1.0, 1e12), st.floats(1.0, 1e12))
def test_crossover_of_floats_is_exact_on_their_binary_values(d, p):
  n = scaling.crossover_senders(d, p)
  assert _gathered(n, p) > _ring(n, d)
  assert n == 2 or _gathered(n - 1, p) <= _ring(n - 1, d)


# --- The warning --------------------------------------------------------------------


def test_warns_from_the_crossover_on_and_not_before():
  d, p = 1686568, 6801
  n = scaling.crossover_senders(d, p)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # any warning before the crossover fails the test
    for senders in (1, 2, 8, n - 1):
      assert scaling.check_allgather(senders, p, d) is False
  for senders in (n, n + 1, 4 * n):
    with pytest.warns(scaling.AllGatherScalingWarning) as record:
      assert scaling.check_allgather(senders, p, d) is True
    (warning,) = record
    message = str(warning.message)
    assert f"{senders} senders" in message and f"crossover of {n}" in message
    assert f"{scaling.allgather_bytes_received(senders, p):,.0f} bytes" in message
    assert f"{scaling.ring_allreduce_bytes_received(senders, d):,.0f}" in message
    for remedy in ("hierarchical exchange", "local_steps", '"bf16"'):
      assert remedy in message
    assert warning.filename == __file__  # points at the caller
    assert issubclass(warning.category, UserWarning)


def test_no_warning_when_asked_not_to():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert scaling.check_allgather(1000, 6801, 1686568, warn=False) is True
    assert scaling.check_allgather(10, 6801, 1686568, warn=False) is False


@settings(max_examples=tiers.examples(100), deadline=None)
@given(st.integers(1, 5000), BYTES, BYTES)
def test_check_agrees_with_the_crossover(n, p, d):
  assert scaling.check_allgather(n, p, d, warn=False) == (n >= scaling.crossover_senders(d, p))


# --- Bad arguments ------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -3, 2.5, 2.0, True, None, "4", math.nan])
def test_bad_senders_are_named(value):
  for call in (lambda: scaling.allgather_bytes_received(value, 10),
               lambda: scaling.ring_allreduce_bytes_received(value, 10),
               lambda: scaling.check_allgather(value, 10, 100)):
    with pytest.raises(ValueError, match=r"`senders`.*Received: senders=") as error:
      call()
    assert f"senders={value!r}" in str(error.value)


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, -math.inf, "10", None, True])
def test_bad_bytes_are_named(value):
  calls = {"payload_bytes": [lambda: scaling.allgather_bytes_received(2, value),
                             lambda: scaling.crossover_senders(100, value),
                             lambda: scaling.check_allgather(2, value, 100)],
           "dense_bytes": [lambda: scaling.ring_allreduce_bytes_received(2, value),
                           lambda: scaling.crossover_senders(value, 10),
                           lambda: scaling.check_allgather(2, 10, value)]}
  for name, functions in calls.items():
    for call in functions:
      with pytest.raises(ValueError, match=f"`{name}`") as error:
        call()
      assert f"Received: {name}={value!r}" in str(error.value)


def test_zero_bytes_are_refused_only_where_they_divide():
  assert scaling.allgather_bytes_received(5, 0) == 0
  assert scaling.ring_allreduce_bytes_received(5, 0) == 0
  for call, name in ((lambda: scaling.crossover_senders(0, 10), "dense_bytes"),
                     (lambda: scaling.crossover_senders(10, 0), "payload_bytes"),
                     (lambda: scaling.check_allgather(2, 0, 10), "payload_bytes"),
                     (lambda: scaling.check_allgather(2, 10, 0), "dense_bytes")):
    with pytest.raises(ValueError, match=f"Received: {name}=0"):
      call()


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_bad_warn_is_named(value):
  with pytest.raises(ValueError, match=f"Received: warn={value!r}"):
    scaling.check_allgather(2, 10, 100, warn=value)
