"""Money under real concurrency: real transactions, one connection per thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest
from django.db import connection

from accounts.models import ApiKey
from billing import selectors
from billing.errors import BillingError
from billing.models import Account, LedgerTransaction
from conftest import make_customer, make_host
from marketplace import services as market
from marketplace.models import Request
from testkit.evidence import drawn
from testkit.requests import submit_request

if TYPE_CHECKING:
    from collections.abc import Callable

    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(transaction=True)


def race(fn: Callable[[int], str], attempts: int) -> list[str]:
    def one(index: int) -> str:
        try:
            return fn(index)
        except BillingError as refusal:
            return refusal.code
        except market.JobNotRunning:
            return "not_running"
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=40) as pool:
        return list(pool.map(one, range(attempts)))


def admit(customer: Customer, catalog: CatalogModel) -> Callable[[int], str]:
    def submit(index: int) -> str:
        submit_request(customer, catalog, public_id=f"chatcmpl-bill-{index}", max_tokens=100)
        return "admitted"

    return submit


class ConcurrentAdmissionTests:
    def test_it_admits_exactly_100_of_1000_racing_requests_when_credit_covers_100(self, catalog) -> None:
        estimate = market.estimate_ucents(model=catalog, prompt_tokens=10, max_tokens=100)
        customer = make_customer(credit_ucents=estimate * 100 + estimate - 1)
        outcomes = race(admit(customer, catalog), 1_000)
        assert outcomes.count("admitted") == 100
        assert outcomes.count("insufficient_credit") == 900
        account = selectors.customer_account(user=customer.user)
        assert (account.held_ucents, account.available_ucents) == (estimate * 100, estimate - 1)
        assert Request.objects.count() == 100
        assert selectors.reconcile_report() == []

    def test_it_admits_exactly_50_of_500_against_a_key_cap_worth_50(self, catalog) -> None:
        estimate = market.estimate_ucents(model=catalog, prompt_tokens=10, max_tokens=100)
        customer = make_customer(credit_ucents=estimate * 1_000, cap_ucents=estimate * 50)
        outcomes = race(admit(customer, catalog), 500)
        assert outcomes.count("admitted") == 50
        assert outcomes.count("key_limit_exceeded") == 450
        key = ApiKey.objects.get(pk=customer.key.pk)
        assert key.held_ucents == estimate * 50
        assert selectors.reconcile_report() == []

    def test_it_admits_exactly_max_concurrent_of_racing_requests(self, catalog) -> None:
        customer = make_customer(credit_ucents=10**12)
        ApiKey.objects.filter(pk=customer.key.pk).update(max_concurrent=7)
        outcomes = race(admit(customer, catalog), 120)
        assert outcomes.count("admitted") == 7 and outcomes.count("too_many_streams") == 113


class ConcurrentSettlementTests:
    def test_50_racing_settlements_of_one_request_post_once(self, catalog) -> None:
        customer = make_customer(credit_ucents=10**10)
        serving = make_host()
        admit(customer, catalog)(0)
        request = Request.objects.get()
        job = market.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
        market.job_push_tokens(host=serving.host, job_id=job.pk, seq=0, text="Hello, world")
        connection.close()

        def settle(_: int) -> str:
            market.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
            return "settled"

        outcomes = race(settle, 50)
        assert set(outcomes) <= {"settled", "not_running"}
        assert LedgerTransaction.objects.filter(kind="settlement", reference=request.public_id).count() == 1
        request.refresh_from_db()
        customer_account = selectors.customer_account(user=customer.user)
        assert customer_account.balance_ucents == 10**10 - request.cost_ucents
        assert customer_account.held_ucents == 0
        host_balance = selectors.host_account(host=serving.host).balance_ucents
        assert host_balance == request.cost_ucents * 80 // 100
        platform = Account.objects.get(kind="platform").balance_ucents
        assert host_balance + platform == request.cost_ucents
        assert selectors.reconcile_report() == []
