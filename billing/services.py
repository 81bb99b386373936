"""Writes to the ledger. Every function runs in (or opens) one transaction and
takes row locks in a fixed order — customer account, then API key — so
concurrent admissions and settlements serialise instead of overspending."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import stripe
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from accounts.models import ApiKey
from billing import selectors, stripe_api
from billing.errors import (
    InsufficientCredit,
    InvalidAmount,
    InvalidWebhook,
    KeyLimitExceeded,
    PaymentProviderError,
    PayoutRefused,
    PayoutsNotConfigured,
    RateLimited,
    TooManyStreams,
    TopupsNotConfigured,
)
from billing.models import (
    Account,
    Hold,
    LedgerEntry,
    LedgerTransaction,
    Payout,
    PayoutProfile,
    StripeEvent,
    TopUp,
)
from catalog.money import UCENTS_PER_CENT, usd
from core.db import Step, insert_step
from hosts.models import Host

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def account_for_customer(*, user: User) -> Account:
    return _get_or_create_account(kind=Account.Kind.CUSTOMER, user=user)


def account_for_host(*, host: Host) -> Account:
    return _get_or_create_account(kind=Account.Kind.HOST, host=host)


def system_account(kind: str) -> Account:
    return _get_or_create_account(kind=kind)


def _get_or_create_account(**lookup: object) -> Account:
    """One SELECT on the hot path; the savepoint and insert only the first time."""
    account = Account.objects.filter(**lookup).first()
    if account is not None:
        return account
    try:
        with transaction.atomic():
            account, _ = Account.objects.get_or_create(**lookup)
            return account
    except IntegrityError:  # created concurrently by someone else: theirs is as good
        return Account.objects.get(**lookup)


def _post(*, kind: str, reference: str, memo: str, legs: list[tuple[Account, int]]) -> LedgerTransaction:
    """Append one balanced transaction and its entries, and move the cached balances with it."""
    if sum(amount for _, amount in legs) != 0:
        raise ValueError(f"unbalanced transaction {kind}:{reference}: {legs}")
    txn = LedgerTransaction.objects.create(kind=kind, reference=reference, memo=memo)
    LedgerEntry.objects.bulk_create(
        [LedgerEntry(transaction=txn, account_id=account.pk, amount_ucents=amount) for account, amount in legs if amount]
    )
    for account, amount in legs:
        if amount:
            Account.objects.filter(pk=account.pk).update(balance_ucents=F("balance_ucents") + amount)
    return txn


@transaction.atomic
def credit_grant(*, user: User, amount_ucents: int, reference: str, memo: str = "") -> LedgerTransaction:
    """Give a customer credit from outside money (operator grant or demo seed)."""
    if amount_ucents <= 0:
        raise ValueError("a grant must be a positive amount")
    customer = account_for_customer(user=user)
    funding = system_account(Account.Kind.FUNDING)
    return _post(
        kind=LedgerTransaction.Kind.GRANT,
        reference=reference,
        memo=memo,
        legs=[(funding, -amount_ucents), (customer, amount_ucents)],
    )


def hold_place(*, user: User, api_key: ApiKey, amount_ucents: int) -> Hold:
    """Reserve `amount_ucents` against the balance and the key's cap, or refuse.

    Must run inside the caller's transaction (the request row is created in the
    same one). Locks the account, then the key; the key's limits are counted
    under the key's lock, so racing admissions cannot both take the last slot.
    Raises TooManyStreams / RateLimited (429), InsufficientCredit /
    KeyLimitExceeded (402).
    """
    account = Account.objects.select_for_update().filter(kind=Account.Kind.CUSTOMER, user=user).first()
    if account is None:  # the first request of a customer without an account yet
        account = Account.objects.select_for_update().get(pk=account_for_customer(user=user).pk)
    key = ApiKey.objects.select_for_update().get(pk=api_key.pk)
    _key_limits_check(key=key)
    if account.available_ucents < amount_ucents:
        raise InsufficientCredit(
            f"This request may cost up to {usd(amount_ucents)} but the available credit is "
            f"{usd(max(account.available_ucents, 0))}. Top up, or lower max_tokens."
        )
    if key.spend_cap_ucents is not None and key.spent_ucents + key.held_ucents + amount_ucents > key.spend_cap_ucents:
        left = key.spend_cap_ucents - key.spent_ucents - key.held_ucents
        raise KeyLimitExceeded(
            f"This request may cost up to {usd(amount_ucents)} but this API key's spend cap leaves "
            f"{usd(max(left, 0))}. Raise the key's cap or use another key."
        )
    Account.objects.filter(pk=account.pk).update(held_ucents=F("held_ucents") + amount_ucents)
    ApiKey.objects.filter(pk=key.pk).update(held_ucents=F("held_ucents") + amount_ucents)
    return Hold.objects.create(account=account, api_key=key, amount_ucents=amount_ucents)


def hold_steps(*, user_id: int, api_key: ApiKey, amount_ucents: int) -> list[Step] | None:
    """`hold_place` as compare-and-set steps of a statement chain (`core.db.chain_run`),
    for a key with no concurrency or rate limit (those are counted under the key's lock:
    `hold_place`); None for a key that has one. The steps are named `account`, `api_key`
    and `hold`; the account and key rows are locked in the usual order by their UPDATEs,
    each of which refuses (no row) where `hold_place` would raise. On a miss the caller
    rolls back and asks `hold_place`, which says why."""
    if api_key.max_concurrent is not None or api_key.rate_limit_per_minute is not None:
        return None
    quote = connection.ops.quote_name
    account_table, key_table = quote(Account._meta.db_table), quote(ApiKey._meta.db_table)
    account = Step(
        "account",
        f"UPDATE {account_table} SET held_ucents = held_ucents + %s"
        " WHERE kind = %s AND user_id = %s AND balance_ucents - held_ucents >= %s RETURNING id",
        [amount_ucents, Account.Kind.CUSTOMER, user_id, amount_ucents],
    )
    key = Step(
        "api_key",
        f"UPDATE {key_table} SET held_ucents = held_ucents + %s WHERE id = %s AND max_concurrent IS NULL"
        " AND rate_limit_per_minute IS NULL"
        " AND (spend_cap_ucents IS NULL OR spent_ucents + held_ucents + %s <= spend_cap_ucents) RETURNING id",
        [amount_ucents, api_key.pk, amount_ucents],
    )
    hold = insert_step("hold", Hold(amount_ucents=amount_ucents), refs={"account_id": "account", "api_key_id": "api_key"})
    return [account, key, hold]


def _key_limits_check(*, key: ApiKey) -> None:
    """Refuse when the key has `max_concurrent` active holds, or has placed
    `rate_limit_per_minute` holds in the last 60 s. Caller holds the key's row lock."""
    if key.max_concurrent is not None:
        active = Hold.objects.filter(api_key=key, status=Hold.Status.ACTIVE).count()
        if active >= key.max_concurrent:
            raise TooManyStreams(
                f"This API key already has {active} requests in flight; its limit is {key.max_concurrent}. "
                "Wait for one to finish."
            )
    if key.rate_limit_per_minute is not None:
        headers = selectors.rate_headers(key=key)
        if headers["x-ratelimit-remaining-requests"] == "0":
            refusal = RateLimited(
                f"This API key is limited to {key.rate_limit_per_minute} requests per minute. "
                f"Retry in {headers['x-ratelimit-reset-requests']}."
            )
            refusal.retry_after = max(int(headers["x-ratelimit-reset-requests"][:-1]), 1)
            refusal.headers = headers
            raise refusal


