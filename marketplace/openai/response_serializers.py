"""Input shapes of the Responses API (`POST /v1/responses`): validation only, no logic. What it
shares with chat and completions (`StoredField`, the item errors) is `serializers`'."""

from __future__ import annotations

import re

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from marketplace.openai.serializers import StoredField, _absent, _item_invalid, _zero


class NotOfferedYet(Exception):
    """A part of OpenAI's Responses API this gateway does not offer yet: refused by name (400
    `unsupported_parameter`) rather than accepted and silently ignored."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _none_only(value: object) -> bool:
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


# name -> (the value that changes nothing, what is not offered yet). `stream_options` only shapes
# the stream, and `user`, `metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier`
# change no answer: all accepted. Built-in tools (web search, files, computers, MCP...) are
# refused by `ResponsesToolsField`.
RESPONSES_NOT_OFFERED: dict[str, tuple[object, str]] = {
    "reasoning": (_none_only, "reasoning settings: the served models do not reason"),
    "include": (_absent, "extra output to include (log-probabilities, reasoning)"),
    "top_logprobs": (_zero, "log-probabilities on /v1/responses; /v1/chat/completions has logprobs"),
    "truncation": (lambda v: v in (None, "disabled"), "truncation: a prompt over the context is a 400"),
    "background": (lambda v: v in (None, False), "background responses"),
    "prompt": (lambda v: v is None, "prompt templates"),
    "conversation": (lambda v: v is None, "the Conversations API; previous_response_id continues a stored response"),
    "max_tool_calls": (lambda v: v is None, "a cap on built-in tool calls: only function tools are offered"),
    "context_management": (lambda v: v is None, "context management"),
}
RESPONSE_ROLES = ("user", "system", "developer", "assistant")
CONTENT_TYPES = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and format names
MAX_CALL_ID_CHARS = 200
CALL_ID = {"type": "string", "minLength": 1, "maxLength": MAX_CALL_ID_CHARS}
BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)
TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
    },
}


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string"},
            {
                "type": "array",
                "minItems": 1,
                "items": {
                    "oneOf": [
                        {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "type": {"type": "string", "enum": ["message"]},
                                "role": {"type": "string", "enum": list(RESPONSE_ROLES)},
                                "content": {"oneOf": [{"type": "string"}, TEXT_PARTS]},
                            },
                        },
                        {
                            "type": "object",
                            "required": ["type", "call_id", "name", "arguments"],
                            "properties": {
                                "type": {"type": "string", "enum": ["function_call"]},
                                "call_id": CALL_ID,
                                "name": {"type": "string", "pattern": FUNCTION_NAME},
                                "arguments": {"type": "string"},
                                "id": {"type": "string"},
                                "status": {"type": "string"},
                            },
                        },
                        {
                            "type": "object",
                            "required": ["type", "call_id", "output"],
                            "properties": {
                                "type": {"type": "string", "enum": ["function_call_output"]},
                                "call_id": CALL_ID,
                                "output": {"oneOf": [{"type": "string"}, TEXT_PARTS]},
                                "id": {"type": "string"},
                                "status": {"type": "string"},
                            },
                        },
                    ]
                },
            },
        ]
    }
)
class ResponsesInputField(StoredField):
    """The Responses API's `input`: a string (one user turn) or items: messages (each text given
    as a string or `input_text` / `output_text` parts), the model's earlier function calls and
    their outputs. Internally: chat turns ({"role", "content"}, a developer turn as a system
    one; consecutive function calls as one assistant turn's `tool_calls`, each output a `tool`
    turn naming its call). Other item and part types (images, files, reasoning, references to
    stored items) are not offered yet: NotOfferedYet, naming where."""

    default_error_messages = {"invalid": "must be a string or a non-empty list of items"}

    def to_internal_value(self, data: object) -> list[dict]:
        if isinstance(data, str):
            return [{"role": "user", "content": data}]
        if not isinstance(data, list) or not data:
            self.fail("invalid")
        turns: list[dict] = []
        calls: set[str] = set()
        for index, item in enumerate(data):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "function_call":
                call = self._call(item, index)  # type: ignore[arg-type]
                calls.add(call["id"])
                if turns and turns[-1]["role"] == "assistant":
                    turns[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
                else:
                    turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                turns.append(self._output(item, index, calls))  # type: ignore[arg-type]
            else:
                turns.append(self._turn(item, index))
        return turns

    def _turn(self, item: object, index: int) -> dict:
        if not isinstance(item, dict):
            raise _item_invalid(
                index,
                [
                    "must be an item: a message {\"role\": ..., \"content\": ...}, "
                    "a function_call or a function_call_output"
                ],
            )
        kind = item.get("type", "message")
        if kind != "message":
            raise NotOfferedYet(
                f"input[{index}].type",
                f"Input items of type {str(kind)[:40]!r} are not offered yet on "
                "/v1/responses (messages, function_call and function_call_output are).",
            )
        role = item.get("role")
        if role not in RESPONSE_ROLES:
            raise _item_invalid(index, {"role": [f"must be one of {', '.join(RESPONSE_ROLES)}"]})
        return {
            "role": "system" if role == "developer" else role,
            "content": self._text(item.get("content"), index, role),
        }

    def _call(self, item: dict, index: int) -> dict:
        """A function_call item (the model's earlier call) as a chat `tool_calls` entry."""
        for name in ("call_id", "name", "arguments"):
            value = item.get(name)
            if not isinstance(value, str) or (not value and name != "arguments"):
                raise _item_invalid(
                    index,
                    {
                        name: [
                            "must be a non-empty string"
                            if name != "arguments"
                            else "must be the call's arguments as a JSON string"
                        ]
                    },
                )
        if len(item["call_id"]) > MAX_CALL_ID_CHARS:
            raise _item_invalid(index, {"call_id": [f"must be at most {MAX_CALL_ID_CHARS} characters"]})
        return {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }

    def _output(self, item: dict, index: int, calls: set[str]) -> dict:
        """A function_call_output item as a chat `tool` turn; it answers a call made earlier in the input."""
        call = item.get("call_id")
        if not isinstance(call, str) or not call:
            raise _item_invalid(index, {"call_id": ["must name the function_call it answers"]})
        if call not in calls:
            raise _item_invalid(
                index,
                {
                    "call_id": [
                        f"no function_call with call_id {call[:200]!r} comes "
                        "before this output in 'input' (send the call too, "
                        "or continue the stored response that made it with 'previous_response_id')"
                    ]
                },
            )
        output = item.get("output")
        if isinstance(output, list):
            output = self._text(output, index, "user", field="output")
        if not isinstance(output, str):
            raise _item_invalid(index, {"output": ["must be a string or a list of input_text parts"]})
        return {"role": "tool", "tool_call_id": call, "content": output}

    def _text(self, content: object, index: int, role: str, *, field: str = "content") -> str:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise _item_invalid(index, {field: ["must be a string or a list of text parts"]})
        texts = []
        for at, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):  # type: ignore[union-attr]
                texts.append(part["text"])  # type: ignore[index]
            elif isinstance(kind, str) and kind not in ("input_text", "output_text"):
                raise NotOfferedYet(
                    f"input[{index}].{field}[{at}].type",
                    f"Content of type {kind[:40]!r} is not offered "
                    f"yet on /v1/responses: text only ({CONTENT_TYPES[role]} parts, or a string).",
                )
            else:
                raise _item_invalid(
                    index,
                    {
                        field: {
                            at: [
                                "must be a text part: {\"type\": \"input_text\" or \"output_text\", \"text\": \"...\"}"
                            ]
                        }
                    },
                )
        return "".join(texts)

    def to_representation(self, value: list[dict]) -> list[dict]:
        return value


FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "name": {"type": "string", "pattern": FUNCTION_NAME},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]},
    },
}


@extend_schema_field({"type": "array", "maxItems": 64, "items": FUNCTION_TOOL})
class ResponsesToolsField(StoredField):
    """The Responses API's `tools`: function tools in its flat shape (`name`, `description`,
    `parameters`, `strict` beside `type`). Built-in tools (web search, file search, computer
    use, MCP, code interpreter...) are not offered: NotOfferedYet naming the tool's type."""

    def to_internal_value(self, data: object) -> list[dict]:
        from marketplace.openai.tool_calls import MAX_TOOLS

        if not isinstance(data, list) or len(data) > MAX_TOOLS:
            raise serializers.ValidationError(f"must be a list of at most {MAX_TOOLS} function tools")
        tools = [self._tool(tool, index) for index, tool in enumerate(data)]
        names = [tool["name"] for tool in tools]
        if len(set(names)) != len(names):
            raise serializers.ValidationError("two tools share a name")
        return tools

    def _tool(self, tool: object, index: int) -> dict:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in BUILT_IN_TOOLS:
            raise NotOfferedYet(
                f"tools[{index}].type",
                f"Built-in tools ({kind!r}) are not offered on /v1/responses: "
                "only function tools, which your code runs ({\"type\": \"function\", \"name\": ..., "
                "\"parameters\": {...}}).",
            )
        if kind != "function":
            raise _item_invalid(index, {"type": ["must be 'function' (a function tool)"]})
        assert isinstance(tool, dict)
        name, description, parameters, strict = (tool.get(k) for k in ("name", "description", "parameters", "strict"))
        if not isinstance(name, str) or not re.match(FUNCTION_NAME, name):
            raise _item_invalid(index, {"name": ["must be 1 to 64 letters, digits, '_' or '-'"]})
        if parameters is not None and not isinstance(parameters, dict):
            raise _item_invalid(index, {"parameters": ["must be a JSON Schema object"]})
        if description is not None and not isinstance(description, str):
            raise _item_invalid(index, {"description": ["must be a string"]})
        if strict is not None and not isinstance(strict, bool):
            raise _item_invalid(index, {"strict": ["must be a boolean"]})
        return {
            "type": "function",
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": strict,
        }

    def to_representation(self, value: list[dict]) -> list[dict]:
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {"type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}},
            },
            {
                "type": "object",
                "required": ["type", "mode", "tools"],
                "properties": {
                    "type": {"type": "string", "enum": ["allowed_tools"]},
                    "mode": {"type": "string", "enum": ["auto", "required"]},
                    "tools": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "name"],
                            "properties": {
                                "type": {"type": "string", "enum": ["function"]},
                                "name": {"type": "string"},
                            },
                        },
                    },
                },
            },
        ]
    }
)
class ResponsesToolChoiceField(StoredField):
    """The Responses API's `tool_choice`: "none", "auto", "required", one function
    ({"type": "function", "name": ...}) or a subset of the tools ({"type": "allowed_tools",
    "mode": "auto" or "required", "tools": [{"type": "function", "name": ...}]}). Choices of
    built-in tools are not offered. Whether the names are among `tools` is checked with them."""

    default_error_messages = {
        "invalid": "must be 'none', 'auto', 'required', {{\"type\": \"function\", \"name\": ...}} or "
        "{{\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}}"
    }

    def to_internal_value(self, data: object) -> str | dict:
        if data in ("none", "auto", "required"):
            return data  # type: ignore[return-value]
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "function" and isinstance(data, dict) and isinstance(data.get("name"), str):
            return {"type": "function", "name": data["name"]}
        if kind == "allowed_tools":
            assert isinstance(data, dict)
            tools = data.get("tools")
            if (
                data.get("mode") not in ("auto", "required")
                or not isinstance(tools, list)
                or not tools
                or not all(
                    isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
                    for t in tools
                )
            ):
                self.fail("invalid")
            return {
                "type": "allowed_tools",
                "mode": data["mode"],
                "tools": [{"type": "function", "name": t["name"]} for t in tools],
            }
        if isinstance(kind, str) and (kind in BUILT_IN_TOOLS or kind.startswith(("web_search", "file_search"))):
            raise NotOfferedYet(
                "tool_choice",
                f"Choosing a built-in tool ({kind[:40]!r}) is not offered on /v1/responses: only function tools.",
            )
        self.fail("invalid")

    def to_representation(self, value: object) -> object:
        return value


