import pytest

from tunewright_api.states import TERMINAL, InvalidTransition, transition


@pytest.mark.parametrize(("current", "new"), [
    ("queued", "running"), ("queued", "cancelled"), ("queued", "failed"),
    ("running", "succeeded"), ("running", "failed"), ("running", "cancelled"),
])
def test_allowed(current, new):
    assert transition(current, new) == new


@pytest.mark.parametrize("current", sorted(TERMINAL))
@pytest.mark.parametrize("new", ["queued", "running", "succeeded", "failed", "cancelled"])
def test_terminal_states_are_final(current, new):
    with pytest.raises(InvalidTransition, match=f"a job in state {current} cannot become {new}"):
        transition(current, new)


def test_no_skipping_back():
    with pytest.raises(InvalidTransition):
        transition("running", "queued")
    with pytest.raises(InvalidTransition):
        transition("queued", "succeeded")
