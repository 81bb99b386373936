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

__all__ = ["Pick", "merge", "pick_in_slice"]


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
