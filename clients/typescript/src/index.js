// Agent Ledger's TypeScript/JavaScript client: the ledger's agent API over HTTP, with the
// Python client's meaning (clients/python, ledger_client).
//
// One lifecycle is two requests: the intent and its submission together
// (POST /api/v1/operations with submit: true), then the outcome.
// When the ledger cannot be reached:
// - before the call (intent or submission not acknowledged): the request carries a
//   Request-Id of this call and is sent again a few times (INTENT_RETRY_DELAYS); a submission
//   it made whose answer was lost is answered again (request_repeated), so the call is made
//   once. Still unanswered: the function is NOT called; LedgerUnavailable.
// - after the call: its outcome is recorded again with the same expected version, with
//   backoff, for up to `recordFor` seconds; the function is never called again. Still
//   unrecorded: OutcomeNotRecorded (the value on `.value`); the operation stays submitted
//   and the ledger's sweep turns it into outcome_unknown, as for a crashed sender.

import { AsyncLocalStorage } from "node:async_hooks";
import { createHash, randomBytes } from "node:crypto";
import * as errors from "./errors.js";
import { Transport, sleep } from "./http.js";
import { Receipt } from "./receipt.js";
import { withActionSpan } from "./tracing.js";

export * from "./errors.js";
export { Receipt } from "./receipt.js";

const OPERATIONS = "/api/v1/operations";
const RETRY_POLICIES = ["never", "if_absent_proven"];
const MAX_KEY = 200;
// ms before sending the intent again after its answer was lost (same Request-Id).
const INTENT_RETRY_DELAYS = [100, 500, 1000];

const scopes = new AsyncLocalStorage();

