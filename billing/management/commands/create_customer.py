"""`create_customer EMAIL --credit USD [--cap USD]`: the last line printed is a new API key."""

from __future__ import annotations

import uuid

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from accounts.services import api_key_create
from billing.services import credit_grant
from catalog.money import usd, usd_to_ucents


class Command(BaseCommand):
    help = "Create (or reuse) a customer, grant credit, and print a new API key on the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("email")
        parser.add_argument("--credit", default="0", help="credit to grant, in USD (e.g. 5 or 0.25)")
        parser.add_argument("--cap", default=None, help="spend cap for the new key, in USD")
        parser.add_argument("--key-name", default="default")

    def handle(self, *args: object, email: str, credit: str, cap: str | None, key_name: str, **options: object) -> None:
        try:
            credit_ucents = usd_to_ucents(credit)
            cap_ucents = None if cap is None else usd_to_ucents(cap)
        except ValueError as error:
            raise CommandError(str(error)) from None
        if credit_ucents < 0 or (cap_ucents is not None and cap_ucents < 0):
            raise CommandError("credit and cap must not be negative")
        with transaction.atomic():
            user, created = get_user_model().objects.get_or_create(username=email, defaults={"email": email})
            if credit_ucents:
                credit_grant(
                    user=user, amount_ucents=credit_ucents, reference=f"cli-{uuid.uuid4()}", memo="create_customer"
                )
            new = api_key_create(user=user, name=key_name, spend_cap_ucents=cap_ucents)
        self.stdout.write(f"{'Created' if created else 'Found'} customer {email}; granted {usd(credit_ucents)}.")
        self.stdout.write(new.secret)
