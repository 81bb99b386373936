"""`make run`'s children each lead a process group, so what a dead child started dies with it:
a Celery worker killed with -9 leaves its pool process running (the hour's soak found one
alive 50 minutes later), and the supervisor reaps it before restarting the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from config.management.commands.serve_demo import Command, reap, stop_all

# a parent that starts a grandchild (as Celery's worker starts its pool) and waits
PARENT = (
    "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "print(child.pid, flush=True); time.sleep(300)"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_killed_with_minus_9_leaves_nothing_running_once_reaped(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    script = PARENT.replace("print(child.pid, flush=True)", f"open({str(pid_file)!r}, 'w').write(str(child.pid))")
    _, proc = Command()._spawn("parent", [sys.executable, "-c", script])
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert os.getpgid(grandchild) == proc.pid, "the child leads its own process group"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _alive(grandchild), "(without the reaping, the grandchild outlives its parent)"
        reap(proc)
        for _ in range(100):
            if not _alive(grandchild):
                break
            time.sleep(0.05)
        assert not _alive(grandchild)
    finally:
        stop_all([("parent", proc)])


class _FakeChild:
    """Records what `stop_all` does to it, into a log shared by all the children."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.pid, self.returncode = name, log, -1, None

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.log.append(f"terminate {self.name}")

    def wait(self, timeout: float | None = None) -> int:
        self.log.append(f"wait {self.name}")
        self.returncode = 0
        return 0

    def kill(self) -> None:
        self.log.append(f"kill {self.name}")


def test_stop_all_stops_the_hosts_before_the_gateway_they_talk_to(monkeypatch) -> None:
    import config.management.commands.serve_demo as serve_demo

    log: list[str] = []
    monkeypatch.setattr(serve_demo, "reap", lambda proc: log.append(f"reap {proc.name}"))
    names = ["gateway", "stripe-local", "watchdogs", "mahout", "mahout-embeddings"]
    stop_all([(name, _FakeChild(name, log)) for name in names])
    assert log.index("reap mahout-embeddings") < log.index("terminate gateway")
    assert log[:6] == [
        "terminate mahout",
        "terminate mahout-embeddings",
        "wait mahout",
        "reap mahout",
        "wait mahout-embeddings",
        "reap mahout-embeddings",
    ]
    assert set(log[6:]) == {f"{verb} {name}" for verb in ("terminate", "wait", "reap") for name in names[:3]}


def test_the_hosts_wait_is_bounded_and_a_host_that_hangs_is_killed(monkeypatch) -> None:
    import config.management.commands.serve_demo as serve_demo

    log: list[str] = []
    monkeypatch.setattr(serve_demo, "reap", lambda proc: log.append(f"reap {proc.name}"))
    hung = _FakeChild("mahout", log)
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> int:
        waits.append(timeout)
        if len(waits) == 1:
            raise subprocess.TimeoutExpired("mahout", timeout or 0)
        return 0

    hung.wait = wait
    stop_all([("gateway", _FakeChild("gateway", log)), ("mahout", hung)])
    assert waits[0] is not None and waits[0] <= serve_demo.HOSTS_STOP_S
    assert log[:3] == ["terminate mahout", "kill mahout", "reap mahout"] and log[3] == "terminate gateway"
