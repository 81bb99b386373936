"""The one price rule: what a request costs, in integer micro-cents."""

from __future__ import annotations

from typing import Protocol


class Priced(Protocol):
    input_price_ucents: int
    output_price_ucents: int


def price(model: Priced, *, prompt_tokens: int, completion_tokens: int) -> int:
    """Every prompt token at the input price plus every output token at the output price.

    Admission prices the worst case (`completion_tokens` = max_tokens) to hold it;
    settlement prices what was counted.
    """
    return prompt_tokens * model.input_price_ucents + completion_tokens * model.output_price_ucents
