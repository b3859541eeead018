"""Runs, steps, leases and tenant grants: what coordinates agents and people."""

import pgtrigger
from django.conf import settings
from django.db import models

from ledger.models.triggers import FENCE_HINT, Protect, Trigger

# The lease that fences a run's writes, named from the run's row `r` (Run.lease_resource):
# `run:<tenant>:<run_id>`, the tenant's "%" and ":" percent-encoded, so that no two runs
# (run ids are unique per tenant) share a lease name.
RUN_LEASE = "'run:' || replace(replace(r.tenant, '%', '%25'), ':', '%3A') || ':' || r.run_id"
# The same, in a query with parameters (its "%" doubled).
RUN_LEASE_WITH_PARAMS = RUN_LEASE.replace("%", "%%")


def run_lease_name(tenant: str, run_id: str) -> str:
    """The name of the lease that fences run `run_id` of `tenant` (as RUN_LEASE)."""
    return f"run:{tenant.replace('%', '%25').replace(':', '%3A')}:{run_id}"


def run_fence_sql(run_pk: str, token: str, change: str) -> str:
    """PL/pgSQL that refuses a write to a leased run that does not carry its lease's current
    token: `run_pk` and `token` are the written row's expressions, `change` a format()
    expression saying what was written. A run never leased is not fenced. The lease row is
    share-locked to the commit, so no newer token is handed out before it (as
    ledger.leases.check_run does). Needs `lease record` declared."""
    return f"""
    SELECT l.token, l.resource INTO lease
      FROM ledger_run r
      JOIN ledger_lease l ON l.resource = {RUN_LEASE}
     WHERE r.id = {run_pk}
       FOR SHARE OF l;
    IF FOUND AND ({token}) IS DISTINCT FROM lease.token THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected the current fencing token %s of %s on %s, found %s',
                             lease.token, lease.resource, {change},
                             COALESCE(({token})::text, 'no token')),
            DETAIL = lease.token::text,
            HINT = '{FENCE_HINT}';
    END IF;
"""


def run_addition_fence_sql(run_pk: str, token: str, change: str) -> str:
    """PL/pgSQL that fences a row a worker adds to a run (a step, an obligation, an
    episode), whose INSERT carries the token it was written under (`token`): once the run
    is leased (held, expired or released, as ledger.leases.check_run), only the lease's
    current token is taken, and a row written without one is refused like a stale one; a
    token named for a run never leased is refused (there is no lease it could be current
    for); a run never leased takes rows without a token. The lease row is share-locked to
    the commit, as `run_fence_sql` does. Needs `lease record` declared; runs for every
    INSERT (no WHEN clause: a missing token is what it refuses)."""
    return f"""
    SELECT l.token, l.resource INTO lease
      FROM ledger_run r
      JOIN ledger_lease l ON l.resource = {RUN_LEASE}
     WHERE r.id = {run_pk}
       FOR SHARE OF l;
    IF FOUND AND ({token}) IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected the current fencing token %s of %s on %s, found no '
                             'token (once a run is leased, every row added to it carries '
                             'the holder''s token)', lease.token, lease.resource, {change}),
            DETAIL = lease.token::text,
            HINT = '{FENCE_HINT}';
    ELSIF ({token}) IS NOT NULL AND (NOT FOUND OR ({token}) IS DISTINCT FROM lease.token) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected fencing token %s to be current for the lease of the '
                             'run of %s, found %s', ({token}), {change},
                             CASE WHEN NOT FOUND THEN 'no lease at all (the run was never '
                                                      'leased)'
                                  ELSE 'current token ' || lease.token || ' of '
                                       || lease.resource END),
            DETAIL = COALESCE(lease.token::text, ''),
            HINT = '{FENCE_HINT}';
    END IF;
    RETURN NEW;
"""


class StepState(models.TextChoices):
    PENDING = "pending", "Pending"
    STARTED = "started", "Started"
    COMMITTED = "committed", "Committed"


