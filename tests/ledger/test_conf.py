"""ledger/conf.py: every LEDGER_* setting has a default, is read lazily, and is checked."""

import pytest

from ledger import conf, receipts
from ledger.conf import check_settings
from ledger.errors import InvalidInput


def test_a_project_that_sets_no_ledger_setting_gets_every_default(settings):
    for name in conf.SETTINGS:
        if hasattr(settings, f"LEDGER_{name}"):
            delattr(settings, f"LEDGER_{name}")
    assert {name: getattr(conf, name) for name in conf.SETTINGS} == {
        "MAX_INTENT_BYTES": 256 * 1024,
        "MAX_REQUEST_BYTES": 1024 * 1024,
        "AGENT_KEY_CACHE_SECONDS": 0,
        "MAX_JSON_DEPTH": 64,
        "RECONCILE_MAX_FAILURES": 3,
        "UNKNOWN_OUTCOME_POLICIES": {},
        "OPERATION_RULES": {},
        "STALE_SUBMISSION_SECONDS": 600,
        "IN_FLIGHT_SECONDS": 60,
        "FACT_MAX_FUTURE_SECONDS": 300,
        "RECONCILER_MODULES": (),
        "DESK_URL": "http://127.0.0.1:8000",
        "TRACE_URL": "",
        "WEBHOOK_SECRETS": {},
        "WEBHOOK_ALLOW_PRIVATE": False,
        "NOTIFY_ITEMS_PER_MESSAGE": 20,
        "NOTIFY_MAX_ATTEMPTS": 8,
        "NOTIFY_BACKOFF_SECONDS": 30,
        "NOTIFY_BACKOFF_CAP_SECONDS": 3600,
        "NOTIFY_TIMEOUT_SECONDS": 10,
        "NOTIFY_QUEUE_GRACE_SECONDS": 60,
        "HEALTH_RECONCILE_BACKLOG_SECONDS": 300,
        "HEALTH_SEAL_LAG_SECONDS": 30,
        "METRICS_TOKEN": "",
        "AUDIT_SIGNING_KEY": "",
        "TRUSTED_PROXY_COUNT": 0,
    }
    assert check_settings() == []


def test_every_setting_says_what_it_does():
    assert all(setting.doc.strip() for setting in conf.SETTINGS.values())


@pytest.mark.django_db
def test_an_overridden_setting_takes_effect_at_the_next_call(settings):
    intent = {"body": "x" * 200}
    receipts.record_intent("mail.send", "smtp://mail.example", intent)
    settings.LEDGER_MAX_INTENT_BYTES = 100
    with pytest.raises(InvalidInput, match="at most 100 bytes"):
        receipts.record_intent("mail.send", "smtp://mail.example", intent)


def test_an_unknown_setting_name_says_which_exist():
    with pytest.raises(AttributeError, match="expected one of the ledger settings "
                                             "MAX_INTENT_BYTES, .*found 'MAX_INTENT'"):
        conf.MAX_INTENT  # noqa: B018


@pytest.mark.parametrize(("name", "value"), [
    ("MAX_INTENT_BYTES", "256k"),
    ("MAX_INTENT_BYTES", 0),
    ("MAX_JSON_DEPTH", 0),
    ("RECONCILE_MAX_FAILURES", True),
    ("STALE_SUBMISSION_SECONDS", -1),
    ("RECONCILER_MODULES", "demo.simulated.articles"),
    ("RECONCILER_MODULES", ["demo.simulated.articles", ""]),
    ("DESK_URL", "desk.example"),
    ("NOTIFY_MAX_ATTEMPTS", 0),
    ("HEALTH_SEAL_LAG_SECONDS", 0),
    ("HEALTH_SEAL_LAG_SECONDS", "30"),
    ("HEALTH_RECONCILE_BACKLOG_SECONDS", 2.5),
    ("TRUSTED_PROXY_COUNT", -1),
    ("TRUSTED_PROXY_COUNT", True),
    ("UNKNOWN_OUTCOME_POLICIES", {"payments.*": {"automatic_retry": "no"}}),
    ("UNKNOWN_OUTCOME_POLICIES", {"payments.*": {"attempts": 0}}),
    ("UNKNOWN_OUTCOME_POLICIES", {"payments.*": {"window": 60}}),
    ("UNKNOWN_OUTCOME_POLICIES", {"": {"attempts": 2}}),
    ("OPERATION_RULES", {"payments.*": ["amount"]}),  # each rule: test_validation.py
])
def test_a_malformed_setting_is_refused_by_the_system_check(settings, name, value):
    setattr(settings, f"LEDGER_{name}", value)
    [error] = check_settings()
    assert error.id == "ledger.E001"
    kind = conf.SETTINGS[name].kind
    assert error.msg == f"expected LEDGER_{name} to be a {kind}, found {value!r}"


def test_a_malformed_webhook_secrets_setting_is_refused_without_printing_a_secret(settings):
    settings.LEDGER_WEBHOOK_SECRETS = {"PAYMENTS": "whsec-NeverPrintedQ7", "": "x"}
    [error] = check_settings()
    assert error.msg == ("expected LEDGER_WEBHOOK_SECRETS to be a mapping of names to "
                         "secrets, found a mapping with an empty name or secret")
    assert "NeverPrinted" not in error.msg


def test_a_metrics_token_that_is_not_text_is_refused_without_printing_it(settings):
    settings.LEDGER_METRICS_TOKEN = 4815162342
    [error] = check_settings()
    assert error.msg == "expected LEDGER_METRICS_TOKEN to be a string, found int"
    assert "4815162342" not in error.msg


def test_the_operators_settings_are_read_through_the_registry(settings):
    settings.LEDGER_TRUSTED_PROXY_COUNT = 2
    settings.LEDGER_HEALTH_SEAL_LAG_SECONDS = 0.5
    assert (conf.TRUSTED_PROXY_COUNT, conf.HEALTH_SEAL_LAG_SECONDS) == (2, 0.5)
    assert check_settings() == []
