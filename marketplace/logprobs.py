"""Log-probabilities (`logprobs`): what a host reports with its text, checked at the door,
and how it reaches the customer in OpenAI's shapes.

A host sends, with each batch of text, one entry per token — `{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}` — whose `token` strings,
joined, are exactly the batch's text (a token that a continuation's seam or a stop string
cut keeps only its delivered characters). The listener hands each piece of text out with
the entries of the tokens that start in it.
"""

from __future__ import annotations

import math

from protocol.jobs import MAX_TOP_LOGPROBS


def entries_problem(entries: object, text: str) -> str | None:
    """Why `entries` are not a batch's token entries for `text`, or None."""
    if not isinstance(entries, list):
        return "'logprobs' must be a list of token entries"
    for index, entry in enumerate(entries):
        why = _entry_problem(entry)
        if why is None and not (
            isinstance(entry["top_logprobs"], list)
            and len(entry["top_logprobs"]) <= MAX_TOP_LOGPROBS
            and all(_entry_problem(top, top=True) is None for top in entry["top_logprobs"])
        ):
            why = f"'top_logprobs' must be a list of at most {MAX_TOP_LOGPROBS} entries"
        if why is not None:
            return f"logprobs[{index}]: {why}"
    if "".join(entry["token"] for entry in entries) != text:  # type: ignore[index]
        return "the entries' tokens do not spell the batch's text"
    return None


def _entry_problem(entry: object, *, top: bool = False) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return "an entry is {'token': str, 'logprob': number, 'bytes': [int], 'top_logprobs': [...]}"
    logprob = entry.get("logprob")
    if (
        isinstance(logprob, bool)
        or not isinstance(logprob, (int, float))
        or not math.isfinite(logprob)
        or logprob > 1e-3
    ):
        return "'logprob' must be a number of 0 or less"
    raw = entry.get("bytes")
    if not isinstance(raw, list) or not all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return "'bytes' must be a list of byte values"
    if not top and "top_logprobs" not in entry:
        return "'top_logprobs' is missing"
    return None


def entries_starting(entries: list[tuple[int, dict]], start: int, end: int) -> list[dict]:
    """The entries (each with its absolute character offset) of the tokens that start in
    [start, end): the ones a piece of text covering those characters carries."""
    return [entry for offset, entry in entries if start <= offset < end]


def located(offset: int, entries: list[dict]) -> list[tuple[int, dict]]:
    """A batch's entries with the absolute offset where each token starts (the batch starts at `offset`)."""
    out = []
    for entry in entries:
        out.append((offset, entry))
        offset += len(entry["token"])
    return out


def completion_logprobs(entries: list[dict], *, start: int = 0) -> dict:
    """Legacy completions' shape: parallel lists, `text_offset` counted in the answer's characters."""
    offsets, at = [], start
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {
        "tokens": [entry["token"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
        "text_offset": offsets,
    }
