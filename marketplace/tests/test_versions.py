"""Versions: mahout sends its version with every heartbeat; a client older than
MAHOUT_MIN_VERSION is refused (426) with how to upgrade, and stops; the pool page shows the
versions in use."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.test import Client

from conftest import ROOT, Gateway, make_host, stack_env
from hosts.models import Host
from mahout import __version__
from testkit.simhost import FINGERPRINT


def beat(token: str, version: str):  # noqa: ANN201
    return Client().post(
        "/hosts/api/heartbeat",
        {"fingerprint": FINGERPRINT, "version": version},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )


@pytest.mark.django_db
def test_an_older_client_is_refused_with_how_to_upgrade(serving_host, settings) -> None:
    settings.MAHOUT_MIN_VERSION = "0.2.0"
    refused = beat(serving_host.token, "0.1.9")
    assert refused.status_code == 426 and refused.json()["error"]["code"] == "upgrade_required"
    message = refused.json()["error"]["message"]
    assert "0.1.9 is older than 0.2.0" in message and "pip install --upgrade http://testserver/downloads/" in message
    assert Host.objects.get(pk=serving_host.host.pk).last_heartbeat_at is None, "a refused heartbeat is no sign of life"
    assert beat(serving_host.token, "0.2.0").status_code == 200
    assert beat(serving_host.token, "1.0").status_code == 200
    assert Host.objects.get(pk=serving_host.host.pk).version == "1.0"


@pytest.mark.django_db
def test_the_pool_page_shows_the_versions_in_use(serving_host, outsider, settings) -> None:
    from django.contrib.auth import get_user_model

    beat(serving_host.token, "0.7.0")
    beat(outsider.token, "0.7.0")
    staff = get_user_model().objects.create_user(username="ops@example.com", password="x" * 12, is_staff=True)
    client = Client()
    client.force_login(staff)
    page = client.get("/pool/").content.decode()
    assert "0.7.0 × 2" in page and f"oldest served: {settings.MAHOUT_MIN_VERSION}" in page


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_real_mahout_older_than_the_gateway_wants_says_so_and_stops(catalog, tmp_path) -> None:
    gateway = Gateway(stack_env({"MAHOUT_MIN_VERSION": "99.0"}), tmp_path)
    try:
        host = make_host(qualified=False, name="old")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mahout",
                "run",
                "--server",
                gateway.url,
                "--home",
                str(tmp_path / "home"),
                "--threads",
                "1",
                "--no-idle-detect",
            ],
            cwd=ROOT,
            env={**stack_env(), "MAHOUT_TOKEN": host.token},
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        gateway.stop()
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"mahout {__version__} is older than 99.0" in done.stderr and "pip install --upgrade" in done.stderr


@pytest.mark.django_db
def test_the_pool_page_says_which_models_cannot_be_audited(catalog, settings) -> None:
    from django.contrib.auth import get_user_model

    from catalog.models import CatalogModel

    CatalogModel.objects.create(
        name="llama-3.1-8b",
        context_length=8192,
        input_price_ucents=1,
        output_price_ucents=2,
        tokenizer="gguf:vocab/x.gguf",
        weights_path="/nowhere/llama.gguf",
    )
    staff = get_user_model().objects.create_user(username="ops@example.com", password="x" * 12, is_staff=True)
    client = Client()
    client.force_login(staff)
    page = client.get("/pool/").content.decode()
    assert "not verifiable here (no weights on the gateway): llama-3.1-8b" in page
    assert "gemma-3-270m" not in page.split("not verifiable here")[1].split("</span>")[0]


@pytest.mark.django_db
@pytest.mark.parametrize("version", ["sim", None, "mahout"])  # ("": a 400, blank)
def test_a_version_that_does_not_parse_is_refused_outside_the_tests(
    serving_host, settings, version: str | None
) -> None:
    """No version (or one that is not a version) cannot be held to the minimum: refused as an old
    client is, or any host could skip the rule by not saying which mahout it runs."""
    settings.MAHOUT_UNVERSIONED_ALLOWED = (
        False  # as in production (the suite's synthetic hosts are let in: conftest.py)
    )
    body = {"fingerprint": FINGERPRINT} if version is None else {"fingerprint": FINGERPRINT, "version": version}
    refused = Client().post(
        "/hosts/api/heartbeat", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {serving_host.token}"
    )
    assert refused.status_code == 426 and refused.json()["error"]["code"] == "upgrade_required"
    assert "is not a version" in refused.json()["error"]["message"]
    assert Host.objects.get(pk=serving_host.host.pk).last_heartbeat_at is None, "a refused heartbeat is no sign of life"
    assert beat(serving_host.token, __version__).status_code == 200
