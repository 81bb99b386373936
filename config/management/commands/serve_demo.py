"""`serve_demo`: the whole system on one machine, as `make run` starts it.

Creates the demo customer and hosts, then runs the gateway (daphne; with
`--workers N`/`WORKERS=N`, N of them behind HAProxy on the same port), Celery
worker + beat (the watchdogs), one mahout host serving the shipped chat model and
one serving the shipped embeddings model (a small farm behind one /v1/models),
prints the API key and a ready-to-paste client snippet, and stops everything
on Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections
from django.utils import timezone

from accounts.services import api_key_create
from billing.services import credit_grant
from catalog.money import usd_to_ucents
from config.balancer import haproxy_config
from config.health import HEALTH_PATH
from hosts.models import Host
from hosts.services import host_create, host_token_rotate
from marketplace.trust.reputation import trust_grant

DEMO_CUSTOMER = "demo@customer.local"
DEMO_HOST_OWNER = "demo@host.local"
DEMO_HOST_NAME = "demo-host"
DEMO_EMBEDDINGS_HOST_NAME = "demo-embeddings-host"
DEMO_CREDIT_USD = "5"


STATUS_EVERY_S = 60.0
HOST_CHILDREN = ("mahout", "mahout-embeddings")  # the demo's hosts, as `_spawn` names them
HOSTS_STOP_S = 10.0  # a host finishes its current job before it exits
REST_STOP_S = 20.0


def status_line() -> str:
    """One line a minute on the terminal: hosts, the queue, streams."""
    from marketplace.models import Job

    online = Host.objects.online(timezone.now())
    running = Job.objects.filter(status=Job.Status.RUNNING)
    return (
        f"[{time.strftime('%H:%M')}] hosts: {online.count()} online, {running.values('host').distinct().count()} busy; "
        f"queue: {Job.objects.filter(status=Job.Status.QUEUED).count()} waiting; streams: {running.count()} running"
    )


def backend_ports(port: int, workers: int) -> list[int]:
    """The gateways' own ports behind the balancer on `port` (none: one gateway on `port` itself)."""
    return [port + index for index in range(1, workers + 1)] if workers > 1 else []


