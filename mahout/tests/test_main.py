"""The command line's local commands: pause, resume, status, login, logs; and what its lines say."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mahout
from mahout.__main__ import main
from mahout.credentials import CREDENTIALS_FILE, NoCredentials, credentials_resolve
from mahout.home import is_paused
from mahout.logfile import follow, log_path
from mahout.tests import fake_gateway
from mahout.tests.fake_gateway import TOKEN

ROOT = Path(mahout.__file__).resolve().parent.parent
LOGIN_HINT = " (this token may have been rotated, revoked or banned: see My machines, then `mahout login --server URL`)"


class CommandLineTests:
    def test_it_pauses_and_resumes_through_a_flag_file(self, tmp_path, capsys):
        assert main(["pause", "--home", str(tmp_path)]) == 0
        assert is_paused(tmp_path)
        main(["status", "--json", "--home", str(tmp_path)])
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["paused"] is True
        assert main(["resume", "--home", str(tmp_path)]) == 0
        assert not is_paused(tmp_path)

    def test_it_shows_the_state_the_current_job_and_the_earnings(self, tmp_path, capsys, gateway):
        assert main(["status", "--home", str(tmp_path), "--server", gateway.url, "--token", TOKEN]) == 0
        assert capsys.readouterr().out.splitlines() == [
            f"mahout: home {tmp_path}; pause flag off; model not assembled yet",
            f"mahout: host 'test-host' (id 7) at {gateway.url}: online",
            "mahout: running job 42 (gemma-3-270m) since 2026-12-02T14:00:00Z",
            (
                "mahout: earned today $0.01234567; pending $0.02500000 "
                "(payable now $0.02000000, still vesting $0.00500000)"
            ),
        ]
        assert main(["status", "--json", "--home", str(tmp_path), "--server", gateway.url, "--token", TOKEN]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["earnings"]["today_ucents"] == 1_234_567

    def test_it_exits_2_with_one_line_on_a_refused_token(self, tmp_path, capsys, gateway):
        assert main(["status", "--home", str(tmp_path), "--server", gateway.url, "--token", "wrong"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == "mahout: error: HTTP 401: bad host token" + LOGIN_HINT

    def test_it_never_imports_django(self):
        modules = (
            "mahout.__main__, mahout.host, mahout.loop, mahout.runners.llama, "
            "protocol.rendering, protocol.jobs, mahout.model_files"
        )
        code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('django')))"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stdout.strip() == "[]"

    def test_its_command_line_needs_no_torch(self):
        """A host installed without the [ring] extra has no torch: `mahout --help` and `run` must not need it."""
        code = (
            "import sys; from mahout.__main__ import build_parser; build_parser().parse_args(['run']); "
            "print('torch' in sys.modules)"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stdout.strip() == "False"


class IdleDetectDefaultTests:
    def test_owner_detection_is_on_unless_turned_off(self):
        from mahout.__main__ import build_parser

        base = ["run", "--server", "http://gateway", "--token", "host-x"]
        assert build_parser().parse_args(base).idle_detect is True, "seed 000: a machine its owner uses pauses"
        assert build_parser().parse_args([*base, "--no-idle-detect"]).idle_detect is False


class LoginTests:
    """The token stays off the command line (issue 17): `login` keeps it in the home, 0600."""

    def test_login_checks_the_token_and_keeps_it_for_status_and_run(self, tmp_path, capsys, gateway, monkeypatch):
        monkeypatch.setattr(sys, "stdin", io.StringIO(TOKEN + "\n"))
        assert main(["login", "--home", str(tmp_path), "--server", gateway.url + "/", "--token-stdin"]) == 0
        saved = tmp_path / CREDENTIALS_FILE
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert json.loads(saved.read_text()) == {"server": gateway.url, "token": TOKEN}
        assert "logged in as host 'test-host'" in capsys.readouterr().out
        assert main(["status", "--json", "--home", str(tmp_path)]) == 0  # no flags: the kept login
        out, err = capsys.readouterr()
        assert json.loads(out.splitlines()[-1])["me"]["name"] == "test-host" and "warning" not in err

    def test_a_refused_token_is_not_kept(self, tmp_path, capsys, gateway, monkeypatch):
        monkeypatch.setattr(sys, "stdin", io.StringIO("wrong\n"))
        assert main(["login", "--home", str(tmp_path), "--server", gateway.url, "--token-stdin"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            "mahout: error: HTTP 401: bad host token (copy the token "
            "again from My machines: a rotated or revoked one is refused)"
        )
        assert not (tmp_path / CREDENTIALS_FILE).exists()

    def test_a_login_error_is_printed_once(self, tmp_path, gateway):
        """Before any log file is open, logging's last resort printed every warning a second time."""
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "mahout",
                "login",
                "--home",
                str(tmp_path),
                "--server",
                gateway.url,
                "--token-stdin",
            ],
            input="wrong\n",
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert result.returncode == 2
        assert result.stderr.splitlines() == [
            "mahout: error: HTTP 401: bad host token (copy the token "
            "again from My machines: a rotated or revoked one is refused)"
        ]

    def test_the_login_line_names_the_command_the_owner_types(self, tmp_path, capsys, gateway, monkeypatch):
        """The wheel installs `mahout`; `python -m mahout` is said only to who started it so."""
        monkeypatch.setattr(sys, "stdin", io.StringIO(TOKEN + "\n"))
        monkeypatch.setattr(sys, "argv", ["/home/owner/.local/bin/mahout"])
        assert main(["login", "--home", str(tmp_path), "--server", gateway.url, "--token-stdin"]) == 0
        assert capsys.readouterr().out.rstrip().endswith("Start serving with: mahout run")
        monkeypatch.setattr(sys, "stdin", io.StringIO(TOKEN + "\n"))
        monkeypatch.setattr(sys, "argv", [str(Path(mahout.__file__).with_name("__main__.py"))])
        assert main(["login", "--home", str(tmp_path), "--server", gateway.url, "--token-stdin"]) == 0
        assert capsys.readouterr().out.rstrip().endswith("Start serving with: python -m mahout run")

    def test_run_without_a_login_says_how_to_log_in(self, tmp_path, capsys, monkeypatch):
        monkeypatch.delenv("MAHOUT_TOKEN", raising=False)
        monkeypatch.delenv("MAHOUT_SERVER", raising=False)
        assert main(["run", "--home", str(tmp_path)]) == 2
        assert "`mahout login --server URL`" in capsys.readouterr().err

    def test_the_environment_comes_before_the_file_and_a_flag_before_both_with_a_warning(self, tmp_path, monkeypatch):
        (tmp_path / CREDENTIALS_FILE).write_text(json.dumps({"server": "http://file", "token": "from-file"}))
        warnings: list[str] = []
        monkeypatch.setenv("MAHOUT_TOKEN", "from-env")
        monkeypatch.delenv("MAHOUT_SERVER", raising=False)
        found = credentials_resolve(server=None, token=None, home=tmp_path, warn=warnings.append)
        assert (found.server, found.token, warnings) == ("http://file", "from-env", [])
        found = credentials_resolve(server="http://flag/", token="from-flag", home=tmp_path, warn=warnings.append)
        assert (found.server, found.token) == ("http://flag", "from-flag") and "visible" in warnings[0]
        os.remove(tmp_path / CREDENTIALS_FILE)
        monkeypatch.delenv("MAHOUT_TOKEN")
        with pytest.raises(NoCredentials, match="no gateway and host token"):
            credentials_resolve(server=None, token=None, home=tmp_path, warn=warnings.append)


