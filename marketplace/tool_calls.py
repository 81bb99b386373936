"""Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) on models with no tool format
of their own.

Everything happens at the gateway, so every host serves tools as it is:
- the offered functions are described in a system turn, with the one answer shape that
  calls them: `{"tool_calls": [{"name": ..., "arguments": {...}}]}`;
- an assistant turn that called functions is rendered back in that shape, and a `tool`
  message becomes a user turn naming the function that answered;
- when a call is required (`tool_choice` "required" or a named function) the host samples
  under the grammar of that shape (structured output: the same `response_format` path, so
  the answer is validated before it is a success); under "auto" the model may answer
  either way, and an answer that is exactly a valid call is one;
- the answer is handed over in OpenAI's shape: `message.tool_calls` with JSON `arguments`
  and finish_reason "tool_calls".
"""
from __future__ import annotations

import hashlib
import json

MAX_TOOLS = 64
MAX_PARALLEL_CALLS = 8  # calls in one answer (a small model may repeat a call until max_tokens otherwise)
CALLS = "tool_calls"


class ToolsRefused(ValueError):
    """`tools` or `tool_choice` cannot be served as sent (a 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def tools_spec(*, tools: list | None, tool_choice: object, parallel: bool | None) -> dict | None:
    """The request's internal tool spec, or None when no tool is offered or `tool_choice` is
    "none" (the answer is then free text). Raises ToolsRefused."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolsRefused("tool_choice needs tools: no function is offered", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolsRefused(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    functions = [_function(tool) for tool in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolsRefused("two tools share a name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ToolsRefused(f"tool_choice names a function that is not in tools: {name!r}", "tool_choice")
        choice = {"name": name}
    elif choice not in ("auto", "required"):
        raise ToolsRefused("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                           "'function': {'name': ...}}", "tool_choice")
    called = [f for f in functions if not isinstance(choice, dict) or f["name"] == choice["name"]]
    single = isinstance(choice, dict) or parallel is False
    most = 1 if single else MAX_PARALLEL_CALLS
    spec = {"functions": functions, "choice": choice, "schema": calls_schema(called, most=most)}
    from marketplace.structured import schema_problem

    why = schema_problem(spec["schema"])
    if why:
        raise ToolsRefused(f"a function's parameters cannot constrain an answer: {why}", "tools")
    return spec


def _function(tool: object) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolsRefused("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}", "tools")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolsRefused(f"function {function['name']!r}: parameters must be a JSON Schema object", "tools")
    description = function.get("description")
    return {"name": function["name"][:64], "description": description[:1000] if isinstance(description, str) else "",
            "parameters": parameters}


