"""Writes the web pages own: signing a person up, and confirming their e-mail address.
Everything else a page changes goes through the owning app's services (billing,
marketplace, hosts).

Sign-up never says whether an address has an account: a new address gets an account and a
link; an address that has one gets an e-mail saying someone tried, and the page answers the
same either way.

An account cannot be taken before it exists (someone signing up with another's address and
waiting for its owner to confirm): until the address is confirmed the account makes no API
key and registers no machine; signing up again with a pending address replaces its password
(every session signed in with the old one ends) and its link; and the link confirms only
with the password of the sign-up that sent it, once, within two hours. Whoever signed up
first with someone else's address is left with nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.contrib.auth import get_user_model
from django.core import signing
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import EmailVerification
from accounts.selectors import account_unconfirmed
from accounts.services import api_key_revoke_all

if TYPE_CHECKING:
    from django.contrib.auth.models import User

VERIFY_SALT = "elephant.email-verification"
VERIFY_MAX_AGE_SECONDS = 2 * 3600
VERIFY_HOURS = VERIFY_MAX_AGE_SECONDS // 3600


def verification_token(user: User) -> str:
    """A new link's token: signed, expiring, naming the account, its address and a new nonce
    (the link before it stops working)."""
    nonce = secrets.token_hex(16)
    EmailVerification.objects.filter(user=user, verified_at__isnull=True).update(nonce=nonce)
    return signing.dumps({"user": user.pk, "email": user.email, "nonce": nonce}, salt=VERIFY_SALT)


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
        if existing is not None and account_unconfirmed(existing):
            # never confirmed: this sign-up's password and a new link replace the last ones (the
            # sessions signed in with the old password end with it; keys it may hold go too)
            existing.set_password(password)
            existing.save(update_fields=["password"])
            api_key_revoke_all(user=existing)
            _send_link(existing, link_for)
        elif existing is not None:
            send_mail(
                "Someone tried to create an Elephant account with your address",
                f"Someone (maybe you) tried to create an account with {email}, which already has one.\n"
                "If it was you, sign in, or reset your password from the sign-in page. If not, you can ignore this.",
                None,
                [email],
            )
        return
    _send_link(user, link_for)


def _send_link(user: User, link_for: Callable[[str], str]) -> None:
    send_mail(
        "Confirm your e-mail address for Elephant",
        f"Open this link to confirm {user.email} and sign in, with the password you chose when you signed up "
        f"(it works once, for {VERIFY_HOURS} hours):\n\n{link_for(verification_token(user))}\n\n"
        "Until then, the account can make no API key and register no machine. If you did not sign up, ignore this "
        "e-mail.",
        None,
        [user.email],
    )


def verification_resend(*, user: User, link_for: Callable[[str], str]) -> bool:
    """A new confirmation link for a signed-in account not yet confirmed; False when it is."""
    if not email_unverified(user):
        return False
    _send_link(user, link_for)
    return True


def email_verify(*, token: str, password: str) -> tuple[User | None, str]:
    """Confirm the account a link names: the latest link (its nonce), unexpired, not used, and
    the password its sign-up chose. Returns the account, now confirmed, or None and why in a
    customer's words."""
    try:
        claim = signing.loads(token, salt=VERIFY_SALT, max_age=VERIFY_MAX_AGE_SECONDS)
    except signing.SignatureExpired:
        return None, f"This link has expired (links work for {VERIFY_HOURS} hours)."
    except signing.BadSignature:
        return None, "This link is not one we sent."
    user = get_user_model().objects.filter(pk=claim.get("user"), email=claim.get("email"), is_active=True).first()
    if user is None or not claim.get("nonce"):
        return None, "This link is not one we sent."
    with transaction.atomic():
        pending = EmailVerification.objects.select_for_update().filter(user=user, verified_at__isnull=True).first()
        if pending is None or pending.nonce != claim["nonce"]:
            return None, "This link was used already, or a newer one was sent since."
        if not user.check_password(password):
            return None, (
                "That is not the password chosen when this link was sent. If you signed up more than once, "
                "use the latest link, or sign up again."
            )
        pending.verified_at, pending.nonce = timezone.now(), ""
        pending.save(update_fields=["verified_at", "nonce"])
    return user, ""


email_unverified = account_unconfirmed  # (the name the pages and their tests use)
