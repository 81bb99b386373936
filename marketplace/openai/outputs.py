"""Output shapes of the OpenAI-compatible API, for its OpenAPI schema: what `render.py` and
`apis.py` return, described field by field. The views build their bodies as dicts; these
serializers only document them, and the schema fuzz test (config/tests/test_schema_fuzz.py)
holds every live answer to them.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiResponse, extend_schema_field
from rest_framework import serializers

from core.openapi import ErrorSerializer, EventStream

TOKEN: dict[str, Any] = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer"}},
    },
}
TOKEN_ENTRY = {
    **TOKEN,
    "required": [*TOKEN["required"], "top_logprobs"],
    "properties": {**TOKEN["properties"], "top_logprobs": {"type": "array", "items": TOKEN}},
}
FINISH = "stop, length, tool_calls (the answer is a call), cancelled, or error (a failed choice among several)"


@extend_schema_field(
    {
        "oneOf": [
            {"type": "null"},
            {
                "type": "object",
                "required": ["content"],
                "properties": {"content": {"type": "array", "items": TOKEN_ENTRY}, "refusal": {"type": "null"}},
            },
        ],
        "description": "with logprobs: each token of the text with its log-probability and the likeliest alternatives",
    }
)
class ChatLogprobsField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "oneOf": [
            {"type": "null"},
            {
                "type": "object",
                "required": ["tokens", "token_logprobs"],
                "properties": {
                    "tokens": {"type": "array", "items": {"type": "string"}},
                    "token_logprobs": {"type": "array", "items": {"type": "number"}},
                    "top_logprobs": {
                        "type": "array",
                        "items": {"type": "object", "additionalProperties": {"type": "number"}},
                    },
                    "text_offset": {"type": "array", "items": {"type": "integer"}},
                },
            },
        ],
        "description": "with logprobs: the legacy completions shape",
    }
)
class TextLogprobsField(serializers.JSONField):
    pass


TOOL_CALL = {
    "type": "object",
    "properties": {
        "index": {"type": "integer"},
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}


@extend_schema_field({"type": "array", "items": TOOL_CALL})
class ToolCallsOutField(serializers.JSONField):
    pass


class ChoiceErrorSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class PromptTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField(
        help_text="prompt tokens billed at the cached price: a prefix the host offered the request holds for this "
        "account, decided by the gateway (never the host's word)"
    )


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    prompt_tokens_details = PromptTokensDetailsSerializer()


class AssistantMessageSerializer(serializers.Serializer):
    role = serializers.CharField(help_text="assistant")
    content = serializers.CharField(allow_blank=True, allow_null=True, help_text="null when the answer is tool calls")
    refusal = serializers.CharField(
        allow_null=True, help_text="always null: the served models do not refuse through it"
    )
    tool_calls = ToolCallsOutField(
        required=False,
        help_text=(
            "the calls, with JSON arguments; cut by max_tokens "
            "(finish_reason length) when a call was required, the last "
            "one's arguments as far as they were written"
        ),
    )


class ChatChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    message = AssistantMessageSerializer()
    logprobs = ChatLogprobsField()
    finish_reason = serializers.CharField(help_text=FINISH)
    error = ChoiceErrorSerializer(required=False, help_text="a failed choice among several (n > 1)")


class ChatCompletionSerializer(serializers.Serializer):
    """A whole chat answer (`stream` false)."""

    id = serializers.CharField()
    object = serializers.CharField(help_text="chat.completion")
    created = serializers.IntegerField(help_text="Unix seconds")
    model = serializers.CharField()
    choices = ChatChoiceSerializer(many=True)
    usage = UsageSerializer()


class TextChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    logprobs = TextLogprobsField()
    finish_reason = serializers.CharField(help_text=FINISH)
    error = ChoiceErrorSerializer(required=False, help_text="a failed choice among several (n > 1)")


class TextCompletionSerializer(serializers.Serializer):
    """A whole text completion (`stream` false)."""

    id = serializers.CharField()
    object = serializers.CharField(help_text="text_completion")
    created = serializers.IntegerField(help_text="Unix seconds")
    model = serializers.CharField()
    choices = TextChoiceSerializer(many=True)
    usage = UsageSerializer()


USAGE_CHUNK = (
    "with stream_options.include_usage, as OpenAI sends it: null on every chunk but the last before [DONE], "
    "which has no choices and carries the usage of them all"
)


class ChunkExtrasSerializer(serializers.Serializer):
    offset = serializers.IntegerField(
        required=False, help_text="characters delivered so far: where a dropped stream resumes"
    )
    resumed = serializers.BooleanField(
        required=False, help_text="true on the last chunk of an answer continued on another host"
    )


class ChatDeltaSerializer(serializers.Serializer):
    role = serializers.CharField(required=False, help_text="assistant, on the first chunk")
    content = serializers.CharField(required=False, allow_blank=True)
    refusal = serializers.CharField(required=False, allow_null=True, help_text="null, on the first chunk")
    tool_calls = ToolCallsOutField(
        required=False,
        help_text=(
            "a call's index, id, type and name (arguments empty), then its arguments in pieces: as they are generated "
            "when a call is required or named, in one piece at the end under auto"
        ),
    )


class ChatChunkChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    delta = ChatDeltaSerializer()
    logprobs = ChatLogprobsField()
    finish_reason = serializers.CharField(allow_null=True, help_text=f"null until the choice's last chunk: {FINISH}")


class ChatCompletionChunkSerializer(serializers.Serializer):
    """One event of a streamed chat (`chunk_body`)."""

    id = serializers.CharField()
    object = serializers.CharField(help_text="chat.completion.chunk")
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = ChatChunkChoiceSerializer(many=True, help_text="empty on the usage chunk")
    usage = UsageSerializer(required=False, allow_null=True, help_text=USAGE_CHUNK)
    x_elephant = ChunkExtrasSerializer(required=False)


class TextChunkChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    logprobs = TextLogprobsField()
    finish_reason = serializers.CharField(allow_null=True, help_text=f"null until the choice's last chunk: {FINISH}")


class TextCompletionChunkSerializer(serializers.Serializer):
    """One event of a streamed text completion (`chunk_body`)."""

    id = serializers.CharField()
    object = serializers.CharField(help_text="text_completion")
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = TextChunkChoiceSerializer(many=True, help_text="empty on the usage chunk")
    usage = UsageSerializer(required=False, allow_null=True, help_text=USAGE_CHUNK)
    x_elephant = ChunkExtrasSerializer(required=False)


STREAM = (
    "`stream: true`: Server-Sent Events. Each event is `data: <{kind} chunk as JSON>`; a text chunk carries "
    "`x_elephant.offset`, the characters delivered so far, where a dropped stream resumes "
    "(`GET …/<id>?stream=true&starting_after=N`). The stream ends with `data: [DONE]`, or with one "
    "`data: {{\"error\": …}}` event when the request failed after it started."
)


def stream(*chunks: type[serializers.Serializer], kind: str) -> EventStream:
    return EventStream((*chunks, ErrorSerializer), description=STREAM.format(kind=kind))


def generation_responses(whole: type[serializers.Serializer], chunk: type[serializers.Serializer], kind: str) -> dict:
    """200 as one JSON body (`stream` false) or as Server-Sent Events (`stream: true`)."""
    description = f"`stream` false: the whole {kind} as JSON. {STREAM.format(kind=kind)}"
    return {
        (200, "application/json"): OpenApiResponse(whole, description=description),
        (200, "text/event-stream"): stream(chunk, kind=kind),
    }


RESUMED = stream(
    ChatCompletionChunkSerializer, TextCompletionChunkSerializer, kind="chat.completion or text_completion"
)


class EmbeddingSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="embedding")
    index = serializers.IntegerField()
    embedding = serializers.JSONField(
        help_text="a list of floats, or base64 of little-endian float32 (`encoding_format`)"
    )


class EmbeddingUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class EmbeddingListSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="list")
    # (OpenAI's field `data`: DRF's stubs take the name for Serializer.data)
    data = EmbeddingSerializer(many=True)  # type: ignore[assignment]
    model = serializers.CharField()
    usage = EmbeddingUsageSerializer()
    id = serializers.CharField()


class ModelPricingSerializer(serializers.Serializer):
    """OpenRouter's shape: exact USD per token, as decimal strings (1 µ¢ is "0.00000001")."""

    prompt = serializers.CharField(help_text='USD per prompt token, e.g. "0.0000001"')
    completion = serializers.CharField(help_text="USD per generated token")


