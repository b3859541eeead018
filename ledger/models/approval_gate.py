"""The approval gate of an operation, as SQL: one text for the trigger on ledger_operation
and for `ledger.approvals.check_can_submit`, so the two cannot disagree.

Apart from the models (which import `ledger.models.operations`): the trigger is one of
Operation's own.
"""

import pgtrigger

from ledger.models.triggers import Trigger
from ledger.states import HUMAN_ONLY, ActorKind, RetryPolicy, State


def gate_sql(*, op_id: str, tenant: str, operation: str, fingerprint: str) -> str:
    """SELECT needed, have, patterns: the approvals an operation needs before it is sent
    (0: none), the live approvals of `fingerprint` by distinct people, and the policies
    asking. The arguments are SQL expressions (`NEW.id` in the trigger, `%s` in Python).

    Needed: the strictest matching policy (consequential: two people), or what the request
    asked for. Live: an approve decision of this fingerprint not yet expired (PostgreSQL's
    `now()`, the transaction's start).
    """
    return f"""
    SELECT GREATEST(COALESCE(MAX(CASE WHEN p.consequential
                                      THEN GREATEST(p.approvals_needed, 2)
                                      ELSE p.approvals_needed END), 0),
                    COALESCE((SELECT r.approvals_needed FROM ledger_approvalrequest r
                               WHERE r.operation_id = {op_id}), 0)) AS needed,
           (SELECT COUNT(DISTINCT a.decided_by_id) FROM ledger_approval a
             WHERE a.operation_id = {op_id} AND a.intent_fingerprint = {fingerprint}
               AND a.decision = 'approve' AND a.expires_at > now()) AS have,
           COALESCE(string_agg(p.pattern, ', ' ORDER BY p.pattern), '') AS patterns
      FROM ledger_approvalpolicy p
     WHERE p.tenant = {tenant} AND p.requires_approval
       AND {pattern_matches_sql(operation)}
    """


def pattern_matches_sql(operation: str, pattern: str = "p.pattern") -> str:
    """Whether the glob `pattern` matches `operation` (SQL expressions), as LIKE
    (`*` any run, `?` one character; `_`, legal in names, taken literally)."""
    return (f"{operation} LIKE replace(replace(replace({pattern}, '_', '\\_'), '*', '%%'), "
            "'?', '_')")


def policy_people_sql(*, tenant: str, operation: str) -> str:
    """The people the policies of `tenant` matching `operation` ask (0: none), as
    `ApprovalPolicy.people_needed` counts them (consequential: at least two). SQL, the
    arguments SQL expressions."""
    return f"""
    (SELECT COALESCE(MAX(CASE WHEN p.consequential THEN GREATEST(p.approvals_needed, 2)
                              ELSE p.approvals_needed END), 0)
       FROM ledger_approvalpolicy p
      WHERE p.tenant = {tenant} AND p.requires_approval
        AND {pattern_matches_sql(operation)})
    """


# How ledger.approvals tells the gate's refusal from any other check violation.
GATE_HINT = "ledger.approvals: approve it first"
# ... and the two-person rule's refusal of a decision without a proposal.
TWO_PERSON_HINT = "ledger.receipts: a second person decides"

