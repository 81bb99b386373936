"""OpenAI's Responses API (`POST /v1/responses`): a different door to the same chat admission
and lifecycle.

The door translates, nothing more. A Responses body becomes a chat body (`chat_body`: its
function tools, `tool_choice`, function calls and their outputs, `text.format` as the chat's
`response_format`), which `marketplace.openai.choices.admit_choices` admits as any chat (priced, held,
queued, relayed, failed over and settled the same way), under a `resp_…` id so
`GET /v1/generation?id=resp_…` finds it. The chat answer is translated back: a whole body into
a Response object (`response_from_chat`: a message, or the function calls), a stream of chat
chunks into the Responses API's semantic events (`response_events`: a call's arguments as they
are generated). What the Responses API defines and this door does not offer is a 400 naming it
(`response_serializers.RESPONSES_NOT_OFFERED`, built-in tools).

A response asked to be kept (`store: true`) is saved by the door once whole
(`marketplace.openai.stored_responses`): its conversation in this API's own item shape, normalised
(`stored_items`, `output_items`: only what a turn needs), so a later turn's
`previous_response_id` puts it before that turn's input (`continued`) and the whole passes the
same validation as any input (a function_call_output answers a stored call).
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

from core.errors import ApiError, DomainError, validation_error
from marketplace.openai.choices import Admitted
from marketplace.openai.response_serializers import NotOfferedYet, ResponsesInputSerializer
from marketplace.selectors import unix


def new_response_id(kind: str) -> str:
    """A Responses request's public id (its row is a chat request of any other kind's)."""
    return "resp_" + secrets.token_hex(24)


def message_id(response_id: str) -> str:
    """The id of a response's output message, derived from the response's."""
    return "msg_" + response_id.removeprefix("resp_")


def function_call_id(call_id: str) -> str:
    """The id of a function_call output item, derived from its call's id."""
    return "fc_" + call_id.removeprefix("call_")


def validated(body: dict) -> dict:
    """The body as `ResponsesInputSerializer` takes it; a bad body is a 400 in OpenAI's shape,
    what is not offered a 400 `unsupported_parameter` naming it."""
    serializer = ResponsesInputSerializer(data=body)
    try:
        valid = serializer.is_valid()
    except NotOfferedYet as refused:
        raise ApiError(400, str(refused), code="unsupported_parameter", param=refused.param) from None
    if not valid:
        raise validation_error(serializer.errors)
    return serializer.validated_data


