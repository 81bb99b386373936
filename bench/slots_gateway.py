"""Many customers per machine, through the gateway (issue 51), measured side by side in one run.

One real mahout serving the shipped model is started twice against one daphne gateway: first
with `--slots 1` (one job at a time, as before), then with `--slots S`. Against each:

1. burst: C customers stream a 128-token answer at once (the `openai` client, streamed
   completions, each its own prompt); aggregate tokens/s = all tokens ÷ the wall time from
   the first request sent to the last token; the requests that got a 504 (no host claimed
   within QUEUE_TIMEOUT_SECONDS, 30 as in production) are counted.
2. (slots S only) the time to first token of a request arriving while 3 streams run, ÷ the
   idle time to first token (medians);
3. (slots S only) the gaps between arrivals of two running streams while a ~2,000-token prompt
   is prefilled beside them, p99 ÷ the p99 of the same streams' gaps with nothing beside them.

    .venv/bin/python bench/slots_gateway.py [--customers 8] [--slots 8] [--threads 2]

Uses a fresh SQLite file unless DATABASE_URL is set (pair it with REDIS_URL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.request_path import pct, setup_django, start, stop, wait_http  # noqa: E402 (after the path)

TOKENS = 128
LONG_PROMPT_WORDS = 700  # 2,025 of the shipped model's tokens


def prompt(n: int) -> str:
    return f"Story {n}. Once upon a time, in a village at the edge of a great forest, there lived"


def stream(client, text: str, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed completion: when it was sent, when each piece of text arrived, its tokens,
    or the status of the error it got."""
    import openai

    sent, arrivals, tokens = time.perf_counter(), [], 0
    try:
        for chunk in client.completions.create(
            model="gemma-3-270m",
            prompt=text,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    except openai.APIStatusError as exc:
        return {"sent": sent, "arrivals": arrivals, "tokens": tokens, "status": exc.status_code}
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens, "status": 200}


