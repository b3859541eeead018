// A ledger served by a real uvicorn process on config.asgi, on a database of the tests' own
// (made by `manage.py migrate` through test/ledger_fixture.py), that a test may kill (SIGKILL)
// and start again on the same port. DATABASE_URL names the PostgreSQL server (else the
// project's embedded one, as tests/ use it); LEDGER_PYTHON the Python (else <repo>/.venv).

import { execFile, spawn } from "node:child_process";
import { existsSync, openSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { randomBytes } from "node:crypto";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
export const ROOT = resolve(here, "..", "..", "..");
export const PYTHON = process.env.LEDGER_PYTHON || join(ROOT, ".venv", "bin", "python");
const FIXTURE = join(here, "ledger_fixture.py");
const DATABASE = process.env.LEDGER_TS_TEST_DATABASE || "agent_ledger_ts_test";
const ENV = { ...process.env, PYTHONUNBUFFERED: "1", LEDGER_DATABASE_NAME: DATABASE };

export const unique = (prefix) => `${prefix}${randomBytes(4).toString("hex")}`;

/** Run a fixture command (without blocking the event loop); its JSON answer. */
export function fixture(...args) {
  if (!existsSync(PYTHON)) {
    throw new Error(`expected the project's Python at ${PYTHON} (set LEDGER_PYTHON), found none`);
  }
  return new Promise((ok, fail) => {
    execFile(PYTHON, [FIXTURE, ...args], { cwd: ROOT, env: ENV, encoding: "utf8" }, (error, out, err) => {
      if (error) fail(new Error(`expected the fixture ${args.join(" ")} to succeed, found:\n${err}`));
      else ok(JSON.parse(out.trim().split("\n").at(-1)));
    });
  });
}

function freePort() {
  return new Promise((ok, fail) => {
    const server = createServer();
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => ok(port));
    });
    server.on("error", fail);
  });
}

export class LedgerServer {
  static async create(logPath) {
    const server = new LedgerServer(await freePort(), logPath);
    await server.start();
    return server;
  }

  constructor(port, logPath) {
    this.port = port;
    this.url = `http://127.0.0.1:${port}`;
    this.logPath = logPath;
    this.proc = null;
  }

  get running() { return this.proc !== null && this.proc.exitCode === null && this.proc.signalCode === null; }

  async start() {
    const log = openSync(this.logPath, "a");
    this.proc = spawn(PYTHON, ["-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
      "--port", String(this.port), "--log-level", "warning"],
    { cwd: ROOT, env: ENV, stdio: ["ignore", log, log] });
    const deadline = Date.now() + 60_000;
    for (;;) {
      try {
        const response = await fetch(`${this.url}/api/v1/openapi.json`, { signal: AbortSignal.timeout(2000) });
        if (response.status === 200) return;
      } catch { /* not up yet */ }
      if (!this.running || Date.now() > deadline) {
        await this.kill();
        throw new Error("expected the ledger server to answer, found it down:\n" +
          readFileSync(this.logPath, "utf8").slice(-3000));
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  async kill() {
    if (this.running) {
      const exited = new Promise((r) => this.proc.once("exit", r));
      this.proc.kill("SIGKILL");
      await exited;
    }
    this.proc = null;
  }
}

/** A function that counts its calls (and may throw after "the effect"). */
export function calls(result = null, raises = null) {
  const fn = async (...args) => {
    fn.count += 1;
    fn.args.push(args);
    if (raises) throw typeof raises === "function" ? raises() : raises;
    return typeof result === "function" ? result(...args) : result;
  };
  fn.count = 0;
  fn.args = [];
  return fn;
}
