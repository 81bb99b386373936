"""Writes the web pages own: signing a person up. Everything else a page changes
goes through the owning app's services (billing, marketplace, hosts)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

if TYPE_CHECKING:
    from django.contrib.auth.models import User


class EmailTaken(Exception):
    pass


@transaction.atomic
def user_signup(*, email: str, password: str) -> User:
    """Create a customer whose username is their e-mail (lower-cased), with a hashed password.

    The unique username decides a race between two sign-ups for one address.
    """
    email = email.strip().lower()
    User = get_user_model()
    try:
        with transaction.atomic():
            return User.objects.create_user(username=email, email=email, password=password)
    except IntegrityError:
        raise EmailTaken("An account with this e-mail already exists; log in or reset the password.") from None