const enc = (text) => encodeURIComponent(text).replace(/[!'()*]/g,
  (c) => `%${c.charCodeAt(0).toString(16).toUpperCase()}`);

/** The idempotency key the ledger derives for a step's call:
 * `run:<run_id>/step:<step_id>[/call:<call>]`, each part percent-encoded; above 200
 * characters `run-step:sha256:<hex>` of that text. */
export function stepKey(runId, stepId, call = null) {
  const parts = [`run:${enc(runId)}`, `step:${enc(stepId)}`];
  if (call !== null && call !== undefined) parts.push(`call:${enc(call)}`);
  let key = parts.join("/");
  if (key.length > MAX_KEY) key = `run-step:sha256:${createHash("sha256").update(key).digest("hex")}`;
  return key;
}

const show = (value) => {
  try { return JSON.stringify(value) ?? String(value); } catch { return String(value); }
};

export class Ledger {
  /**
   * A connection to one ledger with one agent key. `url` and `key` default to LEDGER_URL and
   * LEDGER_AGENT_KEY. `timeout`: seconds per request; `recordFor`: seconds to keep trying to
   * record an outcome after the call; `tenant`: the default tenant of actions.
   */
  constructor(url, { key, tenant = null, timeout = 10, recordFor = 30, approvalPoll = 1,
    fetch } = {}) {
    const env = globalThis.process?.env ?? {};
    url = url ?? env.LEDGER_URL;
    key = key ?? env.LEDGER_AGENT_KEY;
    if (!url) {
      throw new errors.ConfigurationError(
        "expected the ledger's URL (new Ledger(url) or LEDGER_URL), found none");
    }
    if (!key) {
      throw new errors.ConfigurationError(
        "expected an agent key (new Ledger(url, {key}) or LEDGER_AGENT_KEY), found none");
    }
    this.url = url.replace(/\/+$/, "");
    this.tenant = tenant;
    this.recordFor = recordFor;
    this.approvalPoll = approvalPoll;
    Object.defineProperty(this, "transport", {
      value: new Transport(this.url, key, { timeout, fetch }), enumerable: false,
    });
  }

  toString() { return `<Ledger ${this.url}>`; } // never the key

  [Symbol.for("nodejs.util.inspect.custom")]() { return this.toString(); }

  /**
   * Make `fn`'s external side effect happen at most once per idempotency key. Returns an
   * async function with fn's arguments; its `.receipt(...args)` reads the receipt of a call.
   * The intent: the call's single plain-object argument, else `{args: [...]}`.
   */
  action(operation, options, fn) {
    const spec = declare(operation, options ?? {});
    if (typeof fn !== "function") {
      throw new errors.InvalidInput(`expected a function for action ${operation}, found ${typeof fn}`);
    }
    const ledger = this;
    const wrapper = async function (...args) {
      const prepared = prepare(spec, ledger, args);
      return withActionSpan(operation, (span) => ledger.#lifecycle(spec, prepared, span,
        () => fn.apply(this, args)));
    };
    wrapper.receipt = async (...args) => ledger.#find(spec, args);
    wrapper.operationName = operation;
    Object.defineProperty(wrapper, "name", { value: fn.name || operation });
    return wrapper;
  }

  // The intent request's answer; sent again with the same Request-Id after a lost answer (a
  // timeout, a dropped connection): a submission the lost one made is answered again, so
  // nothing is left looking sent that this call did not send. `wait`: seconds to keep
  // asking while another caller has the key in flight.
  async #intent(request, wait) {
    const deadline = wait ? Date.now() + wait * 1000 : null;
    for (let lost = 0; ; ) {
      let delay;
      try {
        return await this.transport.send(request);
      } catch (exc) {
        if (exc instanceof errors.InFlight) {
          const remaining = deadline === null ? 0 : deadline - Date.now();
          if (remaining <= 0) throw exc;
          delay = Math.min(exc.retryAfter * 1000, remaining);
        } else if (exc instanceof errors.LedgerUnavailable && lost < INTENT_RETRY_DELAYS.length &&
                   !exc.message.includes("could not connect")) {
          delay = INTENT_RETRY_DELAYS[lost];
          lost += 1;
        } else {
          throw exc;
        }
      }
      await sleep(delay);
    }
  }

  async #lifecycle(spec, prepared, span, call) {
    const body = { ...prepared.body, submit: true };
    const traceparent = span.traceparent();
    const headers = { "Request-Id": `req-${randomBytes(24).toString("base64url")}` };
    if (traceparent) headers.traceparent = traceparent;
    let data;
    try {
      data = await this.#intent({ method: "POST", path: OPERATIONS, json: body, headers }, spec.wait);
    } catch (exc) {
      if (!(exc instanceof errors.ApprovalRequired) || spec.approvalTimeout === null || !exc.operation) {
        throw exc;
      }
      data = await this.#awaitApproval(spec, prepared, exc.operation);
    }
    const receipt = new Receipt(data);
    span.record(receipt);
    if (!data.submitted_now) return settled(receipt);
    const marks = { expected_version: receipt.version, fencing_token: prepared.fencingToken };
    let value;
    try {
      value = await call();
    } catch (exc) {
      const rejected = spec.rejections.some((cls) => exc instanceof cls);
      const [code, detail] = failureRecord(exc);
      try {
        const final = await this.#record(receipt, rejected ? "rejected" : "outcome_unknown",
          { ...marks, error_code: code, detail });
        span.record(final);
      } catch (failure) {
        if (!(failure instanceof errors.OutcomeNotRecorded)) throw failure;
        if (exc && typeof exc === "object") exc.ledgerNotRecorded = failure;
      }
      throw exc;
    }
    const payload = { ...marks, external_id: externalId(spec.externalId, value) };
    const why = notJson(value, "result");
    if (why) payload.result_unstorable = why.slice(0, 300);
    else payload.result = value === undefined ? null : value;
    const final = await this.#record(receipt, "succeeded", payload, value);
    span.record(final);
    if (final.result_unstorable) {
      throw new errors.UnstorableResult(
        `expected the return value of ${spec.operation} to be storable JSON, found ` +
        `${final.result_unstorable}; operation ${final.operation_id} is recorded as succeeded ` +
        "without its result; the value is on this error's .value", { operation: final, value });
    }
    return value;
  }

  // Record the call's outcome, again and again with the same expected version until the
  // ledger has it or recordFor has passed. A repeat that finds the outcome already there (its
  // first try landed unanswered) is success.
  async #record(receipt, outcome, payload, value) {
    const path = `${OPERATIONS}/${receipt.operation_id}/${outcome.replace("_", "-")}`;
    const deadline = Date.now() + this.recordFor * 1000;
    let delay = 50;
    for (;;) {
      try {
        try {
          return new Receipt(await this.transport.send({ method: "POST", path, json: payload }));
        } catch (exc) {
          if (!(exc instanceof errors.StaleVersion || exc instanceof errors.IllegalTransition)) throw exc;
          const current = new Receipt(await this.transport.send(
            { method: "GET", path: `${OPERATIONS}/${receipt.operation_id}` }));
          if (current.state !== outcome) {
            throw new errors.OutcomeNotRecorded(
              `expected operation ${receipt.operation_id} still submitted to record it ` +
              `${outcome}, found it ${current.state}: the call was made and is not made again`,
              { operation: current, value, cause: exc });
          }
          return current;
        }
      } catch (exc) {
        if (exc instanceof errors.OutcomeNotRecorded || !(exc instanceof errors.LedgerUnavailable)) throw exc;
        if (Date.now() + delay > deadline) {
          throw new errors.OutcomeNotRecorded(
            `expected the ledger to record operation ${receipt.operation_id} ${outcome} within ` +
            `${this.recordFor} s, found it unreachable (${exc.message}); the call was made and ` +
            "is not made again: the operation stays submitted until the ledger's sweep hands " +
            "it to reconciliation", { operation: receipt, value, cause: exc });
        }
        await sleep(delay);
        delay = Math.min(delay * 2, 2000);
      }
    }
  }

  // Ask for approval, wait for the decision; the submitted operation's data.
  async #awaitApproval(spec, prepared, receipt) {
    const path = `${OPERATIONS}/${receipt.operation_id}`;
    await this.transport.send({ method: "POST", path: `${path}/approval-request`,
      json: { note: spec.approvalNote } });
    const deadline = Date.now() + spec.approvalTimeout * 1000;
    for (;;) {
      let data = await this.transport.send({ method: "GET", path });
      const approval = data.approval ?? {};
      if (approval.status === "denied") {
        const reason = approval.denied_reason ?? null;
        throw new errors.ApprovalDenied(
          `expected operation ${receipt.operation_id} approved, found it denied: ${reason}`,
          { status: 409, operation: new Receipt(data), problem: { reason, detail: "denied" } });
      }
      if (data.state !== "planned") return { ...data, submitted_now: false };
      if (approval.status === "approved" || approval.status === "not_required") {
        const submit = { expected_version: data.version, fencing_token: prepared.fencingToken,
          in_flight_seconds: spec.inFlightSeconds };
        try {
          data = await this.transport.send({ method: "POST", path: `${path}/submitted`, json: submit });
        } catch (exc) {
          if (!(exc instanceof errors.StaleVersion)) throw exc;
          return { ...(await this.transport.send({ method: "GET", path })), submitted_now: false };
        }
        return { ...data, submitted_now: true };
      }
      const remaining = deadline - Date.now();
      if (remaining <= 0) {
        throw new errors.ApprovalRequired(
          `expected a decision on operation ${receipt.operation_id} within ` +
          `${spec.approvalTimeout} s, found none (${approval.live} of ${approval.needed} ` +
          "approvals); it is recorded and not sent",
          { status: 409, operation: new Receipt(data),
            problem: { approvals_needed: approval.needed, approvals_live: approval.live } });
      }
      await sleep(Math.min(this.approvalPoll * 1000, remaining));
    }
  }

  async #find(spec, args) {
    const [key, tenant] = lookup(spec, this, args);
    const params = { operation: spec.operation, idempotency_key: key, limit: 1 };
    if (tenant) params.tenant = tenant;
    const page = await this.transport.send({ method: "GET", path: OPERATIONS, params });
    if (!page || !Array.isArray(page.items)) {
      throw new errors.UnexpectedResponse(`expected a page of operations, found ${show(page).slice(0, 200)}`);
    }
    return page.items.length ? new Receipt(page.items[0]) : null;
  }

  // --- the rest of the agent API ------------------------------------------------------------

  /** Actions called inside `fn` belong to the run's step: their keys derive from it and
   * `fencingToken` (from `resume`) fences every write. Returns what `fn` returns. */
  step(runId, stepId, options, fn) {
    if (typeof options === "function") [options, fn] = [{}, options];
    const { fencingToken = null } = options ?? {};
    for (const [name, value] of [["runId", runId], ["stepId", stepId]]) {
      if (typeof value !== "string" || !value) {
        throw new errors.InvalidInput(`expected ${name} to be a non-empty string, found ${show(value)}`);
      }
    }
    if (fencingToken !== null && !Number.isInteger(fencingToken)) {
      throw new errors.InvalidInput(`expected fencingToken to be an integer or null, found ${show(fencingToken)}`);
    }
    return scopes.run({ runId, stepId, fencingToken, calls: new Map() }, fn);
  }

  /** Record an intent without submitting it (the Python client's `record`): the planned
   * operation, or the existing one of the same key and intent (`.replayed` true, its state as
   * it stands: do not send unless it is planned or safe_to_retry). IdempotencyKeyReused for
   * another intent. */
  async record(operation, { target, intent, idempotencyKey = null, tenant = null, run = null,
    step = null, call = null, retryPolicy = "if_absent_proven", redact = [],
    fingerprintFields = null, keep = null } = {}) {
    if (!intent || typeof intent !== "object" || Array.isArray(intent)) {
      throw new errors.InvalidInput(`expected intent to be an object, found ${show(intent)}`);
    }
    if (!RETRY_POLICIES.includes(retryPolicy)) {
      throw new errors.InvalidInput(`expected retryPolicy in ${show(RETRY_POLICIES)}, found ${show(retryPolicy)}`);
    }
    const body = { operation, target, intent, retry_policy: retryPolicy, redact: paths(redact, "redact") };
    for (const [name, value] of [["idempotency_key", idempotencyKey], ["tenant", tenant ?? this.tenant],
      ["run", run], ["step", step], ["call", call]]) {
      if (value !== null && value !== undefined) body[name] = value;
    }
    if (fingerprintFields !== null) body.fingerprint_fields = paths(fingerprintFields, "fingerprintFields");
    if (keep !== null) body.keep = paths(keep, "keep");
    return new Receipt(await this.transport.send({ method: "POST", path: OPERATIONS, json: body }));
  }

  /** The receipt with its events, evidence and approval status. */
  async operation(operationId) {
    return new Receipt(await this.transport.send({ method: "GET", path: `${OPERATIONS}/${operationId}` }));
  }

  /** The operations waiting in safe_to_retry, oldest first. The ledger never sends them: call
   * the action again with the same arguments (same key) to send attempt+1. */
  async retriesDue({ operation = null, tenant = null } = {}) {
    const params = { state: "safe_to_retry", limit: 200 };
    if (operation) params.operation = operation;
    if (tenant) params.tenant = tenant;
    const found = [];
    for (;;) {
      const page = await this.transport.send({ method: "GET", path: OPERATIONS, params });
      found.push(...page.items.map((item) => new Receipt(item)));
      if (!page.next_cursor) break;
      params.cursor = page.next_cursor;
    }
    const order = (r) => [r.state_changed_at ?? "", r.operation_id];
    return found.sort((a, b) => {
      const [x, y] = [order(a), order(b)];
      return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : x[1] < y[1] ? -1 : x[1] > y[1] ? 1 : 0;
    });
  }

  /** Take over the run (its lease) and get its hand-off view: `.token`, `.steps`,
   * `.open_operations`, `.pending_obligations`, `.facts`. LeaseHeld while another holds it.
   * `tenant` (default: the client's): the run's, run ids being unique per tenant. */
  async resume(runId, { worker, ttlSeconds = null, tenant = null } = {}) {
    const body = { worker };
    if (ttlSeconds !== null) body.ttl_seconds = ttlSeconds;
    return new Receipt(await this.transport.send({
      method: "POST", path: `/api/v1/runs/${enc(runId)}/resume`, json: body,
      params: { tenant: tenant ?? this.tenant } }));
  }

  /** Start a run (idempotent on runId). */
  async startRun(objective, { runId = null, tenant = null } = {}) {
    return new Receipt(await this.transport.send({ method: "POST", path: "/api/v1/runs",
      json: { objective, run_id: runId, tenant: tenant ?? this.tenant } }));
  }

  /** Add a step to a run (idempotent); `tenant` as for `resume`. Once the run is leased,
   * pass its `fencingToken` (`resume(...).token`): without it, or with an older one,
   * StaleFencingToken and nothing is added. */
  async addStep(runId, stepId, { dependsOn = [], tenant = null, fencingToken = null } = {}) {
    if (fencingToken !== null && !Number.isInteger(fencingToken)) {
      throw new errors.InvalidInput(`expected fencingToken to be an integer or null, found ${show(fencingToken)}`);
    }
    const json = { step_id: stepId, depends_on: [...dependsOn] };
    if (fencingToken !== null) json.fencing_token = fencingToken;
    return new Receipt(await this.transport.send({ method: "POST",
      path: `/api/v1/runs/${enc(runId)}/steps`, json,
      params: { tenant: tenant ?? this.tenant } }));
  }
}

