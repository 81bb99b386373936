from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.generate import build_stages
from engine.gguf_loader import load_stage
from engine.model import Config, ContextOverflowError, KVCache, RowSpan, Stage

# Weights are float16 and every product's inputs and outputs are rounded to float16, so a row
# packed with others (the float32 kernel) and alone (the float16 kernel) can differ by an ulp
# here and there; through 18 layers that is up to ~0.02 on logits of ~15 (seen: 0.017).
PACKED_ATOL = 0.05
PROMPT_A = [2, 818, 5279, 529, 7001, 563, 496]  # "The capital of France is a"
PROMPT_B = [2, 2063, 11742, 496, 880]


def solo(stage: Stage, prompt: list[int], decoded: list[int], row: int) -> list[torch.Tensor]:
    """Logits of the prompt's last token, then of each decoded token, one request alone."""
    n = len(prompt)
    rows = torch.full((n,), row)
    out = [stage(torch.tensor(prompt), torch.arange(n), rows, torch.tensor([n - 1]))[0]]
    for step, token in enumerate(decoded):
        out.append(stage(torch.tensor([token]), torch.tensor([n + step]), torch.tensor([row]))[0])
    return out  # each (V,)


class StageBatchTests:
    def test_it_gives_each_request_in_a_packed_batch_its_solo_results(self, full_stage: Stage) -> None:
        a_row, b_row = full_stage.cache.assign("req-a"), full_stage.cache.assign("req-b")
        decoded_a, decoded_b = [506, 5279], [236764]
        alone_a = solo(full_stage, PROMPT_A, decoded_a, a_row)
        alone_b = solo(full_stage, PROMPT_B, decoded_b, b_row)

        na, nb = len(PROMPT_A), len(PROMPT_B)
        first_a = full_stage(torch.tensor(PROMPT_A), torch.arange(na), torch.full((na,), a_row), torch.tensor([na - 1]))
        # One pass: request A decodes its first token while request B prefills its prompt.
        ids = torch.tensor([decoded_a[0], *PROMPT_B])  # (1 + nb,)
        positions = torch.tensor([na, *range(nb)])
        rows = torch.tensor([a_row] + [b_row] * nb)
        mixed = full_stage(ids, positions, rows, torch.tensor([0, nb]))  # (2, V)
        # Next pass: both decode, at different positions.
        both = full_stage(
            torch.tensor([decoded_a[1], decoded_b[0]]), torch.tensor([na + 1, nb]), torch.tensor([a_row, b_row])
        )  # (2, V)

        for got, want in [
            (first_a[0], alone_a[0]),
            (mixed[0], alone_a[1]),
            (mixed[1], alone_b[0]),
            (both[0], alone_a[2]),
            (both[1], alone_b[1]),
        ]:
            assert torch.allclose(got, want, atol=PACKED_ATOL, rtol=0), float((got - want).abs().max())
            assert int(got.argmax()) == int(want.argmax())
        full_stage.cache.release("req-a")
        full_stage.cache.release("req-b")


class StageContextTests:
    def test_it_raises_a_clear_error_past_the_context(self, model_path: Path) -> None:
        config, weights = load_stage(model_path, 3, 4)
        stage = Stage(config, weights, 3, 4, n_rows=2, n_ctx=8)
        hidden = torch.randn(8, config.d_model)  # (T, D)
        stage(hidden, torch.arange(8), torch.zeros(8, dtype=torch.long))
        before = stage.cache.k.clone()
        with pytest.raises(ContextOverflowError, match="position 8 of cache row 1 is past the context window of 8"):
            stage(hidden[:2], torch.tensor([7, 8]), torch.tensor([1, 1]))
        assert torch.equal(stage.cache.k, before), "nothing is written when a batch overflows"

    def test_it_refuses_a_cache_longer_than_the_model_context(self, config: Config) -> None:
        with pytest.raises(ValueError, match="exceeds the model's context length"):
            KVCache(config, n_layers=1, n_rows=1, n_ctx=config.context_length + 1)


class StageSliceTests:
    def test_it_runs_a_middle_slice_on_hidden_states(self, model_path: Path) -> None:
        config, weights = load_stage(model_path, 3, 5)
        stage = Stage(config, weights, 3, 5, n_rows=1, n_ctx=16)
        out = stage(torch.randn(4, config.d_model), torch.arange(4), torch.zeros(4, dtype=torch.long))
        assert out.shape == (4, config.d_model)

    def test_it_refuses_weights_of_another_range(self, model_path: Path) -> None:
        config, weights = load_stage(model_path, 3, 4)
        with pytest.raises(ValueError, match=r"weights hold layers \[3, 4\)"):
            Stage(config, weights, 3, 5)


class KVCacheTests:
    def test_it_gives_each_request_its_own_row_until_released(self, config: Config) -> None:
        cache = KVCache(config, n_layers=1, n_rows=2, n_ctx=4)
        assert (cache.assign("a"), cache.assign("b"), cache.assign("a")) == (0, 1, 0)
        with pytest.raises(RuntimeError, match="all 2 KV cache rows are taken"):
            cache.assign("c")
        cache.release("a")
        assert cache.assign("c") == 0


class StageMembershipTests:
    def test_it_forwards_one_batch_membership_through_every_stage(self, model_path: Path, full_stage: Stage) -> None:
        ring = build_stages(model_path, [(0, 9), (9, 18)], n_rows=2, n_ctx=32)
        alone_a = solo(full_stage, PROMPT_A, [506], row=0)
        alone_b = solo(full_stage, PROMPT_B, [], row=1)

        def one_pass(x: torch.Tensor, membership: list[RowSpan]) -> torch.Tensor:
            for stage in ring:  # the same membership at every hop, never re-decided
                x = stage.forward_rows(x, membership)
            return x

        na = len(PROMPT_A)
        first = one_pass(torch.tensor(PROMPT_A), [RowSpan("a", 0, na)])  # (1, V)
        # Request A decodes while request B prefills, in one pass through both stages.
        mixed = one_pass(
            torch.tensor([506, *PROMPT_B]), [RowSpan("a", na, 1), RowSpan("b", 0, len(PROMPT_B))]
        )  # (2, V)

        assert [stage.cache.row_of("b") for stage in ring] == [1, 1]
        for got, want in [(first[0], alone_a[0]), (mixed[0], alone_a[1]), (mixed[1], alone_b[0])]:
            assert torch.allclose(got, want, atol=PACKED_ATOL, rtol=0), float((got - want).abs().max())
