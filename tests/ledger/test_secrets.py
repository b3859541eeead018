"""Secrets in text never reach the database, whichever public entry point carries them.

Each planted credential is unique, so a sweep of every ledger table's rows as text proves
that none of them was stored anywhere: not in a column, an event, evidence or a result.
"""

import pytest
from django.apps import apps
from django.db import connection

from ledger import episodes, facts, obligations, receipts, reconcile, runs
from ledger.canonical import REDACTED
from ledger.models import Evidence, Operation
from ledger.states import State
from tests.factories import UserFactory

# Every shape the ledger promises to recognise, each with a credential found nowhere else.
PLANTED = {
    "userinfo": "https://deploy:Pa55UserinfoQ7@api.example/v1/articles",
    "query": ("https://api.example/v1/articles?page=2&api_key=QpApiKeyQ7&token=QpTokenQ7"
              "&access_token=QpAccessQ7&sig=QpSigQ7"),
    "bearer": "Authorization: Bearer BearerTok3nQ7",
    "basic": "sent Basic QmFzaWNDcmVkUTc= to the proxy",
    "sk": "key sk-proj-SkProjSecretQ7x9",
    "sk_live": "stripe sk_live_51SkLiveSecretQ7",
    "rk_live": "restricted rk_live_RkLiveSecretQ7",
    "aws": "aws AKIAQ7SWEEPEXAMPLE1 and ASIAQ7SWEEPEXAMPLE2",
    "jwt": "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJRNyJ9.JwtSignatureQ7xyz",
    "github": "gh ghp_GithubTokenQ7abcdefghijklmnop and github_pat_11GithubPatQ7_abcdefghij",
    "slack": "slack xoxb-1234567890-SlackTokenQ7",
    "password": "login password=PasswordQ7 failed",
}
SECRETS = [
    "Pa55UserinfoQ7", "QpApiKeyQ7", "QpTokenQ7", "QpAccessQ7", "QpSigQ7", "BearerTok3nQ7",
    "QmFzaWNDcmVkUTc", "SkProjSecretQ7", "SkLiveSecretQ7", "RkLiveSecretQ7",
    "AKIAQ7SWEEPEXAMPLE1", "ASIAQ7SWEEPEXAMPLE2", "JwtSignatureQ7", "eyJzdWIiOiJRNyJ9",
    "GithubTokenQ7", "GithubPatQ7", "SlackTokenQ7", "PasswordQ7",
]
ALL_TEXT = " | ".join(PLANTED.values())


class TransportDown(Exception):
    pass


@reconcile.register("secrets.sweep")
class Echoing(reconcile.Reconciler):
    """Echoes credentials back in every field a reconciler fills, as a careless one would."""

    def lookup(self, op):
        mode = op.intent["mode"]
        if mode == "raise":
            raise ConnectionError(f"lookup failed: {ALL_TEXT}")
        observed = {"response": ALL_TEXT, "headers": PLANTED, PLANTED["sk"]: "keyed"}
        query = {"url": PLANTED["query"], "note": PLANTED["bearer"]}
        if mode == "found":
            return reconcile.Found(f"ext-1 {PLANTED['password']}", observed, query=query)
        return reconcile.Ambiguous(observed, reason=f"two matches: {ALL_TEXT}", query=query)


def ledger_tables() -> list[str]:
    """Every table of the ledger app, from its models (with many-to-many tables), checked
    against the tables PostgreSQL has, so that a new table cannot escape the sweep."""
    tables = set()
    for model in apps.get_app_config("ledger").get_models(include_auto_created=True):
        tables.add(model._meta.db_table)
    existing = {t for t in connection.introspection.table_names() if t.startswith("ledger_")}
    assert existing == tables, f"expected every ledger_ table to belong to a model, found " \
                               f"{sorted(existing ^ tables)}"
    return sorted(tables)


def stored_text() -> dict[str, str]:
    quote = connection.ops.quote_name
    rows = {}
    with connection.cursor() as cursor:
        for table in ledger_tables():
            cursor.execute(f"SELECT t::text FROM {quote(table)} t")
            rows[table] = "\n".join(row[0] for row in cursor.fetchall())
    return rows


