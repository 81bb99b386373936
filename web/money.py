"""How the pages write amounts: micro-cents as dollars, exact (Decimal, never float)."""
from __future__ import annotations

from decimal import Decimal

from billing.models import UCENTS_PER_USD


def usd(ucents: int | None) -> str:
    """$1,234.50 for whole cents; anything finer is written exactly ($0.0000004, $3.12345678)."""
    value = Decimal(ucents or 0) / UCENTS_PER_USD
    sign = "-" if value < 0 else ""
    value = abs(value)
    cents = value.quantize(Decimal("0.01"))
    if cents == value:
        return f"{sign}${cents:,.2f}"
    return f"{sign}${value.quantize(Decimal('0.00000001')).normalize():,f}"


def per_million(ucents_per_token: int) -> str:
    """A per-token price as dollars per million tokens."""
    return usd(ucents_per_token * 1_000_000)
