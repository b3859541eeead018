"""Execution state: versioned facts and their conflicts, obligations, episodes.

Facts are never updated in place: PostgreSQL refuses every UPDATE but the one that links a
current version to the version replacing it. Obligations change once (open -> committed or
cancelled) and never again. Episodes and fact decisions are append-only. Writes go through
`ledger.facts`, `ledger.obligations` and `ledger.episodes`.

Rows are deleted only by the retention purge (`ledger_retention_purge_state`, migration
0038, inside which `ledger_sanctioned` holds), and only a superseded fact version, a settled
obligation or an episode, none of a run that is unfinished (`ledger_run_unfinished`): the
triggers below refuse any other DELETE, whoever asks.
"""

import pgtrigger
from django.conf import settings
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from ledger.chain_content import sealed_once_sql, written_unsealed_sql
from ledger.models.coordination import RUN_LEASE, run_addition_fence_sql, run_fence_sql
from ledger.models.operations import AppendOnly
from ledger.models.triggers import FENCE_HINT, SANCTIONED, Protect, Trigger

# The source of a person's decision on a fact conflict (ledger.facts.REVIEWER_SOURCE_PREFIX).
REVIEWER_SOURCE = "reviewer:"


class FactStatus(models.TextChoices):
    CURRENT = "current", "Current"
    SUPERSEDED = "superseded", "Superseded"
    CANDIDATE = "candidate", "Candidate"


class ConflictState(models.TextChoices):
    OPEN = "open", "Open"
    RESOLVED = "resolved", "Resolved"


class ObligationState(models.TextChoices):
    OPEN = "open", "Open"
    COMMITTED = "committed", "Committed"
    CANCELLED = "cancelled", "Cancelled"


# How a refused DELETE names the row's run: finished, or unfinished and why not.
_RUN_STATE = ("CASE WHEN OLD.run_id IS NULL THEN 'none' "
              "WHEN ledger_run_unfinished(OLD.run_id) THEN OLD.run_id || ', unfinished' "
              "ELSE OLD.run_id || ', finished' END")

# An episode is append-only: only the retention purge deletes one, of a finished run.
_EPISODE_APPEND_ONLY = f"""
    IF TG_OP = 'DELETE' AND {SANCTIONED} AND NOT ledger_run_unfinished(OLD.run_id) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
        MESSAGE = format('episode %s: expected episodes never to change and only the '
                         'retention purge to delete one, of a finished run, found %s (run %s)',
                         OLD.id, TG_OP, {_RUN_STATE});
"""

# The only UPDATE a fact accepts: current -> superseded, linking `superseded_by` once, to
# the id of the version being inserted in the same transaction (so it cannot exist yet),
# with every other column unchanged.
_FACT_IMMUTABLE = f"""
    IF TG_OP = 'DELETE' THEN
        IF {SANCTIONED} AND OLD.status = 'superseded'
           AND NOT ledger_run_unfinished(OLD.run_id) THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('fact %s (%s %s, version %s): expected only the retention purge '
                             'to delete a fact, and only a superseded version of a finished '
                             'run, found a DELETE of a %s version (run %s)', OLD.id,
                             OLD.subject, OLD.predicate, OLD.version, OLD.status,
                             {_RUN_STATE});
    END IF;
    IF OLD.status = 'current' AND NEW.status = 'superseded'
       AND OLD.superseded_by_id IS NULL AND NEW.superseded_by_id IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM ledger_fact WHERE id = NEW.superseded_by_id)
       AND (to_jsonb(NEW) - 'status' - 'superseded_by_id')
           = (to_jsonb(OLD) - 'status' - 'superseded_by_id') THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'check_violation',
        MESSAGE = format('fact %s (%s %s, version %s): expected no change but linking a '
                         'current version once to the new version that supersedes it, found '
                         'an UPDATE (status %s -> %s, superseded_by %s -> %s); write a new '
                         'version with ledger.facts.assert_fact', OLD.id, OLD.subject,
                         OLD.predicate, OLD.version, OLD.status, NEW.status,
                         OLD.superseded_by_id, NEW.superseded_by_id);
"""

