"""The ledger's settings, each with its default: a host project sets only what it changes.

Every `LEDGER_*` Django setting the ledger reads is declared here, and the ledger reads
settings only through this module: `from ledger import conf`, then `conf.MAX_INTENT_BYTES`.
Each read looks at `django.conf.settings` again, so `override_settings` and pytest-django's
`settings` fixture take effect at once. A setting the host project leaves out has its
default; `manage.py check` refuses a value of the wrong kind (see `check_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core import checks


@dataclass(frozen=True)
class Setting:
    default: Any
    kind: str  # "positive integer", "positive number", "whole number", "boolean",
    #            "list of module names", "http(s) URL", "mapping of names to secrets",
    #            "secret (empty: off)"
    doc: str


SETTINGS: dict[str, Setting] = {
    "MAX_INTENT_BYTES": Setting(
        256 * 1024, "positive integer",
        "Largest intent record_intent stores, in bytes of canonical JSON; more raises "
        "InvalidInput.",
    ),
    "MAX_REQUEST_BYTES": Setting(
        1024 * 1024, "positive integer",
        "Largest request body the agent API and the MCP endpoint take, in bytes; a larger "
        "one is refused with 413 before it is read whole. Django's DATA_UPLOAD_MAX_MEMORY_SIZE "
        "(2.5 MB) still bounds it from above.",
    ),
    "AGENT_KEY_CACHE_SECONDS": Setting(
        0, "whole number",
        "How long a web process believes an agent key it verified without asking the "
        "database again (by the secret's SHA-256, never the secret; at most 1,024 keys). 0, "
        "the default: every request asks, so a revoked key is refused from its next request "
        "everywhere. A positive value saves a statement a request; a revoked key is then "
        "refused at once by the process that revoked it and by any request naming an "
        "operation, elsewhere within this many seconds.",
    ),
    "MAX_JSON_DEPTH": Setting(
        64, "positive integer",
        "Deepest nesting of a JSON value the ledger takes (intents, evidence, fact values, "
        "results); deeper raises InvalidInput naming the path.",
    ),
    "RECONCILE_MAX_FAILURES": Setting(
        3, "positive integer",
        "Reconciler errors in a row after which an operation goes to manual_review "
        "(a reconciler's own `max_failures` wins).",
    ),
    "UNKNOWN_OUTCOME_POLICIES": Setting(
        {}, "mapping of operation patterns to unknown-outcome policies",
        "Per operation name (or pattern, `payments.*`), what an unproven outcome may become "
        "(ledger.reconcile.unknown_outcome_policy): {'automatic_retry': False} sends every "
        "proven absence to a person instead of safe_to_retry; 'attempts': failed or blind "
        "readings before manual_review (instead of the reconciler's max_failures); "
        "'window_seconds': how long NotYet may last before manual_review (instead of the "
        "reconciler's grace_period). Left out: automatic retry as the retry policy allows, "
        "and the reconciler's own numbers. The default: a policy admins set on the desk for "
        "the operation's tenant (ledger.outcome_policies) wins over it.",
    ),
    "OPERATION_RULES": Setting(
        {}, "mapping of operation patterns to rule lists",
        "Per operation name (or pattern, `payments.*`), what a sendable intent looks like, "
        "checked before it is submitted (ledger.validation): 'required' (dotted intent "
        "paths), 'ranges' ({path: {'min': n, 'max': n}}), 'one_of' ({path: [values]}), "
        "'targets' and 'accounts' (fnmatch patterns). A refusal is recorded (abandoned, "
        "error code validation_refused, the reason) and nothing is sent.",
    ),
    "STALE_SUBMISSION_SECONDS": Setting(
        600, "positive integer",
        "Age after which a `submitted` operation whose run holds no live lease is swept to "
        "outcome_unknown.",
    ),
    "IN_FLIGHT_SECONDS": Setting(
        60, "positive integer",
        "Default in-flight window of a submission (`mark_submitted(in_flight_for=)`), "
        "counted from the give-up (the attempt's outcome_unknown): a reconciler's "
        "ProvenAbsent observed before it ends is not taken as proof. 60 s: above the usual "
        "client, proxy and load-balancer timeouts (30-60 s), after which a request still "
        "queued somewhere is rare; raise it for services that queue writes.",
    ),
    "FACT_MAX_FUTURE_SECONDS": Setting(
        300, "positive integer",
        "How far past the ledger's clock a fact's observed_at may lie (clock skew between an "
        "agent and the ledger); later raises InvalidInput. A fact observed in year 9999 "
        "would otherwise stay current against every real observation.",
    ),
    "RECONCILER_MODULES": Setting(
        (), "list of module names",
        "Modules imported before reconciling, so that their `@reconcile.register` classes "
        "exist; none by default.",
    ),
    # Notifications (ledger.notifications, `manage.py notify`).
    "DESK_URL": Setting(
        "http://127.0.0.1:8000", "http(s) URL",
        "Where the review desk is served; notifications link to its pages from here.",
    ),
    "TRACE_URL": Setting(
        "", "http(s) URL template naming {trace_id} (or empty)",
        "Where the desk links an operation recorded inside an OpenTelemetry trace, e.g. "
        "Jaeger's http://jaeger:16686/trace/{trace_id}, Tempo's or Langfuse's trace page; "
        "{span_id} may be named too. Empty: no link.",
    ),
    "WEBHOOK_SECRETS": Setting(
        {}, "mapping of names to secrets",
        "HMAC secrets of webhook channels by name (a channel stores only the name); "
        "config/settings.py fills it from environment variables LEDGER_WEBHOOK_SECRET_<NAME>.",
    ),
    "WEBHOOK_ALLOW_PRIVATE": Setting(
        False, "boolean",
        "Whether a webhook may point at a loopback, private, link-local, site-local, "
        "multicast or reserved address, or an IPv6 form embedding one "
        "(ledger.notifications.address_refusal; checked when the channel is saved and before "
        "every delivery); off, an admin cannot "
        "aim the ledger at an internal service. config/settings.py turns it on in development "
        "(the demo's catcher is on loopback).",
    ),
    "NOTIFY_ITEMS_PER_MESSAGE": Setting(
        20, "positive integer",
        "Items listed (with their links) in one notification; the rest are counted.",
    ),
    "NOTIFY_MAX_ATTEMPTS": Setting(
        8, "positive integer",
        "Delivery attempts of one notification before it is given up (status failed).",
    ),
    "NOTIFY_BACKOFF_SECONDS": Setting(
        30, "positive integer",
        "Wait before the first retry of a failed delivery; doubled after each failure.",
    ),
    "NOTIFY_BACKOFF_CAP_SECONDS": Setting(
        3600, "positive integer", "Longest wait between two delivery attempts.",
    ),
    "NOTIFY_TIMEOUT_SECONDS": Setting(
        10, "positive integer", "How long a webhook delivery may take before it counts as failed.",
    ),
    "NOTIFY_QUEUE_GRACE_SECONDS": Setting(
        60, "positive integer",
        "How long an outcome_unknown operation is left to the reconciler before it is told "
        "as an item in the queue (manual_review is told at once).",
    ),
    # Operators' endpoints (review.views_ops: /healthz and /metrics; ledger.health).
    "HEALTH_RECONCILE_BACKLOG_SECONDS": Setting(
        300, "positive integer",
        "/healthz warns when the oldest operation due for reconciliation has waited longer.",
    ),
    "HEALTH_SEAL_LAG_SECONDS": Setting(
        30, "positive number",
        "/healthz warns when the oldest committed event has waited longer for the sealer.",
    ),
    "METRICS_TOKEN": Setting(
        "", "secret (empty: off)",
        "The bearer token /metrics asks for (`Authorization: Bearer <token>`); while empty, "
        "/metrics answers 404, because its labels name tenants.",
    ),
    # The audit trail's signed checkpoints and bundles (ledger.audit_bundle).
    "AUDIT_SIGNING_KEY": Setting(
        "", "secret (empty: off)",
        "The Ed25519 private key `manage.py audit_export` signs each tenant's chain head and "
        "the bundle with: PEM (PKCS#8) or the 32-byte seed as 64 hex digits. Keep it from "
        "the database's owner; `verify_audit --bundle FILE --public-key KEY` needs only the "
        "public key. config/settings.py fills it from the environment variable "
        "LEDGER_AUDIT_SIGNING_KEY. Empty: no export, no signed checkpoints.",
    ),
    # The desk behind reverse proxies (review.security).
    "TRUSTED_PROXY_COUNT": Setting(
        0, "whole number",
        "How many reverse proxies in front of the desk append to X-Forwarded-For; the login "
        "lockout counts failures against the address the outermost of them saw (0: "
        "REMOTE_ADDR).",
    ),
}


def __getattr__(name: str) -> Any:
    try:
        setting = SETTINGS[name]
    except KeyError:
        raise AttributeError(
            f"expected one of the ledger settings {', '.join(SETTINGS)}, found {name!r}"
        ) from None
    return getattr(settings, f"LEDGER_{name}", setting.default)


def __dir__() -> list[str]:
    return sorted([*globals(), *SETTINGS])


def _problem(name: str, setting: Setting, value: Any) -> str | None:
    if setting.kind == "positive integer":
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return None
    elif setting.kind == "http(s) URL":
        if isinstance(value, str) and value.startswith(("http://", "https://")):
            return None
    elif setting.kind.startswith("http(s) URL template"):
        if value == "" or (isinstance(value, str) and value.startswith(("http://", "https://"))
                           and "{trace_id}" in value and _formats(value)):
            return None
    elif setting.kind == "positive number":
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return None
    elif setting.kind == "whole number":
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return None
    elif setting.kind == "secret (empty: off)":
        if isinstance(value, str):
            return None
        return f"expected LEDGER_{name} to be a string, found {type(value).__name__}"
    elif setting.kind == "boolean":
        if isinstance(value, bool):
            return None
    elif setting.kind == "mapping of operation patterns to unknown-outcome policies":
        if isinstance(value, dict) and all(
            isinstance(k, str) and k.strip() and _unknown_outcome_policy(v)
            for k, v in value.items()
        ):
            return None
    elif setting.kind == "mapping of operation patterns to rule lists":
        if isinstance(value, dict) and all(
            isinstance(k, str) and k.strip() and _rule_list(v) for k, v in value.items()
        ):
            return None
    elif setting.kind == "mapping of names to secrets":
        if isinstance(value, dict) and all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()
        ):
            return None
    elif isinstance(value, list | tuple) and all(
        isinstance(m, str) and m.strip() for m in value
    ):
        return None
    if setting.kind == "mapping of names to secrets":  # never print a secret
        value = "a mapping with an empty name or secret" if isinstance(value, dict) else (
            type(value).__name__)
        return f"expected LEDGER_{name} to be a {setting.kind}, found {value}"
    return f"expected LEDGER_{name} to be a {setting.kind}, found {value!r}"


def _unknown_outcome_policy(value: Any) -> bool:
    def positive(n):
        return isinstance(n, int) and not isinstance(n, bool) and n > 0

    return (isinstance(value, dict)
            and set(value) <= {"automatic_retry", "attempts", "window_seconds"}
            and isinstance(value.get("automatic_retry", True), bool)
            and all(positive(value[k]) for k in ("attempts", "window_seconds") if k in value))


def _rule_list(value: Any) -> bool:
    # Its shape only: each rule is checked by `ledger.validation.check_rule_setting`
    # (a check of its own, which names the rule; ledger.validation imports this module).
    return isinstance(value, dict)


def _formats(template: str) -> bool:
    try:
        template.format(trace_id="0" * 32, span_id="0" * 16)
    except (KeyError, IndexError, ValueError):
        return False
    return True


def check_settings(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Names a malformed setting at `manage.py check` and every command that runs checks."""
    errors = []
    for name, setting in SETTINGS.items():
        problem = _problem(name, setting, getattr(settings, f"LEDGER_{name}", setting.default))
        if problem:
            errors.append(checks.Error(problem, hint=setting.doc, id="ledger.E001"))
    return errors
