"""Where mahout finds its gateway and host token without putting the token on the command
line (where every user of the machine reads it in ``ps``, and the shell keeps it in its
history).

In order: ``--server`` / ``--token`` (still accepted, with a warning about the token),
the ``MAHOUT_SERVER`` / ``MAHOUT_TOKEN`` environment variables, then the file
``mahout login`` writes in the home directory (``credentials.json``, mode 0600).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mahout import command_name

CREDENTIALS_FILE = "credentials.json"
SERVER_ENV, TOKEN_ENV = "MAHOUT_SERVER", "MAHOUT_TOKEN"


class NoCredentials(Exception):
    """Nothing says which gateway to serve, or with which token."""


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str


def credentials_path(home: Path) -> Path:
    return home / CREDENTIALS_FILE


def credentials_save(home: Path, server: str, token: str) -> Path:
    """Write the file ``login`` keeps, readable by this user only (created 0600, never wider)."""
    path = credentials_path(home)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"server": server.rstrip("/"), "token": token}, out)
    os.chmod(path, 0o600)  # an older file may have been wider
    return path


def credentials_load(home: Path) -> Credentials | None:
    """The saved credentials, or None when there are none (or the file cannot be read)."""
    try:
        saved = json.loads(credentials_path(home).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("server"), str)
        or not isinstance(saved.get("token"), str)
    ):
        return None
    return Credentials(saved["server"], saved["token"])


def credentials_resolve(
    *, server: str | None, token: str | None, home: Path, warn: Callable[[str], None]
) -> Credentials:
    """The gateway and token to use (see the module's order), or NoCredentials saying how to log in."""
    if token:
        warn(
            "mahout: warning: a token on the command line is visible to every user of this machine (ps) and kept in "
            f"your shell history; run `{command_name()} login` once instead, or set MAHOUT_TOKEN"
        )
    saved = credentials_load(home)
    server = server or os.environ.get(SERVER_ENV) or (saved.server if saved else None)
    token = token or os.environ.get(TOKEN_ENV) or (saved.token if saved else None)
    if not server or not token:
        missing = " and ".join(name for name, value in (("gateway", server), ("host token", token)) if not value)
        raise NoCredentials(
            f"no {missing}: run `{command_name()} login --server URL` (it asks for the token from My machines), "
            f"or set {SERVER_ENV} and {TOKEN_ENV}"
        )
    return Credentials(server.rstrip("/"), token)