def input_items(given: object) -> list:
    """The input as items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given)  # type: ignore[call-overload]


def continued(body: dict, conversation: list[dict]) -> dict:
    """The body continuing a stored conversation: its items first, then this turn's input (an
    input that is neither a string nor a list is left to validation's 400). `instructions` are
    this request's alone, as OpenAI's are: the stored ones are not carried over."""
    given = body.get("input")
    return {**body, "input": [*conversation, *input_items(given)]} if isinstance(given, (str, list)) else body


def stored_items(turns: list[dict]) -> list[dict]:
    """Validated input turns (`ResponsesInputField`'s chat turns) as the items a stored
    response keeps: only what a later turn needs, in this API's own item shape (a message's
    text joined, a developer turn as the system one it became); every other key a customer
    sent (ids, statuses, annotations, keys of no meaning) is left behind. Validating them
    again gives the same turns."""
    items: list[dict] = []
    for turn in turns:
        if turn["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": turn["tool_call_id"], "output": turn["content"]})
            continue
        if turn["content"] is not None or not turn.get("tool_calls"):
            items.append({"type": "message", "role": turn["role"], "content": turn["content"] or ""})
        items += [
            {
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
            for call in turn.get("tool_calls") or []
        ]
    return items


def output_items(output: list[dict]) -> list[dict]:
    """A Response's output items as a stored conversation keeps them: the message's text, the
    calls (their ids, names and arguments); no ids, statuses or annotations."""
    items: list[dict] = []
    for item in output:
        if item["type"] == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        else:
            items.append(
                {"type": "message", "role": "assistant", "content": "".join(part["text"] for part in item["content"])}
            )
    return items


def conversation_after(kept: list[dict], response: dict) -> list[dict]:
    """What a stored response keeps for the next turn: the (continued) input as `stored_items`
    made it before admission, then its output."""
    return [*kept, *output_items(response["output"])]


async def stored_on_end(
    events: AsyncGenerator[dict, None], save: Callable[[dict], Awaitable[object]]
) -> AsyncGenerator[dict, None]:
    """The events of a stream whose response is to be kept: the ending Response is saved before
    its `response.completed` (or `.incomplete`) is sent, so a client that continues it at once
    finds it. A failed response is not kept: nothing to continue."""
    async with aclosing(events) as inner:
        async for event in inner:
            if event["type"] in ("response.completed", "response.incomplete"):
                await save(event["response"])
            yield event


def chat_body(body: dict) -> dict:
    """The chat body a Responses body asks for: `instructions` as a system turn before the
    input's turns, `max_output_tokens` as `max_tokens`, function tools in the chat's nested
    shape (`allowed_tools` offers only those it lists), `text.format` as `response_format`;
    usage always in a stream (the last event carries it). Cheap structural work only: this
    runs on the event loop, and the schemas are checked with the chat's, off it."""
    data = validated(body)
    system = [{"role": "system", "content": data["instructions"]}] if data.get("instructions") else []
    chat = {"model": data["model"], "messages": [*system, *data["input"]], "stream": data["stream"]}
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if data.get(ours) is not None:
            chat[theirs] = data[ours]
    tools, choice = data.get("tools") or [], data.get("tool_choice")
    if isinstance(choice, dict) and choice["type"] == "allowed_tools":
        allowed = {tool["name"] for tool in choice["tools"]}
        tools, choice = [tool for tool in tools if tool["name"] in allowed], choice["mode"]
    if tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    k: tool[k] for k in ("name", "description", "parameters", "strict") if tool[k] is not None
                },
            }
            for tool in tools
        ]
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    form = data.get("text")
    if form is not None:
        chat["response_format"] = (
            form
            if form["type"] == "json_object"
            else {
                "type": "json_schema",
                "json_schema": {k: form[k] for k in ("name", "schema", "description", "strict") if form[k] is not None},
            }
        )
    if data["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat


# The chat's parameters and the words its refusals use, as this door names them.
DOOR_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}
DOOR_WORDS = (
    ("'response_format': json_schema.schema is", "'text.format': its schema is"),
    ("'response_format'", "'text.format'"),
    (
        "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}",
        "{'type': 'function', 'name': ..., 'parameters': {...}}",
    ),
)


def door_error(error: DomainError) -> DomainError:
    """A refusal from the chat admission, naming this door's field: the chat's `messages` are
    the Responses API's `input` (a prompt over the context, a conversation the template
    refuses), its `response_format` is `text.format` (a schema no grammar can be made from)."""
    param = error.param or ""
    for chat, ours in DOOR_PARAMS.items():
        if param == chat or param.startswith((f"{chat}[", f"{chat}.")):
            error.param = ours if chat == "messages" else ours + param[len(chat) :]
    for chat, ours in DOOR_WORDS:
        error.message = error.message.replace(chat, ours)
    return error


INPUT_ITEM = re.compile(r"input\[(\d+)\]")


def own_items(error: DomainError, *, stored: int) -> DomainError:
    """A refusal of a continued body naming an item by its place in this request's own `input`:
    the `stored` items validated before it are not the customer's to count."""

    def shifted(match: re.Match) -> str:
        index = int(match.group(1))
        return f"input[{index - stored}]" if index >= stored else match.group(0)

    if stored:
        error.param = INPUT_ITEM.sub(shifted, error.param) if error.param else error.param
        error.message = INPUT_ITEM.sub(shifted, error.message)
    return error


def echoed(body: dict) -> dict:
    """The request's own fields a Response object repeats, as validated (`chat_body` passed the
    body already; `user: 0` is "0" by then, as the schema says)."""
    serializer = ResponsesInputSerializer(data=body)
    data = serializer.validated_data if serializer.is_valid() else {}
    form = data.get("text")
    return {
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data.get("metadata") or {},
        "user": data.get("user"),
        "tools": data.get("tools") or [],
        "tool_choice": data.get("tool_choice") or "auto",
        "store": bool(data.get("store")),
        "previous_response_id": data.get("previous_response_id"),
        "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
        "text": {"format": {k: v for k, v in form.items() if v is not None} if form else {"type": "text"}},
    }


