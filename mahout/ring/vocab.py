"""Picking the next token when the output head is split over two stages.

A ring shares the output head (`engine.model.output_share`): the head stage holds the
vocabulary's first rows, the tail the rest. Each side picks a candidate from its own slice
and reduces the slice to one number; the tail merges the two candidates into the token.

* Greedy: the candidate is the slice's argmax and the number its logit; the larger logit
  wins, the lower ids on a tie (as one argmax over the whole vocabulary would).
* Sampling at temperature T: the candidate is drawn from the slice's own softmax and the
  number is the slice's log-sum-exp of logits / T. Choosing the first slice with probability
  e^a / (e^a + e^b) then gives each token exactly its probability under the full softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model import Stage
from mahout.ring.membership import Row

__all__ = ["Pick", "Sampler", "merge", "pick_in_slice"]


@dataclass(frozen=True)
class Pick:
    """One slice's candidate for a row's next token."""

    index: int  # vocabulary id
    value: float  # greedy: its logit; sampling: the slice's log-sum-exp of logits / T


def pick_in_slice(logits: torch.Tensor, *, lo: int, temperature: float, generator: torch.Generator | None) -> Pick:
    """The candidate of vocabulary rows [lo, lo + V_s) from their logits."""
    # logits: (V_s,)
    if temperature <= 0:
        best = int(logits.argmax())
        return Pick(lo + best, float(logits[best]))
    scaled = logits / temperature  # (V_s,)
    drawn = int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))
    return Pick(lo + drawn, float(torch.logsumexp(scaled, dim=-1)))


def merge(first: Pick, second: Pick, *, temperature: float, generator: torch.Generator | None) -> int:
    """The token from the candidates of the lower (`first`) and the upper slice."""
    if temperature <= 0:
        return first.index if first.value >= second.value else second.index
    p_first = 1.0 / (1.0 + math.exp(min(second.value - first.value, 700.0)))
    u = float(torch.rand((), generator=generator))
    return first.index if u < p_first else second.index


class Sampler:
    """A stage's candidates from its slice of the vocabulary, each request on its own random stream.

    `stream` offsets each request's seed: the tail draws from the request's seed (0), the
    head's share of the output head from a stream of its own (1).
    """

    def __init__(self, stage: Stage, *, stream: int) -> None:
        self.stage = stage
        self.stream = stream
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, row: Row) -> torch.Generator | None:
        """The row's request's random stream (None when greedy)."""
        if row.temperature <= 0:
            return None
        generator = self._generators.get(row.request_id)
        if generator is None:
            seed = (row.seed or 0) + self.stream
            generator = self._generators[row.request_id] = torch.Generator().manual_seed(seed)
        return generator

    def pick(self, row: Row, logits: torch.Tensor) -> Pick:
        """The row's candidate from this stage's logits."""
        # logits: (V_s,) of vocabulary rows [vocab_lo, vocab_lo + V_s)
        lo = self.stage.weights.vocab_lo
        return pick_in_slice(logits, lo=lo, temperature=row.temperature, generator=self.generator(row))

    def slice_picks(self, rows: list[Row], states: torch.Tensor) -> list[Pick]:
        """Each row's candidate from final-normed states, one per row."""
        # states: (S, D)
        logits = self.stage.logits(states)  # (S, V_s)
        return [self.pick(row, logits[i]) for i, row in enumerate(rows)]

    def forget(self, request_id: str) -> None:
        """Drop the random stream of a request that ended."""
        self._generators.pop(request_id, None)
