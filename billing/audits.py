"""The money of audits: a job's host share waits in the audit escrow until its audit passes
(`audit_release`) or fails (`audit_refund`); a trusted scorer is paid its fee."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import IntegrityError, transaction

from billing.ledger import account_for_customer, account_for_host, ledger_post, system_account
from billing.models import Account, LedgerTransaction
from hosts.models import Host

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def audit_release(*, host: Host, amount_ucents: int, reference: str, memo: str = "") -> bool:
    """An audit passed: the host's share of its job, held in escrow since settlement, is
    paid to the host (it then vests like any earnings). Idempotent by `reference`;
    False when it was already released."""
    if amount_ucents < 0:
        raise ValueError(f"negative release {amount_ucents}")
    escrow = system_account(Account.Kind.AUDIT_ESCROW)
    try:
        with transaction.atomic():
            ledger_post(
                kind=LedgerTransaction.Kind.AUDIT_RELEASE,
                reference=reference,
                memo=memo,
                legs=[(escrow, -amount_ucents), (account_for_host(host=host), amount_ucents)],
            )
    except IntegrityError:
        return False
    return True


def audit_refund(*, user: User, host_ucents: int, platform_ucents: int, reference: str, memo: str = "") -> bool:
    """An audit failed: the customer gets back what the job cost, the host's share out of
    the escrow and the platform's out of its revenue. Idempotent by `reference`; False
    when it was already refunded."""
    if host_ucents < 0 or platform_ucents < 0:
        raise ValueError(f"negative refund {host_ucents} + {platform_ucents}")
    try:
        with transaction.atomic():
            ledger_post(
                kind=LedgerTransaction.Kind.AUDIT_REFUND,
                reference=reference,
                memo=memo,
                legs=[
                    (system_account(Account.Kind.AUDIT_ESCROW), -host_ucents),
                    (system_account(Account.Kind.PLATFORM), -platform_ucents),
                    (account_for_customer(user=user), host_ucents + platform_ucents),
                ],
            )
    except IntegrityError:
        return False
    return True


@transaction.atomic
def audit_score_pay(*, host: Host, amount_ucents: int, reference: str, memo: str = "") -> int:
    """A trusted host scored an audit: its fee for the prefill, out of the platform's revenue
    (the caller bounds it by the audited job's platform share). Never more than the platform
    holds, so a failed audit whose refund took the platform's share back cannot drive its
    balance negative. Idempotent by `reference`. Returns what was paid."""
    if amount_ucents < 0:
        raise ValueError(f"negative fee {amount_ucents}")
    platform = Account.objects.select_for_update().get(pk=system_account(Account.Kind.PLATFORM).pk)
    amount = min(amount_ucents, max(platform.available_ucents, 0))
    if amount <= 0:
        return 0
    try:
        with transaction.atomic():
            ledger_post(
                kind=LedgerTransaction.Kind.AUDIT_SCORE,
                reference=reference,
                memo=memo,
                legs=[(platform, -amount), (account_for_host(host=host), amount)],
            )
    except IntegrityError:
        return 0
    return amount