FORMATS = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "name", "schema"],
            "properties": {
                "type": {"type": "string", "enum": ["json_schema"]},
                "name": {"type": "string", "pattern": FUNCTION_NAME},
                "schema": {"type": "object"},
                "description": {"type": ["string", "null"]},
                "strict": {"type": ["boolean", "null"]},
            },
        },
    ]
}


@extend_schema_field(
    {
        "type": "object",
        "properties": {"format": FORMATS, "verbosity": {"type": ["string", "null"], "enum": ["medium", None]}},
    }
)
class ResponsesTextField(StoredField):
    """The Responses API's `text`: its `format` is free text ({"type": "text"}), any JSON object
    ({"type": "json_object"}) or JSON matching a schema ({"type": "json_schema", "name", "schema",
    "strict"}), served as the chat's `response_format` (the host samples under the schema's
    grammar; whether the schema can be one is checked with the chat's, off the event loop).
    Internally: the format, in the Responses API's shape (None: text). `verbosity` is for
    models that choose their length: only its default ("medium") is taken."""

    default_error_messages = {
        "invalid": "must be {{\"format\": {{\"type\": \"text\"}}}}, {{\"format\": {{\"type\": "
        "\"json_object\"}}}} or {{\"format\": {{\"type\": \"json_schema\", \"name\": ..., "
        "\"schema\": {{...}}}}}}"
    }

    def to_internal_value(self, data: object) -> dict | None:
        if not isinstance(data, dict):
            self.fail("invalid")
        assert isinstance(data, dict)
        if data.get("verbosity") not in (None, "medium"):
            raise NotOfferedYet(
                "text.verbosity",
                "'text.verbosity' other than 'medium' is not offered on /v1/responses: "
                "the served models do not choose their length (max_output_tokens bounds it).",
            )
        unknown = sorted(set(data) - {"format", "verbosity"})
        if unknown:
            raise serializers.ValidationError({unknown[0]: ["is not a field of 'text' (format, verbosity)"]})
        form = data.get("format")
        kind = form.get("type") if isinstance(form, dict) else None
        if form is None or kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind != "json_schema":
            raise serializers.ValidationError({"format": {"type": ["must be 'text', 'json_object' or 'json_schema'"]}})
        assert isinstance(form, dict)
        if not isinstance(form.get("name"), str) or not re.match(FUNCTION_NAME, form["name"]):
            raise serializers.ValidationError({"format": {"name": ["must be 1 to 64 letters, digits, '_' or '-'"]}})
        if not isinstance(form.get("schema"), dict):
            raise serializers.ValidationError({"format": {"schema": ["must be a JSON Schema object"]}})
        if form.get("strict") is not None and not isinstance(form["strict"], bool):
            raise serializers.ValidationError({"format": {"strict": ["must be a boolean"]}})
        if form.get("description") is not None and not isinstance(form["description"], str):
            raise serializers.ValidationError({"format": {"description": ["must be a string"]}})
        return {
            "type": "json_schema",
            "name": form["name"],
            "schema": form["schema"],
            "description": form.get("description"),
            "strict": form.get("strict"),
        }

    def to_representation(self, value: dict | None) -> dict | None:
        return value


