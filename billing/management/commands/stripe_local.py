"""`stripe_local`: local test mode's stand-in for Stripe's servers (billing/stripe_local.py).

`make run` starts it on a port of its own when no STRIPE_SECRET_KEY is set, and gives the
gateway and this command the same test keys: the gateway's STRIPE_API_BASE points here,
and "Pay" on its Checkout page posts the signed event to `--webhook-url`. Its state is kept
in `--state` (var/stripe-local.json), so the supervisor's restart of it loses no open
Checkout session or account.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing.stripe_local import LocalStripe


class Command(BaseCommand):
    help = "Run local test mode's Stripe stand-in (Checkout, Connect onboarding, transfers; no real money)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument(
            "--webhook-url",
            required=True,
            help="the gateway's webhook endpoint, e.g. http://127.0.0.1:8000/billing/stripe/webhook/",
        )
        parser.add_argument(
            "--state",
            type=Path,
            default=None,
            help="the JSON file its sessions and accounts survive a restart in (default: var/stripe-local.json)",
        )

    def handle(self, *args: object, port: int, webhook_url: str, state: Path | None, **options: object) -> None:
        if not settings.STRIPE_SECRET_KEY.startswith("sk_test_") or not settings.STRIPE_WEBHOOK_SECRET:
            raise CommandError(
                "stripe_local needs the gateway's test keys in its environment: STRIPE_SECRET_KEY (sk_test_…) "
                "and STRIPE_WEBHOOK_SECRET"
            )
        stand_in = LocalStripe(
            secret_key=settings.STRIPE_SECRET_KEY,
            webhook_secret=settings.STRIPE_WEBHOOK_SECRET,
            webhook_url=webhook_url,
            state_path=state or settings.VAR_DIR / "stripe-local.json",
        ).start(port=port)
        self.stdout.write(
            f"Stripe test mode: a local stand-in at {stand_in.url} takes the top-ups and payout setups "
            "(no real money moves; set STRIPE_SECRET_KEY for real Stripe)"
        )
        stopped = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stopped.set())
        signal.signal(signal.SIGINT, lambda *_: stopped.set())
        stopped.wait()
        stand_in.stop()
