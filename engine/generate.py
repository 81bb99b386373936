"""Chain stages in one process and decode: the single-process path (`python -m engine
generate`) and the reference the split and ring tests compare against."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.gguf_loader import load_stage
from engine.model import Stage

__all__ = ["Generation", "build_stages", "even_split", "generate", "run_stages"]


def even_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `n_stages` contiguous slices, sizes differing by at most one."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def build_stages(
    model_path: str | Path,
    ranges: Sequence[tuple[int, int]],
    *,
    n_rows: int = 4,
    n_ctx: int = 1024,
    share_output: bool = False,
    device: torch.device | str = "cpu",
) -> list[Stage]:
    """One Stage per range, each loading only its own tensors (`share_output`: as a ring's
    stages do, the head and the tail each hold half of the output head) on `device`."""
    stages = []
    for start, end in ranges:
        config, weights = load_stage(model_path, start, end, share_output=share_output)
        stages.append(Stage(config, weights, start, end, n_rows=n_rows, n_ctx=n_ctx, device=device))
    return stages


def run_stages(
    stages: Sequence[Stage],
    x: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    logits_for: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hand the boundary (hidden state) from each stage to the next, as the ring does."""
    # x: (T,) token ids -> ... (T, D) hidden ... -> (T', V) logits
    for stage in stages:
        x = stage(x, positions, cache_rows, logits_for if stage.is_tail else None)
    return x


@dataclass
class Generation:
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    first_logits: torch.Tensor = field(repr=False)  # (V,) logits after the prompt

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1  # the first token comes out of the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


def generate(
    stages: Sequence[Stage],
    prompt_ids: list[int],
    max_tokens: int,
    *,
    row: int = 0,
    stop_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Generation:
    """Prefill the prompt into cache row `row`, then decode one token per pass (greedy when
    temperature is 0)."""
    rows = torch.full((len(prompt_ids),), row, dtype=torch.long)  # (P,)
    started = time.perf_counter()
    logits = run_stages(
        stages, torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), rows, torch.tensor([len(prompt_ids) - 1])
    )[0]  # (V,)
    prefill_s = time.perf_counter() - started
    first_logits, out = logits, []
    started = time.perf_counter()
    for step in range(max_tokens):
        token = _pick(logits, temperature, generator)
        out.append(token)
        if token in stop_ids or step == max_tokens - 1:
            break
        position = torch.tensor([len(prompt_ids) + step])
        logits = run_stages(stages, torch.tensor([token]), position, torch.tensor([row]))[0]  # (V,)
    return Generation(out, prefill_s, time.perf_counter() - started, first_logits)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    # logits: (V,)
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator))
