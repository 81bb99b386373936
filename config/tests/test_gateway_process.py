"""How `make run` runs the gateway (`config.gateway`): the hosts' routine calls are not
access-logged (a setting brings them back), a status line says what the system is doing,
and a body is refused while it grows past the limit."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from config.gateway import HostQuietAccessLog, QuietAccessLog, quiet
from config.management.commands.serve_demo import status_line
from conftest import ROOT, free_port, make_host, stack_env, wait_until
from marketplace.tests.test_reputation import online
from marketplace.tests.test_services import submit


def test_the_hosts_routine_calls_are_left_out_and_the_customers_kept() -> None:
    assert quiet("POST /hosts/api/heartbeat") and quiet("POST /hosts/api/claim") and quiet("WSCONNECTING /hosts/ws")
    assert quiet("POST /hosts/api/jobs/12/tokens") and quiet("GET /api/rings/assignment")
    assert not quiet("POST /v1/chat/completions") and not quiet("GET /machines/") and not quiet("GET /hosts/")
    stream = io.StringIO()
    log = HostQuietAccessLog(stream)
    log(
        "http",
        "complete",
        {"client": ["127.0.0.1", 1], "method": "POST", "path": "/hosts/api/heartbeat", "status": 200, "size": 9},
    )
    log(
        "http",
        "complete",
        {"client": ["127.0.0.1", 1], "method": "POST", "path": "/v1/chat/completions", "status": 200, "size": 9},
    )
    assert "/v1/chat/completions" in stream.getvalue() and "heartbeat" not in stream.getvalue()


@pytest.mark.parametrize("log_class", [HostQuietAccessLog, QuietAccessLog])  # (QuietAccessLog: ACCESS_LOG_HOSTS=1)
def test_the_balancers_health_checks_are_left_out_whatever_is_set(log_class) -> None:
    stream = io.StringIO()
    log = log_class(stream)
    for path in ("/healthz", "/healthz", "/v1/models"):
        log("http", "complete", {"client": ["127.0.0.1", 1], "method": "GET", "path": path, "status": 200, "size": 9})
    assert stream.getvalue().count("\n") == 1 and "/v1/models" in stream.getvalue()


@pytest.mark.django_db
def test_the_status_line_counts_hosts_queue_and_streams(serving_host, customer, catalog) -> None:
    online(serving_host)
    submit(customer, catalog)
    line = status_line()
    assert "hosts: 1 online, 0 busy" in line and "queue: 1 waiting" in line and "streams: 0 running" in line


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("hosts_logged", [False, True])
def test_the_quiet_daphne_serves_and_logs_as_set(catalog, tmp_path, hosts_logged: bool) -> None:
    port = free_port()
    log = tmp_path / "daphne.log"
    env = stack_env({"MAX_BODY_BYTES": "4096", **({"ACCESS_LOG_HOSTS": "1"} if hosts_logged else {})})
    if not hosts_logged:
        env.pop("ACCESS_LOG_HOSTS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "config.gateway", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"],
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/v1/models", timeout=1).status_code == 401
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60, what="the quiet daphne to answer")
        token = make_host(name="quiet").token
        assert (
            httpx.post(
                f"{url}/hosts/api/heartbeat", json={}, headers={"Authorization": f"Bearer {token}"}, timeout=10
            ).status_code
            < 500
        )
        wait_until(lambda: "/v1/models" in log.read_text(), timeout=10, what="the access log line")
        # a chunked body (no Content-Length) is refused as it grows past the limit, not after it all arrived
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            raw.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: application/json\r\n\r\n"
            )
            answer = b""
            try:
                for _ in range(1000):  # 1000 × 1 KiB offered; the answer comes after about 4
                    raw.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            while chunk := raw.recv(65536):
                answer += chunk
        head, _, body = answer.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 413") and json.loads(body)["error"]["code"] == "body_too_large"
        # a header that is not HTTP (what a fuzzer sends) is answered in the API's format, not a bare status line
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: ##$(5,\r\n\r\n")
            answer = b""
            while chunk := raw.recv(65536):
                answer += chunk
        head, _, body = answer.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 400") and "Content-Type: application/json" in head, head
        assert json.loads(body)["error"]["code"] == "malformed_request"
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401  # and it serves on
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert ('"POST /hosts/api/heartbeat"' in log.read_text()) is hosts_logged  # (the access log quotes the request)
    assert os.path.exists(log)
