"""`make run`'s start order: the hosts start, and "Elephant is running" is printed, only once the
gateway answers its health check through the balancer. HAProxy answers 503 while its backends
start; that used to count as "up", and both demo hosts met it and crash-looped."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.management import call_command

from config.management.commands.serve_demo import Command


class FakeBalancer(ThreadingHTTPServer):
    """What HAProxy answers on loopback: 503 to everything until `ready`, then /healthz is a 200."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.ready = threading.Event()
        self.asked = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(BaseHTTPRequestHandler):
    server: FakeBalancer

    def log_message(self, *_args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.asked += 1
        up = self.server.ready.is_set() and self.path == "/healthz"
        body = b'{"status": "ok"}' if up else b"<html><body><h1>503 Service Unavailable</h1></body></html>"
        self.send_response(200 if up else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def balancer() -> Iterator[FakeBalancer]:
    server = FakeBalancer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


class Running:
    """A child that stays up."""

    returncode = None

    def poll(self) -> None:
        return None


class WaitForTests:
    def test_a_balancers_503_is_not_a_gateway_that_answers(self, balancer) -> None:
        threading.Timer(1.0, balancer.ready.set).start()
        Command()._wait_for([balancer.url], [("gateway", Running())], timeout=30)
        assert balancer.ready.is_set() and balancer.asked > 1

    def test_it_waits_for_every_url_in_turn(self, balancer) -> None:
        second = FakeBalancer()
        threading.Thread(target=second.serve_forever, daemon=True).start()
        try:
            balancer.ready.set()
            threading.Timer(1.0, second.ready.set).start()
            Command()._wait_for([balancer.url, second.url], [], timeout=30)
            assert second.ready.is_set()
        finally:
            second.shutdown()
            second.server_close()

    def test_a_gateway_that_exits_ends_the_wait_at_once_saying_which(self, balancer) -> None:
        crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        crashed.wait(timeout=30)
        with pytest.raises(SystemExit, match="gateway-8001 exited with 3 before the gateway answered"):
            Command()._wait_for([balancer.url], [("gateway-8001", crashed)], timeout=30)

    def test_it_gives_up_after_the_timeout_naming_the_url(self, balancer) -> None:
        with pytest.raises(SystemExit, match=f"did not answer on {balancer.url} within 1 s"):
            Command()._wait_for([balancer.url], [], timeout=1)


@pytest.mark.django_db
def test_the_hosts_and_the_welcome_wait_for_the_gateway(balancer, var_dir, monkeypatch) -> None:
    started: list[tuple[str, bool]] = []

    def spawn(self: Command, name: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[str, Running]:
        started.append((name, balancer.ready.is_set()))
        if name == "watchdogs":  # the gateway comes up a moment after everything before the hosts has started
            threading.Timer(1.0, balancer.ready.set).start()
        return name, Running()

    class Terminal(io.StringIO):
        welcomed_when_up: list[bool] = []

        def write(self, text: str) -> int:
            if "Elephant is running" in text:
                self.welcomed_when_up.append(balancer.ready.is_set())
            return super().write(text)

    monkeypatch.setattr(Command, "_spawn", spawn)
    monkeypatch.setattr(Command, "_supervise", lambda *_args, **_kwargs: None)
    terminal = Terminal()
    call_command("serve_demo", port=balancer.server_address[1], workers=1, stdout=terminal)

    hosts = [up for name, up in started if name.startswith("mahout")]
    assert started[0] == ("gateway", False) and hosts == [True, True], started
    assert Terminal.welcomed_when_up == [True]


def test_haproxy_starts_once_every_gateway_behind_it_answers(var_dir, monkeypatch) -> None:
    """Started with them, its first checks failed: "server is DOWN" and "no server available!" on
    every start, before the gateways had had time to listen."""
    from config.management.commands import serve_demo

    backends = [FakeBalancer(), FakeBalancer()]
    for backend in backends:
        threading.Thread(target=backend.serve_forever, daemon=True).start()
    started: list[tuple[str, list[bool]]] = []

    def spawn(self: Command, name: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[str, Running]:
        started.append((name, [backend.ready.is_set() for backend in backends]))
        if name.startswith("gateway-"):
            threading.Timer(0.5 * len(started), backends[len(started) - 1].ready.set).start()
        return name, Running()

    monkeypatch.setattr(Command, "_spawn", spawn)
    monkeypatch.setattr(serve_demo, "backend_ports", lambda port, workers: [b.server_address[1] for b in backends])
    try:
        Command()._gateways(sys.executable, 8000, 2, var_dir)
    finally:
        for backend in backends:
            backend.shutdown()
            backend.server_close()
    assert [name for name, _ in started] == [f"gateway-{b.server_address[1]}" for b in backends] + ["haproxy"]
    assert started[-1][1] == [True, True]
    assert (var_dir / "haproxy.cfg").read_text().count("check") >= 2
