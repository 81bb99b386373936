"""The ledger: accounts, double-entry transactions, and holds.

Money is integer micro-cents (1 USD = 100,000,000 µ¢). Every movement is a
`LedgerTransaction` whose `LedgerEntry` rows sum to zero; rows are never
updated or deleted (corrections are new transactions). `Account.balance_ucents`
and `Account.held_ucents` are caches written in the same transaction as the
entries and holds they summarise; `reconcile` and the tests check them.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from catalog.money import UCENTS_PER_CENT, usd


class Account(models.Model):
    class Kind(models.TextChoices):
        CUSTOMER = "customer", "Customer credit"
        HOST = "host", "Host earnings"
        PLATFORM = "platform", "Platform revenue"
        FUNDING = "funding", "Money from outside (top-ups, grants) and back out (payouts)"
        PAYOUTS_PENDING = "payouts_pending", "Host payouts requested, not yet sent"
        AUDIT_ESCROW = "audit_escrow", "Host earnings held until their job's audit passes"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT)
    host = models.ForeignKey("hosts.Host", null=True, blank=True, on_delete=models.PROTECT)
    balance_ucents = models.BigIntegerField(default=0)
    held_ucents = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user"], condition=Q(kind="customer"), name="one_customer_account_per_user"
            ),
            models.UniqueConstraint(fields=["host"], condition=Q(kind="host"), name="one_earnings_account_per_host"),
            models.UniqueConstraint(
                fields=["kind"],
                condition=Q(kind__in=["platform", "funding", "payouts_pending", "audit_escrow"]),
                name="singleton_system_accounts",
            ),
            models.CheckConstraint(condition=Q(held_ucents__gte=0), name="held_not_negative"),
            models.CheckConstraint(  # a customer may owe after a refund or a chargeback of credit already spent
                condition=Q(kind__in=["funding", "customer"]) | Q(balance_ucents__gte=models.F("held_ucents")),
                name="available_not_negative",
            ),
        ]

    def __str__(self) -> str:
        owner = self.user or self.host or ""
        return f"{self.kind}:{owner}"

    @property
    def available_ucents(self) -> int:
        return self.balance_ucents - self.held_ucents


class LedgerTransaction(models.Model):
    class Kind(models.TextChoices):
        GRANT = "grant", "Credit granted by an operator"
        TOPUP = "topup", "Top-up"
        SETTLEMENT = "settlement", "Request settlement"
        PAYOUT_REQUEST = "payout_request", "Host payout requested (earnings → pending)"
        PAYOUT_SENT = "payout_sent", "Host payout sent (pending → outside)"
        PAYOUT_VOID = "payout_void", "Host payout failed (pending → earnings)"
        FORFEIT = "forfeit", "Unvested host earnings forfeited (earnings → platform), with the reason"
        REFUND = "refund", "Top-up refunded by Stripe (customer credit → outside)"
        CHARGEBACK = "chargeback", "Top-up disputed (customer credit → outside until the dispute is decided)"
        CHARGEBACK_WON = "chargeback_won", "Dispute won (the disputed credit comes back)"
        AUDIT_RELEASE = "audit_release", "An audit passed (held earnings → the host)"
        AUDIT_REFUND = "audit_refund", "An audit failed (held earnings and the platform's share → the customer)"
        AUDIT_SCORE = "audit_score", "A trusted host scored an audit (platform → the scorer, its prefill's fee)"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    reference = models.CharField(max_length=128)
    memo = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "reference"], name="one_transaction_per_reference")]

    def __str__(self) -> str:
        return f"{self.kind}:{self.reference}"


class LedgerEntry(models.Model):
    transaction = models.ForeignKey(LedgerTransaction, on_delete=models.PROTECT, related_name="entries")
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="entries")
    amount_ucents = models.BigIntegerField()

    class Meta:
        indexes = [models.Index(fields=["account", "transaction"])]

    def __str__(self) -> str:
        return f"{self.account} {self.amount_ucents:+d}"


class Hold(models.Model):
    """Credit reserved at admission so concurrent requests cannot overspend."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        SETTLED = "settled"
        RELEASED = "released"

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="holds")
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.PROTECT, related_name="holds")
    amount_ucents = models.BigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(amount_ucents__gte=0), name="hold_not_negative")]
        indexes = [
            models.Index(fields=["status", "account"]),
            # the key limits count a key's active holds and its holds of the last minute
            models.Index(fields=["api_key", "status"]),
            models.Index(fields=["api_key", "created_at"]),
        ]

    def __str__(self) -> str:
        return f"hold {self.amount_ucents} ({self.status})"


