"""factory-boy factories. Operations are made through the ledger API, never as raw rows."""

from __future__ import annotations

from datetime import timedelta
from functools import cache

import factory
from django.contrib.auth.models import Group, User
from django.db import connection, transaction

from ledger import leases, receipts, states, transitions
from ledger.models import Operation, Run
from ledger.states import ActorKind, State


def machine_path(to_state: str) -> list[str]:
    """The shortest walk through `states.TRANSITIONS` from planned to `to_state` that takes
    no human decision (a factory has no reviewer): the states after planned, in order.
    Computed from the table, so a change of the table changes the paths with it.
    """
    came_from: dict[str, str] = {State.PLANNED: ""}
    frontier = [State.PLANNED.value]
    while frontier and to_state not in came_from:
        following = []
        for state in frontier:
            for target in states.targets(state):  # sorted: the same path on every run
                if target not in came_from and not states.is_human_only(state, target):
                    came_from[target] = state
                    following.append(target)
        frontier = following
    if to_state not in came_from:
        raise ValueError(
            f"expected a path from planned to {to_state!r} without a human decision, found none"
        )
    path = []
    while to_state != State.PLANNED:
        path.append(to_state)
        to_state = came_from[to_state]
    return path[::-1]


def actor_of(from_state: str, to_state: str) -> str:
    """Who makes a move in a factory's walk: the reconciler in and out of reconciling, the
    agent otherwise."""
    if State.RECONCILING in (from_state, to_state):
        return ActorKind.RECONCILER
    return ActorKind.AGENT


def reconciler_lease(op: Operation, worker: str | None = None) -> int:
    """A fresh token of the lease `reconcile:<operation_id>` for `worker` (by default
    `factory-<tenant>`; taken over when another holds it), as a reconciler holds it when it
    changes the operation."""
    worker = worker or f"factory-{op.tenant}"
    resource = f"reconcile:{op.operation_id}"
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("UPDATE ledger_lease SET expires_at = now() WHERE resource = %s",
                           [resource])
        return leases.acquire(resource, worker, timedelta(minutes=5))


def drive(op: Operation, to_state: str) -> Operation:
    """Walk `op` (in planned) along `machine_path` to `to_state`, one transition at a time,
    through the ledger's one writer of changes."""
    for state in machine_path(to_state):
        actor_kind = actor_of(op.state, state)
        # An agent's change of a leased run's operation carries the lease's current token,
        # a reconciler's the token of its lease on the operation (PostgreSQL checks both).
        token = (leases.current_token(op.run.lease_resource)
                 if op.run_id is not None and actor_kind == ActorKind.AGENT else None)
        if actor_kind == ActorKind.RECONCILER:
            token = reconciler_lease(op)
        with transaction.atomic():
            transitions._apply(op, state, actor_kind=actor_kind, fencing_token=token,
                               actor_id="factory", reason=f"test setup: to {state}")
    return op


class OperationFactory(factory.Factory):
    class Meta:
        model = Operation

    operation = "articles.create"
    target = "https://articles.example/api/articles"
    intent = factory.Sequence(lambda n: {"title": f"Article {n}", "body": "text"})
    tenant = "default"
    retry_policy = "if_absent_proven"
    idempotency_key = None
    run = None

    @classmethod
    def _create(cls, model_class, *, state=State.PLANNED, **kwargs):
        op = receipts.record_intent(
            kwargs.pop("operation"), kwargs.pop("target"), kwargs.pop("intent"), **kwargs
        )
        return drive(op, state)


class RunFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Run

    run_id = factory.Sequence(lambda n: f"run-{n:05d}")
    tenant = "default"
    objective = factory.Sequence(lambda n: f"Publish article batch {n}")


PASSWORD = "correct horse battery staple"


def hashed_password(raw: str) -> str:
    """`raw` hashed by the configured hasher, once a session per password and hasher: PBKDF2
    at Django's iterations costs about half a second, and a run makes about a thousand users.
    Logging in still checks the password with the real hasher."""
    from django.conf import settings

    return _hashed(raw, settings.PASSWORD_HASHERS[0])


@cache
def _hashed(raw: str, hasher: str) -> str:
    from django.contrib.auth.hashers import make_password

    return make_password(raw)


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        django_get_or_create = ["username"]
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = PASSWORD  # hashed once per distinct password by _adjust_kwargs

    @classmethod
    def _adjust_kwargs(cls, **kwargs):
        kwargs["password"] = hashed_password(kwargs["password"])
        return kwargs

    @factory.post_generation
    def role(self, create, extracted, **kwargs):
        if create and extracted:
            self.groups.add(Group.objects.get(name=extracted))

    @factory.post_generation
    def tenants(self, create, extracted, **kwargs):
        from ledger import access

        if create:
            for tenant in extracted if extracted is not None else ["default"]:
                access.grant(self, tenant)


def add_evidence(
    op: Operation,
    *,
    verdict: str,
    to_state: str | None = None,
    observed: dict | None = None,
    query: dict | None = None,
    reconciler: str = "articles.create",
    matched_by: str = "",
    detail: str = "",
):
    """What a reconciler would write: one Evidence row and an optional transition.

    Both in one transaction, through `transitions._apply` (the reconciler's own API, with
    its claim and lease, is not needed to set up a review-desk test); the transition's
    event seals the row, as `reconcile.settle` does. Without `to_state` the row has no
    event (verify_audit reports such a row). Returns the Evidence.
    """
    from django.utils import timezone

    from ledger.models import Evidence
    from ledger.reconcile import conflict_for

    observed = {} if observed is None else observed
    with transaction.atomic():
        row = Evidence.objects.create(
            operation=op, reconciler=reconciler, query=query or {"idempotency_key":
                                                                  op.idempotency_key},
            observed=observed, verdict=verdict, matched_by=matched_by, detail=detail,
            created_at=timezone.now(),
        )
        if to_state is not None:
            conflict = conflict_for(verdict, observed)
            transitions._apply(
                op, to_state, actor_kind=ActorKind.RECONCILER, actor_id="reconciler-test",
                fencing_token=reconciler_lease(op),
                reason=f"verdict {verdict}", evidence={"verdict": verdict},
                changes={"conflict": conflict} if conflict else None, evidence_row=row,
            )
        return row


def ensure_roles() -> None:
    """The role groups and their permissions (a flush after a transactional test empties
    them; the ledger's post_migrate receiver restores them, this is for tests that flush
    by other means)."""
    from ledger.roles import ensure_roles as restore

    restore()
