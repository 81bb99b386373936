"""Customers' API keys."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q


class ApiKey(models.Model):
    """A customer's API key: only its hash and a visible prefix are stored."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16)
    key_hash = models.CharField(max_length=64, unique=True)
    spend_cap_ucents = models.BigIntegerField(null=True, blank=True)
    rate_limit_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="admissions per rolling minute; empty = unlimited"
    )
    max_concurrent = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests in flight at once; empty = unlimited"
    )
    trusted_only = models.BooleanField(default=False, help_text="serve this key's requests on trusted hosts only")
    account_wide = models.BooleanField(
        default=False,
        help_text="lists and resumes every request of the account (usage, stream resumes, generation "
        "stats); otherwise only its own. Keys made before scopes existed are account-wide, as they were",
    )
    spent_ucents = models.BigIntegerField(default=0)
    held_ucents = models.BigIntegerField(default=0)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "marketplace_apikey"  # the table it had before accounts became its own app
        constraints = [
            models.CheckConstraint(
                condition=Q(held_ucents__gte=0) & Q(spent_ucents__gte=0), name="key_sums_not_negative"
            ),
            models.CheckConstraint(
                condition=Q(spend_cap_ucents__isnull=True)
                | Q(spend_cap_ucents__gte=models.F("spent_ucents") + models.F("held_ucents")),
                name="key_within_cap",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or self.user})"


class EmailVerification(models.Model):
    """A signed-up account's e-mail address until its owner proves it (the link we sent):
    until then the account can make no API key and register no machine. Accounts an operator
    creates have none (whoever made them vouched for the address)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="email_verification")
    sent_at = models.DateTimeField(auto_now_add=True)
    verified_at = models.DateTimeField(null=True, blank=True)
    # the latest link's: each new link (a sign-up again, "send it again") replaces it, so only the
    # latest link works, and confirming clears it, so no link works twice
    nonce = models.CharField(max_length=32, blank=True, default="")

    def __str__(self) -> str:
        return f"{self.user} ({'verified' if self.verified_at else 'unverified'})"