# The database's copy of the rule "a step starts only once every dependency is committed",
# and of the step lifecycle pending -> started -> committed (nothing else, never back).
_STEP_CHECK = """
    IF NEW.run_id IS DISTINCT FROM OLD.run_id OR NEW.step_id IS DISTINCT FROM OLD.step_id
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('step %s: expected its run, step_id and created_at to stay '
                             'unchanged, found an UPDATE changing them', OLD.step_id);
    END IF;
    IF NEW.added_token IS DISTINCT FROM OLD.added_token THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('step %s: expected the token it was added under to stay %s, '
                             'found an UPDATE changing it to %s', OLD.step_id,
                             COALESCE(OLD.added_token::text, 'none'),
                             COALESCE(NEW.added_token::text, 'none'));
    END IF;
    IF NEW.started_token IS DISTINCT FROM OLD.started_token
       AND (OLD.state, NEW.state) IS DISTINCT FROM ('pending', 'started')
       OR NEW.committed_token IS DISTINCT FROM OLD.committed_token
       AND (OLD.state, NEW.state) IS DISTINCT FROM ('started', 'committed') THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('step %s: expected its fencing tokens to be written only by the '
                             'change they fence (started_token by pending -> started, '
                             'committed_token by started -> committed), found %s -> %s '
                             'changing them', OLD.step_id, OLD.state, NEW.state);
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF (OLD.state, NEW.state) NOT IN (('pending', 'started'), ('started', 'committed')) THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('step %s: expected pending -> started -> committed, found '
                                 '%s -> %s', OLD.step_id, OLD.state, NEW.state);
        END IF;
        IF NEW.state = 'started' THEN
            SELECT string_agg(dep.step_id || ' (' || dep.state || ')', ', ' ORDER BY dep.step_id)
              INTO missing
              FROM ledger_step_depends_on link
              JOIN ledger_step dep ON dep.id = link.to_step_id
             WHERE link.from_step_id = NEW.id AND dep.state <> 'committed';
            IF missing IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'check_violation',
                    MESSAGE = format('step %s: expected every dependency committed before it '
                                     'starts, found %s', NEW.step_id, missing);
            END IF;
        END IF;
    ELSIF OLD.state = 'committed' AND (NEW.started_at IS DISTINCT FROM OLD.started_at
                                       OR NEW.committed_at IS DISTINCT FROM OLD.committed_at) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('step %s: expected a committed step never to change, found an '
                             'UPDATE of its times', OLD.step_id);
    END IF;
    RETURN NEW;
"""

# A step is added pending, never started or committed by its INSERT (so no step skips the
# fence of its changes below).
_STEP_INSERT = """
    IF NEW.state <> 'pending' OR NEW.started_at IS NOT NULL OR NEW.committed_at IS NOT NULL
       OR NEW.started_token IS NOT NULL OR NEW.committed_token IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('step %s: expected a new step to be pending, with no times or '
                             'tokens, found an INSERT of a %s step', NEW.step_id, NEW.state);
    END IF;
    RETURN NEW;
"""

# Once its run is leased, a step starts and commits only under the lease's current token,
# written with the change (started_token, committed_token; each once, by its change).
_STEP_FENCED = run_fence_sql(
    "NEW.run_id",
    "CASE NEW.state WHEN 'started' THEN NEW.started_token ELSE NEW.committed_token END",
    "format('step %s moving %s -> %s', NEW.step_id, OLD.state, NEW.state)",
) + "    RETURN NEW;\n"
# A step added to a leased run: under the lease's current token only (`runs.add_step(
# fencing_token=)`, stored as added_token); to a run never leased, without one.
_STEP_ADDED_FENCED = run_addition_fence_sql(
    "NEW.run_id", "NEW.added_token", "format('step %s added', NEW.step_id)")


