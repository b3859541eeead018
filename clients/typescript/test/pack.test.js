// `npm pack` gives an installable tarball: installed offline in a scratch folder (the package
// has no dependencies), the example of examples/typescript runs against a real server.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { copyFileSync, mkdtempSync, readdirSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { LedgerServer, ROOT, fixture, unique } from "./support.js";

const run = promisify(execFile);
const PACKAGE = join(ROOT, "clients", "typescript");
let server;
let secret;

before(async () => {
  await fixture("setup");
  secret = (await fixture("key", unique("ts-pack-"), "default")).secret;
  server = await LedgerServer.create(join(mkdtempSync(join(tmpdir(), "ledger-ts-")), "server.log"));
}, { timeout: 180_000 });

after(async () => { await server?.kill(); });

test("the packed tarball installs offline in a scratch folder and the example runs", async () => {
  const scratch = mkdtempSync(join(tmpdir(), "ledger-ts-example-"));
  await run("npm", ["pack", "--pack-destination", scratch], { cwd: PACKAGE });
  const [tarball] = readdirSync(scratch).filter((name) => name.endsWith(".tgz"));
  assert.match(tarball, /^agent-ledger-client-\d+\.\d+\.\d+\.tgz$/);
  for (const name of ["package.json", "send_once.mjs"]) {
    copyFileSync(join(ROOT, "examples", "typescript", name), join(scratch, name));
  }
  await run("npm", ["install", "--offline", "--no-audit", "--no-fund", join(scratch, tarball)], { cwd: scratch });
  const id = unique("welcome-");
  const { stdout } = await run("node", ["send_once.mjs", id], {
    cwd: scratch, env: { ...process.env, LEDGER_URL: server.url, LEDGER_AGENT_KEY: secret },
  });
  const out = JSON.parse(stdout.trim());
  assert.deepEqual(out, { first: { messageId: `msg-${id}` }, retried: { messageId: `msg-${id}` }, sent: 1, state: "succeeded" });
});