# A new fact is a first version (1), the successor (n + 1) of the version that links to
# it, or a candidate (no version) that contradicts a version of its own tenant, subject and
# predicate (migration 0057: a link to another tenant's fact is refused; row-level security
# cannot hold a fact's links to other facts, since a policy cannot read its own table).
_FACT_INSERT = """
    IF NEW.superseded_by_id IS NOT NULL OR NEW.status NOT IN ('current', 'candidate') THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('fact %s %s: expected a new fact to be current or a candidate '
                             'and superseded by nothing, found status %s', NEW.subject,
                             NEW.predicate, NEW.status);
    END IF;
    SELECT id, tenant, subject, predicate, version INTO prev
      FROM ledger_fact WHERE superseded_by_id = NEW.id;
    IF FOUND THEN
        IF NEW.status <> 'current' OR prev.tenant <> NEW.tenant OR prev.subject <> NEW.subject
           OR prev.predicate <> NEW.predicate OR NEW.version IS DISTINCT FROM prev.version + 1
        THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('fact %s %s: expected the successor of version %s to be the '
                                 'current version %s of the same subject and predicate, found '
                                 '%s %s %s version %s', prev.subject, prev.predicate,
                                 prev.version, prev.version + 1, NEW.status, NEW.subject,
                                 NEW.predicate, NEW.version);
        END IF;
    ELSIF NEW.status = 'current' AND NEW.version IS DISTINCT FROM 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('fact %s %s: expected version 1 for a first value, or a link from '
                             'the version it supersedes, found version %s and no link',
                             NEW.subject, NEW.predicate, NEW.version);
    END IF;
    IF NEW.contradicts_id IS NOT NULL THEN
        -- A candidate contradicts a version of its own tenant, subject and predicate (read
        -- under the writer's row-level security: another tenant's fact is not found).
        SELECT id, tenant, subject, predicate, version INTO prev
          FROM ledger_fact WHERE id = NEW.contradicts_id;
        IF NOT FOUND OR prev.tenant <> NEW.tenant THEN
            RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
                MESSAGE = format('fact %s %s: expected the candidate to contradict a fact of '
                                 'its tenant %s, found fact id %s %s', NEW.subject,
                                 NEW.predicate, NEW.tenant, NEW.contradicts_id,
                                 CASE WHEN FOUND THEN 'of another tenant'
                                      ELSE 'not there or not visible' END);
        END IF;
        IF prev.subject <> NEW.subject OR prev.predicate <> NEW.predicate THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('fact %s %s: expected the candidate to contradict a version '
                                 'of the same subject and predicate, found %s %s', NEW.subject,
                                 NEW.predicate, prev.subject, prev.predicate);
        END IF;
    END IF;
    RETURN NEW;
"""

_CONFLICT_SETTLED = """
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('fact conflict %s: expected conflicts never to be deleted, found '
                             'a DELETE', OLD.id);
    END IF;
    IF OLD.state <> 'open' OR NEW.current_id IS DISTINCT FROM OLD.current_id
       OR NEW.candidate_id IS DISTINCT FROM OLD.candidate_id
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('fact conflict %s: expected only an open conflict to change, and '
                             'only its resolution, found an UPDATE of a %s conflict', OLD.id,
                             OLD.state);
    END IF;
    RETURN NEW;
"""

