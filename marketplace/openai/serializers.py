"""Input shapes of the OpenAI-compatible API (validation only, no logic)."""

from __future__ import annotations

from typing import Any, cast

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.fields import empty

from core.http import holds_nul
from protocol.jobs import MAX_TOP_LOGPROBS  # chat's `top_logprobs`, as OpenAI

NON_EMPTY = {"type": "string", "minLength": 1}


def _item_invalid(index: int, detail: list | dict) -> serializers.ValidationError:
    """An error keyed by the item's position in a list, as DRF keys a ListField's
    (its stubs allow only string keys)."""
    return serializers.ValidationError(cast(dict[str, Any], {index: detail}))


class UnsupportedParameter(Exception):
    """A parameter that would change the answer, which no host honours yet."""

    def __init__(self, name: str, feature: str) -> None:
        super().__init__(
            f"'{name}' is not supported by this gateway yet ({feature}); the answer would ignore it, so the request is "
            f"refused. Remove '{name}' (supported: {', '.join(SUPPORTED_PARAMETERS)})."
        )
        self.param = name


class StoredField(serializers.Field):
    """A free-form input the request stores (messages, prompt, stop, texts to embed): like
    DRF's CharField, it refuses NUL characters, which the database cannot hold."""

    default_error_messages = {"null_characters": "Null characters are not allowed."}

    def run_validation(self, data: object = empty) -> object:
        value = super().run_validation(data)
        if holds_nul(value):
            self.fail("null_characters")
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                },
            },
        ]
    }
)
class ContentField(StoredField):
    """OpenAI message content: a string, or a list of {"type": "text", "text": ...} parts."""

    default_error_messages = {"invalid": "must be a string or a list of text parts"}

    def to_internal_value(self, data: object) -> str:
        if isinstance(data, str):
            return data
        if isinstance(data, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in data
        ):
            return "".join(part["text"] for part in data)
        self.fail("invalid")

    def to_representation(self, value: str) -> str:
        return value


@extend_schema_field({"oneOf": [NON_EMPTY, {"type": "array", "maxItems": 4, "items": NON_EMPTY}]})  # null: allow_null
class StopField(StoredField):
    default_error_messages = {"invalid": "must be a string or a list of up to 4 non-empty strings"}

    def to_internal_value(self, data: object) -> list[str] | None:
        if data is None:
            return None
        if isinstance(data, str) and data:
            return [data]
        if isinstance(data, list) and len(data) <= 4 and all(isinstance(s, str) and s for s in data):
            return data or None
        self.fail("invalid")

    def to_representation(self, value: list[str] | None) -> list[str] | None:
        return value


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["id", "type", "function"],
            "properties": {
                "id": {"type": "string"},
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name", "arguments"],
                    "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
                },
            },
        },
    }
)
class ToolCallsField(StoredField):
    """An assistant turn's earlier `tool_calls`, as OpenAI returned them."""

    default_error_messages = {
        "invalid": "must be a list of calls, each with an id, type \"function\" and a function "
        "with a name and its arguments as a JSON string"
    }

    def to_internal_value(self, data: object) -> list[dict]:
        def valid(call: object) -> bool:
            if not isinstance(call, dict):
                return False
            function = call.get("function")
            return (
                isinstance(call.get("id"), str)
                and call.get("type", "function") == "function"  # type: ignore[union-attr]
                and isinstance(function, dict)
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)
            )

        if not isinstance(data, list) or not all(valid(call) for call in data):
            self.fail("invalid")
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            }
            for c in data
        ]

    def to_representation(self, value: list[dict]) -> list[dict]:
        return value


class MessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "developer", "user", "assistant", "tool"])
    content = ContentField(allow_null=True, required=False)
    tool_calls = ToolCallsField(required=False, allow_null=True, help_text="an assistant turn's calls")
    tool_call_id = serializers.CharField(
        required=False, max_length=200, help_text="a tool message: the call it answers"
    )

    def to_internal_value(self, data: object) -> dict:
        value = super().to_internal_value(data)
        if value.get("content") is None and not (value["role"] == "assistant" and value.get("tool_calls")):
            raise serializers.ValidationError(
                {"content": "This field is required (null only for an assistant turn with tool_calls)."}
            )
        if value["role"] == "tool" and not value.get("tool_call_id"):
            raise serializers.ValidationError({"tool_call_id": "A tool message names the call it answers."})
        plain = {"role": "system" if value["role"] == "developer" else value["role"], "content": value.get("content")}
        if value.get("tool_calls"):
            plain["tool_calls"] = value["tool_calls"]
        if value["role"] == "tool":
            plain["tool_call_id"] = value["tool_call_id"]
        return plain


