"""factory-boy factories. Operations are made through the ledger API, never as raw rows."""

from __future__ import annotations

import factory
from django.contrib.auth.models import Group, User
from django.db import transaction

from ledger import receipts
from ledger.models import Operation, Run
from ledger.states import ActorKind, State

# The shortest path through the state table to each state, from planned.
PATHS: dict[str, list[tuple[str, str]]] = {
    State.PLANNED: [],
    State.SUBMITTED: [(State.SUBMITTED, ActorKind.AGENT)],
    State.SUCCEEDED: [(State.SUBMITTED, ActorKind.AGENT), (State.SUCCEEDED, ActorKind.AGENT)],
    State.REJECTED: [(State.SUBMITTED, ActorKind.AGENT), (State.REJECTED, ActorKind.AGENT)],
    State.OUTCOME_UNKNOWN: [
        (State.SUBMITTED, ActorKind.AGENT), (State.OUTCOME_UNKNOWN, ActorKind.AGENT)
    ],
    State.RECONCILING: [
        (State.SUBMITTED, ActorKind.AGENT), (State.OUTCOME_UNKNOWN, ActorKind.AGENT),
        (State.RECONCILING, ActorKind.RECONCILER),
    ],
    State.MANUAL_REVIEW: [
        (State.SUBMITTED, ActorKind.AGENT), (State.OUTCOME_UNKNOWN, ActorKind.AGENT),
        (State.RECONCILING, ActorKind.RECONCILER), (State.MANUAL_REVIEW, ActorKind.RECONCILER),
    ],
    State.SAFE_TO_RETRY: [
        (State.SUBMITTED, ActorKind.AGENT), (State.OUTCOME_UNKNOWN, ActorKind.AGENT),
        (State.RECONCILING, ActorKind.RECONCILER), (State.SAFE_TO_RETRY, ActorKind.RECONCILER),
    ],
    State.ABANDONED: [(State.ABANDONED, ActorKind.AGENT)],
}


def drive(op: Operation, to_state: str) -> Operation:
    """Walk `op` (in planned) along PATHS to `to_state`, one API transition at a time."""
    for state, actor_kind in PATHS[to_state]:
        with transaction.atomic():
            receipts.apply_transition(op, state, actor_kind=actor_kind, actor_id="factory",
                                      reason=f"test setup: to {state}")
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


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        django_get_or_create = ["username"]
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("correct horse battery staple")

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
    """What a reconciler would write: an optional transition plus one Evidence row.

    Both in one transaction, through `receipts.apply_transition` (the reconciler's own API
    is not needed to set up a review-desk test). Returns the Evidence.
    """
    from django.utils import timezone

    from ledger.models import Evidence

    observed = {} if observed is None else observed
    with transaction.atomic():
        if to_state is not None:
            receipts.apply_transition(
                op, to_state, actor_kind=ActorKind.RECONCILER, actor_id="reconciler-test",
                reason=f"verdict {verdict}", evidence={"verdict": verdict},
            )
        return Evidence.objects.create(
            operation=op, reconciler=reconciler, query=query or {"idempotency_key":
                                                                  op.idempotency_key},
            observed=observed, verdict=verdict, matched_by=matched_by, detail=detail,
            created_at=timezone.now(),
        )


def ensure_roles() -> None:
    """Recreate the role groups of migration 0002_roles if a flush removed them.

    Transactional tests (`transaction=True`) end with a flush that empties every table,
    including the groups a data migration created; tests that run after one and need the
    roles call this first.
    """
    import importlib

    from django.apps import apps
    from django.contrib.auth.management import create_permissions
    from django.contrib.auth.models import Permission

    for app_config in apps.get_app_configs():
        create_permissions(app_config, verbosity=0)
    for name, codenames in _role_codenames(importlib).items():
        group, _ = Group.objects.get_or_create(name=name)
        group.permissions.set(
            Permission.objects.filter(content_type__app_label="ledger", codename__in=codenames)
        )


def _role_codenames(importlib) -> dict[str, set[str]]:
    """Each role's permissions as the migrations grant them: 0002_roles, 0003_execution
    (facts, obligations, episodes; deciding fact conflicts) and 0004_retention."""
    base = importlib.import_module("ledger.migrations.0002_roles").ROLES
    execution = importlib.import_module("ledger.migrations.0003_execution").ROLES
    retention = importlib.import_module("ledger.migrations.0004_retention")
    return {
        name: set(codenames) | set(execution.get(name, ())) | set(retention.EVERY_ROLE_PERMS)
        | (set(retention.ADMIN_PERMS) if name == "admin" else set())
        for name, codenames in base.items()
    }