_OBLIGATION_ONCE = f"""
    IF TG_OP = 'DELETE' THEN
        IF {SANCTIONED} AND OLD.state <> 'open' AND NOT ledger_run_unfinished(OLD.run_id) THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('obligation %s: expected only the retention purge to delete an '
                             'obligation, and only a settled one of a finished run, found a '
                             'DELETE of a %s obligation (run %s)', OLD.key, OLD.state,
                             {_RUN_STATE});
    END IF;
    IF OLD.state <> 'open' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('obligation %s: expected a %s obligation never to change, found '
                             'an UPDATE', OLD.key, OLD.state);
    END IF;
    IF NEW.state = 'open' AND NEW.fencing_token IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('obligation %s: expected its fencing_token to be written only by '
                             'the change that settles it, found an UPDATE leaving it open',
                             OLD.key);
    END IF;
    IF NEW.key IS DISTINCT FROM OLD.key OR NEW.run_id IS DISTINCT FROM OLD.run_id
       OR NEW.kind IS DISTINCT FROM OLD.kind OR NEW.tenant IS DISTINCT FROM OLD.tenant
       OR NEW.created_at IS DISTINCT FROM OLD.created_at
       OR NEW.opened_token IS DISTINCT FROM OLD.opened_token THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('obligation %s: expected its key, run, kind, tenant, '
                             'created_at and opened_token to stay unchanged, found an '
                             'UPDATE changing them', OLD.key);
    END IF;
    RETURN NEW;
"""

# An obligation is opened, never settled by its INSERT (so no settlement skips the fence
# below, and no forged result waits for the rightful committer as the winner's).
_OBLIGATION_INSERT = """
    IF NEW.state <> 'open' OR NEW.result IS NOT NULL OR NEW.committed_at IS NOT NULL
       OR NEW.cancelled_at IS NOT NULL OR NEW.cancel_reason <> ''
       OR NEW.fencing_token IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('obligation %s: expected a new obligation to be open, with no '
                             'result, times or token, found an INSERT of a %s one', NEW.key,
                             NEW.state);
    END IF;
    RETURN NEW;
"""

# Once its run is leased, an obligation is committed or cancelled only under the lease's
# current token, written with the change; a fact of the run is recorded only under it.
_OBLIGATION_FENCED = run_fence_sql(
    "NEW.run_id", "NEW.fencing_token",
    "format('obligation %s moving %s -> %s', NEW.key, OLD.state, NEW.state)",
) + "    RETURN NEW;\n"
# An obligation opened, or an episode recorded, on a leased run: under the lease's current
# token only; on a run never leased, without one.
_OBLIGATION_OPENED_FENCED = run_addition_fence_sql(
    "NEW.run_id", "NEW.opened_token", "format('obligation %s opened', NEW.key)")
_EPISODE_FENCED = run_addition_fence_sql(
    "NEW.run_id", "NEW.fencing_token", "format('an episode said by %s', NEW.role)")

# The fence follows the fact's run, and a fact's successor is of its predecessor's run: a
# successor written without a run inherits it (so the fence below holds it to that run's
# lease), and one of another run is refused while the predecessor's run is leased (its
# worker's token is not that lease's). The one successor of a leased run's fact written
# without its token is a person's decision on a conflict (ledger.facts.resolve_conflict,
# source `reviewer:<username>`, from the desk's role), which fact_decided holds to the
# FactDecision its transaction writes for it.
_FACT_FENCED = f"""
    IF NEW.version > 1 THEN
        SELECT f.id, f.run_id, f.version INTO prev FROM ledger_fact f
         WHERE f.superseded_by_id = NEW.id;
        IF FOUND AND prev.run_id IS NOT NULL
           AND prev.run_id IS DISTINCT FROM NEW.run_id THEN
            IF NEW.run_id IS NULL THEN
                NEW.run_id := prev.run_id;
                IF NEW.fencing_token IS NULL AND NEW.source LIKE '{REVIEWER_SOURCE}%'
                   AND ledger_session_is('ledger_desk') THEN
                    RETURN NEW;
                END IF;
            ELSE
                SELECT l.token, l.resource INTO lease
                  FROM ledger_run r
                  JOIN ledger_lease l ON l.resource = {RUN_LEASE}
                 WHERE r.id = prev.run_id
                   FOR SHARE OF l;
                IF FOUND THEN
                    RAISE EXCEPTION USING ERRCODE = 'check_violation',
                        MESSAGE = format('expected the successor of fact %s %s version %s to '
                                         'be of its run (leased: %s, token %s), found it '
                                         'of another run', NEW.subject, NEW.predicate,
                                         prev.version, lease.resource, lease.token),
                        DETAIL = lease.token::text,
                        HINT = '{FENCE_HINT}';
                END IF;
            END IF;
        END IF;
    END IF;
    IF NEW.run_id IS NULL THEN
        RETURN NEW;
    END IF;
""" + run_fence_sql(
    "NEW.run_id", "NEW.fencing_token",
    "format('fact %s %s of its run', NEW.subject, NEW.predicate)",
) + "    RETURN NEW;\n"

