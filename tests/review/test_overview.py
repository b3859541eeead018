"""The overview's charts: the queue's ages and the unknown-outcome rate per operation,
drawn as inline SVG with the same numbers in a table."""

import re
from datetime import timedelta
from unittest import mock

import pytest
from django.template.loader import render_to_string
from django.test import RequestFactory
from django.urls import reverse
from django.utils import timezone

from ledger import approvals
from ledger.selectors.charts import OperationRate, UnknownOutcomeRates
from ledger.states import State
from review import charts
from tests.factories import OperationFactory, UserFactory

OVERVIEW = reverse("review:overview")


def made_at(moment, **kwargs):
    """An operation driven to its state with the ledger's clock reading `moment`."""
    with mock.patch("django.utils.timezone.now", return_value=moment):
        return OperationFactory(**kwargs)


def table_rows(body: str, table_id: str) -> list[list[str]]:
    table = body.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]
    body_part = table.split("<tbody>", 1)[1]
    return [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)
            for row in re.findall(r"<tr>(.*?)</tr>", body_part, re.S)]


@pytest.fixture
def known_dataset(db):
    now = timezone.now()
    for _ in range(2):
        made_at(now - timedelta(minutes=2), state=State.OUTCOME_UNKNOWN)
    made_at(now - timedelta(hours=3), state=State.MANUAL_REVIEW)
    made_at(now - timedelta(days=2), state=State.OUTCOME_UNKNOWN, operation="mail.send")
    for _ in range(3):
        made_at(now - timedelta(days=1), state=State.SUCCEEDED, operation="mail.send")
    made_at(now - timedelta(days=10), state=State.MANUAL_REVIEW)  # outside the week
    with mock.patch("django.utils.timezone.now", return_value=now - timedelta(hours=8)):
        approvals.request(OperationFactory(operation="payments.charge"))
    OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")  # not the reviewer's
    return now


@pytest.mark.django_db
def test_the_age_chart_and_its_table_give_the_numbers_of_a_known_queue(
        client, reviewer, known_dataset):
    client.force_login(reviewer)
    body = client.get(OVERVIEW).content.decode()
    rows = table_rows(body, "ages-table")
    # Waited | Outcome unknown | Manual review | Conflicting | Awaiting approval | All
    assert rows == [
        ["&lt; 5 min", "2", "0", "0", "0", "2"],
        ["5–60 min", "0", "0", "0", "0", "0"],
        ["1–6 h", "0", "1", "0", "0", "1"],
        ["6–24 h", "0", "0", "0", "1", "1"],
        ["1–7 d", "1", "0", "0", "0", "1"],
        ["&gt; 7 d", "0", "1", "0", "0", "1"],
    ]
    svg = body.split('<svg class="chart-svg"', 1)[1].split("</svg>", 1)[0]
    assert '<title id="ages-title">' in svg and "6 items waiting" in svg
    # one rect per non-empty (bucket, kind); the fullest bucket spans the plot
    counts = re.findall(r'class="kind-(\w+)" data-count="(\d+)"', svg)
    assert sorted(counts) == sorted([("outcome_unknown", "2"), ("manual_review", "1"),
                                     ("awaiting_approval", "1"), ("outcome_unknown", "1"),
                                     ("manual_review", "1")])
    widths = [float(w) for w in re.findall(r'width="([\d.]+)" height="16" class="kind-', svg)]
    plot = charts.WIDTH - charts.LABEL_WIDTH - charts.VALUE_WIDTH
    assert max(widths) == plot and min(widths) == plot / 2


@pytest.mark.django_db
def test_the_rate_chart_counts_submissions_and_unknown_outcomes_of_the_last_week(
        client, reviewer, known_dataset):
    client.force_login(reviewer)
    body = client.get(OVERVIEW).content.decode()
    rows = table_rows(body, "rates-table")
    # articles.create: 3 in the week (the 10-day-old one is outside), all unknown once;
    # mail.send: 4 submitted, 1 unknown; payments.charge: never submitted
    assert rows == [["articles.create", "3", "3", "100 %"],
                    ["mail.send", "4", "1", "25 %"]]
    assert "100 % (3/3)" in body and "25 % (1/4)" in body


@pytest.mark.django_db
def test_overview_runs_a_fixed_number_of_queries(client, reviewer, known_dataset,
                                                 django_assert_num_queries):
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, ages, awaiting approvals,
    # unknown-outcome rates
    with django_assert_num_queries(8):
        assert client.get(OVERVIEW).status_code == 200


@pytest.mark.django_db
def test_a_user_without_grants_sees_empty_charts(client, known_dataset):
    nobody = UserFactory(username="nobody", role="viewer", tenants=[])
    client.force_login(nobody)
    body = client.get(OVERVIEW).content.decode()
    assert all(row[-1] == "0" for row in table_rows(body, "ages-table"))
    assert "No call was submitted" in body


@pytest.mark.django_db
def test_operation_names_are_escaped_in_the_svg_and_the_table(reviewer):
    # The input gate refuses such names; the template must not rely on it.
    hostile = '<script>alert("x")</script>'
    rates = UnknownOutcomeRates(since=timezone.now(), days=7, more=False,
                                rows=[OperationRate(hostile, 4, 1)])
    request = RequestFactory().get(OVERVIEW)
    request.user = reviewer
    from ledger.selectors.charts import queue_age_distribution

    ages = queue_age_distribution(reviewer)
    body = render_to_string("review/overview.html", {
        "ages": ages, "age_chart": charts.age_chart(ages), "age_table": [], "kinds": [],
        "rates": rates, "rate_chart": charts.rate_chart(rates),
    }, request=request)
    assert "<script>alert" not in body
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in body


@pytest.mark.django_db
def test_the_queue_and_the_main_menu_lead_to_the_overview(client, reviewer):
    client.force_login(reviewer)
    body = client.get(reverse("review:queue")).content.decode()
    assert body.count(f'href="{OVERVIEW}"') == 2
