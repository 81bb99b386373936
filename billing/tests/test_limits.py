from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from accounts.models import ApiKey
from billing import errors, services
from billing.models import Hold
from conftest import make_customer

if TYPE_CHECKING:
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db


def limited(**limits: int) -> Customer:
    customer = make_customer(credit_ucents=1_000_000)
    ApiKey.objects.filter(pk=customer.key.pk).update(**limits)
    customer.key.refresh_from_db()
    return customer


class ConcurrentStreamLimitTests:
    def test_it_refuses_past_max_concurrent_until_a_hold_closes(self, catalog) -> None:
        customer = limited(max_concurrent=2)
        first = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)
        services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)
        with pytest.raises(errors.TooManyStreams) as refused:
            services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)
        assert (refused.value.code, refused.value.status) == ("too_many_streams", 429)
        services.hold_release(hold=first)
        services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)
        assert Hold.objects.filter(status="active").count() == 2


class RateLimitTests:
    def test_it_refuses_past_the_per_minute_rate_and_forgets_after_60_seconds(self, catalog) -> None:
        customer = limited(rate_limit_per_minute=3)
        for _ in range(3):
            services.hold_release(hold=services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10))
        with pytest.raises(errors.RateLimited) as refused:
            services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)
        assert (refused.value.code, refused.value.status) == ("rate_limited", 429)
        Hold.objects.update(created_at=timezone.now() - timedelta(seconds=61))
        services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)

    def test_it_leaves_unlimited_keys_alone(self, catalog) -> None:
        customer = make_customer(credit_ucents=1_000_000)
        assert (customer.key.max_concurrent, customer.key.rate_limit_per_minute) == (None, None)
        for _ in range(20):  # within one minute, none released: past any rate or concurrency limit
            services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=10)
        assert Hold.objects.filter(api_key=customer.key, status=Hold.Status.ACTIVE).count() == 20


class ErrorStatusTests:
    def test_it_declares_the_http_status_of_every_refusal_as_data(self) -> None:
        assert errors.InsufficientCredit.status == errors.KeyLimitExceeded.status == 402
        assert errors.RateLimited.status == errors.TooManyStreams.status == 429
