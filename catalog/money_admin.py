"""Money in the admin as people read it: the admin shows a stored amount in dollars
(`catalog.money.usd`; a price per token as dollars per million tokens), never the raw µ¢
("$4.99968700", not "499968700"). Formatting only: a field an operator edits keeps its raw
integer in the form, with its help text saying the unit.

Money fields are found by name: `*_ucents` (µ¢) and `*_cents` (Stripe's cents, TopUp).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest

from catalog.money import UCENTS_PER_CENT, per_million, usd


def is_money(name: object) -> bool:
    return isinstance(name, str) and (name.endswith("_ucents") or name.endswith("_cents"))


@cache
def usd_column(field: str) -> Callable[[Model], str]:
    """A column (or read-only field) that shows `field` in dollars; one function per field
    name, so the admin finds the same one in its fields and its read-only fields."""
    label = field.removesuffix("_ucents").removesuffix("_cents").replace("_", " ")

    @admin.display(description=label, ordering=field)
    def column(obj: Model) -> str:
        value = getattr(obj, field)
        if value is None:
            return "—"
        if "price" in field:
            return f"{per_million(value)} / 1M tokens"
        return usd(value * UCENTS_PER_CENT if not field.endswith("_ucents") else value)

    column.__name__ = column.__qualname__ = f"{field}_usd"
    return column


def _swap(names: Sequence[Any], shown: set[str]) -> list[Any]:
    swapped: list[Any] = []
    for name in names:
        entry = usd_column(name) if name in shown else name
        if entry not in swapped:
            swapped.append(entry)
    return swapped


class MoneyAdmin(admin.options.BaseModelAdmin):
    """For a ModelAdmin or an inline: every money column of the list, and every money field
    its change page only shows (read-only, or all of them to someone who may only view), in
    dollars. Editable money fields stay raw integers."""

    def _money_shown(self, request: HttpRequest, obj: Model | None) -> set[str]:
        names = {field.name for field in self.model._meta.fields if is_money(field.name)}
        if obj is not None and not self.has_change_permission(request, obj):
            return names
        return names & {name for name in super().get_readonly_fields(request, obj) if isinstance(name, str)}

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[Any]:
        shown = self._money_shown(request, obj)
        return _swap([*super().get_readonly_fields(request, obj), *sorted(shown)], shown)

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> list[Any]:
        return _swap(super().get_fields(request, obj), self._money_shown(request, obj))

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        # (ModelAdmin's: MoneyAdmin comes before it in a ModelAdmin's bases; an inline has no list)
        names = super().get_list_display(request)  # type: ignore[misc]
        return [usd_column(name) if is_money(name) else name for name in names]
