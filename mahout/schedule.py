"""Serving hours (`mahout run --schedule 22:00-08:00`): outside them the host claims nothing,
whatever the idle detector says. Local time; a window that ends before it starts runs past
midnight; several windows are separated by commas ("22:00-08:00,12:00-13:30")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, time


@dataclass(frozen=True)
class Schedule:
    windows: tuple[tuple[time, time], ...]
    text: str
    clock: Callable[[], datetime] = datetime.now  # local time; injected in tests

    @classmethod
    def parse(cls, text: str, *, clock: Callable[[], datetime] = datetime.now) -> Schedule:
        """Raises ValueError naming what is wrong."""
        windows = []
        for part in text.split(","):
            start, sep, end = part.strip().partition("-")
            if not sep:
                raise ValueError(f"{part.strip()!r} is not a window: write HH:MM-HH:MM, e.g. 22:00-08:00")
            window = (_clock_time(start), _clock_time(end))
            if window[0] == window[1]:
                raise ValueError(
                    f"{part.strip()!r} starts and ends at the same minute: leave --schedule out to serve all day"
                )
            windows.append(window)
        return cls(tuple(windows), text.strip(), clock)

    def serving(self, now: datetime | None = None) -> bool:
        """True inside one of the windows (its start included, its end not)."""
        at = (now or self.clock()).time().replace(second=0, microsecond=0)
        return any(start <= at < end if start < end else (at >= start or at < end) for start, end in self.windows)

    def pause_reason(self) -> str | None:
        return None if self.serving() else f"outside the serving hours ({self.text})"


def _clock_time(text: str) -> time:
    hours, sep, minutes = text.strip().partition(":")
    try:
        if sep and len(minutes) == 2:
            return time(int(hours), int(minutes))
    except ValueError:
        pass
    raise ValueError(f"{text.strip()!r} is not a time of day: write HH:MM (24-hour), e.g. 08:00")
