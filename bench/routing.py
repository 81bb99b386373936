"""Routing throughput and placement, measured on the real services (no HTTP).

1. Claim throughput with H waiting hosts: N jobs are queued (each routed: offered to a
   warm host with a free slot), then H host threads — spread over P forked gateway
   processes — claim until the queue is empty. Claims per second, and the same run with
   the same plain-SQL claim minus routing's rules (oldest job first) for the baseline.
2. The routing decision's share: time of `placement` per job (at admission) and of
   a claim with and without the routing filter.
3. Warm share under a mixed load: M models, hosts each warm for one model (with spare
   capacity), a submitter queueing jobs of every model at random while the hosts claim,
   hold each job for a few ms and complete it. Share of jobs that ran on a host warm
   for its model.
4. Mixed speeds: two fast and two slow warm hosts of one model (by the tokens/s the
   gateway measured) and two idle cold hosts, under a load that often keeps every warm
   host busy: the share on warm hosts, and how the jobs split between fast and slow.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/elephant_routing_bench \\
        .venv/bin/python bench/routing.py [--hosts 50] [--jobs 2000] [--processes 2] [--only-mixed]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _bench_helpers():  # type: ignore[no-untyped-def]
    """bench/billing.py's setup and helpers (loaded by path: `billing` is also a Django app)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_billing", ROOT / "bench" / "billing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


_helpers = _bench_helpers()
setup_django, pct, gateway_call = _helpers.setup_django, _helpers.pct, _helpers.gateway_call


def catalog_model(name: str):  # type: ignore[no-untyped-def]
    from catalog.models import CatalogModel

    return CatalogModel.objects.create(
        name=f"{name}-{uuid.uuid4().hex[:6]}",
        context_length=100_000,
        input_price_ucents=10,
        output_price_ucents=40,
        tokenizer="bytes",
    )


def farm(models: list, hosts: int, *, warm_for=None, slots: int = 4) -> list:  # type: ignore[no-untyped-def]
    """`hosts` hosts qualified for every model; host i is warm for `warm_for(i)` (a model or None for all)."""
    from hosts.services import host_heartbeat, qualification_register
    from testkit.personas import make_host

    made = []
    for i in range(hosts):
        serving = make_host(qualified=False, name=f"bench-{uuid.uuid4().hex[:6]}", trusted=True)
        for model in models:
            qualification_register(
                host=serving.host,
                model_name=model.name,
                fingerprint=serving.fingerprint,
                benchmark={"prompt_tps": 1, "gen_tps": 40, "ttft_ms": 1, "memory_mb": 1},
                machine={},
            )
        loaded = [m.name for m in models] if warm_for is None else [warm_for(i).name]
        host_heartbeat(
            host=serving.host,
            fingerprint=serving.fingerprint,
            paused=False,
            models_loaded=loaded,
            version="b",
            catalog={"installed": loaded, "qualified": loaded, "loaded": loaded, "slots": slots, "active_jobs": 0},
        )
        made.append(serving)
    return made


def submit(customer, model) -> None:  # type: ignore[no-untyped-def]
    from marketplace import services as market

    market.request_submit(
        public_id=market.new_public_id("chat"),
        api_key=customer.key,
        model=model,
        kind="chat",
        messages=[{"role": "user", "content": "hi"}],
        prompt=None,
        stream=True,
        prompt_tokens=4,
        params={"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": None},
    )