class TopUp(models.Model):
    """A Stripe Checkout Session we created: the only thing a webhook may credit.

    The row exists before Stripe is called (its id is the idempotency key and
    the session's `client_reference_id`); the webhook credits exactly
    `amount_cents` of it, once, and only if Stripe reports that amount paid.
    """

    class Status(models.TextChoices):
        CREATING = "creating"
        OPEN = "open"
        PAID = "paid"
        FAILED = "failed"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="topups")
    amount_cents = models.PositiveIntegerField()
    currency = models.CharField(max_length=3, default="usd")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.CREATING)
    stripe_session_id = models.CharField(max_length=255, null=True, blank=True, unique=True)
    checkout_url = models.URLField(max_length=2000, blank=True)
    transaction = models.OneToOneField(
        LedgerTransaction, null=True, blank=True, on_delete=models.PROTECT, related_name="topup"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    stripe_payment_intent = models.CharField(
        max_length=255, blank=True, db_index=True, help_text="the paid session's payment: refunds and disputes name it"
    )
    refunded_cents = models.PositiveIntegerField(default=0, help_text="taken back for refunds so far")
    disputed_cents = models.PositiveIntegerField(default=0, help_text="taken back for disputes not won")

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(amount_cents__gt=0), name="topup_positive"),
            models.CheckConstraint(
                condition=~Q(status="paid") | Q(transaction__isnull=False), name="paid_topup_has_transaction"
            ),
        ]

    def __str__(self) -> str:
        return f"top-up {self.pk} ${self.amount_cents / 100:.2f} ({self.status})"

    @property
    def amount_ucents(self) -> int:
        return self.amount_cents * UCENTS_PER_CENT


class StripeEvent(models.Model):
    """Every verified Stripe event, recorded once (the unique id makes replays no-ops)."""

    class Outcome(models.TextChoices):
        CREDITED = "credited", "Credited a top-up"
        DEBITED = "debited", "Took credit back (a refund or a dispute)"
        RESTORED = "restored", "Gave disputed credit back (a dispute won)"
        PAYOUT_READY = "payout_ready", "Marked a payout account ready (onboarding finished)"
        IGNORED = "ignored", "Nothing to do"
        REJECTED = "rejected", "Did not match a top-up we created"

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    detail = models.CharField(max_length=500, blank=True)
    topup = models.ForeignKey(TopUp, null=True, blank=True, on_delete=models.PROTECT, related_name="events")
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=~Q(outcome="credited") | Q(topup__isnull=False), name="credited_event_names_topup"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event_id} {self.type} ({self.outcome})"


class PayoutProfile(models.Model):
    """Where a host's payouts go: its Stripe Connect account. onboarding → ready.

    The owner's "Set up payouts" creates the account and the row (onboarding); it becomes
    ready once Stripe says onboarding finished: asked at the return URL
    (`billing.services.payout_account_refresh`) or told by Connect's `account.updated` webhook.
    An operator who connects an account in the admin connects a finished one (ready).
    """

    class Status(models.TextChoices):
        ONBOARDING = "onboarding", "Stripe onboarding not finished"
        READY = "ready", "Ready for payouts"

    host = models.OneToOneField("hosts.Host", on_delete=models.PROTECT, related_name="payout_profile")
    stripe_account_id = models.CharField(max_length=255, help_text="acct_…, the host's connected account")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.host} → {self.stripe_account_id}"


class Payout(models.Model):
    """A host's withdrawal. requested → sending → paid | failed.

    Requesting moves the amount from the host's earnings to the payouts-pending
    account; approval sends a Stripe Transfer (idempotency key = this id) and
    then posts it out (paid) or reverses it back to the host (failed).
    """

    class Status(models.TextChoices):
        REQUESTED = "requested"
        SENDING = "sending"
        PAID = "paid"
        FAILED = "failed"

    host = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, related_name="payouts")
    amount_ucents = models.BigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.REQUESTED)
    destination = models.CharField(max_length=255, help_text="the connected account at request time")
    stripe_transfer_id = models.CharField(max_length=255, blank=True)
    failure_reason = models.CharField(max_length=500, blank=True)
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(amount_ucents__gt=0), name="payout_positive"),
        ]
        indexes = [models.Index(fields=["host", "created_at"]), models.Index(fields=["status", "created_at"])]

    def __str__(self) -> str:
        return f"payout {self.pk} {usd(self.amount_ucents)} ({self.status})"

    @property
    def amount_cents(self) -> int:
        return self.amount_ucents // UCENTS_PER_CENT
