"""A simulated agent: a three-call task that may be killed anywhere and restarted.

`publish_articles` creates one article per step through the ledger: record the intent
(key derived from run and step), submit, send, record the answer, all fenced by the run's
lease. Restarted after a crash it takes a new lease (older tokens become stale), skips
steps that succeeded, turns a step its dead predecessor left `submitted` into
`outcome_unknown` (only a read can tell whether it took effect), resends a step the
reconciler proved absent (`safe_to_retry`, same key), and stops at the first step it cannot
finish, so the next run picks up where the reconciler left it.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from datetime import timedelta

from demo.simulated.articles import ArticleRejected, ArticlesClient, ServiceError
from ledger import leases, receipts
from ledger.models import Run
from ledger.states import State

STEPS = ("draft", "review", "publish")
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, ServiceError)


def _no_pause(step: str, point: str) -> None:
    return None


def publish_articles(
    run_id: str,
    base_url: str,
    *,
    titles: tuple[str, ...] = ("Draft notes", "Reviewed notes", "Published notes"),
    tenant: str = "default",
    pause: Callable[[str, str], None] = _no_pause,
    lease_ttl: timedelta = timedelta(seconds=30),
    timeout: float = 5.0,
) -> dict[str, str]:
    """Run (or resume) the task; returns {step: state} for the steps it reached.

    `pause(step, point)` is called at every boundary: "after_record", "after_submit" (the
    receipt says submitted, nothing sent yet), "after_send" (the service answered, not yet
    recorded) and "after_succeed".
    """
    run, _ = Run.objects.get_or_create(
        run_id=run_id, defaults={"tenant": tenant, "objective": "publish three articles"}
    )
    owner = f"agent:{run_id}"
    token = leases.acquire(run.lease_resource, owner, lease_ttl)
    client = ArticlesClient(base_url, timeout=timeout)
    reached: dict[str, str] = {}
    try:
        for step, title in zip(STEPS, titles, strict=True):
            op = _do_step(run, step, title, client, token, pause)
            reached[step] = op.state
            if op.state != State.SUCCEEDED:
                break
    finally:
        leases.release(run.lease_resource, owner, token)
    return reached


def _do_step(run, step, title, client, token, pause):
    intent = {"title": title, "body": f"{title}: body", "headers": {"Authorization": "Bearer x"}}
    op = receipts.record_intent(
        "articles.create", client.articles_url, intent, tenant=run.tenant, run=run,
        idempotency_key=receipts.idempotency_key(run.run_id, step), actor=f"agent:{run.run_id}",
    )
    pause(step, "after_record")
    if op.state == State.SUBMITTED:
        # Sent by a previous incarnation that died before recording the answer.
        return receipts.mark_outcome_unknown(
            op, error_code="SenderRestarted",
            detail="the agent restarted and found this call submitted without an answer",
            fencing_token=token,
        )
    if op.state not in (State.PLANNED, State.SAFE_TO_RETRY):
        return op
    try:
        with receipts.submit(op, rejections=(ArticleRejected,), fencing_token=token) as attempt:
            pause(step, "after_submit")
            answer = client.create(title=intent["title"], body=intent["body"],
                                   idempotency_key=op.idempotency_key)
            pause(step, "after_send")
            attempt.succeeded(external_id=answer["id"])
    except (ArticleRejected, *TRANSPORT_ERRORS):
        return attempt.op
    pause(step, "after_succeed")
    return attempt.op