@transaction.atomic
def hold_release(*, hold: Hold) -> bool:
    """Give the reserved credit back (request failed or expired): a compare-and-set from
    active, so it is idempotent; False if the hold was already closed."""
    closed = Hold.objects.filter(pk=hold.pk, status=Hold.Status.ACTIVE).update(
        status=Hold.Status.RELEASED, closed_at=timezone.now()
    )
    if not closed:
        return False
    Account.objects.filter(pk=hold.account_id).update(held_ucents=F("held_ucents") - hold.amount_ucents)
    ApiKey.objects.filter(pk=hold.api_key_id).update(held_ucents=F("held_ucents") - hold.amount_ucents)
    return True


@dataclass(frozen=True)
class Settlement:
    cost_ucents: int
    host_ucents: int
    platform_ucents: int


def split_cost(cost_ucents: int) -> Settlement:
    """The host gets floor(80%); the platform keeps the remainder, so no µ¢ is lost.
    The one place the host's share is computed (a continuation's host too)."""
    host = cost_ucents * settings.HOST_SHARE_PERCENT // 100
    return Settlement(cost_ucents=cost_ucents, host_ucents=host, platform_ucents=cost_ucents - host)


def split_by_layers(host_ucents: int, layers: Mapping[int, int]) -> dict[int, int]:
    """A ring's host share among its hosts (host id → layers it ran): floor(share × layers /
    all layers) each; what the floors leave is the platform's (so no µ¢ is invented)."""
    total = sum(layers.values())
    if total <= 0:
        raise ValueError("a ring runs at least one layer")
    return {host_id: host_ucents * count // total for host_id, count in layers.items()}


@transaction.atomic(savepoint=False)  # always inside the caller's transaction; one fewer round trip pair
def hold_settle(
    *, hold: Hold, cost_ucents: int, host: Host | None, reference: str, host_ucents: int | None = None,
    others: Mapping[int, int] | None = None, memo: str = "", escrow: bool = False,
) -> Settlement | None:
    """Charge the actual cost against a hold, exactly once.

    The host earns `host_ucents` (default floor(80%) of the cost; never more);
    with no host (nobody finished the work) the platform keeps everything.
    `others` (host id → µ¢: a ring's stage hosts, `split_by_layers`) are paid out
    of the same share: `host_ucents` and theirs together never exceed it, and the
    platform keeps the rest. Returns None when the hold was already settled or
    released (someone else got there first). The cost can never exceed what was held.
    With `escrow`, the hosts' shares go to the audit escrow instead, a ring's stage
    hosts' with its bridge's (`audit_release` pays each once its job's audit passes,
    `audit_refund` gives them back to the customer if it fails).

    Hot rows (the customer's account, their key, the platform account) are
    updated last, one statement each and in the global lock order (account,
    key, hosts by account, platform), so their row locks are held only until the
    commit that follows: that is what lets one busy customer settle hundreds of
    requests a second.
    """
    if not 0 <= cost_ucents <= hold.amount_ucents:
        raise ValueError(f"cost {cost_ucents} outside the hold of {hold.amount_ucents}")
    others = {host_id: amount for host_id, amount in (others or {}).items() if host is None or host_id != host.pk}
    ceiling = split_cost(cost_ucents).host_ucents
    own = 0 if host is None else ceiling if host_ucents is None else host_ucents
    if own < 0 or any(amount < 0 for amount in others.values()) or own + sum(others.values()) > ceiling:
        raise ValueError(f"host shares {own} and {sorted(others.values())} above {settings.HOST_SHARE_PERCENT}% of {cost_ucents}")
    split = Settlement(cost_ucents=cost_ucents, host_ucents=own, platform_ucents=cost_ucents - own - sum(others.values()))
    payees = {**({} if host is None else {host.pk: own}), **others}
    platform_id, accounts = _settlement_account_ids(host_ids=list(payees))
    if escrow and host is not None:
        accounts = dict.fromkeys(accounts, system_account(Account.Kind.AUDIT_ESCROW).pk)
    legs: dict[int, int] = {}
    for host_id, amount in payees.items():  # (escrowed, a ring's shares are one leg)
        legs[accounts[host_id]] = legs.get(accounts[host_id], 0) + amount
    host_legs = sorted(legs.items())
    if not _settlement_write(
        hold=hold, split=split, reference=reference, platform_id=platform_id, host_legs=host_legs, memo=memo
    ):
        return None
    return split


def _settlement_account_ids(*, host_ids: list[int]) -> tuple[int, dict[int, int]]:
    """The platform's and the hosts' account ids in one SELECT (each created the first time)."""
    wanted = Q(kind=Account.Kind.PLATFORM)
    if host_ids:
        wanted |= Q(kind=Account.Kind.HOST, host_id__in=host_ids)
    platform_id, accounts = None, {}
    for pk, kind, host_id in Account.objects.filter(wanted).values_list("pk", "kind", "host_id"):
        if kind == Account.Kind.PLATFORM:
            platform_id = pk
        else:
            accounts[host_id] = pk
    for missing in set(host_ids) - set(accounts):
        accounts[missing] = account_for_host(host=Host.objects.get(pk=missing)).pk
    return platform_id or system_account(Account.Kind.PLATFORM).pk, accounts


def _settlement_write(
    *, hold: Hold, split: Settlement, reference: str, platform_id: int, host_legs: list[tuple[int, int]], memo: str = "",
) -> bool:
    """The settlement's writes as plain SQL, one statement per row (the ORM's statement
    building costs more than the database's work here, and this runs for every request).

    The hold's compare-and-set decides; then the transaction and its entries; the hot
    rows (customer account, key, host, platform) last, in the global lock order.
    """
    table = {model: connection.ops.quote_name(model._meta.db_table) for model in (Hold, LedgerTransaction, LedgerEntry, Account, ApiKey)}
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    legs = [(hold.account_id, -split.cost_ucents), (platform_id, split.platform_ucents), *host_legs]
    legs = [(account_id, amount) for account_id, amount in legs if amount]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table[Hold]} SET status = %s, closed_at = %s WHERE id = %s AND status = %s",
            [Hold.Status.SETTLED, now, hold.pk, Hold.Status.ACTIVE],
        )
        if cursor.rowcount != 1:
            return False
        cursor.execute(
            f"INSERT INTO {table[LedgerTransaction]} (kind, reference, memo, created_at) VALUES (%s, %s, %s, %s) RETURNING id",
            [LedgerTransaction.Kind.SETTLEMENT, reference, memo, now],
        )
        transaction_id = cursor.fetchone()[0]
        if legs:
            rows = ", ".join(["(%s, %s, %s)"] * len(legs))
            cursor.execute(
                f"INSERT INTO {table[LedgerEntry]} (transaction_id, account_id, amount_ucents) VALUES {rows}",
                [value for account_id, amount in legs for value in (transaction_id, account_id, amount)],
            )
        cursor.execute(
            f"UPDATE {table[Account]} SET balance_ucents = balance_ucents - %s, held_ucents = held_ucents - %s WHERE id = %s",
            [split.cost_ucents, hold.amount_ucents, hold.account_id],
        )
        cursor.execute(
            f"UPDATE {table[ApiKey]} SET held_ucents = held_ucents - %s, spent_ucents = spent_ucents + %s WHERE id = %s",
            [hold.amount_ucents, split.cost_ucents, hold.api_key_id],
        )
        for account_id, amount in (*host_legs, (platform_id, split.platform_ucents)):
            if amount:
                cursor.execute(
                    f"UPDATE {table[Account]} SET balance_ucents = balance_ucents + %s WHERE id = %s", [amount, account_id]
                )
    return True


