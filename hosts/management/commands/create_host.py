"""`create_host EMAIL NAME`: the last line printed is a new host token."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError

from accounts.services import AccountUnconfirmed
from hosts.services import MachineLimitReached, host_create


class Command(BaseCommand):
    help = "Create a host for the owner EMAIL and print its token on the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("email")
        parser.add_argument("name")

    def handle(self, *args: object, email: str, name: str, **options: object) -> None:
        try:
            new = host_create(email=email, name=name)
        except IntegrityError:
            raise CommandError(f"{email} already has a host named {name!r}") from None
        except (AccountUnconfirmed, MachineLimitReached) as refusal:
            raise CommandError(str(refusal)) from None
        self.stdout.write(f"Created host {name!r} for {email}. Run it with: mahout run --server URL --token TOKEN")
        self.stdout.write(new.token)
