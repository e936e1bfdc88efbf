"""``fixes.switch``: the one reading of stackfix's on/off environment switches -- the usual
spellings, any case, and for anything else a ValueError naming the variable, its value and the
spellings allowed."""

from __future__ import annotations

import pytest

from fixes.switch import env_switch, on_off

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE", "Yes", " On "])
def test_the_usual_spellings_of_on(value):
    assert on_off(value) is True


@pytest.mark.parametrize("value", ["0", "false", "no", "off", "FALSE", "No", " OFF "])
def test_the_usual_spellings_of_off(value):
    assert on_off(value) is False


@pytest.mark.parametrize("value", ["", "maybe", "2", "enabled", "y"])
def test_anything_else_is_neither(value):
    assert on_off(value) is None


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(default):
    assert env_switch("STACKFIX_T", default, {}) is default
    assert env_switch("STACKFIX_T", default, {"STACKFIX_T": " "}) is default
    assert env_switch("STACKFIX_T", default, {"STACKFIX_T": "off"}) is False


def test_an_unknown_value_is_an_error_naming_the_allowed_spellings():
    with pytest.raises(ValueError) as error:
        env_switch("STACKFIX_T", True, {"STACKFIX_T": "maybe"})
    assert str(error.value) == ("STACKFIX_T='maybe' is not an on/off value: on is 1, true, yes "
                                "or on; off is 0, false, no or off (any case)")
