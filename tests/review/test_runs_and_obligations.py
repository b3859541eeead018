"""The run page and the overdue obligations in the queue."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from ledger import episodes, facts, obligations, runs
from tests.factories import OperationFactory
from tests.review.execution_setup import busy_run, make_conflict, make_overdue

OVERDUE = reverse("review:overdue")
HOSTILE = "<img src=x onerror=alert(1)>"


def run_url(run_id):
    return reverse("review:run", args=[run_id])


@pytest.mark.django_db
def test_overdue_lists_open_obligations_past_deadline_linked_to_their_run(client, reviewer):
    run = runs.start("Send the welcome mails", run_id="run-mail")
    late = make_overdue(run, key="mail:late", hours_late=5)
    later = make_overdue(run, key="mail:later", hours_late=1)
    obligations.open(run, "email.send", "mail:future",
                     deadline=timezone.now() + timedelta(hours=2))
    done = make_overdue(run, key="mail:done")
    obligations.commit(done.key, {"sent": True})
    client.force_login(reviewer)
    response = client.get(OVERDUE)
    assert [o.key for o in response.context["page"].items] == [late.key, later.key]
    body = response.content.decode()
    assert "mail:future" not in body and "mail:done" not in body
    assert run_url("run-mail") in body and "5 h" in body


@pytest.mark.django_db
def test_the_queue_counts_overdue_obligations_of_granted_tenants(client, reviewer):
    make_overdue(runs.start("a", run_id="run-a"), key="k1")
    make_overdue(runs.start("b", run_id="run-b"), key="k2")
    make_overdue(runs.start("c", run_id="run-c", tenant="acme"), key="k3")
    client.force_login(reviewer)
    body = client.get(reverse("review:queue")).content.decode()
    assert '<b data-count="overdue_obligations">2</b>' in body
    overdue = client.get(OVERDUE).content.decode()
    # the key as the page shows it (a bare "k3" could turn up inside a CSRF token)
    assert 'title="k1"' in overdue and 'title="k3"' not in overdue


@pytest.mark.django_db
def test_keyset_pages_of_overdue_obligations_cover_each_once(client, reviewer):
    run = runs.start("many", run_id="run-many")
    made = [make_overdue(run, key=f"k{n}", hours_late=10 - n) for n in range(5)]
    client.force_login(reviewer)
    seen, cursor = [], ""
    while True:
        page = client.get(OVERDUE, {"per_page": 2, "cursor": cursor}).context["page"]
        seen += [o.key for o in page.items]
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert seen == [o.key for o in made]


@pytest.mark.django_db
@pytest.mark.parametrize("per_page", [1, 50])
def test_the_overdue_list_runs_a_fixed_number_of_queries(client, reviewer, per_page,
                                                         django_assert_num_queries):
    for n in range(4):
        make_overdue(runs.start("r", run_id=f"run-{n}"), key=f"k{n}")
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, the page, two capped counts
    with django_assert_num_queries(8):
        response = client.get(OVERDUE, {"per_page": per_page})
    assert len(response.context["page"].items) == min(per_page, 4)


@pytest.mark.django_db
def test_the_run_page_shows_objective_steps_operations_obligations_facts_episodes_and_lease(
    client, reviewer
):
    run, made = busy_run()
    client.force_login(reviewer)
    response = client.get(run_url(run.run_id))
    body = response.content.decode()
    assert "Ship order 7 once the payment clears" in body
    steps = {s.step_id: s for s in response.context["detail"].steps}
    assert (steps["pay"].state, steps["ship"].state) == ("committed", "pending")
    assert "ship" in body and "pay <span class=\"muted\">(committed)</span>" in body
    for op in (made["paid"], made["shipping"]):
        assert reverse("review:operation", args=[op.operation_id]) in body
    assert "badge-outcome_unknown" in body and "badge-succeeded" in body
    assert "run-ship-7:email" in body and "run-ship-7:invoice" in body
    assert "INV-7" in body and "Committed" in body
    [fact] = response.context["detail"].facts
    assert (fact.subject, fact.version, fact.source) == ("order:7", 1, "bank-feed")
    assert fact.observed_at.strftime("%Y-%m-%d %H:%M:%S") in body
    assert "Payment cleared; booking the courier next." in body
    assert "held by <span class=\"mono\">worker-a</span>" in body
    assert f"fencing token <b class=\"mono\">{made['token']}</b>" in body
    assert "run:default:run-ship-7" in body


@pytest.mark.django_db
def test_the_run_page_says_when_the_lease_expired_and_when_none_was_taken(client, reviewer):
    from ledger import leases

    idle = runs.start("Nobody worked on this", run_id="run-idle")
    client.force_login(reviewer)
    assert "never taken" in client.get(run_url(idle.run_id)).content.decode()
    leases.acquire(idle.lease_resource, "worker-b", timedelta(microseconds=1))
    body = client.get(run_url(idle.run_id)).content.decode()
    assert "worker-b" in body and "expired" in body


@pytest.mark.django_db
def test_the_run_page_escapes_agent_written_text(client, reviewer):
    run = runs.start(f"Objective {HOSTILE}", run_id="run-hostile")
    episodes.record(run, "assistant", content=HOSTILE)
    facts.assert_fact("doc:1", "title", HOSTILE, source=HOSTILE, run=run)
    client.force_login(reviewer)
    body = client.get(run_url(run.run_id)).content.decode()
    assert HOSTILE not in body and body.count("&lt;img src=x onerror=alert(1)&gt;") >= 3


@pytest.mark.django_db
def test_the_run_page_links_the_open_conflicts_of_its_writes(client, reviewer):
    run = runs.start("Reconcile", run_id="run-rec")
    conflict = make_conflict(run=run)
    client.force_login(reviewer)
    body = client.get(run_url(run.run_id)).content.decode()
    assert reverse("review:conflict", args=[conflict.pk]) in body


@pytest.mark.django_db
@pytest.mark.parametrize("extra_rows", [0, 6])
def test_the_run_page_runs_a_fixed_number_of_queries(client, reviewer, extra_rows,
                                                     django_assert_num_queries):
    run, _ = busy_run(extra_rows=extra_rows)
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants; run, episodes, lease, steps
    # and their dependencies, operations, obligations, facts, open conflicts
    with django_assert_num_queries(14):
        client.get(run_url(run.run_id))


@pytest.mark.django_db
def test_htmx_request_gets_only_the_records_fragment(client, reviewer):
    run, _ = busy_run()
    client.force_login(reviewer)
    body = client.get(run_url(run.run_id), headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<div class="detail" id="records"') and "<html" not in body


@pytest.mark.django_db
def test_a_run_id_with_a_slash_still_has_a_page(client, reviewer):
    runs.start("nested", run_id="team/run-1")
    client.force_login(reviewer)
    assert client.get(run_url("team/run-1")).status_code == 200


@pytest.mark.django_db
def test_operation_detail_and_queue_rows_link_the_operations_run(client, reviewer):
    run = runs.start("Publish", run_id="run-pub")
    op = OperationFactory(state="outcome_unknown", run=run)
    alone = OperationFactory(state="outcome_unknown")
    client.force_login(reviewer)
    detail = client.get(reverse("review:operation", args=[op.operation_id])).content.decode()
    assert f'href="{run_url("run-pub")}?tenant=default"' in detail
    queue = client.get(reverse("review:queue")).content.decode()
    assert queue.count(f'href="{run_url("run-pub")}?tenant=default"') == 1
    assert alone.operation_id in queue


@pytest.mark.django_db
def test_runs_of_one_id_in_two_tenants_each_open_from_a_link_naming_the_tenant(client, reviewer):
    from ledger import access

    access.grant(reviewer, "acme")
    runs.start("Ours", run_id="run-1")
    theirs = runs.start("Theirs", tenant="acme", run_id="run-1")
    obligations.open(theirs, "refund", "refund-1", deadline=timezone.now() - timedelta(hours=1))
    client.force_login(reviewer)
    link = f"{run_url('run-1')}?tenant=acme"
    assert link in client.get(reverse("review:overdue")).content.decode()
    assert "Theirs" in client.get(link).content.decode()
    assert "Ours" in client.get(f"{run_url('run-1')}?tenant=default").content.decode()
    assert client.get(run_url("run-1")).status_code == 400  # which one? name the tenant
