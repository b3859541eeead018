"""Spans of time in words, the one way the ledger and its desk write them: "1 d",
"2 h 30 min", "45 s" (never Python's "1 day, 0:00:00")."""

from __future__ import annotations

from datetime import timedelta

_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


def in_words(span: timedelta | int | float | None, *, units: int = 2) -> str:
    """`span` (a timedelta or seconds; negative counts as its size) in at most `units`
    of its largest non-zero units: "1 d 2 h", "15 min", "0 s"; "" for None."""
    if span is None:
        return ""
    seconds = span.total_seconds() if isinstance(span, timedelta) else float(span)
    left = int(abs(seconds))
    parts = []
    for name, size in _UNITS:
        if left >= size and len(parts) < units:
            parts.append(f"{left // size} {name}")
            left %= size
        elif parts:
            # Units are consecutive: "1 d 0 h 5 min" would mislead, so stop at a gap.
            break
    return " ".join(parts) or "0 s"
