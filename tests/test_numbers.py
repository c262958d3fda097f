"""``_numbers``: the int / number checks refuse a bool (JSON's and YAML's true is a Python int, True == 1), and each
takes exactly the kinds its name says (numpy integers only where the check is ``is_integral``)."""
import math

import numpy as np
import pytest

from chronicals._numbers import is_int, is_integral, is_number, is_real


@pytest.mark.parametrize("check", [is_int, is_integral, is_real, is_number])
def test_bools_are_refused_by_every_check(check):
    assert not check(True)
    assert not check(False)
    assert not check(np.bool_(True))


@pytest.mark.parametrize("check", [is_int, is_integral, is_real, is_number])
@pytest.mark.parametrize("v", [0, 1, -3, 10**30])
def test_python_ints_pass_every_check(check, v):
    assert check(v)


@pytest.mark.parametrize("check", [is_int, is_integral, is_real, is_number])
@pytest.mark.parametrize("v", [None, "1", b"1", [1], (1,), {1: 1}])
def test_what_is_not_a_number_fails_every_check(check, v):
    assert not check(v)


def test_is_int_takes_python_ints_only():
    assert not is_int(1.0)
    assert not is_int(np.int64(3))
    assert not is_int(np.int32(3))


def test_is_integral_also_takes_numpy_integers_but_no_floats():
    assert is_integral(np.int64(3)) and is_integral(np.int32(-1)) and is_integral(np.uint8(7))
    assert not is_integral(1.0)
    assert not is_integral(np.float64(2.0))


def test_is_real_takes_floats_inf_and_nan_and_is_number_only_finite_ones():
    for v in (0.5, -2.0, np.float64(1.5)):
        assert is_real(v) and is_number(v)
    for v in (math.inf, -math.inf, math.nan):
        assert is_real(v) and not is_number(v)
    assert not is_real(np.int64(3))  # not an int or float subclass: callers that take numpy integers say so
    assert not is_real(1 + 2j)
