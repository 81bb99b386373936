"""Billing fixtures: Stripe configured against local test mode's stand-in (billing/stripe_local.py),
which speaks Stripe's wire format."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from billing.stripe_local import LocalStripe

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pytest_django import Settings

WEBHOOK_SECRET = "whsec_test_5f1b2c"
BACK = {
    "success_url": "http://testserver/?topup=success",
    "cancel_url": "http://testserver/?topup=cancelled",
}  # Checkout's return


@pytest.fixture(scope="session")
def fake_stripe_server() -> Iterator[LocalStripe]:
    fake = LocalStripe(secret_key="sk_test_local", webhook_secret=WEBHOOK_SECRET).start()
    yield fake
    fake.stop()


@pytest.fixture
def fake_stripe(fake_stripe_server: LocalStripe, settings: Settings) -> LocalStripe:
    """Stripe keys set and the client pointed at the local server (fresh records per test)."""
    fake_stripe_server.received.clear()
    fake_stripe_server.replays.clear()
    fake_stripe_server.refuse_transfers = False
    fake_stripe_server.webhook_url = ""
    settings.STRIPE_SECRET_KEY = "sk_test_local"
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.STRIPE_API_BASE = fake_stripe_server.url
    settings.STRIPE_MAX_RETRIES = 0
    return fake_stripe_server


@pytest.fixture
def no_stripe(settings: Settings) -> None:
    settings.STRIPE_SECRET_KEY = ""
    settings.STRIPE_WEBHOOK_SECRET = ""
    settings.STRIPE_API_BASE = ""
