"""What a packed batch is: its rows (the batch *membership*) and the limits a plan declares.

The head decides the membership of every pass; it travels in the frame header to every
downstream stage, which uses exactly that membership and never re-decides it. `Limits`
are declared by the plan up front: at most `micro_batch` rows per pass and at most
`row_width` tokens per row (a prefill longer than that is fed in chunks). They bound the
largest hidden state a stage receives, (micro_batch * row_width, D), and the largest result
the tail returns, (micro_batch, V); `Limits.frame_caps` turns that bound into the largest
frame a stage reads at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.model import RowSpan
from mahout.link import FrameCaps

__all__ = ["BatchTooWide", "Limits", "Row", "rows_from_wire", "rows_to_wire"]

PREFILL = "prefill"
DECODE = "decode"
FLOAT32_BYTES = 4
HEADER_MARGIN_BYTES = 64 * 1024  # stats, errors, a pass's other fields
ROW_HEADER_BYTES = 512  # one row of a membership in JSON (request id, positions, sampling)
PROMPT_ID_BYTES = 12  # one prompt token id in a submit's JSON ("262143, " is 8)
GRAMMAR_MAX_BYTES = 256 * 1024  # a response_format's grammar (GBNF) a submit may carry to the stage that picks


class BatchTooWide(ValueError):
    """A batch exceeds the row width or micro-batch the plan declared."""


@dataclass(frozen=True)
class Row:
    """One request's share of a pass: tokens at positions [start, start + n_tokens).

    `sample` is true when the tail must pick the next token after this row: a decode, or the
    last chunk of a prefill. `temperature` 0 means greedy; `seed` seeds sampling otherwise,
    and `top_p` below 1 keeps only the nucleus (`protocol.sampling`). `top_logprobs`: report
    the token's log-probability and that many likeliest alternatives (None: none). `grammar`:
    the token is drawn under the request's grammar (a response_format's), held by the stage
    that picks (`mahout.ring.stage`). `heal`: the request resumes text, so its first tokens
    write its cut last word again under a healer's mask (`scorer.healing.TokenHealer`),
    held there too.
    """

    request_id: str
    start: int
    n_tokens: int
    kind: str
    sample: bool
    temperature: float = 0.0
    seed: int | None = None
    top_p: float = 1.0
    top_logprobs: int | None = None
    grammar: bool = False
    heal: bool = False

    @property
    def needs_whole(self) -> bool:
        """Its pick needs the whole vocabulary's logits in one place: the nucleus of top_p < 1
        is cut over all of them, log-probabilities are normalised over all of them, and a
        grammar's masked draw weighs all of them, and so does a healer's (a request that resumes text
        writes its cut last word again under a mask over the whole vocabulary)."""
        return self.grammar or self.heal or self.top_logprobs is not None or (self.temperature > 0 and self.top_p < 1)

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

    def frame_caps(self, *, d_model: int, n_ctx: int, tail_vocab: int = 0) -> FrameCaps:
        """The largest frame a stage of this plan reads: a pass's hidden state, at most
        micro_batch x row_width rows of `d_model` float32 (the shared output head's states
        are micro_batch rows, fewer), and a header that may carry a whole prompt (a submit
        within the `n_ctx` window, with a grammar of at most GRAMMAR_MAX_BYTES) or a full
        membership. A head sharing the output head also reads the tail's logits for the rows
        whose pick needs them whole (`Row.needs_whole`): micro_batch rows of `tail_vocab` float32.
        Anything larger is refused unread."""
        payload = max(self.micro_batch * self.row_width * d_model, self.micro_batch * tail_vocab) * FLOAT32_BYTES
        header = HEADER_MARGIN_BYTES + n_ctx * PROMPT_ID_BYTES + GRAMMAR_MAX_BYTES + self.micro_batch * ROW_HEADER_BYTES
        return FrameCaps(header_bytes=header, payload_bytes=payload)

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
