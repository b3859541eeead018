"""The retention page: admins only, audited policy writes, errors, and previews that match."""

import pytest
from django.urls import reverse
from django.utils import timezone

from ledger import retention
from ledger.models import PurgeRun, RetentionChange, RetentionPolicy
from ledger.states import State
from tests.factories import OperationFactory, UserFactory, ensure_roles
from tests.support.retention import complete_days_ago

PAGE = reverse("review:retention")
ADD = reverse("review:retention_add")


def edit_url(policy):
    return reverse("review:retention_edit", args=[policy.pk])


def delete_url(policy):
    return reverse("review:retention_delete", args=[policy.pk])


def new_policy(pattern, purge, *, tenant="", redact="", keep=""):
    return {"new-pattern": pattern, "new-tenant": tenant, "new-purge_after_days": purge,
            "new-redact_after_days": redact, "new-keep_events_days": keep}


def edited(policy, purge, *, redact="", keep=""):
    prefix = f"policy-{policy.pk}"
    return {f"{prefix}-purge_after_days": purge, f"{prefix}-redact_after_days": redact,
            f"{prefix}-keep_events_days": keep}


def default_policy():
    return RetentionPolicy.objects.get(pattern="*", tenant="")


def written():
    """Everything a policy write leaves behind, to show that nothing was written."""
    return (sorted(RetentionPolicy.objects.values_list(
                "pattern", "tenant", "purge_after_days", "redact_after_days",
                "keep_events_days")),
            RetentionChange.objects.count())


@pytest.fixture
def admin_client(client, admin_user):
    client.force_login(admin_user)
    return client


# --- who may see and change retention ------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("role, status", [
    ("anonymous", 302), ("no role", 403), ("viewer", 403), ("reviewer", 403), ("admin", 200),
])
def test_only_admins_see_the_retention_page(client, role, status):
    if role != "anonymous":
        roles = {"no role": None, "viewer": "viewer", "reviewer": "reviewer", "admin": "admin"}
        client.force_login(UserFactory(username=role.replace(" ", "-"), role=roles[role]))
    response = client.get(PAGE)
    assert response.status_code == status
    if status == 302:
        assert response["Location"].startswith("/accounts/login/")
    # An htmx request for the fragment alone is refused the same way.
    assert client.get(PAGE, headers={"HX-Request": "true"}).status_code == status


@pytest.mark.django_db
@pytest.mark.parametrize("role, status", [("anonymous", 302), ("viewer", 403),
                                          ("reviewer", 403)])
def test_only_admins_can_add_edit_or_delete_policies(client, role, status):
    other = retention.set_policy("mail.*", purge_after_days=30,
                                 user=UserFactory(username="admin", role="admin"))
    if role != "anonymous":
        client.force_login(UserFactory(username=role, role=role))
    before = written()
    assert client.post(ADD, new_policy("articles.*", 10)).status_code == status
    assert client.post(edit_url(other), edited(other, 5)).status_code == status
    assert client.post(delete_url(other)).status_code == status
    assert written() == before


@pytest.mark.django_db
def test_the_retention_link_is_in_the_navigation_for_admins_only(client, admin_user, reviewer):
    client.force_login(reviewer)
    assert f'href="{PAGE}"' not in client.get(reverse("review:queue")).content.decode()
    client.force_login(admin_user)
    assert f'href="{PAGE}"' in client.get(reverse("review:queue")).content.decode()


# --- what the page shows ---------------------------------------------------------------------


@pytest.mark.django_db
def test_policies_are_listed_most_specific_first_with_their_days(admin_client, admin_user):
    for pattern, tenant in [("articles.*", ""), ("articles.create", ""), ("*", "acme")]:
        retention.set_policy(pattern, tenant=tenant, purge_after_days=40, redact_after_days=7,
                             keep_events_days=50, user=admin_user)
    response = admin_client.get(PAGE)
    assert [(p.policy.pattern, p.policy.tenant) for p, _ in response.context["rows"]] == [
        ("*", "acme"), ("articles.create", ""), ("articles.*", ""), ("*", "")]
    body = response.content.decode()
    assert body.index("articles.create") < body.index("articles.*")
    assert "40 d" in body and "7 d" in body and "50 d" in body


@pytest.mark.django_db
@pytest.mark.parametrize("extra_policies", [0, 6])
def test_retention_page_runs_a_fixed_number_of_queries(admin_client, admin_user, extra_policies,
                                                       django_assert_num_queries):
    for n in range(extra_policies):
        retention.set_policy(f"service{n}.*", purge_after_days=30 + n, redact_after_days=5,
                             user=admin_user)
    for _ in range(3):
        complete_days_ago(OperationFactory(state=State.SUCCEEDED), 400)
    retention.purge(actor="cron", dry_run=True)
    # session, user, user perms, group perms, policies, the preview of every policy (one
    # statement), state policies and their preview (one statement), table sizes (one
    # statement), purge runs, state purge runs, policy changes
    with django_assert_num_queries(12):
        response = admin_client.get(PAGE)
    assert len(response.context["rows"]) == 1 + extra_policies
    assert response.context["rows"][-1][0].operations == 3


