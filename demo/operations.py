"""Demo operations: simulated agents against the simulated articles service, reconciled.

`seed_operations` leaves a realistic mix: plain successes, rejections, timeouts after the
commit (reconciled to succeeded), lost requests (proven absent: safe_to_retry, or
manual_review under retry policy "never"), two operations with the same fingerprint that
both took effect, a lost request whose only look-alike was posted by hand under another
key during a key-index outage (ambiguous: manual_review), a crashed sender swept to
outcome_unknown, another not swept yet (stuck in submitted), one awaiting approval, and
some still outcome_unknown (reads inside the service's consistency window, and one not
looked at yet), and a few (DECIDE_BY_HAND) whose requests may still land for a day and stay
outcome_unknown while the demo runs, for a reviewer. Everything goes through the ledger API,
at moments from six days to minutes ago (`demo.clock.backdated`), so the desk shows
realistic ages.

Every operation names the articles service the running demo serves (Procfile.demo's
`articles`, `demo_articles_url`): the seed runs that service in-process, on its port, while
it writes, and leaves what its agents created in `demo_articles_file` for `demo_articles`
to start with. So the running demo's reconciler reads a live service that knows them: what
the seed left outcome_unknown settles by what the service holds (found: succeeded; a
request that never landed: proven absent), not by a closed port.
"""

from __future__ import annotations

import http.client
from collections import Counter
from datetime import timedelta

from django.utils import timezone

from demo.clock import backdated
from demo.simulated.articles import (
    HOST,
    ArticleRejected,
    ArticlesClient,
    ArticlesService,
    ServiceError,
    demo_articles_file,
    demo_articles_port,
    save_articles,
)
from ledger import approvals, leases, receipts, reconcile
from ledger.models import Operation, Run

WORKER = "demo-reconciler"
# Outcome unknown for as long as the demo runs, for a reviewer to settle by hand: (run,
# step, title), requests that may still land on the articles service within DELIVERY_WINDOW.
DECIDE_BY_HAND = [
    ("demo-newsroom", "corrections", "Corrections and clarifications"),
    ("demo-acme-blog", "case-study", "Case study: a year with Acme"),
    ("demo-newsroom", "opinion", "Opinion: keep the harbour open"),
]
DELIVERY_WINDOW = timedelta(days=1)
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, ServiceError)


def seed_operations(stdout) -> None:
    """Create the demo operations once; a second call finds them and changes nothing.

    The story is told in chapters from six days ago to a few minutes ago (`backdated`),
    oldest first, so the queue shows items that have waited minutes, hours and days."""
    if Run.objects.filter(run_id__startswith="demo-").exists():
        stdout.write("Demo operations exist already; left them as they are.")
        return
    service = _the_demos_service()
    try:
        agent = _Agent(service)
        with backdated(timedelta(days=6, hours=2)):
            newsroom = Run.objects.create(run_id="demo-newsroom", tenant="default",
                                          objective="Publish the morning newsroom articles")
            acme = Run.objects.create(run_id="demo-acme-blog", tenant="acme",
                                      objective="Cross-post the acme product blog")
            # Plain successes, rejections, timeouts after the commit (found: succeeded).
            for step, title in [("lead", "Harbour reopens after storm"),
                                ("weather", "Weekend weather: sun, then rain"),
                                ("sports", "Local club wins the cup")]:
                agent.send(newsroom, step, title)
            agent.send(acme, "launch", "Acme ships version 2")
            agent.send(newsroom, "untitled", "")  # 422: rejected, nothing created
            agent.send(acme, "bad-draft", " ")
            agent.send(newsroom, "markets", "Markets close higher", fault="drop_response")
            agent.send(newsroom, "traffic", "Bridge closed for repairs", fault="slow")
            agent.send(acme, "pricing", "New pricing for teams", fault="drop_response")
            reconcile.run_once(worker=WORKER)

        with backdated(timedelta(days=5, hours=4)):
            # Lost requests: proven absent, safe_to_retry (waiting for their agents ever
            # since), or manual_review under retry policy "never".
            agent.send(newsroom, "letters", "Letters to the editor", fault="lose_request")
            agent.send(acme, "changelog", "Changelog for March", fault="lose_request")
            agent.send(acme, "invoice-mail", "Invoice reminder", fault="lose_request",
                       retry_policy="never")
            reconcile.run_once(worker=WORKER)

        with backdated(timedelta(days=3, hours=1)):
            # Two operations, same content, both took effect (shown side by side).
            agent.send(newsroom, "digest", "Weekly digest")
            agent.send(newsroom, "digest-again", "Weekly digest")
            reconcile.run_once(worker=WORKER)

        with backdated(timedelta(days=1, hours=20)):
            # An outage of the service's key index: the reconciler matches content.
            service.key_lookup = False
            agent.send(newsroom, "obituary", "In memoriam: a town's baker",
                       fault="drop_response")
            # An editor posted the spring promotion by hand, under a key of their own, and
            # the agent's request was lost: the one match carries another key, so it may be
            # a twin made another way (ambiguous: a person decides).
            ArticlesClient(service.url).create(
                title="Spring promotion", body="Spring promotion: the full text.",
                idempotency_key="editor-posted-by-hand")
            agent.send(acme, "promo", "Spring promotion", fault="lose_request")
            reconcile.run_once(worker=WORKER)
            service.key_lookup = True

        with backdated(timedelta(hours=19)):
            # A sender that crashed after marking the call submitted, before sending it.
            _crashed_sender(newsroom, service, "night-desk", "Night desk summary")
            reconcile.sweep_stale_submissions(older_than=timedelta(0))
            reconcile.run_once(worker=WORKER)

        with backdated(timedelta(hours=5, minutes=10)):
            # Reads lag behind writes: these stay outcome_unknown, retried with backoff.
            service.read_lag = 3600
            agent.send(newsroom, "late-edition", "Late edition", fault="drop_response")
            agent.send(acme, "webinar", "Webinar next Tuesday", fault="slow")
            reconcile.run_once(worker=WORKER)

        with backdated(timedelta(hours=2, minutes=40)):
            # Another crash after "submitted"; no worker has swept it yet (the desk lists
            # it under "submitted > 1 h").
            _crashed_sender(newsroom, service, "evening-briefing", "Evening briefing")

        with backdated(timedelta(hours=1, minutes=25)):
            # A consequential call the agent may not make before a person approves it.
            _awaiting_approval(newsroom, service)

        with backdated(timedelta(minutes=25)):
            # The service's delivery queue may hold a request for up to a day: these were
            # lost on the way, and until that window ends the reconciler's reads prove
            # nothing (absent, but maybe still in flight). They stay outcome_unknown while
            # the demo runs: a person settles them.
            runs = {"demo-newsroom": newsroom, "demo-acme-blog": acme}
            for run_id, step, title in DECIDE_BY_HAND:
                agent.send(runs[run_id], step, title, fault="lose_request",
                           in_flight_for=DELIVERY_WINDOW)

        with backdated(timedelta(minutes=4)):
            # Timed out just now; no reconciler has looked at it yet.
            agent.send(acme, "newsletter", "April newsletter", fault="drop_response")
    finally:
        service.stop()
        # What the running demo's service starts with (`manage.py demo_articles`).
        save_articles(demo_articles_file(), service.side_effects())
    _report(stdout, len(service.side_effects()))


