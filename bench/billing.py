"""Billing throughput and cost, measured on the real services (no HTTP).

1. Settlements per second on ONE hot customer account: N requests are admitted,
   claimed and given text up front; then T threads complete them concurrently
   (`job_complete`: count tokens, settle the hold, credit host and platform).
   Every settlement locks the same customer account row, so this is the
   worst case for contention.
2. Admission latency under C concurrent clients (`request_submit`: hold +
   request + job in one transaction), for one shared account (hot) and for one
   account per client (spread).
3. Ledger rows written per request (holds, transactions, entries) for 10 and
   1,000 completion tokens.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/elephant_billing_bench \\
        .venv/bin/python bench/billing.py [--settlements 1000] [--processes 2] [--threads 1] \\
        [--clients 50] [--admissions 20]

Uses a bench catalog model counted by the byte tokenizer, so the figures are
billing's, not the GGUF tokenizer's. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def setup_django() -> None:
    if not os.environ.get("DATABASE_URL"):
        os.environ["SQLITE_PATH"] = str(Path(tempfile.mkdtemp()) / "bench.sqlite3")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    # The bench's one host runs every prepared job at once: a trusted host whose cap is its slots.
    os.environ.setdefault("HOST_TRUSTED_MAX_JOBS", "1000000")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def params(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": None}


class World:
    def __init__(self) -> None:
        from catalog.models import CatalogModel
        from hosts.services import qualification_register
        from testkit.personas import make_host

        self.model = CatalogModel.objects.create(
            name=f"bench-{uuid.uuid4().hex[:6]}",
            context_length=100_000,
            input_price_ucents=10,
            output_price_ucents=40,
            tokenizer="bytes",
        )
        from hosts.models import Host

        self.serving = make_host(qualified=False, name=f"bench-{uuid.uuid4().hex[:6]}", trusted=True)
        Host.objects.filter(pk=self.serving.host.pk).update(slots=30000)
        self.serving.host.refresh_from_db()
        qualification_register(
            host=self.serving.host,
            model_name=self.model.name,
            fingerprint=self.serving.fingerprint,
            benchmark={"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1},
            machine={},
        )

    def customer(self, credit_ucents: int):  # type: ignore[no-untyped-def]
        from testkit.personas import make_customer

        return make_customer(credit_ucents=credit_ucents)

    def submit(self, customer, max_tokens: int = 64):  # type: ignore[no-untyped-def]
        from marketplace import services as market

        return market.request_submit(
            public_id=market.new_public_id("chat"),
            api_key=customer.key,
            model=self.model,
            kind="chat",
            messages=[{"role": "user", "content": "hi"}],
            prompt=None,
            params=params(max_tokens),
            stream=True,
            prompt_tokens=8,
        )

    def run_to_completion_prep(self, customer, text: str, max_tokens: int):  # type: ignore[no-untyped-def]
        """Admit, claim and push text; return the running job's id."""
        from marketplace import services as market

        self.submit(customer, max_tokens)
        job = market.job_claim_next(host=self.serving.host, fingerprint=self.serving.fingerprint)
        market.job_push_tokens(host=self.serving.host, job_id=job.pk, seq=0, text=text)
        return job.pk