@pytest.mark.django_db
def test_the_page_shows_table_sizes_and_recent_purge_runs(admin_client):
    complete_days_ago(OperationFactory(state=State.SUCCEEDED), 400)
    retention.purge(actor="nightly-cron")
    response = admin_client.get(PAGE)
    body = response.content.decode()
    sizes = {t.table: t for t in response.context["tables"]}
    # one run of the operations' policy, one of each execution-state policy
    assert sizes["ledger_operation"].rows == 0 and sizes["ledger_purgerun"].rows == 5
    assert "ledger_operationevent" in body and " KB</td>" in body.replace("\xa0", " ")
    [run] = response.context["last_runs"]
    assert run.operations_purged == 1 and "nightly-cron" in body


@pytest.mark.django_db
def test_agent_and_admin_text_on_the_page_is_escaped(admin_client, admin_user):
    retention.set_policy("*", tenant="<script>alert(1)</script>", purge_after_days=30,
                         user=admin_user)
    retention.purge(actor="<img src=x onerror=alert(2)>", dry_run=True)
    body = admin_client.get(PAGE).content.decode()
    assert "<script>alert(1)" not in body and "&lt;script&gt;alert(1)" in body
    assert "<img src=x" not in body and "&lt;img src=x" in body


# --- writes through the page, and the audit rows they leave ----------------------------------


@pytest.mark.django_db
def test_adding_a_policy_through_the_page_writes_it_and_records_who(admin_client):
    response = admin_client.post(ADD, new_policy("mail.*", 30, tenant="acme", redact=7),
                                 follow=True)
    policy = RetentionPolicy.objects.get(pattern="mail.*", tenant="acme")
    assert (policy.purge_after_days, policy.redact_after_days, policy.keep_events_days) == (
        30, 7, 30)
    change = RetentionChange.objects.get(policy_id=policy.pk)
    assert (change.action, change.changed_by_name, change.before) == ("created", "admin", None)
    assert change.after["purge_after_days"] == 30
    body = response.content.decode()
    assert response.redirect_chain == [(PAGE, 302)]
    assert "Policy mail.* (acme): purge after 30 d, redact after 7 d, keep events 30 d." in body
    assert response.context["changes"][0] == change


@pytest.mark.django_db
def test_editing_a_policy_through_the_page_records_before_and_after(admin_client):
    policy = default_policy()
    response = admin_client.post(edit_url(policy), edited(policy, 200, redact=20, keep=300),
                                 follow=True)
    policy.refresh_from_db()
    assert (policy.purge_after_days, policy.redact_after_days, policy.keep_events_days) == (
        200, 20, 300)
    change = RetentionChange.objects.filter(policy_id=policy.pk).order_by("-id").first()
    assert (change.action, change.changed_by_name) == ("updated", "admin")
    assert (change.before["purge_after_days"], change.after["purge_after_days"]) == (365, 200)
    body = response.content.decode()
    assert "purge after 365 d, redact after 90 d, keep events 365 d" in body  # before
    assert "purge after 200 d, redact after 20 d, keep events 300 d" in body  # after


@pytest.mark.django_db
def test_deleting_a_policy_through_the_page_removes_it_and_records_what_it_was(admin_client,
                                                                               admin_user):
    policy = retention.set_policy("mail.*", purge_after_days=30, user=admin_user)
    response = admin_client.post(delete_url(policy), follow=True)
    assert not RetentionPolicy.objects.filter(pk=policy.pk).exists()
    change = RetentionChange.objects.order_by("-id").first()
    assert (change.action, change.policy_id, change.after) == ("deleted", policy.pk, None)
    assert change.before["pattern"] == "mail.*"
    assert "Deleted policy mail.* (every tenant)." in response.content.decode()


@pytest.mark.django_db
def test_an_htmx_write_returns_the_fresh_retention_fragment(admin_client):
    response = admin_client.post(ADD, new_policy("mail.send", 12),
                                 headers={"HX-Request": "true"})
    body = response.content.decode()
    assert response.status_code == 200
    assert body.lstrip().startswith('<section id="retention"') and "<html" not in body
    assert "mail.send" in body and "Policy mail.send (every tenant)" in body


