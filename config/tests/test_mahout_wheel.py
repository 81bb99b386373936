"""One install for owners: the wheel `make mahout-wheel` builds installs the `mahout` command
into a clean environment with the host's dependencies only (no Django, no torch), and a
host run from there serves a real gateway."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from conftest import ROOT, make_customer, make_host, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment holding the wheel and what it requires, nothing else."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # built from a copy: setuptools leaves build/ and egg-info behind
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    for package in ("mahout", "scorer", "protocol", "engine"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"), str(source)], check=True
    )
    (wheel,) = (work / "dist").glob("elephant_mahout-*-py3-none-any.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)], check=True)
    yield venv


def test_the_wheel_installs_the_mahout_command_without_the_gateway(installed: Path) -> None:
    help_text = subprocess.run(
        [str(installed / "bin" / "mahout"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "run" in help_text and "login" in help_text
    for module in ("django", "rest_framework", "channels", "torch"):
        missing = subprocess.run(
            [str(installed / "bin" / "python"), "-c", f"import {module}"], capture_output=True, text=True
        )
        assert missing.returncode != 0 and "ModuleNotFoundError" in missing.stderr, module


@pytest.mark.django_db(transaction=True)
def test_a_host_installed_from_the_wheel_serves_a_real_gateway(
    installed: Path, gateway, catalog, tmp_path: Path
) -> None:  # noqa: ANN001
    from hosts.models import Host

    host = make_host(qualified=False, name="from-the-wheel")
    log = open(tmp_path / "mahout.log", "w")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO", "DATABASE", "PYTHON"))}
    proc = subprocess.Popen(
        [
            str(installed / "bin" / "mahout"),
            "run",
            "--server",
            gateway.url,
            "--home",
            str(tmp_path / "home"),
            "--threads",
            "1",
            "--no-idle-detect",
        ],
        cwd=tmp_path,
        env={**env, "MAHOUT_TOKEN": host.token},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def qualified() -> bool:
            assert proc.poll() is None, (tmp_path / "mahout.log").read_text()
            row = Host.objects.get(pk=host.host.pk)
            return bool(row.last_heartbeat_at and row.qualifications.exists())

        wait_until(qualified, timeout=240, what="the wheel's mahout to benchmark and register", interval=0.5)
        time.sleep(0.3)
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=make_customer().secret, max_retries=0, timeout=60)
        answer = api.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0
        )
        assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
        assert Host.objects.get(pk=host.host.pk).jobs.filter(status="completed").exists()
    finally:
        proc.terminate()  # (it finishes its long-poll first: up to its wait)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
