"""`mahout install-service`: the host starts with the machine and restarts after a crash.

Linux: a systemd *user* unit (``~/.config/systemd/user/mahout.service``), enabled and started
with ``systemctl --user``; ``loginctl enable-linger`` lets it run while nobody is logged in.
macOS: a launchd agent (``~/Library/LaunchAgents/net.elephant.mahout.plist``), loaded with
``launchctl``. The unit runs ``python -m mahout run`` with this interpreter and home; the
token stays in the home's credentials file (``mahout login``), never in the unit.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UNIT_NAME = "mahout.service"
AGENT_LABEL = "net.elephant.mahout"


@dataclass
class Installed:
    path: Path
    started: bool  # enabled and started here (else `next` says how)
    next: list[str]  # what the owner runs next, if anything


def service_command(home: Path, run_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "mahout", "run", "--home", str(home), *run_args]


def systemd_unit(command: list[str], home: Path) -> str:
    return (
        "[Unit]\n"
        "Description=Elephant host (mahout): serves inference jobs on this machine\n"
        "After=network-online.target\nWants=network-online.target\n\n"
        "[Service]\n"
        f"ExecStart={shlex.join(command)}\n"
        f"Environment=MAHOUT_HOME={home}\n"
        "Restart=on-failure\nRestartSec=10\n"
        "RestartPreventExitStatus=2 3\n"  # 2: cannot serve as configured; 3: too old for the gateway (upgrade first)
        "KillSignal=SIGINT\nTimeoutStopSec=90\n\n"  # SIGINT: finish the current job, then stop
        "[Install]\nWantedBy=default.target\n"
    )


def launchd_plist(command: list[str], home: Path) -> bytes:
    logs = home / "logs"
    return plistlib.dumps(
        {
            "Label": AGENT_LABEL,
            "ProgramArguments": command,
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},
            "EnvironmentVariables": {"MAHOUT_HOME": str(home)},
            "StandardOutPath": str(logs / "launchd.out.log"),
            "StandardErrorPath": str(logs / "launchd.err.log"),
        }
    )


def install_service(
    home: Path,
    run_args: list[str],
    *,
    platform: str = sys.platform,
    enable: bool = True,
    run: Callable[[list[str]], int] | None = None,
) -> Installed:
    """Write (and, where the service manager is here, enable and start) the service."""
    command = service_command(home, run_args)
    runner = run or _run
    if platform == "darwin":
        path = Path.home() / "Library" / "LaunchAgents" / f"{AGENT_LABEL}.plist"
        path.parent.mkdir(parents=True, exist_ok=True)
        (home / "logs").mkdir(parents=True, exist_ok=True)
        path.write_bytes(launchd_plist(command, home))
        load = ["launchctl", "load", "-w", str(path)]
        started = enable and shutil.which("launchctl") is not None and runner(load) == 0
        return Installed(path, started, [] if started else [shlex.join(load)])
    if not platform.startswith("linux"):
        raise RuntimeError(
            f"install-service knows systemd (Linux) and launchd (macOS), not {platform}; "
            f"run this at startup instead: {shlex.join(command)}"
        )
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    path = config / "systemd" / "user" / UNIT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(systemd_unit(command, home))
    steps = [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", UNIT_NAME]]
    started = enable and shutil.which("systemctl") is not None and all(runner(step) == 0 for step in steps)
    linger = f"loginctl enable-linger {os.environ.get('USER') or '$USER'}  # to run while nobody is logged in"
    return Installed(path, started, [linger] if started else [*(shlex.join(step) for step in steps), linger])


def _run(argv: list[str]) -> int:
    try:
        return subprocess.run(argv, check=False, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return 1
