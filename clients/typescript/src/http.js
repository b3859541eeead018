// Requests to the ledger's API and their answers, over fetch.
// A request that could not even connect reached nothing, so it is tried again (a few times,
// briefly): that is always safe. Any other transport failure (a timeout, a dropped
// connection) may have reached the ledger: it is LedgerUnavailable and the caller decides.

import * as errors from "./errors.js";
import { Receipt } from "./receipt.js";

const PROBLEM = "application/problem+json";
const REPLAYED = "Idempotent-Replayed";
const CONNECT_DELAYS = [50, 200, 500]; // ms, after a refused connection: nothing was sent
const REFUSED = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "ECONNRESET_BEFORE_SEND"]);

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function describe(request) {
  return `${request.method} ${request.path}`;
}

function refusedConnection(exc) {
  let cause = exc;
  for (let depth = 0; cause && depth < 4; depth += 1) {
    if (REFUSED.has(cause.code)) return true;
    if (Array.isArray(cause.errors) && cause.errors.some((e) => REFUSED.has(e.code))) return true;
    cause = cause.cause;
  }
  return false;
}

function unavailable(request, url, exc) {
  const timedOut = exc?.name === "TimeoutError" || exc?.name === "AbortError";
  const kind = refusedConnection(exc) ? "could not connect"
    : timedOut ? "timed out" : `failed (${exc?.cause?.code ?? exc?.name ?? "error"})`;
  return new errors.LedgerUnavailable(
    `expected the ledger at ${url} to answer ${describe(request)}, found that the request ` +
    `${kind}: ${exc?.cause?.message ?? exc?.message ?? exc}`, { cause: exc });
}

export function problemError(problem, status) {
  const slug = problem.type.startsWith(errors.PROBLEM_PREFIX)
    ? problem.type.slice(errors.PROBLEM_PREFIX.length) : problem.type;
  let cls = errors.PROBLEM_TYPES[slug];
  if (!cls) cls = status >= 500 ? errors.InternalError : errors.ProblemError;
  const detail = String(problem.detail ?? "");
  const operation = problem.operation && typeof problem.operation === "object"
    ? new Receipt(problem.operation) : null;
  return new cls(`${problem.title ?? slug} (${status}): ${detail}`, { status, problem, operation });
}

async function answer(request, response) {
  const status = response.status;
  const contentType = (response.headers.get("content-type") ?? "").split(";")[0].trim();
  const text = await response.text();
  if (status >= 200 && status < 300) {
    let data;
    try {
      data = JSON.parse(text);
    } catch (exc) {
      throw new errors.UnexpectedResponse(
        `expected JSON from the ledger for ${describe(request)}, found ${status} with ` +
        `${contentType || "no content type"}: ${JSON.stringify(text.slice(0, 200))}`, { cause: exc });
    }
    // Served from the stored receipt (Receipt.replayed): nothing was recorded or sent.
    if (data && typeof data === "object" && !Array.isArray(data) &&
        (response.headers.get(REPLAYED) ?? "").toLowerCase() === "true") {
      data.replayed = true;
    }
    return data;
  }
  let problem = null;
  if (contentType === PROBLEM) {
    try { problem = JSON.parse(text); } catch { problem = null; }
  }
  if (!problem || typeof problem !== "object" || typeof problem.type !== "string") {
    const message = `expected the ledger's API to answer ${describe(request)}, found ${status} ` +
      `with ${contentType || "no content type"}: ${JSON.stringify(text.slice(0, 200))}`;
    if (status >= 500) throw new errors.ServerError(message, { status });
    throw new errors.UnexpectedResponse(message);
  }
  throw problemError(problem, status);
}

export class Transport {
  constructor(url, key, { timeout, fetch: fetchImpl }) {
    this.url = url;
    this.timeout = timeout;
    this.fetch = fetchImpl ?? globalThis.fetch;
    // not enumerable: never printed with the client
    Object.defineProperty(this, "headers", {
      value: { Authorization: `Bearer ${key}`, Accept: "application/json" }, enumerable: false,
    });
  }

  async send(request) {
    let target = this.url + request.path;
    if (request.params) {
      const query = new URLSearchParams();
      for (const [name, value] of Object.entries(request.params)) {
        if (value !== undefined && value !== null) query.append(name, String(value));
      }
      target += `?${query}`;
    }
    const headers = { ...this.headers, ...(request.headers ?? {}) };
    let body;
    if (request.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(request.json);
    }
    for (let attempt = 0; ; attempt += 1) {
      let response;
      try {
        response = await this.fetch(target, {
          method: request.method, headers, body,
          signal: AbortSignal.timeout(this.timeout * 1000),
        });
      } catch (exc) {
        if (refusedConnection(exc) && attempt < CONNECT_DELAYS.length) {
          await sleep(CONNECT_DELAYS[attempt]);
          continue;
        }
        throw unavailable(request, this.url, exc);
      }
      try {
        return await answer(request, response);
      } catch (exc) {
        if (exc instanceof errors.LedgerError) throw exc;
        throw unavailable(request, this.url, exc); // the body was cut off
      }
    }
  }
}