# --- top-ups (Stripe Checkout; credit only from the webhook) ------------------------


def topup_create(*, user: User, amount_cents: int, success_url: str, cancel_url: str) -> TopUp:
    """Create a Checkout Session for `amount_cents` and return our TopUp (with its URL).
    Stripe sends the customer back to `success_url` or `cancel_url` (the caller's own
    address: the gateway as the customer reached it).

    Not one transaction on purpose: the row commits before Stripe is called (its
    id is the idempotency key and the session's client_reference_id), so no
    session can exist that we do not know about. Nothing is credited here.
    """
    if not stripe_api.topups_configured():
        raise TopupsNotConfigured("Top-ups are not configured on this gateway; ask an operator to grant credit.")
    low, high = settings.TOPUP_MIN_CENTS, settings.TOPUP_MAX_CENTS
    if not low <= amount_cents <= high:
        raise InvalidAmount(topup_rule())
    topup = TopUp.objects.create(user=user, amount_cents=amount_cents, currency=settings.BILLING_CURRENCY)
    try:
        session = stripe_api.checkout_session_create(
            topup_id=topup.pk, amount_cents=amount_cents, currency=topup.currency, email=user.email,
            success_url=success_url, cancel_url=cancel_url,
        )
    except stripe.StripeError as error:
        TopUp.objects.filter(pk=topup.pk, status=TopUp.Status.CREATING).update(status=TopUp.Status.FAILED)
        raise PaymentProviderError(f"The payment provider refused to start a checkout: {error.user_message or error}") from None
    TopUp.objects.filter(pk=topup.pk, status=TopUp.Status.CREATING).update(
        status=TopUp.Status.OPEN, stripe_session_id=session.id, checkout_url=session.url or ""
    )
    topup.refresh_from_db()
    return topup


