"""A person corrects a fact on the desk (seed 003: "Can the person correct it?"): a new
version written as the reviewer, with the reason, superseding the agent's version; audited
as a FactDecision under the tenant's chain; what the agent reads afterwards."""

import json
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from ledger import chain, facts, runs
from ledger.errors import InvalidInput, PermissionDenied, StaleFact
from ledger.models import Fact, FactDecision, RecordLink
from tests.conftest import TEST_LOGINS
from tests.factories import UserFactory
from tests.ledger.test_verify_audit_tamper import verify_audit
from tests.support.processes import run_as

HOSTILE = "<img src=x onerror=alert(1)>"


def page(fact):
    return reverse("review:fact", args=[fact.pk])


def correct(client, fact, value, *, reason="confirmed with the customer by phone",
            version=None, follow=False, **extra):
    return client.post(reverse("review:correct_fact", args=[fact.pk]), {
        "value": json.dumps(value), "reason": reason,
        "version": fact.version if version is None else version, **extra}, follow=follow)


@pytest.mark.django_db
def test_a_reviewer_corrects_a_fact_and_the_agent_reads_the_persons_version(client, reviewer):
    agents = facts.assert_fact("customer:42", "email", "old@x.example", source="crm-agent")
    client.force_login(reviewer)
    body = client.get(page(agents)).content.decode()
    assert "Correct this fact" in body and "old@x.example" in body

    response = correct(client, agents, "ada@x.example", reason=f"the customer said so {HOSTILE}")
    written = Fact.objects.get(subject="customer:42", status="current")
    assert response.status_code == 302 and response["Location"] == page(written)
    assert (written.version, written.value, written.source) == (2, "ada@x.example",
                                                                "reviewer:reviewer")
    assert Fact.objects.get(pk=agents.pk).status == "superseded"
    decision = FactDecision.objects.get()
    assert (decision.conflict, decision.chosen_id, decision.written_id, decision.username,
            decision.reason) == (None, agents.pk, written.pk, "reviewer",
                                 f"the customer said so {HOSTILE}")
    # The agent reading afterwards sees the person's version as current.
    [read] = facts.read_facts("customer:42")
    assert (read.pk, read.value, read.source) == (written.pk, "ada@x.example",
                                                  "reviewer:reviewer")
    with pytest.raises(StaleFact):
        facts.require_current(agents)
    # The page shows both versions and the decision, escaped.
    body = client.get(page(written)).content.decode()
    assert "old@x.example" in body and "ada@x.example" in body
    assert "corrected version 1" in body and HOSTILE not in body
    assert "&lt;img src=x onerror=alert(1)&gt;" in body


@pytest.mark.django_db
def test_a_viewer_may_read_the_fact_but_not_correct_it(client, viewer):
    fact = facts.assert_fact("customer:43", "email", "a@x.example", source="crm-agent")
    client.force_login(viewer)
    body = client.get(page(fact)).content.decode()
    assert "a@x.example" in body and "Correct this fact" not in body
    assert "Your role cannot correct facts" in body
    assert correct(client, fact, "b@x.example").status_code == 403
    with pytest.raises(PermissionDenied):
        facts.correct_fact(fact, version=1, value="b@x.example", user=viewer, reason="no")
    assert list(Fact.objects.values_list("version", "value")) == [(1, "a@x.example")]
    assert not FactDecision.objects.exists()


@pytest.mark.django_db
def test_a_reviewer_of_another_tenant_gets_a_404_and_writes_nothing(
        client, other_tenant_reviewer):
    fact = facts.assert_fact("customer:44", "email", "a@x.example", source="crm-agent")
    client.force_login(other_tenant_reviewer)
    assert client.get(page(fact)).status_code == 404
    assert correct(client, fact, "b@x.example").status_code == 404
    with pytest.raises(PermissionDenied):
        facts.correct_fact(fact, version=1, value="b@x.example", user=other_tenant_reviewer,
                           reason="not mine")
    assert Fact.objects.count() == 1 and not FactDecision.objects.exists()


