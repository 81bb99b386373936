"""The host's home directory: assembled models, cached qualifications, the pause flag.

Pausing is a flag file rather than a signal or a socket so that ``python -m mahout pause``
works from any shell, survives restarts, and the loop can read it before every claim.
"""

from __future__ import annotations

import os
from pathlib import Path

PAUSE_FLAG = "paused"


def resolve_home(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit``, else ``$MAHOUT_HOME``, else ``~/.mahout``; created if missing."""
    home = Path(explicit or os.environ.get("MAHOUT_HOME") or Path.home() / ".mahout").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def is_paused(home: Path) -> bool:
    """True while the pause flag file exists."""
    return (home / PAUSE_FLAG).exists()


def set_paused(home: Path, paused: bool) -> None:
    """Create or remove the pause flag file (idempotent)."""
    flag = home / PAUSE_FLAG
    if paused:
        flag.touch()
    else:
        flag.unlink(missing_ok=True)
