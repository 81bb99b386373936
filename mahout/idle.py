"""Owner-activity detector: a machine whose owner is using it stops claiming work.

The owner counts as active when there was keyboard or mouse input within ``threshold_s``
(on macOS the HID system's ``HIDIdleTime`` from ``ioreg``; elsewhere X11 idle time via
``xprintidle`` when installed, else the newest mtime among ``/dev/input/event*``), or when
another process is computing on the GPU. Probes are injectable so tests need neither X11 nor a
GPU; every external command is time-bounded.

"Another" process is one outside mahout's own process tree: mahout itself and everything it
started (a ring's stages are its child processes on the GPU, `mahout.ring.member.LocalStages`)
never count as the owner's work, or `mahout ring` would pause itself as soon as its stages load.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

COMMAND_TIMEOUT_SECONDS = 2.0
DEFAULT_THRESHOLD_SECONDS = 120.0
HID_IDLE_TIME = re.compile(r'"HIDIdleTime"\s*=\s*(\d+)')


def run_command(argv: list[str], timeout: float = COMMAND_TIMEOUT_SECONDS) -> str | None:
    """Run a command with a timeout; its stdout, or ``None`` if it failed in any way."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def xprintidle_seconds() -> float | None:
    """Seconds since the last X11 input, or ``None`` without xprintidle or a display."""
    if shutil.which("xprintidle") is None:
        return None
    out = run_command(["xprintidle"])
    try:
        return int(out.strip()) / 1000.0 if out else None
    except ValueError:
        return None


def input_device_idle_seconds(pattern: str = "/dev/input/event*") -> float | None:
    """Seconds since the newest input-device mtime, or ``None`` if none is readable."""
    mtimes = []
    for path in glob.glob(pattern):
        try:
            mtimes.append(os.stat(path).st_mtime)
        except OSError:
            continue
    return time.time() - max(mtimes) if mtimes else None


def parse_hid_idle_time(ioreg_output: str) -> float | None:
    """Seconds from the first ``"HIDIdleTime" = <nanoseconds>`` in ``ioreg -c IOHIDSystem``'s
    output, or ``None`` when it has none."""
    match = HID_IDLE_TIME.search(ioreg_output)
    return int(match.group(1)) / 1e9 if match else None


def macos_idle_seconds() -> float | None:
    """Seconds since the last keyboard, mouse or trackpad input on macOS (IOKit's HID system,
    readable without any permission), or ``None`` without ``ioreg``."""
    if shutil.which("ioreg") is None:
        return None
    out = run_command(["ioreg", "-c", "IOHIDSystem"])
    return parse_hid_idle_time(out) if out else None


def input_idle_seconds() -> float | None:
    """Seconds since the owner last touched keyboard or mouse, by the best probe available."""
    if sys.platform == "darwin":
        return macos_idle_seconds()
    seconds = xprintidle_seconds()
    return seconds if seconds is not None else input_device_idle_seconds()


def parse_compute_pids(nvidia_smi_output: str) -> list[int]:
    """The PIDs in ``nvidia-smi --query-compute-apps=pid --format=csv,noheader``'s output, one a line."""
    return [int(line) for line in (s.strip() for s in nvidia_smi_output.splitlines()) if line.isdigit()]


def gpu_compute_pids() -> list[int]:
    """PIDs of processes computing on an NVIDIA GPU; [] without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    return parse_compute_pids(run_command(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]) or "")


def proc_parents(proc: str | os.PathLike[str] = "/proc") -> dict[int, int]:
    """{pid: parent pid} of every process ``/proc`` lists ({} where there is no ``/proc``). A
    process's ``stat`` is ``pid (comm) state ppid ...``; its name may hold spaces and brackets, so
    the fields are read after the last ``)``. A process that ends while it is read is skipped."""
    parents: dict[int, int] = {}
    for path in glob.glob(os.path.join(proc, "[0-9]*", "stat")):
        try:
            with open(path, encoding="utf-8", errors="replace") as stat:
                text = stat.read()
        except OSError:
            continue
        pid, _, rest = text.partition(" (")
        fields = rest.rpartition(")")[2].split()
        if pid.isdigit() and len(fields) >= 2 and fields[1].isdigit():
            parents[int(pid)] = int(fields[1])
    return parents


def process_parents() -> dict[int, int]:
    """{pid: parent pid} of the machine's processes: from psutil where it is installed, else
    from ``/proc`` ({} where neither can tell: then only mahout's own pid counts as its own)."""
    try:
        import psutil  # optional: not a dependency of mahout
    except ImportError:
        return proc_parents()
    parents: dict[int, int] = {}
    for process in psutil.process_iter(["ppid"]):
        ppid = process.info.get("ppid")
        if ppid is not None:
            parents[process.pid] = ppid
    return parents


def process_tree(root: int, parents: dict[int, int]) -> set[int]:
    """`root` and every process descended from it, by the {pid: parent pid} map `parents`."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        if pid != ppid:
            children.setdefault(ppid, []).append(pid)
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


class IdleDetector:
    """Answers "is the owner using this machine right now?" from two probes."""

    def __init__(
        self,
        threshold_s: float = DEFAULT_THRESHOLD_SECONDS,
        *,
        input_idle: Callable[[], float | None] = input_idle_seconds,
        gpu_pids: Callable[[], list[int]] = gpu_compute_pids,
        own_pid: int | None = None,
        parents: Callable[[], dict[int, int]] = process_parents,
    ) -> None:
        """`own_pid` (this process by default) is the root of mahout's own process tree;
        `parents` lists the machine's processes as {pid: parent pid}, read only when the GPU
        has a process other than `own_pid` on it."""
        self.threshold_s = threshold_s
        self._input_idle = input_idle
        self._gpu_pids = gpu_pids
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._parents = parents

    def activity(self) -> str | None:
        """Why the owner counts as active, or ``None`` when the machine is free to work."""
        idle = self._input_idle()
        if idle is not None and idle < self.threshold_s:
            return f"input {idle:.0f} s ago"
        others = [pid for pid in self._gpu_pids() if pid != self._own_pid]
        if others:  # mahout's own children (a ring's stages) are not the owner's work
            own = process_tree(self._own_pid, self._parents())
            others = [pid for pid in others if pid not in own]
        if others:
            return f"GPU in use by pid {others[0]}"
        return None

    def owner_active(self) -> bool:
        """True when the owner is using the machine and mahout should not claim."""
        return self.activity() is not None