class ResponsesInputSerializer(serializers.Serializer):
    """POST /v1/responses: what it takes is validated here, what it does not take is refused by
    name (`RESPONSES_NOT_OFFERED`, built-in tools). Schemas (a function's
    parameters, `text.format`'s) are checked as the chat's are, once translated."""

    model = serializers.CharField(max_length=100)
    input = ResponsesInputField()
    instructions = serializers.CharField(
        required=False,
        allow_null=True,
        allow_blank=True,
        trim_whitespace=False,
        help_text="a system turn before the input",
    )
    max_output_tokens = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=settings.MAX_TOKENS_LIMIT
    )
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=2.0)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    stream = serializers.BooleanField(required=False, default=False)
    tools = ResponsesToolsField(required=False, allow_null=True, help_text="function tools the model may call")
    tool_choice = ResponsesToolChoiceField(
        required=False, allow_null=True, help_text="auto (the default), none, required, one function, or allowed_tools"
    )
    parallel_tool_calls = serializers.BooleanField(
        required=False, allow_null=True, help_text="false: at most one call per answer"
    )
    text = ResponsesTextField(required=False, allow_null=True, help_text="format: text, json_object or json_schema")
    store = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="true: kept for RESPONSE_STORE_SECONDS (an hour), to continue or read back",
    )
    previous_response_id = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=200,
        help_text="a stored response whose conversation this one continues",
    )
    metadata = serializers.DictField(
        child=serializers.CharField(max_length=512, allow_blank=True), required=False, allow_null=True
    )
    user = serializers.CharField(required=False, allow_blank=True, allow_null=True, max_length=256)

    def to_internal_value(self, data: object) -> dict:
        if isinstance(data, dict):
            for name, (harmless, feature) in RESPONSES_NOT_OFFERED.items():
                if name in data and not harmless(data[name]):  # type: ignore[operator]
                    raise NotOfferedYet(
                        name,
                        f"'{name}' is not offered yet on /v1/responses ({feature}); the answer "
                        f"would ignore it, so the request is refused. Remove '{name}'.",
                    )
        return super().to_internal_value(data)

    def validate_input(self, turns: list[dict]) -> list[dict]:
        if not any(turn["role"] == "user" for turn in turns):
            raise serializers.ValidationError("needs at least one message with role 'user'")
        return turns

    def validate(self, data: dict) -> dict:
        """`tool_choice` names only offered functions, and asks for a call only when there are some."""
        names = {tool["name"] for tool in data.get("tools") or []}
        choice = data.get("tool_choice")
        named = (
            [choice["name"]]
            if isinstance(choice, dict) and choice["type"] == "function"
            else [t["name"] for t in choice["tools"]]
            if isinstance(choice, dict)
            else []
        )
        missing = [name for name in named if name not in names]
        if missing:
            raise serializers.ValidationError(
                {"tool_choice": [f"names a function that is not in tools: {missing[0][:64]!r}"]}
            )
        if not names and choice not in (None, "none", "auto"):
            raise serializers.ValidationError({"tool_choice": ["needs tools: no function is offered"]})
        return data
