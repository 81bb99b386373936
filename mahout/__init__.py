"""mahout: the Elephant host client. Never imports Django: hosts install it alone."""

from __future__ import annotations

from protocol.version import MAHOUT_VERSION as __version__  # (the gateway reads it from protocol)

__all__ = ["__version__", "command_name"]


def command_name() -> str:
    """What the owner types to run mahout, for lines that tell them a command: ``mahout`` (the
    command the wheel installs), or ``python -m mahout`` when this process was started so (a
    checkout of the repository, `make run`)."""
    import sys
    from pathlib import Path

    started_as_module = Path(sys.argv[0]).resolve() == Path(__file__).with_name("__main__.py").resolve()
    return "python -m mahout" if started_as_module else "mahout"