def together(client, texts: list[str], max_tokens: int, *, stagger: float = 0.0) -> list[dict]:  # type: ignore[no-untyped-def]
    results: list[dict] = [{} for _ in texts]

    def one(index: int) -> None:
        results[index] = stream(client, texts[index], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
        time.sleep(stagger)
    for thread in threads:
        thread.join()
    return results


def burst(client, customers: int, round_: int) -> dict:  # type: ignore[no-untyped-def]
    results = together(client, [prompt(round_ * 100 + i) for i in range(customers)], TOKENS)
    ended = max((r["arrivals"][-1] for r in results if r["arrivals"]), default=time.perf_counter())
    began = min(r["sent"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "seconds": ended - began,
        "tps": tokens / (ended - began),
        "timeouts": sum(1 for r in results if r["status"] == 504),
        "errors": sum(1 for r in results if r["status"] not in (200, 504)),
    }


def ttft(result: dict) -> float:
    return result["arrivals"][0] - result["sent"]


def busy_ttft(client, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    idle = [ttft(stream(client, prompt(900 + i), 8)) for i in range(rounds)]
    busy = []
    for i in range(rounds):
        texts = [prompt(950 + i * 3 + k) for k in range(3)]
        runners = threading.Thread(target=together, args=(client, texts, 200))
        runners.start()
        time.sleep(2.0)  # the three are streaming
        busy.append(ttft(stream(client, prompt(990 + i), 8)))
        runners.join()
    return {
        "idle_ttft_ms_p50": statistics.median(idle) * 1000,
        "busy_ttft_ms_p50": statistics.median(busy) * 1000,
        "ratio": statistics.median(busy) / statistics.median(idle),
    }


def gaps(result: dict, since: float, until: float) -> list[float]:
    times = [t for t in result["arrivals"] if since <= t <= until]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def prefill_beside(client) -> dict:  # type: ignore[no-untyped-def]
    long_text = " ".join(f"word{i % 97}" for i in range(LONG_PROMPT_WORDS)) + ". In short,"
    quiet = together(client, [prompt(700), prompt(701)], 160)
    quiet_gaps = (
        [g for r in quiet for g in gaps(r, r["arrivals"][2], r["arrivals"][-1])]
        if all(len(r["arrivals"]) > 3 for r in quiet)
        else []
    )
    holder: list[dict] = []
    runners = threading.Thread(target=lambda: holder.extend(together(client, [prompt(702), prompt(703)], 300)))
    runners.start()
    time.sleep(2.0)
    started = time.perf_counter()
    long = stream(client, long_text, 4)
    runners.join()
    during = [
        g for r in holder for g in gaps(r, started, long["arrivals"][0] if long["arrivals"] else time.perf_counter())
    ]
    if long["status"] != 200 or not long["arrivals"]:
        raise SystemExit(f"the long prompt was refused ({long['status']}): no prefill measured")
    return {
        "quiet_p99_ms": pct(quiet_gaps, 0.99) * 1000 if quiet_gaps else None,
        "beside_prefill_p99_ms": pct(during, 0.99) * 1000 if during else None,
        "prefill_ttft_ms": ttft(long) * 1000 if long["arrivals"] else None,
        "ratio": (pct(during, 0.99) / pct(quiet_gaps, 0.99)) if during and quiet_gaps else None,
    }


def phase(args, server: str, secret: str, token: str, tmp: Path, slots: int) -> dict:  # type: ignore[no-untyped-def]
    import openai

    host = start(
        [
            sys.executable,
            "-m",
            "mahout",
            "run",
            "--server",
            server,
            "--token",
            token,
            "--home",
            str(tmp / "mahout"),
            "--threads",
            str(args.threads),
            "--slots",
            str(slots),
            "--no-idle-detect",
        ],
        tmp / f"mahout-{slots}.log",
    )
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=secret, max_retries=0, timeout=120)
    try:
        for _ in range(600):  # until mahout has benchmarked and claims
            if stream(client, prompt(0), 4)["status"] == 200:
                break
            time.sleep(0.5)
        out = {"slots": slots, "bursts": [burst(client, args.customers, r) for r in range(args.rounds)]}
        out["tps"] = statistics.median(b["tps"] for b in out["bursts"])
        out["timeouts"] = sum(b["timeouts"] for b in out["bursts"])
        if slots > 1:
            out["ttft"] = busy_ttft(client, 3)
            out["prefill"] = prefill_beside(client)
    finally:
        stop(host, timeout=60)
    from hosts.models import Host

    Host.objects.filter(token_prefix=token[:12]).update(last_heartbeat_at=None)  # gone: routing offers it nothing
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--customers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-slots-"))
    os.environ["HOST_PROBATION_MAX_JOBS"] = str(max(args.slots, 4))  # a new host may take all its slots
    setup_django(tmp)
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed
    from testkit.personas import make_customer, make_host

    catalog_seed(CatalogModel)
    os.environ["QUEUE_TIMEOUT_SECONDS"] = "30"
    server = f"http://127.0.0.1:{args.port}"
    gateway = start(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(args.port), "config.asgi:application"],
        tmp / "gateway.log",
    )
    try:
        wait_http(f"{server}/v1/models")
        customer = make_customer(credit_ucents=10**11)
        one = phase(
            args, server, customer.secret, make_host(qualified=False, name=f"bench-one-{time.time_ns()}").token, tmp, 1
        )
        many = phase(
            args,
            server,
            customer.secret,
            make_host(qualified=False, name=f"bench-many-{time.time_ns()}").token,
            tmp,
            args.slots,
        )
    finally:
        stop(gateway)
    from django.db import connection

    report = {
        "database": connection.vendor,
        "threads": args.threads,
        "customers": args.customers,
        "load": os.getloadavg(),
        "one_slot": one,
        "slots": many,
        "ratio": many["tps"] / one["tps"],
    }
    print(json.dumps(report, indent=2, default=str))
    print(
        f"\n{args.customers} customers x {TOKENS} tokens at once: "
        f"--slots {args.slots} {many['tps']:.1f} tok/s vs --slots 1 "
        f"{one['tps']:.1f} tok/s: ratio {report['ratio']:.2f} (floor 1.8, goal 2.4); 504s {many['timeouts']} "
        f"(with one slot: {one['timeouts']})"
    )
    t, p = many["ttft"], many["prefill"]
    print(
        f"TTFT while 3 streams run {t['busy_ttft_ms_p50']:.0f} ms vs "
        f"idle {t['idle_ttft_ms_p50']:.0f} ms: ratio {t['ratio']:.2f} "
        f"(floor 2, goal 1.3)"
    )
    if p["ratio"] is not None:
        print(
            f"inter-token p99 beside a ~2,000-token prefill {p['beside_prefill_p99_ms']:.0f} ms vs quiet "
            f"{p['quiet_p99_ms']:.0f} ms: ratio {p['ratio']:.2f} (floor 3, goal 1.5)"
        )


if __name__ == "__main__":
    main()
