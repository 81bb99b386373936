"""Runners turn a claimed job into streamed text.

A runner exposes ``stream(job) -> Iterator[str]`` and, once the iterator is exhausted,
``finish_reason`` ("stop" | "length") and ``completion_tokens`` for that job.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Protocol


class Runner(Protocol):
    """What the host loop needs from a runner (llama.cpp today; ring stages later)."""

    finish_reason: str
    completion_tokens: int

    def stream(self, job: dict) -> Generator[str, None, None]:
        """Yield the generated text in order; set ``finish_reason`` and ``completion_tokens`` at the end."""
        ...
