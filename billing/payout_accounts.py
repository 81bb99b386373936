"""A machine's payout account with Stripe Connect: onboarding → ready, decided by what
Stripe says of the account (on the owner's return, or by Connect's `account.updated`)."""

from __future__ import annotations

import stripe
from django.db import IntegrityError, transaction

from billing import stripe_api
from billing.errors import PaymentProviderError, PayoutRefused, PayoutsNotConfigured
from billing.models import PayoutProfile, StripeEvent
from hosts.models import Host


def payout_account_onboard(*, host: Host, return_url: str, refresh_url: str) -> str | None:
    """The owner's "Set up payouts": the machine's Stripe Connect account (created the first
    time) and a fresh onboarding link to send the owner to; None when the account is ready
    (already, or its onboarding finished since).

    Not one transaction: Stripe is called between the writes. Two clicks at once create one
    account (the same idempotency key; the second insert loses to the unique host and reads
    the winner's row). An account Stripe no longer knows (local test mode's, once its
    var/stripe-local.json is deleted) is replaced while the row is still onboarding.
    """
    if not stripe_api.payouts_configured():
        raise PayoutsNotConfigured(
            "Payouts are not configured on this gateway (no STRIPE_SECRET_KEY); ask an operator."
        )
    if Host.objects.filter(pk=host.pk, banned_at__isnull=False).exists():
        raise PayoutRefused("This machine is banned, so it cannot set up payouts.")
    profile = PayoutProfile.objects.filter(host=host).first()
    if profile is not None and profile.status == PayoutProfile.Status.READY:
        return None
    account = _connected_account(profile.stripe_account_id) if profile is not None else None
    if (
        profile is not None
        and account is not None
        and _payout_account_mark_ready(profile=profile, account=account.to_dict())
    ):
        return None
    if profile is None or account is None:
        profile = _payout_account_create(host=host, replacing=profile)
    try:
        link = stripe_api.account_link_create(
            account_id=profile.stripe_account_id, return_url=return_url, refresh_url=refresh_url
        )
    except stripe.StripeError as error:
        raise PaymentProviderError(f"Stripe could not start the payout setup: {error.user_message or error}") from None
    return link.url


def payout_account_refresh(*, host: Host) -> PayoutProfile | None:
    """Ask Stripe whether the machine's account finished onboarding and, if it did, mark it
    ready. The return URL calls this: arriving there proves nothing, the account Stripe
    describes does. None without an account."""
    profile = PayoutProfile.objects.filter(host=host).first()
    if profile is None or profile.status == PayoutProfile.Status.READY:
        return profile
    account = _connected_account(profile.stripe_account_id)
    if account is not None:
        _payout_account_mark_ready(profile=profile, account=account.to_dict())
        profile.refresh_from_db()
    return profile


def _connected_account(account_id: str) -> stripe.Account | None:
    """The account as Stripe describes it; None when Stripe does not know it."""
    try:
        return stripe_api.connected_account_retrieve(account_id)
    except stripe.InvalidRequestError:
        return None
    except stripe.StripeError as error:
        raise PaymentProviderError(
            f"Stripe could not be asked about the payout account: {error.user_message or error}"
        ) from None


def _payout_account_mark_ready(*, profile: PayoutProfile, account: dict) -> bool:
    """onboarding → ready, a compare-and-set, when Stripe says the account (its fields) can
    receive transfers; True when the profile is ready (by this call or a concurrent one)."""
    if not stripe_api.account_ready(account):
        return False
    PayoutProfile.objects.filter(
        pk=profile.pk, status=PayoutProfile.Status.ONBOARDING, stripe_account_id=account.get("id")
    ).update(status=PayoutProfile.Status.READY)
    return PayoutProfile.objects.filter(pk=profile.pk, status=PayoutProfile.Status.READY).exists()


def payout_account_updated(*, account: dict) -> tuple[str, None, str]:
    """Connect's `account.updated`: an account whose onboarding finished is marked ready by
    the same rule as the return URL's check (an owner who closed Stripe's tab before being
    sent back is ready too). The event's account is signed by Stripe, so it is not asked again."""
    account_id = account.get("id")
    profile = (
        PayoutProfile.objects.filter(stripe_account_id=account_id).first() if isinstance(account_id, str) else None
    )
    if profile is None:
        return StripeEvent.Outcome.IGNORED, None, f"no machine's payout account is {account_id!r}"
    if profile.status == PayoutProfile.Status.READY:
        return StripeEvent.Outcome.IGNORED, None, f"payout account {account_id} was already ready"
    if not _payout_account_mark_ready(profile=profile, account=account):
        return StripeEvent.Outcome.IGNORED, None, f"payout account {account_id} has not finished onboarding"
    return StripeEvent.Outcome.PAYOUT_READY, None, f"payout account {account_id} of host {profile.host_id} is ready"


def _payout_account_create(*, host: Host, replacing: PayoutProfile | None) -> PayoutProfile:
    attempt = replacing.stripe_account_id if replacing is not None else "first"
    try:
        account = stripe_api.connected_account_create(host_id=host.pk, email=host.owner.email, attempt=attempt)
    except stripe.StripeError as error:
        raise PaymentProviderError(f"Stripe could not create a payout account: {error.user_message or error}") from None
    if replacing is not None:
        PayoutProfile.objects.filter(
            pk=replacing.pk, status=PayoutProfile.Status.ONBOARDING, stripe_account_id=replacing.stripe_account_id
        ).update(stripe_account_id=account.id)
        return PayoutProfile.objects.get(pk=replacing.pk)
    try:
        with transaction.atomic():
            return PayoutProfile.objects.create(
                host=host, stripe_account_id=account.id, status=PayoutProfile.Status.ONBOARDING
            )
    except IntegrityError:  # the other click's row (the same account: the same idempotency key)
        return PayoutProfile.objects.get(host=host)
