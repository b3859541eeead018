// P8's TypeScript side: the same action as the Python client's (bench/p8_http.py), through
// clients/typescript, one call per line read on stdin ("<key>"), answered with the call's
// duration in milliseconds as measured here (so the pipe is not counted).
import { createInterface } from "node:readline";
import { performance } from "node:perf_hooks";
import { Ledger } from "../clients/typescript/src/index.js";

const [url, run] = process.argv.slice(2);
const ledger = new Ledger(url, { key: process.env.LEDGER_AGENT_KEY, tenant: "default" });
const create = (article) => ({ id: article.title });
const action = ledger.action("bench.ts_client", {
  target: "https://cms.example/api", key: (a) => a.title, externalId: (r) => r.id,
}, create);

for await (const line of createInterface({ input: process.stdin })) {
  const i = line.trim();
  const intent = { title: `Quarterly report ts-${run}-${i}`, body: "x".repeat(400),
    tags: ["a", "b"], headers: { Authorization: "Bearer secret" } };
  const started = performance.now();
  await action(intent);
  process.stdout.write(`${performance.now() - started}\n`);
}