class RefusedTokenTests:
    def test_run_checks_the_token_before_assembling_or_benchmarking_anything(self, tmp_path, capsys, gateway):
        assert main(["run", "--home", str(tmp_path), "--server", gateway.url, "--token", "wrong"]) == 2
        error = capsys.readouterr().err.splitlines()[-1]
        assert error.startswith("mahout: error: HTTP 401: bad host token") and "mahout login" in error
        assert not (tmp_path / "models").exists() and not (tmp_path / "qualifications.json").exists()

    def test_a_token_revoked_while_serving_exits_pointing_at_login(self, tmp_path, capsys, gateway, monkeypatch):
        import mahout.host
        from mahout.loop import HostLoop
        from mahout.tests.test_loop import MODEL, FakeRunner

        def start_host(api, home, threads, *, out, **_options):  # noqa: ANN001, ANN202 (the real one's signature)
            monkeypatch.setattr(fake_gateway, "TOKEN", "rotated-since")  # the owner rotated it on My machines
            return HostLoop(
                api,
                {MODEL: FakeRunner([])},
                fingerprint="f" * 64,
                home=home,
                claim_wait=0.2,
                heartbeat_interval=0.05,
                pause_poll=0.01,
                error_backoff=0.01,
                out=out,
            )

        monkeypatch.setattr(mahout.host, "start_host", start_host)
        monkeypatch.setattr(mahout.host, "gpu_setup", lambda *_args, **_kwargs: mahout.host.GpuSetup())
        assert (
            main(["run", "--home", str(tmp_path), "--server", gateway.url, "--token", TOKEN, "--no-idle-detect"]) == 2
        )
        assert capsys.readouterr().err.splitlines()[-1] == "mahout: error: HTTP 401: bad host token" + LOGIN_HINT