class ModelArchitectureSerializer(serializers.Serializer):
    modality = serializers.CharField(help_text='"text->text" (chat) or "text->embeddings"')
    input_modalities = serializers.ListField(child=serializers.CharField())
    output_modalities = serializers.ListField(child=serializers.CharField())
    tokenizer = serializers.CharField(
        allow_blank=True, help_text="the GGUF's general.architecture (blank: not read from a file)"
    )
    instruct_type = serializers.CharField(
        allow_null=True, help_text='"chat_template": rendered by the model\'s own template'
    )


class ModelSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="model")
    created = serializers.IntegerField(help_text="Unix seconds")
    owned_by = serializers.CharField()
    kind = serializers.CharField(help_text="chat or embedding")
    context_length = serializers.IntegerField()
    pricing = ModelPricingSerializer()
    architecture = ModelArchitectureSerializer()
    hosts_online = serializers.IntegerField()
    hosts_warm = serializers.IntegerField()
    latency_critical = serializers.BooleanField()
    supported_parameters = serializers.ListField(
        child=serializers.CharField(), help_text="what the model's endpoint takes"
    )


class ModelListSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="list")
    # (OpenAI's field `data`: DRF's stubs take the name for Serializer.data)
    data = ModelSerializer(many=True)  # type: ignore[assignment]


