"""Web fixtures: the shared personas signed in through a session, plus billing's Stripe fakes."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from billing.tests.conftest import fake_stripe, fake_stripe_server, no_stripe  # noqa: F401
from conftest import Customer, ServingHost

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def customer_client(customer: Customer) -> Client:
    return signed_in(customer.user)


@pytest.fixture
def host_client(serving_host: ServingHost) -> Client:
    return signed_in(serving_host.host.owner)


@pytest.fixture
def outsider_client(outsider: ServingHost) -> Client:
    """Signed in as the outsider persona: owns a host of its own and a customer account of nothing."""
    return signed_in(outsider.host.owner)


@pytest.fixture
def staff_client(db: None) -> Client:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create(username=f"op-{uuid.uuid4().hex[:6]}@example.com", is_staff=True)
    return signed_in(user)