# At the commit of a person's successor of a leased run's fact written without the lease's
# token (fact_fenced let it through for the desk): the FactDecision naming it, which
# ledger_fact_decision_person_check holds to a person allowed to decide.
_FACT_DECIDED = f"""
    IF EXISTS (SELECT 1 FROM ledger_run r JOIN ledger_lease l ON l.resource = {RUN_LEASE}
                WHERE r.id = NEW.run_id)
       AND NOT EXISTS (SELECT 1 FROM ledger_factdecision d WHERE d.written_id = NEW.id) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('fact %s %s version %s: expected a successor of a leased run''s '
                             'fact written without the lease''s token to be a person''s '
                             'decision (a FactDecision naming it, in its transaction), found '
                             'none', NEW.subject, NEW.predicate, NEW.version),
            HINT = '{FENCE_HINT}';
    END IF;
    RETURN NULL;
"""


class FactQuerySet(models.QuerySet):
    def current(self):
        return self.filter(status=FactStatus.CURRENT)

    def unexpired(self, now=None):
        """Versions without an expiry or whose expiry is still ahead (the database clock
        unless `now`)."""
        return self.filter(models.Q(expires_at__isnull=True)
                           | models.Q(expires_at__gt=now if now is not None else Now()))

    def for_tenants(self, tenants):
        """`tenants` None means every tenant (superusers)."""
        return self if tenants is None else self.filter(tenant__in=tenants)


