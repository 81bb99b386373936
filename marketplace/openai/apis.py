"""The OpenAI-compatible customer API.

Generation endpoints are async views: they hold a connection open while a
host works, so they must not tie up a thread. Everything that touches the
database goes through `db()`; everything that decides goes through a service.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.request import Request as DrfRequest
from rest_framework.response import Response
from rest_framework.serializers import BooleanField, CharField, Serializer

from accounts.apis import KeyApi
from accounts.models import ApiKey
from accounts.selectors import key_for_spending, key_from_secret, key_scope
from billing import selectors as billing_selectors
from catalog.models import CatalogModel
from catalog.money import usd_decimal
from catalog.selectors import catalog_model_card
from core.db import db
from core.errors import ApiError, DomainError, bad_request, validation_error
from core.http import bearer_secret, json_body
from core.openapi import API_KEY, ERROR
from marketplace import selectors, services
from marketplace.models import Request
from marketplace.openai import admission, outputs, responses, stored_responses
from marketplace.openai.choices import Admitted, admit_choices, stream_chunks
from marketplace.openai.render import failed_choice, response_body, usage_sum
from marketplace.openai.response_serializers import ResponsesInputSerializer
from marketplace.openai.serializers import ChatInputSerializer, CompletionInputSerializer, EmbeddingsInputSerializer
from marketplace.openai.streaming import Ended, RequestListener, Text, ended_error
from marketplace.openai.tool_calls import tool_calls_in


async def rate_limit_headers(row: Request) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers after an admission, for a key with a per-minute limit
    (one more query then; none for a key without one). `row.api_key` is the key admission
    loaded."""
    key = row.api_key
    return await db(billing_selectors.rate_headers, key=key) if key.rate_limit_per_minute is not None else {}


R = TypeVar("R", bound=HttpResponseBase)


def with_headers(response: R, headers: dict[str, str]) -> R:
    for name, value in headers.items():
        response[name] = value
    return response


