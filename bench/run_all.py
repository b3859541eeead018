"""Run every benchmark (bench/p*_*.py) at one scale, then print the summary table.

    .venv/bin/python bench/run_all.py --scale quick     # what `make bench` runs
    .venv/bin/python bench/run_all.py --scale full
    .venv/bin/python bench/run_all.py --only P1 P2      # a subset

Each script also runs alone. Results are merged into bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.common import RESULTS  # noqa: E402

# benchmark -> (what the ratio compares, the goal, how to read the goal)
GOALS = {
    "P1": ("lifecycle: ledger API / bare ORM", 1.2, "<="),
    "P2": ("desk pages: large / small ledger (10k unresolved)", 1.2, "<="),
    "P3": ("reconcile: 4 workers / 1 worker throughput", 3.5, ">="),
    "P4": ("record_intent: replay / first record", 0.5, "<="),
    "P5": ("record_intent p99: during purge / without", 2.0, "<="),
    "P6": ("obligation commit: same / distinct obligations", None, ""),
    "P7": ("16 writers, 2 ms commits: one tenant / 16 tenants", 0.8, ">="),
    "P8": ("lifecycle: HTTP API (uvicorn) / in process", 2.0, "<="),
    "P8cpu": ("an action's CPU: over HTTP (client, server, PostgreSQL) / in process", 2.0, "<="),
    "P9": ("MCP tool call: through the gateway / straight to the upstream", None, ""),
    "P10": ("action throughput, 1 writer: ledger / DBOS workflow+step", 2.5, ">="),
}


# The second claim some benchmarks make, printed under the summary line.
ALSO = {
    "P1": lambda r: f"as the agent's role / as the owner {r['agent_role_ratio']:.3f}x "
                    "(goal <= 1.05)" + ("  met" if r["agent_role_ratio"] <= 1.05 else "  NOT met")
                    + f"\n{'':30}in two commits (submit=True): ledger / bare ORM "
                    f"{r['ratio_two_commits']:.2f}x; 2 / 3 commits "
                    f"{r['two_vs_three_commits']:.2f}x",
    "P2": lambda r: f"SQL queries constant from the small to the large ledger: "
                    f"{r['queries_constant']}",
    "P3": lambda r: f"as threads of one process: {r['ratio_threads']:.2f}x",
    "P7": lambda r: f"one tenant / bare ORM {r['one_tenant_vs_bare']:.2f}x (goal >= 0.6)"
                    + ("  met" if r["one_tenant_vs_bare"] >= 0.6 else "  NOT met")
                    + f"; sealer lag max {r['sealer_max_lag_s']:.2f} s",
    "P8": lambda r: f"HTTP median {r['http_median_ms']:.1f} ms, in process "
                    f"{r['in_process_median_ms']:.1f} ms; transport floor "
                    f"{r['transport_median_ms']:.1f} ms ({r['transport_ratio']:.2f}x); "
                    f"with http.client {r['lean_client_ratio']:.2f}x"
                    + (f"; action: Python client {r['client_ratio']:.2f}x, TypeScript client "
                       f"{r['ts_client_ratio']:.2f}x the decorator"
                       if r.get("ts_client_ratio") is not None else
                       "; TypeScript client: not run (no node)"),
    "P8cpu": lambda r: f"server CPU per API request {r['server_ms_per_request_idle']:.2f} ms "
                       f"idle, {r['server_ms_per_request_load']:.2f} ms with {r['clients']} "
                       "clients (goal <= 1.5)"
                       + ("  met" if max(r["server_ms_per_request_idle"],
                                         r["server_ms_per_request_load"]) <= 1.5
                          else "  NOT met")
                       + f"; action p50 {r['action_p50_ms']:.1f} ms, p99 "
                         f"{r['action_p99_ms']:.1f} ms over HTTP",
    "P9": lambda r: f"adds {r['added_ms']:.1f} ms per call (goal <= 10)"
                    + ("  met" if r["added_ms"] <= 10 else "  NOT met")
                    + f" ({r['direct_median_ms']:.1f} -> {r['receipt_median_ms']:.1f} ms, "
                    f"stdio both); pass-through {r['pass_through_ratio']:.2f}x",
    "P10": lambda r: f"at 8 writers {r['ratio_8']:.2f}x (goal >= 2.5)"
                     + ("  met" if r["ratio_8"] >= 2.5 else "  NOT met")
                     + f"; in 3 commits {r['writers_1']['ratio_three_commits']:.2f}x and "
                     f"{r['writers_8']['ratio_three_commits']:.2f}x"
                     + (f"\n{'':30}this tree / {r['against']['root']} (--against): "
                        f"{r['against']['ratio']:.2f}x at 1 writer, {r['against']['ratio_8']:.2f}x "
                        "at 8 (goal >= 1)"
                        + ("  met" if min(r["against"]["ratio"], r["against"]["ratio_8"]) >= 1
                           else "  NOT met") if r.get("against") else ""),
    "P5": lambda r: f"longest purge batch {r['longest_batch_ms']:.0f} ms (goal <= 100 ms)"
                    + ("  met" if r["longest_batch_ms"] <= 100 else "  NOT met"),
}


def scripts(only: list[str] | None) -> list[Path]:
    found = sorted(HERE.glob("p[0-9]*_*.py"), key=lambda p: int(p.name[1:].split("_")[0]))
    if only:
        wanted = {name.upper() for name in only}
        found = [p for p in found if p.name.split("_")[0].upper() in wanted]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=["quick", "full"], default="quick")
    parser.add_argument("--only", nargs="*", help="benchmark names, e.g. P1 P3")
    args = parser.parse_args()
    failed = []
    for script in scripts(args.only):
        print(f"\n=== {script.name} --scale {args.scale}", flush=True)
        done = subprocess.run([sys.executable, str(script), "--scale", args.scale])
        if done.returncode != 0:
            failed.append(script.name)
    summary(args.only)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
        return 1
    return 0


def summary(only: list[str] | None) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    wanted = {o.upper() for o in only or ()}
    # P8 also names the claims of its other scripts (P8cpu: bench/p8_cpu.py)
    names = [n for n in GOALS if not only or n.upper() in wanted
             or n.upper().removesuffix("CPU") in wanted]
    print("\nSummary (ratios measured side by side in one run)")
    print(f"{'':4} {'ratio':>8}  {'goal':>7}  {'scale':<6} what")
    for name in names:
        what, goal, sense = GOALS[name]
        if name not in results:
            print(f"{name:4} {'-':>8}  {'':>7}  {'':<6} {what} (not run)")
            continue
        ratio = results[name]["ratio"]
        goal_text = f"{sense}{goal}" if goal is not None else "report"
        met = ""
        if goal is not None:
            ok = ratio <= goal if sense == "<=" else ratio >= goal
            met = "  met" if ok else "  NOT met"
        print(f"{name:4} {ratio:>7.2f}x  {goal_text:>7}  {results[name].get('scale', ''):<6} "
              f"{what}{met}")
        if name in ALSO:
            try:
                print(f"{'':30}{ALSO[name](results[name])}")
            except KeyError:  # a result recorded by an older version of the script
                pass


if __name__ == "__main__":
    sys.exit(main())
