"""Machine fingerprint: a stable id for "this very machine".

A qualification (a benchmark) is valid only for the machine it ran on, so the gateway keys
qualifications by this fingerprint. It hashes facts that change only when the hardware or
OS install changes: machine-id, hostname, CPU model, total memory, GPU names.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path

COMMAND_TIMEOUT_SECONDS = 5.0


def _read(path: str) -> str:
    """Return a file's text, or "" when it is absent or unreadable."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first ``model name`` in /proc/cpuinfo, or the platform's processor string."""
    text = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def total_memory_mb(meminfo: str | None = None) -> int:
    """Total RAM in MiB from /proc/meminfo (``MemTotal`` in kB), or from sysconf."""
    text = _read("/proc/meminfo") if meminfo is None else meminfo
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_names() -> list[str]:
    """GPU names reported by ``nvidia-smi`` (time-bounded); [] without NVIDIA tooling."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def machine_facts() -> dict:
    """The facts the fingerprint is computed from; also sent to the server for display."""
    return {
        "machine_id": _read("/etc/machine-id").strip(),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "memory_mb": total_memory_mb(),
        "gpus": gpu_names(),
    }


def fingerprint_of(facts: dict) -> str:
    """sha256 (hex) of the identifying facts; ``cpu_count`` is informative, not identifying."""
    identity = {key: facts[key] for key in ("machine_id", "hostname", "cpu_model", "memory_mb", "gpus")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def machine_fingerprint() -> tuple[str, dict]:
    """Return ``(fingerprint_hex, facts)`` for this machine."""
    facts = machine_facts()
    return fingerprint_of(facts), facts
