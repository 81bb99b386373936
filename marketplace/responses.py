"""OpenAI's Responses API (`POST /v1/responses`), text only for now: a different door to the
same chat admission and lifecycle.

The door translates, nothing more. A Responses body becomes a chat body (`chat_body`), which
`marketplace.choices.admit_choices` admits as any chat (priced, held, queued, relayed, failed
over and settled the same way), under a `resp_…` id so `GET /v1/generation?id=resp_…` finds
it. The chat answer is translated back: a whole body into a Response object
(`response_from_chat`), a stream of chat chunks into the Responses API's semantic events
(`response_events`). What the Responses API defines and this door does not offer yet is a
400 naming it (`serializers.RESPONSES_NOT_OFFERED`, stored responses).
"""
from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing

from core.errors import ApiError, DomainError, validation_error
from marketplace.choices import Admitted
from marketplace.selectors import unix
from marketplace.serializers import NotOfferedYet, ResponsesInputSerializer


def new_response_id(kind: str) -> str:
    """A Responses request's public id (its row is a chat request of any other kind's)."""
    return "resp_" + secrets.token_hex(24)


def message_id(response_id: str) -> str:
    """The id of a response's one output message, derived from the response's."""
    return "msg_" + response_id.removeprefix("resp_")


def chat_body(body: dict) -> dict:
    """The chat body a Responses body asks for: `instructions` as a system turn before the
    input's turns, `max_output_tokens` as `max_tokens`; usage always in a stream (the last
    event carries it). A bad body is a 400 in OpenAI's shape; what is not offered yet, a 400
    `unsupported_parameter` naming it."""
    serializer = ResponsesInputSerializer(data=body)
    try:
        valid = serializer.is_valid()
    except NotOfferedYet as refused:
        raise ApiError(400, str(refused), code="unsupported_parameter", param=refused.param) from None
    if not valid:
        raise validation_error(serializer.errors)
    data = serializer.validated_data
    system = [{"role": "system", "content": data["instructions"]}] if data.get("instructions") else []
    chat = {"model": data["model"], "messages": [*system, *data["input"]], "stream": data["stream"]}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if data.get(ours) is not None:
            chat[theirs] = data[ours]
    if data["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat


def door_error(error: DomainError) -> DomainError:
    """A refusal from the chat admission, naming this door's field: the chat's `messages` are
    the Responses API's `input` (a prompt over the context, a conversation the template refuses)."""
    if error.param == "messages" or (error.param or "").startswith("messages["):
        error.param = "input"
    return error


def echoed(body: dict) -> dict:
    """The request's own fields a Response object repeats, as validated (`chat_body` passed the
    body already; `user: 0` is "0" by then, as the schema says)."""
    serializer = ResponsesInputSerializer(data=body)
    data = serializer.validated_data if serializer.is_valid() else {}
    return {"instructions": data.get("instructions"), "max_output_tokens": data.get("max_output_tokens"),
            "metadata": data.get("metadata") or {}, "user": data.get("user")}


def usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(response_id: str, *, status: str, text: str | None) -> dict:
    """The one output item: an assistant message holding the text (no content while it is in progress)."""
    content = [] if text is None else [text_part(text)]
    return {"id": message_id(response_id), "type": "message", "status": status, "role": "assistant", "content": content}


def finished(finish_reason: str | None) -> tuple[str, dict | None]:
    """A response's status and `incomplete_details` from the chat's finish: cut by
    max_output_tokens is "incomplete", as OpenAI says it."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    *, response_id: str, created: int, model: str, status: str, params: dict, echo: dict, text: str | None = None,
    chat_usage: dict | None = None, incomplete: dict | None = None, error: dict | None = None,
) -> dict:
    """A Response object, with OpenAI's fields: `output` holds the message once there is text
    to give; `params` are the chat request's (the temperature and top_p it ran with)."""
    item_status = "incomplete" if status == "incomplete" else "completed"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
        "incomplete_details": incomplete, "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
        "model": model, "output": [] if text is None else [message_item(response_id, status=item_status, text=text)],
        "parallel_tool_calls": False, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False, "temperature": params.get("temperature"), "text": {"format": {"type": "text"}},
        "tool_choice": "none", "tools": [], "top_p": params.get("top_p"), "truncation": "disabled",
        "usage": None if chat_usage is None else usage(chat_usage), "user": echo["user"], "metadata": echo["metadata"],
    }


def response_from_chat(chat: dict, *, params: dict, echo: dict) -> dict:
    """A whole chat completion (`GenerationApi._answer`'s body) as a Response object."""
    choice = chat["choices"][0]
    status, incomplete = finished(choice["finish_reason"])
    return response_object(response_id=chat["id"], created=chat["created"], model=chat["model"], status=status,
                           params=params, echo=echo, text=choice["message"]["content"] or "", chat_usage=chat["usage"],
                           incomplete=incomplete)


async def response_events(admitted: Admitted, *, echo: dict) -> AsyncIterator[dict]:
    """The Responses API's semantic events for one streamed chat: created, in_progress, the
    message item and its text part added, a delta per piece of text, then the text, part and
    item done and `response.completed` (or `response.incomplete`, cut by max_output_tokens)
    with usage; a request that fails on the way ends with `response.failed` carrying the error.
    Each event has its `sequence_number`, from 0."""
    row, numbers = admitted.row, itertools.count()
    common = {"response_id": row.public_id, "created": unix(row.created_at), "model": row.model.name, "params": row.params, "echo": echo}
    where = {"item_id": message_id(row.public_id), "output_index": 0}

    def event(kind: str, **fields: object) -> dict:
        return {"type": kind, **fields, "sequence_number": next(numbers)}

    yield event("response.created", response=response_object(status="in_progress", **common))
    yield event("response.in_progress", response=response_object(status="in_progress", **common))
    yield event("response.output_item.added", output_index=0,
                item=message_item(row.public_id, status="in_progress", text=None))
    yield event("response.content_part.added", **where, content_index=0, part=text_part(""))
    pieces: list[str] = []
    last: dict = {}
    async with aclosing(admitted.chunks()) as chunks:  # closed with this stream: a client gone is a listener left
        async for chunk in chunks:
            if not isinstance(chunk, dict):
                continue  # "[DONE]": the chat stream's end marker; this stream ends with its last event
            if "error" in chunk:
                error = {"code": chunk["error"]["code"], "message": chunk["error"]["message"]}
                yield event("response.failed", response=response_object(status="failed", error=error, **common))
                return
            choice = chunk["choices"][0] if chunk["choices"] else {}
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                pieces.append(delta)
                yield event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])
            if choice.get("finish_reason") is not None:
                last = chunk
    if not last:
        return  # (a chat stream ends with its finish or an error: nothing else reaches here)
    text = "".join(pieces)
    status, incomplete = finished(last["choices"][0]["finish_reason"])
    item_status = "incomplete" if status == "incomplete" else "completed"
    yield event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
    yield event("response.content_part.done", **where, content_index=0, part=text_part(text))
    yield event("response.output_item.done", output_index=0, item=message_item(row.public_id, status=item_status, text=text))
    final = response_object(status=status, text=text, chat_usage=last.get("usage"), incomplete=incomplete, **common)
    ending = event(f"response.{status}", response=final)
    if (last.get("x_elephant") or {}).get("resumed"):
        ending["x_elephant"] = {"resumed": True}  # continued on another host after one died (DESIGN 1.2)
    yield ending


def sse_event(payload: dict) -> bytes:
    """One Server-Sent Event as OpenAI sends the Responses API's: named by its type."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