class Command(BaseCommand):
    help = "Start the gateway, the watchdogs and one mahout host with the shipped model."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
        parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
        parser.add_argument(
            "--workers",
            type=int,
            default=int(os.environ.get("WORKERS") or 1),
            help="gateway processes behind HAProxy on --port (needs DATABASE_URL and REDIS_URL)",
        )

    def handle(self, *args: object, port: int, threads: int, workers: int, **options: object) -> None:
        if workers > 1 and not (settings.DATABASE_URL and settings.REDIS_URL):
            raise CommandError(
                f"WORKERS={workers} needs DATABASE_URL and REDIS_URL: several gateway processes share PostgreSQL and "
                "Redis. The embedded default (SQLite, in-process channel layer) runs one process."
            )
        if workers > 1 and shutil.which("haproxy") is None:
            raise CommandError("WORKERS needs HAProxy in front of the gateways: apt-get install haproxy")
        var: Path = settings.VAR_DIR
        api_key = self._demo_key()
        host_token = self._demo_host_token(DEMO_HOST_NAME)
        embeddings_token = self._demo_host_token(DEMO_EMBEDDINGS_HOST_NAME)
        (var / "demo-api-key").write_text(api_key + "\n")
        server = f"http://127.0.0.1:{port}"
        python = sys.executable
        stripe_argv = self._stripe_test_mode(python, server)  # (before any child starts: they inherit its keys)
        procs = self._gateways(python, port, workers, var)
        gateways = list(procs)
        if stripe_argv:
            procs.append(self._spawn("stripe-local", stripe_argv))
        watchdogs_argv = [
            python,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-B",
            "--concurrency",
            "1",
            "--loglevel",
            "WARNING",
        ]
        procs.append(self._spawn("watchdogs", watchdogs_argv))
        # the hosts only once the gateway answers through the balancer: a host that meets its 503
        # at start gives up (and was restarted, over and over)
        try:
            self._wait_for([server], gateways)
        except SystemExit:
            stop_all(procs)
            raise
        # the demo's hosts run on the operator's own machine, which the operator is using: they
        # must not pause for it (a stranger's mahout pauses while its owner is active, by default)
        # (their tokens travel in the environment, never on a command line `ps` shows)
        host_argv = [
            python,
            "-m",
            "mahout",
            "run",
            "--server",
            server,
            "--home",
            str(var / "mahout"),
            "--threads",
            str(threads),
            "--no-idle-detect",
        ]
        embeddings_argv = [
            python,
            "-m",
            "mahout",
            "run",
            "--server",
            server,
            "--home",
            str(var / "mahout-embeddings"),
            "--threads",
            "1",
            "--models",
            "all-minilm-l6-v2",
            "--no-idle-detect",
        ]
        envs = {
            "mahout": {**os.environ, "MAHOUT_TOKEN": host_token},
            "mahout-embeddings": {**os.environ, "MAHOUT_TOKEN": embeddings_token},
        }
        procs.append(self._spawn("mahout", host_argv, env=envs["mahout"]))
        procs.append(self._spawn("mahout-embeddings", embeddings_argv, env=envs["mahout-embeddings"]))
        self._print_welcome(server, api_key)
        # the watchdogs too: a 16-minute soak saw the embedded broker's worker die on a message it
        # read half-written (JSONDecodeError), and that stopped the whole system
        self._supervise(
            procs,
            restartable={
                "mahout": host_argv,
                "mahout-embeddings": embeddings_argv,
                "watchdogs": watchdogs_argv,
                **({"stripe-local": stripe_argv} if stripe_argv else {}),
            },
            envs=envs,
        )

    def _demo_key(self) -> str:
        user, created = get_user_model().objects.get_or_create(
            username=DEMO_CUSTOMER, defaults={"email": DEMO_CUSTOMER}
        )
        if created:
            credit_grant(
                user=user,
                amount_ucents=usd_to_ucents(DEMO_CREDIT_USD),
                reference=f"demo-{uuid.uuid4()}",
                memo="demo credit",
            )
        return api_key_create(user=user, name=f"demo {time.strftime('%Y-%m-%d %H:%M')}").secret

    def _demo_host_token(self, name: str) -> str:
        """The host's token is only stored hashed, so each start issues a fresh one. The
        bundled host is the operator's own machine: trusted from the start (strangers' hosts
        begin in probation)."""
        host = Host.objects.filter(owner__username=DEMO_HOST_OWNER, name=name).first()
        if host is None:
            new = host_create(email=DEMO_HOST_OWNER, name=name)
            host, token = new.host, new.token
        else:
            token = host_token_rotate(host=host).token
        trust_grant(host_id=host.pk)
        return token

    def _stripe_test_mode(self, python: str, server: str) -> list[str] | None:
        """Local test mode unless the operator set a real STRIPE_SECRET_KEY: the command line of
        the Stripe stand-in (billing/stripe_local.py) on a free port of its own, and its fresh
        test keys put in the environment every child inherits (the gateway's STRIPE_API_BASE
        points at it; its "Pay" posts signed events to the gateway's webhook)."""
        if os.environ.get("STRIPE_SECRET_KEY"):
            return None
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            stripe_port = probe.getsockname()[1]
        os.environ.update(
            STRIPE_SECRET_KEY=f"sk_test_local_{secrets.token_hex(12)}",
            STRIPE_WEBHOOK_SECRET=f"whsec_local_{secrets.token_hex(16)}",
            STRIPE_API_BASE=f"http://127.0.0.1:{stripe_port}",
        )
        return [
            python,
            "manage.py",
            "stripe_local",
            "--port",
            str(stripe_port),
            "--webhook-url",
            f"{server}/billing/stripe/webhook/",
        ]

    def _gateways(self, python: str, port: int, workers: int, var: Path) -> list[tuple[str, subprocess.Popen]]:
        """One daphne on `port`; or `workers` of them on the ports above it, behind HAProxy on `port`,
        started once they answer (its first health checks then pass: no "server is DOWN" alerts)."""

        def daphne(listen: int) -> list[str]:
            # (daphne, with the hosts' heartbeats and long-polls left out of its access log)
            return [python, "-m", "config.gateway", "-b", "127.0.0.1", "-p", str(listen), "config.asgi:application"]

        if workers <= 1:
            return [self._spawn("gateway", daphne(port))]
        backends = backend_ports(port, workers)
        config = var / "haproxy.cfg"
        config.write_text(haproxy_config(port=port, backends=backends))
        behind = {
            **os.environ,
            "TRUSTED_PROXY_COUNT": os.environ.get("TRUSTED_PROXY_COUNT", "1"),
        }  # HAProxy adds X-Forwarded-For
        procs = [self._spawn(f"gateway-{backend}", daphne(backend), env=behind) for backend in backends]
        try:
            self._wait_for([f"http://127.0.0.1:{backend}" for backend in backends], procs)
        except SystemExit:
            stop_all(procs)
            raise
        procs.append(self._spawn("haproxy", ["haproxy", "-db", "-f", str(config)]))
        return procs

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
        self.stdout.write(f"starting {name}: {' '.join(argv[1:4])} …")
        # its own process group: when it dies, what it started dies with it (`reap`), and Ctrl-C
        # reaches it once, through `stop_all`, not twice (the terminal's and ours)
        return name, subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env, start_new_session=True)

    def _wait_for(self, urls: list[str], procs: list[tuple[str, subprocess.Popen]], timeout: float = 60) -> None:
        """Return once every one of `urls` passes the health check (a 200 from /healthz: the
        balancer's own 503 while its backends start is not one); a gateway that exits meanwhile,
        or the timeout, stops the command."""
        waiting, deadline = list(urls), time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for name, proc in procs:
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited with {proc.returncode} before the gateway answered")
            try:
                if httpx.get(f"{waiting[0]}{HEALTH_PATH}", timeout=1).status_code == 200:
                    waiting.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if waiting:
            raise SystemExit(f"the gateway did not answer on {waiting[0]} within {timeout:.0f} s")

    def _print_welcome(self, server: str, api_key: str) -> None:
        self.stdout.write(
            f"""
Elephant is running at {server}  (Ctrl-C stops everything)
Demo API key (also in var/demo-api-key):
{api_key}

Paste into Python once mahout reports it is ready (first start benchmarks the model):

from openai import OpenAI
client = OpenAI(base_url="{server}/v1", api_key=open("var/demo-api-key").read().strip())
for chunk in client.chat.completions.create(model="gemma-3-270m", stream=True, max_tokens=64,
        messages=[{{"role": "user", "content": "Write a haiku about elephants."}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print(len(client.embeddings.create(model="all-minilm-l6-v2", input="a grey giant").data[0].embedding))
"""
        )

    def _supervise(
        self,
        procs: list[tuple[str, subprocess.Popen]],
        restartable: dict[str, list[str]],
        envs: dict[str, dict[str, str]] | None = None,
    ) -> None:
        """Wait for Ctrl-C. A host that dies (try `kill -9` on it mid-stream) is
        restarted, like an owner's machine coming back, and so are the watchdogs; a gateway
        that dies stops all."""
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGHUP, stop)  # the terminal closed: its hangup no longer reaches the children
        next_status = time.monotonic() + STATUS_EVERY_S
        while not stopping:
            if time.monotonic() >= next_status:
                close_old_connections()  # (a minute apart: the database may have closed it)
                self.stdout.write(status_line())
                next_status += STATUS_EVERY_S
            for index, (name, proc) in enumerate(procs):
                if proc.poll() is None:
                    continue
                reap(proc)
                if name in restartable:
                    self.stderr.write(f"{name} exited with {proc.returncode}; restarting it")
                    procs[index] = self._spawn(name, restartable[name], env=(envs or {}).get(name))
                else:
                    self.stderr.write(f"{name} exited with {proc.returncode}; stopping the rest")
                    stopping = True
            time.sleep(0.5)
        stop_all(procs)


def reap(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a dead child's process group: a Celery worker killed with -9
    leaves its pool process running (the soak found one alive 50 minutes later)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def stop_waves(procs: list[tuple[str, subprocess.Popen]]) -> list[tuple[list[tuple[str, subprocess.Popen]], float]]:
    """The order `stop_all` stops the children in, each wave with its bound in seconds: the
    demo's hosts first, so they finish their job against a gateway still up (stopped together,
    they printed "server unavailable" as the gateway died under them), then the rest."""
    hosts = [child for child in procs if child[0] in HOST_CHILDREN]
    rest = [child for child in procs if child[0] not in HOST_CHILDREN]
    return [(wave, bound) for wave, bound in ((hosts, HOSTS_STOP_S), (rest, REST_STOP_S)) if wave]


def stop_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    """Stop the children wave by wave (`stop_waves`): SIGTERM to each one still running, then
    SIGKILL to any not gone within the wave's bound, and to whatever each one started."""
    for wave, bound in stop_waves(procs):
        for _, proc in wave:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + bound
        for _, proc in wave:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            reap(proc)
