"""Request-path overhead, measured side by side in one run.

1. Time to first token and decode tokens/s through the gateway (openai client →
   daphne → queue → real mahout → SSE) versus a direct llama-cpp-python call in
   this process with the same model, threads, prompt and greedy sampling.
   Runs alternate (direct, gateway, direct, …) so machine noise hits both;
   each round uses a new prompt (as customers do), so neither side reuses a
   cached prompt prefix.
2. Claim latency for a waiting host: a host long-polls; a request is queued;
   latency = host receives the job − the job row's created_at (conservative:
   it includes the commit).

    .venv/bin/python bench/request_path.py [--rounds 15] [--threads 1] [--claims 50]

Uses a fresh SQLite file unless DATABASE_URL is set (then that database is
migrated and used; pair it with REDIS_URL for the Redis channel layer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.simhost import drawn_ids  # noqa: E402 (after the path)

PROMPT = "{n}. Once upon a time, in a village at the edge of a great forest, there lived"
MAX_TOKENS = 64


def setup_django(tmp: Path) -> None:
    if not os.environ.get("DATABASE_URL"):
        os.environ["SQLITE_PATH"] = str(tmp / "bench.sqlite3")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["QUEUE_TIMEOUT_SECONDS"] = "30"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen, *, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_http(url: str) -> None:
    import httpx

    for _ in range(300):
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


def direct_run(llm, n: int) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    first = last = 0.0
    count = 0
    for chunk in llm.create_completion(PROMPT.format(n=n), max_tokens=MAX_TOKENS, temperature=0.0, stream=True):
        if chunk["choices"][0]["text"]:
            last = time.perf_counter()
            first = first or last
            count += 1
    return first - started, (count - 1) / (last - first), count


WALL: list[tuple[float, float]] = []  # each gateway round's (sent, first text received), wall clock


def gateway_run(client, n: int) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    started, sent = time.perf_counter(), time.time()
    first = last = 0.0
    tokens = 0
    for chunk in client.completions.create(
        model="gemma-3-270m",
        prompt=PROMPT.format(n=n),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    WALL.append((sent, sent + first - started))
    return first - started, (tokens - 1) / (last - first), tokens


def generation_phase(args, server: str, secret: str, token: str, tmp: Path) -> dict:  # type: ignore[no-untyped-def]
    import openai

    from catalog.tokenizer import shipped_model_path
    from scorer.llama import load_llama

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
        ],
        tmp / "mahout.log",
    )
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=secret, max_retries=0)
    llm = load_llama(shipped_model_path(), n_ctx=4096, threads=args.threads)
    try:
        for _ in range(600):  # until mahout has benchmarked and claims
            try:
                gateway_run(client, 0)
                break
            except openai.APIStatusError:
                time.sleep(0.5)
        direct_run(llm, 0)  # warm both paths once
        from django.utils import timezone

        since = timezone.now()
        WALL.clear()
        rows: dict[str, list[tuple[float, float, int]]] = {"direct": [], "gateway": []}
        for n in range(1, args.rounds + 1):  # a new prompt each round: no prefix-cache hits on either side
            rows["direct"].append(direct_run(llm, n))
            rows["gateway"].append(gateway_run(client, n))
    finally:
        host.kill()
        host.wait(timeout=20)
    out = {"stages_ms_p50": gateway_stages(since)}
    for name, runs in rows.items():
        out[name] = {
            "ttft_ms_p50": statistics.median(r[0] for r in runs) * 1000,
            "decode_tps_p50": statistics.median(r[1] for r in runs),
            "tokens": statistics.median(r[2] for r in runs),
        }
    out["ttft_ratio"] = out["gateway"]["ttft_ms_p50"] / out["direct"]["ttft_ms_p50"]
    out["ttft_extra_ms"] = out["gateway"]["ttft_ms_p50"] - out["direct"]["ttft_ms_p50"]
    out["decode_ratio"] = out["gateway"]["decode_tps_p50"] / out["direct"]["decode_tps_p50"]
    return out


def gateway_stages(since) -> dict:  # type: ignore[no-untyped-def]
    """Where the gateway runs spent their time to first token, from the job rows."""
    from marketplace.models import Job

    jobs = list(Job.objects.filter(created_at__gte=since, first_token_at__isnull=False).order_by("created_at"))
    walls = WALL[-len(jobs) :] if len(WALL) >= len(jobs) else []
    return {
        "sent_to_queued": statistics.median(
            (j.created_at.timestamp() - sent) * 1000 for j, (sent, _) in zip(jobs, walls, strict=True)
        )
        if walls
        else None,
        "first_push_to_customer": statistics.median(
            (got - j.first_token_at.timestamp()) * 1000 for j, (_, got) in zip(jobs, walls, strict=True)
        )
        if walls
        else None,
        "queued_to_claimed": statistics.median((j.claimed_at - j.created_at).total_seconds() * 1000 for j in jobs),
        "claimed_to_first_push": statistics.median(
            (j.first_token_at - j.claimed_at).total_seconds() * 1000 for j in jobs
        ),
    }


def claim_phase(args, server: str, secret: str, catalog) -> dict:  # type: ignore[no-untyped-def]
    """A synthetic host (real HTTP, no model; online and warm by its heartbeat, so routing
    offers it each job) long-polls; each queued job is timed."""
    import httpx

    from mahout import __version__ as mahout_version
    from marketplace.models import Job
    from testkit.personas import make_host

    fake = make_host(name=f"bench-{time.time_ns()}", fingerprint="b" * 64)
    auth = {"Authorization": f"Bearer {fake.token}"}
    received: dict[int, float] = {}
    stop = threading.Event()

    def host_loop() -> None:
        with httpx.Client(base_url=server, headers=auth, timeout=30) as http:
            catalog = {
                "installed": ["gemma-3-270m"],
                "qualified": ["gemma-3-270m"],
                "loaded": ["gemma-3-270m"],
                "slots": 1,
            }
            http.post(
                "/hosts/api/heartbeat",
                json={"fingerprint": fake.fingerprint, "catalog": catalog, "version": mahout_version},
            ).raise_for_status()
            while not stop.is_set():
                answer = http.post("/hosts/api/claim", json={"fingerprint": fake.fingerprint, "wait": 1})
                if answer.status_code != 200:
                    continue
                job = answer.json()["job"]
                received[job["id"]] = time.time()
                http.post(f"/hosts/api/jobs/{job['id']}/tokens", json={"seq": 0, "text": "ok"})
                http.post(
                    f"/hosts/api/jobs/{job['id']}/complete",
                    json={"finish_reason": "stop", "tokens": drawn_ids(job["model"], "ok")},
                )

    thread = threading.Thread(target=host_loop, daemon=True)
    thread.start()
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {secret}"}, timeout=60) as http:
        for _ in range(args.claims):
            time.sleep(0.15)  # let the host get back into its long-poll
            http.post(
                "/v1/chat/completions",
                json={"model": "gemma-3-270m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            )
    stop.set()
    thread.join(timeout=10)
    latencies = [
        (received[job.pk] - job.created_at.timestamp()) * 1000
        for job in Job.objects.filter(host=fake.host)
        if job.pk in received
    ]
    return {
        "samples": len(latencies),
        "claim_ms_p50": statistics.median(latencies),
        "claim_ms_p95": pct(latencies, 0.95),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--claims", type=int, default=50)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-bench-"))
    setup_django(tmp)
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed
    from testkit.personas import make_customer, make_host

    catalog_seed(CatalogModel)
    catalog = CatalogModel.objects.get(name="gemma-3-270m")
    server = f"http://127.0.0.1:{args.port}"
    gateway = start(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(args.port), "config.asgi:application"],
        tmp / "gateway.log",
    )
    try:
        wait_http(f"{server}/v1/models")
        customer = make_customer(credit_ucents=10**10)
        serving = make_host(qualified=False, name=f"bench-real-{time.time_ns()}")
        generation = generation_phase(args, server, customer.secret, serving.token, tmp)
        from hosts.models import Host  # its mahout has stopped: routing must not offer it jobs for 30 s more

        Host.objects.filter(pk=serving.host.pk).update(last_heartbeat_at=None)
        claims = claim_phase(args, server, customer.secret, catalog)
    finally:
        stop(gateway)
    from django.db import connection

    report = {
        "database": connection.vendor,
        "threads": args.threads,
        "rounds": args.rounds,
        "generation": generation,
        "claims": claims,
    }
    print(json.dumps(report, indent=2))
    g = generation
    print(
        f"\nTTFT   gateway {g['gateway']['ttft_ms_p50']:.1f} ms vs direct {g['direct']['ttft_ms_p50']:.1f} ms: "
        f"ratio {g['ttft_ratio']:.2f} (target <= 1.25), +{g['ttft_extra_ms']:.1f} ms (target <= 50)"
    )
    print(
        f"decode gateway {g['gateway']['decode_tps_p50']:.1f} tok/s "
        f"vs direct {g['direct']['decode_tps_p50']:.1f} tok/s: "
        f"ratio {g['decode_ratio']:.2f} (target >= 0.90)"
    )
    print(
        f"claim  p50 {claims['claim_ms_p50']:.1f} ms, p95 "
        f"{claims['claim_ms_p95']:.1f} ms over {claims['samples']} jobs "
        f"(targets 10 / 50 ms)"
    )


if __name__ == "__main__":
    main()
