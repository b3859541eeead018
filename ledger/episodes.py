"""Episodes: the low-authority record of what was said during a run.

An episode is a message, a tool call or a chunk of transcript (or a reference to where it
is stored). It records talk, never what happened: receipts, facts and obligations do that,
and `runs.resume` never reads episodes. Append-only: PostgreSQL refuses UPDATE and DELETE.
"""

from __future__ import annotations

from django.db import transaction

from ledger import leases, runs, tracing
from ledger.canonical import scrub_text
from ledger.errors import InvalidInput
from ledger.inputs import (
    check_fencing_token,
    check_identifier,
    check_run_ref,
    check_string,
    storable,
)
from ledger.models import Episode, Run

MAX_CONTENT_CHARS = 1_000_000


@tracing.state_tool("episodes_record", tracing.episode_attributes)
def record(
    run: Run | str, role: str, *, content_ref: str = "", content: str | None = None,
    fencing_token: int | None = None,
) -> Episode:
    """Append an episode said by `role` ("user", "assistant", "tool", ...) to `run`.

    Give `content`, `content_ref` (where the full text is stored), or both. Credentials
    in either (`Bearer` values, `password=`, signed-URL parameters...) are masked before
    they are stored. Once the run is leased, StaleFencingToken unless `fencing_token` is
    the lease's current token (none, or an older one, is refused: a worker whose lease was
    taken over records nothing); a run never leased takes episodes without a token.
    PostgreSQL checks the token written with the episode (`episode_fenced`; for a call
    without a token it is the only check).
    """
    check_run_ref(run)
    check_fencing_token(fencing_token)
    check_identifier(role, "role", 50)
    content_ref = scrub_text(check_string(content_ref, "content_ref", 1000))
    if content is not None and not isinstance(content, str):
        raise InvalidInput(f"expected content to be a string or None, found "
                           f"{type(content).__name__}")
    if not content_ref.strip() and not content:
        raise InvalidInput("expected content or a content_ref, found neither")
    if content is not None and len(content) > MAX_CONTENT_CHARS:
        raise InvalidInput(
            f"expected content of at most {MAX_CONTENT_CHARS:,} characters, found "
            f"{len(content):,}; store it elsewhere and record a content_ref"
        )
    run = runs.as_run(run)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        if fencing_token is not None:
            leases.check_run(run.pk, fencing_token)
        # Without a token, the INSERT is the check (a round trip less on a run never leased):
        # episode_fenced refuses it on a leased run, as StaleFencingToken.
        return Episode.objects.create(
            run=run, tenant=run.tenant, role=role, content_ref=content_ref.strip(),
            fencing_token=fencing_token,
            # What was said is recorded as it was, only made storable.
            content=scrub_text(storable(content, MAX_CONTENT_CHARS))
            if content is not None else None,
        )