def topup_rule() -> str:
    """The one sentence that states the top-up limits (the form and the API say it too)."""
    return f"Top-ups are between {usd(settings.TOPUP_MIN_CENTS * UCENTS_PER_CENT)} and {usd(settings.TOPUP_MAX_CENTS * UCENTS_PER_CENT)}."


CREDITING_EVENTS = ("checkout.session.completed", "checkout.session.async_payment_succeeded")


def stripe_webhook_receive(*, payload: bytes, signature: str) -> StripeEvent:
    """Verify a delivery over its raw bytes, then apply it (idempotently).

    Raises InvalidWebhook for a forged, stale, re-serialised or malformed body.
    """
    if not stripe_api.topups_configured():
        raise InvalidWebhook("Stripe webhooks are not configured on this gateway.")
    try:
        event = stripe_api.webhook_event(payload=payload, signature=signature)
    except (ValueError, stripe.SignatureVerificationError) as error:
        raise InvalidWebhook(f"Webhook rejected: {error}") from None
    obj = event.data.object.to_dict() if event.data and event.data.object else None
    return stripe_event_apply(event_id=event.id, event_type=event.type, obj=obj)


@transaction.atomic
def stripe_event_apply(*, event_id: str, event_type: str, obj: dict | None) -> StripeEvent:
    """Record a verified event once and apply it, in one transaction: a paid checkout
    session credits its top-up; a refund or a dispute of that payment takes the credit
    back (`_topup_refund`, `_topup_dispute`); a dispute won gives it back; Connect's
    `account.updated` marks a payout account ready once its onboarding finished.

    The event row is inserted first: a concurrent delivery of the same event
    blocks on the unique id and then finds it, so a replay applies nothing.
    The top-up row lock plus its status compare-and-set (and the ledger's unique
    reference, the session id) make two *different* events for one session
    credit it once; refunds and disputes count what was already taken back.
    """
    try:
        with transaction.atomic():
            record = StripeEvent.objects.create(event_id=event_id, type=event_type, outcome=StripeEvent.Outcome.IGNORED)
    except IntegrityError:
        return StripeEvent.objects.get(event_id=event_id)
    applied: tuple[str, TopUp | None, str] | None = None
    if obj is None:
        pass
    elif event_type in CREDITING_EVENTS and obj.get("payment_status") == "paid":
        applied = _topup_credit(session=obj)
    elif event_type == "charge.refunded":
        applied = _topup_refund(charge=obj)
    elif event_type in ("charge.dispute.created", "charge.dispute.closed"):
        applied = _topup_dispute(dispute=obj, closed=event_type == "charge.dispute.closed")
    elif event_type == "account.updated":
        applied = _payout_account_updated(account=obj)
    if applied is not None:
        outcome, topup, detail = applied
        StripeEvent.objects.filter(pk=record.pk).update(outcome=outcome, topup=topup, detail=detail[:500])
        record.refresh_from_db()
    return record