@pytest.mark.django_db
def test_a_correction_against_a_version_that_moved_on_records_nothing(client, reviewer):
    first = facts.assert_fact("customer:45", "plan", "gold", source="crm-agent")
    facts.assert_fact("customer:45", "plan", "silver", source="crm-agent", expected_version=1)
    client.force_login(reviewer)
    response = correct(client, first, "platinum", version=1, follow=True)
    body = response.content.decode()
    assert "Nothing recorded" in body and "now version 2" in body
    assert [f.value for f in Fact.objects.order_by("version")] == ["gold", "silver"]
    assert not FactDecision.objects.exists()


@pytest.mark.django_db
def test_correct_fact_takes_the_named_version_from_any_version_of_the_fact(reviewer):
    """The caller names the fact by any of its versions and the version the person saw;
    correct_fact finds that version itself."""
    first = facts.assert_fact("customer:48", "plan", "gold", source="crm-agent")
    second = facts.assert_fact("customer:48", "plan", "silver", source="crm-agent",
                               expected_version=1)
    written = facts.correct_fact(first, version=2, value="platinum", user=reviewer,
                                 reason="the contract says platinum")
    assert (written.version, written.value) == (3, "platinum")
    assert FactDecision.objects.get().chosen_id == second.pk
    with pytest.raises(StaleFact, match="expected version 1 of customer:48 plan") as moved:
        facts.correct_fact(second, version=1, value="bronze", user=reviewer, reason="late")
    assert moved.value.current.pk == written.pk
    assert FactDecision.objects.count() == 1


@pytest.mark.django_db
def test_correct_fact_refuses_a_version_the_fact_never_had(reviewer):
    fact = facts.assert_fact("customer:49", "plan", "gold", source="crm-agent")
    with pytest.raises(InvalidInput) as refused:
        facts.correct_fact(fact, version=7, value="silver", user=reviewer, reason="typo")
    assert str(refused.value) == "expected version 7 of customer:49 plan, found none"
    with pytest.raises(InvalidInput, match="expected version to be a version from 1"):
        facts.correct_fact(fact, version=True, value="silver", user=reviewer, reason="typo")
    assert Fact.objects.count() == 1 and not FactDecision.objects.exists()


@pytest.mark.django_db
def test_a_correction_naming_a_version_the_fact_never_had_records_nothing(client, reviewer):
    fact = facts.assert_fact("customer:50", "plan", "gold", source="crm-agent")
    client.force_login(reviewer)
    body = correct(client, fact, "silver", version=9, follow=True).content.decode()
    assert "Nothing recorded: expected version 9 of customer:50 plan, found none" in body
    assert Fact.objects.count() == 1 and not FactDecision.objects.exists()


@pytest.mark.django_db
def test_a_superseded_versions_page_corrects_the_version_the_form_names(client, reviewer):
    first = facts.assert_fact("customer:51", "plan", "gold", source="crm-agent")
    facts.assert_fact("customer:51", "plan", "silver", source="crm-agent", expected_version=1)
    client.force_login(reviewer)
    response = correct(client, first, "platinum", version=2)
    written = Fact.objects.get(subject="customer:51", status="current")
    assert response.status_code == 302 and response["Location"] == page(written)
    assert (written.version, written.value) == (3, "platinum")


@pytest.mark.django_db
@pytest.mark.parametrize("data, says", [
    ({"value": "not json", "reason": "x"}, "Enter the corrected value as JSON"),
    ({"value": '"b"', "reason": "  "}, "A reason is required"),
])
def test_a_bad_correction_form_is_shown_again_and_writes_nothing(client, reviewer, data, says):
    fact = facts.assert_fact("customer:46", "email", "a@x.example", source="crm-agent")
    client.force_login(reviewer)
    response = client.post(reverse("review:correct_fact", args=[fact.pk]),
                           {**data, "version": 1})
    assert response.status_code == 422 and says in response.content.decode()
    assert Fact.objects.count() == 1