def sse_response(chunks: AsyncIterator, encode: Callable[[Any], bytes] | None = None) -> StreamingHttpResponse:
    """An SSE stream of OpenAI chunks (each one event, `encode`d: `sse` unless told), never
    cached or buffered on the way."""
    encode = encode or sse
    response = StreamingHttpResponse((encode(chunk) async for chunk in chunks), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@method_decorator(csrf_exempt, name="dispatch")
class AsyncApi(View):
    """An async POST endpoint whose refusals are ApiErrors, answered in OpenAI's format."""

    security_scheme = API_KEY

    async def post(self, request: HttpRequest) -> HttpResponseBase:
        try:
            return await self._post(request)
        except DomainError as error:
            return error.response()

    async def _post(self, request: HttpRequest) -> HttpResponseBase:
        raise NotImplementedError


class GenerationApi(AsyncApi):
    """POST a generation request; answered as SSE chunks or one JSON body."""

    kind: str = Request.Kind.CHAT

    async def _post(self, request: HttpRequest) -> HttpResponseBase:
        choices = await admit_choices(secret=bearer_secret(request), body=json_body(request), kind=self.kind)
        rate = await rate_limit_headers(choices[-1].row)
        response = sse_response(stream_chunks(choices)) if choices[0].row.stream else await self._whole(choices)
        return with_headers(response, rate)

    async def _whole(self, choices: list[Admitted]) -> HttpResponse:
        """One body with every choice; a failed choice among others that succeeded finishes
        with "error" and its error (the others' text is paid for and handed over); the error
        alone when every choice failed."""
        answers = await asyncio.gather(*(self._answer(choice) for choice in choices))
        failed = [answer for answer in answers if isinstance(answer, DomainError)]
        if len(failed) == len(answers):
            return failed[0].response()
        bodies = [answer for answer in answers if not isinstance(answer, DomainError)]
        body = {
            **bodies[0],
            "id": choices[0].row.public_id,
            "choices": [],
            "usage": usage_sum([b["usage"] for b in bodies]),
        }
        for choice, answer in zip(choices, answers, strict=True):
            if isinstance(answer, DomainError):
                body["choices"].append(
                    {**failed_choice(choice.row, index=choice.index), "error": answer.body()["error"]}
                )
            else:
                body["choices"].append({**answer["choices"][0], "index": choice.index})
        response = JsonResponse(body)
        if any(choice.ended is not None and choice.ended.resumed for choice in choices):
            response["x-elephant-resumed"] = "true"
        return response

    async def _answer(self, admitted: Admitted) -> dict | DomainError:
        parts: list[str] = []
        entries: list[dict] = []
        try:
            async for event in admitted.listener.events():
                if isinstance(event, Text):
                    parts.append(event.text)
                    entries += event.logprobs or []
                    continue
                ended = admitted.ended = event.request
                admitted.handed_over = True  # as a stream's end: the text is forgotten once this body is made
                if ended.status == Request.Status.FAILED:
                    return ended_error(ended)
                text = "".join(parts)
                calls = tool_calls_in(
                    admitted.row.params.get("tools"),
                    text,
                    request_id=ended.public_id,
                    cut=ended.finish_reason == "length",
                )
                return response_body(
                    ended,
                    text=text,
                    calls=calls,
                    logprobs=entries if admitted.listener.logprobs and not calls else None,
                )
        finally:
            await admitted.close()
        raise AssertionError("listener ended without an Ended event")


class StreamResumeApi(View):
    """GET /v1/chat/completions/<id>?stream=true&starting_after=N (and /v1/completions/<id>):
    re-attach to a running (or just ended) request of this key's account and receive the
    rest of its stream from character N — the `x_elephant.offset` of the last text chunk
    received — exactly once, in the same chunk format. Reading bills nothing."""

    security_scheme = API_KEY

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "stream", OpenApiTypes.STR, enum=["true"], required=True, description="only streams resume"
            ),
            OpenApiParameter(
                "starting_after", OpenApiTypes.INT, description="the `x_elephant.offset` of the last chunk received"
            ),
            OpenApiParameter(
                "include_usage", OpenApiTypes.STR, enum=["true", "false"], description="usage in the last chunk"
            ),
        ],
        responses={(200, "text/event-stream"): outputs.RESUMED, 410: ERROR},
    )
    async def get(self, request: HttpRequest, public_id: str) -> HttpResponseBase:
        try:
            if request.GET.get("stream") != "true":
                raise bad_request(
                    "Only streams can be resumed: pass stream=true (and starting_after=N).",
                    code="stream_required",
                    param="stream",
                )
            raw = request.GET.get("starting_after", "0")
            if not raw.isdigit():
                raise bad_request(
                    f"'starting_after' must be a character offset (0 or more), got {raw!r}.",
                    code="invalid_value",
                    param="starting_after",
                )
            row = await db(_resumable, secret=bearer_secret(request), public_id=public_id, starting_after=int(raw))
        except DomainError as error:
            return error.response()
        listener = await RequestListener(public_id, resume_at=int(raw)).open()
        listener.stops = row.params.get("stop") or []
        listener.logprobs = row.params.get("logprobs") is not None
        await db(services.request_listener_here, request_id=row.pk)  # back in time: the request is not abandoned
        admitted = Admitted(row=row, listener=listener, include_usage=request.GET.get("include_usage") == "true")
        return sse_response(admitted.chunks(first=False))


def _resumable(*, secret: str, public_id: str, starting_after: int) -> Request:
    key = key_from_secret(secret)
    row = selectors.request_for_user(user=key.user, public_id=public_id, api_key=key_scope(key))
    if row is None or row.kind == Request.Kind.EMBEDDINGS:
        raise ApiError(404, f"No streamed request '{public_id}' for this {_reader(key)}.", code="not_found", param="id")
    if row.output_forgotten:
        raise ApiError(
            410, "This request's text was handed over and deleted; it cannot be streamed again.", code="output_gone"
        )
    if starting_after > row.delivered_chars:
        raise bad_request(
            f"'starting_after' is past the {row.delivered_chars} characters delivered so far.",
            code="invalid_value",
            param="starting_after",
        )
    return row


# What a generation can answer besides its own shape: 402 before anything is queued (credit, the
# key's cap), 403 (an unconfirmed account), 429 (the key's rate or streams), 502 (failed on its
# hosts), 503 (a response_format schema could not be checked now), 504 (no host took it in time).
GENERATION_ERRORS = {402: ERROR, 403: ERROR, 429: ERROR, 502: ERROR, 503: ERROR, 504: ERROR}
SAY_HI = [{"role": "user", "content": "Say hi"}]