@pytest.mark.django_db
def test_no_planted_secret_reaches_any_ledger_table_through_any_entry_point():
    reviewer = UserFactory(username="sweeper", role="reviewer")
    run = runs.start(f"publish {ALL_TEXT}", run_id="run-secrets")
    runs.add_step(run, "send")

    intent = {"headers": dict(PLANTED), "body": ALL_TEXT, "list": list(PLANTED.values()),
              PLANTED["github"]: "keyed by a token", "nested": {"deep": [{"x": ALL_TEXT}]}}
    rejected = receipts.record_intent("secrets.send", PLANTED["query"], intent, run=run,
                                      step="send")
    receipts.mark_submitted(rejected)
    receipts.mark_rejected(rejected, error_code="HTTP_401 token=ErrTok", detail=ALL_TEXT)

    unknown = receipts.record_intent("secrets.send", PLANTED["userinfo"], {"n": 2, "x": ALL_TEXT})
    with pytest.raises(TransportDown):
        with receipts.submit(unknown):
            raise TransportDown(f"connection reset while sending {ALL_TEXT}")
    assert unknown.state == State.OUTCOME_UNKNOWN

    told = receipts.record_intent("secrets.send", "https://api.example", {"n": 3})
    receipts.mark_submitted(told)
    receipts.mark_outcome_unknown(told, error_code="Timeout", detail=ALL_TEXT)

    done = receipts.record_intent("secrets.send", "https://api.example", {"n": 4})
    receipts.mark_submitted(done)
    receipts.mark_succeeded(done, external_id=f"ext {PLANTED['query']}",
                            evidence={"response": ALL_TEXT, "raw": PLANTED})

    reconciled = {}
    for mode in ("found", "ambiguous", "raise"):
        op = receipts.record_intent("secrets.sweep", PLANTED["query"], {"mode": mode})
        receipts.mark_submitted(op)
        receipts.mark_outcome_unknown(op, error_code="Timeout", detail=ALL_TEXT)
        reconciled[mode] = op
    reconcile.run_once(worker="sweeper-worker")
    assert Evidence.objects.filter(operation__operation="secrets.sweep").count() == 3
    ambiguous = Operation.objects.get(pk=reconciled["ambiguous"].pk)
    assert ambiguous.state == State.MANUAL_REVIEW
    receipts.resolve(ambiguous, State.SUCCEEDED, user=reviewer, reason=f"checked: {ALL_TEXT}",
                     external_id=f"ext-2 {PLANTED['jwt']}")

    facts.assert_fact("article:1", "status", {"detail": ALL_TEXT, "raw": PLANTED},
                      source=f"crawler {PLANTED['query']}", run=run)
    candidate = facts.assert_fact("article:1", "status", ALL_TEXT, source=PLANTED["userinfo"])
    facts.resolve_conflict(candidate.conflict, winner="candidate", user=reviewer,
                           reason=f"newer: {ALL_TEXT}")

    obligations.open(run, "email.send", "ob-secrets-1")
    obligations.commit("ob-secrets-1", {"receipt": ALL_TEXT, "raw": PLANTED})
    obligations.open(run, "email.send", "ob-secrets-2")
    obligations.cancel("ob-secrets-2", reason=f"not needed: {ALL_TEXT}")

    episodes.record(run, "tool", content=f"called the API: {ALL_TEXT}",
                    content_ref=PLANTED["query"])

    stored = stored_text()
    assert stored["ledger_operation"] and stored["ledger_evidence"] and stored["ledger_fact"]
    leaks = {(table, secret) for table, text in stored.items() for secret in SECRETS
             if secret in text}
    assert leaks == set()
    assert "ErrTok" not in stored["ledger_operation"]
    # Masked, not dropped: what is not a credential is still there to read.
    assert REDACTED in stored["ledger_operation"] and "api.example/v1/articles" in \
        stored["ledger_operation"]
    assert "page=2" in stored["ledger_evidence"]


@pytest.mark.django_db
def test_intents_differing_only_in_a_secret_are_one_operation_under_one_key():
    def intent(secret):
        return {"url": f"https://api.example/x?token={secret}",
                "headers": f"Authorization: Bearer {secret}", "title": "Hello"}

    first = receipts.record_intent("secrets.send", f"https://a:{'Pw1'}@api.example",
                                   intent("FirstSecret1"), idempotency_key="k-1")
    again = receipts.record_intent("secrets.send", f"https://a:{'Pw2'}@api.example",
                                   intent("OtherSecret2"), idempotency_key="k-1")
    assert again.pk == first.pk
    assert again.intent_fingerprint == first.intent_fingerprint
    other = receipts.record_intent("secrets.send", "https://api.example",
                                   {**intent("FirstSecret1"), "title": "Bye"})
    assert other.intent_fingerprint != first.intent_fingerprint


