"""Routing, simulated: many lightweight host processes speaking the real host API
(`testkit.simhost`) against a real gateway (daphne) on the test database.
Customers call the real OpenAI API over HTTP; placement is read back from the jobs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

from conftest import ROOT, Gateway, make_customer, stack_env, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from pytest_django import DjangoDbBlocker

    from catalog.models import CatalogModel
    from hosts.models import Host

pytestmark = pytest.mark.django_db(transaction=True)

OFFER_SECONDS = 1.0
COLD_GRACE_SECONDS = 1.0
MAX_FAILURES = 3


@pytest.fixture(scope="module")
def routing_gateway(
    django_db_setup: None, django_db_blocker: DjangoDbBlocker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("routing-logs")
    with django_db_blocker.unblock():
        env = stack_env(
            {
                "ROUTING_OFFER_SECONDS": str(OFFER_SECONDS),
                "ROUTING_COLD_GRACE_SECONDS": str(COLD_GRACE_SECONDS),
                "HOST_MAX_FAILURES_PER_HOUR": str(MAX_FAILURES),
                "MODEL_LIST_CACHE_SECONDS": "0",
                "QUEUE_TIMEOUT_SECONDS": "30",
                "CONTINUATION_GRACE_SECONDS": "0.5",
                # its simulated hosts hold jobs (`--delay`, `hold:`) before their first token on purpose, with
                # benchmark figures that say they start at once: a real host doing so would be found frozen
                "JOB_START_FLOOR_SECONDS": "30",
            }
        )
    gateway = Gateway(env, logs)
    yield gateway
    gateway.stop()


@pytest.fixture
def sim_model(transactional_db: None) -> CatalogModel:
    """A chat model counted by the byte tokenizer, so the figures are routing's."""
    from catalog.models import CatalogModel

    return CatalogModel.objects.create(
        name=f"sim-{uuid.uuid4().hex[:6]}",
        context_length=4096,
        input_price_ucents=10,
        output_price_ucents=40,
        tokenizer="bytes",
    )