@extend_schema_field(
    {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    }
)
class ResponseFormatField(StoredField):
    """OpenAI `response_format`: free text, any JSON object, or JSON matching a schema. The
    host samples under a grammar made from it (llama.cpp's JSON-schema converter, checked
    here so a schema it cannot take is a 400, not a host's failure); the gateway validates
    the answer before calling it complete. Internally: None, {"type": "json_object"} or
    {"type": "json_schema", "name", "schema"}."""

    default_error_messages = {
        "invalid": "must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
        "{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}",
        "schema": "json_schema.schema {why}",
    }

    def to_internal_value(self, data: object) -> dict | None:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        spec = data.get("json_schema") if isinstance(data, dict) and kind == "json_schema" else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            self.fail("invalid")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            self.fail("invalid")
        from marketplace.lifecycle.structured import schema_refusal

        why = schema_refusal(schema)
        if why:
            self.fail("schema", why=why)
        return {"type": "json_schema", "name": spec["name"][:64], "schema": schema}

    def to_representation(self, value: dict | None) -> dict | None:
        return value


STOP_WITH_FORMAT = (
    "a stop sequence cannot be combined with a JSON response_format (json_schema, json_object) or a "
    "required tool call: the answer is sampled under the format's grammar, which already ends it where its "
    "JSON ends, so a stop sequence could only cut the JSON short. Remove 'stop'."
)


def stop_checked(data: dict, *, response_format: dict | None) -> dict:
    """Refuse `stop` beside a structured format (400 on `stop`).

    OpenAI delivers such an answer cut at the stop sequence, unchecked, with finish_reason
    "stop"; this gateway refuses the pair up front instead. The host samples under the format's
    grammar, which ends the answer where its JSON ends, so a stop sequence can only cut it
    short; and a cut answer can neither be checked against the format nor told from a dishonest
    host's junk cut at the same string, so accepting it would have to pay any text. Before this
    refusal such an answer failed as its honest host's fault; refused at admission, it is never
    anyone's failure (a request admitted earlier is not its host's either:
    `structured.answer_refusal`)."""
    if data.get("stop") and response_format:
        raise serializers.ValidationError({"stop": STOP_WITH_FORMAT})
    return data


class ProviderSerializer(serializers.Serializer):
    """OpenRouter-style provider preferences; only those the marketplace honours are accepted."""

    trusted_only = serializers.BooleanField(required=False, default=False, help_text="serve on trusted hosts only")

    def to_internal_value(self, data: object) -> dict:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    f"unsupported provider preference {unknown[0]!r}; supported: trusted_only"
                )
        return super().to_internal_value(data)


# Parameters that would change the answer but that no host honours yet: refused by name
# (400 `unsupported_parameter`) rather than accepted and silently ignored. Each is allowed
# at the value that changes nothing. Parameters that change no output (`user`, `metadata`,
# `store`, `service_tier`, ...) are accepted.
def _absent(value: object) -> bool:
    return value is None or value is False or value == [] or value == {}


def _zero(value: object) -> bool:
    return value is None or value == 0


TOOL_PARAMETERS = ("tools", "tool_choice", "parallel_tool_calls")
UNSUPPORTED: dict[str, tuple[object, str]] = {  # name -> (the value that changes nothing, what to send instead)
    "tools": (_absent, "tool calling, on /v1/chat/completions only"),
    "tool_choice": (lambda v: v is None or v == "none", "tool calling, on /v1/chat/completions only"),
    "parallel_tool_calls": (lambda v: True, ""),  # meaningless without tools, which are refused
    "functions": (_absent, "function calling"),
    "function_call": (lambda v: v is None or v == "none", "function calling"),
    "logit_bias": (_absent, "logit bias"),
    "presence_penalty": (_zero, "presence penalty"),
    "frequency_penalty": (_zero, "frequency penalty"),
    "best_of": (lambda v: v is None or v == 1, "best_of"),
    "echo": (lambda v: v is None or v is False, "echo"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion)"),
    "modalities": (lambda v: v is None or v == ["text"], "modalities other than text"),
    "audio": (lambda v: v is None, "audio output"),
    "prediction": (lambda v: v is None, "predicted outputs"),
}
SUPPORTED_PARAMETERS = [
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "provider",
    "response_format",
    "models",
    "n",
    "logprobs",
    "top_logprobs",
    *TOOL_PARAMETERS,
]


