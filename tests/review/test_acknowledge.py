"""Acknowledge on the desk: a flagged terminal operation, a required reason, the audit."""

import pytest
from django.test import Client
from django.urls import reverse

from api.mcp import build_server
from ledger import agent_keys, receipts
from ledger.models import Operation, OperationEvent
from ledger.states import ActorKind
from review.templatetags.desk import operation_url
from tests.factories import UserFactory
from tests.support.loops import run_coroutine


def ack_url(op):
    return reverse("review:acknowledge", args=[op.operation_id])


def acknowledge(client, op, *, reason="intended: two posts", version=None, htmx=False):
    return client.post(ack_url(op), {"reason": reason,
                                     "version": op.version if version is None else version},
                       headers={"HX-Request": "true"} if htmx else {})


def twins(tenant="default"):
    """Two operations with one fingerprint that both succeeded: both flagged duplicate."""
    ops = []
    for key in ("k1", "k2"):
        op = receipts.record_intent("articles.create", "https://cms.example/a",
                                    {"title": "Launch", "body": "same"}, idempotency_key=key,
                                    tenant=tenant)
        receipts.mark_submitted(op)
        ops.append(receipts.mark_succeeded(op, external_id=f"art-{key}"))
    return [Operation.objects.get(pk=op.pk) for op in ops]


def flags():
    return sorted(Operation.objects.values_list("conflict", flat=True))


def human_events():
    return list(OperationEvent.objects.filter(actor_kind=ActorKind.HUMAN).order_by("id"))


@pytest.mark.django_db
def test_a_reviewer_is_offered_acknowledge_on_a_flagged_operation(client, reviewer):
    first, _ = twins()
    client.force_login(reviewer)
    body = client.get(operation_url(first)).content.decode()
    assert f'action="{ack_url(first)}"' in body and ">Acknowledge</button>" in body
    assert 'name="reason"' in body and "required" in body


@pytest.mark.django_db
def test_a_viewer_is_not_offered_it_and_a_forged_post_is_refused(client, viewer):
    first, second = twins()
    client.force_login(viewer)
    body = client.get(operation_url(first)).content.decode()
    assert "Acknowledge</button>" not in body and "cannot acknowledge" in body
    assert acknowledge(client, first).status_code == 403
    assert flags() == ["duplicate", "duplicate"] and human_events() == []


@pytest.mark.django_db
def test_another_tenants_operation_is_not_found(client, other_tenant_reviewer):
    first, _ = twins(tenant="globex")
    client.force_login(other_tenant_reviewer)
    assert client.get(operation_url(first)).status_code == 404
    assert acknowledge(client, first).status_code == 404
    assert flags() == ["duplicate", "duplicate"] and human_events() == []


@pytest.mark.django_db
def test_acknowledging_one_twin_takes_both_out_of_the_queue_with_audit_rows(client, reviewer):
    first, second = twins()
    client.force_login(reviewer)
    queue = client.get(reverse("review:queue")).content.decode()
    assert first.operation_id in queue and second.operation_id in queue

    response = acknowledge(client, first, reason="intended: two launch posts")
    assert response.status_code == 302 and response["Location"] == operation_url(first)
    assert flags() == ["", ""]
    page = client.get(response["Location"]).content.decode()
    assert "Recorded: conflict acknowledged" in page and "Acknowledge</button>" not in page
    assert "flag duplicate → none" in page  # on the timeline
    queue = client.get(reverse("review:queue")).content.decode()
    assert first.operation_id not in queue and second.operation_id not in queue

    events = human_events()
    assert [(e.operation_id, e.actor_id) for e in events] == [
        (first.pk, "reviewer"), (second.pk, "reviewer")]
    audit = client.get(reverse("review:audit"), {"actor": "reviewer"}).content.decode()
    assert "intended: two launch posts" in audit and f"with {first.operation_id}" in audit
    csv = b"".join(client.get(reverse("review:audit_csv"), {"actor": "reviewer"})
                   .streaming_content).decode()
    assert csv.count("acknowledged duplicate") == 2


@pytest.mark.django_db
def test_htmx_acknowledge_returns_the_fresh_decision_fragment(client, reviewer):
    first, _ = twins()
    client.force_login(reviewer)
    response = acknowledge(client, first, htmx=True)
    body = response.content.decode()
    assert response.status_code == 200
    assert body.lstrip().startswith('<section id="decision"') and "<html" not in body
    assert "Recorded: conflict acknowledged" in body and "Acknowledge</button>" not in body


@pytest.mark.django_db
def test_a_missing_reason_is_refused_and_writes_nothing(client, reviewer):
    first, _ = twins()
    client.force_login(reviewer)
    response = acknowledge(client, first, reason="  ", htmx=True)
    assert response.status_code == 422
    assert "A reason is required to acknowledge a conflict." in response.content.decode()
    assert flags() == ["duplicate", "duplicate"] and human_events() == []


@pytest.mark.django_db
def test_a_stale_form_is_told_who_settled_it_first(client, reviewer):
    first, second = twins()
    alice = Client()
    alice.force_login(UserFactory(username="alice", role="reviewer"))
    acknowledge(alice, first, reason="alice checked the CMS")
    client.force_login(reviewer)
    response = acknowledge(client, second, version=second.version, reason="my own check")
    assert response.status_code == 409  # re-rendered: the reason typed is kept
    page = response.content.decode()
    assert "Your reason, not recorded: “my own check”" in page  # no form left to keep it
    assert ("Nothing recorded: alice (human) already changed the conflict flag of this "
            "operation") in page
    assert "alice checked the CMS" in page and "no longer flagged" in page
    assert [e.actor_id for e in human_events()] == ["alice", "alice"]


@pytest.mark.django_db
def test_csrf_is_required(reviewer):
    first, _ = twins()
    client = Client(enforce_csrf_checks=True)
    client.force_login(reviewer)
    assert acknowledge(client, first).status_code == 403
    assert flags() == ["duplicate", "duplicate"]


@pytest.mark.django_db
def test_agents_cannot_acknowledge_over_http_or_mcp(client, admin_user):
    first, _ = twins()
    _, secret = agent_keys.create("bot", tenants=["default"], user=admin_user)
    bearer = {"Authorization": f"Bearer {secret}"}
    url = f"/api/v1/operations/{first.operation_id}"
    assert client.get(url, headers=bearer).status_code == 200  # the key works
    assert client.post(f"{url}/acknowledge", {"reason": "x"}, headers=bearer,
                       content_type="application/json").status_code in (404, 405)
    schema = client.get("/api/v1/openapi.json").json()
    assert not [path for path in schema["paths"] if "acknowledge" in path]
    tools = run_coroutine(build_server().list_tools())
    assert not [tool.name for tool in tools if "acknowledge" in tool.name]
    assert flags() == ["duplicate", "duplicate"]


@pytest.mark.django_db
def test_acknowledging_a_pair_runs_a_fixed_number_of_queries(client, reviewer,
                                                             django_assert_num_queries):
    first, _ = twins()
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, operation; then the durable
    # block (a savepoint inside the test's transaction): the flagged set locked, one
    # statement per operation (the flag, its chain link and its event)
    with django_assert_num_queries(11):
        acknowledge(client, first)