@extend_schema(
    request=ChatInputSerializer,
    responses={
        **outputs.generation_responses(
            outputs.ChatCompletionSerializer, outputs.ChatCompletionChunkSerializer, "chat.completion"
        ),
        **GENERATION_ERRORS,
    },
    examples=[
        OpenApiExample(
            "whole", value={"model": "gemma-3-270m", "messages": SAY_HI, "max_tokens": 8}, request_only=True
        ),
        OpenApiExample(
            "streamed",
            value={
                "model": "gemma-3-270m",
                "messages": SAY_HI,
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            request_only=True,
        ),
    ],
)
class ChatCompletionsApi(GenerationApi):
    """POST a chat: the answer as one JSON body, or streamed as Server-Sent Events (`stream: true`)."""

    kind = Request.Kind.CHAT


@extend_schema(
    request=CompletionInputSerializer,
    responses={
        **outputs.generation_responses(
            outputs.TextCompletionSerializer, outputs.TextCompletionChunkSerializer, "text_completion"
        ),
        **GENERATION_ERRORS,
    },
    examples=[
        OpenApiExample(
            "whole", value={"model": "gemma-3-270m", "prompt": "Once upon", "max_tokens": 8}, request_only=True
        ),
        OpenApiExample(
            "streamed",
            value={"model": "gemma-3-270m", "prompt": "Once upon", "max_tokens": 8, "stream": True},
            request_only=True,
        ),
    ],
)
class CompletionsApi(GenerationApi):
    """POST a prompt to continue: the text as one JSON body, or streamed as Server-Sent Events (`stream: true`)."""

    kind = Request.Kind.COMPLETION


@extend_schema(
    request=ResponsesInputSerializer,
    responses={
        (200, "application/json"): OpenApiResponse(outputs.ResponseSerializer, description=outputs.RESPONSE_WHOLE),
        (200, "text/event-stream"): outputs.RESPONSE_EVENTS,
        **GENERATION_ERRORS,
    },
    examples=[
        OpenApiExample(
            "whole", value={"model": "gemma-3-270m", "input": "Say hi", "max_output_tokens": 8}, request_only=True
        ),
        OpenApiExample(
            "streamed",
            value={
                "model": "gemma-3-270m",
                "instructions": "Be brief.",
                "input": SAY_HI,
                "max_output_tokens": 8,
                "stream": True,
            },
            request_only=True,
        ),
    ],
)
class ResponsesApi(GenerationApi):
    """POST /v1/responses (OpenAI's Responses API, text only): admitted and run as a chat
    (`marketplace.openai.responses` translates both ways); the Response object as one JSON body, or
    its semantic events streamed (`stream: true`). With `store: true` the whole response is
    kept (`marketplace.openai.stored_responses`); `previous_response_id` continues a kept one."""

    async def _post(self, request: HttpRequest) -> HttpResponseBase:
        secret, body = bearer_secret(request), json_body(request)  # (in that order: no key is a 401 whatever the body)
        previous, conversation = body.get("previous_response_id"), list[dict]()
        if previous is not None:  # (a 401 for a bad key first, then a 404 for an id it cannot read)
            conversation = await db(stored_responses.stored_conversation, secret=secret, response_id=previous)
            body = responses.continued(body, conversation)
        try:  # what a stored response keeps is bounded before anything is queued or billed
            kept = await stored_responses.stored_turn_admit(secret=secret, body=body)
            choices = await admit_choices(
                secret=secret,
                body=body,
                kind=Request.Kind.CHAT,
                translate=responses.chat_body,
                new_id=responses.new_response_id,
            )
        except DomainError as error:
            raise responses.own_items(responses.door_error(error), stored=len(conversation)) from None
        admitted, echo = choices[0], responses.echoed(body)
        rate = await rate_limit_headers(admitted.row)

        async def save(response: dict) -> None:
            await db(
                stored_responses.stored_response_save, request_id=admitted.row.pk, kept=kept or [], response=response
            )

        if admitted.row.stream:
            events = responses.response_events(admitted, echo=echo)
            events = responses.stored_on_end(events, save) if echo["store"] else events
            return with_headers(sse_response(events, responses.sse_event), rate)
        answer = await self._answer(admitted)
        if isinstance(answer, DomainError):
            return with_headers(answer.response(), rate)
        whole = responses.response_from_chat(answer, params=admitted.row.params, echo=echo)
        if echo["store"]:
            await save(whole)
        response = JsonResponse(whole)
        if admitted.ended is not None and admitted.ended.resumed:
            response["x-elephant-resumed"] = "true"
        return with_headers(response, rate)


class StoredResponseApi(KeyApi):
    """GET /v1/responses/{id} reads a stored response back; DELETE /v1/responses/{id} deletes it
    now. Either is a 404 for anything this key did not store (another account's, expired, never
    stored): an id tells a stranger nothing."""

    class DeletedSerializer(Serializer):
        id = CharField()
        object = CharField(help_text="response")
        deleted = BooleanField()

    @extend_schema(operation_id="v1_responses_retrieve", responses={200: outputs.ResponseSerializer, 404: ERROR})
    def get(self, request: DrfRequest, response_id: str) -> Response:
        return Response(stored_responses.stored_response_body(key=self.key(request), response_id=response_id))

    @extend_schema(operation_id="v1_responses_destroy", responses={200: DeletedSerializer, 404: ERROR})
    def delete(self, request: DrfRequest, response_id: str) -> Response:
        stored_responses.stored_response_delete(key=self.key(request), response_id=response_id)
        return Response({"id": response_id, "object": "response", "deleted": True})


@extend_schema(
    request=EmbeddingsInputSerializer,
    responses={200: outputs.EmbeddingListSerializer, **GENERATION_ERRORS},
    examples=[
        OpenApiExample("two texts", value={"model": "all-minilm-l6-v2", "input": ["a cat", "a dog"]}, request_only=True)
    ],
)
class EmbeddingsApi(AsyncApi):
    """POST /v1/embeddings: queued like any job, answered once a host returns the vectors."""

    async def _post(self, request: HttpRequest) -> HttpResponseBase:
        secret = bearer_secret(request)
        body = json_body(request)
        api_key = await db(key_for_spending, secret)  # before any work on the body: a stranger gets a 401 alone
        serializer = EmbeddingsInputSerializer(data=body)
        if not serializer.is_valid():
            raise validation_error(serializer.errors)
        data = serializer.validated_data
        public_id = services.new_public_id(Request.Kind.EMBEDDINGS)
        listener = await RequestListener(public_id).open()  # listening before the job exists
        try:
            row = await db(admission.embeddings_admit, api_key=api_key, data=data, public_id=public_id)
        except BaseException:
            await listener.close()
            raise
        rate = await rate_limit_headers(row)
        try:
            async for event in listener.events():
                if isinstance(event, Ended):
                    ended = event.request
                    if ended.status == Request.Status.FAILED:
                        return with_headers(ended_error(ended).response(), rate)
                    return with_headers(JsonResponse(embeddings_body(ended, encoding=data["encoding_format"])), rate)
        finally:
            await listener.close()
            await db(services.request_forget_output, request_id=row.pk)  # the vectors are not kept
        raise AssertionError("listener ended without an Ended event")


def embeddings_body(row: Request, *, encoding: str) -> dict:
    """OpenAI's embeddings response; base64 is little-endian float32, as OpenAI sends it."""

    def encoded(vector: list[float]) -> list[float] | str:
        if encoding == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(row.result or [])],
        "model": row.model.name,
        "usage": {"prompt_tokens": row.prompt_tokens, "total_tokens": row.prompt_tokens},
        "id": row.public_id,
    }


