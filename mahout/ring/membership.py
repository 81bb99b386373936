"""What a packed batch is: its rows (the batch *membership*) and the limits a plan declares.

The head decides the membership of every pass; it travels in the frame header to every
downstream stage, which uses exactly that membership and never re-decides it. `Limits`
are declared by the plan up front: at most `micro_batch` rows per pass and at most
`row_width` tokens per row (a prefill longer than that is fed in chunks). They bound the
largest hidden state a stage receives, (micro_batch * row_width, D), and the largest result
the tail returns, (micro_batch, V).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.model import RowSpan

__all__ = ["BatchTooWide", "Limits", "Row", "rows_from_wire", "rows_to_wire"]

PREFILL = "prefill"
DECODE = "decode"


class BatchTooWide(ValueError):
    """A batch exceeds the row width or micro-batch the plan declared."""


@dataclass(frozen=True)
class Row:
    """One request's share of a pass: tokens at positions [start, start + n_tokens).

    `sample` is true when the tail must pick the next token after this row: a decode, or the
    last chunk of a prefill. `temperature` 0 means greedy; `seed` seeds sampling otherwise.
    """

    request_id: str
    start: int
    n_tokens: int
    kind: str
    sample: bool
    temperature: float = 0.0
    seed: int | None = None

    def span(self) -> RowSpan:
        return RowSpan(self.request_id, self.start, self.n_tokens)


def rows_to_wire(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]


def rows_from_wire(rows: Sequence[dict[str, Any]]) -> list[Row]:
    return [Row(**row) for row in rows]


@dataclass(frozen=True)
class Limits:
    """The plan's declared widths: rows per pass and tokens per row."""

    micro_batch: int
    row_width: int

    def __post_init__(self) -> None:
        if self.micro_batch <= 0 or self.row_width <= 0:
            raise ValueError("micro-batch and row width must be positive")

    def check(self, rows: Sequence[Row], n_tokens: int) -> None:
        """Refuse a batch this stage was not planned for (before any compute)."""
        if not rows:
            raise BatchTooWide("an empty batch")
        if len(rows) > self.micro_batch:
            raise BatchTooWide(f"batch of {len(rows)} rows exceeds the plan's micro-batch of {self.micro_batch}")
        widest = max(row.n_tokens for row in rows)
        if widest > self.row_width or min(row.n_tokens for row in rows) <= 0:
            raise BatchTooWide(f"a row of {widest} tokens exceeds the plan's row width of {self.row_width}")
        if sum(row.n_tokens for row in rows) != n_tokens:
            raise BatchTooWide(f"membership names {sum(r.n_tokens for r in rows)} tokens, the tensor holds {n_tokens}")
        if len({row.request_id for row in rows}) != len(rows):
            raise BatchTooWide("a request appears twice in one batch")