# On ledger_operation (installed with Operation's other triggers): no planned ->
# submitted without enough live approvals of the fingerprint being submitted, and no new
# fingerprint on a planned operation unless a person approved exactly that intent.
GATE_TRIGGER = Trigger(
    name="operation_submit_approved",
    operation=pgtrigger.Update,
    when=pgtrigger.Before,
    condition=pgtrigger.Q(old__state="planned"),
    declare=[("gate", "record")],
    func=f"""
    IF NEW.state = 'submitted' THEN
        SELECT * INTO gate FROM ({gate_sql(op_id="NEW.id", tenant="NEW.tenant",
                                           operation="NEW.operation",
                                           fingerprint="NEW.intent_fingerprint")
                                  .replace("%%", "%")}) q;
        IF gate.have < gate.needed THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation', HINT = '{GATE_HINT}',
                MESSAGE = format('operation %s: expected %s live approval(s) of fingerprint '
                                 '%s before it is submitted (approval policy %s), found %s',
                                 NEW.operation_id, gate.needed, NEW.intent_fingerprint,
                                 COALESCE(NULLIF(gate.patterns, ''), 'none: the agent asked'),
                                 gate.have);
        END IF;
    END IF;
    IF NEW.intent_fingerprint IS DISTINCT FROM OLD.intent_fingerprint AND NOT EXISTS (
        SELECT 1 FROM ledger_approval a
         WHERE a.operation_id = NEW.id AND a.intent_fingerprint = NEW.intent_fingerprint
           AND a.edited_from = OLD.intent_fingerprint AND a.decision = 'approve') THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected a new intent only with a person''s '
                             'approval of it (ledger.approvals.approve(intent=)), found '
                             'fingerprint %s -> %s without one', NEW.operation_id,
                             OLD.intent_fingerprint, NEW.intent_fingerprint);
    END IF;
    RETURN NEW;
    """,
)


def two_person_sql(*, op_id: str, to_state: str) -> str:
    """Whether moving the operation `op_id` to `to_state` by a person takes two people
    (SQL, a boolean): a consequential policy of its tenant matches its name, or it is
    safe_to_retry on an operation whose retry policy is `never`."""
    return f"""
    EXISTS (SELECT 1 FROM ledger_operation o
             WHERE o.id = {op_id}
               AND (({to_state}) = '{State.SAFE_TO_RETRY}'
                    AND o.retry_policy = '{RetryPolicy.NEVER}'
                    OR EXISTS (SELECT 1 FROM ledger_approvalpolicy p
                                WHERE p.tenant = o.tenant AND p.consequential
                                  AND p.requires_approval
                                  AND {pattern_matches_sql("o.operation")})))
    """


_HUMAN_ONLY = ", ".join(f"('{a}', '{b}')" for a, b in sorted(HUMAN_ONLY))

# On ledger_operationevent (installed with OperationEvent's other triggers): a person's
# decision that takes two people needs a proposal of the same decision, at the version the
# decision leaves, by a different user (ledger.receipts.resolve records it).
TWO_PERSON_TRIGGER = Trigger(
    name="event_two_person_check",
    operation=pgtrigger.Insert,
    when=pgtrigger.Before,
    condition=pgtrigger.Q(new__actor_kind=ActorKind.HUMAN, new__decided_by__isnull=False),
    func=f"""
    IF (NEW.from_state, NEW.to_state) IN ({_HUMAN_ONLY})
       AND {two_person_sql(op_id="NEW.operation_id", to_state="NEW.to_state")
            .replace("%%", "%")}
       AND NOT EXISTS (
           SELECT 1 FROM ledger_resolutionproposal r
            WHERE r.operation_id = NEW.operation_id AND r.version = NEW.version - 1
              AND r.to_state = NEW.to_state AND r.proposed_by_id <> NEW.decided_by_id) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation', HINT = '{TWO_PERSON_HINT}',
            MESSAGE = format('operation event %s -> %s at version %s: expected two people '
                             '(a proposal of %s at version %s by someone other than user %s: '
                             'ledger.receipts.resolve records it), found none',
                             NEW.from_state, NEW.to_state, NEW.version, NEW.to_state,
                             NEW.version - 1, NEW.decided_by_id);
    END IF;
    RETURN NEW;
    """,
)