@pytest.mark.django_db
def test_the_default_policy_cannot_be_deleted_and_the_page_says_why(admin_client):
    policy = default_policy()
    before = written()
    response = admin_client.post(delete_url(policy), follow=True)
    assert written() == before
    body = response.content.decode()
    assert "Nothing deleted: expected a policy other than the default" in body
    assert f'action="{delete_url(policy)}"' not in body  # no delete button offered
    htmx = admin_client.post(delete_url(policy), headers={"HX-Request": "true"})
    assert htmx.status_code == 422 and "expected a policy other than the default" in (
        htmx.content.decode())
    assert written() == before


@pytest.mark.django_db
@pytest.mark.parametrize("form, message", [
    (new_policy("articles create", 30), "expected a pattern of operation-name characters"),
    # the ledger's argument names become the form's labels
    (new_policy("articles.*", 0), "expected “Purge after (days)” to be a whole number of "
                                  "days from 1 to 36500, found 0"),
    (new_policy("articles.*", 10, redact=20), "expected “Redact after (days)” at most "
                                              "“Purge after (days)” (10), found 20"),
    (new_policy("articles.*", 10, keep=99999),
     "expected “Keep events (days)” to be a whole number"),
    (new_policy("articles.*", 10, tenant="t" * 101), "expected tenant to be a tenant name"),
    (new_policy("articles.*", "ten"), "Purge after (days): expected a whole number of days."),
    (new_policy("", 10), "Operation pattern: expected a glob"),
])
def test_bad_input_shows_the_clear_message_and_writes_nothing(admin_client, form, message):
    before = written()
    response = admin_client.post(ADD, form)
    assert response.status_code == 422
    body = response.content.decode()
    assert "Nothing written: " in body and message in body
    assert written() == before
    # What the admin typed is shown again, to correct.
    assert response.context["new_form"].data["new-pattern"] == form["new-pattern"]


@pytest.mark.django_db
def test_a_bad_edit_shows_the_ledgers_message_keeps_the_form_open_and_writes_nothing(
        admin_client):
    policy = default_policy()
    before = written()
    response = admin_client.post(edit_url(policy), edited(policy, 30, redact=60),
                                 headers={"HX-Request": "true"})
    assert response.status_code == 422
    body = response.content.decode()
    assert ("expected “Redact after (days)” at most “Purge after (days)” (30), found 60"
            in body)
    assert "<details open>" in body and 'value="60"' in body
    assert written() == before


@pytest.mark.django_db
def test_writing_to_a_policy_someone_deleted_says_so_and_writes_nothing(admin_client,
                                                                        admin_user):
    policy = retention.set_policy("mail.*", purge_after_days=30, user=admin_user)
    retention.delete_policy(policy, user=admin_user)
    before = written()
    body = admin_client.post(edit_url(policy), edited(policy, 5), follow=True).content.decode()
    assert f"expected retention policy #{policy.pk}, found none" in body
    admin_client.post(delete_url(policy))
    assert written() == before


# --- the preview is what the purge does -------------------------------------------------------


@pytest.mark.django_db
def test_preview_counts_on_the_page_match_what_a_purge_then_does(admin_client, admin_user):
    retention.set_policy("*", purge_after_days=30, redact_after_days=10, user=admin_user)
    retention.set_policy("mail.*", purge_after_days=5, user=admin_user)
    retention.set_policy("articles.*", tenant="acme", purge_after_days=100,
                         redact_after_days=50, user=admin_user)
    aged = [
        ("articles.create", "default", State.SUCCEEDED, 40),   # purged by *
        ("articles.create", "default", State.REJECTED, 20),    # redacted by *
        ("articles.create", "default", State.ABANDONED, 5),    # too young for anything
        ("mail.send", "default", State.ABANDONED, 6),          # purged by mail.*
        ("mail.send", "default", State.SUCCEEDED, 4),          # too young
        ("articles.create", "acme", State.SUCCEEDED, 120),     # purged by articles.* (acme)
        ("articles.create", "acme", State.SUCCEEDED, 60),      # redacted by articles.* (acme)
        ("articles.create", "default", State.OUTCOME_UNKNOWN, 400),  # never: not terminal
        ("articles.create", "default", State.MANUAL_REVIEW, 400),    # never: not terminal
    ]
    now = timezone.now()
    for name, tenant, state, days in aged:
        complete_days_ago(OperationFactory(operation=name, tenant=tenant, state=state), days,
                          now=now)

    response = admin_client.get(PAGE)
    shown = {(p.policy.pattern, p.policy.tenant): p for p, _ in response.context["rows"]}
    body = response.content.decode()
    for previewed in shown.values():
        row = body[body.index(f'<tr id="policy-{previewed.policy.pk}">'):]
        row = row[: row.index("</tr>")]
        assert f"<b>{previewed.operations}</b> operation" in row
        assert f"{previewed.events} event" in row
        assert f"<b>{previewed.redactions}</b> operation" in row
    assert {key: (p.operations, p.redactions) for key, p in shown.items()} == {
        ("*", ""): (1, 1), ("mail.*", ""): (1, 0), ("articles.*", "acme"): (1, 1)}

    result = retention.purge(actor="test")

    runs = {(r.policy_snapshot["pattern"], r.policy_snapshot["tenant"]): r for r in result.runs}
    assert runs.keys() == shown.keys()
    for key, previewed in shown.items():
        run = runs[key]
        assert (run.operations_purged, run.events_purged, run.evidence_purged,
                run.operations_redacted) == (previewed.operations, previewed.events,
                                             previewed.evidence, previewed.redactions), key
    assert PurgeRun.objects.filter(dry_run=False, state_policy=None).count() == 3
    # After the purge the page previews nothing more to do, and lists the runs.
    after = admin_client.get(PAGE).context
    assert all((p.operations, p.redactions) == (0, 0) for p, _ in after["rows"])
    assert {r.pk for r in after["last_runs"]} == {r.pk for r in result.runs}


