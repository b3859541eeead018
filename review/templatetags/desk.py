"""Template helpers of the review desk. Every value they return is escaped."""

import json
from datetime import UTC, datetime
from urllib.parse import urlencode

from django import template
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from ledger import durations, saved_views
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
def view_query(filters) -> str:
    """A saved view's filters as the queue's query string: "?state=manual_review&age=1h"
    ("" for none)."""
    if not isinstance(filters, dict) or not filters:
        return ""
    # In the queue form's order, as the queue writes its own URL (jsonb keeps no order).
    names = [*saved_views.FILTER_NAMES, *sorted(set(filters) - set(saved_views.FILTER_NAMES))]
    return "?" + urlencode({key: str(filters[key]) for key in names if key in filters})


def stuck_for(since) -> str:
    """How long ago `since` was, coarsely: "12 min", "3 h", "2 d" (templates write
    `{{ since|duration:1 }}`)."""
    if since is None:
        return ""
    return _span(max(0, int((timezone.now() - since).total_seconds())))


def _span(seconds: int) -> str:
    """A span of `seconds` (not negative), coarsely: "12 min", "3 h", "2 d"."""
    return durations.in_words(seconds, units=1)


@register.filter
def duration(span, units: int = 2) -> str:
    """A span of time (a timedelta, or seconds) in words: `{{ policy.approval_ttl|duration }}`
    -> "1 d", "1 h 30 min"; `|duration:1` keeps one unit; a datetime is the span between
    it and now ("in {{ claim.expires_at|duration:1 }}"). The desk's one way to write a
    duration (`ledger.durations.in_words`); "—" for None."""
    if span is None or span == "":
        return "—"
    if isinstance(span, datetime):
        span = span - timezone.now()
    return durations.in_words(span, units=int(units))


@register.filter
def reason_text(reason: str) -> str:
    """An event's reason as people read it: an agent's "Timeout:" written before the
    detail was optional loses its dangling colon."""
    text = (reason or "").strip()
    return text[:-1].rstrip() if text.endswith(":") else text


@register.simple_tag
def actor(kind_label: str, actor_id: str, *, kind: str = ""):
    """Who made a change: "Agent billing-bot", "Person ada"; an in-process agent that
    gave no name reads "Agent (in-process, unnamed)" rather than a bare "Agent"."""
    if actor_id:
        return format_html('<span class="actor">{}</span> {}', kind_label, actor_id)
    missing = {"agent": "in-process, unnamed", "system": "the ledger",
               "reconciler": "unnamed worker"}.get(kind, "unnamed")
    return format_html('<span class="actor">{}</span> <span class="muted">({})</span>',
                       kind_label, missing)


@register.filter
def changed_fields(change) -> list[tuple[str, str, str]]:
    """What a policy or channel change changed, for people: (field, before, after) with
    yes/no for booleans, durations in words and lists joined; fields that stayed out."""
    before = change.before if isinstance(change.before, dict) else {}
    after = change.after if isinstance(change.after, dict) else {}
    rows = []
    for name in [*after, *(k for k in before if k not in after)]:
        old, new = before.get(name), after.get(name)
        if change.before is not None and old == new:
            continue
        label = name.removesuffix("_seconds").replace("_", " ")
        rows.append((label, _plain(name, old) if change.before is not None else "",
                     _plain(name, new)))
    return rows


def _plain(name: str, value) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_seconds") and isinstance(value, int | float):
        return durations.in_words(value)
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or "—"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_plain(k, v)}" for k, v in value.items()) or "—"
    return str(value)


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
