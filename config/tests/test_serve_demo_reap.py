"""`make run`'s children each lead a process group, so what a dead child started dies with it:
a Celery worker killed with -9 leaves its pool process running (the hour's soak found one
alive 50 minutes later), and the supervisor reaps it before restarting the worker."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from config.management.commands.serve_demo import Command, reap, stop_all

# a parent that starts a grandchild (as Celery's worker starts its pool) and waits
PARENT = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
          "print(child.pid, flush=True); time.sleep(300)")


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
