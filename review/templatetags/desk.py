"""Template helpers of the review desk. Every value they return is escaped."""

import json
from datetime import UTC

from django import template
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from ledger.models import Operation
from ledger.states import QUEUE_STATES, State

register = template.Library()


@register.simple_tag
def operation_url(operation: Operation | str) -> str:
    """The desk page of an operation (or of an operation id): `{% operation_url op %}`.

    The desk resolves its own URLs; the model does not know where (or whether) a desk is
    mounted. Views call it as a function.
    """
    operation_id = operation.operation_id if isinstance(operation, Operation) else operation
    return reverse("review:operation", args=[operation_id])


@register.filter
def stuck_for(since) -> str:
    """How long ago `since` was, coarsely: "12 min", "3 h", "2 d"."""
    if since is None:
        return ""
    return _span(max(0, int((timezone.now() - since).total_seconds())))


def _span(seconds: int) -> str:
    """A span of `seconds` (not negative), coarsely: "12 min", "3 h", "2 d"."""
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86400:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


@register.filter
def pretty_json(value) -> str:
    """Indented JSON as plain text; the template escapes it like any other string."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


@register.simple_tag
def state_badge(state: str):
    """A badge that says the state in words; the colour only repeats it."""
    label = State(state).label if state in State.values else state
    return format_html('<span class="badge badge-{}">{}</span>', state, label)


@register.simple_tag
def queue_counts(counts: dict) -> list[tuple[str, int]]:
    """(state, count) for each state the queue waits on a person for, in the order of
    `ledger.states.QUEUE_STATES` (derived from the state table)."""
    counts = counts if isinstance(counts, dict) else {}
    return [(state, counts.get(state, 0)) for state in QUEUE_STATES]


@register.simple_tag
def role_of(user) -> str:
    if user.is_superuser or user.has_perm("ledger.override_retry_policy"):
        return "admin"
    if user.has_perm("ledger.resolve_operation"):
        return "reviewer"
    if user.has_perm("ledger.view_operation"):
        return "viewer"
    return "no role"


@register.simple_tag
def ago(when):
    """`<time>` saying how long ago `when` was ("3 min ago", "in 12 min" for a time still
    ahead), with the absolute UTC time in `datetime` and on hover (the desk's script turns
    the hover text into the reviewer's time zone)."""
    if when is None:
        return "—"
    seconds = int((timezone.now() - when).total_seconds())
    words = _span(abs(seconds))
    text = "just now" if abs(seconds) < 10 else (
        f"{words} ago" if seconds >= 0 else f"in {words}")
    return _time_element(when, text)


@register.simple_tag
def waited(since):
    """`<time>` saying how long since `since`, coarsely ("3 h", as `stuck_for`), with the
    absolute time on hover (UTC here; the desk's script shows the reviewer's time zone)."""
    if since is None:
        return ""
    return _time_element(since, stuck_for(since))


def _time_element(when, text: str) -> str:
    utc = when.astimezone(UTC)
    return format_html('<time datetime="{}" title="{} UTC">{}</time>',
                       utc.isoformat(), utc.strftime("%Y-%m-%d %H:%M:%S"), text)
