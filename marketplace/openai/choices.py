"""A generation request's choices (`n`), behind every door that streams one: the SSE
and whole-body answers of `marketplace.openai.apis` and the chat WebSocket.

Each choice is its own queued request (billed as its own) with a listener that relays
its text; `admit_choices` queues them all or none, and `stream_chunks` interleaves their
chunks into the one stream OpenAI sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from accounts.models import ApiKey
from accounts.selectors import key_for_spending
from catalog.tokenizer import tokenizer_for
from core.db import db
from core.errors import ApiError, validation_error
from marketplace import selectors, services
from marketplace.models import CHOICE_OF, Request
from marketplace.openai import admission
from marketplace.openai.render import chunk_body, usage_chunk
from marketplace.openai.serializers import ChatInputSerializer, CompletionInputSerializer, UnsupportedParameter
from marketplace.openai.streaming import RequestListener, Text, ended_error
from marketplace.openai.tool_calls import CallStream


def authenticated(admit: Callable[..., Request]) -> Callable[..., Request]:
    """`admit` with the key looked up from the bearer secret first, in the same trip to the
    database thread pool."""

    def call(*, secret: str, **kwargs: object) -> Request:
        return admit(api_key=key_for_spending(secret), **kwargs)

    return call


@dataclass
class Admitted:
    """A queued request and the listener that relays its text."""

    row: Request
    listener: RequestListener
    include_usage: bool
    index: int = 0  # the choice (`n`)
    handed_over: bool = False
    ended: Request | None = None

    async def chunks(self, *, first: bool = True) -> AsyncGenerator[dict | str, None]:
        """OpenAI stream chunks, ending with "[DONE]" or an error object. Each text chunk
        carries `x_elephant.offset`: the characters delivered so far, where a dropped
        stream resumes (`starting_after`). With `include_usage`, as OpenAI sends it: every
        chunk says `"usage": null`, and after the finish one more chunk with no choices
        carries the usage (`usage_chunk`)."""
        async with aclosing(self._chunks(first=first)) as chunks:  # (closed with this stream: its listener with it)
            async for chunk in chunks:
                if self.include_usage and isinstance(chunk, dict) and not {"error", "usage"} & chunk.keys():
                    chunk = {**chunk, "usage": None}
                yield chunk

    async def _chunks(self, *, first: bool) -> AsyncGenerator[dict | str, None]:
        row = self.row
        holder = CallStream(row.params["tools"], request_id=row.public_id) if row.params.get("tools") else None
        try:
            if first:
                yield chunk_body(row, text="", first=True, index=self.index)
            elif holder is not None and self.listener.sent:
                holder.prime(await self._delivered_before(self.listener.sent))
            async for event in self.listener.events():
                if isinstance(event, Text):
                    if self.listener.model is not None:  # (read with the request: a fallback model may serve it)
                        row.model = self.listener.model
                    text, logprobs, deltas = (
                        holder.feed(event.text, event.logprobs) if holder else (event.text, event.logprobs, [])
                    )
                    if text:
                        yield chunk_body(row, text=text, offset=self.listener.sent, index=self.index, logprobs=logprobs)
                    for delta in deltas:  # a call's arguments as they are generated (each chunk says where to resume)
                        yield chunk_body(row, text="", calls=[delta], offset=self.listener.sent, index=self.index)
                    continue
                ended = self.ended = event.request
                self.handed_over = True
                if ended.status == Request.Status.FAILED:
                    yield ended_error(ended).body()
                    return
                finish = ended.finish_reason or "stop"
                if holder is not None:
                    held, logprobs, deltas, calls = holder.finish(cut=finish == "length")
                    if held:
                        yield chunk_body(row, text=held, offset=self.listener.sent, index=self.index, logprobs=logprobs)
                    for delta in deltas:
                        yield chunk_body(row, text="", calls=[delta], index=self.index)
                    finish = "tool_calls" if calls and finish != "length" else finish
                yield chunk_body(ended, text="", finish_reason=finish, index=self.index)
                if self.include_usage:
                    yield usage_chunk([ended])
                yield "[DONE]"
        finally:
            await self.close()

    async def _delivered_before(self, offset: int) -> str:
        """The answer's first `offset` characters (a resumed stream's customer has them)."""
        _, text, _ = await db(selectors.request_catch_up_entries, public_id=self.row.public_id, sent=0, logprobs=False)
        return text[:offset]

    async def withdraw(self) -> None:
        """End this queued request now, unbilled (a sibling choice was refused)."""
        try:
            await db(services.request_withdraw, request_id=self.row.pk)
        finally:
            await self.listener.close()

    async def close(self) -> None:
        """Stop listening; once the whole answer was handed over, forget it. A stream that
        dropped early leaves the text for a resume, until the watchdog's retention ends.
        The forgetting is shielded: a client that hangs up right after "[DONE]" cancels
        this stream's task, and the text must still go."""
        try:
            if self.handed_over:
                await asyncio.shield(db(services.request_forget_output, request_id=self.row.pk))
            else:  # the customer went away mid-answer: unless it re-attaches in time, the job is cancelled
                await asyncio.shield(db(services.request_listener_left, request_id=self.row.pk))
        finally:
            await self.listener.close()