class Run(models.Model):
    """One task an agent works on; operations, steps and facts hang off it."""

    run_id = models.CharField(max_length=100)
    tenant = models.CharField(max_length=100, default="default", db_index=True)
    objective = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            # Per tenant: one tenant's run ids are neither visible to nor taken by another.
            models.UniqueConstraint(fields=["tenant", "run_id"], name="run_id_unique_per_tenant"),
        ]
        ordering = ["-created_at"]

    def __str__(self):
        return self.run_id

    @property
    def lease_resource(self) -> str:
        return run_lease_name(self.tenant, self.run_id)


class Step(models.Model):
    """A step of a run; an operation may name the step it belongs to.

    pending -> started -> committed, through `ledger.runs`. A step starts only once every
    step it depends on is committed; a trigger refuses anything else, even a raw UPDATE.
    Dependencies are steps of the same run added before it, so they never form a cycle.
    Once the run is leased, PostgreSQL refuses a start or commit that does not write the
    lease's current token with it (`started_token`, `committed_token`).
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps")
    step_id = models.CharField(max_length=100)
    state = models.CharField(max_length=20, choices=StepState.choices, default=StepState.PENDING)
    depends_on = models.ManyToManyField(
        "self", symmetrical=False, related_name="dependents", blank=True
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    committed_at = models.DateTimeField(null=True, blank=True)
    # The run lease's token each change was made under (None: the run was not leased).
    started_token = models.BigIntegerField(null=True, blank=True)
    committed_token = models.BigIntegerField(null=True, blank=True)
    # The token it was added under (`add_step(fencing_token=)`); None: added without one,
    # to a run not leased then.
    added_token = models.BigIntegerField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "step_id"], name="step_unique_per_run"),
            models.CheckConstraint(
                condition=models.Q(state__in=StepState.values), name="step_state_known"
            ),
        ]
        ordering = ["run", "id"]
        triggers = [
            Trigger(
                name="step_lifecycle_check",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                declare=[("missing", "text")],
                func=_STEP_CHECK,
            ),
            Trigger(
                name="step_insert_check",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                func=_STEP_INSERT,
            ),
            Trigger(
                name="step_fenced",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition('OLD."state" IS DISTINCT FROM NEW."state"'),
                declare=[("lease", "record")],
                func=_STEP_FENCED,
            ),
            Trigger(
                name="step_added_fenced",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                declare=[("lease", "record")],
                func=_STEP_ADDED_FENCED,
            ),
        ]

    def __str__(self):
        return f"{self.run.run_id}/{self.step_id}"

    @property
    def is_committed(self) -> bool:
        return self.state == StepState.COMMITTED


# Whether the session's role (current_user) is the table's owner or a member of it: inside
# the SECURITY DEFINER functions of migration 0042 it is; an application role never is.
TABLE_OWNER_SESSION = """EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                  WHERE c.oid = TG_RELID
                    AND pg_catalog.pg_has_role(current_user, c.relowner, 'MEMBER'))"""

# A lease row changes only inside ledger_lease_acquire / _renew / _release (migration 0042,
# SECURITY DEFINER, run as the tables' owner): every other role is refused, whatever its
# grants (the fences' FOR SHARE needs UPDATE on one column, ledger.db_roles). Whoever
# writes, even the owner: the resource stays, the token never decreases, and a live lease
# is never taken over by another holder.
_LEASE_CHECK = f"""
    IF NOT {TABLE_OWNER_SESSION} THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('lease %s: expected a lease taken, renewed or released only '
                             'through ledger_lease_acquire, ledger_lease_renew or '
                             'ledger_lease_release (ledger.leases), found a direct %s from '
                             'role %s', NEW.resource, TG_OP, current_user);
    END IF;
    IF TG_OP = 'UPDATE' THEN
        IF NEW.resource IS DISTINCT FROM OLD.resource THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('lease %s: expected its resource unchanged, found %s',
                                 OLD.resource, NEW.resource);
        END IF;
        IF NEW.token < OLD.token THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('lease %s: expected its fencing token never to decrease, '
                                 'found %s -> %s', OLD.resource, OLD.token, NEW.token);
        END IF;
        IF NEW.owner IS DISTINCT FROM OLD.owner
           AND (OLD.expires_at > clock_timestamp() OR NEW.token <= OLD.token) THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('lease %s: expected a new holder only once the lease expired '
                                 'and with a larger token, found %s (token %s, live until %s) '
                                 'replaced by %s (token %s)', OLD.resource, OLD.owner,
                                 OLD.token, OLD.expires_at, NEW.owner, NEW.token);
        END IF;
    END IF;
    RETURN NEW;
