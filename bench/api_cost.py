"""What one API request costs the gateway: its CPU and its latency, per kind of request.

Each checkout (this one, and a baseline's git worktree with `--baseline DIR`) gets one daphne
on a fresh SQLite file, its own customer, and a host that has registered; then, in turns
(head, base, head, base, ...), `--requests` sequential requests of each kind:

- `no-key`: a chat with a wrong key (401), what a stranger costs;
- `refused`: a chat with a good key and issue 30's heavy schema (`minItems: 1e7`, a 400);
- `models`: `GET /v1/models` with a good key (200);
- `heartbeat`: a host's `POST /hosts/api/heartbeat` (200), what every host sends.

It reports the gateway process's CPU per request (from /proc) and the client's latency p50/p90,
and the ratios base ÷ head in the same run (these machines are noisy: compare within a run).

    .venv/bin/python bench/api_cost.py [--requests 300] [--turns 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relay import HEAVY, ROOT, Target, cpu_seconds, pct  # noqa: E402  (bench/ is not a package)

KINDS = ("no-key", "refused", "models", "heartbeat")


def one_kind(http: httpx.Client, server: str, kind: str, secret: str, token: str) -> httpx.Response:
    chat = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    if kind == "no-key":
        return http.post(f"{server}/v1/chat/completions", json=chat, headers={"Authorization": "Bearer sk-nobody"})
    if kind == "refused":
        return http.post(
            f"{server}/v1/chat/completions",
            json={**chat, "response_format": HEAVY},
            headers={"Authorization": f"Bearer {secret}"},
        )
    if kind == "models":
        return http.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    return http.post(
        f"{server}/hosts/api/heartbeat",
        json={"fingerprint": "bench-api-cost", "paused": False, "models_loaded": ["gemma-3-270m"], "version": "0.7.0"},
        headers={"Authorization": f"Bearer {token}"},
    )


def measure(server: str, pid: int, kind: str, count: int, secret: str, token: str) -> dict:
    with httpx.Client(timeout=30) as http:
        for _ in range(5):  # warm: this kind's code paths are loaded
            one_kind(http, server, kind, secret, token)
        latencies, statuses = [], set()
        cpu = cpu_seconds(pid)
        for _ in range(count):
            started = time.perf_counter()
            statuses.add(one_kind(http, server, kind, secret, token).status_code)
            latencies.append(time.perf_counter() - started)
        used = cpu_seconds(pid) - cpu
    return {
        "cpu_ms": used / count * 1000,
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p90_ms": pct(latencies, 0.9) * 1000,
        "statuses": sorted(statuses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="sequential requests of each kind per turn")
    parser.add_argument("--turns", type=int, default=3, help="turns per checkout, alternating")
    parser.add_argument("--baseline", type=Path, help="a checkout of the baseline commit (git worktree)")
    parser.add_argument("--port", type=int, default=8771)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-api-cost-"))
    targets = [Target("head", ROOT, tmp)] + ([Target("base", args.baseline.resolve(), tmp)] if args.baseline else [])
    servers = {}
    for index, target in enumerate(targets):
        port = args.port + index * 10
        servers[target.name] = (
            target.start(port, tmp / f"gateway-{target.name}.log"),
            target.gateways[0].pid,
            target.manage("create_customer", f"{target.name}@bench.local", "--credit", "10"),
            target.manage("create_host", f"{target.name}@host.local", f"{target.name}-host"),
        )
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for _ in range(args.turns):
            for target in targets:
                server, pid, secret, token = servers[target.name]
                for kind in KINDS:
                    results.setdefault((target.name, kind), []).append(
                        measure(server, pid, kind, args.requests, secret, token)
                    )
    finally:
        for target in targets:
            target.stop()
    print(f"{args.requests} sequential requests per kind per turn, {args.turns} turns, one daphne each, SQLite")
    print(f"{'gateway':<6} {'kind':<10} {'status':<8} {'CPU ms/request (turns)':<26} {'p50 ms':>7} {'p90 ms':>7}")
    for (name, kind), turns in results.items():
        cpu = statistics.median(t["cpu_ms"] for t in turns)
        spread = "/".join(f"{t['cpu_ms']:.2f}" for t in turns)
        print(
            f"{name:<6} {kind:<10} {','.join(map(str, sorted({s for t in turns for s in t['statuses']}))):<8} "
            f"{cpu:6.2f} ({spread}){'':<4} {statistics.median(t['p50_ms'] for t in turns):7.2f} "
            f"{statistics.median(t['p90_ms'] for t in turns):7.2f}"
        )
    if args.baseline:
        for kind in KINDS:
            head = statistics.median(t["cpu_ms"] for t in results[("head", kind)])
            base = statistics.median(t["cpu_ms"] for t in results[("base", kind)])
            head_p50 = statistics.median(t["p50_ms"] for t in results[("head", kind)])
            base_p50 = statistics.median(t["p50_ms"] for t in results[("base", kind)])
            print(f"{kind:<10} base ÷ head: CPU {base / head:.2f}×, latency p50 {base_p50 / head_p50:.2f}×")


if __name__ == "__main__":
    main()
