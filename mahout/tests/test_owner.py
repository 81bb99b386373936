"""The shared "may this machine work now?" check, and its watcher."""

from __future__ import annotations

import argparse
import threading
from datetime import datetime
from pathlib import Path

import pytest

from mahout.home import set_paused
from mahout.idle import IdleDetector
from mahout.owner import OwnerGuard, OwnerWatch, add_owner_arguments, owner_guard
from mahout.schedule import Schedule

AT_NOON = datetime(2026, 1, 5, 12, 0)


def _idle(seconds: float | None) -> IdleDetector:
    return IdleDetector(60, input_idle=lambda: seconds, gpu_pids=lambda: [], own_pid=1)


class OwnerGuardTests:
    def test_it_lets_an_unpaused_idle_machine_work(self, tmp_path: Path) -> None:
        guard = OwnerGuard(tmp_path, Schedule.parse("08:00-20:00", clock=lambda: AT_NOON), _idle(600.0))
        assert guard.reason() is None

    def test_it_says_no_while_the_pause_flag_is_set_and_yes_once_cleared(self, tmp_path: Path) -> None:
        guard = OwnerGuard(tmp_path)
        set_paused(tmp_path, True)
        assert guard.reason() == "pause flag set"
        set_paused(tmp_path, False)
        assert guard.reason() is None

    def test_it_says_no_outside_the_serving_hours(self, tmp_path: Path) -> None:
        guard = OwnerGuard(tmp_path, Schedule.parse("22:00-08:00", clock=lambda: AT_NOON))
        assert guard.reason() == "outside the serving hours (22:00-08:00)"

    def test_it_says_no_while_the_owner_is_at_the_keyboard(self, tmp_path: Path) -> None:
        assert OwnerGuard(tmp_path, idle=_idle(5.0)).reason() == "owner active (input 5 s ago)"

    def test_the_pause_flag_is_named_before_the_other_reasons(self, tmp_path: Path) -> None:
        set_paused(tmp_path, True)
        guard = OwnerGuard(tmp_path, Schedule.parse("22:00-08:00", clock=lambda: AT_NOON), _idle(5.0))
        assert guard.reason() == "pause flag set"


class OwnerArgumentsTests:
    def _parse(self, *argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_owner_arguments(parser)
        return parser.parse_args(argv)

    def test_idle_detection_is_on_by_default(self, tmp_path: Path) -> None:
        guard = owner_guard(self._parse(), tmp_path)
        assert guard.idle is not None and guard.idle.threshold_s == 120.0 and guard.schedule is None

    def test_it_builds_the_guard_the_options_describe(self, tmp_path: Path) -> None:
        guard = owner_guard(self._parse("--no-idle-detect", "--schedule", "22:00-08:00"), tmp_path)
        assert guard.idle is None and guard.schedule is not None and guard.schedule.text == "22:00-08:00"

    def test_it_refuses_a_bad_schedule_by_name(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            self._parse("--schedule", "25:00-08:00")
        assert "'25:00' is not a time of day" in capsys.readouterr().err


class OwnerWatchTests:
    def test_it_reports_each_change_counting_from_free(self, tmp_path: Path) -> None:
        seen: list[str | None] = []
        changed = threading.Event()

        def on_change(reason: str | None) -> None:
            seen.append(reason)
            changed.set()

        watch = OwnerWatch(OwnerGuard(tmp_path), on_change, poll_s=0.01).start()
        try:
            assert seen == [] and watch.reason is None
            for paused, expected in ((True, "pause flag set"), (False, None)):
                changed.clear()
                set_paused(tmp_path, paused)
                assert changed.wait(5)
                assert seen[-1] == expected and watch.reason == expected
        finally:
            watch.stop()
        assert seen == ["pause flag set", None]

    def test_a_machine_paused_at_start_is_reported_at_once(self, tmp_path: Path) -> None:
        set_paused(tmp_path, True)
        seen: list[str | None] = []
        watch = OwnerWatch(OwnerGuard(tmp_path), seen.append, poll_s=60).start()
        watch.stop()
        assert seen == ["pause flag set"] and watch.reason == "pause flag set"
