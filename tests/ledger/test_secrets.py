"""Secrets in text never reach the database, whichever public entry point carries them.

Each planted credential is unique, so a sweep of every ledger table's rows as text proves
that none of them was stored anywhere: not in a column, an event, evidence or a result.
"""

import base64

import pytest
from django.apps import apps
from django.db import connection

from ledger import episodes, facts, obligations, receipts, reconcile, runs
from ledger.canonical import REDACTED, redact
from ledger.models import Episode, Evidence, Fact, Operation, OperationEvent
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
    # db_roles' list of logins limited to tenants (ledger/sql/app_role.sql): no model, and
    # only the tables' owner writes it, from `manage.py db_roles --login NAME --tenants`.
    existing -= {"ledger_logintenant"}
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


# Issue 41: shapes two independent attack runs found stored. Each case: a name, where it is
# stored, what is written there, and what the ledger must hold afterwards (the input itself
# for look-alikes that must be kept). Each secret is unique ("...Q9"), so a leak names its case.
_B64_PASSWORD = base64.b64encode(b"password=B64SecretQ9").decode()
CORPUS = [
    # Passwords in prose, in four languages.
    ("prose_for", "intent", "the password for the admin account is Tr0ub4dorQ9&3, keep it",
     "the password for the admin account is [redacted], keep it"),
    ("prose_my", "episode", "my password Hunter2Q9 is on the note",
     "my password [redacted] is on the note"),
    ("prose_zh", "error_detail", "管理员账户的密码是Zx9SecretQ9，请保密",
     "管理员账户的密码是[redacted]，请保密"),
    ("prose_zh_my", "fact", "我的密码Zx9MineQ9，别告诉别人", "我的密码[redacted]，别告诉别人"),
    ("prose_de", "evidence", "das Passwort für das Admin-Konto lautet Geh31mQ9!",
     "das Passwort für das Admin-Konto lautet [redacted]!"),
    ("prose_de_my", "episode", "mein Passwort Geh31mMeinQ9 und sonst nichts",
     "mein Passwort [redacted] und sonst nichts"),
    ("prose_fr", "intent", "le mot de passe du compte admin est S3cretFrQ9.",
     "le mot de passe du compte admin est [redacted]."),
    ("prose_fr_my", "error_detail", "mon mot de passe S3cretMonQ9, merci",
     "mon mot de passe [redacted], merci"),
    # Name/value pairs the scrubber did not know.
    ("azure_account_key", "intent",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=AzureKeyQ9+abc/xyz==;"
     "EndpointSuffix=core.windows.net",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=[redacted];"
     "EndpointSuffix=core.windows.net"),
    ("ecs_env_text", "episode", '[{"Name":"DB_PASSWORD","Value":"EcsTextQ9"}]',
     '[{"Name":"DB_PASSWORD","Value":"[redacted]"}]'),
    ("ecs_env_json", "intent", {"env": [{"Name": "DB_PASSWORD", "Value": "EcsJsonQ9"},
                                        {"Name": "REGION", "Value": "eu-west-1"}]},
     {"env": [{"Name": "DB_PASSWORD", "Value": "[redacted]"},
              {"Name": "REGION", "Value": "eu-west-1"}]}),
    ("ecs_env_reversed", "error_detail", '{"Value": 31337009, "Name": "DB_PASSWORD"}',
     '{"Value": [redacted], "Name": "DB_PASSWORD"}'),
    ("name_data_text", "fact", '{"name":"password","data":"NameDataQ9"}',
     '{"name":"password","data":"[redacted]"}'),
    ("name_data_json", "evidence", {"name": "password", "data": "NameDataJsonQ9"},
     {"name": "password", "data": "[redacted]"}),
    ("keys_json", "intent", {"ssh_key": "SshKeyQ9", "pass": "PassKeyQ9", "cvv": "737",
                             "db_pass": "DbPassQ9", "pass_count": 3},
     {"ssh_key": "[redacted]", "pass": "[redacted]", "cvv": "[redacted]",
      "db_pass": "[redacted]", "pass_count": 3}),
    ("keys_text", "episode", "ssh_key=SshTextQ9 pass=PassTextQ9 cvv: 7377 user=bob",
     "ssh_key=[redacted] pass=[redacted] cvv: [redacted] user=bob"),
    # Token shapes.
    ("gitlab", "intent", "token glpat-GlpatQ9abcdefghijklmn here", "token [redacted] here"),
    ("huggingface", "error_detail", "hf hf_HfTokenQ9abcdefghijklmnopqrstuv",
     "hf [redacted]"),
    ("npm", "episode", "npm npm_NpmTokenQ9abcdefghijklmnopqrstuvwxyz01 set",
     "npm [redacted] set"),
    ("sendgrid", "fact", "SG.SendGridQ9abcdefgh.SendGridSecretQ9abcdefghijklmnopqrstuvw",
     "[redacted]"),
    ("google_oauth", "evidence", "Authorization token ya29.a0AfH6SMBGoogleQ9abcdefghij",
     "Authorization token [redacted]"),
    ("aws_bare", "intent", "secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYQ9AMPLEKEY.",
     "secret [redacted]."),
    ("token_no_equals", "intent", "then set refresh_token RefreshQ9abc and retry",
     "then set refresh_token [redacted] and retry"),
    ("aws_no_equals", "episode", "aws configure set aws_secret_access_key AwsSpaceQ9/abc+def",
     "aws configure set aws_secret_access_key [redacted]"),
    ("slack_webhook", "error_detail",
     "POST https://hooks.slack.com/services/T0AAAA1111/B0BBBB2222/SlackHookQ9abcdefghij failed",
     "POST https://hooks.slack.com/services/[redacted] failed"),
    # Numbers that identify a person's money or person.
    ("iban_grouped", "intent", "IBAN DE89 3704 0044 0532 0130 00 EUR", "IBAN [redacted] EUR"),
    ("iban_compact", "fact", "pay to GB82WEST12345698765432 today", "pay to [redacted] today"),
    ("ssn", "episode", "SSN 078-05-1120 on file", "SSN [redacted] on file"),
    ("card_dots", "evidence", "card 4111.1111.1111.1111 declined", "card [redacted] declined"),
    # Encodings that hid `password=` from the pass that knows it.
    ("percent_encoded", "intent", "next=%2Flogin%3Fuser%3Dbob%26password%3DEncodedQ9%26x%3Dy",
     "next=%2Flogin%3Fuser%3Dbob%26password%3D[redacted]%26x%3Dy"),
    ("full_width", "error_detail", "login ｐａｓｓｗｏｒｄ＝FullWidthQ9 failed",
     "login password=[redacted] failed"),
    ("zero_width", "episode", "login pass\u200bword=ZeroWidthQ9 failed",
     "login password=[redacted] failed"),
    ("base64", "fact", f"blob {_B64_PASSWORD} end", "blob [redacted] end"),
    # Look-alikes: kept as they are.
    ("order_number", "intent", "order 1234567890123 shipped", None),
    ("order_reference", "episode", "order ORD-2024-000123 for 3 items", None),
    ("uuid", "error_detail", "id 123e4567-e89b-12d3-a456-426614174000", None),
    ("sha1", "fact", "commit 9fceb02d0ae598e95dc970b74767f19372d61af8", None),
    ("sha1_upper", "evidence", "commit 9FCEB02D0AE598E95DC970B74767F19372D61AF8", None),
    ("password_manager", "episode", "my password manager is great", None),
    ("password_required", "intent", "the password for the admin account is required", None),
    ("passwort_falsch", "episode", "das Passwort ist falsch", None),
    ("mot_de_passe_incorrect", "episode", "le mot de passe est incorrect", None),
    ("mima_wrong", "episode", "密码错误，请重试", None),
    ("phone", "intent", "call 555-123-4567 tomorrow", None),
    ("date", "intent", "on 2024-01-15 we met", None),
    ("version", "intent", "version 4.1.1.1 released", None),
    ("pass_count", "intent", "pass_count: 3, bypass=true", None),
    ("long_words", "episode", "internationalization ThisIsALongCamelCaseIdentifierName", None),
    ("not_an_iban", "intent", "ES12 3456 order", None),
    ("full_width_prose", "episode", "会议在三楼，请准时（十点）。", None),
    ("url", "intent", "https://example.com/a/b/c?page=2", None),
]