class LogsTests:
    """`run` keeps what it says in the home (rotated); `mahout logs` prints its end, `-f` follows it."""

    def test_logs_prints_what_run_said(self, tmp_path, capsys, monkeypatch):
        monkeypatch.delenv("MAHOUT_TOKEN", raising=False)
        monkeypatch.delenv("MAHOUT_SERVER", raising=False)
        assert main(["run", "--home", str(tmp_path)]) == 2  # not logged in: one error line, in the log too
        said = capsys.readouterr().err.splitlines()[-1]
        assert main(["logs", "--home", str(tmp_path)]) == 0
        assert capsys.readouterr().out.splitlines()[-1].endswith(f"WARNING {said}")

    def test_logs_prints_the_last_lines_across_a_rotation(self, tmp_path, capsys):
        path = log_path(tmp_path)
        path.parent.mkdir(parents=True)
        path.with_name("mahout.log.1").write_text("one\ntwo\nthree\n")
        path.write_text("four\n")
        assert main(["logs", "--home", str(tmp_path), "-n", "3"]) == 0
        assert capsys.readouterr().out.splitlines() == ["two", "three", "four"]

    def test_logs_without_a_log_says_what_writes_one(self, tmp_path, capsys):
        assert main(["logs", "--home", str(tmp_path)]) == 1
        assert capsys.readouterr().err.strip() == f"mahout: no log at {log_path(tmp_path)} yet: `mahout run` writes one"

    def test_follow_prints_each_new_line_once_through_rotations(self, tmp_path):
        from logging.handlers import RotatingFileHandler

        path = log_path(tmp_path)
        path.parent.mkdir(parents=True)
        path.write_text("written before\n")
        seen: list[str] = []
        stop = threading.Event()
        reader = threading.Thread(target=follow, args=(path, seen.append), kwargs={"stop": stop, "poll": 0.01})
        reader.start()
        time.sleep(0.2)  # (from the end: what was there before is tail's, not follow's)
        log = logging.getLogger("mahout.tests.follow")
        log.propagate = False
        handler = RotatingFileHandler(path, maxBytes=80, backupCount=50)  # a rotation every ten lines
        log.addHandler(handler)
        try:
            for index in range(32):
                log.warning("line %02d", index)
                time.sleep(0.02)
            deadline = time.monotonic() + 10
            while len(seen) < 32 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            reader.join(timeout=5)
            log.removeHandler(handler)
            handler.close()
        assert seen == [f"line {index:02d}" for index in range(32)]
        assert len(list(path.parent.glob("mahout.log.*"))) >= 3