# What redaction by key name and by token shape alone let through (issue 30): the ledger's
# own agent secrets, the value of a name/value pair whose name is a secret's, passwords in
# prose and card numbers.
PROSE = {
    "agent_key": "calling with alk_AgentSecretQ8abcdefghijklmnopqrstuvwxyz0123456789",
    "prose": "my password is Hunter2Q8, please keep it",
    "pw": "login failed (pw: PwColonQ8!)",
    "passcode": "the passcode was PasscodeQ8.",
    "card": "card 4111 1111 1111 1111 declined",
    "card_plain": "charged 5555555555554444 ok",
}
PROSE_SECRETS = ["AgentSecretQ8", "Hunter2Q8", "PwColonQ8", "PasscodeQ8",
                 "4111 1111 1111 1111", "5555555555554444", "NamedValueQ8", "PairListQ8",
                 "NamedTextQ8", "4242424242424242"]
PROSE_TEXT = " | ".join(PROSE.values()) + (
    ' | {"name": "X-Api-Key", "value": "NamedTextQ8"}')
NAMED = {"headers": [{"name": "X-Api-Key", "value": "NamedValueQ8"},
                     {"name": "Accept", "value": "application/json"}],
         "pairs": [["Authorization", "PairListQ8"], ["Accept", "text/plain"]],
         "card_number_as_int": 4242424242424242}


@reconcile.register("secrets.prose")
class EchoingProse(reconcile.Reconciler):
    def lookup(self, op):
        return reconcile.Found(f"ext {PROSE['pw']}", {"response": PROSE_TEXT, **NAMED},
                               query={"note": PROSE_TEXT})


@pytest.mark.django_db
def test_agent_keys_named_values_prose_passwords_and_cards_reach_no_stored_text():
    reviewer = UserFactory(username="sweeper", role="reviewer")
    run = runs.start(f"publish {PROSE_TEXT}", run_id="run-prose")
    intent = {"body": PROSE_TEXT, **NAMED, "nested": [{"x": PROSE_TEXT}]}
    op = receipts.record_intent("secrets.send", "https://api.example", intent)
    with pytest.raises(TransportDown):
        with receipts.submit(op):
            raise TransportDown(f"reset while sending {PROSE_TEXT}")
    done = receipts.record_intent("secrets.send", "https://api.example", {"n": 2})
    receipts.mark_submitted(done)
    receipts.mark_succeeded(done, evidence={"response": PROSE_TEXT, **NAMED})
    echoed = receipts.record_intent("secrets.prose", "https://api.example", {"n": 3})
    receipts.mark_submitted(echoed)
    receipts.mark_outcome_unknown(echoed, error_code="Timeout", detail=PROSE_TEXT)
    reconcile.run_once(worker="sweeper-worker")
    unknown = Operation.objects.get(pk=op.pk)
    receipts.resolve(unknown, State.ABANDONED, user=reviewer, reason=f"checked {PROSE_TEXT}")

    facts.assert_fact("customer:1", "login", {"detail": PROSE_TEXT, **NAMED},
                      source=f"crawler {PROSE['agent_key']}", run=run)
    obligations.open(run, "email.send", "ob-prose")
    obligations.commit("ob-prose", {"receipt": PROSE_TEXT, **NAMED})
    episodes.record(run, "tool", content=f"called the API: {PROSE_TEXT}")

    stored = stored_text()
    leaks = {(table, secret) for table, text in stored.items() for secret in PROSE_SECRETS
             if secret in text}
    assert leaks == set()
    # What is not a secret is still there to read.
    assert "application/json" in stored["ledger_operation"]
    assert "please keep it" in stored["ledger_operation"]
    assert "declined" in stored["ledger_episode"]


@pytest.mark.parametrize("text", [
    "the password is required", "password is incorrect", "Password must be 8 characters",
    "order 1234567890123 shipped",  # 13 digits, not a card's prefix
    "order 4111111111111112 shipped",  # a card's shape, not Luhn-valid
    "skeleton key", "pass the salt", "pwd is /home/ada",
])
def test_ordinary_text_near_the_new_shapes_is_left_alone(text):
    from ledger.canonical import scrub_text

    assert scrub_text(text) == text