async def admit_choices(
    *,
    secret: str,
    body: dict,
    kind: str,
    translate: Callable[[dict], dict] | None = None,
    new_id: Callable[[str], str] = services.new_public_id,
) -> list[Admitted]:
    """Authenticate, validate, price and queue a generation request, or raise a DomainError
    (402 before queueing): one queued request per choice (`n`), each billed as its own, with
    its own seed when one is given (seed + index: the same seed would make the same choice).
    When a later choice is refused (credit, the key's rate), those already queued are
    withdrawn unbilled.

    The key comes first: validating the body can build grammars from `response_format` and
    `tools` schemas, work that a stranger (a 401) must never get done for them. That work is
    bounded (`protocol.schema_limits`) and runs in a worker thread, so no request's schema
    holds up the streams and host sockets this process relays.

    Each listener joins its request's group before the job exists, so no token can be
    announced before someone is listening.

    Another door (`marketplace.openai.responses`) comes in through here too: `translate` turns its
    body into a chat body once the key is known (a DomainError when it is bad), and `new_id`
    names its requests; admission and everything after it stay the same.
    """
    api_key = await db(key_for_spending, secret)
    if translate is not None:
        body = translate(body)
    serializer = (ChatInputSerializer if kind == Request.Kind.CHAT else CompletionInputSerializer)(data=body)
    try:  # off the event loop (a schema's checks and grammar), and off the database thread too
        valid = await sync_to_async(serializer.is_valid, thread_sensitive=False)()
    except UnsupportedParameter as refused:  # accepted and ignored would be worse than a refusal
        raise ApiError(400, str(refused), code="unsupported_parameter", param=refused.param) from None
    if not valid:
        raise validation_error(serializer.errors)
    params = serializer.params()
    choices: list[Admitted] = []
    try:
        for index in range(serializer.validated_data.get("n") or 1):
            seeded = {**params, "seed": params["seed"] + index} if params["seed"] is not None and index else params
            if index:  # the prompt is billed once, to the first choice (`Request.prompt_tokens_billed`)
                seeded = {**seeded, CHOICE_OF: choices[0].row.public_id}
            choices.append(
                await _admit_one(
                    api_key=api_key,
                    data=serializer.validated_data,
                    params=seeded,
                    kind=kind,
                    include_usage=serializer.include_usage(),
                    index=index,
                    new_id=new_id,
                )
            )
    except BaseException:
        for choice in choices:
            await asyncio.shield(choice.withdraw())
        raise
    return choices


async def _admit_one(
    *,
    api_key: ApiKey,
    data: dict,
    params: dict,
    kind: str,
    include_usage: bool,
    index: int,
    new_id: Callable[[str], str],
) -> Admitted:
    public_id = new_id(kind)
    listener = await RequestListener(public_id).open()
    try:
        row = await db(
            admission.request_admit, api_key=api_key, data=data, params=params, kind=kind, public_id=public_id
        )
    except BaseException:
        await listener.close()
        raise
    listener.stops = row.params.get("stop") or []
    listener.token_limit = services.relay_token_limit(row)
    listener.tokenizer = tokenizer_for(row.model.tokenizer)
    listener.logprobs = params.get("logprobs") is not None
    return Admitted(row=row, listener=listener, include_usage=include_usage, index=index)


async def stream_chunks(choices: list[Admitted]) -> AsyncIterator[dict | str]:
    """The stream of one choice, or of several interleaved as OpenAI interleaves them: chunks
    of every choice as they come (each with its `index`), one finish per choice (a failed
    choice finishes with "error" and its error), then the usage of them all when asked for
    (a chunk with no choices; every other chunk then says `"usage": null`), then one "[DONE]" —
    or the error alone when every choice failed."""
    if len(choices) == 1:
        async for one in choices[0].chunks():
            yield one
        return
    queue: asyncio.Queue[tuple[Admitted, dict | str | None]] = asyncio.Queue()

    async def pump(choice: Admitted) -> None:
        try:
            async for chunk in choice.chunks():
                await queue.put((choice, chunk))
        finally:
            await queue.put((choice, None))

    include_usage = choices[0].include_usage
    nulled = {"usage": None} if include_usage else {}  # every chunk but the usage one, as OpenAI sends them
    for choice in choices:
        choice.include_usage = False
    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    errors: list[dict] = []
    try:
        running = len(choices)
        while running:
            choice, chunk = await queue.get()
            if chunk is None:
                running -= 1
            elif isinstance(chunk, dict) and "error" in chunk:
                errors.append(chunk)
                if len(errors) < len(choices):
                    yield {
                        **chunk_body(choice.row, text="", finish_reason="error", index=choice.index),
                        **chunk,
                        **nulled,
                    }
            elif chunk != "[DONE]":
                yield {**chunk, "id": choices[0].row.public_id, **nulled}  # type: ignore[dict-item]  # (one response: one id)
        if len(errors) == len(choices):
            yield errors[0]
            return
        if include_usage:
            yield usage_chunk([choice.ended for choice in choices if choice.ended is not None])
        yield "[DONE]"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