def claim_loop(hosts: list, model_ids: list[int], routed: bool, latencies: list[float]) -> None:
    """Each thread is one waiting host: claim until the queue is empty."""
    from django.db import connection

    from hosts import selectors as host_selectors
    from hosts.models import Host
    from marketplace import services as market
    from mesh.rings.selectors import bridged_model_ids

    def host_thread(serving) -> None:  # type: ignore[no-untyped-def]
        host = Host.objects.get(pk=serving.host.pk)
        warm = host_selectors.warm_model_ids(host=host, model_ids=model_ids) if routed else model_ids
        rings = bridged_model_ids(host_id=host.pk)  # once per long-poll, as `marketplace.hostdoor.claiming` reads them
        mine = []
        try:
            while True:
                t0 = time.perf_counter()
                if routed:
                    payload = gateway_call(
                        market.job_claim_payload, host=host, model_ids=model_ids, warm_ids=warm, ring_ids=rings
                    )
                else:
                    payload = gateway_call(plain_claim, host=host, model_ids=model_ids)
                mine.append(time.perf_counter() - t0)
                if payload is None:
                    break
        finally:
            connection.close()
            latencies.extend(mine)

    threads = [threading.Thread(target=host_thread, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def plain_claim(*, host, model_ids: list[int]):  # type: ignore[no-untyped-def]
    """The same claim statement as `job_claim_payload` with routing's rules left out (the
    oldest queued job of a qualified model): the baseline for routing's share of a claim."""
    from django.utils import timezone

    from marketplace import services as market
    from marketplace.models import Job

    selection = (
        f"status = %s AND model_id IN ({', '.join(['%s'] * len(model_ids))}) ORDER BY created_at, id",
        [Job.Status.QUEUED, *model_ids],
    )
    job = market.job_claim_selected(host=host, selection=selection, now=timezone.now())
    return None if job is None else market.job_payload(job)


def _claims_child(host_slice: list, model_ids: list[int], routed: bool, start_at: float) -> None:
    from django.db import connections

    connections.close_all()
    time.sleep(max(0.0, start_at - time.time()))
    claim_loop(host_slice, model_ids, routed, [])


def bench_claims(hosts_n: int, jobs_n: int, processes: int, routed: bool) -> None:
    import multiprocessing

    from django.db import connections

    from marketplace.trust import routing
    from testkit.personas import make_customer

    model = catalog_model("claims")
    hosts = farm([model], hosts_n, slots=max(1, jobs_n // hosts_n + 2))
    customer = make_customer(credit_ucents=10**13)
    route_times = []
    for _ in range(jobs_n):
        t0 = time.perf_counter()
        gateway_call(submit, customer, model)
        route_times.append(time.perf_counter() - t0)
    if not routed:
        from marketplace.models import Job

        Job.objects.filter(model=model).update(offered_host=None, offer_until=None, warm_until=None)
    # time the routing decision alone, on the same pool (the hosts are full of offers now: worst case)
    from django.utils import timezone

    decision = []
    for _ in range(50):
        t0 = time.perf_counter()
        routing.pick(model=model, pool=routing.candidates(model=model, now=timezone.now()), now=timezone.now())
        decision.append(time.perf_counter() - t0)
    connections.close_all()
    context = multiprocessing.get_context("fork")
    start_at = time.time() + 1.0
    children = [
        context.Process(target=_claims_child, args=(hosts[i::processes], [model.pk], routed, start_at))
        for i in range(processes)
    ]
    for c in children:
        c.start()
    for c in children:
        c.join()
    elapsed = time.time() - start_at
    from marketplace.models import Job

    claimed = Job.objects.filter(model=model, status=Job.Status.RUNNING).count()
    label = "routing on " if routed else "routing off"
    print(
        f"claims, {hosts_n} waiting hosts, {processes} process(es), {label}: {claimed}/{jobs_n} in {elapsed:.2f} s "
        f"= {claimed / elapsed:.0f} claims/s"
    )
    if routed:
        print(
            f"  admission incl. routing decision: p50 {pct(route_times, 0.5) * 1000:.1f} ms; routing decision alone "
            f"({hosts_n} hosts): p50 {pct(decision, 0.5) * 1000:.2f} ms, p95 {pct(decision, 0.95) * 1000:.2f} ms"
        )


def bench_claim_latency(hosts_n: int) -> None:
    """One host claiming alone, with and without routing's filter, in one process."""
    from hosts import selectors as host_selectors
    from hosts.models import Host
    from marketplace import services as market
    from testkit.personas import make_customer

    model = catalog_model("latency")
    hosts = farm([model], hosts_n, slots=1000)
    customer = make_customer(credit_ucents=10**13)
    for _ in range(400):
        gateway_call(submit, customer, model)
    from marketplace.models import Job

    Job.objects.filter(model=model).update(offered_host=hosts[0].host)  # all offered to the claiming host
    host = Host.objects.get(pk=hosts[0].host.pk)
    warm = host_selectors.warm_model_ids(host=host, model_ids=[model.pk])
    sides: dict[str, list[float]] = {"routed": [], "plain": []}
    for i in range(400):
        side = "routed" if i % 2 == 0 else "plain"
        t0 = time.perf_counter()
        if side == "routed":
            gateway_call(
                market.job_claim_payload, host=host, model_ids=[model.pk], warm_ids=warm, ring_ids=[]
            )  # (bridging no ring: looked up once per long-poll)
        else:
            gateway_call(plain_claim, host=host, model_ids=[model.pk])
        sides[side].append(time.perf_counter() - t0)
    r, p = statistics.median(sides["routed"]), statistics.median(sides["plain"])
    print(
        f"claim latency, alternating: with routing filter p50 {r * 1000:.2f} ms, plain p50 {p * 1000:.2f} ms; "
        f"routing's share {max(0.0, r - p) / r:.0%}"
    )


def bench_warm_share(hosts_n: int, models_n: int, jobs_n: int, hold_ms: float) -> None:
    from django.db import connection

    from hosts import selectors as host_selectors
    from hosts.models import Host
    from marketplace import services as market
    from marketplace.models import Job
    from testkit.personas import make_customer

    models = [catalog_model(f"mix{i}") for i in range(models_n)]
    hosts = farm(models, hosts_n, warm_for=lambda i: models[i % models_n], slots=1)
    model_ids = [m.pk for m in models]
    customer = make_customer(credit_ucents=10**13)
    done = threading.Event()

    def host_thread(serving) -> None:  # type: ignore[no-untyped-def]
        host = Host.objects.get(pk=serving.host.pk)
        warm = host_selectors.warm_model_ids(host=host, model_ids=model_ids)
        try:
            while not done.is_set() or Job.objects.filter(model_id__in=model_ids, status=Job.Status.QUEUED).exists():
                payload = gateway_call(
                    market.job_claim_payload, host=host, model_ids=model_ids, warm_ids=warm, ring_ids=[]
                )
                if payload is None:
                    time.sleep(0.01)
                    continue
                time.sleep(hold_ms / 1000)
                gateway_call(market.job_push_tokens, host=host, job_id=payload["id"], seq=0, text="x")
                gateway_call(market.job_complete, host=host, job_id=payload["id"], finish_reason="stop")
        finally:
            connection.close()

    threads = [threading.Thread(target=host_thread, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    rng = random.Random(7)
    for _ in range(jobs_n):
        gateway_call(submit, customer, rng.choice(models))
        time.sleep(rng.expovariate(1 / 0.01))
    done.set()
    for t in threads:
        t.join()
    connection.close()
    warm_of = {h.host.pk: models[i % models_n].pk for i, h in enumerate(hosts)}
    jobs = list(
        Job.objects.filter(model_id__in=model_ids).values_list("host_id", "model_id", "claimed_at", "created_at")
    )
    on_warm = sum(1 for host_id, model_id, _, _ in jobs if warm_of.get(host_id) == model_id)
    waits = [(c - q).total_seconds() for _, _, c, q in jobs if c]
    print(
        f"warm share, {hosts_n} hosts ({models_n} models, each host "
        f"warm for one), {len(jobs)} jobs, hold {hold_ms:.0f} ms: "
        f"{on_warm / len(jobs):.1%} on a warm host; queue wait p50 {pct(waits, 0.5) * 1000:.0f} ms, "
        f"p95 {pct(waits, 0.95) * 1000:.0f} ms"
    )


def bench_mixed_speed(jobs_n: int) -> None:
    """Mixed speeds: 4 warm hosts of one model, two fast (80 tokens/s measured: a job holds them
    10 ms) and two slow (20 tokens/s: 40 ms), and 2 idle cold hosts (qualified, not loaded).
    Jobs arrive every ~8 ms on average, so the warm hosts are often all busy: cold hosts should
    still take (almost) nothing, and the fast hosts should take more of the jobs."""
    from django.db import connection

    from hosts import selectors as host_selectors
    from hosts.models import Host
    from hosts.services import host_heartbeat
    from marketplace import services as market
    from marketplace.models import Job
    from testkit.personas import make_customer

    model = catalog_model("speeds")
    hosts = farm([model], 6, slots=1)
    speeds = [80.0, 80.0, 20.0, 20.0, None, None]
    for serving, speed in zip(hosts, speeds, strict=True):
        if speed is None:  # cold: it would have to load the model
            host_heartbeat(
                host=serving.host,
                fingerprint=serving.fingerprint,
                paused=False,
                models_loaded=[],
                version="b",
                catalog={
                    "installed": [model.name],
                    "qualified": [model.name],
                    "loaded": [],
                    "slots": 1,
                    "active_jobs": 0,
                },
            )
        else:
            Host.objects.filter(pk=serving.host.pk).update(measured_tps=speed)
    customer = make_customer(credit_ucents=10**13)
    done = threading.Event()

    def host_thread(serving, speed) -> None:  # type: ignore[no-untyped-def]
        host = Host.objects.get(pk=serving.host.pk)
        warm = host_selectors.warm_model_ids(host=host, model_ids=[model.pk])
        hold = 0.8 / (speed or 20.0)  # 0.8 s of work at 1 token/s: 10 ms fast, 40 ms slow (a cold host as slow)
        try:
            while not done.is_set() or Job.objects.filter(model=model, status=Job.Status.QUEUED).exists():
                payload = gateway_call(
                    market.job_claim_payload, host=host, model_ids=[model.pk], warm_ids=warm, ring_ids=[]
                )
                if payload is None:
                    time.sleep(0.005)
                    continue
                time.sleep(hold)
                gateway_call(market.job_push_tokens, host=host, job_id=payload["id"], seq=0, text="x")
                gateway_call(market.job_complete, host=host, job_id=payload["id"], finish_reason="stop")
        finally:
            connection.close()

    threads = [threading.Thread(target=host_thread, args=(h, s)) for h, s in zip(hosts, speeds, strict=True)]
    for t in threads:
        t.start()
    rng = random.Random(11)
    for _ in range(jobs_n):
        gateway_call(submit, customer, model)
        time.sleep(rng.expovariate(1 / 0.008))
    done.set()
    for t in threads:
        t.join()
    connection.close()
    kind = {
        h.host.pk: ("fast" if s == 80.0 else "slow" if s == 20.0 else "cold")
        for h, s in zip(hosts, speeds, strict=True)
    }
    jobs = list(Job.objects.filter(model=model).values_list("host_id", "claimed_at", "created_at"))
    counts = {k: sum(1 for host_id, _, _ in jobs if kind.get(host_id) == k) for k in ("fast", "slow", "cold")}
    waits = [(c - q).total_seconds() for _, c, q in jobs if c]
    print(
        f"mixed speeds, 2 fast + 2 slow warm hosts and 2 idle cold ones, {len(jobs)} jobs: "
        f"{(counts['fast'] + counts['slow']) / len(jobs):.1%} on a "
        f"warm host (fast {counts['fast']}, slow {counts['slow']}, "
        f"cold {counts['cold']}); queue wait p50 {pct(waits, 0.5) * 1000:.0f} ms, p95 {pct(waits, 0.95) * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--mixed-jobs", type=int, default=600)
    parser.add_argument("--only-mixed", action="store_true", help="only the warm-share and mixed-speed cases")
    args = parser.parse_args()
    setup_django()
    from django.db import connection

    print(f"database: {connection.vendor}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    if not args.only_mixed:
        bench_claims(args.hosts, args.jobs, args.processes, routed=False)
        bench_claims(args.hosts, args.jobs, args.processes, routed=True)
        bench_claim_latency(args.hosts)
    bench_warm_share(hosts_n=10, models_n=2, jobs_n=args.mixed_jobs, hold_ms=20)
    bench_mixed_speed(jobs_n=args.mixed_jobs)


if __name__ == "__main__":
    main()
