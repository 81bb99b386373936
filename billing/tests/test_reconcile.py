from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from billing import ledger, selectors, services, tasks
from billing.models import Account, Hold
from conftest import make_customer
from marketplace.models import Request
from testkit.requests import submit_request

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db


def submit(customer: Customer, catalog: CatalogModel) -> Request:
    return submit_request(customer, catalog, max_tokens=10, prompt_tokens=4)


class ReconcileCommandTests:
    def test_it_passes_on_straight_books(self, catalog, capsys) -> None:
        submit(make_customer(), catalog)
        call_command("reconcile")
        assert "reconcile: ok" in capsys.readouterr().out

    def test_it_fails_with_a_readable_report_on_a_drifted_cache(self, catalog, capsys) -> None:
        customer = make_customer(credit_ucents=1_000)
        Account.objects.filter(user=customer.user).update(balance_ucents=1_001)
        with pytest.raises(CommandError, match="1 problem"):
            call_command("reconcile")
        assert "cached balance 1001 != ledger 1000" in capsys.readouterr().err

    def test_it_reports_then_releases_an_orphaned_hold(self, catalog, capsys) -> None:
        customer = make_customer()
        request = submit(customer, catalog)
        Request.objects.filter(pk=request.pk).update(status=Request.Status.FAILED)  # as if the hold were forgotten
        with pytest.raises(CommandError):
            call_command("reconcile")
        assert f"hold {request.hold_id}: still active" in capsys.readouterr().err
        call_command("reconcile", "--release-orphans")
        assert Hold.objects.get(pk=request.hold_id).status == Hold.Status.RELEASED
        assert selectors.customer_account(user=customer.user).held_ucents == 0

    def test_it_reports_top_up_credit_without_a_webhook_event(self, catalog) -> None:
        from billing.models import LedgerTransaction

        customer = make_customer(credit_ucents=0)
        ledger.ledger_post(
            kind=LedgerTransaction.Kind.TOPUP,
            reference="cs_forged",
            memo="",
            legs=[
                (services.system_account(Account.Kind.FUNDING), -5),
                (services.account_for_customer(user=customer.user), 5),
            ],
        )
        assert any(problem.startswith("Stripe:") for problem in selectors.reconcile_report())


class ReconcileTaskTests:
    def test_it_releases_holds_whose_request_ended_and_reports_clean_books(self, catalog) -> None:
        customer = make_customer()
        orphans = [submit(customer, catalog) for _ in range(3)]
        Request.objects.filter(pk__in=[r.pk for r in orphans]).update(status=Request.Status.COMPLETED)
        live = submit(customer, catalog)
        assert tasks.reconcile_tick() == 0
        assert Hold.objects.filter(status=Hold.Status.RELEASED).count() == 3
        assert Hold.objects.get(pk=live.hold_id).status == Hold.Status.ACTIVE
        assert selectors.customer_account(user=customer.user).held_ucents == live.estimate_ucents
