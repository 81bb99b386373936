"""OpenAI response shapes for chat and text completions."""

from __future__ import annotations

from typing import Any

from marketplace.logprobs import completion_logprobs
from marketplace.models import Request
from marketplace.selectors import unix


def usage_of(row: Request) -> dict:
    """Its counts, with the prompt tokens billed as cached (the gateway's decision at admission)."""
    return {
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": row.cached_tokens},
    }


def usage_sum(usages: list[dict]) -> dict:
    """The usage of several choices: one prompt (OpenAI counts it once, with the first's cached
    tokens), every completion."""
    completion = sum(u["completion_tokens"] for u in usages)
    prompt = usages[0]["prompt_tokens"] if usages else 0
    cached = (usages[0].get("prompt_tokens_details") or {}).get("cached_tokens", 0) if usages else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_chunk(rows: list[Request]) -> dict:
    """The last chunk of a stream of several choices, when usage is asked for: no choices.
    Like one choice's last chunk, it says `x_elephant.resumed` when any choice was continued
    on another host (the whole body's `x-elephant-resumed` header says the same)."""
    row = rows[0]
    body: dict[str, Any] = {
        "id": row.public_id,
        "object": "chat.completion.chunk" if row.kind == Request.Kind.CHAT else "text_completion",
        "created": unix(row.created_at),
        "model": row.model.name,
        "choices": [],
        "usage": usage_sum([usage_of(r) for r in rows]),
    }
    if any(r.resumed for r in rows):
        body["x_elephant"] = {"resumed": True}
    return body


def failed_choice(row: Request, *, index: int) -> dict:
    """A choice that failed while its siblings succeeded (OpenRouter's finish_reason "error")."""
    if row.kind == Request.Kind.CHAT:
        return {
            "index": index,
            "message": {"role": "assistant", "content": None, "refusal": None},
            "logprobs": None,
            "finish_reason": "error",
        }
    return {"index": index, "text": "", "logprobs": None, "finish_reason": "error"}


def chunk_body(
    row: Request,
    *,
    text: str,
    first: bool = False,
    finish_reason: str | None = None,
    usage: dict | None = None,
    offset: int | None = None,
    calls: list[dict] | None = None,
    index: int = 0,
    logprobs: list[dict] | None = None,
) -> dict:
    """One stream chunk. `offset`: the characters relayed once this chunk's text is (its
    tokens' `text_offset`s count from the chunk's start: `offset` less the text)."""
    if row.kind == Request.Kind.CHAT:
        delta: dict = (
            {"role": "assistant", "content": text, "refusal": None} if first else ({"content": text} if text else {})
        )
        if calls:
            delta = {"tool_calls": calls}
        choice: dict = {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        body = {
            "id": row.public_id,
            "object": "chat.completion.chunk",
            "created": unix(row.created_at),
            "model": row.model.name,
            "choices": [choice],
        }
    else:
        start = (offset or 0) - len(text)
        choice = {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs, start=start),
        }
        body = {
            "id": row.public_id,
            "object": "text_completion",
            "created": unix(row.created_at),
            "model": row.model.name,
            "choices": [choice],
        }
    if usage is not None:
        body["usage"] = usage
    if offset is not None:
        body["x_elephant"] = {"offset": offset}
    if finish_reason is not None and row.resumed:
        body["x_elephant"] = {"resumed": True}
    return body


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def response_body(
    row: Request, *, text: str, calls: list[dict] | None = None, logprobs: list[dict] | None = None
) -> dict:
    finish = "tool_calls" if calls and row.finish_reason != "length" else row.finish_reason or "stop"
    if row.kind == Request.Kind.CHAT:
        # `refusal` as OpenAI's schema requires it: null, the served models do not refuse through it. A
        # required call cut before any name was known (`calls` empty) is no content either.
        message = (
            {"role": "assistant", "content": None, "refusal": None, **({"tool_calls": calls} if calls else {})}
            if calls is not None
            else {"role": "assistant", "content": text, "refusal": None}
        )
        choice = {"index": 0, "message": message, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": finish,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs),
        }
        obj = "text_completion"
    return {
        "id": row.public_id,
        "object": obj,
        "created": unix(row.created_at),
        "model": row.model.name,
        "choices": [choice],
        "usage": usage_of(row),
    }