@pytest.mark.django_db
def test_a_correction_may_set_an_expiry_and_the_same_value_is_refused(client, reviewer):
    fact = facts.assert_fact("customer:47", "email", "a@x.example", source="crm-agent")
    client.force_login(reviewer)
    response = correct(client, fact, "a@x.example", follow=True)
    assert "Nothing recorded" in response.content.decode()
    at = (timezone.now() + timedelta(days=30)).replace(second=0, microsecond=0)
    response = correct(client, fact, "b@x.example", expires_at=at.strftime("%Y-%m-%d %H:%M"))
    assert response.status_code == 302
    written = Fact.objects.get(status="current")
    assert (written.value, written.expires_at) == ("b@x.example", at)


@pytest.mark.django_db
def test_the_run_page_links_each_fact_to_its_page(client, reviewer):
    run = runs.start("Reconcile", run_id="run-correct")
    fact = facts.assert_fact("invoice:9", "status", "sent", source="billing", run=run)
    client.force_login(reviewer)
    body = client.get(reverse("review:run", args=["run-correct"])).content.decode()
    assert page(fact) in body


@pytest.mark.django_db(transaction=True)
def test_a_correction_of_a_leased_runs_fact_is_linked_and_verify_audit_stays_intact():
    """The person's version of a leased run's fact (no lease token: the FactDecision in its
    transaction is what lets it through), linked by PostgreSQL like every fact, the decision
    sealed into the tenant's fact_decisions chain; verify_audit intact afterwards."""
    reviewer = UserFactory(username="rev-chain", role="reviewer")
    run = runs.start("ship", run_id="run-corrected")
    leased = runs.resume("run-corrected", worker="w1")
    fact = facts.assert_fact("order:50", "status", "paid", source="billing", run=run,
                             fencing_token=leased.token)
    written = facts.correct_fact(fact, version=1, value="refunded", user=reviewer,
                                 reason="the bank reversed it")
    assert (written.run_id, written.fencing_token, written.source) == (
        run.pk, None, "reviewer:rev-chain")
    assert RecordLink.objects.filter(source="fact", row_id=written.pk,
                                     action="insert").exists()
    assert RecordLink.objects.filter(source="fact_decision", action="insert").exists()
    chain.seal()
    assert FactDecision.objects.get().chain_seq is not None
    status, out, err = verify_audit()
    assert status == 0, (out, err)
    assert "audit trail intact" in out
    # The worker holding the lease reads the person's version.
    assert [f.value for f in facts.read_facts("order:50")] == ["refunded"]


@pytest.mark.django_db(transaction=True)
def test_as_the_desk_role_a_correction_is_written_and_as_the_agent_role_it_is_refused():
    """The correction from a child logged in as the desk's role goes through; the same call
    from the agent's role writes nothing (it may not write a person's decision)."""
    UserFactory(username="rev-roles", role="reviewer")
    fact = facts.assert_fact("order:51", "status", "paid", source="billing")
    code = f"""
from django.contrib.auth import get_user_model
from ledger import facts
from ledger.models import Fact
result = {{}}
try:
    written = facts.correct_fact(Fact.objects.get(pk={fact.pk}), version=1, value="refunded",
                                 user=get_user_model().objects.get(username="rev-roles"),
                                 reason="the bank reversed it")
    result["written"] = [written.version, written.source]
except Exception as exc:
    result["refused"] = f"{{type(exc).__name__}}: {{exc}}"
"""
    agent = run_as(TEST_LOGINS["agent"], code)
    assert "permission denied" in agent.get("refused", ""), agent
    assert Fact.objects.count() == 1 and not FactDecision.objects.exists()
    desk = run_as(TEST_LOGINS["desk"], code)
    assert desk == {"written": [2, "reviewer:rev-roles"]}, desk
    assert FactDecision.objects.get().username == "rev-roles"
