"""Picking the next token by the specified sampler (`protocol.sampling`) when the output
head may be split over two stages.

A ring shares the output head (`engine.model.output_share`): the head stage holds the
vocabulary's first rows, the tail the rest. Every token is the one the specified sampler
draws over the whole vocabulary, so a verifier holding the model can audit a ring's answer
as any host's (`scorer.verify`):

* Greedy: each side's candidate is its slice's argmax and its logit; the larger logit wins,
  the lower id on a tie (as one argmax over the whole vocabulary would).
* Sampled at temperature T: the draw is ``u = uniform(seed, position)`` over the whole
  vocabulary. Both compute their slice's logits at once; the tail sends the head its slice's
  mass (`protocol.sampling.part_mass`), and the head then knows which slice the draw falls in
  (`protocol.sampling.part_of_draw`): in its own, it draws the token there; in the tail's, it
  sends the tail the draw to make within its slice.
* Sampled with top_p < 1, or with log-probabilities asked for (`Row.needs_whole`): the nucleus
  is cut, and log-probabilities are normalised, over the whole vocabulary, so the tail sends the
  head its slice's logits whole (one float32 row of half the vocabulary per token: 0.5 MB for
  Gemma 3's 262,144 tokens), and the head picks with `protocol.sampling.select` (or the argmax)
  over both slices, exactly as over one output head, and sends the tail the token (with its
  log-probability and the likeliest alternatives, `report`).

A tail holding the whole output head draws with `protocol.sampling.select` directly.

Under a `response_format`'s grammar the stage that picks (the head when the output head is
shared, the tail when it holds it whole) holds the request's grammar, draws with
`protocol.sampling.select_masked` over the whole vocabulary, as a single-machine host does,
and feeds the grammar each token it picks.

Log-probabilities are the model's own (the log-softmax of the logits, before temperature or
top_p), as a single-machine host reports them (`mahout.runners.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.model import Stage
from mahout.ring.membership import Row
from mahout.runners.logprobs import LogprobRecorder, log_softmax
from protocol.sampling import part_mass, part_of_draw, select, select_masked, uniform

if TYPE_CHECKING:
    from scorer.healing import TokenHealer
    from scorer.llama import Grammar

__all__ = ["Healing", "Pick", "Sampler", "merge", "report", "whole_pick"]


@dataclass(frozen=True)
class Pick:
    """One slice's greedy candidate for a row's next token."""

    index: int  # vocabulary id
    value: float  # its logit


def merge(first: Pick, second: Pick) -> int:
    """The greedy token from the candidates of the lower (`first`) and the upper slice."""
    return first.index if first.value >= second.value else second.index


def row_draw(row: Row) -> float:
    """The draw for the token after `row`: its position is the number of tokens before it."""
    return uniform(row.seed or 0, row.start + row.n_tokens)


def report(row: Row, logits: torch.Tensor, token: int) -> dict | None:
    """The log-probability of `token` and the row's `top_logprobs` likeliest tokens (best
    first, as ``[id, logprob]``) over the whole vocabulary's `logits`; None when the row asked
    for none."""
    if row.top_logprobs is None:
        return None
    logprobs = log_softmax(logits.float().numpy())
    best = LogprobRecorder(prompt_len=0, top=row.top_logprobs).best(logprobs)
    return {"logprob": float(logprobs[token]), "top": [[t, float(logprobs[t])] for t in best]}


class Healing:
    """A request that resumes text, at the stage that picks: the text its first tokens must
    write again (`TokenHealer`) and what they have written so far."""

    def __init__(self, healer: TokenHealer) -> None:
        self.healer = healer
        self.produced = b""

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` as a single-machine host's sampler sees them: -inf where the text still to
        write again does not allow the token (a copy; unchanged once it is all written). Rows
        past the vocabulary's (a model's padded output head) are never allowed."""
        allowed = self.healer.mask(self.produced)
        if allowed is None:
            return logits
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        n = min(len(allowed), len(mask))
        mask[:n] = torch.from_numpy(allowed[:n])
        return logits.float().masked_fill(~mask, float("-inf"))

    def wrote(self, token: int) -> None:
        if len(self.produced) < len(self.healer.dropped):
            self.produced += self.healer.vocab.pieces[token]


