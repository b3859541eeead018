"""The one gate for arguments: each check refuses with "expected ..., found ..." and returns
what it accepted."""

from datetime import UTC, datetime, timedelta

import pytest

from ledger import inputs
from ledger.errors import InvalidInput


@pytest.mark.parametrize("check, message", [
    (lambda: inputs.check_text("", "subject", 10),
     "expected subject to be a non-empty string, found ''"),
    (lambda: inputs.check_text("   ", "key"), "expected key to be a non-empty string, found '   '"),
    (lambda: inputs.check_text(7, "owner"), "expected owner to be a non-empty string, found 7"),
    (lambda: inputs.check_text("x" * 11, "kind", 10),
     "expected kind of at most 10 characters, found 11"),
    (lambda: inputs.check_string(None, "target", 5),
     "expected target to be a string, found NoneType"),
    (lambda: inputs.check_reason(" "), "expected a non-empty reason for the decision, found ' '"),
    (lambda: inputs.check_operation_name("no spaces"), "expected operation to be a name like"),
    (lambda: inputs.check_operation_pattern("a b"), "expected a pattern of operation-name"),
    (lambda: inputs.check_tenant_or_every(" acme"), "expected tenant to be a tenant name or ''"),
    (lambda: inputs.check_choice("maybe", "retry_policy", ["never"]),
     "expected retry_policy one of ['never'], found 'maybe'"),
    (lambda: inputs.check_whole_number(True, low=1, expected="limit to be a positive integer"),
     "expected limit to be a positive integer, found True"),
    (lambda: inputs.check_whole_number(11, low=1, high=10, expected="a page size"),
     "expected a page size, found 11"),
    (lambda: inputs.check_aware(datetime(2026, 1, 1), "deadline"),
     "expected deadline to be a timezone-aware datetime"),
    (lambda: inputs.check_positive_duration(timedelta(0), "ttl"),
     "expected ttl to be a positive timedelta, found datetime.timedelta(0)"),
    (lambda: inputs.check_duration(timedelta(seconds=-1), "older_than"),
     "expected older_than to be a timedelta >= 0"),
    (lambda: inputs.check_duration(timedelta(hours=2), "pause", high=timedelta(minutes=1)),
     "expected pause to be a timedelta from 0 to 0:01:00"),
    (lambda: inputs.check_names("pay", "depends_on", 100),
     "expected depends_on to be a list of names, found the string 'pay'"),
    (lambda: inputs.check_names(["a", "a"], "depends_on", 100),
     "expected depends_on without repeats, found ['a', 'a']"),
    (lambda: inputs.check_paths(["body..card"], "redact"),
     "expected each of redact to be a dotted path like 'body.card', found 'body..card'"),
])
def test_each_check_says_what_it_expected_and_what_it_found(check, message):
    with pytest.raises(InvalidInput) as refused:
        check()
    assert str(refused.value).startswith(message)


def test_each_check_returns_what_it_accepted():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert inputs.check_text("order:17", "subject", 500) == "order:17"
    assert inputs.check_string("", "target", 5) == ""
    assert inputs.check_reason("  looked it up  ") == "looked it up"
    assert inputs.check_operation_name("crm/contacts.update") == "crm/contacts.update"
    assert inputs.check_operation_pattern("mail.*") == "mail.*"
    assert inputs.check_tenant_or_every("") == ""
    assert inputs.check_whole_number(10, low=1, high=10, expected="x") == 10
    assert inputs.check_aware(now, "deadline") == now and inputs.check_aware(None, "d") is None
    assert inputs.check_duration(timedelta(0), "pause", high=timedelta(minutes=1)) == timedelta(0)
    assert inputs.check_names(("pay", "pack"), "depends_on", 100) == ["pay", "pack"]
    assert inputs.check_paths(("body.card",), "redact") == ["body.card"]