class CreditsKeySerializer(serializers.Serializer):
    prefix = serializers.CharField()
    spend_cap_ucents = serializers.IntegerField(allow_null=True)
    spent_ucents = serializers.IntegerField()
    held_ucents = serializers.IntegerField()


class CreditsSerializer(serializers.Serializer):
    """Amounts in µ¢ (1 USD = 100,000,000 µ¢)."""

    object = serializers.CharField(help_text="credits")
    balance_ucents = serializers.IntegerField()
    held_ucents = serializers.IntegerField()
    available_ucents = serializers.IntegerField()
    available_usd = serializers.CharField(help_text='dollars, as a decimal string with 8 places ("4.99000000")')
    key = CreditsKeySerializer()


class GenerationErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField(allow_blank=True)


class GenerationSerializer(serializers.Serializer):
    """Status, counts and cost of a request: never its prompt or its text."""

    id = serializers.CharField()
    object = serializers.CharField(help_text="generation")
    model = serializers.CharField()
    kind = serializers.CharField(help_text="chat, completion or embeddings")
    status = serializers.CharField(help_text="queued, running, completed or failed")
    created = serializers.IntegerField(help_text="Unix seconds")
    finished = serializers.IntegerField(allow_null=True)
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField(help_text="of the prompt, billed at the cached price (prompt caching)")
    completion_tokens = serializers.IntegerField(help_text="of every choice (`n`)")
    estimate_ucents = serializers.IntegerField()
    cost_ucents = serializers.IntegerField(help_text="of every choice (`n`), the prompt billed once")
    choices = serializers.IntegerField(help_text="the request's `n`")
    finish_reason = serializers.CharField(allow_null=True)
    resumed = serializers.BooleanField()
    settled = serializers.BooleanField(
        help_text="its cost is final: it ended and no audit of its answer is pending "
        "(an audited request settles when its audit is decided; a failed or "
        "unscored audit refunds it)"
    )
    error = GenerationErrorSerializer(allow_null=True)


# --- POST /v1/responses (marketplace.openai.responses) ---


class ResponseTextPartSerializer(serializers.Serializer):
    type = serializers.CharField(help_text="output_text")
    text = serializers.CharField(allow_blank=True)
    annotations = serializers.ListField(child=serializers.JSONField(), help_text="always empty")
    logprobs = serializers.ListField(child=serializers.JSONField(), help_text="always empty")


class ResponseOutputItemSerializer(serializers.Serializer):
    """An output item: an assistant message with its text, or a function call to run."""

    id = serializers.CharField(help_text="msg_… (a message) or fc_… (a function call)")
    type = serializers.CharField(help_text="message or function_call")
    status = serializers.CharField(help_text="in_progress, completed or incomplete")
    role = serializers.CharField(required=False, help_text="a message: assistant")
    content = ResponseTextPartSerializer(many=True, required=False, help_text="a message: its text")
    call_id = serializers.CharField(
        required=False, help_text="a function call: its id, named by the function_call_output item that answers it"
    )
    name = serializers.CharField(required=False, help_text="a function call: the function")
    arguments = serializers.CharField(
        required=False, allow_blank=True, help_text="a function call: its arguments, a JSON object as text"
    )


class ResponseUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    input_tokens_details = serializers.DictField(child=serializers.IntegerField(), help_text="cached_tokens: 0")
    output_tokens = serializers.IntegerField()
    output_tokens_details = serializers.DictField(child=serializers.IntegerField(), help_text="reasoning_tokens: 0")
    total_tokens = serializers.IntegerField()


class ResponseErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField(allow_blank=True)


class ResponseSerializer(serializers.Serializer):
    """A Response object (OpenAI's Responses API): an assistant message with the text, or the function calls."""

    id = serializers.CharField(help_text="resp_…: also the id GET /v1/generation reads")
    object = serializers.CharField(help_text="response")
    created_at = serializers.IntegerField(help_text="Unix seconds")
    status = serializers.CharField(help_text="in_progress, completed, incomplete (cut by max_output_tokens) or failed")
    error = ResponseErrorSerializer(allow_null=True)
    incomplete_details = serializers.DictField(
        allow_null=True, help_text='{"reason": "max_output_tokens"} when incomplete'
    )
    instructions = serializers.CharField(allow_null=True, allow_blank=True)
    max_output_tokens = serializers.IntegerField(allow_null=True)
    model = serializers.CharField()
    output = ResponseOutputItemSerializer(
        many=True, help_text="the message, or the function calls; empty while in progress"
    )
    parallel_tool_calls = serializers.BooleanField()
    previous_response_id = serializers.CharField(allow_null=True)
    reasoning = serializers.DictField(allow_null=True)
    store = serializers.BooleanField()
    temperature = serializers.FloatField(allow_null=True)
    text = serializers.DictField(help_text="format: as asked (text, json_object or json_schema)")
    tool_choice = serializers.JSONField(help_text="as asked: auto (the default), none, required, or an object")
    tools = serializers.ListField(child=serializers.JSONField(), help_text="the function tools, as asked")
    top_p = serializers.FloatField(allow_null=True)
    truncation = serializers.CharField()
    usage = ResponseUsageSerializer(allow_null=True, help_text="null until the response ends")
    user = serializers.CharField(allow_null=True, allow_blank=True)
    metadata = serializers.DictField()


class ResponseEventSerializer(serializers.Serializer):
    """One semantic event of a streamed response; which fields it has depends on its `type`."""

    type = serializers.CharField(
        help_text=(
            "response.created, response.in_progress, response.output_item.added, response.content_part.added, "
            "response.output_text.delta (one per piece of text), "
            "response.output_text.done, response.content_part.done, "
            "response.output_item.done; for a function call response.output_item.added, "
            "response.function_call_arguments.delta (its arguments as they are generated), "
            "response.function_call_arguments.done, response.output_item.done; then response.completed or "
            "response.incomplete; or response.failed"
        )
    )
    sequence_number = serializers.IntegerField(help_text="0, 1, 2, … in the order sent")
    response = ResponseSerializer(
        required=False, help_text="response.created, .in_progress, .completed, .incomplete, .failed"
    )
    output_index = serializers.IntegerField(required=False)
    item_id = serializers.CharField(required=False)
    content_index = serializers.IntegerField(required=False)
    item = ResponseOutputItemSerializer(required=False)
    part = ResponseTextPartSerializer(required=False)
    delta = serializers.CharField(required=False, allow_blank=True)
    text = serializers.CharField(required=False, allow_blank=True)
    name = serializers.CharField(required=False, help_text="response.function_call_arguments.done: the function")
    arguments = serializers.CharField(
        required=False, allow_blank=True, help_text="response.function_call_arguments.done: the whole arguments"
    )
    logprobs = serializers.ListField(child=serializers.JSONField(), required=False)
    x_elephant = ChunkExtrasSerializer(required=False, help_text="on the last event: resumed on another host")


RESPONSE_WHOLE = "`stream` false: the Response object as JSON."
RESPONSE_EVENTS = EventStream(
    (ResponseEventSerializer,),
    done=None,
    description=(
        "`stream: true`: Server-Sent Events as OpenAI sends them, `event: <type>` and `data: <the event as JSON>`. "
        "The stream ends after response.completed, response.incomplete or response.failed (no [DONE])."
    ),
)