def usage(chat_usage: dict) -> dict:
    """The chat's usage in this API's names: its `prompt_tokens_details.cached_tokens` (the prompt
    tokens the gateway found cached at admission and bills at the cached price: docs/privacy.md,
    "Prompt caching") as `input_tokens_details.cached_tokens`, streamed or whole alike."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(response_id: str, *, status: str, text: str | None) -> dict:
    """An assistant message holding the text (no content while it is in progress)."""
    content = [] if text is None else [text_part(text)]
    return {"id": message_id(response_id), "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(call_id: str, name: str, *, status: str, arguments: str) -> dict:
    """A function_call output item: the call the customer's code runs, answered with a
    function_call_output item naming its `call_id`."""
    return {
        "id": function_call_id(call_id),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def finished(finish_reason: str | None) -> tuple[str, dict | None]:
    """A response's status and `incomplete_details` from the chat's finish: cut by
    max_output_tokens is "incomplete", as OpenAI says it."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    *,
    response_id: str,
    created: int,
    model: str,
    status: str,
    params: dict,
    echo: dict,
    output: list[dict] | None = None,
    chat_usage: dict | None = None,
    incomplete: dict | None = None,
    error: dict | None = None,
) -> dict:
    """A Response object, with OpenAI's fields: `output` holds the message or the calls once
    there are some; `params` are the chat request's (the temperature and top_p it ran with)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "model": model,
        "output": output or [],
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": echo["previous_response_id"],
        "reasoning": {"effort": None, "summary": None},
        "store": echo["store"],
        "temperature": params.get("temperature"),
        "text": echo["text"],
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "top_p": params.get("top_p"),
        "truncation": "disabled",
        "usage": None if chat_usage is None else usage(chat_usage),
        "user": echo["user"],
        "metadata": echo["metadata"],
    }


def response_from_chat(chat: dict, *, params: dict, echo: dict) -> dict:
    """A whole chat completion (`GenerationApi._answer`'s body) as a Response object: its
    message, or its function calls. Cut by max_output_tokens, the last item is "incomplete"
    (a call's arguments as far as they were written), as a stream's is."""
    choice = chat["choices"][0]
    status, incomplete = finished(choice["finish_reason"])
    last_status = "incomplete" if status == "incomplete" else "completed"
    calls = choice["message"].get("tool_calls")
    output = (
        [
            call_item(
                call["id"],
                call["function"]["name"],
                status=last_status if at == len(calls) - 1 else "completed",
                arguments=call["function"]["arguments"],
            )
            for at, call in enumerate(calls)
        ]
        if calls
        else [message_item(chat["id"], status=last_status, text=choice["message"]["content"] or "")]
    )
    return response_object(
        response_id=chat["id"],
        created=chat["created"],
        model=chat["model"],
        status=status,
        params=params,
        echo=echo,
        output=output,
        chat_usage=chat["usage"],
        incomplete=incomplete,
    )


class _Output:
    """The output items of a streamed response, opened and closed in order as the chat's deltas
    arrive: a message for text, a function_call per call. Each method returns the events it
    makes (`event` numbers them)."""

    def __init__(self, response_id: str, event: Callable[..., dict]) -> None:
        self.response_id, self.event = response_id, event
        self.items: list[dict] = []  # as they stand: the open one last
        self.parts: list[str] = []  # the open item's text or arguments so far
        self.open = False

    def text(self, delta: str) -> list[dict]:
        events = (
            [] if self.open and self.items[-1]["type"] == "message" else [*self.close("completed"), *self.message()]
        )
        self.parts.append(delta)
        index = len(self.items) - 1
        return [
            *events,
            self.event(
                "response.output_text.delta",
                item_id=self.items[-1]["id"],
                output_index=index,
                content_index=0,
                delta=delta,
                logprobs=[],
            ),
        ]

    def message(self) -> list[dict]:
        self.items.append(message_item(self.response_id, status="in_progress", text=None))
        self.parts, self.open = [], True
        index = len(self.items) - 1
        return [
            self.event("response.output_item.added", output_index=index, item=self.items[-1]),
            self.event(
                "response.content_part.added",
                item_id=self.items[-1]["id"],
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def call(self, delta: dict) -> list[dict]:
        """A chat tool-call delta: the first of a call opens its item, the rest are its arguments."""
        events = []
        if delta.get("id"):
            events = self.close("completed")
            self.items.append(call_item(delta["id"], delta["function"]["name"], status="in_progress", arguments=""))
            self.parts, self.open = [], True
            events.append(
                self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1])
            )
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece and self.open and self.items[-1]["type"] == "function_call":
            self.parts.append(piece)
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.items[-1]["id"],
                    output_index=len(self.items) - 1,
                    delta=piece,
                )
            )
        return events

    def close(self, status: str) -> list[dict]:
        """Close the open item, if any, with `status`."""
        if not self.open:
            return []
        self.open, item, index, whole = False, self.items[-1], len(self.items) - 1, "".join(self.parts)
        if item["type"] == "message":
            self.items[-1] = message_item(self.response_id, status=status, text=whole)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events = [
                self.event("response.output_text.done", **where, text=whole, logprobs=[]),
                self.event("response.content_part.done", **where, part=text_part(whole)),
            ]
        else:
            self.items[-1] = {**item, "status": status, "arguments": whole}
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=whole,
                )
            ]
        return [*events, self.event("response.output_item.done", output_index=index, item=self.items[-1])]


async def response_events(admitted: Admitted, *, echo: dict) -> AsyncGenerator[dict, None]:
    """The Responses API's semantic events for one streamed chat: created, in_progress, then
    per output item its added event, its deltas (`response.output_text.delta` for text,
    `response.function_call_arguments.delta` for a call's arguments, as they are generated)
    and its done events, then `response.completed` (or `response.incomplete`, cut by
    max_output_tokens) with usage; a request that fails on the way ends with `response.failed`
    carrying the error. Without tools the message opens at once, as OpenAI's does; with tools,
    when the first text or call arrives. Each event has its `sequence_number`, from 0."""
    row, numbers = admitted.row, itertools.count()
    common = {
        "response_id": row.public_id,
        "created": unix(row.created_at),
        "model": row.model.name,
        "params": row.params,
        "echo": echo,
    }

    def event(kind: str, **fields: object) -> dict:
        return {"type": kind, **fields, "sequence_number": next(numbers)}

    output = _Output(row.public_id, event)
    yield event("response.created", response=response_object(status="in_progress", **common))
    yield event("response.in_progress", response=response_object(status="in_progress", **common))
    if not row.params.get("tools"):
        for opened in output.message():
            yield opened
    last: dict = {}
    chat_usage: dict | None = None  # from the chat's last chunk, which has no choices (asked by `chat_body`)
    async with aclosing(admitted.chunks()) as chunks:  # closed with this stream: a client gone is a listener left
        async for chunk in chunks:
            if not isinstance(chunk, dict):
                continue  # "[DONE]": the chat stream's end marker; this stream ends with its last event
            if "error" in chunk:
                error = {"code": chunk["error"]["code"], "message": chunk["error"]["message"]}
                yield event("response.failed", response=response_object(status="failed", error=error, **common))
                return
            choice = chunk["choices"][0] if chunk["choices"] else {}
            delta = choice.get("delta") or {}
            for made in [
                *(output.text(delta["content"]) if delta.get("content") else []),
                *(made for call in delta.get("tool_calls") or [] for made in output.call(call)),
            ]:
                yield made
            if choice.get("finish_reason") is not None:
                last = chunk
            chat_usage = chunk.get("usage") or chat_usage
    if not last:
        return  # (a chat stream ends with its finish or an error: nothing else reaches here)
    status, incomplete = finished(last["choices"][0]["finish_reason"])
    if not output.items:
        for opened in output.message():  # an empty answer is an empty message
            yield opened
    for closed in output.close("incomplete" if status == "incomplete" else "completed"):
        yield closed
    final = response_object(status=status, output=output.items, chat_usage=chat_usage, incomplete=incomplete, **common)
    ending = event(f"response.{status}", response=final)
    if (last.get("x_elephant") or {}).get("resumed"):
        ending["x_elephant"] = {"resumed": True}  # continued on another host after one died (DESIGN 1.2)
    yield ending


def sse_event(payload: dict) -> bytes:
    """One Server-Sent Event as OpenAI sends the Responses API's: named by its type."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
