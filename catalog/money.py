"""Money as the system counts it, and as people read it.

Every amount is an integer of micro-cents (µ¢): 1 USD = 100,000,000 µ¢. Amounts
are written exactly (Decimal, never float), wherever they are shown: pages,
admin, error messages, command output.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

UCENTS_PER_USD = 100_000_000
UCENTS_PER_CENT = 1_000_000


def usd(ucents: int | None) -> str:
    """$1,234.50 for whole cents; anything finer is written exactly ($0.0000004, $3.12345678)."""
    value = Decimal(ucents or 0) / UCENTS_PER_USD
    sign = "-" if value < 0 else ""
    value = abs(value)
    cents = value.quantize(Decimal("0.01"))
    if cents == value:
        return f"{sign}${cents:,.2f}"
    return f"{sign}${value.quantize(Decimal('0.00000001')).normalize():,f}"


def usd_decimal(ucents: int) -> str:
    """An amount as a plain decimal string of dollars with all 8 places ("0.12345678"), for APIs."""
    return f"{Decimal(ucents) / UCENTS_PER_USD:.8f}"


def per_million(ucents_per_token: int) -> str:
    """A per-token price as dollars per million tokens."""
    return usd(ucents_per_token * 1_000_000)


def usd_to_ucents(amount: str | float | int | Decimal) -> int:
    """Exact conversion of a decimal USD amount (as typed by a person) to µ¢."""
    try:
        value = Decimal(str(amount)) * UCENTS_PER_USD
    except InvalidOperation:
        raise ValueError(f"{amount!r} is not an amount in USD") from None
    if value != value.to_integral_value():
        raise ValueError(f"{amount!r} has more precision than a micro-cent")
    return int(value)


def usd_per_million_to_ucents(amount: str) -> int:
    """A price as a person types it, USD per million tokens, as the µ¢ per token the ledger
    charges: "0.10" -> 10. Refuses (ValueError saying why) anything but a non-negative number
    that is a whole number of µ¢ per token ("0.105" would be 10.5 µ¢)."""
    try:
        value = Decimal(amount.strip())
    except InvalidOperation:
        raise ValueError(f"{amount!r} is not a number of USD per million tokens") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"{amount!r} is not a non-negative number of USD per million tokens")
    per_token = value * UCENTS_PER_USD / 1_000_000
    if per_token != per_token.to_integral_value():
        raise ValueError(
            f"{amount!r} USD per million tokens is {per_token.normalize():f} µ¢ per token, "
            f"not a whole number of µ¢ (1 µ¢ per token = $0.01 per million tokens)"
        )
    if per_token >= 2**63:
        raise ValueError(f"{amount!r} USD per million tokens is too large")
    return int(per_token)


def usd_per_token(ucents_per_token: int) -> str:
    """A per-token price as OpenRouter's `pricing` writes it: plain USD per token, exact ("0.0000001" for 10 µ¢)."""
    return format((Decimal(ucents_per_token) / UCENTS_PER_USD).normalize(), "f")
