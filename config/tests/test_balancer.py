"""HAProxy's configuration for `WORKERS=N`: its health checks ask `/healthz`, which needs no key
(they asked `/v1/models` and took its 401 for a pass: four "Unauthorized" lines a second)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from config.balancer import haproxy_config


def test_the_health_check_asks_the_unauthenticated_endpoint_and_wants_a_200() -> None:
    config = haproxy_config(port=8000, backends=[8001, 8002], max_body=1024)
    assert "option httpchk GET /healthz\n" in config and "http-check expect status 200\n" in config
    assert "/v1/models" not in config and "401" not in config
    assert "server gateway1 127.0.0.1:8001 check" in config and "server gateway2 127.0.0.1:8002 check" in config


def test_haproxy_accepts_the_configuration(tmp_path) -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (.ci/run installs it from Debian)")
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy_config(port=8000, backends=[8001, 8002], max_body=1024))
    checked = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
