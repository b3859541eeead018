// The client against a real ledger server (uvicorn on config.asgi) with a database of its own.

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as client from "../src/index.js";
import { LedgerServer, PYTHON, ROOT, calls, fixture, unique } from "./support.js";

const { Ledger } = client;
let server;
let secret;

before(async () => {
  await fixture("setup");
  secret = (await fixture("key", unique("ts-bot-"), "default")).secret;
  server = await LedgerServer.create(join(mkdtempSync(join(tmpdir(), "ledger-ts-")), "server.log"));
}, { timeout: 180_000 });

after(async () => { await server?.kill(); });

const ledger = (options = {}) => new Ledger(server.url, { key: secret, recordFor: 60, approvalPoll: 0.1, ...options });
const byValue = (v) => v;

async function ensureUp() {
  if (!server.running) await server.start();
}

describe("the client's errors", () => {
  test("every problem type of the API has its error class, as in the Python client", () => {
    const slugs = JSON.parse(execFileSync(PYTHON, ["-c",
      "import json; from api.problems import KINDS; print(json.dumps(sorted({k[2] for k in KINDS} | {'invalid-request', 'malformed-body', 'http-error', 'internal-error'})))"],
    { cwd: ROOT, encoding: "utf8", env: { ...process.env, DJANGO_SETTINGS_MODULE: "config.settings" } }));
    const python = JSON.parse(execFileSync(PYTHON, ["-c",
      "import json, sys; sys.path.insert(0, 'clients/python'); from ledger_client.errors import PROBLEM_TYPES; print(json.dumps(sorted(PROBLEM_TYPES)))"],
    { cwd: ROOT, encoding: "utf8" }));
    for (const slug of [...slugs, ...python]) {
      assert.ok(client.PROBLEM_TYPES[slug], `expected an error class for problem type ${slug}`);
    }
    assert.ok(new client.InvalidRequest("x", { status: 422, problem: {} }) instanceof client.InvalidInput);
    assert.ok(new client.InternalError("x", { status: 500 }) instanceof client.LedgerUnavailable);
  });

  test("no URL or key is a configuration error", () => {
    const saved = [process.env.LEDGER_URL, process.env.LEDGER_AGENT_KEY];
    delete process.env.LEDGER_URL;
    delete process.env.LEDGER_AGENT_KEY;
    try {
      assert.throws(() => new Ledger(), client.ConfigurationError);
      assert.throws(() => new Ledger("http://x"), /LEDGER_AGENT_KEY/);
    } finally {
      if (saved[0] !== undefined) process.env.LEDGER_URL = saved[0];
      if (saved[1] !== undefined) process.env.LEDGER_AGENT_KEY = saved[1];
    }
  });
});

