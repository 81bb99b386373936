"""May this machine work for others now? One answer for every command that serves others' work.

The machine stays its owner's (seed 000): `mahout run`, `mahout ring`'s bridge, `mahout
stage`, `mahout moe coordinator`, `volunteer` and `worker` all ask the same `OwnerGuard`,
which says no while the pause flag is set (`mahout pause`), outside the serving hours
(``--schedule``), or while the owner is using the machine (the idle detector). What each
command does on a "no" is its own, written where it acts: a host loop stops claiming and
finishes the job in hand; a stage leaves its ring; an expert worker refuses new batches
and a volunteer gives its slice up.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mahout.home import is_paused
from mahout.idle import DEFAULT_THRESHOLD_SECONDS, IdleDetector
from mahout.schedule import Schedule

__all__ = ["OwnerGuard", "OwnerWatch", "add_owner_arguments", "announce", "owner_guard"]


@dataclass(frozen=True)
class OwnerGuard:
    """The three local reasons not to work, read afresh on every call (the flag is a file)."""

    home: Path
    schedule: Schedule | None = None
    idle: IdleDetector | None = None

    def reason(self) -> str | None:
        """Why this machine must not take others' work now, or ``None`` when it may."""
        if is_paused(self.home):
            return "pause flag set"
        outside = self.schedule.pause_reason() if self.schedule is not None else None
        if outside:
            return outside
        activity = self.idle.activity() if self.idle is not None else None
        return f"owner active ({activity})" if activity else None


class OwnerWatch:
    """Asks `guard` at `start` and then every `poll_s` seconds on a daemon thread; calls
    `on_change(reason)` each time the answer changes (``None``: free again), counting from
    free. `reason` is the latest answer, cheap to read on every request."""

    def __init__(
        self,
        guard: OwnerGuard,
        on_change: Callable[[str | None], object] = lambda _reason: None,
        *,
        poll_s: float = 1.0,
    ) -> None:
        self.guard, self.on_change, self.poll_s = guard, on_change, poll_s
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="owner-watch", daemon=True)

    def start(self) -> OwnerWatch:
        self._check()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._check()

    def _check(self) -> None:
        reason = self.guard.reason()
        if reason != self.reason:
            self.reason = reason
            self.on_change(reason)

    def stop(self) -> None:
        self._stop.set()


def announce(out: Callable[[str], None], name: str, *, paused: str, resumed: str) -> Callable[[str | None], None]:
    """An `OwnerWatch` callback printing one line per change, e.g. ``mahout stage 1: paused
    (pause flag set): leaving the ring`` and ``mahout stage 1: resumed: rejoining``."""

    def on_change(reason: str | None) -> None:
        out(f"{name}: paused ({reason}): {paused}" if reason else f"{name}: resumed: {resumed}")

    return on_change


def _schedule(text: str) -> Schedule:
    try:
        return Schedule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_owner_arguments(parser: argparse.ArgumentParser) -> None:
    """``--idle-detect/--no-idle-detect``, ``--idle-threshold`` and ``--schedule``, as `mahout run` has them."""
    parser.add_argument(
        "--idle-detect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop taking work while the owner uses the machine (keyboard/mouse input, another GPU "
        "program); on by default, --no-idle-detect for a dedicated server",
    )
    parser.add_argument(
        "--idle-threshold", type=float, default=DEFAULT_THRESHOLD_SECONDS, help="seconds of no input before working"
    )
    parser.add_argument(
        "--schedule",
        type=_schedule,
        default=None,
        help="work only in these local hours, e.g. 22:00-08:00 (several: 22:00-08:00,12:00-13:00)",
    )


def owner_guard(args: argparse.Namespace, home: Path) -> OwnerGuard:
    """The guard `add_owner_arguments`' options describe, for the home whose pause flag counts."""
    idle = IdleDetector(args.idle_threshold) if args.idle_detect else None
    return OwnerGuard(home, args.schedule, idle)
