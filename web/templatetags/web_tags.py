from __future__ import annotations

from django import template

from catalog.money import per_million, usd

register = template.Library()
register.filter("usd", usd)
register.filter("per_million", per_million)


@register.filter
def pct(fraction: float | None) -> str:
    """A share as a percentage with one decimal (0.925 → 92.5%); a dash when there is none yet."""
    return "–" if fraction is None else f"{fraction:.1%}"


@register.filter
def thousands(count: int | None) -> str:
    """A count with thousands separators (1234567 → 1,234,567)."""
    return f"{count or 0:,}"
