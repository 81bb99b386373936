"""Billing fixtures: Stripe configured against a local server that speaks its format."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from billing.tests.stripe_fake import FakeStripe

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pytest_django import Settings

WEBHOOK_SECRET = "whsec_test_5f1b2c"


@pytest.fixture(scope="session")
def fake_stripe_server() -> Iterator[FakeStripe]:
    fake = FakeStripe().start()
    yield fake
    fake.stop()


@pytest.fixture
def fake_stripe(fake_stripe_server: FakeStripe, settings: Settings) -> FakeStripe:
    """Stripe keys set and the client pointed at the local server (fresh records per test)."""
    fake_stripe_server.received.clear()
    fake_stripe_server.transfers_by_key.clear()
    fake_stripe_server.refuse_transfers = False
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