MAX_FALLBACK_MODELS = 4
MAX_CHOICES = 4  # `n`
MAX_COMPLETION_LOGPROBS = 5  # completions' `logprobs`, as OpenAI


class SamplingSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=100)
    provider = ProviderSerializer(required=False, allow_null=True)
    max_tokens = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=settings.MAX_TOKENS_LIMIT
    )
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=2.0)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    stop = StopField(required=False, allow_null=True)
    seed = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=2**31 - 1)
    n = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=MAX_CHOICES,
        help_text=f"choices: each a request of its own, billed as such (at most {MAX_CHOICES})",
    )
    stream = serializers.BooleanField(required=False, default=False)
    stream_options = serializers.DictField(required=False, allow_null=True)
    response_format = ResponseFormatField(required=False, allow_null=True)
    models = serializers.ListField(
        child=serializers.CharField(max_length=100),
        required=False,
        allow_null=True,
        max_length=MAX_FALLBACK_MODELS,
        help_text=(
            "fallbacks (OpenRouter's convention): tried in order "
            "when `model` has no host online, or its queue times out"
        ),
    )

    default_max_tokens = settings.DEFAULT_MAX_TOKENS
    unsupported = UNSUPPORTED

    def to_internal_value(self, data: object) -> dict:
        if isinstance(data, dict):
            for name, (harmless, feature) in self.unsupported.items():
                if name in data and not harmless(data[name]):  # type: ignore[operator]
                    raise UnsupportedParameter(name, feature)
        return super().to_internal_value(data)

    def validate(self, data: dict) -> dict:
        return stop_checked(data, response_format=data.get("response_format"))

    def params(self) -> dict:
        data = self.validated_data
        return {
            "max_tokens": data.get("max_tokens") or self.default_max_tokens,
            "temperature": 1.0 if data.get("temperature") is None else data["temperature"],
            "top_p": 1.0 if data.get("top_p") is None else data["top_p"],
            "stop": data.get("stop"),
            "seed": data.get("seed"),
            "response_format": data.get("response_format"),
        }

    def include_usage(self) -> bool:
        return bool((self.validated_data.get("stream_options") or {}).get("include_usage"))


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "parameters": {"type": "object"},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
        },
    }
)
class ToolsField(StoredField):
    """OpenAI `tools`: functions the model may call (checked with `tool_choice` in validate)."""

    def to_internal_value(self, data: object) -> object:
        return data

    def to_representation(self, value: object) -> object:
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                },
            },
        ]
    }
)
class ToolChoiceField(ToolsField):
    """OpenAI `tool_choice`."""