def _paid_topup(payment_intent: object) -> TopUp | None:
    """The paid top-up of a payment, locked (refunds and disputes name the payment)."""
    if not isinstance(payment_intent, str) or not payment_intent:
        return None
    return TopUp.objects.select_for_update().filter(stripe_payment_intent=payment_intent, status=TopUp.Status.PAID).first()


def _take_back(*, topup: TopUp, cents: int, kind: str, reference: str, memo: str) -> None:
    """Debit the customer (through the ledger) what Stripe gave back to the card: the balance
    may go negative, and admission then refuses with 402 until it is covered."""
    _post(kind=kind, reference=reference, memo=memo[:255], legs=[  # the customer's account first, the global lock order
        (account_for_customer(user=topup.user), -cents * UCENTS_PER_CENT),
        (system_account(Account.Kind.FUNDING), cents * UCENTS_PER_CENT),
    ])


def _topup_refund(*, charge: dict) -> tuple[str, TopUp | None, str]:
    """A refund of a top-up's payment (Stripe's `amount_refunded` is cumulative): take back
    what was refunded and not yet taken back, never more than the top-up less its disputes."""
    topup = _paid_topup(charge.get("payment_intent"))
    if topup is None:
        return StripeEvent.Outcome.REJECTED, None, f"no paid top-up for payment {charge.get('payment_intent')}"
    refunded = charge.get("amount_refunded")
    if not isinstance(refunded, int) or refunded < 0:
        return StripeEvent.Outcome.REJECTED, topup, f"amount_refunded {refunded!r} is not a number of cents"
    new = min(refunded, topup.amount_cents - topup.disputed_cents) - topup.refunded_cents
    if new <= 0:
        return StripeEvent.Outcome.IGNORED, topup, f"{topup.refunded_cents} cents already taken back for refunds"
    _take_back(topup=topup, cents=new, kind=LedgerTransaction.Kind.REFUND, reference=f"refund-{charge.get('id')}-{refunded}",
               memo=f"Stripe refund of top-up {topup.pk}: {new / 100:.2f} {topup.currency.upper()}")
    TopUp.objects.filter(pk=topup.pk).update(refunded_cents=topup.refunded_cents + new)
    return StripeEvent.Outcome.DEBITED, topup, f"refunded {new} cents"