def _store(where: str, value, name: str):
    """Write `value` where `where` says, through the public API, and read back what the
    database holds there."""
    if where == "intent":
        intent = value if isinstance(value, dict) else {"note": value}
        op = receipts.record_intent("secrets.corpus", "https://api.example", intent,
                                    idempotency_key=f"corpus-{name}")
        stored = Operation.objects.get(pk=op.pk).intent
        return stored if isinstance(value, dict) else stored["note"]
    if where == "error_detail":
        op = receipts.record_intent("secrets.corpus", "https://api.example", {"n": name})
        receipts.mark_submitted(op)
        receipts.mark_rejected(op, error_code="HTTP_400", detail=value)
        return Operation.objects.get(pk=op.pk).error_detail
    if where == "evidence":
        op = receipts.record_intent("secrets.corpus", "https://api.example", {"n": name})
        receipts.mark_submitted(op)
        receipts.mark_succeeded(op, evidence={"response": value})
        event = OperationEvent.objects.filter(operation=op).order_by("-pk").first()
        return event.evidence["response"]
    if where == "fact":
        return Fact.objects.get(pk=facts.assert_fact(f"corpus:{name}", "said", value,
                                                     source="corpus").pk).value
    assert where == "episode", f"expected a known place to store, found {where!r}"
    run = runs.start("corpus", run_id=f"run-{name}")
    return Episode.objects.get(pk=episodes.record(run, "tool", content=value).pk).content


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "where", "written", "expected"), CORPUS,
                         ids=[case[0] for case in CORPUS])
def test_corpus_of_shapes_is_stored_redacted_and_look_alikes_as_written(name, where, written,
                                                                         expected):
    expected = written if expected is None else expected
    stored = _store(where, written, name)
    assert stored == expected, f"{name} stored in {where}: expected {expected!r}, found {stored!r}"


@pytest.mark.parametrize(("name", "where", "written", "expected"), CORPUS,
                         ids=[case[0] for case in CORPUS])
def test_corpus_scrubbed_twice_is_scrubbed_once(name, where, written, expected):
    once = redact(written)
    assert redact(once) == once, f"{name}: a second scrub changed {once!r}"


@pytest.mark.django_db
def test_identifiers_are_stored_as_given_even_when_they_look_like_secrets():
    # The documented contract (docs/security.md): idempotency keys, fact subjects and step
    # ids identify; masking them would merge distinct identities, so they are not scrubbed.
    op = receipts.record_intent("secrets.ids", "https://api.example", {"n": 1},
                                idempotency_key="password=IdemKeyQ9")
    fact = facts.assert_fact("user:password=SubjectQ9", "said", "x", source="ids")
    run = runs.start("ids", run_id="run-ids")
    step = runs.add_step(run, "password=StepQ9")
    assert (Operation.objects.get(pk=op.pk).idempotency_key, Fact.objects.get(pk=fact.pk).subject,
            step.step_id) == ("password=IdemKeyQ9", "user:password=SubjectQ9", "password=StepQ9")
