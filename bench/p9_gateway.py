"""P9: an MCP tool call through the gateway / the same call straight to the upstream.

Both over stdio, the upstream (tests/api/gateway_upstream.py) doing nothing (`noop`). Three
MCP clients of the official SDK stay connected for the whole run: one to the upstream, one
to a `manage.py mcp_gateway` where noop is consequential (every call a new receipt: intent,
submitted, succeeded with its result), one to a gateway where noop passes through. The
calls are interleaved in rounds, so machine noise hits every side alike. Prints the ratio
and the milliseconds the receipt adds, per call (medians), and the p50, p95 and p99 of a
receipted call.

P9_BEFORE_ROOT=/path/to/another/checkout adds a fourth side: the receipted gateway of that
tree (its `manage.py mcp_gateway`, on the same database), in the same rounds, so a change
is measured against the tree before it side by side on a busy machine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    BENCH_DATABASE,
    ROOT,
    Stopwatch,
    ms,
    parse_args,
    print_table,
    record,
    setup_django,
)

UPSTREAM = [sys.executable, str(ROOT / "tests" / "api" / "gateway_upstream.py")]


def config(directory: Path, name: str, consequential: bool) -> Path:
    path = directory / f"{name}.toml"
    tool = """
[tools.noop]
mode = "consequential"
operation = "bench.noop"
timeout = 30
""" if consequential else ""
    path.write_text(f"""
[gateway]
name = "{name}"

[upstream]
command = {json.dumps(UPSTREAM)}
env = {{ UPSTREAM_STATE = {json.dumps(str(directory / "state.json"))} }}
{tool}""")
    return path


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    from ledger import agent_keys
    from ledger.management.commands.agent_key import ShellOperator

    rounds = 150 if args.scale == "quick" else 1000
    run = uuid.uuid4().hex[:10]
    name = f"bench-p9-{run}"
    _, secret = agent_keys.create(name, tenants=["default"], user=ShellOperator())
    env = {**os.environ, "LEDGER_AGENT_KEY": secret, "LEDGER_DATABASE_NAME": BENCH_DATABASE}

    before_root = os.environ.get("P9_BEFORE_ROOT", "")

    def gateway(path: Path, root: Path = ROOT) -> Client:
        return Client(StdioServerParameters(
            command=sys.executable, args=["manage.py", "mcp_gateway", "--config", str(path)],
            cwd=str(root), env=env), cache=None)

    side_names = ["direct", "receipt", "pass_through"] + (["receipt_before"] if before_root
                                                          else [])
    watches = {side: Stopwatch(side) for side in side_names}

    async def measure(directory: Path) -> None:
        direct = Client(StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:]),
                        cache=None)
        async with AsyncExitStack() as stack:
            clients = {
                "direct": await stack.enter_async_context(direct),
                "receipt": await stack.enter_async_context(
                    gateway(config(directory, "receipt", True))),
                "pass_through": await stack.enter_async_context(
                    gateway(config(directory, "pass", False))),
            }
            if before_root:
                clients["receipt_before"] = await stack.enter_async_context(
                    gateway(config(directory, "before", True), Path(before_root)))
            sides = list(clients)
            for n in range(10):  # warm up every path (imports, prepared statements)
                for side in sides:
                    await clients[side].call_tool("noop", {"n": -1 - n})
            for r in range(rounds):
                for side in (sides if r % 2 == 0 else list(reversed(sides))):
                    started = time.perf_counter()
                    result = await clients[side].call_tool("noop", {"n": r})
                    watches[side].samples.append(time.perf_counter() - started)
                    if result.is_error:
                        raise SystemExit(f"expected noop to succeed through {side}, found "
                                         f"{result.content}")

    try:
        with tempfile.TemporaryDirectory() as directory:
            anyio.run(measure, Path(directory))
    finally:
        agent_keys.revoke(name, user=ShellOperator())
    direct, receipt, passing = (watches[s] for s in ("direct", "receipt", "pass_through"))
    summary = {
        "ratio": receipt.median / direct.median,
        "added_ms": (receipt.median - direct.median) * 1000,
        "pass_through_ratio": passing.median / direct.median,
        "direct_median_ms": direct.median * 1000,
        "receipt_median_ms": receipt.median * 1000,
        "pass_through_median_ms": passing.median * 1000,
        "receipt_p50_ms": receipt.median * 1000,
        "receipt_p95_ms": receipt.percentile(0.95) * 1000,
        "receipt_p99_ms": receipt.percentile(0.99) * 1000,
        "calls_per_side": rounds,
    }
    if before_root:
        before = watches["receipt_before"]
        summary.update({"before_receipt_median_ms": before.median * 1000,
                        "before_added_ms": (before.median - direct.median) * 1000,
                        "before_ratio": before.median / direct.median,
                        "before_receipt_p50_ms": before.median * 1000,
                        "before_receipt_p99_ms": before.percentile(0.99) * 1000})
    print_table(f"P9 MCP gateway ({rounds} calls per side, stdio, upstream does nothing)", [
        ("straight to the upstream", ms(direct.median)),
        ("through the gateway, pass-through", ms(passing.median)),
        ("through the gateway, with a receipt", ms(receipt.median)),
        ("receipt p50", ms(receipt.median)),
        ("receipt p95", ms(receipt.percentile(0.95))),
        ("receipt p99", ms(receipt.percentile(0.99))),
        ("ratio (receipt / direct)", f"{summary['ratio']:.2f}x"),
        ("added per call", f"{summary['added_ms']:.2f} ms"),
        ("pass-through ratio", f"{summary['pass_through_ratio']:.2f}x"),
        *([("the tree before: with a receipt", ms(watches["receipt_before"].median)),
           ("the tree before: receipt p99", ms(watches["receipt_before"].percentile(0.99))),
           ("the tree before: ratio (receipt / direct)", f"{summary['before_ratio']:.2f}x"),
           ("the tree before: added per call", f"{summary['before_added_ms']:.2f} ms"),
           ("this tree's receipt / the tree before's",
            f"{receipt.median / watches['receipt_before'].median:.2f}x")]
          if before_root else []),
    ])
    record("P9", summary)
    return summary


if __name__ == "__main__":
    main()