class Fact(models.Model):
    """One version of what is believed about (subject, predicate), and on whose evidence.

    At most one version per (tenant, subject, predicate) is current (a partial unique
    index). Versions step by one along `superseded_by`. A candidate is a write that
    contradicted the current version without naming it; it has no version, and waits in a
    `FactConflict` for a person.
    """

    tenant = models.CharField(max_length=100, default="default")
    subject = models.CharField(max_length=500)
    predicate = models.CharField(max_length=200)
    value = models.JSONField(null=True)
    value_fingerprint = models.CharField(max_length=80)
    source = models.CharField(max_length=500)
    observed_at = models.DateTimeField()
    version = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=FactStatus.choices)
    superseded_by = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="supersedes"
    )
    contradicts = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="candidates"
    )
    run = models.ForeignKey(
        "ledger.Run", null=True, blank=True, on_delete=models.PROTECT, related_name="facts"
    )
    # The run lease's token it was recorded under (None: no run, or a run never leased).
    fencing_token = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    # After it the version is no longer current: reads leave it out, and an action relying
    # on it is not submitted (operation_submit_on_current_facts). None: it does not expire.
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = FactQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "subject", "predicate"],
                condition=models.Q(status="current"),
                name="fact_one_current_version",
            ),
            models.UniqueConstraint(
                fields=["tenant", "subject", "predicate", "version"],
                name="fact_version_unique",
            ),
            models.UniqueConstraint(
                fields=["contradicts", "value_fingerprint", "source"],
                condition=models.Q(status="candidate"),
                name="fact_candidate_unique",
            ),
            models.CheckConstraint(
                condition=models.Q(status__in=FactStatus.values), name="fact_status_known"
            ),
            models.CheckConstraint(
                condition=(
                    models.Q(status="candidate", version__isnull=True,
                             contradicts__isnull=False)
                    | (~models.Q(status="candidate")
                       & models.Q(version__gte=1, contradicts__isnull=True))
                ),
                name="fact_candidate_has_no_version",
            ),
            models.CheckConstraint(
                condition=models.Q(status="superseded", superseded_by__isnull=False)
                | (~models.Q(status="superseded") & models.Q(superseded_by__isnull=True)),
                name="fact_superseded_iff_linked",
            ),
        ]
        indexes = [
            models.Index(fields=["run", "status"], name="fact_run_idx"),
        ]
        ordering = ["tenant", "subject", "predicate", "version", "id"]
        triggers = [
            Trigger(
                name="fact_never_updated_in_place",
                operation=pgtrigger.Update | pgtrigger.Delete,
                when=pgtrigger.Before,
                func=_FACT_IMMUTABLE,
            ),
            Trigger(
                name="fact_insert_check",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                declare=[("prev", "record")],
                func=_FACT_INSERT,
            ),
            Trigger(
                name="fact_fenced",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition('NEW."run_id" IS NOT NULL OR NEW."version" > 1'),
                declare=[("lease", "record"), ("prev", "record")],
                func=_FACT_FENCED,
            ),
            Trigger(
                name="fact_decided",
                operation=pgtrigger.Insert,
                when=pgtrigger.After,
                timing=pgtrigger.Deferred,
                condition=pgtrigger.Condition(
                    f"NEW.run_id IS NOT NULL AND NEW.fencing_token IS NULL "
                    f"AND NEW.version > 1 AND NEW.source LIKE '{REVIEWER_SOURCE}%'"
                ),
                func=_FACT_DECIDED,
            ),
        ]

    def __str__(self):
        label = f"v{self.version}" if self.version else "candidate"
        return f"{self.subject} {self.predicate} = {self.value!r} ({label}, {self.status})"

    @property
    def is_current(self) -> bool:
        return self.status == FactStatus.CURRENT

    @property
    def is_candidate(self) -> bool:
        return self.status == FactStatus.CANDIDATE

    @property
    def is_expired(self) -> bool:
        """Whether its expiry has passed (by this process's clock)."""
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.tenant, self.subject, self.predicate)

    @property
    def provenance(self) -> dict:
        """Where the value came from: source, when it was observed and recorded, which run."""
        return {
            "source": self.source,
            "observed_at": self.observed_at,
            "recorded_at": self.created_at,
            "version": self.version,
            "run_id": self.run.run_id if self.run_id else None,
        }


class FactConflictQuerySet(models.QuerySet):
    def open(self):
        return self.filter(state=ConflictState.OPEN)

    def for_tenants(self, tenants):
        """`tenants` None means every tenant (superusers)."""
        return self if tenants is None else self.filter(tenant__in=tenants)