// --- a declared action ------------------------------------------------------------------------

function paths(value, name) {
  if (typeof value === "string" || !Array.isArray(value)) {
    throw new errors.InvalidInput(`expected ${name} to be a list of dotted paths, found ${show(value)}`);
  }
  for (const path of value) {
    if (typeof path !== "string" || !path || path.split(".").some((p) => !p)) {
      throw new errors.InvalidInput(`expected ${name} to hold dotted paths, found ${show(path)}`);
    }
  }
  return [...value];
}

// Checked once, where the action is declared.
function declare(operation, options) {
  const { target, key = null, rejections = [], externalId = null, tenant = null,
    retryPolicy = "if_absent_proven", redact = [], fingerprintFields = null, keep = null,
    inFlightFor = null, approvalTimeout = null, approvalNote = "", account = null, wait = null } = options;
  if (typeof operation !== "string" || !operation) {
    throw new errors.InvalidInput(`expected an operation name, found ${show(operation)}`);
  }
  if (target === undefined || target === null) {
    throw new errors.InvalidInput("expected target (a string or a function), found none");
  }
  for (const [name, value] of [["target", target], ["tenant", tenant], ["account", account]]) {
    if (value !== null && typeof value !== "function" && typeof value !== "string") {
      throw new errors.InvalidInput(`expected ${name} to be a string or a function of the call's arguments, found ${show(value)}`);
    }
  }
  for (const [name, value] of [["key", key], ["externalId", externalId]]) {
    if (value !== null && typeof value !== "function") {
      throw new errors.InvalidInput(`expected ${name} to be a function or null, found ${typeof value}`);
    }
  }
  if (!Array.isArray(rejections) || !rejections.every((r) => typeof r === "function")) {
    throw new errors.InvalidInput(`expected rejections to be a list of error classes, found ${show(rejections)}`);
  }
  if (!RETRY_POLICIES.includes(retryPolicy)) {
    throw new errors.InvalidInput(`expected retryPolicy in ${show(RETRY_POLICIES)}, found ${show(retryPolicy)}`);
  }
  if (approvalTimeout !== null && (typeof approvalTimeout !== "number" || !(approvalTimeout >= 0))) {
    throw new errors.InvalidInput(`expected approvalTimeout to be seconds or null, found ${show(approvalTimeout)}`);
  }
  if (wait !== null && (typeof wait !== "number" || !(wait >= 0) || wait === Infinity)) {
    throw new errors.InvalidInput(`expected wait to be seconds or null, found ${show(wait)}`);
  }
  return {
    operation, target, key, rejections, externalId, tenant, retryPolicy, wait,
    redact: paths(redact, "redact"),
    fingerprintFields: fingerprintFields === null ? null : paths(fingerprintFields, "fingerprintFields"),
    keep: keep === null ? null : paths(keep, "keep"),
    inFlightSeconds: inFlightFor, approvalTimeout, approvalNote, account,
  };
}

