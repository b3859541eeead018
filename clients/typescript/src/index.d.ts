// Types of agent-ledger-client (hand-written beside the ESM source).

export declare const PROBLEM_PREFIX: "urn:agent-ledger:problem:";

/** An operation as the ledger answered it: every field of the API's operation. */
export declare class Receipt {
  constructor(data: Record<string, unknown>);
  readonly data: Record<string, unknown>;
  operation_id: string;
  tenant: string;
  operation: string;
  target: string;
  /** The provider account the call acted as (a non-secret label), or "". */
  account?: string;
  state: string;
  version: number;
  attempt: number;
  idempotency_key: string;
  intent: Record<string, unknown>;
  intent_fingerprint: string;
  external_id: string | null;
  result: unknown;
  result_unstorable?: string | null;
  error_code: string | null;
  /** True when the ledger served this from the stored receipt (Idempotent-Replayed). */
  readonly replayed: boolean;
  [field: string]: unknown;
}

export declare class LedgerError extends Error {
  constructor(message: string, options?: { operation?: Receipt | null; cause?: unknown });
  operation: Receipt | null;
}
export declare class OutcomeUnknown extends LedgerError {}
/** 409 idempotency-in-flight: another caller is sending this key now; ask again later. */
export declare class InFlight extends OutcomeUnknown {
  constructor(message: string, options?: { status?: number; problem?: Record<string, unknown>; operation?: Receipt | null });
  status: number;
  problem: Record<string, unknown>;
  detail: string;
  readonly retryAfter: number;
}
export declare class Rejected extends LedgerError {}
export declare class UnstorableResult extends LedgerError { value: unknown; }
export declare class InvalidInput extends LedgerError {}
export declare class ConfigurationError extends LedgerError {}
export declare class LedgerUnavailable extends LedgerError {}
export declare class ServerError extends LedgerUnavailable {
  status: number;
  problem: Record<string, unknown>;
}
export declare class UnexpectedResponse extends LedgerUnavailable {}
export declare class OutcomeNotRecorded extends LedgerUnavailable { value: unknown; }

export declare class ProblemError extends LedgerError {
  static readonly slug: string;
  constructor(message: string, options: { status: number; problem?: Record<string, unknown>; operation?: Receipt | null });
  status: number;
  problem: Record<string, unknown>;
  detail: string;
}
export declare class Unauthenticated extends ProblemError {}
export declare class PermissionDenied extends ProblemError {}
export declare class NotFound extends ProblemError {}
/** Also `instanceof InvalidInput`. */
export declare class InvalidRequest extends ProblemError {}
/** Also `instanceof InvalidInput`. */
export declare class MalformedBody extends ProblemError {}
/** Also `instanceof InvalidInput`. */
export declare class InvalidInputProblem extends ProblemError {}
export declare class HTTPError extends ProblemError {}
export declare class Refused extends ProblemError {}
export declare class IdempotencyKeyReused extends Refused {}
export declare class StaleVersion extends Refused {
  readonly currentState: string | null;
  readonly currentVersion: number | null;
}
export declare class IllegalTransition extends Refused {}
export declare class StaleFencingToken extends Refused { readonly currentToken: number | null; }
export declare class LeaseHeld extends Refused {}
export declare class AlreadyCommitted extends Refused { readonly result: unknown; }
export declare class StaleFact extends Refused {}
export declare class DependencyNotMet extends Refused {}
export declare class ApprovalRequired extends Refused {}
export declare class ApprovalDenied extends Refused { readonly reason: string | null; }
/** 409 validation-refused: the operation kind's validator refused the intent; nothing was sent. */
export declare class ValidationRefused extends Refused { readonly reason: string | null; }
export declare class SecondPersonRequired extends Refused {}
/** Also a LedgerUnavailable (a ServerError). */
export declare class InternalError extends ServerError {}

export declare const PROBLEM_TYPES: Record<string, new (...args: any[]) => LedgerError>;

export interface LedgerOptions {
  /** The agent key (default: LEDGER_AGENT_KEY). */
  key?: string;
  /** The default tenant of actions (none: the key's only tenant). */
  tenant?: string | null;
  /** Seconds per request (default 10). */
  timeout?: number;
  /** Seconds to keep trying to record an outcome after the call (default 30). */
  recordFor?: number;
  /** Seconds between looks at an approval (default 1). */
  approvalPoll?: number;
  /** Another fetch (a proxy's, a test's). */
  fetch?: typeof globalThis.fetch;
}

export interface ActionOptions<A extends unknown[], R> {
  target: string | ((...args: A) => string);
  /** The provider account the call acts as (a Stripe account, a mailbox): a non-secret
   * label, beside target; the ledger's reconcilers read as it. */
  account?: string | ((...args: A) => string | null | undefined) | null;
  /** The idempotency key of a call (outside `ledger.step`). */
  key?: (...args: A) => string | number;
  /** Error classes that mean "rejected by the external system" (nothing happened). */
  rejections?: Array<abstract new (...args: any[]) => unknown>;
  externalId?: (result: R) => unknown;
  tenant?: string | ((...args: A) => string | null | undefined) | null;
  retryPolicy?: "never" | "if_absent_proven";
  redact?: string[];
  fingerprintFields?: string[] | null;
  /** Dotted paths: only these fields of the intent leave the process. */
  keep?: string[] | null;
  inFlightFor?: number | null;
  /** Seconds to wait for people's approval (null: ApprovalRequired at once). */
  approvalTimeout?: number | null;
  approvalNote?: string;
  /** Seconds to wait for the outcome of a key another caller has in flight (default: none). */
  wait?: number | null;
}

export interface Action<A extends unknown[], R> {
  (...args: A): Promise<R>;
  /** The receipt of this call (same arguments: same key), or null; records nothing. */
  receipt(...args: A): Promise<Receipt | null>;
  readonly operationName: string;
}

export declare function stepKey(runId: string, stepId: string, call?: string | null): string;

export declare class Ledger {
  constructor(url?: string, options?: LedgerOptions);
  readonly url: string;
  tenant: string | null;
  recordFor: number;
  approvalPoll: number;
  action<A extends unknown[], R>(
    operation: string, options: ActionOptions<A, Awaited<R>>, fn: (...args: A) => R,
  ): Action<A, Awaited<R>>;
  step<T>(runId: string, stepId: string, fn: () => T): T;
  step<T>(runId: string, stepId: string, options: { fencingToken?: number | null }, fn: () => T): T;
  record(operation: string, options: {
    target: string; intent: Record<string, unknown>; idempotencyKey?: string | null;
    tenant?: string | null; run?: string | null; step?: string | null; call?: string | null;
    retryPolicy?: "never" | "if_absent_proven"; redact?: string[];
    fingerprintFields?: string[] | null; keep?: string[] | null;
  }): Promise<Receipt>;
  operation(operationId: string): Promise<Receipt>;
  retriesDue(options?: { operation?: string | null; tenant?: string | null }): Promise<Receipt[]>;
  resume(runId: string, options: { worker: string; ttlSeconds?: number | null; tenant?: string | null }): Promise<Receipt>;
  startRun(objective: string, options?: { runId?: string | null; tenant?: string | null }): Promise<Receipt>;
  addStep(runId: string, stepId: string, options?: { dependsOn?: string[]; tenant?: string | null; fencingToken?: number | null }): Promise<Receipt>;
}
