"""The desk's forms offer what the state table allows, no hand-kept copy of it."""

from ledger import selectors, states
from review.forms import ACTION_LABELS, QUEUE_STATE_CHOICES, ResolveForm


def test_every_decision_of_the_table_has_a_button_label_and_no_other():
    assert set(ACTION_LABELS) == set(states.RESOLUTIONS)


def test_the_decision_field_offers_the_resolutions_in_desk_order():
    choices = ResolveForm().fields["to_state"].choices
    assert [value for value, _ in choices] == list(states.RESOLUTIONS)


def test_the_queue_filter_offers_the_queue_states_of_the_table_then_every_other_state():
    *queue, (group, browsing) = QUEUE_STATE_CHOICES
    assert [value for value, _ in queue] == ["", *states.QUEUE_STATES, selectors.CONFLICTING]
    assert group == "Every state"
    assert [value for value, _ in browsing] == [
        s for s in states.State.values if s not in states.QUEUE_STATES]