function valueOf(spec, name, value, args) {
  if (typeof value === "function") {
    value = value(...args);
    if (value !== null && value !== undefined && (typeof value !== "string" || !value)) {
      throw new errors.InvalidInput(`expected ${name} of ${spec.operation} to return a non-empty string, found ${show(value)}`);
    }
  }
  return value ?? null;
}

const isPlainObject = (value) => value !== null && typeof value === "object"
  && (Object.getPrototypeOf(value) === Object.prototype || Object.getPrototypeOf(value) === null);

// [idempotency key, call, scope]. In a step the key is left to the ledger, which derives it.
function keyOf(spec, args, advance) {
  const scope = scopes.getStore();
  if (scope) {
    let n = scope.calls.get(spec.operation) ?? 0;
    if (advance) scope.calls.set(spec.operation, (n += 1));
    n = Math.max(n, 1);
    return [null, n > 1 ? String(n) : null, scope];
  }
  if (!spec.key) {
    throw new errors.InvalidInput(
      `expected a key for action ${spec.operation}: call it inside ledger.step(runId, stepId, fn) ` +
      "or give ledger.action a key function, found neither (a generated key would send again after a crash)");
  }
  const value = spec.key(...args);
  if (!((typeof value === "string" && value) || (typeof value === "number" && Number.isInteger(value)))) {
    throw new errors.InvalidInput(`expected key of ${spec.operation} to return a non-empty string, found ${show(value)}`);
  }
  return [String(value), null, null];
}