@pytest.mark.django_db(transaction=True)
def test_the_page_preview_matches_a_purge_whose_batches_really_commit(client):
    ensure_roles()  # a flush by an earlier transactional test removes the groups
    admin = UserFactory(username="admin", role="admin")
    client.force_login(admin)
    client.post(ADD, new_policy("*", 30, redact=10))
    assert RetentionPolicy.objects.get(pattern="*", tenant="").redact_after_days == 10
    for state, days in [(State.SUCCEEDED, 31), (State.REJECTED, 45), (State.ABANDONED, 12),
                        (State.SUCCEEDED, 2), (State.OUTCOME_UNKNOWN, 90)]:
        complete_days_ago(OperationFactory(state=state), days)
    [(previewed, _)] = client.get(PAGE).context["rows"]
    assert (previewed.operations, previewed.redactions) == (2, 1)

    [run] = retention.purge(actor="test", batch=1).runs

    assert (run.operations_purged, run.events_purged, run.evidence_purged,
            run.operations_redacted) == (previewed.operations, previewed.events,
                                         previewed.evidence, previewed.redactions)
    [(after, _)] = client.get(PAGE).context["rows"]
    assert (after.operations, after.redactions) == (0, 0)


# --- execution state's policies ----------------------------------------------------------


@pytest.mark.django_db
def test_admins_set_execution_state_policies_on_the_page_and_others_cannot(client, admin_user):
    from ledger.models import StateRetentionPolicy

    episodes_policy = StateRetentionPolicy.objects.get(kind="episodes", tenant="")
    edit = reverse("review:retention_state_edit", args=[episodes_policy.pk])
    add = reverse("review:retention_state_add")
    new = {"new-state-kind": "facts", "new-state-tenant": "acme",
           "new-state-purge_after_days": "30"}
    state = lambda: sorted(StateRetentionPolicy.objects.values_list(  # noqa: E731
        "kind", "tenant", "purge_after_days"))
    before = (state(), RetentionChange.objects.count())
    client.force_login(UserFactory(username="reviewer", role="reviewer"))
    assert client.post(add, new).status_code == 403
    assert client.post(edit, {f"state-{episodes_policy.pk}-purge_after_days": "7"}
                       ).status_code == 403
    assert (state(), RetentionChange.objects.count()) == before

    client.force_login(admin_user)
    page = client.get(PAGE)
    assert [(p.kind, n) for p, n, _ in page.context["state_rows"]] == [
        ("coverage", 0), ("episodes", 0), ("facts", 0), ("obligations", 0)]
    assert "Settled obligations" in page.content.decode()
    assert '<option value="coverage">Coverage readings</option>' in page.content.decode()
    bad = client.post(edit, {f"state-{episodes_policy.pk}-purge_after_days": "0"})
    assert bad.status_code == 422 and "Nothing written" in bad.content.decode()
    assert client.post(edit, {f"state-{episodes_policy.pk}-purge_after_days": "7"}
                       ).status_code == 302
    assert client.post(add, new).status_code == 302
    acme = StateRetentionPolicy.objects.get(kind="facts", tenant="acme")
    assert state() == [("coverage", "", 90), ("episodes", "", 7), ("facts", "", 365),
                       ("facts", "acme", 30), ("obligations", "", 365)]
    body = client.get(PAGE).content.decode()
    assert "facts (acme)" in body and "purge after 30 d" in body
    assert client.post(reverse("review:retention_state_delete", args=[episodes_policy.pk])
                       ).status_code == 302  # refused: the message says why
    assert StateRetentionPolicy.objects.filter(pk=episodes_policy.pk).exists()
    assert client.post(reverse("review:retention_state_delete", args=[acme.pk])
                       ).status_code == 302
    assert [c.action for c in RetentionChange.objects.filter(
        state_policy_id__isnull=False).order_by("id")][-3:] == ["updated", "created", "deleted"]
