"""The log a long-running command keeps in the home, and ``mahout logs [-f]`` reading it.

``run`` (and ``ring``, ``stage``, ``moe``, ``benchmark``, ``add``, ``install-service``)
write every line they print to ``logs/mahout.log`` under the home as well, rotated at
:data:`LOG_BYTES` with :data:`LOG_BACKUPS` old files kept (``mahout.log.1`` the newest of
them): started as a service, a host's output otherwise goes nowhere its owner looks.
:func:`tail` reads the last lines across the rotation; :func:`follow` prints lines as they
are written, like ``tail -F``: it notices when the file is rotated and reads on from the new one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import BinaryIO

LOG_FILE = "logs/mahout.log"
LOG_BYTES = 5 * 1024 * 1024
LOG_BACKUPS = 5
FOLLOW_POLL_SECONDS = 0.5


def log_path(home: Path) -> Path:
    return home / LOG_FILE


def open_log(home: Path, log: logging.Logger) -> Path:
    """Send `log`'s lines to the home's rotating log file (replacing any handler it had)."""
    path = log_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in list(log.handlers):
        log.removeHandler(old)
        old.close()
    handler = RotatingFileHandler(path, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return path


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines written, the newest rotated file's included when the current one
    holds fewer (a log rotated a moment ago is not empty to its reader)."""
    kept: deque[str] = deque(maxlen=lines)
    for part in (path.with_name(path.name + ".1"), path):
        if part.is_file():
            with part.open(encoding="utf-8", errors="replace") as text:
                kept.extend(line.rstrip("\n") for line in text)
    return list(kept) if lines > 0 else []


def follow(
    path: Path, write: Callable[[str], None], *, stop: threading.Event, poll: float = FOLLOW_POLL_SECONDS
) -> None:
    """Hand `write` every line appended to `path` from now until `stop` is set; a rotation
    (the file replaced by a new one, or cut shorter) is read on from the new file's start, and a
    file not there yet is waited for."""
    handle, inode = _open_at(path, end=True)
    try:
        while not stop.is_set():
            line = handle.readline() if handle is not None else b""
            if line.endswith(b"\n"):
                write(line.decode("utf-8", errors="replace").rstrip("\n"))
                continue
            if line and handle is not None:  # half a line: its writer is mid-way; read it whole next time
                handle.seek(-len(line), 1)
            if _rotated(path, handle, inode):
                if handle is not None:  # what was written to the old file before it was renamed comes first
                    for rest in handle.read().splitlines():
                        write(rest.decode("utf-8", errors="replace"))
                    handle.close()
                handle, inode = _open_at(path, end=False)
                continue
            stop.wait(poll)
    finally:
        if handle is not None:
            handle.close()


def _open_at(path: Path, *, end: bool) -> tuple[BinaryIO | None, int | None]:
    """The file opened at its end (or start), with its inode; (None, None) when it is not there."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return None, None
    if end:
        handle.seek(0, 2)
    return handle, os.fstat(handle.fileno()).st_ino


def _rotated(path: Path, handle: BinaryIO | None, inode: int | None) -> bool:
    """Whether `path` is now another file than the one `handle` reads (or has shrunk under it)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False  # (between a rotation's rename and the new file: the next poll sees it)
    return handle is None or now.st_ino != inode or now.st_size < handle.tell()