function prepare(spec, ledger, args) {
  let intent = args.length === 1 && isPlainObject(args[0]) ? { ...args[0] } : { args: [...args] };
  const why = notJson(intent, "intent");
  if (why) {
    throw new errors.InvalidInput(`expected the arguments of ${spec.operation} to be JSON, found ${why}; nothing was sent`);
  }
  intent = JSON.parse(JSON.stringify(intent));
  if (spec.keep !== null) intent = kept(intent, spec.keep);
  const [idem, call, scope] = keyOf(spec, args, true);
  const body = {
    operation: spec.operation,
    target: valueOf(spec, "target", spec.target, args),
    intent,
    retry_policy: spec.retryPolicy,
    redact: spec.redact,
  };
  const tenant = valueOf(spec, "tenant", spec.tenant, args) ?? ledger.tenant;
  if (tenant) body.tenant = tenant;
  const account = valueOf(spec, "account", spec.account, args);
  if (account) body.account = account;
  if (spec.fingerprintFields !== null) body.fingerprint_fields = spec.fingerprintFields;
  if (scope) {
    body.run = scope.runId;
    body.step = scope.stepId;
    if (call !== null) body.call = call;
  } else {
    body.idempotency_key = idem;
  }
  const token = scope ? scope.fencingToken : null;
  if (token !== null) body.fencing_token = token;
  if (spec.inFlightSeconds !== null) body.in_flight_seconds = spec.inFlightSeconds;
  return { body, fencingToken: token };
}

