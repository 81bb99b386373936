"""Writes for API keys: creation and revocation. The secret is shown once, never stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import account_unconfirmed
from core.secrets import secret_hash, secret_new, secret_prefix

if TYPE_CHECKING:
    from django.contrib.auth.models import User


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str


class AccountUnconfirmed(Exception):
    """The account has not confirmed its e-mail address: it makes no key and no machine (else
    whoever signed up with someone else's address would hold keys once its owner confirms)."""


def api_key_create(
    *,
    user: User,
    name: str = "",
    spend_cap_ucents: int | None = None,
    trusted_only: bool = False,
    account_wide: bool = False,
) -> NewKey:
    """Create a key; the secret is returned here once and never stored. `trusted_only`: its
    requests are served by trusted hosts only; `account_wide`: it reads every request of the
    account, not only its own. An unconfirmed account raises AccountUnconfirmed."""
    if account_unconfirmed(user):
        raise AccountUnconfirmed(f"{user.email} is not confirmed yet")
    if spend_cap_ucents is not None and spend_cap_ucents < 0:
        raise ValueError("a spend cap cannot be negative")
    secret = secret_new("el")
    key = ApiKey.objects.create(
        user=user,
        name=name,
        prefix=secret_prefix(secret),
        key_hash=secret_hash(secret),
        spend_cap_ucents=spend_cap_ucents,
        trusted_only=trusted_only,
        account_wide=account_wide,
    )
    return NewKey(key=key, secret=secret)


def api_key_revoke(*, key: ApiKey) -> bool:
    return bool(ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()))


def api_key_revoke_all(*, user: User) -> int:
    """Revoke every live key of `user` (a password reset that asked to); returns how many."""
    return ApiKey.objects.filter(user=user, revoked_at__isnull=True).update(revoked_at=timezone.now())
