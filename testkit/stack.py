"""The end-to-end stack: real processes on loopback (a daphne gateway on the test
database, mahout hosts running the shipped model)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent


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
        env["DATABASE_URL"] = (
            f"postgres://{s['USER'] or 'postgres'}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{name}"
        )
    else:
        env.pop("DATABASE_URL", None)
        env["SQLITE_PATH"] = str(name)
    env["EMAIL_BACKEND"] = "django.core.mail.backends.filebased.EmailBackend"  # what a child sends, tests read
    env["EMAIL_FILE_PATH"] = str(MAIL_DIR)
    env.setdefault("ACCESS_LOG_HOSTS", "1")  # the tests' gateway logs keep every line
    env.setdefault("AUDIT_ENABLED", "0")  # off but in the tests that are about audits (`@pytest.mark.audits`)
    env.setdefault(
        "MAHOUT_UNVERSIONED_ALLOWED", "1"
    )  # the synthetic hosts say "sim" or nothing (as in-process: conftest.py)
    env.setdefault("AUDIT_PASS_RECHECK_RATE", "0")  # a scorer's pass decides (as in-process tests: conftest.py)
    env.setdefault("AUDIT_SCORER_OWNER_MIN_AGE_DAYS", "0")  # a scorer's owner needs no history (as conftest.py)
    env.setdefault("AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS", "0")
    env.update(extra or {})
    return env


MAIL_DIR = Path(tempfile.gettempdir()) / f"elephant-mail-{os.getpid()}"


def mail_link(*, to: str, pattern: str, timeout: float = 10.0) -> str:
    """The first match of `pattern` (a URL, group 1) in the latest e-mail a child process
    sent to `to` (through the file backend `stack_env` sets)."""

    def found() -> str | None:
        for path in sorted(MAIL_DIR.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True):
            text = path.read_text(errors="replace")
            for message in reversed(text.split("-" * 79)):
                if f"To: {to}" in message:
                    match = re.search(pattern, message)
                    if match:
                        return match.group(1)
        return None

    return wait_until(found, timeout=timeout, what=f"an e-mail to {to}")


def wait_until(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.1) -> T:
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
            [
                sys.executable,
                "-m",
                "config.gateway",
                "-b",
                "127.0.0.1",
                "-p",
                str(self.port),
                "config.asgi:application",
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
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

    def __init__(
        self, *, server: str, token: str, home: Path, env: dict[str, str], log_dir: Path, extra: list[str] | None = None
    ) -> None:
        self.home = home
        self.log_path = log_dir / f"mahout-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
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
                str(home),
                "--threads",
                "1",
                "--no-idle-detect",
                *(extra or []),
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
