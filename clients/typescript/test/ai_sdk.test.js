// The Vercel AI SDK adapter (examples/typescript/ai-sdk) with the SDK's own scripted model
// (ai/test's MockLanguageModelV2): no model call, a real ledger server. Skipped, and said so,
// when the example's dependencies are not installed (npm ci in examples/typescript/ai-sdk).

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Ledger } from "../src/index.js";
import { LedgerServer, ROOT, fixture, unique } from "./support.js";

const EXAMPLE = join(ROOT, "examples", "typescript", "ai-sdk");
const installed = existsSync(join(EXAMPLE, "node_modules", "ai"));
let server;
let ledger;

const usage = { inputTokens: 1, outputTokens: 1, totalTokens: 2 };
const call = (id, input) => ({
  content: [{ type: "tool-call", toolCallId: id, toolName: "refund", input: JSON.stringify(input) }],
  finishReason: "tool-calls", usage, warnings: [],
});
const text = (t) => ({ content: [{ type: "text", text: t }], finishReason: "stop", usage, warnings: [] });

describe("the Vercel AI SDK tool", { skip: installed ? false : `the example's dependencies are not installed: npm ci in ${EXAMPLE}` }, () => {
  let ai, mock, refundTool;

  before(async () => {
    ai = await import(join(EXAMPLE, "node_modules", "ai", "dist", "index.mjs"));
    mock = await import(join(EXAMPLE, "node_modules", "ai", "dist", "test", "index.mjs"));
    ({ refundTool } = await import(join(EXAMPLE, "refund_tool.mjs")));
    await fixture("setup");
    const secret = (await fixture("key", unique("ts-ai-"), "default")).secret;
    server = await LedgerServer.create(join(mkdtempSync(join(tmpdir(), "ledger-ts-")), "server.log"));
    ledger = new Ledger(server.url, { key: secret });
  }, { timeout: 180_000 });

  after(async () => { await server?.kill(); });

  test("a tool call the model repeats is sent once; both get the refund", async () => {
    const orderId = unique("order-");
    const payments = { count: 0, refund: async (r) => ({ refundId: `rf-${r.orderId}`, n: ++payments.count }) };
    const model = new mock.MockLanguageModelV2({
      doGenerate: [call("c1", { orderId, amount: 5 }), call("c2", { orderId, amount: 5 }), text("refunded")],
    });
    const result = await ai.generateText({
      model, prompt: "refund it", tools: { refund: refundTool(ledger, payments) }, stopWhen: ai.stepCountIs(5),
    });
    assert.equal(payments.count, 1);
    const outputs = result.steps.flatMap((s) => s.toolResults.map((r) => r.output));
    assert.deepEqual(outputs, [{ refundId: `rf-${orderId}`, n: 1 }, { refundId: `rf-${orderId}`, n: 1 }]);
    assert.equal(result.text, "refunded");
  });

  test("an unknown outcome reaches the model as a message: do not retry, the operation", async () => {
    const orderId = unique("order-");
    class TimeoutError extends Error {}
    const payments = { count: 0, refund: async () => { payments.count += 1; throw new TimeoutError("read timed out"); } };
    const model = new mock.MockLanguageModelV2({
      doGenerate: [call("c1", { orderId, amount: 5 }), call("c2", { orderId, amount: 5 }), text("I will wait")],
    });
    const result = await ai.generateText({
      model, prompt: "refund it", tools: { refund: refundTool(ledger, payments) }, stopWhen: ai.stepCountIs(5),
    });
    assert.equal(payments.count, 1);
    const receipt = await ledger.action("payments.refund", { target: "x", key: (r) => r.orderId }, () => null).receipt({ orderId });
    assert.equal(receipt.state, "outcome_unknown");
    const message = `do not retry; the ledger is reconciling operation ${receipt.operation_id}`;
    const outputs = result.steps.flatMap((s) => s.toolResults.map((r) => r.output));
    assert.deepEqual(outputs, [message, message]);
    // what the model was shown on its next turn
    assert.match(JSON.stringify(model.doGenerateCalls[1].prompt), new RegExp(message));
  });
});