def whole_pick(row: Row, logits: torch.Tensor, grammar: Grammar | None, healing: Healing | None = None) -> int:
    """The token the specified sampler picks from the whole vocabulary's `logits`: the argmax
    (greedy) or the seeded draw, under `grammar` the masked draw (`select_masked`, as a
    single-machine host draws), which the grammar then accepts; while `healing` writes text
    again, only among the tokens it allows (as a single-machine host's healer masks them)."""
    if grammar is None and row.grammar:
        raise ValueError(f"request {row.request_id} has no grammar at the stage that picks its tokens")
    if healing is None and row.heal:
        raise ValueError(f"request {row.request_id} has no healer at the stage that picks its tokens")
    if healing is not None:
        token = whole_pick(replace(row, heal=False), healing.masked(logits), grammar)
        healing.wrote(token)
        return token
    if grammar is None:
        if row.temperature <= 0:
            return int(logits.argmax())
        return select(logits.float().numpy(), temperature=row.temperature, top_p=row.top_p, u=row_draw(row))
    token = select_masked(
        logits.float().numpy(), grammar.allowed, temperature=row.temperature, top_p=row.top_p, u=row_draw(row)
    )
    grammar.accept(token)
    return token


def picked(theirs: list | dict) -> dict | None:
    """The log-probabilities the head's answer carries (`Sampler.head_pick`), if any."""
    return (
        {"logprob": theirs["logprob"], "top": theirs.get("top") or []}
        if isinstance(theirs, dict) and "logprob" in theirs
        else None
    )


class Sampler:
    """A stage's part of the pick, over its slice of the vocabulary (all of it at a tail that
    holds the whole output head)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """This stage's slice of the logits for final-normed `states`."""
        # states: (S, D) -> (S, V_s)
        return self.stage.logits(states)

    def pick(
        self, row: Row, logits: torch.Tensor, grammar: Grammar | None = None, healing: Healing | None = None
    ) -> int:
        """The token from the whole vocabulary's `logits` (a tail holding the whole output head),
        under the row's `grammar` and healer when it has them (`whole_pick`)."""
        # logits: (V,)
        return whole_pick(row, logits, grammar, healing)

    def greedy(self, logits: torch.Tensor) -> Pick:
        """This slice's greedy candidate."""
        # logits: (V_s,)
        best = int(logits.argmax())
        return Pick(self.stage.weights.vocab_lo + best, float(logits[best]))

    def mass(self, row: Row, logits: torch.Tensor) -> list[float]:
        """This slice's best logit and weight (`part_mass`), for the other slice's stage."""
        return list(part_mass(logits.float().numpy(), temperature=row.temperature))

    def draw(self, row: Row, logits: torch.Tensor, within: float) -> int:
        """The token the draw `within` this slice selects."""
        return self.stage.weights.vocab_lo + select(
            logits.float().numpy(), temperature=row.temperature, top_p=1.0, u=within
        )

    def head_pick(
        self,
        row: Row,
        logits: torch.Tensor,
        tail_mass: list[float] | None,
        tail_logits: torch.Tensor | None = None,
        grammar: Grammar | None = None,
        healing: Healing | None = None,
    ) -> list | dict:
        """The head's answer for one shared row: its greedy candidate; or, sampled, the token
        when the draw falls in its slice, else the draw the tail makes within its own; or, when
        the pick `needs_whole` (top_p < 1, log-probabilities, a grammar), the token picked over both
        slices' logits (`tail_logits`, the tail's whole), with its log-probabilities (`report`)."""
        if row.needs_whole:
            if tail_logits is None:
                raise ValueError(
                    f"the tail sent no logits for request {row.request_id} (top_p < 1, logprobs or a grammar)"
                )
            whole = torch.cat([logits.float(), tail_logits.float()])  # (V,): the head's slice starts at id 0
            token = whole_pick(row, whole, grammar, healing)
            return {"token": token, **(report(row, whole, token) or {})}
        if row.temperature <= 0:
            pick = self.greedy(logits)
            return [pick.index, pick.value]
        if tail_mass is None:
            raise ValueError(f"the tail sent no mass for sampled request {row.request_id}")
        parts = [
            part_mass(logits.float().numpy(), temperature=row.temperature),
            (float(tail_mass[0]), float(tail_mass[1])),
        ]
        part, within = part_of_draw(parts, temperature=row.temperature, u=row_draw(row))
        return {"token": self.draw(row, logits, within)} if part == 0 else {"within": within}

    def tail_pick(self, row: Row, logits: torch.Tensor, theirs: list | dict) -> int:
        """The token from the head's answer (`head_pick`) and this tail's slice of the logits."""
        if isinstance(theirs, dict) and "token" in theirs:
            return int(theirs["token"])
        if row.temperature <= 0:
            index, value = theirs  # type: ignore[misc]
            return merge(Pick(int(index), float(value)), self.greedy(logits))
        return self.draw(row, logits, float(theirs["within"]))  # type: ignore[call-overload]
