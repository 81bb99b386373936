"""`DJANGO_ENV=production` (issue 17): refuses to start unsafe, and with real settings
`manage.py check --deploy --fail-level WARNING` finds nothing; behind a TLS proxy the
gateway knows requests are HTTPS, and plain HTTP is redirected."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from conftest import ROOT


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DJANGO_SECRET_KEY", "ALLOWED_HOSTS", "DJANGO_DEBUG", "DJANGO_ENV")
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def production() -> dict[str, str]:
    return {
        "DJANGO_ENV": "production",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "ALLOWED_HOSTS": "gateway.example",
    }


class ProductionSettingsTests:
    def test_check_deploy_finds_nothing(self, production) -> None:
        result = manage("check", "--deploy", "--fail-level", "WARNING", **production)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "System check identified no issues" in result.stdout
        assert "EMAIL_BACKEND" in result.stderr, "mail still going to the console is said loudly"

    @pytest.mark.parametrize(
        ("missing", "says"),
        [
            ("DJANGO_SECRET_KEY", "needs DJANGO_SECRET_KEY"),
            ("ALLOWED_HOSTS", "needs ALLOWED_HOSTS"),
        ],
    )
    def test_it_refuses_to_start_without(self, production, missing, says) -> None:
        result = manage("check", **{k: v for k, v in production.items() if k != missing})
        assert result.returncode != 0 and says in result.stderr

    def test_it_refuses_the_development_key_and_debug(self, production) -> None:
        from django.conf import settings

        assert manage("check", **{**production, "DJANGO_SECRET_KEY": settings.DEVELOPMENT_SECRET_KEY}).returncode != 0
        assert "never runs with DJANGO_DEBUG" in manage("check", **production, DJANGO_DEBUG="1").stderr

    def test_behind_a_tls_proxy_requests_are_https_and_plain_http_is_redirected(self, production) -> None:
        script = (
            "from django.test import Client; c = Client(); "
            "plain = c.get('/login/', HTTP_HOST='gateway.example'); "
            "proxied = c.get('/login/', HTTP_HOST='gateway.example', HTTP_X_FORWARDED_PROTO='https'); "
            "health = c.get('/v1/models', HTTP_HOST='gateway.example'); "
            "healthz = c.get('/healthz', HTTP_HOST='gateway.example'); "
            "print('|'.join(map(str, [plain.status_code, plain.get('Location'), proxied.status_code, "
            "proxied.get('Strict-Transport-Security'), health.status_code, healthz.status_code])))"
        )
        result = manage("shell", "-c", script, **production)
        assert result.returncode == 0, result.stderr
        plain, location, proxied, hsts, health, healthz = result.stdout.strip().splitlines()[-1].split("|")
        assert (plain, location) == ("301", "https://gateway.example/login/")
        assert proxied == "200" and hsts == "max-age=31536000; includeSubDomains; preload"
        assert health == "401", "a balancer's health check on /v1/models is answered over plain HTTP"
        assert healthz == "200", "and so is HAProxy's, on /healthz"
