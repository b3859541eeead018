"""Checks of agent-supplied arguments, shared by the execution-state writers.

Each raises InvalidInput (a ValueError) saying what was expected and what was found, before
anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.utils import timezone

from ledger.errors import InvalidInput


def check_text(value: Any, name: str, max_length: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"expected {name} to be a non-empty string, found {value!r}")
    if len(value) > max_length:
        raise InvalidInput(
            f"expected {name} of at most {max_length} characters, found {len(value)}"
        )
    return value


def check_aware(value: Any, name: str) -> datetime | None:
    """None, or a timezone-aware datetime."""
    if value is not None and (not isinstance(value, datetime) or timezone.is_naive(value)):
        raise InvalidInput(f"expected {name} to be a timezone-aware datetime, found {value!r}")
    return value


def check_names(values: Iterable[str], name: str, max_length: int) -> list[str]:
    """A list of distinct non-empty strings (a lone string is refused, not split)."""
    if isinstance(values, str):
        raise InvalidInput(f"expected {name} to be a list of names, found the string {values!r}")
    result = list(values)
    for value in result:
        check_text(value, f"each of {name}", max_length)
    if len(set(result)) != len(result):
        raise InvalidInput(f"expected {name} without repeats, found {result!r}")
    return result
