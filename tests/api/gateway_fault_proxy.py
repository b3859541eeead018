"""A stdio fault proxy: `python gateway_fault_proxy.py -- COMMAND ARGS...` starts the MCP
server COMMAND and relays newline-delimited JSON-RPC between its own stdin/stdout and the
server's, losing messages as FAULT_PLAN (JSON in the environment) says:

    {"tool": "create_invoice", "drop_reply": [2], "drop_request": [3]}

counting the `tools/call` requests of that tool from 1: the 2nd reaches the server (its
effect is committed) and its reply is dropped on the way back; the 3rd never reaches the
server. Everything else passes through untouched. Each dropped message is logged to stderr.

A blind reader: `{"blind_tool": "find_invoice", "blind_answer": {...}}` answers every call
of that tool itself with the JSON-RPC result `blind_answer`, never asking the server, as a
reader with the wrong credentials or account sees nothing (an empty 200, a "not found").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1:]
    plan = json.loads(os.environ.get("FAULT_PLAN") or "{}")
    tool = plan.get("tool")
    drop_reply = set(plan.get("drop_reply", ()))
    drop_request = set(plan.get("drop_request", ()))
    blind_tool, blind_answer = plan.get("blind_tool"), plan.get("blind_answer")
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             bufsize=0)
    lost_replies: set = set()
    lock = threading.Lock()
    calls = 0

    def downstream():  # server -> client
        for line in child.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = {}
            with lock:
                lost = isinstance(message, dict) and message.get("id") in lost_replies \
                    and "method" not in message
                if lost:
                    lost_replies.discard(message["id"])
            if lost:
                print(f"fault proxy: dropped the reply to request {message['id']}",
                      file=sys.stderr, flush=True)
                continue
            with lock:  # whole lines: the proxy answers blind calls on the same stream
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()

    relay = threading.Thread(target=downstream, daemon=True)
    relay.start()
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            message = {}
        if (blind_tool and isinstance(message, dict) and message.get("method") == "tools/call"
                and (message.get("params") or {}).get("name") == blind_tool):
            print(f"fault proxy: answered {blind_tool} blind (request {message.get('id')})",
                  file=sys.stderr, flush=True)
            with lock:
                sys.stdout.buffer.write(json.dumps({"jsonrpc": "2.0", "id": message.get("id"),
                                                    "result": blind_answer}).encode() + b"\n")
                sys.stdout.buffer.flush()
            continue
        if (isinstance(message, dict) and message.get("method") == "tools/call"
                and (message.get("params") or {}).get("name") == tool):
            calls += 1
            if calls in drop_request:
                print(f"fault proxy: dropped call {calls} of {tool} (request "
                      f"{message.get('id')})", file=sys.stderr, flush=True)
                continue
            if calls in drop_reply:
                with lock:
                    lost_replies.add(message.get("id"))
        child.stdin.write(line)
        child.stdin.flush()
    child.stdin.close()
    child.wait(timeout=10)
    relay.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