class ModelListApi(KeyApi):
    @extend_schema(responses={200: outputs.ModelListSerializer})
    def get(self, request: DrfRequest) -> Response:
        self.key(request)
        return Response({"object": "list", "data": [model_body(served) for served in selectors.served_models()]})


class ModelApi(KeyApi):
    @extend_schema(operation_id="v1_model_retrieve", responses={200: outputs.ModelSerializer})
    def get(self, request: DrfRequest, model_id: str) -> Response:
        """GET /v1/models/{id}: the entry /v1/models lists for that model; a 404 when it lists none."""
        self.key(request)
        served = next((served for served in selectors.served_models() if served.model.name == model_id), None)
        if served is None:
            raise ApiError(
                404,
                f"The model '{model_id[:100]}' does not exist or no host serves it now; GET /v1/models lists them.",
                code="model_not_found",
                param="model",
            )
        return Response(model_body(served))


def model_body(served: selectors.ServedModel) -> dict:
    """A served model as /v1/models lists it: OpenAI's fields, the catalog's card (context, USD
    per-token pricing, architecture: all from the entry), and what only the API knows (hosts, the
    parameters its endpoint takes)."""
    model = served.model
    return {
        "id": model.name,
        "object": "model",
        "created": selectors.unix(model.created_at),
        "owned_by": "elephant",
        "kind": model.kind,
        **catalog_model_card(model),
        "hosts_online": served.hosts_online,
        "hosts_warm": served.hosts_warm,
        "latency_critical": model.latency_critical,
        "supported_parameters": SUPPORTED_PARAMETERS_BY_KIND[model.kind],
    }


