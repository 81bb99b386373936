"""A machine that looks after itself: the service unit `mahout install-service` writes (the
service manager stubbed at its boundary: a `systemctl`/`launchctl` on PATH that records its
calls), and the log kept, rotated, in the home."""

from __future__ import annotations

import json
import os
import plistlib
import stat
import sys
from pathlib import Path

import pytest

from mahout import __main__ as cli
from mahout import logfile
from mahout.autostart import install_service
from mahout.credentials import credentials_save


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake systemctl and launchctl first on PATH, logging their arguments; HOME in tmp."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("systemctl", "launchctl"):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return calls


class InstallServiceTests:
    def test_linux_writes_a_user_unit_and_enables_it(self, manager: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
        home = tmp_path / "mahout-home"
        home.mkdir()
        credentials_save(home, "http://gateway.example", "host-secret-token")
        assert cli.main(["install-service", "--home", str(home), "--", "--schedule", "22:00-08:00"]) == 0
        unit = tmp_path / "user" / ".config" / "systemd" / "user" / "mahout.service"
        text = unit.read_text()
        assert f"ExecStart={sys.executable} -m mahout run --home {home} --schedule 22:00-08:00" in text
        assert "Restart=on-failure" in text and "WantedBy=default.target" in text
        assert "host-secret-token" not in text, "the token stays in the home's credentials file"
        assert manager.read_text().splitlines() == [
            "systemctl --user daemon-reload",
            "systemctl --user enable --now mahout.service",
        ]
        out = capsys.readouterr().out
        assert "enabled and started" in out and "loginctl enable-linger" in out
        assert out.splitlines()[-1] == "mahout: next: mahout logs -f  # what it says, as it says it"

    def test_macos_writes_a_launch_agent_and_loads_it(self, manager: Path, tmp_path: Path) -> None:
        home = tmp_path / "mahout-home"
        installed = install_service(home, ["--threads", "4"], platform="darwin")
        plist = plistlib.loads(installed.path.read_bytes())
        assert installed.path == tmp_path / "user" / "Library" / "LaunchAgents" / "net.elephant.mahout.plist"
        assert plist["ProgramArguments"] == [
            sys.executable,
            "-m",
            "mahout",
            "run",
            "--home",
            str(home),
            "--threads",
            "4",
        ]
        assert plist["RunAtLoad"] is True and installed.started
        assert manager.read_text().strip() == f"launchctl load -w {installed.path}"

    def test_it_refuses_before_login_and_a_bad_run_option(self, manager: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
        home = tmp_path / "mahout-home"
        assert cli.main(["install-service", "--home", str(home)]) == 2
        assert "log in first" in capsys.readouterr().err
        credentials_save(home, "http://gateway.example", "host-secret-token")
        with pytest.raises(SystemExit):
            cli.main(["install-service", "--home", str(home), "--", "--schedule", "soon"])
        assert not manager.exists(), "nothing was enabled"

    def test_without_a_service_manager_it_says_what_to_run(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("HOME", str(tmp_path / "user"))
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        installed = install_service(tmp_path / "h", [], platform="linux")
        assert not installed.started and installed.next[0] == "systemctl --user daemon-reload"


class LogTests:
    def test_what_a_command_says_is_kept_in_the_home_and_rotated(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(logfile, "LOG_BYTES", 2000)
        path = logfile.open_log(tmp_path, cli._log)
        for index in range(200):
            cli.say(f"mahout: line {index} " + "x" * 40)
        logs = sorted(p.name for p in path.parent.iterdir())
        assert logs == ["mahout.log", *(f"mahout.log.{n}" for n in range(1, logfile.LOG_BACKUPS + 1))]
        assert "mahout: line 199" in path.read_text() and all(p.stat().st_size <= 2100 for p in path.parent.iterdir())

    def test_run_like_commands_open_the_log(self, tmp_path: Path, capsys) -> None:  # noqa: ANN001
        renamed = tmp_path / "x.gguf"
        renamed.write_bytes(b"not a model")
        cli.main(["add", str(renamed), "--home", str(tmp_path / "h")])
        assert "is no catalog model's file" in (tmp_path / "h" / "logs" / "mahout.log").read_text()
        json.dumps(capsys.readouterr().err)  # (the same line went to stderr)
