// The client's errors: one class per problem type of the ledger's API, and the client's own.
// Every error is a LedgerError. A problem answered by the ledger (RFC 9457) becomes the class
// of its `type`, with `status`, `detail`, the whole `problem`, and `operation` (a Receipt)
// when the problem names one. Not reaching the ledger is LedgerUnavailable.

export const PROBLEM_PREFIX = "urn:agent-ledger:problem:";

export class LedgerError extends Error {
  constructor(message, { operation = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = new.target.name;
    this.operation = operation;
  }
}

// --- what an action raises from the operation's state ------------------------------------

/** The key was sent before and its effect is not proven: the function was not called. */
export class OutcomeUnknown extends LedgerError {}

/** 409 `idempotency-in-flight`: another caller is sending this key right now (submitted);
 * the function was not called. Ask again after `retryAfter` seconds for its outcome. A
 * subclass of OutcomeUnknown, so code catching that keeps working. */
export class InFlight extends OutcomeUnknown {
  static slug = "idempotency-in-flight";
  constructor(message, { status = 409, problem = {}, operation = null } = {}) {
    super(message, { operation });
    this.status = status;
    this.problem = problem;
    this.detail = problem.detail ?? "";
  }

  get retryAfter() {
    return typeof this.problem.retry_after === "number" ? this.problem.retry_after : 1;
  }
}

/** The key was rejected by the external system or abandoned by a person: not called. */
export class Rejected extends LedgerError {}

/** The call succeeded but its return value could not be stored; `.value` holds it. */
export class UnstorableResult extends LedgerError {
  constructor(message, { operation = null, value } = {}) {
    super(message, { operation });
    this.value = value;
  }
}

const INVALID_INPUT = Symbol.for("agent-ledger-client.invalid-input");

/** Refused before anything was sent (also the ledger's invalid-input problems). */
export class InvalidInput extends LedgerError {
  static [Symbol.hasInstance](value) {
    return value != null && value[INVALID_INPUT] === true;
  }
  get [INVALID_INPUT]() { return true; }
}

/** No ledger URL or agent key (give them, or set LEDGER_URL / LEDGER_AGENT_KEY). */
export class ConfigurationError extends LedgerError {}

// --- not reaching the ledger --------------------------------------------------------------

/** The ledger could not be reached or did not answer as its API does; before a call the
 * function was NOT called. `.cause` is the underlying error. */
export class LedgerUnavailable extends LedgerError {}

/** The ledger answered 5xx. */
export class ServerError extends LedgerUnavailable {
  constructor(message, { status, problem = {}, operation = null } = {}) {
    super(message, { operation });
    this.status = status;
    this.problem = problem;
  }
}

/** An answer that is not the API's. */
export class UnexpectedResponse extends LedgerUnavailable {}

/** The function WAS called and the ledger could not record how it went within the retry
 * budget. It is never called again for this key: the operation stays submitted for the
 * ledger's sweep. `.value` is the function's return value (if it returned). */
export class OutcomeNotRecorded extends LedgerUnavailable {
  constructor(message, { operation = null, value, cause } = {}) {
    super(message, { operation, cause });
    this.value = value;
  }
}

// --- the API's problem types ----------------------------------------------------------------

export class ProblemError extends LedgerError {
  static slug = "";
  constructor(message, { status, problem = {}, operation = null } = {}) {
    super(message, { operation });
    this.status = status;
    this.problem = problem;
    this.detail = problem.detail ?? "";
  }
}

export class Unauthenticated extends ProblemError { static slug = "unauthenticated"; }
export class PermissionDenied extends ProblemError { static slug = "permission-denied"; }
export class NotFound extends ProblemError { static slug = "not-found"; }
export class InvalidRequest extends ProblemError {
  static slug = "invalid-request";
  get [INVALID_INPUT]() { return true; }
}
export class MalformedBody extends ProblemError {
  static slug = "malformed-body";
  get [INVALID_INPUT]() { return true; }
}
export class InvalidInputProblem extends ProblemError {
  static slug = "invalid-input";
  get [INVALID_INPUT]() { return true; }
}
export class HTTPError extends ProblemError { static slug = "http-error"; }
export class Refused extends ProblemError { static slug = "refused"; }
export class IdempotencyKeyReused extends Refused { static slug = "idempotency-key-reused"; }
export class StaleVersion extends Refused {
  static slug = "stale-version";
  get currentState() { return this.problem.current_state ?? null; }
  get currentVersion() { return this.problem.current_version ?? null; }
}
export class IllegalTransition extends Refused { static slug = "illegal-transition"; }
export class StaleFencingToken extends Refused {
  static slug = "stale-fencing-token";
  get currentToken() { return this.problem.current_token ?? null; }
}
export class LeaseHeld extends Refused { static slug = "lease-held"; }
export class AlreadyCommitted extends Refused {
  static slug = "already-committed";
  get result() { return this.problem.result; }
}
export class StaleFact extends Refused { static slug = "stale-fact"; }
export class DependencyNotMet extends Refused { static slug = "dependency-not-met"; }
export class ApprovalRequired extends Refused { static slug = "approval-required"; }
export class ApprovalDenied extends Refused {
  static slug = "approval-denied";
  get reason() { return this.problem.reason ?? null; }
}
export class SecondPersonRequired extends Refused { static slug = "second-person-required"; }
export class ValidationRefused extends Refused {
  static slug = "validation-refused";
  get reason() { return this.problem.reason ?? null; }
}
export class InternalError extends ServerError { static slug = "internal-error"; }

export const PROBLEM_TYPES = Object.fromEntries([
  Unauthenticated, PermissionDenied, NotFound, InvalidRequest, MalformedBody,
  InvalidInputProblem, HTTPError, Refused, IdempotencyKeyReused, StaleVersion,
  IllegalTransition, StaleFencingToken, LeaseHeld, AlreadyCommitted, StaleFact,
  DependencyNotMet, ApprovalRequired, ApprovalDenied, SecondPersonRequired, InFlight,
  InternalError, ValidationRefused,
].map((cls) => [cls.slug, cls]));
