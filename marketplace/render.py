"""OpenAI response shapes for chat and text completions."""
from __future__ import annotations

from marketplace.models import Request
from marketplace.selectors import unix


def usage_of(row: Request) -> dict:
    return {
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
    }


def chunk_body(
    row: Request, *, text: str, first: bool = False, finish_reason: str | None = None, usage: dict | None = None,
    offset: int | None = None,
) -> dict:
    if row.kind == Request.Kind.CHAT:
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice: dict = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": row.public_id, "object": "chat.completion.chunk", "created": unix(row.created_at), "model": row.model.name, "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": row.public_id, "object": "text_completion", "created": unix(row.created_at), "model": row.model.name, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    if offset is not None:
        body["x_elephant"] = {"offset": offset}
    if finish_reason is not None and row.resumed:
        body["x_elephant"] = {"resumed": True}
    return body


def response_body(row: Request, *, text: str) -> dict:
    finish = row.finish_reason or "stop"
    if row.kind == Request.Kind.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": row.public_id, "object": obj, "created": unix(row.created_at), "model": row.model.name, "choices": [choice], "usage": usage_of(row)}