function lookup(spec, ledger, args) {
  let [idem, call, scope] = keyOf(spec, args, false);
  if (scope) idem = stepKey(scope.runId, scope.stepId, call);
  return [idem, valueOf(spec, "tenant", spec.tenant, args) ?? ledger.tenant];
}

// --- helpers --------------------------------------------------------------------------------

// What a call of a key that is not to be sent gets: the stored result or an error.
function settled(receipt) {
  const state = receipt.state;
  if (state === "succeeded") {
    if (receipt.result_unstorable) {
      throw new errors.UnstorableResult(
        `expected a stored result of operation ${receipt.operation_id} (${receipt.operation}), ` +
        `found none: ${receipt.result_unstorable}; it succeeded (external id ` +
        `${receipt.external_id || "none"}) and is not sent again`, { operation: receipt });
    }
    return receipt.result ?? null;
  }
  if (state === "rejected" || state === "abandoned") {
    const code = receipt.error_code;
    throw new errors.Rejected(
      `expected operation ${receipt.operation_id} (${receipt.operation}, key ` +
      `${receipt.idempotency_key}) to be sendable, found it ${state}` +
      (code ? ` with code ${code}` : "") + "; it is not sent again", { operation: receipt });
  }
  if (state === "submitted") { // another caller is sending it (a ledger without the 409)
    throw new errors.InFlight(
      `expected operation ${receipt.operation_id} (${receipt.operation}, key ` +
      `${receipt.idempotency_key}) planned, safe_to_retry or succeeded, found submitted: ` +
      "another caller is sending it now; it is not sent again, ask again shortly for its " +
      "outcome", { operation: receipt, problem: { retry_after: 1, detail: "in flight" } });
  }
  throw new errors.OutcomeUnknown(
    `expected operation ${receipt.operation_id} (${receipt.operation}, key ` +
    `${receipt.idempotency_key}) planned, safe_to_retry or succeeded, found ${state}: an ` +
    "earlier attempt was sent and its effect is not proven; it is not sent again until " +
    "reconciliation or a person decides", { operation: receipt });
}