class ChatInputSerializer(SamplingSerializer):
    # DRF passes max_length on to the ListSerializer that many=True makes; the stubs lack it
    messages = MessageSerializer(many=True, allow_empty=False, max_length=1000)  # type: ignore[call-arg]
    max_completion_tokens = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=settings.MAX_TOKENS_LIMIT
    )
    logprobs = serializers.BooleanField(
        required=False, allow_null=True, help_text="each token's log-probability, from the host's own sampler"
    )
    top_logprobs = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=MAX_TOP_LOGPROBS,
        help_text="with logprobs: the likeliest alternatives at each token",
    )
    tools = ToolsField(required=False, allow_null=True)
    tool_choice = ToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)
    unsupported = {name: rule for name, rule in UNSUPPORTED.items() if name not in TOOL_PARAMETERS}

    def validate_messages(self, messages: list[dict]) -> list[dict]:
        if not any(m["role"] == "user" for m in messages):
            raise serializers.ValidationError("needs at least one message with role 'user'")
        return messages

    def validate(self, data: dict) -> dict:
        if data.get("top_logprobs") and not data.get("logprobs"):
            raise serializers.ValidationError({"top_logprobs": "top_logprobs needs logprobs: true."})
        return self._with_tools(data)

    def _with_tools(self, data: dict) -> dict:
        """Tools are checked, and the messages become the plain turns the host renders (see
        marketplace.openai.tool_calls); a required call is a structured format (`stop_checked`)."""
        from marketplace.openai.tool_calls import ToolsRefused, prompt_messages, required_format, tools_spec

        try:
            spec = tools_spec(
                tools=data.get("tools"), tool_choice=data.get("tool_choice"), parallel=data.get("parallel_tool_calls")
            )
        except ToolsRefused as refused:
            raise serializers.ValidationError({refused.param: str(refused)}) from None
        stop_checked(data, response_format=required_format(spec) or data.get("response_format"))
        return {**data, "tool_spec": spec, "messages": prompt_messages(data["messages"], spec)}

    def params(self) -> dict:
        from marketplace.openai.tool_calls import required_format

        params = super().params()
        if self.validated_data.get("max_completion_tokens"):
            params["max_tokens"] = self.validated_data["max_completion_tokens"]
        if self.validated_data.get("logprobs"):
            params["logprobs"] = self.validated_data.get("top_logprobs") or 0
        spec = self.validated_data.get("tool_spec")
        if spec is not None:
            params["tools"] = spec
            params["response_format"] = required_format(spec) or params["response_format"]
        return params


@extend_schema_field({"oneOf": [NON_EMPTY, {"type": "array", "minItems": 1, "maxItems": 1, "items": NON_EMPTY}]})
class PromptField(StoredField):
    default_error_messages = {"invalid": "must be a non-empty string (or a list holding one string)"}

    def to_internal_value(self, data: object) -> str:
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if isinstance(data, str) and data:
            return data
        self.fail("invalid")

    def to_representation(self, value: str) -> str:
        return value


class CompletionInputSerializer(SamplingSerializer):
    prompt = PromptField()
    logprobs = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=MAX_COMPLETION_LOGPROBS,
        help_text="each token's log-probability, with this many likeliest alternatives",
    )
    default_max_tokens = 16  # OpenAI's default for /v1/completions

    def params(self) -> dict:
        params = super().params()
        if self.validated_data.get("logprobs") is not None:
            params["logprobs"] = self.validated_data["logprobs"]
        return params


MAX_EMBEDDING_INPUTS = (
    128  # per request: the vectors must fit a host API body (MAX_BODY_BYTES), and embed well inside the stall watchdog
)


@extend_schema_field(
    {"oneOf": [NON_EMPTY, {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS, "items": NON_EMPTY}]}
)
class EmbeddingInputField(StoredField):
    """OpenAI `input`: one string or a list of strings (token arrays are not accepted)."""

    default_error_messages = {
        "invalid": "must be a non-empty string or a list of 1 to {limit} non-empty strings",
        "tokens": "token arrays are not supported; send the text",
    }

    def to_internal_value(self, data: object) -> list[str]:
        if isinstance(data, str) and data:
            return [data]
        if isinstance(data, list) and data and all(isinstance(item, int) for item in data):
            self.fail("tokens")
        if isinstance(data, list) and data and all(isinstance(item, list) for item in data):
            self.fail("tokens")
        if (
            isinstance(data, list)
            and 0 < len(data) <= MAX_EMBEDDING_INPUTS
            and all(isinstance(t, str) and t for t in data)
        ):
            return data
        self.fail("invalid", limit=MAX_EMBEDDING_INPUTS)

    def to_representation(self, value: list[str]) -> list[str]:
        return value


class EmbeddingsInputSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=100)
    input = EmbeddingInputField()
    encoding_format = serializers.ChoiceField(choices=["float", "base64"], required=False, default="float")
    dimensions = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
    provider = ProviderSerializer(required=False, allow_null=True)

    def validate_dimensions(self, value: int | None) -> int | None:
        if value is not None:
            raise serializers.ValidationError("choosing the number of dimensions is not supported; omit it")
        return value


# --- POST /v1/responses (OpenAI's Responses API: marketplace.openai.responses) ---
