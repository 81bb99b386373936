"""Replay the ledger and report any drift; exit status 1 if the books are not straight.

python manage.py reconcile [--release-orphans]
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing import selectors, services


class Command(BaseCommand):
    help = "Replay the ledger: balanced transactions, cached balances, orphaned holds, Stripe and payout totals."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--release-orphans", action="store_true", help="first release holds whose request ended")

    def handle(self, *args: object, **options: object) -> None:
        if options["release_orphans"]:
            released = 0
            while services.orphaned_hold_release_one():
                released += 1
            self.stdout.write(f"released {released} orphaned hold(s)")
        problems = selectors.reconcile_report()
        if problems:
            for problem in problems:
                self.stderr.write(f"DRIFT  {problem}")
            raise CommandError(f"reconcile: {len(problems)} problem(s) found")
        self.stdout.write(
            f"reconcile: ok — ledger total {selectors.ledger_total()} µ¢, every transaction balances, caches match"
        )