def accepted_parameters(serializer: type[Serializer], *, refused: tuple[str, ...] = ()) -> list[str]:
    """What an endpoint takes besides the request's subject (model, messages, input), read from its
    input serializer so the list follows it; `refused` names fields declared only to answer a 400."""
    return [name for name in serializer().fields.keys() if name not in ("model", "messages", "input", *refused)]


SUPPORTED_PARAMETERS_BY_KIND: dict[str, list[str]] = {  # per kind, what its endpoint takes
    CatalogModel.Kind.CHAT: accepted_parameters(ChatInputSerializer),
    CatalogModel.Kind.EMBEDDING: accepted_parameters(EmbeddingsInputSerializer, refused=("dimensions",)),
}


class CreditsApi(KeyApi):
    @extend_schema(responses={200: outputs.CreditsSerializer})
    def get(self, request: DrfRequest) -> Response:
        key = self.key(request)
        account = billing_selectors.customer_account(user=key.user)
        balance = account.balance_ucents if account else 0
        held = account.held_ucents if account else 0
        return Response(
            {
                "object": "credits",
                "balance_ucents": balance,
                "held_ucents": held,
                "available_ucents": balance - held,
                "available_usd": usd_decimal(balance - held),
                "key": {
                    "prefix": key.prefix,
                    "spend_cap_ucents": key.spend_cap_ucents,
                    "spent_ucents": key.spent_ucents,
                    "held_ucents": key.held_ucents,
                },
            }
        )


class GenerationStatsApi(KeyApi):
    @extend_schema(
        parameters=[
            OpenApiParameter("id", OpenApiTypes.STR, required=True, description="the request's id (chatcmpl-…)")
        ],
        responses={200: outputs.GenerationSerializer},
    )
    def get(self, request: DrfRequest) -> Response:
        key = self.key(request)
        public_id = request.query_params.get("id", "")
        if not public_id:
            raise bad_request("Pass the request id as ?id=…", code="missing_id", param="id")
        row = selectors.request_for_user(user=key.user, public_id=public_id, api_key=key_scope(key))
        if row is None:
            raise ApiError(404, f"No request '{public_id}' for this {_reader(key)}.", code="not_found", param="id")
        return Response(generation_body(row, later=selectors.later_choices(row)))


def _reader(key: ApiKey) -> str:
    """Whose requests a 404 looked among: the account's, or this key's own."""
    return "account" if key.account_wide else "key (it reads its own requests; an account-wide key reads them all)"


def generation_body(row: Request, *, later: list[Request] = ()) -> dict:  # type: ignore[assignment]
    """Status, counts and cost of a request; never its prompt or its text. An `n` request is
    one generation: its later choices' tokens and cost are added to the first's (the prompt is
    billed once, `Request.prompt_tokens_billed`), as its response's `usage` counts them."""
    rows = [row, *later]
    return {
        "id": row.public_id,
        "object": "generation",
        "model": row.model.name,
        "kind": row.kind,
        "status": row.status,
        "created": selectors.unix(row.created_at),
        "finished": selectors.unix(row.finished_at) if row.finished_at else None,
        "prompt_tokens": row.prompt_tokens,
        "cached_tokens": row.cached_tokens,
        "completion_tokens": sum(each.completion_tokens for each in rows),
        "estimate_ucents": sum(each.estimate_ucents for each in rows),
        "cost_ucents": sum(each.cost_ucents for each in rows),
        "choices": len(rows),
        "finish_reason": row.finish_reason or None,
        "resumed": row.resumed,
        "settled": selectors.request_settled(row, later=later),
        "error": {"code": row.error_code, "message": row.error_message} if row.error_code else None,
    }
