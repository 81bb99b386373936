from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.generate import build_stages, even_split, generate, run_stages
from engine.model import Stage

PROMPT = [2, 818, 5279, 529, 7001, 563]  # "The capital of France is"
DECODE_TOKENS = 8


class EvenSplitTests:
    def test_it_covers_every_layer_once_in_contiguous_slices(self) -> None:
        assert even_split(18, 4) == [(0, 4), (4, 9), (9, 14), (14, 18)]
        assert even_split(18, 1) == [(0, 18)]

    def test_it_refuses_more_stages_than_layers(self) -> None:
        with pytest.raises(ValueError):
            even_split(2, 3)


class SplitStagesTests:
    @pytest.mark.parametrize("n_stages", [2, 3, 4])
    def test_it_matches_one_stage_over_all_layers(self, n_stages: int, model_path: Path, full_stage: Stage) -> None:
        stages = build_stages(model_path, even_split(18, n_stages), n_rows=1, n_ctx=64)
        for stage in stages:
            assert {name.split(".")[1] for name in stage.weights.names if name.startswith("blk.")} == {
                str(i) for i in range(stage.start, stage.end)
            }
        n = len(PROMPT)
        args = (torch.tensor(PROMPT), torch.arange(n), torch.zeros(n, dtype=torch.long))
        want: dict[int, torch.Tensor] = {}
        full_logits = full_stage(*args, capture=want)  # (n, V)
        got: dict[int, torch.Tensor] = {}
        x = args[0]
        for stage in stages:
            x = stage(x, args[1], args[2], capture=got)
        for stage in stages[:-1]:  # every boundary a stage hands over
            boundary = stage.end - 1
            assert torch.allclose(got[boundary], want[boundary], atol=1e-5, rtol=1e-5), boundary
        assert torch.allclose(x, full_logits, atol=1e-4, rtol=1e-5)

        split = generate(stages, PROMPT, DECODE_TOKENS)
        single = generate([full_stage], PROMPT, DECODE_TOKENS)
        assert split.token_ids == single.token_ids
        del stages
        gc.collect()

    def test_it_hands_only_hidden_states_between_stages(self, model_path: Path) -> None:
        stages = build_stages(model_path, [(0, 1), (1, 2)], n_rows=1, n_ctx=8)
        # A two-stage chain of the first layers alone has no tail; its output is the boundary.
        hidden = run_stages(
            stages, torch.tensor(PROMPT), torch.arange(len(PROMPT)), torch.zeros(len(PROMPT), dtype=torch.long)
        )
        assert hidden.shape == (len(PROMPT), 640)
