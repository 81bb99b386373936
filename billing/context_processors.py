"""What every page needs to know about billing: which Stripe it talks to."""

from __future__ import annotations

from django.http import HttpRequest

from billing import stripe_api


def stripe_mode(request: HttpRequest) -> dict[str, str]:
    """`stripe_mode` for the base template's banner: "local" (the stand-in), "test" (Stripe's
    test keys), "live", or "" (not configured)."""
    return {"stripe_mode": stripe_api.mode()}