class FactConflict(models.Model):
    """A write that contradicted the current version without naming it, for a person to
    decide. Both sides stay readable; the decision becomes a new current version."""

    tenant = models.CharField(max_length=100, default="default")
    subject = models.CharField(max_length=500)
    predicate = models.CharField(max_length=200)
    current = models.ForeignKey(Fact, on_delete=models.PROTECT, related_name="conflicts")
    candidate = models.OneToOneField(Fact, on_delete=models.PROTECT, related_name="conflict")
    state = models.CharField(
        max_length=20, choices=ConflictState.choices, default=ConflictState.OPEN
    )
    created_at = models.DateTimeField(db_default=Now())
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    resolution_reason = models.TextField(blank=True)
    chosen = models.ForeignKey(
        Fact, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    resolved_fact = models.ForeignKey(
        Fact, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )

    objects = FactConflictQuerySet.as_manager()

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(state__in=ConflictState.values), name="conflict_state_known"
            ),
            models.CheckConstraint(
                condition=models.Q(state="open")
                | models.Q(resolved_at__isnull=False, chosen__isnull=False,
                           resolved_fact__isnull=False),
                name="conflict_resolution_recorded",
            ),
        ]
        indexes = [models.Index(fields=["state", "created_at", "id"], name="conflict_queue_idx")]
        ordering = ["created_at", "id"]
        permissions = [("resolve_factconflict", "Can decide between conflicting facts")]
        triggers = [
            Trigger(
                name="conflict_settled_once",
                operation=pgtrigger.Update | pgtrigger.Delete,
                when=pgtrigger.Before,
                func=_CONFLICT_SETTLED,
            ),
        ]

    def __str__(self):
        return f"conflict on {self.subject} {self.predicate} ({self.state})"

    @property
    def is_open(self) -> bool:
        return self.state == ConflictState.OPEN


class FactDecision(models.Model):
    """A person's decision on a fact: on a conflict (`conflict`, `chosen` the side chosen), or
    a correction (`conflict` None, `chosen` the version corrected, `written` the person's
    value superseding it). Append-only: the audit trail of facts."""

    tenant = models.CharField(max_length=100)
    conflict = models.ForeignKey(FactConflict, null=True, blank=True, on_delete=models.PROTECT,
                                 related_name="decisions")
    chosen = models.ForeignKey(Fact, on_delete=models.PROTECT, related_name="+")
    written = models.ForeignKey(Fact, on_delete=models.PROTECT, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                             related_name="+")
    username = models.CharField(max_length=150)
    reason = models.TextField()
    created_at = models.DateTimeField(db_default=Now())
    # Its link in the tenant's "fact_decisions" hash chain (ledger.chain): unset ('' and
    # None) as written; set once by the sealer.
    chain_seq = models.BigIntegerField(null=True, blank=True)
    chain_hash = models.CharField(max_length=64, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "chain_seq"],
                                    name="fact_decision_chain_seq_unique"),
        ]
        indexes = [models.Index(fields=["created_at", "id"], name="fact_decision_time_idx")]
        ordering = ["created_at", "id"]
        triggers = [
            # Linked by the sealer alone (ledger_seal_links): written unsealed, its link set
            # once, nothing else ever changed.
            AppendOnly(name="fact_decision_append_only", sealed=True),
            Trigger(name="fact_decision_sealed_once", operation=pgtrigger.Update,
                    when=pgtrigger.Before, func=sealed_once_sql("fact decision")),
            Trigger(name="fact_decision_chain_columns", operation=pgtrigger.Insert,
                    when=pgtrigger.Before,
                    func=written_unsealed_sql("fact decision", unsealed_hash="''")),
        ]

    def __str__(self):
        if self.conflict_id is None:
            return f"{self.username} corrected {self.chosen_id} with {self.written_id}"
        return f"{self.username} chose {self.chosen_id} for conflict {self.conflict_id}"


class ObligationQuerySet(models.QuerySet):
    def pending(self):
        return self.filter(state=ObligationState.OPEN)

    def overdue(self, now=None):
        """Open obligations whose deadline has passed (the database clock unless `now`)."""
        return self.pending().filter(deadline__lt=now if now is not None else Now())

    def for_tenants(self, tenants):
        """`tenants` None means every tenant (superusers)."""
        return self if tenants is None else self.filter(tenant__in=tenants)


