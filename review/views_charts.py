"""The overview: the queue's age distribution and the unknown-outcome rate per operation
over the last week, drawn server-side as inline SVG with the numbers in a table beside
each chart. Read-only; counts only the tenants the reviewer may see."""

from __future__ import annotations

from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from ledger.selectors import charts as chart_reads
from review import charts
from review.http import ledger_errors
from review.views import view_required


@require_GET
@view_required
@ledger_errors
def overview(request):
    now = timezone.now()
    ages = chart_reads.queue_age_distribution(request.user, now=now)
    rates = chart_reads.unknown_outcome_rates(request.user, now=now)
    context = {
        "ages": ages, "age_chart": charts.age_chart(ages),
        "age_table": [(label, [ages.count(kind, key) for kind in chart_reads.WAITING_KINDS],
                       sum(ages.count(kind, key) for kind in chart_reads.WAITING_KINDS))
                      for key, label, _ in chart_reads.AGE_BUCKETS],
        "kinds": [chart_reads.KIND_LABELS[kind] for kind in chart_reads.WAITING_KINDS],
        "rates": rates, "rate_chart": charts.rate_chart(rates),
    }
    return render(request, "review/overview.html", context)
