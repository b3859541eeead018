"""Messages people read (the desk, the API's 409 details, MCP) say states and spans of time
in plain words, never Python's names for them."""

from datetime import timedelta

import pytest

from ledger import durations, receipts, states, transitions
from ledger.errors import IllegalTransition
from ledger.states import ActorKind, State

PYTHON_REPRS = ("State.", "0:00:00", "{'", "[<")


def test_listed_says_states_in_plain_words():
    assert states.listed(states.TERMINAL) == "abandoned, rejected, succeeded"
    assert states.listed(states.resolutions_from(State.MANUAL_REVIEW)) == (
        "succeeded, safe_to_retry, abandoned")
    assert states.listed([], empty="none (terminal)") == "none (terminal)"


@pytest.mark.parametrize(("span", "words"), [
    (timedelta(0), "0 s"), (timedelta(seconds=45), "45 s"), (timedelta(minutes=90), "1 h 30 min"),
    (timedelta(days=1), "1 d"), (timedelta(days=1, minutes=5), "1 d"),
    (timedelta(hours=26), "1 d 2 h"), (3600, "1 h"), (None, ""),
    (timedelta(seconds=-75), "1 min 15 s"),
])
def test_durations_are_words(span, words):
    assert durations.in_words(span) == words


def test_one_unit_is_the_coarse_form():
    assert durations.in_words(timedelta(hours=26), units=1) == "1 d"


@pytest.mark.django_db
def test_an_illegal_transition_names_its_targets_as_values(make_op):
    op = make_op(state=State.ABANDONED)
    with pytest.raises(IllegalTransition) as caught:
        transitions._apply(op, State.SUBMITTED, actor_kind=ActorKind.AGENT, actor_id="a",
                           reason="again")
    assert "none (terminal)" in str(caught.value)
    op = make_op(state=State.RECONCILING)
    with pytest.raises(IllegalTransition) as caught:
        transitions._apply(op, State.ABANDONED, actor_kind=ActorKind.AGENT, actor_id="a",
                           reason="give up")
    message = str(caught.value)
    assert "one of manual_review, outcome_unknown, safe_to_retry, succeeded" in message
    assert not any(text in message for text in PYTHON_REPRS), message


@pytest.mark.django_db
def test_resolving_a_settled_operation_says_which_states_it_needed(make_op, reviewer):
    op = make_op(state=State.SUCCEEDED)
    with pytest.raises(IllegalTransition) as caught:
        receipts.resolve(op, State.ABANDONED, user=reviewer, reason="late")
    message = str(caught.value)
    assert "in one of manual_review, outcome_unknown" in message
    assert not any(text in message for text in PYTHON_REPRS), message


@pytest.mark.django_db
def test_an_outcome_without_detail_leaves_no_dangling_colon(make_op):
    op = make_op(state=State.SUBMITTED)
    receipts.mark_outcome_unknown(op, error_code="Timeout")
    assert op.events.order_by("-version").first().reason == "Timeout"