"""


class Lease(models.Model):
    """A time-limited claim on a resource. `token` only ever grows (fencing).

    Written only by PostgreSQL's functions `ledger_lease_acquire`, `ledger_lease_renew` and
    `ledger_lease_release` (`ledger.leases` calls them); the rows are never deleted, so the
    next token is still larger.
    """

    resource = models.CharField(max_length=200, unique=True)
    owner = models.CharField(max_length=200)
    token = models.BigIntegerField()
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["resource"]
        triggers = [
            Trigger(
                name="lease_change_check",
                operation=pgtrigger.Insert | pgtrigger.Update,
                when=pgtrigger.Before,
                func=_LEASE_CHECK,
            ),
            Trigger(
                name="lease_never_deleted",
                operation=pgtrigger.Delete,
                when=pgtrigger.Before,
                func="""
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
        MESSAGE = format('lease %s: expected a lease row to stay (the next token grows from '
                         'it), found a DELETE from role %s', OLD.resource, current_user);
""",
            ),
        ]

    def __str__(self):
        return f"{self.resource} held by {self.owner} (token {self.token})"


class WorkerLock(models.Model):
    """The background workers' locks: a row per lock, locked FOR UPDATE to the end of the
    worker's transaction (the sealer's per tenant, `seal:<tenant>`; the notification loop's
    per channel, `notify:<channel id>`).

    Taken only through `ledger_worker_lock(name)` (SECURITY DEFINER, EXECUTE for the
    reconciler's role, migration 0042): no application role may write or lock the rows,
    which takes UPDATE, so an agent's or the desk's login cannot hold a worker's lock and
    stall it, as any login could with the advisory locks this replaces.
    """

    name = models.CharField(max_length=200, primary_key=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class TenantAccess(models.Model):
    """A user may see the operations of `tenant`. Superusers see every tenant."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_grants"
    )
    tenant = models.CharField(max_length=100)
    granted_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="tenant_access_unique")
        ]
        verbose_name = "tenant access"
        verbose_name_plural = "tenant access"

    def __str__(self):
        return f"{self.user} may see {self.tenant}"


class TenantAccessChange(models.Model):
    """Who granted or revoked which user's access to which tenant, and when. Append-only.

    Written by `ledger.access.grant` / `revoke` in the same transaction as the change.
    `changed_by` is empty when code changed the grant without naming a person (a
    management command, the demo seed).
    """

    class Action(models.TextChoices):
        GRANTED = "granted", "Granted"
        REVOKED = "revoked", "Revoked"

    # DO_NOTHING without a constraint: the row is append-only, so it keeps the id of a
    # deleted user rather than being updated to NULL; the names say who it was.
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.DO_NOTHING, related_name="+",
        db_constraint=False,
    )
    username = models.CharField(max_length=150)
    tenant = models.CharField(max_length=100)
    action = models.CharField(max_length=20, choices=Action.choices)
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.DO_NOTHING,
        related_name="+", db_constraint=False,
    )
    changed_by_name = models.CharField(max_length=150, blank=True)
    changed_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(action__in=["granted", "revoked"]),
                name="tenant_access_change_action_known",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "changed_at"], name="tenant_access_change_idx"),
        ]
        ordering = ["-changed_at", "-id"]
        triggers = [
            Protect(
                name="tenant_access_change_append_only",
                operation=pgtrigger.Update | pgtrigger.Delete,
            ),
        ]

    def __str__(self):
        who = self.changed_by_name or "code"
        return f"{who} {self.action} {self.username} access to {self.tenant}"