def _topup_dispute(*, dispute: dict, closed: bool) -> tuple[str, TopUp | None, str]:
    """A chargeback: opened, the disputed amount is taken back at once (Stripe takes it from
    us then); closed and won, it is given back; closed and lost, it stays taken."""
    topup = _paid_topup(dispute.get("payment_intent"))
    if topup is None:
        return StripeEvent.Outcome.REJECTED, None, f"no paid top-up for payment {dispute.get('payment_intent')}"
    opened = LedgerTransaction.objects.filter(kind=LedgerTransaction.Kind.CHARGEBACK, reference=f"dispute-{dispute.get('id')}").first()
    taken = -sum(opened.entries.filter(account__kind=Account.Kind.CUSTOMER).values_list("amount_ucents", flat=True)) // UCENTS_PER_CENT if opened else 0
    if not closed:
        if opened is not None:
            return StripeEvent.Outcome.IGNORED, topup, f"dispute {dispute.get('id')} already taken back"
        amount = dispute.get("amount")
        if not isinstance(amount, int) or amount <= 0:
            return StripeEvent.Outcome.REJECTED, topup, f"dispute amount {amount!r} is not a number of cents"
        cents = min(amount, topup.amount_cents - topup.refunded_cents - topup.disputed_cents)
        if cents <= 0:
            return StripeEvent.Outcome.IGNORED, topup, "nothing of this top-up is left to take back"
        _take_back(topup=topup, cents=cents, kind=LedgerTransaction.Kind.CHARGEBACK, reference=f"dispute-{dispute.get('id')}",
                   memo=f"Stripe dispute of top-up {topup.pk} ({dispute.get('reason') or 'no reason given'})")
        TopUp.objects.filter(pk=topup.pk).update(disputed_cents=topup.disputed_cents + cents)
        return StripeEvent.Outcome.DEBITED, topup, f"disputed {cents} cents"
    if dispute.get("status") != "won" or taken <= 0:
        return StripeEvent.Outcome.IGNORED, topup, f"dispute {dispute.get('id')} closed {dispute.get('status')}"
    try:
        with transaction.atomic():
            _post(kind=LedgerTransaction.Kind.CHARGEBACK_WON, reference=f"dispute-won-{dispute.get('id')}",
                  memo=f"Stripe dispute of top-up {topup.pk} won", legs=[
                      (account_for_customer(user=topup.user), taken * UCENTS_PER_CENT),
                      (system_account(Account.Kind.FUNDING), -taken * UCENTS_PER_CENT),
                  ])
    except IntegrityError:  # (the ledger's unique reference: a second "won" for the same dispute)
        return StripeEvent.Outcome.IGNORED, topup, f"dispute {dispute.get('id')} already given back"
    TopUp.objects.filter(pk=topup.pk).update(disputed_cents=max(0, topup.disputed_cents - taken))
    return StripeEvent.Outcome.RESTORED, topup, f"dispute won: {taken} cents given back"


def _topup_credit(*, session: dict) -> tuple[str, TopUp | None, str]:
    """Credit the TopUp a paid session belongs to, if it is ours and the amount matches.

    A session we never stored (Stripe created it, but its answer to us was lost: the
    top-up is still `creating`, or `failed` when the call timed out) is found by its
    `client_reference_id`, our top-up's id, and reconciled here: the signed event is
    Stripe's own account of the session."""
    topup = TopUp.objects.select_for_update().filter(stripe_session_id=session.get("id")).first()
    reference = session.get("client_reference_id")
    if topup is None and isinstance(reference, str) and reference.isdigit():
        topup = TopUp.objects.select_for_update().filter(
            pk=int(reference), stripe_session_id__isnull=True, status__in=[TopUp.Status.CREATING, TopUp.Status.FAILED]
        ).first()
        if topup is not None:
            TopUp.objects.filter(pk=topup.pk).update(stripe_session_id=session.get("id"), status=TopUp.Status.OPEN)
            topup.refresh_from_db()
    if topup is None:
        return StripeEvent.Outcome.REJECTED, None, f"no top-up for session {session.get('id')}"
    paid = (session.get("amount_total"), (session.get("currency") or "").lower(), session.get("client_reference_id"))
    expected = (topup.amount_cents, topup.currency, str(topup.pk))
    if paid != expected:
        return StripeEvent.Outcome.REJECTED, topup, f"session says {paid}, we created {expected}"
    if topup.status != TopUp.Status.OPEN:
        return StripeEvent.Outcome.IGNORED, topup, f"top-up already {topup.status}"
    txn = _post(
        kind=LedgerTransaction.Kind.TOPUP,
        reference=topup.stripe_session_id,
        memo=f"Stripe Checkout top-up {topup.pk}",
        legs=[
            (system_account(Account.Kind.FUNDING), -topup.amount_ucents),
            (account_for_customer(user=topup.user), topup.amount_ucents),
        ],
    )
    TopUp.objects.filter(pk=topup.pk, status=TopUp.Status.OPEN).update(
        status=TopUp.Status.PAID, transaction=txn, paid_at=timezone.now(),
        stripe_payment_intent=session.get("payment_intent") if isinstance(session.get("payment_intent"), str) else "",
    )
    return StripeEvent.Outcome.CREDITED, topup, ""