def calls_schema(functions: list[dict], *, most: int) -> dict:
    """The JSON Schema of an answer that calls some of `functions` (at most `most` calls)."""
    one = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    calls = {"type": "array", "minItems": 1, "maxItems": most, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    return {"type": "object", "properties": {CALLS: calls}, "required": [CALLS], "additionalProperties": False}


def required_format(spec: dict | None) -> dict | None:
    """The `response_format` a host samples under when a call is required, or None."""
    if spec is None or spec["choice"] == "auto":
        return None
    return {"type": "json_schema", "name": CALLS, "schema": spec["schema"]}


def prompt_messages(messages: list[dict], spec: dict | None) -> list[dict]:
    """Plain system/user/assistant messages for the prompt: the tools described first, tool
    calls and results written out."""
    names = {call["id"]: call["function"]["name"] for m in messages for call in m.get(CALLS) or []}
    plain = [{"role": "system", "content": _instructions(spec)}] if spec is not None else []
    for message in messages:
        if message["role"] == "tool":
            name = names.get(message.get("tool_call_id"), message.get("tool_call_id") or "a function")
            plain.append({"role": "user", "content": f"Result of {name}: {message['content']}"})
        elif message.get(CALLS):
            calls = [{"name": c["function"]["name"], "arguments": _parsed(c["function"]["arguments"])}
                     for c in message[CALLS]]
            text = json.dumps({CALLS: calls}, separators=(", ", ": "))
            plain.append({"role": "assistant", "content": f"{message['content']}\n{text}" if message["content"] else text})
        else:
            plain.append({"role": message["role"], "content": message["content"] or ""})
    return plain


def _parsed(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _instructions(spec: dict) -> str:
    listed = "\n".join(
        f"- {f['name']}: {f['description'] or '(no description)'} Parameters (JSON Schema): "
        f"{json.dumps(f['parameters'], separators=(',', ':'))}" for f in spec["functions"])
    choice = spec["choice"]
    must = ("Answer by calling the function " + choice["name"] if isinstance(choice, dict)
            else "Answer by calling one or more of them" if choice == "required"
            else "When a function would help, call it; otherwise answer normally")
    return (f"You can call these functions:\n{listed}\n{must}. A call is an answer that is only this JSON: "
            f'{{"{CALLS}": [{{"name": "<function name>", "arguments": {{<arguments>}}}}]}}')


def tool_calls_in(spec: dict | None, text: str, *, request_id: str, cut: bool = False) -> list[dict] | None:
    """The answer's calls in OpenAI's shape when it is exactly a valid call, else None. An
    answer `cut` by max_tokens keeps the calls it completed (a small model may list calls
    until its budget runs out; the finish_reason still says "length")."""
    if spec is None or not text.lstrip().startswith("{"):
        return None
    from jsonschema import exceptions

    from marketplace.structured import schema_validator

    try:
        value = json.loads(text)
        schema_validator(spec["schema"]).validate(value)
        made = value[CALLS]
    except (ValueError, exceptions.ValidationError):
        made = _completed_calls(spec, text) if cut else []
    if not made:
        return None
    return [{"id": call_id(request_id, index), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
            for index, call in enumerate(made)]


def _completed_calls(spec: dict, text: str) -> list[dict]:
    """The calls a cut answer finished, in order: each a whole, valid item of its list."""
    from marketplace.structured import schema_validator

    opening = text.find("[", text.find(f'"{CALLS}"'))
    if text.find(f'"{CALLS}"') < 0 or opening < 0:
        return []
    calls_schema_ = spec["schema"]["properties"][CALLS]
    valid = schema_validator(calls_schema_["items"])
    decoder, at, done = json.JSONDecoder(), opening + 1, []
    while len(done) < calls_schema_["maxItems"]:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        if not valid.is_valid(item):
            break
        done.append(item)
    return done


def call_id(request_id: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


class CallHolder:
    """Splits a streamed answer into content, relayed as it comes, and a call, held to the
    end: a required call is held whole; under "auto" the first visible character decides
    (a call starts with "{")."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.held: list[str] = []
        self.held_logprobs: list[dict] = []  # (held with their text)
        self.holding: bool | None = None if spec["choice"] == "auto" else True

    def feed(self, text: str, logprobs: list[dict] | None = None) -> tuple[str, list[dict]]:
        """The text to relay now ("" while it is held), with its log-probability entries."""
        if self.holding is False:
            return text, logprobs or []
        self.held.append(text)
        self.held_logprobs += logprobs or []
        if self.holding is None:
            joined = "".join(self.held)
            if joined.strip():
                self.holding = joined.lstrip().startswith("{")
                if not self.holding:
                    entries, self.held, self.held_logprobs = self.held_logprobs, [], []
                    return joined, entries
        return "", []

    def finish(self, *, request_id: str, cut: bool = False) -> tuple[str, list[dict], list[dict] | None]:
        """At the end: (content still to relay, its entries, the calls or None); `cut`: by max_tokens."""
        text = "".join(self.held)
        calls = tool_calls_in(self.spec, text, request_id=request_id, cut=cut)
        return ("", [], calls) if calls else (text, self.held_logprobs, None)
