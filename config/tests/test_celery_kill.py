"""The watchdogs survive their worker's death: Celery's worker and beat killed with -9 during
a burst of requests that only the watchdogs can end (their customers went away, or nobody
claimed them). After a restart the watchdogs resume; no hold is left open after two watchdog
periods; the ledger reconciles."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from billing import selectors as ledger
from billing.models import Hold
from conftest import ROOT, Gateway, make_customer, stack_env, wait_until
from marketplace.models import Request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

INTERVAL = 2.0  # WATCHDOG_INTERVAL_SECONDS (the default)
CUSTOMERS = 24


class Worker:
    """`celery worker -B` as `make run` starts it, in its own process group (a -9 takes the
    worker, its pool and beat at once)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = open(log, "a")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "-B",
                "--concurrency",
                "1",
                "--loglevel",
                "INFO",
                "--hostname",
                f"kill-test-{os.getpid()}@%h",
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.path = log

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"the worker exited: see {self.path}"
        return " ready." in self.path.read_text(errors="replace")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Gateway, dict[str, str]]]:
    env = stack_env(
        {
            "ELEPHANT_VAR_DIR": str(tmp_path / "var"),  # its own file broker and beat schedule on the embedded default
            "WATCHDOG_INTERVAL_SECONDS": str(INTERVAL),
            "QUEUE_TIMEOUT_SECONDS": "4",
            "ABANDON_GRACE_SECONDS": "1",
        }
    )
    gateway = Gateway(env, tmp_path)
    yield gateway, env
    gateway.stop()


async def burst(url: str, secrets: list[str]) -> list[str]:
    """Every customer starts a stream nobody will serve and hangs up after its first event
    (the request is admitted and queued): only the watchdogs can end these requests now."""
    body = {
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "anyone there?"}],
        "max_tokens": 16,
        "stream": True,
    }

    async def one(secret: str) -> str:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for chunk in response.aiter_bytes():
                    return "left" if b'"role":"assistant"' in chunk else chunk.decode()
        return "ended"

    return await asyncio.gather(*(one(secret) for secret in secrets))


def open_holds() -> int:
    return Hold.objects.filter(status=Hold.Status.ACTIVE).count()


def test_the_watchdogs_resume_after_their_worker_is_killed_mid_burst(stack, catalog, tmp_path: Path) -> None:
    gateway, env = stack
    worker = Worker(env, tmp_path / "worker-1.log")
    try:
        wait_until(worker.ready, timeout=60, what="the Celery worker to start")
        customers = [make_customer() for _ in range(CUSTOMERS)]
        outcomes = asyncio.run(burst(gateway.url, [c.secret for c in customers]))
        assert outcomes.count("left") == CUSTOMERS, outcomes  # nobody stayed to see the queue time out
        assert Request.objects.count() == CUSTOMERS
        worker.kill()  # mid-burst: the requests are still queued, their customers gone
        assert open_holds() > 0, "the burst's holds should still be open: only the watchdogs end these"
        time.sleep(3 * INTERVAL)
        held = open_holds()
        assert held > 0, "nothing but the watchdogs should have closed the holds while the worker was dead"
    finally:
        worker.stop()

    restarted = Worker(env, tmp_path / "worker-2.log")
    try:
        wait_until(restarted.ready, timeout=60, what="the Celery worker to start again")
        began = time.monotonic()
        wait_until(lambda: open_holds() == 0, timeout=2 * INTERVAL + 10, what="every hold to close after the restart")
        closed_after = time.monotonic() - began
    finally:
        restarted.stop()
    assert not Request.objects.filter(status__in=[Request.Status.QUEUED, Request.Status.RUNNING]).exists()
    assert set(Request.objects.values_list("status", flat=True)) <= {Request.Status.FAILED, Request.Status.COMPLETED}
    assert ledger.reconcile_report() == []
    print(f"{held} holds were open while the worker was dead; all closed {closed_after:.1f} s after it was ready again")
