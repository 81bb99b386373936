"""A token picked from two halves of the vocabulary is the token one pick over the whole
vocabulary gives: the same argmax, and samples with the full softmax's frequencies."""
from __future__ import annotations

import torch

from mahout.ring.vocab import merge, pick_in_slice


def split_pick(logits: torch.Tensor, temperature: float, first: torch.Generator | None, second: torch.Generator | None) -> int:
    half = logits.shape[0] // 2
    low = pick_in_slice(logits[:half], lo=0, temperature=temperature, generator=first)
    high = pick_in_slice(logits[half:], lo=half, temperature=temperature, generator=second)
    return merge(low, high, temperature=temperature, generator=second)


class VocabSplitTests:
    def test_it_gives_the_whole_vocabularys_argmax(self) -> None:
        generator = torch.Generator().manual_seed(7)
        for _ in range(200):
            logits = torch.randn(101, generator=generator) * 5  # (V,), an odd size: halves of 50 and 51
            assert split_pick(logits, 0.0, None, None) == int(logits.argmax())

    def test_it_breaks_a_tie_towards_the_lower_id_like_one_argmax(self) -> None:
        logits = torch.zeros(8)
        logits[2] = logits[6] = 3.0
        assert split_pick(logits, 0.0, None, None) == 2 == int(logits.argmax())

    def test_it_samples_each_token_with_its_full_softmax_probability(self) -> None:
        logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, 3.0, -0.5, 1.5])  # (V,) = (8,)
        temperature = 0.8
        expected = torch.softmax(logits / temperature, dim=-1)
        first, second = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
        draws = 20_000
        counts = torch.bincount(torch.tensor([split_pick(logits, temperature, first, second) for _ in range(draws)]), minlength=8)
        assert torch.allclose(counts / draws, expected, atol=0.01), (counts / draws, expected)

    def test_it_is_reproducible_for_a_seed(self) -> None:
        logits = torch.randn(64, generator=torch.Generator().manual_seed(3))

        def run() -> list[int]:
            first, second = torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)
            return [split_pick(logits, 1.0, first, second) for _ in range(50)]

        assert run() == run()
