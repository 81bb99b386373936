"""The command line's local commands: pause, resume, status."""
from __future__ import annotations

import json
import subprocess
import sys

from mahout.__main__ import main
from mahout.home import is_paused
from mahout.tests.fake_gateway import TOKEN


class CommandLineTests:
    def test_it_pauses_and_resumes_through_a_flag_file(self, tmp_path, capsys):
        assert main(["pause", "--home", str(tmp_path)]) == 0
        assert is_paused(tmp_path)
        main(["status", "--home", str(tmp_path)])
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["paused"] is True
        assert main(["resume", "--home", str(tmp_path)]) == 0
        assert not is_paused(tmp_path)

    def test_it_shows_the_servers_view_with_a_token(self, tmp_path, capsys, gateway):
        assert main(["status", "--home", str(tmp_path), "--server", gateway.url, "--token", TOKEN]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
            "me": {"name": "test-host"}, "earnings": {"total_ucents": 0}}

    def test_it_exits_2_with_one_line_on_a_refused_token(self, tmp_path, capsys, gateway):
        assert main(["status", "--home", str(tmp_path), "--server", gateway.url, "--token", "wrong"]) == 2
        assert capsys.readouterr().err == "mahout: error: HTTP 401: bad host token\n"

    def test_it_never_imports_django(self):
        modules = "mahout.__main__, mahout.host, mahout.loop, mahout.runners.llama, protocol.turns, mahout.models"
        code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('django')))"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stdout.strip() == "[]"


class IdleDetectDefaultTests:
    def test_owner_detection_is_on_unless_turned_off(self):
        from mahout.__main__ import build_parser

        base = ["run", "--server", "http://gateway", "--token", "host-x"]
        assert build_parser().parse_args(base).idle_detect is True, "seed 000: a machine its owner uses pauses"
        assert build_parser().parse_args([*base, "--no-idle-detect"]).idle_detect is False