class Obligation(models.Model):
    """Something a run has promised to do exactly once, named by its idempotency key.

    open -> committed (with its result) or cancelled, once; then it never changes (a
    trigger refuses any UPDATE of a settled obligation, and every DELETE). It is inserted
    open; once its run is leased, PostgreSQL refuses a settlement that does not write the
    lease's current token with it (`fencing_token`).
    """

    run = models.ForeignKey("ledger.Run", on_delete=models.PROTECT, related_name="obligations")
    tenant = models.CharField(max_length=100, default="default")
    kind = models.CharField(max_length=200)
    key = models.CharField(max_length=200)
    state = models.CharField(
        max_length=20, choices=ObligationState.choices, default=ObligationState.OPEN
    )
    created_at = models.DateTimeField(db_default=Now())
    deadline = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    committed_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(blank=True)
    # The run lease's token it was settled under (None: open, or its run was not leased).
    fencing_token = models.BigIntegerField(null=True, blank=True)
    # The token it was opened under (`obligations.open(fencing_token=)`); None: without one,
    # on a run not leased then.
    opened_token = models.BigIntegerField(null=True, blank=True)

    objects = ObligationQuerySet.as_manager()

    class Meta:
        constraints = [
            # Per tenant: one tenant's keys are neither visible to nor taken by another.
            models.UniqueConstraint(fields=["tenant", "key"],
                                    name="obligation_key_unique_per_tenant"),
            models.CheckConstraint(
                condition=models.Q(state__in=ObligationState.values),
                name="obligation_state_known",
            ),
            models.CheckConstraint(
                condition=~models.Q(state="committed") | models.Q(committed_at__isnull=False),
                name="obligation_commit_time_recorded",
            ),
            models.CheckConstraint(
                condition=~models.Q(state="cancelled") | models.Q(cancelled_at__isnull=False),
                name="obligation_cancel_time_recorded",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "deadline"], name="obligation_overdue_idx"),
            models.Index(fields=["run", "state"], name="obligation_run_idx"),
        ]
        ordering = ["created_at", "id"]
        triggers = [
            Trigger(
                name="obligation_settled_once",
                operation=pgtrigger.Update | pgtrigger.Delete,
                when=pgtrigger.Before,
                func=_OBLIGATION_ONCE,
            ),
            Trigger(
                name="obligation_insert_check",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                func=_OBLIGATION_INSERT,
            ),
            Trigger(
                name="obligation_fenced",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition('OLD."state" IS DISTINCT FROM NEW."state"'),
                declare=[("lease", "record")],
                func=_OBLIGATION_FENCED,
            ),
            Trigger(
                name="obligation_opened_fenced",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                declare=[("lease", "record")],
                func=_OBLIGATION_OPENED_FENCED,
            ),
        ]

    def __str__(self):
        return f"{self.kind} {self.key} ({self.state})"

    @property
    def is_open(self) -> bool:
        return self.state == ObligationState.OPEN


class RetainedAppendOnly(Protect):
    """An append-only table's Protect whose rows the retention purge may delete (episodes:
    `_EPISODE_APPEND_ONLY`)."""

    def get_func(self, model):
        return _EPISODE_APPEND_ONLY


class Episode(models.Model):
    """What was said during a run (a message, a tool call, a transcript chunk), or where it
    is stored. Low authority: a record of talk, never of what happened. Append-only."""

    run = models.ForeignKey("ledger.Run", on_delete=models.PROTECT, related_name="episodes")
    tenant = models.CharField(max_length=100, default="default")
    role = models.CharField(max_length=50)
    content_ref = models.CharField(max_length=1000, blank=True)
    content = models.TextField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    # The run lease's token it was recorded under (`episodes.record(fencing_token=)`);
    # None: recorded without one, on a run not leased then.
    fencing_token = models.BigIntegerField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["run", "created_at", "id"], name="episode_run_idx")]
        ordering = ["created_at", "id"]
        triggers = [
            RetainedAppendOnly(
                name="episode_append_only", operation=pgtrigger.Update | pgtrigger.Delete
            ),
            Trigger(
                name="episode_fenced",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                declare=[("lease", "record")],
                func=_EPISODE_FENCED,
            ),
        ]

    def __str__(self):
        return f"{self.role} in run {self.run_id}"