// Only the fields at `paths` (dotted); the rest never leaves the process.
function kept(intent, keepPaths) {
  const out = {};
  for (const path of keepPaths) {
    const parts = path.split(".");
    let source = intent;
    let found = true;
    for (const part of parts) {
      if (!isPlainObject(source) || !Object.hasOwn(source, part)) { found = false; break; }
      source = source[part];
    }
    if (!found) continue;
    let into = out;
    for (const part of parts.slice(0, -1)) into = (into[part] ??= {});
    into[parts.at(-1)] = source;
  }
  return out;
}

// "" when `value` is JSON; else where and what it is not (`intent.items[3].n: a Set`).
export function notJson(value, what) {
  const stack = [[value, what]];
  const seen = new Set();
  while (stack.length) {
    const [item, path] = stack.pop();
    if (item === null || typeof item === "string" || typeof item === "boolean") continue;
    if (typeof item === "number") {
      if (!Number.isFinite(item)) return `${path}: ${item} (not a finite number)`;
      continue;
    }
    if (Array.isArray(item) || isPlainObject(item)) {
      if (seen.has(item)) return `${path}: a container that contains itself`;
      seen.add(item);
      if (Array.isArray(item)) item.forEach((v, i) => stack.push([v, `${path}[${i}]`]));
      else for (const [k, v] of Object.entries(item)) if (v !== undefined) stack.push([v, `${path}.${k}`]);
      continue;
    }
    if (item === undefined) return `${path}: undefined`;
    return `${path}: a ${typeof item === "object" ? item.constructor?.name ?? "object" : typeof item}`;
  }
  return "";
}

function externalId(extract, value) {
  if (!extract) return null;
  let text;
  try {
    const found = extract(value);
    text = found === null || found === undefined ? null : String(found);
  } catch {
    return null; // the effect happened; the id is a nicety
  }
  text = text === null ? null : text.trim().slice(0, 500);
  return text || null;
}

// [error_code, detail]: the error's class name and its message.
function failureRecord(exc) {
  const code = exc?.constructor?.name || exc?.name || typeof exc;
  let detail;
  try {
    detail = exc instanceof Error ? exc.message : String(exc);
  } catch {
    detail = `<${code} whose message cannot be read>`;
  }
  return [code, detail.slice(0, 4000)];
}
