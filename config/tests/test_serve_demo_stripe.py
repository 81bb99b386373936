"""`make run`'s Stripe: local test mode unless the operator set a real key."""

from __future__ import annotations

import os

import pytest

from config.management.commands.serve_demo import Command


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """serve_demo's environment (what its children inherit), this test's own."""
    env = {"PATH": "/usr/bin"}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_without_a_key_it_starts_the_stand_in_and_points_every_child_at_it(environ) -> None:
    argv = Command()._stripe_test_mode("python", "http://127.0.0.1:8091")
    assert argv[:3] == ["python", "manage.py", "stripe_local"]
    assert argv[3:] == ["--port", argv[4], "--webhook-url", "http://127.0.0.1:8091/billing/stripe/webhook/"]
    assert environ["STRIPE_API_BASE"] == f"http://127.0.0.1:{argv[4]}"
    assert environ["STRIPE_SECRET_KEY"].startswith("sk_test_local_") and environ["STRIPE_WEBHOOK_SECRET"].startswith(
        "whsec_local_"
    )
    first = environ.pop("STRIPE_SECRET_KEY")  # the next `make run`
    Command()._stripe_test_mode("python", "http://127.0.0.1:8091")
    assert environ["STRIPE_SECRET_KEY"] != first, "fresh keys each start"


def test_an_operator_who_sets_a_real_key_gets_real_stripe(environ) -> None:
    environ.update(STRIPE_SECRET_KEY="sk_live_operator", STRIPE_WEBHOOK_SECRET="whsec_operator")
    assert Command()._stripe_test_mode("python", "http://127.0.0.1:8000") is None
    assert "STRIPE_API_BASE" not in environ and environ["STRIPE_SECRET_KEY"] == "sk_live_operator"
