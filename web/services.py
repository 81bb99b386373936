"""Writes the web pages own: signing a person up, and confirming their e-mail address.
Everything else a page changes goes through the owning app's services (billing,
marketplace, hosts).

Sign-up never says whether an address has an account: a new address gets an account (its
keys cannot spend until the address is confirmed) and a link; an address that has one gets
an e-mail saying someone tried (or, if it was never confirmed, a new link), and the page
answers the same either way.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from django.contrib.auth import get_user_model
from django.core import signing
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import EmailVerification

if TYPE_CHECKING:
    from django.contrib.auth.models import User

VERIFY_SALT = "elephant.email-verification"
VERIFY_MAX_AGE_SECONDS = 3 * 24 * 3600


def verification_token(user: User) -> str:
    """A signed, expiring token naming the account and the address it confirms."""
    return signing.dumps({"user": user.pk, "email": user.email}, salt=VERIFY_SALT)


def signup_request(*, email: str, password: str, link_for: Callable[[str], str]) -> None:
    """Sign `email` up, or tell its owner someone tried; the caller answers the same either
    way. `link_for(token)` is the confirmation page's absolute URL."""
    email = email.strip().lower()
    User = get_user_model()
    try:
        with transaction.atomic():
            user = User.objects.create_user(username=email, email=email, password=password)
            EmailVerification.objects.create(user=user)
    except IntegrityError:
        existing = User.objects.filter(username=email).first()
        pending = existing is not None and EmailVerification.objects.filter(user=existing, verified_at__isnull=True).exists()
        if pending:  # never confirmed: a new link (the password is not changed by a second sign-up)
            _send_link(existing, link_for)
        elif existing is not None:
            send_mail(
                "Someone tried to create an Elephant account with your address",
                f"Someone (maybe you) tried to create an account with {email}, which already has one.\n"
                "If it was you, sign in, or reset your password from the sign-in page. If not, you can ignore this.",
                None, [email],
            )
        return
    _send_link(user, link_for)


def _send_link(user: User, link_for: Callable[[str], str]) -> None:
    send_mail(
        "Confirm your e-mail address for Elephant",
        f"Open this link to confirm {user.email} and sign in (it works for 3 days):\n\n{link_for(verification_token(user))}\n\n"
        "Until then, API keys of this account cannot spend. If you did not sign up, ignore this e-mail.",
        None, [user.email],
    )


def verification_resend(*, user: User, link_for: Callable[[str], str]) -> bool:
    """A new confirmation link for a signed-in account not yet confirmed; False when it is."""
    if not email_unverified(user):
        return False
    _send_link(user, link_for)
    return True


def email_verify(*, token: str) -> User | None:
    """The account a valid, unexpired token confirms (now marked confirmed), or None."""
    try:
        claim = signing.loads(token, salt=VERIFY_SALT, max_age=VERIFY_MAX_AGE_SECONDS)
    except signing.BadSignature:
        return None
    user = get_user_model().objects.filter(pk=claim.get("user"), email=claim.get("email"), is_active=True).first()
    if user is None:
        return None
    EmailVerification.objects.filter(user=user, verified_at__isnull=True).update(verified_at=timezone.now())
    return user


def email_unverified(user: User) -> bool:
    return EmailVerification.objects.filter(user=user, verified_at__isnull=True).exists()
