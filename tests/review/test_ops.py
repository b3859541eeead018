"""/healthz and /metrics: no login, their answers, the metrics token, cheap scrapes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from ledger import health, metrics
from ledger.states import State
from tests.factories import OperationFactory

TOKEN = "metrics-token-0123456789abcdef"


@pytest.mark.django_db
def test_healthz_answers_200_with_every_check_and_needs_no_login(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert "no-store" in response["Cache-Control"]
    body = response.json()
    assert body["status"] == "ok"
    assert list(body["checks"]) == ["database", "migrations", "reconcile_backlog",
                                   "sealer_lag"]
    assert all(check["ok"] for check in body["checks"].values())


@pytest.mark.django_db
def test_healthz_answers_503_naming_the_migration_that_is_not_applied(client):
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM django_migrations WHERE app = 'ledger'"
                       " ORDER BY name DESC LIMIT 1")
        latest = cursor.fetchone()[0]
        cursor.execute("DELETE FROM django_migrations WHERE app = 'ledger' AND name = %s",
                       [latest])
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "fail"
    assert body["checks"]["migrations"]["ok"] is False
    assert f"ledger.{latest}" in body["checks"]["migrations"]["detail"]
    assert body["checks"]["database"]["ok"] is True


@pytest.mark.django_db
def test_a_late_reconcile_backlog_is_a_warning_that_keeps_the_process_in_service(
        client, settings):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    report = health.run(now=timezone.now() + timedelta(hours=1))
    backlog = {c.name: c for c in report.checks}["reconcile_backlog"]
    assert not backlog.ok and backlog.severity == "warning"
    assert 3590 < backlog.value < 3700 and "reconcile" in backlog.detail
    assert report.is_healthy and report.status == "warn"

    settings.LEDGER_HEALTH_RECONCILE_BACKLOG_SECONDS = 0
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json()["status"] == "warn"


@pytest.mark.django_db
def test_a_registered_check_is_run_and_a_failed_critical_one_answers_503(client):
    def sealer(now):
        return health.Check("sealer", False, "critical", "expected a sealer, found none")

    health.register(sealer)
    try:
        response = client.get("/healthz")
    finally:
        health.CHECKS.remove(sealer)
    assert response.status_code == 503
    assert response.json()["checks"]["sealer"]["detail"] == "expected a sealer, found none"


@pytest.mark.django_db
def test_metrics_are_off_while_no_token_is_configured(client, settings):
    settings.LEDGER_METRICS_TOKEN = ""
    response = client.get("/metrics", headers={"Authorization": "Bearer anything"})
    assert response.status_code == 404
    assert response["Content-Type"] == "application/problem+json"
    assert "LEDGER_METRICS_TOKEN" in response.json()["detail"]


@pytest.mark.django_db
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer"])
def test_metrics_refuse_a_request_without_the_token(client, settings, header):
    settings.LEDGER_METRICS_TOKEN = TOKEN
    headers = {"Authorization": header} if header else {}
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert response["Content-Type"] == "application/problem+json"
    assert TOKEN not in response.content.decode()


@pytest.mark.django_db
def test_metrics_count_operations_by_tenant_and_state_and_the_queues(client, settings):
    settings.LEDGER_METRICS_TOKEN = TOKEN
    for _ in range(2):
        OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    OperationFactory(state=State.MANUAL_REVIEW, tenant="default")
    OperationFactory(state=State.SUCCEEDED, tenant="default")
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    text = response.content.decode()
    assert 'ledger_operations{state="outcome_unknown",tenant="acme"} 2.0' in text
    assert 'ledger_operations{state="manual_review",tenant="default"} 1.0' in text
    assert 'state="succeeded"' not in text  # terminal states: only the table estimate
    assert "ledger_operations_estimated_rows " in text
    # In the window: acme sent 2, both unknown; default sent 2, one went through unknown
    # (on its way to manual_review).
    assert 'ledger_submitted_recent{tenant="acme"} 2.0' in text
    assert 'ledger_outcome_unknown_ratio{tenant="acme"} 1.0' in text
    assert 'ledger_outcome_unknown_ratio{tenant="default"} 0.5' in text
    assert "ledger_reconcile_due_operations 2.0" in text
    assert 'ledger_oldest_waiting_seconds{queue="manual_review"}' in text


@pytest.mark.django_db
def test_a_scrape_runs_the_same_few_queries_whatever_the_data(django_assert_num_queries):
    now = timezone.now()
    with django_assert_num_queries(10):
        metrics.render(now=now)
    for tenant in ("a", "b", "c"):
        for state in (State.OUTCOME_UNKNOWN, State.MANUAL_REVIEW, State.SUBMITTED):
            OperationFactory(state=state, tenant=tenant)
    with django_assert_num_queries(10):
        text = metrics.render(now=timezone.now()).decode()
    assert text.count("ledger_operations{") == 9


@pytest.mark.django_db
def test_healthz_runs_one_query_per_check(client, django_assert_num_queries):
    health.run()  # the migration graph is read from disk once per process
    with django_assert_num_queries(4):
        assert client.get("/healthz").status_code == 200


@pytest.mark.django_db
def test_a_registered_collector_appears_in_the_scrape():
    from prometheus_client.core import GaugeMetricFamily

    def example_lag(now):
        yield GaugeMetricFamily("ledger_example_lag_seconds", "test", value=1.5)

    metrics.register(example_lag)
    try:
        assert "ledger_example_lag_seconds 1.5" in metrics.render().decode()
    finally:
        metrics.COLLECTORS.remove(example_lag)
