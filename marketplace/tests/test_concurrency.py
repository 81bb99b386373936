"""Admission under real concurrency (real transactions, one connection per thread)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest
from django.db import connection

from billing import selectors as ledger
from billing.errors import BillingError
from conftest import make_customer
from marketplace import services
from marketplace.models import Job, Request
from testkit.requests import submit_request

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(transaction=True)


def admit_all(customer: Customer, catalog: CatalogModel, attempts: int) -> list[str]:
    def one(index: int) -> str:
        try:
            submit_request(customer, catalog, public_id=f"chatcmpl-race-{index}", max_tokens=100)
            return "admitted"
        except BillingError as refusal:
            return refusal.code
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=40) as pool:
        return list(pool.map(one, range(attempts)))


class ConcurrentAdmissionTests:
    def test_200_racing_requests_never_admit_more_than_the_balance_covers(self, catalog) -> None:
        estimate = services.estimate_ucents(model=catalog, prompt_tokens=10, max_tokens=100)
        customer = make_customer(credit_ucents=estimate * 20 + estimate // 2)
        outcomes = admit_all(customer, catalog, 200)
        assert outcomes.count("admitted") == 20
        assert outcomes.count("insufficient_credit") == 180
        assert Request.objects.count() == Job.objects.count() == 20
        account = ledger.customer_account(user=customer.user)
        assert account.available_ucents == estimate // 2 and account.available_ucents >= 0
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []

    def test_racing_requests_respect_the_key_cap(self, catalog) -> None:
        estimate = services.estimate_ucents(model=catalog, prompt_tokens=10, max_tokens=100)
        customer = make_customer(cap_ucents=estimate * 5)
        outcomes = admit_all(customer, catalog, 60)
        assert outcomes.count("admitted") == 5 and outcomes.count("key_limit_exceeded") == 55
        customer.key.refresh_from_db()
        assert customer.key.held_ucents == estimate * 5


class ConcurrentClaimTests:
    def test_one_hosts_racing_claims_never_pass_its_cap(self, catalog, settings) -> None:
        """A host in probation runs at most HOST_PROBATION_MAX_JOBS jobs, however many of its
        claims race (each claim counts the host's running jobs; its row serialises them)."""
        from conftest import make_host
        from hosts.models import Host

        settings.HOST_PROBATION_MAX_JOBS = 3
        customer = make_customer()
        admit_all(customer, catalog, 24)
        serving = make_host()
        Host.objects.filter(pk=serving.host.pk).update(slots=50)
        host = Host.objects.get(pk=serving.host.pk)

        def claim(_: int) -> bool:
            try:
                return services.job_claim_next(host=host, fingerprint=serving.fingerprint) is not None
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=24) as pool:
            won = sum(pool.map(claim, range(24)))
        assert won == 3
        assert Job.objects.filter(host=host, status=Job.Status.RUNNING).count() == 3
