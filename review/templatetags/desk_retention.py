"""Template helpers of the retention page. Every value they return is escaped."""

from django import template

register = template.Library()


@register.filter
def policy_days(values: dict | None) -> str:
    """A policy's days in words: "purge after 30 d, redact after 7 d, keep events 30 d".

    `values` is `RetentionPolicy.as_audit_dict()` (or a `RetentionChange.before`/`after`).
    """
    if not values:
        return "—"
    if "kind" in values:  # an execution-state policy (StateRetentionPolicy.as_audit_dict())
        return f"purge after {values.get('purge_after_days')} d"
    redact = values.get("redact_after_days")
    return (f"purge after {values.get('purge_after_days')} d, "
            f"redact {f'after {redact} d' if redact else 'never'}, "
            f"keep events {values.get('keep_events_days')} d")


@register.filter
def policy_scope(values: dict | None) -> str:
    """Pattern (or an execution-state policy's kind) and tenant of a policy snapshot:
    "articles.* (every tenant)", "episodes (acme)"."""
    if not values:
        return "—"
    scope = values.get("pattern") or values.get("kind")
    return f"{scope} ({values.get('tenant') or 'every tenant'})"