# On ledger_approvalrequest (installed with ApprovalRequest): the request's tenant is its
# operation's; an agent asks (a pending request, of a planned operation, asking at least
# what the policies ask and never fewer than one person); only the desk marks it approved
# (when enough distinct people's approvals of the operation's current fingerprint were
# live at `decided_at`) or denied (when a person's denial is recorded), and the count of
# people asked changes only when it is asked again. Whoever writes, the owner included.
APPROVAL_REQUEST_TRIGGER = Trigger(
    name="approval_request_check",
    operation=pgtrigger.Insert | pgtrigger.Update,
    when=pgtrigger.Before,
    declare=[("op", "record"), ("needed", "integer"), ("have", "integer")],
    func=f"""
    SELECT o.operation_id, o.tenant, o.operation, o.state, o.intent_fingerprint INTO op
      FROM ledger_operation o WHERE o.id = NEW.operation_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation',
            MESSAGE = format('approval request: expected an existing operation, found id %s',
                             NEW.operation_id);
    END IF;
    IF NEW.tenant IS DISTINCT FROM op.tenant THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('approval request of operation %s: expected its operation''s '
                             'tenant %s, found %s', op.operation_id, op.tenant, NEW.tenant);
    END IF;
    IF TG_OP = 'UPDATE' AND NEW.operation_id IS DISTINCT FROM OLD.operation_id THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('approval request of operation %s: expected its operation '
                             'unchanged, found an UPDATE moving it', op.operation_id);
    END IF;
    IF TG_OP = 'INSERT' AND NEW.status IS DISTINCT FROM 'pending' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('approval request of operation %s: expected a new request '
                             'pending (people decide it), found %s', op.operation_id,
                             NEW.status);
    END IF;
    needed := GREATEST(1, {policy_people_sql(tenant="op.tenant", operation="op.operation")
                           .replace("%%", "%")});
    IF NEW.status = 'pending' THEN
        IF op.state IS DISTINCT FROM 'planned' OR NEW.decided_at IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('approval request of operation %s: expected a pending '
                                 'request of a planned operation, undecided, found the '
                                 'operation %s, decided at %s', op.operation_id, op.state,
                                 COALESCE(NEW.decided_at::text, 'never'));
        END IF;
        IF NEW.approvals_needed < needed THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('approval request of operation %s: expected at least %s '
                                 'approval(s) asked (the policies of tenant %s, at least one '
                                 'person), found %s', op.operation_id, needed, op.tenant,
                                 NEW.approvals_needed);
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.approvals_needed IS DISTINCT FROM OLD.approvals_needed THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('approval request of operation %s: expected the people asked to '
                             'change only when the agent asks again (pending), found %s -> %s '
                             'on a %s request', op.operation_id, OLD.approvals_needed,
                             NEW.approvals_needed, NEW.status);
    END IF;
    IF NEW.status IS NOT DISTINCT FROM OLD.status
       AND NEW.decided_at IS NOT DISTINCT FROM OLD.decided_at THEN
        RETURN NEW;
    END IF;
    IF NOT ledger_session_is('ledger_desk') THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('approval request of operation %s: expected a request approved '
                             'or denied by the desk (a session in role ledger_desk), found '
                             'status %s from role %s', op.operation_id, NEW.status,
                             current_user);
    END IF;
    IF NEW.status = 'approved' THEN
        SELECT COUNT(DISTINCT a.decided_by_id) INTO have FROM ledger_approval a
         WHERE a.operation_id = NEW.operation_id
           AND a.intent_fingerprint = op.intent_fingerprint AND a.decision = 'approve'
           AND a.created_at <= NEW.decided_at AND a.expires_at > NEW.decided_at;
        needed := GREATEST(needed, NEW.approvals_needed);
        IF NEW.decided_at IS NULL OR have < needed THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('approval request of operation %s: expected %s live '
                                 'approval(s) of fingerprint %s at its decision (%s) to mark '
                                 'it approved, found %s', op.operation_id, needed,
                                 op.intent_fingerprint,
                                 COALESCE(NEW.decided_at::text, 'no time'), have);
        END IF;
    ELSIF NEW.status = 'denied' THEN
        IF NEW.decided_at IS NULL OR NOT EXISTS (
                SELECT 1 FROM ledger_approval a
                 WHERE a.operation_id = NEW.operation_id AND a.decision = 'deny') THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('approval request of operation %s: expected a person''s '
                                 'denial recorded, with its time, to mark it denied, found '
                                 'none (decided at %s)', op.operation_id,
                                 COALESCE(NEW.decided_at::text, 'no time'));
        END IF;
    ELSE
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('approval request of operation %s: expected status pending, '
                             'approved or denied, found %s', op.operation_id, NEW.status);
    END IF;
    RETURN NEW;
    """,
)
