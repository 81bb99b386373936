"""Runners do the work of a claimed job.

A text runner exposes ``stream(job) -> Iterator[str]`` and, once the iterator is exhausted,
(a job that asks for ``logprobs`` gets :class:`Piece` items: text with its tokens' entries)
``finish_reason`` ("stop" | "length") and ``completion_tokens`` for that job. An
embeddings runner exposes ``embed(texts) -> list[list[float]]`` and, after it,
``prompt_tokens``. Either may have ``close()``, which the loading policy calls on unload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator
from typing import Protocol

from scorer.errors import RequestRejected


class Piece(str):
    """Generated text with the log-probability entries of exactly its tokens (OpenAI's
    `logprobs.content` items; their `token` strings, joined, are the text)."""

    logprobs: list[dict]

    def __new__(cls, text: str, logprobs: list[dict]) -> Piece:
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece


class JobUnsupported(RuntimeError):
    """This runner cannot do what the job asks (a ring cannot follow a grammar): the job is
    this host's failure, and continues on a host that can, before any token is spent on it."""


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


SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}


def job_number(params: dict, key: str, default: float) -> float:
    """``params[key]`` as a float, or ``default`` when absent or null (OpenAI's defaults are 1);
    RequestRejected when it is not a finite number in its range (the gateway checks this
    too: a request that reaches a host with one is the request's fault, not the host's)."""
    value = params.get(key)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RequestRejected(f"{key} {value!r} is not a number") from None
    low, high = SAMPLING_RANGES.get(key, (-math.inf, math.inf))
    if not math.isfinite(number) or not low <= number <= high:
        raise RequestRejected(f"{key} {value!r} is outside [{low:g}, {high:g}]")
    return number


def job_seed(params: dict) -> int:
    """The job's sampling seed; a random 63-bit one when it has none (an older gateway sends none)."""
    value = params.get("seed")
    if value is None:
        return random.SystemRandom().getrandbits(63)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"seed {value!r} is not an integer")
    return value
