"""Two gateway processes behind HAProxy, as `WORKERS=2 make run` starts them: many streams
relay exactly through either, and a gateway killed with -9 mid-stream costs nobody their
text (customers re-attach; the host's batches go on through the other process)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.db import connection

from billing import selectors as ledger
from billing.models import Hold
from config.balancer import haproxy_config
from conftest import ROOT, Gateway, free_port, make_customer, make_host, stack_env, wait_until
from marketplace.models import Job
from marketplace.services import watchdog_tick

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

STREAMS, BATCHES = 20, 60
METRICS_TOKEN = "metrics-test-token"
MARK = re.compile(r" @(\d+):\d+\.\d+ a b c d")


@pytest.fixture
def balanced(tmp_path: Path) -> Iterator[tuple[str, list[Gateway], dict[str, str]]]:
    if connection.vendor != "postgresql" or not os.environ.get("REDIS_URL"):
        pytest.skip("several gateway processes share PostgreSQL and Redis; the embedded default is one process")
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed (.ci/run installs it from Debian)")
    env = stack_env({"QUEUE_TIMEOUT_SECONDS": "30", "OUTPUT_RETENTION_SECONDS": "120", "METRICS_TOKEN": METRICS_TOKEN})
    gateways: list[Gateway] = []
    balancer = None
    try:
        gateways = [Gateway(env, tmp_path) for _ in range(2)]
        port = free_port()
        config = tmp_path / "haproxy.cfg"
        config.write_text(haproxy_config(port=port, backends=[g.port for g in gateways]))
        balancer = subprocess.Popen(
            ["haproxy", "-db", "-f", str(config)], stdout=open(tmp_path / "haproxy.log", "w"), stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/v1/models", timeout=1).status_code == 401
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=30, what="HAProxy to answer")
        yield url, gateways, env
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(timeout=10)
        for gateway in gateways:
            if gateway.proc.poll() is None:
                gateway.stop()


async def stream_with_resume(url: str, secret: str) -> tuple[str, str | None, int]:
    """One customer: a stream, re-attached from its last offset whenever the connection drops.
    Returns the text, an error code if the request ended in error, and how many re-attaches."""
    headers = {"Authorization": f"Bearer {secret}"}
    body = {
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "relay"}],
        "max_tokens": 3000,
        "stream": True,
    }
    text, offset, public_id, reattaches = "", 0, None, 0
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        for _ in range(10):
            request = (
                http.build_request("POST", "/v1/chat/completions", json=body)
                if public_id is None
                else http.build_request("GET", f"/v1/chat/completions/{public_id}?stream=true&starting_after={offset}")
            )
            try:
                response = await http.send(request, stream=True)
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return text, None, reattaches
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return text, chunk["error"]["code"], reattaches
                    public_id = chunk["id"]
                    if chunk["choices"][0].get("delta", {}).get("content"):
                        text += chunk["choices"][0]["delta"]["content"]
                        offset = chunk["x_elephant"]["offset"]
            except (httpx.TransportError, httpx.RemoteProtocolError):
                pass
            reattaches += 1
            await asyncio.sleep(0.2)
    return text, "gave_up", reattaches


def connections_to(port: int) -> int:
    """Established TCP connections whose local end is 127.0.0.1:`port` (Linux's /proc/net/tcp)."""
    found = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _, state = line.split()[1:4]
        found += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return found


def whole(text: str) -> bool:
    return [int(m.group(1)) for m in MARK.finditer(text)] == list(range(BATCHES)) and len(MARK.sub("", text)) == 0


class TwoGatewaysTests:
    def test_the_health_checks_pass_without_a_key_and_stay_out_of_the_gateways_logs(self, balanced) -> None:
        """They asked /v1/models and took its 401 for a pass: an "Unauthorized" line and an access
        line per check, four a second, on `make run`'s terminal."""
        url, gateways, _ = balanced
        logs = [Path(gateway.log.name) for gateway in gateways]
        before = [log.stat().st_size for log in logs]  # (what the start-up probes logged)
        time.sleep(3)  # HAProxy asks each backend once a second
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200  # (both backends down would be a 503)
        for log, offset in zip(logs, before, strict=True):
            with log.open() as text:
                text.seek(offset)
                logged = text.read()
            assert "healthz" not in logged and "Unauthorized" not in logged, logged[-2000:]

    def test_the_balancer_refuses_a_declared_body_over_the_limit_before_a_gateway_buffers_it(self, balanced) -> None:
        url, _, _ = balanced
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:  # headers only: the body never comes
            raw.sendall(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: 10000000000\r\n\r\n".encode()
            )
            answer = raw.recv(65536).decode()
        head, _, body = answer.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 413") and json.loads(body)["error"]["code"] == "body_too_large"

    def test_either_process_reports_every_request_made_through_the_balancer(self, balanced, catalog) -> None:
        """The metrics are read from the shared database: each process answers for both."""
        url, gateways, _ = balanced
        made = 6

        async def start_and_leave(secret: str) -> None:
            body = {
                "model": "gemma-3-270m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stream": True,
            }
            async with httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
            ) as http:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_bytes():
                        return

        async def burst(secrets: list[str]) -> None:
            await asyncio.gather(*(start_and_leave(secret) for secret in secrets))

        asyncio.run(burst([make_customer().secret for _ in range(made)]))
        totals = []
        for gateway in gateways:
            text = httpx.get(
                f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
            ).text
            totals.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("elephant_requests_total{")
                )
            )
        assert totals == [made, made], totals

    def test_streams_survive_a_gateway_killed_mid_stream(self, balanced, catalog, tmp_path) -> None:
        url, gateways, env = balanced
        customers = [make_customer() for _ in range(STREAMS)]
        serving = make_host(qualified=False, name="pool", trusted=True)
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testkit.simhost",
                "--server",
                url,
                "--token",
                serving.token,
                "--model",
                "gemma-3-270m",
                "--loaded",
                "gemma-3-270m",
                "--slots",
                str(STREAMS),
                "--stream-batches",
                str(BATCHES),
                "--interval",
                "0.05",
                "--socket",
                "--wait",
                "2",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "simhost.log", "w"),
            text=True,
        )
        try:
            assert sim.stdout is not None and json.loads(sim.stdout.readline()).get("ready")

            async def run() -> list[tuple[str, str | None, int]]:
                streams = [asyncio.ensure_future(stream_with_resume(url, c.secret)) for c in customers]
                await asyncio.sleep(1.5)  # mid-stream: each is ~3 s long
                # The busier process is killed: a gateway slow to answer HAProxy's health check
                # under load is taken out for a while, and its twin then carries every stream.
                busiest = max(gateways, key=lambda gateway: connections_to(gateway.port))
                os.kill(busiest.proc.pid, signal.SIGKILL)
                return await asyncio.gather(*streams)

            results = asyncio.run(run())
        finally:
            sim.send_signal(signal.SIGTERM)
            sim.wait(timeout=10)
        completed = [text for text, error, _ in results if error is None]
        assert all(whole(text) for text in completed), [t[:80] for t in completed if not whole(t)]
        assert all(error in (None, "host_failed") for _, error, _ in results), results
        assert len(completed) >= STREAMS - 2  # a job whose host's batch died with the gateway may honestly fail
        assert sum(reattached for *_, reattached in results) >= 1  # someone was on the killed process

        # What no customer is watching any more is the watchdog's (Celery beat runs it under
        # `make run`; this stack has none): a claim whose answer died with the gateway leaves a
        # job its host never heard of, running until its start bound.
        def every_job_ended() -> bool:
            watchdog_tick()
            return not Job.objects.filter(status__in=["queued", "running"]).exists()

        left = list(
            Job.objects.filter(status__in=["queued", "running"]).values(
                "pk",
                "status",
                "attempt",
                "requeue",
                "request__status",
                "claimed_at",
                "first_token_at",
                "generated_chars",
            )
        )
        wait_until(every_job_ended, timeout=60, what=f"every job to end (left when the streams ended: {left})")
        assert not Hold.objects.filter(status=Hold.Status.ACTIVE).exists()
        assert ledger.reconcile_report() == []
