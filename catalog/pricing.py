"""The one price rule: what a request costs, in integer micro-cents."""

from __future__ import annotations

from typing import Protocol

CACHED_SHARE_DEFAULT = 4  # a cached prompt token costs a quarter of an input token unless the catalog says otherwise


class Priced(Protocol):
    input_price_ucents: int
    output_price_ucents: int
    cached_input_price_ucents: int | None


def price(model: Priced, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> int:
    """Every prompt token at the input price, but the `cached_tokens` of them (a prefix a host
    already holds, decided by the gateway at admission) at the cached price, plus every output
    token at the output price.

    Admission prices the worst case (`completion_tokens` = max_tokens) to hold it;
    settlement prices what was counted.
    """
    cached = min(max(cached_tokens, 0), prompt_tokens)
    return (
        (prompt_tokens - cached) * model.input_price_ucents
        + cached_price(model, cached)
        + completion_tokens * model.output_price_ucents
    )


def cached_price(model: Priced, cached_tokens: int) -> int:
    """`cached_tokens` at the model's cached price: the operator's, else a quarter of the input
    price, rounded up once per request (integer micro-cents)."""
    per_token = getattr(model, "cached_input_price_ucents", None)
    if per_token is not None:
        return cached_tokens * per_token
    return -(-cached_tokens * model.input_price_ucents // CACHED_SHARE_DEFAULT)