def _the_demos_service() -> ArticlesService:
    """The articles service the running demo serves, started in-process on its port (the
    seed runs before the demo: the port is free unless a demo is running)."""
    port = demo_articles_port()
    try:
        # The service reads the ledger's clock, so its replies tell the replayed time too.
        return ArticlesService(slow_seconds=0.6, clock=lambda: timezone.now(),
                               port=port).start()
    except OSError as exc:
        raise OSError(
            f"expected {HOST}:{port} free for the demo's articles service while the seed "
            f"writes, found {exc}: stop what serves it (a running demo), or set "
            "DEMO_ARTICLES_PORT") from exc


class _Agent:
    """A simulated agent: record the intent, submit, call the service, record the answer."""

    def __init__(self, service: ArticlesService):
        self.service = service

    def send(self, run: Run, step: str, title: str, *, fault: str | None = None,
             retry_policy: str = "if_absent_proven",
             in_flight_for: timedelta | None = None) -> Operation:
        """`in_flight_for`: how long the request may still land."""
        # The seed reconciles at once. A lost request never reached the in-process service
        # (it fails before any byte is sent), so no window is needed to trust its absence;
        # a real agent keeps the default window.
        if in_flight_for is None and fault == "lose_request":
            in_flight_for = timedelta(0)
        client = ArticlesClient(self.service.url, timeout=0.3 if fault == "slow" else 5.0)
        body = f"{title.strip() or 'Untitled'}: the full text."
        op = receipts.record_intent(
            "articles.create", client.articles_url,
            {"title": title, "body": body, "headers": {"Authorization": "Bearer demo-secret"}},
            tenant=run.tenant, run=run, idempotency_key=receipts.idempotency_key(run.run_id, step),
            retry_policy=retry_policy, actor=f"agent:{run.run_id}",
        )
        # The agent works under its run's lease: every change of a leased run's operation
        # carries the lease's current token (re-taking its own lease gives a fresh one).
        token = leases.acquire(run.lease_resource, f"agent:{run.run_id}", timedelta(seconds=30))
        try:
            with receipts.submit(op, rejections=(ArticleRejected,), fencing_token=token,
                                 in_flight_for=in_flight_for) as attempt:
                answer = client.create(title=title, body=body,
                                       idempotency_key=op.idempotency_key, fault=fault)
                attempt.succeeded(external_id=answer["id"])
        except (ArticleRejected, *TRANSPORT_ERRORS):
            pass
        return op


def _crashed_sender(run: Run, service: ArticlesService, step: str, title: str) -> None:
    token = leases.acquire(run.lease_resource, f"agent:{run.run_id}", timedelta(seconds=30))
    op = receipts.record_intent(
        "articles.create", service.articles_url,
        {"title": title, "body": "Never sent: the agent died."},
        tenant=run.tenant, run=run,
        idempotency_key=receipts.idempotency_key(run.run_id, step),
        actor=f"agent:{run.run_id}",
    )
    receipts.mark_submitted(op, fencing_token=token)
    leases.release(run.lease_resource, f"agent:{run.run_id}", token)  # ... and it died


def _awaiting_approval(run: Run, service: ArticlesService) -> None:
    op = receipts.record_intent(
        "articles.delete", service.articles_url,
        {"slug": "local-club-wins-the-cup", "why": "the club asked us to take it down"},
        tenant=run.tenant, run=run,
        idempotency_key=receipts.idempotency_key(run.run_id, "takedown"),
        actor=f"agent:{run.run_id}",
    )
    approvals.request(op, note="Deleting a published article: please confirm.",
                      actor=f"agent:{run.run_id}")


def _report(stdout, side_effects: int) -> None:
    states = Counter(
        Operation.objects.filter(run__run_id__startswith="demo-").values_list("state", flat=True)
    )
    summary = ", ".join(f"{state} {count}" for state, count in sorted(states.items()))
    stdout.write(f"Demo operations: {sum(states.values())} ({summary}); the simulated "
                 f"service created {side_effects} articles.")