class Sim:
    """One simulated host process and the jobs it reports."""

    def __init__(self, server: str, model: str, name: str, args: list[str]) -> None:
        from django.utils import timezone

        from hosts.models import Host
        from hosts.services import host_create

        new = host_create(email=f"{name}-{uuid.uuid4().hex[:6]}@example.com", name=name)
        Host.objects.filter(pk=new.host.pk).update(trusted_at=timezone.now())  # the strategies, among equals
        self.host = new.host
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testkit.simhost",
                "--server",
                server,
                "--token",
                new.token,
                "--model",
                model,
                *args,
            ],
            cwd=ROOT,
            env=stack_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.records: list[dict] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                try:
                    record = json.loads(line)
                except ValueError:
                    self.records.append({"log": line})
                    continue
                self.records.append(record)
                if record.get("ready"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(30):
            raise AssertionError(f"simulated host {name} did not start: {self.records}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def sims(routing_gateway: Gateway, sim_model: CatalogModel) -> Iterator[Callable[..., Sim]]:
    started: list[Sim] = []

    def start(name: str, *args: str) -> Sim:
        sim = Sim(routing_gateway.url, sim_model.name, name, list(args))
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


def ask(gateway: Gateway, secret: str, model: str, timeout: float = 60, prompt: str = "route me") -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/completions",
        headers={"Authorization": f"Bearer {secret}"},
        json={"model": model, "prompt": prompt, "max_tokens": 4},
        timeout=timeout,
    )


def jobs_of(model: CatalogModel) -> list:
    from marketplace.models import Job

    return list(Job.objects.filter(model=model).order_by("created_at"))


def running_per_host(model: CatalogModel, hosts: list[Host]) -> list[int]:
    from marketplace.models import Job

    return [Job.objects.filter(model=model, host=h, status=Job.Status.RUNNING).count() for h in hosts]


def test_warm_host_gets_the_jobs_and_a_cold_host_only_after_the_grace(routing_gateway, sims, sim_model) -> None:
    from marketplace.models import Job

    warm = sims("warm", "--loaded", sim_model.name, "--delay", "0.2")
    cold = sims("cold", "--loaded", "", "--delay", "0.2")
    customer = make_customer()
    for _ in range(3):  # one at a time: the warm host is free each time, so it takes every one
        assert ask(routing_gateway, customer.secret, sim_model.name).status_code == 200
    assert {job.host_id for job in jobs_of(sim_model)} == {warm.host.pk}

    with ThreadPoolExecutor(2) as pool:
        # The warm host's only slot is taken first (its job holds it 10 s), and only then does the
        # next request arrive: no warm host can take it, so the cold host does, once the grace is over.
        held = pool.submit(ask, routing_gateway, customer.secret, sim_model.name, prompt="hold:10 route me")
        wait_until(lambda: running_per_host(sim_model, [warm.host]) == [1], timeout=15, what="the warm host to be busy")
        second = ask(routing_gateway, customer.secret, sim_model.name)
        assert [second.status_code, held.result().status_code] == [200, 200]
    jobs = jobs_of(sim_model)
    last = jobs[-1]
    placed = [
        (job.pk, job.host_id, job.claimed_at and (job.claimed_at - job.created_at).total_seconds()) for job in jobs
    ]
    assert last.host_id == cold.host.pk and last.status == Job.Status.COMPLETED, (warm.host.pk, cold.host.pk, placed)
    waited = (last.claimed_at - last.created_at).total_seconds()
    assert waited >= COLD_GRACE_SECONDS - 0.05, f"the cold host took a job after {waited:.2f} s, inside the grace"


def test_a_host_whose_catalog_is_unreadable_still_gets_work(routing_gateway, sims, sim_model) -> None:
    from hosts.models import Host

    unreadable = sims("unreadable", "--catalog", "unreadable")
    sims("cold", "--loaded", "")
    customer = make_customer()
    for _ in range(3):
        assert ask(routing_gateway, customer.secret, sim_model.name).status_code == 200
    jobs = jobs_of(sim_model)
    assert {job.host_id for job in jobs} == {unreadable.host.pk}
    assert all((job.claimed_at - job.created_at).total_seconds() < COLD_GRACE_SECONDS for job in jobs)
    assert Host.objects.get(pk=unreadable.host.pk).catalog_at is None


def test_least_connections_keeps_active_counts_within_one(routing_gateway, sims, sim_model) -> None:
    hosts = [sims(f"lc{i}", "--loaded", sim_model.name, "--slots", "4", "--delay", "6").host for i in range(3)]
    customer = make_customer()
    pool = ThreadPoolExecutor(9)
    try:
        futures = []
        for n in range(1, 10):  # one more request each time; the new one must go to a least-busy host
            futures.append(pool.submit(ask, routing_gateway, customer.secret, sim_model.name))
            wait_until(lambda n=n: sum(running_per_host(sim_model, hosts)) == n, timeout=10, what=f"{n} jobs running")
            counts = running_per_host(sim_model, hosts)
            assert max(counts) - min(counts) <= 1, counts
        assert running_per_host(sim_model, hosts) == [3, 3, 3]
        assert all(f.result().status_code == 200 for f in futures)
    finally:
        pool.shutdown(wait=True)


def test_weighted_splits_three_hundred_jobs_by_the_weights(routing_gateway, sims, sim_model) -> None:
    from catalog.models import CatalogModel
    from hosts.models import Host

    CatalogModel.objects.filter(pk=sim_model.pk).update(routing_strategy="weighted")
    big = sims("big", "--loaded", sim_model.name, "--slots", "8")
    small = sims("small", "--loaded", sim_model.name, "--slots", "8")
    Host.objects.filter(pk=big.host.pk).update(routing_weight=3.0)
    Host.objects.filter(pk=small.host.pk).update(routing_weight=1.0)
    customer = make_customer(credit_ucents=10**12)
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        codes = list(
            pool.map(lambda _: ask(routing_gateway, customer.secret, sim_model.name).status_code, range(300))
        )  # (±0.0875 is 3.5 standard deviations of a 300-job share)
    elapsed = time.monotonic() - started
    assert codes.count(200) == 300, {code: codes.count(code) for code in set(codes)}
    jobs = jobs_of(sim_model)
    share = sum(1 for job in jobs if job.host_id == big.host.pk) / len(jobs)
    assert abs(share - 0.75) <= 0.0875, f"the weight-3 host took {share:.1%} of {len(jobs)} jobs ({elapsed:.0f} s)"


def test_a_flapping_host_goes_to_maintenance_and_is_told_why(routing_gateway, sims, sim_model) -> None:
    from hosts.models import Host

    flapper = sims("flapper", "--loaded", sim_model.name, "--fail")
    customer = make_customer()
    with ThreadPoolExecutor(2) as pool:  # each request dies twice (attempt and continuation), then fails unbilled
        responses = list(pool.map(lambda _: ask(routing_gateway, customer.secret, sim_model.name), range(2)))
    assert all(r.status_code in (502, 503) and r.json()["error"]["code"] == "host_failed" for r in responses), [
        r.text for r in responses
    ]
    host = Host.objects.get(pk=flapper.host.pk)
    assert host.maintenance_since is not None
    assert "dropped or failed in the last hour" in host.maintenance_reason
    wait_until(
        lambda: any(r.get("code") == "host_maintenance" for r in flapper.records),
        timeout=10,
        what="the host to be refused work with the reason",
    )
