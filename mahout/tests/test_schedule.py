"""Serving hours: the loop pauses and resumes claiming at the schedule's boundaries (clock injected)."""

from __future__ import annotations

from datetime import datetime

import pytest

from mahout import __main__ as cli
from mahout.schedule import Schedule
from mahout.tests.test_loop import FakeRunner, make_loop, pieces


class ScheduleTests:
    @pytest.mark.parametrize(
        ("at", "serving"),
        [
            ("21:59", False),
            ("22:00", True),
            ("23:59", True),
            ("00:00", True),
            ("07:59", True),
            ("08:00", False),
            ("12:00", True),
            ("13:29", True),
            ("13:30", False),
        ],
    )
    def test_windows_include_their_start_and_run_past_midnight(self, at: str, serving: bool) -> None:
        schedule = Schedule.parse("22:00-08:00, 12:00-13:30")
        hour, minute = map(int, at.split(":"))
        assert schedule.serving(datetime(2026, 12, 2, hour, minute, 30)) is serving

    @pytest.mark.parametrize("text", ["22:00", "25:00-08:00", "22-08", "08:00-08:00", "9:5-10:00"])
    def test_a_bad_schedule_says_what_is_wrong(self, text: str, capsys: pytest.CaptureFixture) -> None:
        with pytest.raises(ValueError):
            Schedule.parse(text)
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["run", "--schedule", text])
        assert "--schedule" in capsys.readouterr().err

    def test_the_loop_claims_only_inside_the_hours(self, gateway, api, tmp_path) -> None:  # noqa: ANN001
        now = [datetime(2026, 12, 2, 21, 59)]
        lines: list[str] = []
        gateway.state.add_job("job-1")
        loop = make_loop(api, FakeRunner(pieces(2)), tmp_path, lines)
        loop.schedule = Schedule.parse("22:00-08:00", clock=lambda: now[0])
        assert loop.run(once=True) == 0 and gateway.state.claims == 0
        loop.heartbeat()
        assert gateway.state.heartbeats[-1]["paused"] is True, "the gateway hears the host is paused"
        now[0] = datetime(2026, 12, 2, 22, 0)
        assert loop.run(once=True) == 1 and "job-1" in gateway.state.completions
        now[0] = datetime(2026, 12, 3, 8, 0)
        gateway.state.add_job("job-2")
        assert loop.run(once=True) == 0 and "job-2" not in gateway.state.completions
        assert [line for line in lines if "paused" in line or "resumed" in line] == [
            "mahout: paused: outside the serving hours (22:00-08:00)",
            "mahout: resumed, claiming work",
            "mahout: paused: outside the serving hours (22:00-08:00)",
        ]
