"""Shared personas and the end-to-end stack.

Personas: a customer who pays, a host who serves, an outsider who must be
refused. The stack starts real processes on loopback: a daphne gateway on the
test database and mahout hosts running the shipped model.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


@dataclass
class Customer:
    user: object
    key: object
    secret: str


@dataclass
class ServingHost:
    host: object
    token: str
    fingerprint: str


def make_customer(*, credit_ucents: int = 500_000_000, cap_ucents: int | None = None, email: str | None = None) -> Customer:
    from django.contrib.auth import get_user_model

    from billing.services import credit_grant
    from marketplace.services import api_key_create

    user = get_user_model().objects.create(username=email or f"c-{uuid.uuid4().hex[:8]}@example.com")
    if credit_ucents:
        credit_grant(user=user, amount_ucents=credit_ucents, reference=f"test-{uuid.uuid4()}")
    new = api_key_create(user=user, name="test", spend_cap_ucents=cap_ucents)
    return Customer(user=user, key=new.key, secret=new.secret)


def make_host(*, qualified: bool = True, name: str | None = None, fingerprint: str = "f" * 64) -> ServingHost:
    from hosts.services import host_create, qualification_register

    new = host_create(email=f"h-{uuid.uuid4().hex[:8]}@example.com", name=name or "rig")
    if qualified:
        qualification_register(
            host=new.host,
            model_name="gemma-3-270m",
            fingerprint=fingerprint,
            benchmark={"prompt_tps": 500.0, "gen_tps": 40.0, "ttft_ms": 50.0, "memory_mb": 400.0, "threads": 2},
            machine={},
        )
    return ServingHost(host=new.host, token=new.token, fingerprint=fingerprint)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):  # type: ignore[no-untyped-def]
    """Close connections after each pooled ORM call so none outlive the test database,
    and give each run its own SQLite file (the gateway processes it starts share it)."""
    from django.conf import settings

    default = settings.DATABASES["default"]
    default["CONN_MAX_AGE"] = 0
    if default["ENGINE"].endswith("sqlite3"):  # a file per test run: parallel runs must not share one
        default.setdefault("TEST", {})["NAME"] = str(settings.VAR_DIR / f"test-{os.getpid()}.sqlite3")


@pytest.fixture(autouse=True)
def _fresh_cache():  # type: ignore[no-untyped-def]
    """The served-model list is cached; each test starts from the database's truth."""
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture
def catalog(db):  # type: ignore[no-untyped-def]
    from marketplace.catalog import catalog_seed
    from marketplace.models import CatalogModel

    catalog_seed(CatalogModel)
    return CatalogModel.objects.get(name="gemma-3-270m")


@pytest.fixture
def customer(catalog) -> Customer:  # type: ignore[no-untyped-def]
    return make_customer()


@pytest.fixture
def serving_host(catalog) -> ServingHost:  # type: ignore[no-untyped-def]
    return make_host()


@pytest.fixture
def outsider(catalog) -> ServingHost:  # type: ignore[no-untyped-def]
    return make_host(name="outsider")


# --- real processes -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stack_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process that must use the test database."""
    from django.db import connection

    env = dict(os.environ)
    name = connection.settings_dict["NAME"]
    if connection.vendor == "postgresql":
        s = connection.settings_dict
        env["DATABASE_URL"] = f"postgres://{s['USER'] or 'postgres'}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{name}"
    else:
        env.pop("DATABASE_URL", None)
        env["SQLITE_PATH"] = str(name)
    env.update(extra or {})
    return env


def wait_until(predicate, *, timeout: float, what: str, interval: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Gateway:
    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"gateway-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "config.asgi:application"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        import httpx

        def up() -> bool:
            assert self.proc.poll() is None, f"gateway exited: see {self.log.name}"
            try:
                return httpx.get(f"{self.url}/v1/models", timeout=1).status_code in (200, 401)
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60, what="the gateway to answer")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Mahout:
    """A real mahout host process serving the shipped model."""

    def __init__(self, *, server: str, token: str, home: Path, env: dict[str, str], log_dir: Path, extra: list[str] | None = None) -> None:
        self.home = home
        self.log_path = log_dir / f"mahout-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mahout", "run", "--server", server, "--token", token, "--home", str(home), "--threads", "1", *(extra or [])],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="session")
def e2e_dirs(tmp_path_factory):  # type: ignore[no-untyped-def]
    base = tmp_path_factory.mktemp("e2e")
    (base / "logs").mkdir()
    (base / "mahout-home").mkdir()
    return base


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker, e2e_dirs):  # type: ignore[no-untyped-def]
    with django_db_blocker.unblock():
        env = stack_env({  # the failover tests kill hosts on purpose: they must not be rested as unreliable
            "QUEUE_TIMEOUT_SECONDS": "4", "STALL_SECONDS": "20", "OUTPUT_RETENTION_SECONDS": "0",
            "HOST_MAX_FAILURES_PER_HOUR": "100000",
        })
    gw = Gateway(env, e2e_dirs / "logs")
    yield gw
    gw.stop()


@pytest.fixture
def start_mahout(gateway, e2e_dirs, transactional_db):  # type: ignore[no-untyped-def]
    """Start a mahout host for a token and wait until it has qualified."""
    started: list[Mahout] = []

    def start(token: str, *, extra: list[str] | None = None, wait_qualified: bool = True) -> Mahout:
        from hosts.models import Host

        host = Mahout(server=gateway.url, token=token, home=e2e_dirs / "mahout-home", env=stack_env(), log_dir=e2e_dirs / "logs", extra=extra)
        started.append(host)
        if wait_qualified:
            def ready() -> bool:
                assert host.proc.poll() is None, f"mahout exited:\n{host.output()}"
                row = Host.objects.filter(token_prefix=token[:12]).first()
                return bool(row and row.last_heartbeat_at and row.qualifications.exists())

            wait_until(ready, timeout=180, what="mahout to benchmark and register", interval=0.3)
            time.sleep(0.3)  # its first long-poll is on the way
        return host

    yield start
    for host in started:
        host.stop()