describe("the lifecycle", () => {
  test("the environment names the ledger and the key; the key is never shown", async () => {
    process.env.LEDGER_URL = server.url;
    process.env.LEDGER_AGENT_KEY = secret;
    try {
      const fromEnv = new Ledger();
      assert.ok(!String(fromEnv).includes(secret) && !JSON.stringify(fromEnv).includes(secret));
      const act = fromEnv.action(unique("env.op"), { target: "https://x", key: byValue }, calls("ok"));
      assert.equal(await act("k"), "ok");
    } finally {
      delete process.env.LEDGER_URL;
      delete process.env.LEDGER_AGENT_KEY;
    }
  });

  test("one send per key under retries; the stored result without calling", async () => {
    const send = calls((article) => ({ id: 42, slug: article.slug }));
    const act = ledger().action(unique("cms.create"), {
      target: "https://cms", key: (a) => a.slug, externalId: (r) => r.id }, send);
    const first = await act({ slug: "hello", body: "b" });
    const again = await Promise.all([act({ slug: "hello", body: "b" }), act({ slug: "hello", body: "b" })]);
    assert.deepEqual(first, { id: 42, slug: "hello" });
    assert.deepEqual(again, [first, first]);
    assert.equal(send.count, 1);
    const receipt = await act.receipt({ slug: "hello", body: "b" });
    assert.equal(receipt.state, "succeeded");
    assert.equal(receipt.external_id, "42");
    assert.deepEqual(receipt.intent, { slug: "hello", body: "b" });
    assert.equal(await act.receipt({ slug: "never" }), null);
  });

  test("a sync function works as an async one", async () => {
    let count = 0;
    const act = ledger().action(unique("sync.op"), { target: "https://x", key: byValue }, (v) => { count += 1; return v * 2; });
    assert.equal(await act(21), 42);
    assert.equal(await act(21), 42);
    assert.equal(count, 1);
  });

  test("a timeout after the effect is outcome_unknown, and later calls are OutcomeUnknown without calling", async () => {
    class TimeoutError extends Error {}
    const send = calls(null, () => new TimeoutError("read timed out"));
    const act = ledger().action(unique("pay.send"), { target: "https://pay", key: byValue }, send);
    await assert.rejects(act("p1"), TimeoutError);
    await assert.rejects(act("p1"), (exc) => exc instanceof client.OutcomeUnknown
      && !(exc instanceof client.InFlight) && exc.operation.replayed === true
      && exc.operation.state === "outcome_unknown" && /not sent again/.test(exc.message));
    assert.equal(send.count, 1);
    const receipt = await act.receipt("p1");
    assert.equal(receipt.error_code, "TimeoutError");
    assert.equal(receipt.replayed, false);
  });

  test("a key another call is sending is InFlight (409, Retry-After), never a bare OutcomeUnknown", async () => {
    let release;
    const gate = new Promise((ok) => { release = ok; });
    const send = calls(async (v) => { await gate; return { sent: v }; });
    const act = ledger().action(unique("pay.charge"), { target: "https://psp", key: byValue }, send);
    const first = act("c1");
    while (send.count === 0) await new Promise((ok) => setTimeout(ok, 10));
    await assert.rejects(act("c1"), (exc) => exc instanceof client.InFlight
      && exc instanceof client.OutcomeUnknown && exc.status === 409 && exc.retryAfter === 1
      && exc.operation.state === "submitted" && /another caller is sending it now/.test(exc.message));
    release();
    assert.deepEqual(await first, { sent: "c1" });
    assert.deepEqual(await act("c1"), { sent: "c1" });
    assert.equal(send.count, 1);
  });

  test("a lost answer to the intent is asked again with the same Request-Id: the call is made once", async () => {
    const ids = [];
    let dropped = 0;
    const losing = async (url, init) => {
      const response = await fetch(url, init);
      if (init.method === "POST" && new URL(url).pathname === "/api/v1/operations") {
        ids.push(init.headers["Request-Id"]);
        if (dropped === 0) {
          dropped += 1;
          await response.text(); // it reached the ledger; its answer is lost on the way back
          throw new TypeError("fetch failed", { cause: { code: "ECONNRESET", message: "socket hang up" } });
        }
      }
      return response;
    };
    const send = calls(async (v) => ({ sent: v }));
    const act = ledger({ fetch: losing }).action(unique("mail.send"), { target: "smtp://m", key: byValue }, send);
    assert.deepEqual(await act("l1"), { sent: "l1" });
    assert.deepEqual(await act("l1"), { sent: "l1" }); // the stored result
    assert.equal(dropped, 1);
    assert.equal(send.count, 1);
    assert.ok(/^req-/.test(ids[0]) && ids[0] === ids[1] && ids[2] !== ids[0], ids.join(" "));
  });

  test("wait: a call that finds its key in flight gets the other caller's outcome, not sent again", async () => {
    let release;
    const gate = new Promise((ok) => { release = ok; });
    const send = calls(async (v) => { await gate; return { sent: v }; });
    const name = unique("pay.charge");
    const first = ledger().action(name, { target: "https://psp", key: byValue }, send)("w1");
    const patient = ledger().action(name, { target: "https://psp", key: byValue, wait: 30 }, send);
    const hasty = ledger().action(name, { target: "https://psp", key: byValue, wait: 0.3 }, send);
    while (send.count === 0) await new Promise((ok) => setTimeout(ok, 10));
    await assert.rejects(hasty("w1"), (exc) => exc instanceof client.InFlight);
    const waited = patient("w1");
    setTimeout(release, 1500);
    assert.deepEqual(await first, { sent: "w1" });
    assert.deepEqual(await waited, { sent: "w1" });
    assert.equal(send.count, 1);
    assert.throws(() => ledger().action(name, { target: "t", key: byValue, wait: -1 }, send),
      (exc) => exc instanceof client.InvalidInput && /wait/.test(exc.message));
  });

  test("record: an intent recorded without submitting; the same again is a replay; an action of the key sends it", async () => {
    const name = unique("mail.send");
    const first = await ledger().record(name, { target: "smtp://m", intent: { to: "r1" }, idempotencyKey: "r1" });
    assert.equal(first.state, "planned");
    assert.ok(!first.replayed);
    const again = await ledger().record(name, { target: "smtp://m", intent: { to: "r1" }, idempotencyKey: "r1" });
    assert.equal(again.operation_id, first.operation_id);
    assert.equal(again.replayed, true);
    await assert.rejects(ledger().record(name, { target: "smtp://m", intent: { to: "other" }, idempotencyKey: "r1" }),
      (exc) => exc instanceof client.IdempotencyKeyReused);
    await assert.rejects(ledger().record(name, { target: "smtp://m", intent: [1], idempotencyKey: "r2" }),
      (exc) => exc instanceof client.InvalidInput);
    const send = calls(async (intent) => ({ sent: intent.to }));
    const act = ledger().action(name, { target: "smtp://m", key: (intent) => intent.to }, send);
    assert.deepEqual(await act({ to: "r1" }), { sent: "r1" });
    assert.equal(send.count, 1);
  });

  test("a rejection is recorded, re-raised, and later calls are Rejected without calling", async () => {
    class Declined extends Error {}
    const send = calls(null, () => new Declined("card declined"));
    const act = ledger().action(unique("pay.charge"), { target: "https://pay", key: byValue, rejections: [Declined] }, send);
    await assert.rejects(act("c1"), Declined);
    await assert.rejects(act("c1"), (exc) => exc instanceof client.Rejected && /Declined/.test(exc.message));
    assert.equal(send.count, 1);
  });

  test("keep sends only the kept fields; tenant and target may be functions", async () => {
    const act = ledger().action(unique("mail.send"), {
      target: (m) => `mailto:${m.to}`, tenant: () => "default", key: (m) => m.id, keep: ["to", "meta.kind"] },
    calls("sent"));
    await act({ id: "m1", to: "a@example.com", body: "secret text", meta: { kind: "x", token: "t" } });
    const receipt = await act.receipt({ id: "m1" });
    assert.deepEqual(receipt.intent, { to: "a@example.com", meta: { kind: "x" } });
    assert.equal(receipt.target, "mailto:a@example.com");
  });

  test("the provider account is a value or a function of the call, on the receipt", async () => {
    const act = ledger().action(unique("payments.refund"), {
      target: "https://api.stripe.example/v1/refunds", account: (r) => `acct_${r.shop}`,
      key: (r) => r.charge },
    calls({ id: "re_1" }));
    await act({ shop: "acme", charge: "ch_1" });
    const receipt = await act.receipt({ shop: "acme", charge: "ch_1" });
    assert.equal(receipt.account, "acct_acme");
    assert.throws(() => ledger().action("x.y", { target: "t", account: 42, key: () => "k" }),
      client.InvalidInput);
  });

  test("arguments that are not JSON, or no key, are refused before anything is sent", async () => {
    const send = calls();
    const act = ledger().action(unique("x.y"), { target: "https://x", key: () => "k" }, send);
    await assert.rejects(act({ when: new Date() }), (exc) => exc instanceof client.InvalidInput && /intent.when: a Date/.test(exc.message));
    const keyless = ledger().action(unique("x.y"), { target: "https://x" }, send);
    await assert.rejects(keyless("a"), client.InvalidInput);
    assert.equal(send.count, 0);
  });

  test("a step derives the keys and its token fences the writes", async () => {
    const l = ledger();
    const run = unique("run-");
    await l.startRun("publish", { runId: run });
    await l.addStep(run, "draft");
    const first = await l.resume(run, { worker: "w1", ttlSeconds: 60 });
    const send = calls("done");
    const act = l.action(unique("cms.post"), { target: "https://cms" }, send);
    await l.step(run, "draft", { fencingToken: first.token }, async () => {
      await act("a");
      await act("b");
      assert.equal((await act.receipt("b")).idempotency_key, client.stepKey(run, "draft", "2"));
    });
    assert.equal(await l.step(run, "draft", { fencingToken: first.token }, () => act("a")), "done");
    assert.equal(send.count, 2);
    const second = await l.resume(run, { worker: "w1", ttlSeconds: 60 });
    // Once the run is leased a step is added only under the current token.
    for (const fencingToken of [null, first.token]) {
      await assert.rejects(l.addStep(run, "publish", { fencingToken }),
        (exc) => exc instanceof client.StaleFencingToken && exc.currentToken === second.token);
    }
    assert.equal((await l.addStep(run, "publish", { fencingToken: second.token })).state, "pending");
    await assert.rejects(l.step(run, "publish", { fencingToken: first.token }, () => act("c")),
      (exc) => exc instanceof client.StaleFencingToken && exc.currentToken > first.token);
    assert.equal(send.count, 2);
    assert.ok(Array.isArray(await l.retriesDue({ operation: "cms.post" })));
  });
});

