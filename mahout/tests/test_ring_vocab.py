"""A token picked from two halves of the vocabulary is the token the specified sampler
(`protocol.sampling.select`) picks over the whole vocabulary: the same argmax, and the same
seeded draw, top_p < 1 included, so a verifier audits a ring's answer as any host's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mahout.ring.membership import Row
from mahout.ring.vocab import Sampler, picked, report, row_draw
from protocol.sampling import select


def halves(size: int) -> tuple[Sampler, Sampler]:
    """A head's and a tail's sampler over a vocabulary of `size` ids split in two (an odd size: unequal halves)."""
    half = size // 2
    return (
        Sampler(SimpleNamespace(weights=SimpleNamespace(vocab_lo=0))),  # type: ignore[arg-type]
        Sampler(SimpleNamespace(weights=SimpleNamespace(vocab_lo=half))),
    )  # type: ignore[arg-type]


def split_answer(logits: torch.Tensor, row: Row) -> tuple[int, dict | None]:
    """The ring's pick and its log-probabilities: the tail's mass (or its half whole), the head's
    part, the tail's token (`mahout.ring.stage`)."""
    head, tail = halves(logits.shape[0])
    half = logits.shape[0] // 2
    mass = tail.mass(row, logits[half:]) if row.temperature > 0 and not row.needs_whole else None
    whole = logits[half:] if row.needs_whole else None  # (the tail's `mass` frame carries them)
    theirs = head.head_pick(row, logits[:half], mass, whole)
    return tail.tail_pick(row, logits[half:], theirs), picked(theirs)


def split_pick(logits: torch.Tensor, row: Row) -> int:
    return split_answer(logits, row)[0]


def row(
    temperature: float, *, seed: int = 7, start: int = 0, top_p: float = 1.0, top_logprobs: int | None = None
) -> Row:
    return Row("r", start, 1, "decode", True, temperature, seed, top_p, top_logprobs)


class VocabSplitTests:
    def test_it_gives_the_whole_vocabularys_argmax(self) -> None:
        generator = torch.Generator().manual_seed(7)
        for _ in range(200):
            logits = torch.randn(101, generator=generator) * 5  # (V,), an odd size: halves of 50 and 51
            assert split_pick(logits, row(0.0)) == int(logits.argmax())

    def test_it_breaks_a_tie_towards_the_lower_id_like_one_argmax(self) -> None:
        logits = torch.zeros(8)
        logits[2] = logits[6] = 3.0
        assert split_pick(logits, row(0.0)) == 2 == int(logits.argmax())

    def test_a_sampled_token_is_the_specified_samplers_draw_over_the_whole_vocabulary(self) -> None:
        generator = torch.Generator().manual_seed(3)
        seen_halves = set()
        for position in range(400):
            logits = torch.randn(1001, generator=generator) * 3  # (V,)
            for temperature in (0.7, 1.2):
                drawn = row(temperature, seed=11, start=position)
                whole = select(logits.numpy(), temperature=temperature, top_p=1.0, u=row_draw(drawn))
                assert split_pick(logits, drawn) == whole, (position, temperature)
                seen_halves.add(whole >= 500)
        assert seen_halves == {False, True}  # both halves' ways were taken

    def test_a_tail_with_the_whole_output_head_draws_the_same(self) -> None:
        logits = torch.randn(300, generator=torch.Generator().manual_seed(5))
        whole = Sampler(SimpleNamespace(weights=SimpleNamespace(vocab_lo=0)))  # type: ignore[arg-type]
        for position in range(50):
            drawn = row(0.9, seed=2, start=position)
            assert whole.pick(drawn, logits) == split_pick(logits, drawn)

    def test_under_top_p_the_token_is_the_nucleus_draw_over_the_whole_vocabulary(self) -> None:
        generator = torch.Generator().manual_seed(9)
        seen_halves, outside_nucleus = set(), 0
        for position in range(300):
            logits = torch.randn(1001, generator=generator) * 3  # (V,)
            for temperature, top_p in ((0.7, 0.9), (1.2, 0.5), (1.0, 0.05)):
                drawn = row(temperature, seed=13, start=position, top_p=top_p)
                nucleus = select(logits.numpy(), temperature=temperature, top_p=top_p, u=row_draw(drawn))
                assert split_pick(logits, drawn) == nucleus, (position, temperature, top_p)
                seen_halves.add(nucleus >= 500)
                everything = select(logits.numpy(), temperature=temperature, top_p=1.0, u=row_draw(drawn))
                outside_nucleus += everything != nucleus
        assert seen_halves == {False, True}
        assert outside_nucleus > 100  # top_p changed the draw: a ring at top_p 1 would fail these audits

    def test_a_tail_with_the_whole_output_head_applies_top_p(self) -> None:
        logits = torch.randn(300, generator=torch.Generator().manual_seed(6)) * 3
        whole = Sampler(SimpleNamespace(weights=SimpleNamespace(vocab_lo=0)))  # type: ignore[arg-type]
        for position in range(50):
            drawn = row(0.9, seed=2, start=position, top_p=0.3)
            nucleus = select(logits.numpy(), temperature=0.9, top_p=0.3, u=row_draw(drawn))
            assert whole.pick(drawn, logits) == nucleus == split_pick(logits, drawn)

    def test_a_head_sent_no_logits_for_a_top_p_row_refuses_it(self) -> None:
        head, _ = halves(10)
        with pytest.raises(ValueError, match="no logits"):
            head.head_pick(row(0.8, top_p=0.5), torch.zeros(5), None, None)

    def test_log_probabilities_are_the_whole_vocabularys_and_the_draw_is_unchanged(self) -> None:
        generator = torch.Generator().manual_seed(4)
        whole = Sampler(SimpleNamespace(weights=SimpleNamespace(vocab_lo=0)))  # type: ignore[arg-type]
        for position in range(60):
            logits = torch.randn(1001, generator=generator) * 3  # (V,)
            expected = torch.log_softmax(logits.double(), dim=0)
            for temperature, top_p in ((0.0, 1.0), (0.8, 1.0), (1.1, 0.9)):
                asked = row(temperature, seed=5, start=position, top_p=top_p, top_logprobs=3)
                token, logprobs = split_answer(logits, asked)
                assert token == split_pick(logits, row(temperature, seed=5, start=position, top_p=top_p))
                assert token == whole.pick(asked, logits)
                assert logprobs == report(asked, logits, token)  # a tail holding the whole head reports the same
                assert abs(logprobs["logprob"] - float(expected[token])) < 1e-4
                best = torch.topk(expected, 3).indices.tolist()
                assert [t for t, _ in logprobs["top"]] == best
                assert all(abs(lp - float(expected[t])) < 1e-4 for t, lp in logprobs["top"])
        assert report(row(0.8), logits, 3) is None  # none asked: none computed