def gateway_call(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Call a service as the gateway's `aio.db()` does: announcements go to an outbox
    (delivered by the event loop after the call, outside the transaction; dropped here)."""
    from core import events

    token = events.collecting([])
    try:
        return fn(*args, **kwargs)
    finally:
        events.stop_collecting(token)


def pooled(fn, items: list, threads: int) -> None:  # type: ignore[no-untyped-def]
    """Run fn over items on `threads` threads, each keeping one database connection."""
    chunks = [items[i::threads] for i in range(threads)]

    def worker(chunk: list) -> None:
        from django.db import connection

        try:
            for item in chunk:
                fn(item)
        finally:
            connection.close()

    workers = [threading.Thread(target=worker, args=(chunk,)) for chunk in chunks]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _settle_in_child(job_ids: list[int], host_pk: int, threads: int, start_at: float) -> None:
    """A forked gateway process: its own database connection(s), its share of the jobs."""
    from django.db import connections

    from hosts.models import Host
    from marketplace import services as market

    connections.close_all()  # never share the parent's socket
    host = Host.objects.get(pk=host_pk)
    connections.close_all()
    time.sleep(max(0.0, start_at - time.time()))
    pooled(
        lambda job_id: gateway_call(market.job_complete, host=host, job_id=job_id, finish_reason="stop"),
        job_ids,
        threads,
    )


def bench_settlements(world: World, n: int, threads: int, processes: int) -> None:
    """N settlements of one customer, spread over `processes` forked gateway processes
    with `threads` threads each (a deployment runs several ASGI processes)."""
    import multiprocessing

    from django.db import connections

    from billing import selectors
    from marketplace import services as market

    customer = world.customer(10**13)
    jobs = [gateway_call(world.run_to_completion_prep, customer, "x" * 32, 64) for _ in range(n)]
    if processes <= 1:
        start = time.perf_counter()
        pooled(
            lambda job_id: gateway_call(
                market.job_complete, host=world.serving.host, job_id=job_id, finish_reason="stop"
            ),
            jobs,
            threads,
        )
        elapsed = time.perf_counter() - start
    else:
        connections.close_all()
        context = multiprocessing.get_context("fork")
        start_at = time.time() + 1.0  # children start together, after forking and connecting
        children = [
            context.Process(
                target=_settle_in_child, args=(jobs[i::processes], world.serving.host.pk, threads, start_at)
            )
            for i in range(processes)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join()
        elapsed = time.time() - start_at
        if any(child.exitcode for child in children):
            raise SystemExit("a settling process failed")
    account = selectors.customer_account(user=customer.user)
    assert account.held_ucents == 0, account.held_ucents
    print(
        f"settlements, one hot customer account: {n} in {elapsed:.2f} s with {processes} process(es) x {threads} "
        f"thread(s) = {n / elapsed:.0f}/s"
    )


def bench_admissions(world: World, clients: int, per_client: int, *, hot: bool) -> None:
    shared = world.customer(10**13) if hot else None
    owners = [shared or world.customer(10**12) for _ in range(clients)]
    latencies: list[float] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        from django.db import connection

        mine = []
        try:
            for _ in range(per_client):
                t0 = time.perf_counter()
                gateway_call(world.submit, owners[index])
                mine.append(time.perf_counter() - t0)
        finally:
            connection.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    label = "one shared account" if hot else "one account per client"
    print(
        f"admission latency, {clients} concurrent clients, {label}: p50 {pct(latencies, 0.5) * 1000:.1f} ms, "
        f"p95 {pct(latencies, 0.95) * 1000:.1f} ms, mean {statistics.mean(latencies) * 1000:.1f} ms "
        f"({len(latencies)} admissions, {len(latencies) / elapsed:.0f}/s)"
    )


def bench_rows(world: World) -> None:
    from billing.models import Hold, LedgerEntry, LedgerTransaction
    from marketplace import services as market

    customer = world.customer(10**12)
    for tokens in (10, 1_000):
        before = (Hold.objects.count(), LedgerTransaction.objects.count(), LedgerEntry.objects.count())
        job_id = world.run_to_completion_prep(customer, "y" * tokens, tokens)
        done = market.job_complete(host=world.serving.host, job_id=job_id, finish_reason="stop")
        after = (Hold.objects.count(), LedgerTransaction.objects.count(), LedgerEntry.objects.count())
        holds, txns, entries = (a - b for a, b in zip(after, before, strict=True))
        print(
            f"ledger rows for a {done.request.completion_tokens}-token request: {holds} hold, {txns} transaction, "
            f"{entries} entries ({holds + txns + entries} rows)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settlements", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="settling threads per process")
    parser.add_argument("--processes", type=int, default=1, help="settling gateway processes")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--admissions", type=int, default=20, help="admissions per client")
    args = parser.parse_args()
    setup_django()
    from django.db import connection

    print(f"database: {connection.vendor}; {os.cpu_count()} CPUs")
    world = World()
    bench_rows(world)
    bench_settlements(world, args.settlements, args.threads, args.processes)
    bench_admissions(world, args.clients, args.admissions, hot=True)
    bench_admissions(world, args.clients, args.admissions, hot=False)


if __name__ == "__main__":
    main()