describe("a wrong or revoked key", () => {
  test("is Unauthenticated and nothing is called", async () => {
    const name = unique("revoked-");
    const key = (await fixture("key", name, "default")).secret;
    const send = calls("x");
    const wrong = new Ledger(server.url, { key: "alk_wrong" }).action(unique("x.y"), { target: "https://x", key: byValue }, send);
    await assert.rejects(wrong("k"), (exc) => exc instanceof client.Unauthenticated && exc.status === 401);
    const act = new Ledger(server.url, { key }).action(unique("x.y"), { target: "https://x", key: byValue }, send);
    assert.equal(await act("k1"), "x");
    await fixture("revoke", name);
    await assert.rejects(act("k2"), client.Unauthenticated);
    assert.equal(send.count, 1);
  });
});

describe("approvals", () => {
  test("an approval policy raises ApprovalRequired without calling", async () => {
    const prefix = unique("payments");
    await fixture("policy", `${prefix}.*`);
    const send = calls();
    const act = ledger().action(`${prefix}.refund`, { target: "https://pay", key: byValue }, send);
    await assert.rejects(act("r1"), (exc) => exc instanceof client.ApprovalRequired && exc.operation.state === "planned");
    assert.equal(send.count, 0);
  });

  for (const decision of ["approve", "deny"]) {
    test(`waiting for approval: ${decision}`, async () => {
      const prefix = unique("payments");
      await fixture("policy", `${prefix}.*`);
      const send = calls("refunded");
      const l = ledger();
      const act = l.action(`${prefix}.refund`, { target: "https://pay", key: byValue, approvalTimeout: 120, approvalNote: "customer asked" }, send);
      const outcome = act("r1").then((v) => v, (e) => e);
      let receipt = null;
      while (!receipt) {
        receipt = await act.receipt("r1");
        if (!receipt) await new Promise((r) => setTimeout(r, 100));
      }
      // the request for approval is made before the waiting starts
      await new Promise((r) => setTimeout(r, 300));
      try {
        if (decision === "approve") await fixture("approve", receipt.operation_id);
        else await fixture("deny", receipt.operation_id, "not eligible");
      } catch (exc) {
        await fixture("deny", receipt.operation_id, "the test failed").catch(() => {});
        throw exc;
      }
      const result = await outcome;
      if (decision === "approve") {
        assert.equal(result, "refunded");
        assert.equal(send.count, 1);
      } else {
        assert.ok(result instanceof client.ApprovalDenied, String(result));
        assert.equal(result.reason, "not eligible");
        assert.equal(send.count, 0);
      }
    });
  }

  test("no decision in time is ApprovalRequired", async () => {
    const prefix = unique("payments");
    await fixture("policy", `${prefix}.*`);
    const send = calls();
    const act = ledger().action(`${prefix}.refund`, { target: "https://pay", key: byValue, approvalTimeout: 0.3 }, send);
    await assert.rejects(act("r1"), (exc) => exc instanceof client.ApprovalRequired && /within 0.3 s/.test(exc.message));
    assert.equal(send.count, 0);
  });
});

