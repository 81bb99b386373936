"""Runners do the work of a claimed job.

A text runner exposes ``stream(job) -> Iterator[str]`` and, once the iterator is exhausted,
(a job that asks for ``logprobs`` gets :class:`Piece` items: text with its tokens' entries)
``finish_reason`` ("stop" | "length") and ``completion_tokens`` for that job. An
embeddings runner exposes ``embed(texts) -> list[list[float]]`` and, after it,
``prompt_tokens``. Either may have ``close()``, which the loading policy calls on unload.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Protocol


class RequestRejected(ValueError):
    """The job's own content cannot be run (a parameter out of range, a prompt past the
    context): the customer's request is at fault, not this machine. mahout reports it as
    such, so it is no strike against the host."""


class Piece(str):
    """Generated text with the log-probability entries of exactly its tokens (OpenAI's
    `logprobs.content` items; their `token` strings, joined, are the text)."""

    logprobs: list[dict]

    def __new__(cls, text: str, logprobs: list[dict]) -> Piece:
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece


class LogprobsUnsupported(RuntimeError):
    """This runner cannot report log-probabilities (a ring stage, an expert mesh): the job
    is this host's failure, and continues on a host that can."""


class Runner(Protocol):
    """What the host loop needs from a text runner (llama.cpp, ring stages)."""

    finish_reason: str
    completion_tokens: int

    def stream(self, job: dict) -> Generator[str, None, None]:
        """Yield the generated text in order; set ``finish_reason`` and ``completion_tokens`` at the end."""
        ...


class Embedder(Protocol):
    """What the host loop needs from an embeddings runner."""

    prompt_tokens: int

    def embed(self, texts: list[str]) -> list[list[float]]:
        """One vector per text, in order; set ``prompt_tokens`` to the tokens embedded."""
        ...
