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

UCENTS_PER_USD = 100_000_000


class Account(models.Model):
    class Kind(models.TextChoices):
        CUSTOMER = "customer", "Customer credit"
        HOST = "host", "Host earnings"
        PLATFORM = "platform", "Platform revenue"
        FUNDING = "funding", "Money from outside (top-ups, grants)"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT)
    host = models.ForeignKey("hosts.Host", null=True, blank=True, on_delete=models.PROTECT)
    balance_ucents = models.BigIntegerField(default=0)
    held_ucents = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user"], condition=Q(kind="customer"), name="one_customer_account_per_user"),
            models.UniqueConstraint(fields=["host"], condition=Q(kind="host"), name="one_earnings_account_per_host"),
            models.UniqueConstraint(
                fields=["kind"], condition=Q(kind__in=["platform", "funding"]), name="singleton_system_accounts"
            ),
            models.CheckConstraint(condition=Q(held_ucents__gte=0), name="held_not_negative"),
            models.CheckConstraint(
                condition=Q(kind="funding") | Q(balance_ucents__gte=models.F("held_ucents")),
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
    api_key = models.ForeignKey("marketplace.ApiKey", on_delete=models.PROTECT, related_name="holds")
    amount_ucents = models.BigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(amount_ucents__gte=0), name="hold_not_negative")]
        indexes = [models.Index(fields=["status", "account"])]

    def __str__(self) -> str:
        return f"hold {self.amount_ucents} ({self.status})"