describe("the ledger stopped and restarted", () => {
  test("down before the intent: not called, LedgerUnavailable; back: sent once", async () => {
    const send = calls("sent");
    const act = ledger().action(unique("x.y"), { target: "https://x", key: byValue }, send);
    await server.kill();
    try {
      await assert.rejects(act("k"), (exc) => exc instanceof client.LedgerUnavailable && /could not connect/.test(exc.message));
      assert.equal(send.count, 0);
    } finally {
      await ensureUp();
    }
    assert.equal(await act("k"), "sent");
    assert.equal(send.count, 1);
  });

  test("down after the call: the recording is retried until it is back, the call never re-sent", async () => {
    let restarted;
    let count = 0;
    const act = ledger().action(unique("x.y"), { target: "https://x", key: byValue, externalId: (r) => r.id }, async () => {
      count += 1;
      await server.kill(); // the call went out; the ledger dies before its outcome is recorded
      restarted = new Promise((r) => setTimeout(r, 1000)).then(() => server.start());
      return { id: 7 };
    });
    assert.deepEqual(await act("k"), { id: 7 });
    await restarted;
    assert.equal(count, 1);
    const receipt = await act.receipt("k");
    assert.deepEqual([receipt.state, receipt.external_id, receipt.result, receipt.version], ["succeeded", "7", { id: 7 }, 3]);
    assert.deepEqual(await act("k"), { id: 7 });
    assert.equal(count, 1);
  });

  test("down for good after the call: OutcomeNotRecorded, left submitted for the sweep, never re-sent", async () => {
    let count = 0;
    const act = ledger({ recordFor: 1 }).action(unique("x.y"), { target: "https://x", key: byValue }, async () => {
      count += 1;
      await server.kill();
      return "done";
    });
    try {
      await assert.rejects(act("k"), (exc) => exc instanceof client.OutcomeNotRecorded && exc.value === "done"
        && exc.operation.state === "submitted");
    } finally {
      await ensureUp();
    }
    await assert.rejects(act("k"), (exc) => exc instanceof client.OutcomeUnknown && exc.operation.state === "submitted");
    assert.equal(count, 1);
  });
});
