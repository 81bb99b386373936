"""Host payouts, requested → sending → paid | failed, each step a compare-and-set on the
payout and a ledger transaction; and the forfeit of a cheat's unvested earnings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import stripe
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import selectors, stripe_api
from billing.errors import InvalidAmount, PaymentProviderError, PayoutRefused
from billing.ledger import account_for_host, ledger_post, system_account
from billing.models import Account, LedgerTransaction, Payout, PayoutProfile
from catalog.money import UCENTS_PER_CENT, usd
from hosts.models import Host

if TYPE_CHECKING:
    from django.contrib.auth.models import User


@transaction.atomic
def payout_request(*, host: Host, amount_ucents: int | None = None) -> Payout:
    """Phase 1: move earnings (all available whole cents by default) to payouts-pending.

    Under the host account's row lock, so two requests cannot withdraw the same
    earnings. Refused for a banned host (what it earned waits for an operator), below
    PAYOUT_MINIMUM_UCENTS, above what is available, in fractions of a cent, or without a
    connected account to send to.
    """
    if Host.objects.filter(pk=host.pk, banned_at__isnull=False).exists():  # (read now: the caller's row may be stale)
        raise PayoutRefused(
            "This machine is banned, so it cannot request payouts; an operator decides what happens "
            "to its earnings. Write to support if you think the ban is a mistake."
        )
    profile = PayoutProfile.objects.filter(host=host).first()
    if profile is None or not profile.stripe_account_id:
        raise PayoutRefused(
            "This machine has no payout account yet: press \"Set up payouts\" on its page "
            "(My machines, then the machine) to connect one with Stripe."
        )
    if profile.status != PayoutProfile.Status.READY:
        raise PayoutRefused(
            f"This machine's payout account ({profile.stripe_account_id}) has not finished Stripe's "
            "onboarding: press \"Set up payouts\" on the machine's page to continue it."
        )
    account = Account.objects.select_for_update().get(pk=account_for_host(host=host).pk)
    available = selectors.host_payable_ucents(account=account)
    amount = available // UCENTS_PER_CENT * UCENTS_PER_CENT if amount_ucents is None else amount_ucents
    if amount % UCENTS_PER_CENT:
        raise InvalidAmount("A payout must be a whole number of cents (multiples of 1,000,000 µ¢).")
    if amount_ucents is None and amount < settings.PAYOUT_MINIMUM_UCENTS:
        raise PayoutRefused(_below_minimum(account=account, payable_ucents=amount))
    if amount < settings.PAYOUT_MINIMUM_UCENTS:
        raise PayoutRefused(
            f"The minimum payout is {usd(settings.PAYOUT_MINIMUM_UCENTS)}; this request is {usd(amount)}."
        )
    if amount > available:
        unvested = selectors.host_unvested_ucents(account=account)
        later = (
            f" ({usd(unvested)} more vests within {settings.EARNINGS_VEST_SECONDS / 86400:g} days of being earned)"
            if unvested
            else ""
        )
        raise PayoutRefused(f"Only {usd(available)} is available to withdraw{later}.")
    payout = Payout.objects.create(host=host, amount_ucents=amount, destination=profile.stripe_account_id)
    ledger_post(
        kind=LedgerTransaction.Kind.PAYOUT_REQUEST,
        reference=f"payout-{payout.pk}",
        memo=f"payout {payout.pk} requested",
        legs=[(account, -amount), (system_account(Account.Kind.PAYOUTS_PENDING), amount)],
    )
    return payout


def _below_minimum(*, account: Account, payable_ucents: int) -> str:
    """Why "withdraw everything" is refused: what is payable, what is still vesting, and
    when the minimum payout becomes payable (or when all of it has vested)."""
    minimum = settings.PAYOUT_MINIMUM_UCENTS
    schedule = selectors.host_vesting_schedule(account=account)
    if not schedule:
        return (
            f"There is {usd(payable_ucents)} to withdraw and the "
            f"minimum payout is {usd(minimum)}; nothing more is vesting."
        )
    vesting = sum(amount for _, amount in schedule)
    payable, reaches = payable_ucents, None
    for moment, amount in schedule:
        payable += amount
        if payable // UCENTS_PER_CENT * UCENTS_PER_CENT >= minimum:
            reaches = moment
            break
    when = (
        f"the minimum is payable from {_utc_minute(reaches)}"
        if reaches is not None
        else f"all of it has vested by {_utc_minute(schedule[-1][0])}, {usd(payable)} in all, still below the minimum"
    )
    return (
        f"{usd(vesting)} of this machine's earnings is still vesting (earnings become payable "
        f"{settings.EARNINGS_VEST_SECONDS / 86400:g} days after each job) and {usd(payable_ucents)} is payable now, "
        f"below the minimum payout of {usd(minimum)}: {when}."
    )


def _utc_minute(moment: datetime) -> str:
    """A moment as "2026-12-10 14:03 UTC", rounded up to the minute (never before it happens)."""
    rounded = (moment + timedelta(seconds=59, microseconds=999_999)).astimezone(UTC)
    return rounded.strftime("%Y-%m-%d %H:%M UTC")


@transaction.atomic
def earnings_forfeit(*, host: Host, reason: str) -> int:
    """A host caught cheating forfeits what has not vested to the platform: one ledger
    transaction whose memo is the reason. Returns the amount (0: nothing unvested)."""
    account = Account.objects.select_for_update().filter(kind=Account.Kind.HOST, host=host).first()
    if account is None:
        return 0
    amount = selectors.host_unvested_ucents(account=account)
    if amount <= 0:
        return 0
    ledger_post(
        kind=LedgerTransaction.Kind.FORFEIT,
        reference=f"forfeit-{host.pk}-{timezone.now().timestamp():.6f}",
        memo=reason[:255],
        legs=[(account, -amount), (system_account(Account.Kind.PLATFORM), amount)],
    )
    return amount


def payout_approve(*, payout_id: int, operator: User | None = None) -> Payout:
    """Phase 2 (an operator approved): send the Stripe Transfer, then post or void.

    The requested → sending compare-and-set commits before Stripe is called. A
    definite refusal from Stripe voids the payout (earnings return to the host);
    an unknown outcome (timeout, 5xx) leaves it `sending` and raises, and
    approving it again re-sends with the same idempotency key, which Stripe
    answers with the original transfer, so a host is never paid twice.
    """
    if not stripe_api.payouts_configured():
        raise PaymentProviderError("Payouts are not configured on this gateway (no STRIPE_SECRET_KEY).")
    claimed = Payout.objects.filter(pk=payout_id, status__in=[Payout.Status.REQUESTED, Payout.Status.SENDING]).update(
        status=Payout.Status.SENDING, approved_by=operator
    )
    payout = Payout.objects.get(pk=payout_id)
    if not claimed:
        raise PayoutRefused(f"Payout {payout_id} is already {payout.status}.")
    try:
        transfer = stripe_api.transfer_create(
            payout_id=payout.pk,
            amount_cents=payout.amount_cents,
            currency=settings.BILLING_CURRENCY,
            destination=payout.destination,
        )
    except (stripe.InvalidRequestError, stripe.CardError, stripe.PermissionError) as refusal:
        payout_void(
            payout_id=payout.pk,
            reason=f"Stripe refused the transfer: {refusal.user_message or refusal}",
            refused_by_stripe=True,
        )
    except stripe.StripeError as error:
        raise PaymentProviderError(
            f"Payout {payout.pk} outcome unknown, still sending; approve again to retry: {error}"
        ) from None
    else:
        payout_post(payout_id=payout.pk, transfer_id=transfer.id)
    payout.refresh_from_db()
    return payout


@transaction.atomic
def payout_post(*, payout_id: int, transfer_id: str) -> bool:
    """The transfer went out: pending → outside money. False if already decided."""
    if not Payout.objects.filter(pk=payout_id, status=Payout.Status.SENDING).update(
        status=Payout.Status.PAID, stripe_transfer_id=transfer_id, decided_at=timezone.now()
    ):
        return False
    payout = Payout.objects.get(pk=payout_id)
    ledger_post(
        kind=LedgerTransaction.Kind.PAYOUT_SENT,
        reference=f"payout-{payout.pk}",
        memo=f"Stripe transfer {transfer_id}",
        legs=[
            (system_account(Account.Kind.PAYOUTS_PENDING), -payout.amount_ucents),
            (system_account(Account.Kind.FUNDING), payout.amount_ucents),
        ],
    )
    return True


@transaction.atomic
def payout_void(*, payout_id: int, reason: str, refused_by_stripe: bool = False) -> bool:
    """The payout will not be sent: a reverse entry gives the earnings back. False if
    already decided, or if it may be on its way.

    An operator rejects only a payout still `requested`: once approval has moved it to
    `sending`, a transfer may be in flight (or sent, its answer lost), so voiding it then
    could pay the host twice; it stays `sending` until approving again learns the outcome.
    Only Stripe's definite refusal of the transfer (`refused_by_stripe`) voids a `sending` one."""
    voidable = Payout.Status.SENDING if refused_by_stripe else Payout.Status.REQUESTED
    if not Payout.objects.filter(pk=payout_id, status=voidable).update(
        status=Payout.Status.FAILED, failure_reason=reason[:500], decided_at=timezone.now()
    ):
        return False
    payout = Payout.objects.get(pk=payout_id)
    ledger_post(
        kind=LedgerTransaction.Kind.PAYOUT_VOID,
        reference=f"payout-{payout.pk}",
        memo=reason[:255],
        legs=[  # the host account first, as payout_request locks them
            (account_for_host(host=payout.host), payout.amount_ucents),
            (system_account(Account.Kind.PAYOUTS_PENDING), -payout.amount_ucents),
        ],
    )
    return True