def credit_grant_by_operator(*, user: User, amount_ucents: int, reason: str, operator: User) -> LedgerTransaction:
    """An operator's grant from the admin: a GRANT transaction with the reason and who gave it."""
    import uuid

    if not reason.strip():
        raise InvalidAmount("A grant needs a reason.")
    return credit_grant(
        user=user, amount_ucents=amount_ucents, reference=f"admin-{uuid.uuid4()}", memo=f"{reason.strip()} (by {operator})"[:255]
    )


# --- host payouts: requested → sending → paid | failed -----------------------------


@transaction.atomic
def payout_request(*, host: Host, amount_ucents: int | None = None) -> Payout:
    """Phase 1: move earnings (all available whole cents by default) to payouts-pending.

    Under the host account's row lock, so two requests cannot withdraw the same
    earnings. Refused for a banned host (what it earned waits for an operator), below
    PAYOUT_MINIMUM_UCENTS, above what is available, in fractions of a cent, or without a
    connected account to send to.
    """
    if Host.objects.filter(pk=host.pk, banned_at__isnull=False).exists():  # (read now: the caller's row may be stale)
        raise PayoutRefused("This machine is banned, so it cannot request payouts; an operator decides what happens "
                            "to its earnings. Write to support if you think the ban is a mistake.")
    profile = PayoutProfile.objects.filter(host=host).first()
    if profile is None or not profile.stripe_account_id:
        raise PayoutRefused("This machine has no payout account yet: press \"Set up payouts\" on its page "
                            "(My machines, then the machine) to connect one with Stripe.")
    if profile.status != PayoutProfile.Status.READY:
        raise PayoutRefused(f"This machine's payout account ({profile.stripe_account_id}) has not finished Stripe's "
                            "onboarding: press \"Set up payouts\" on the machine's page to continue it.")
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
        later = f" ({usd(unvested)} more vests within {settings.EARNINGS_VEST_SECONDS / 86400:g} days of being earned)" if unvested else ""
        raise PayoutRefused(f"Only {usd(available)} is available to withdraw{later}.")
    payout = Payout.objects.create(host=host, amount_ucents=amount, destination=profile.stripe_account_id)
    _post(
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
        return f"There is {usd(payable_ucents)} to withdraw and the minimum payout is {usd(minimum)}; nothing more is vesting."
    vesting = sum(amount for _, amount in schedule)
    payable, reaches = payable_ucents, None
    for moment, amount in schedule:
        payable += amount
        if payable // UCENTS_PER_CENT * UCENTS_PER_CENT >= minimum:
            reaches = moment
            break
    when = (f"the minimum is payable from {_utc_minute(reaches)}" if reaches is not None else
            f"all of it has vested by {_utc_minute(schedule[-1][0])}, {usd(payable)} in all, still below the minimum")
    return (f"{usd(vesting)} of this machine's earnings is still vesting (earnings become payable "
            f"{settings.EARNINGS_VEST_SECONDS / 86400:g} days after each job) and {usd(payable_ucents)} is payable now, "
            f"below the minimum payout of {usd(minimum)}: {when}.")


def _utc_minute(moment: datetime) -> str:
    """A moment as "2026-12-10 14:03 UTC", rounded up to the minute (never before it happens)."""
    rounded = (moment + timedelta(seconds=59, microseconds=999_999)).astimezone(UTC)
    return rounded.strftime("%Y-%m-%d %H:%M UTC")


# --- host payout accounts: onboarding → ready (Stripe Connect) -------------------------


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
        raise PayoutsNotConfigured("Payouts are not configured on this gateway (no STRIPE_SECRET_KEY); ask an operator.")
    if Host.objects.filter(pk=host.pk, banned_at__isnull=False).exists():
        raise PayoutRefused("This machine is banned, so it cannot set up payouts.")
    profile = PayoutProfile.objects.filter(host=host).first()
    if profile is not None and profile.status == PayoutProfile.Status.READY:
        return None
    account = _connected_account(profile.stripe_account_id) if profile is not None else None
    if profile is not None and account is not None and _payout_account_mark_ready(profile=profile, account=account.to_dict()):
        return None
    if profile is None or account is None:
        profile = _payout_account_create(host=host, replacing=profile)
    try:
        link = stripe_api.account_link_create(account_id=profile.stripe_account_id, return_url=return_url, refresh_url=refresh_url)
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
        raise PaymentProviderError(f"Stripe could not be asked about the payout account: {error.user_message or error}") from None


def _payout_account_mark_ready(*, profile: PayoutProfile, account: dict) -> bool:
    """onboarding → ready, a compare-and-set, when Stripe says the account (its fields) can
    receive transfers; True when the profile is ready (by this call or a concurrent one)."""
    if not stripe_api.account_ready(account):
        return False
    PayoutProfile.objects.filter(
        pk=profile.pk, status=PayoutProfile.Status.ONBOARDING, stripe_account_id=account.get("id")
    ).update(status=PayoutProfile.Status.READY)
    return PayoutProfile.objects.filter(pk=profile.pk, status=PayoutProfile.Status.READY).exists()


def _payout_account_updated(*, account: dict) -> tuple[str, None, str]:
    """Connect's `account.updated`: an account whose onboarding finished is marked ready by
    the same rule as the return URL's check (an owner who closed Stripe's tab before being
    sent back is ready too). The event's account is signed by Stripe, so it is not asked again."""
    account_id = account.get("id")
    profile = PayoutProfile.objects.filter(stripe_account_id=account_id).first() if isinstance(account_id, str) else None
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
            return PayoutProfile.objects.create(host=host, stripe_account_id=account.id, status=PayoutProfile.Status.ONBOARDING)
    except IntegrityError:  # the other click's row (the same account: the same idempotency key)
        return PayoutProfile.objects.get(host=host)


def audit_release(*, host: Host, amount_ucents: int, reference: str, memo: str = "") -> bool:
    """An audit passed: the host's share of its job, held in escrow since settlement, is
    paid to the host (it then vests like any earnings). Idempotent by `reference`;
    False when it was already released."""
    if amount_ucents < 0:
        raise ValueError(f"negative release {amount_ucents}")
    escrow = system_account(Account.Kind.AUDIT_ESCROW)
    try:
        with transaction.atomic():
            _post(kind=LedgerTransaction.Kind.AUDIT_RELEASE, reference=reference, memo=memo,
                  legs=[(escrow, -amount_ucents), (account_for_host(host=host), amount_ucents)])
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
            _post(kind=LedgerTransaction.Kind.AUDIT_REFUND, reference=reference, memo=memo, legs=[
                (system_account(Account.Kind.AUDIT_ESCROW), -host_ucents),
                (system_account(Account.Kind.PLATFORM), -platform_ucents),
                (account_for_customer(user=user), host_ucents + platform_ucents),
            ])
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
            _post(kind=LedgerTransaction.Kind.AUDIT_SCORE, reference=reference, memo=memo,
                  legs=[(platform, -amount), (account_for_host(host=host), amount)])
    except IntegrityError:
        return 0
    return amount


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
    _post(
        kind=LedgerTransaction.Kind.FORFEIT, reference=f"forfeit-{host.pk}-{timezone.now().timestamp():.6f}",
        memo=reason[:255], legs=[(account, -amount), (system_account(Account.Kind.PLATFORM), amount)],
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
        payout_void(payout_id=payout.pk, reason=f"Stripe refused the transfer: {refusal.user_message or refusal}",
                    refused_by_stripe=True)
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
    _post(
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
    _post(
        kind=LedgerTransaction.Kind.PAYOUT_VOID,
        reference=f"payout-{payout.pk}",
        memo=reason[:255],
        legs=[  # the host account first, as payout_request locks them
            (account_for_host(host=payout.host), payout.amount_ucents),
            (system_account(Account.Kind.PAYOUTS_PENDING), -payout.amount_ucents),
        ],
    )
    return True


# --- reconciliation steps (Celery beat calls the tick; tests call the steps) ----------


def orphaned_hold_release_one() -> bool:
    """Release one active hold whose request already ended (completed or failed)."""
    hold = (
        Hold.objects.filter(status=Hold.Status.ACTIVE, request__status__in=["completed", "failed"]).order_by("pk").first()
    )
    return hold is not None and hold_release(hold=hold)
