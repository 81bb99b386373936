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
from dataclasses import dataclass
from typing import Any

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
        raise ToolsRefused(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    called = [f for f in functions if not isinstance(choice, dict) or f["name"] == choice["name"]]
    single = isinstance(choice, dict) or parallel is False
    most = 1 if single else MAX_PARALLEL_CALLS
    spec: dict[str, Any] = {"functions": functions, "choice": choice, "schema": calls_schema(called, most=most)}
    from marketplace.lifecycle.schema_reach import unenforced
    from marketplace.lifecycle.structured import schema_problem

    why = schema_problem(spec["schema"])
    if why:
        raise ToolsRefused(f"a function's parameters cannot constrain an answer: {why}", "tools")
    for function in called if choice != "auto" else ():  # (under "auto" no grammar holds the answer: a call that
        left_out = unenforced(function["parameters"])  # breaks its parameters is handed over as text, nobody's failure)
        if left_out:
            raise ToolsRefused(
                f"function {function['name']!r}: its parameters are refused when tool_choice requires a "
                f"call (the host samples the call under their grammar): {left_out.sentence()}",
                "tools",
            )
    return spec


def _function(tool: object) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolsRefused(
            "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}", "tools"
        )
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolsRefused(f"function {function['name']!r}: parameters must be a JSON Schema object", "tools")
    description = function.get("description")
    return {
        "name": function["name"][:64],
        "description": description[:1000] if isinstance(description, str) else "",
        "parameters": parameters,
    }


def calls_schema(functions: list[dict], *, most: int) -> dict:
    """The JSON Schema of an answer that calls some of `functions` (at most `most` calls)."""
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
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
            calls = [
                {"name": c["function"]["name"], "arguments": _parsed(c["function"]["arguments"])}
                for c in message[CALLS]
            ]
            text = json.dumps({CALLS: calls}, separators=(", ", ": "))
            plain.append(
                {"role": "assistant", "content": f"{message['content']}\n{text}" if message["content"] else text}
            )
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
        f"{json.dumps(f['parameters'], separators=(',', ':'))}"
        for f in spec["functions"]
    )
    choice = spec["choice"]
    must = (
        "Answer by calling the function " + choice["name"]
        if isinstance(choice, dict)
        else "Answer by calling one or more of them"
        if choice == "required"
        else "When a function would help, call it; otherwise answer normally"
    )
    return (
        f"You can call these functions:\n{listed}\n{must}. A call is an answer that is only this JSON: "
        f'{{"{CALLS}": [{{"name": "<function name>", "arguments": {{<arguments>}}}}]}}'
    )


def tool_calls_in(spec: dict | None, text: str, *, request_id: str, cut: bool = False) -> list[dict] | None:
    """The answer's calls in OpenAI's shape when it is exactly a valid call, else None. An
    answer `cut` by max_tokens keeps the calls it completed (a small model may list calls
    until its budget runs out; the finish_reason still says "length"); when a call was
    required, it is a call whatever its length (`cut_calls`). Each call's `arguments` is the
    JSON text the model wrote, as it was streamed (`CallStream`)."""
    if spec is not None and cut and spec["choice"] != "auto":
        return cut_calls(spec, text, request_id=request_id)
    if spec is None or not text.lstrip().startswith("{"):
        return None
    from jsonschema import exceptions

    from marketplace.lifecycle.structured import schema_validator

    try:
        value = json.loads(text)
        schema_validator(spec["schema"]).validate(value)
        made = value[CALLS]
    except (ValueError, exceptions.ValidationError):
        made = _completed_calls(spec, text) if cut else []
    if not made:
        return None
    scanned = CallScanner()
    scanned.feed(text)
    return [
        {
            "id": call_id(request_id, index),
            "type": "function",
            "function": {"name": call["name"], "arguments": scanned.arguments(index) or json.dumps(call["arguments"])},
        }
        for index, call in enumerate(made)
    ]


def cut_calls(spec: dict, text: str, *, request_id: str) -> list[dict]:
    """A required (or named) call cut by max_tokens, as OpenAI hands one over: the calls it
    completed, then the one it was writing with its arguments as far as they go (possibly
    ""), finish_reason "length". The host sampled under the call's grammar, so the answer is
    a call from its first character and never content; a call is handed over once its name is
    known: written whole, or the only offered function its first letters (or none) can begin.
    Empty when the cut came before any name was known."""
    choice = spec["choice"]
    allowed = [f["name"] for f in spec["functions"] if not isinstance(choice, dict) or f["name"] == choice["name"]]
    scanned = CallScanner()
    scanned.feed(text)
    done, stopped = _calls_read(spec, text)
    calls = [
        {
            "id": call_id(request_id, index),
            "type": "function",
            "function": {"name": call["name"], "arguments": scanned.arguments(index) or json.dumps(call["arguments"])},
        }
        for index, call in enumerate(done)
    ]
    at = len(done)
    begun = at < len(scanned.calls) and not stopped and not scanned.broken  # the call being written when cut
    if not begun and (scanned.calls or stopped or scanned.broken):
        return calls
    whole, written = (scanned.calls[at].name, scanned.name_so_far(at)) if begun else (None, "")
    named = (
        [whole]
        if whole is not None
        else []
        if written is None
        else [name for name in allowed if name.startswith(written)]
    )
    if len(named) == 1 and named[0] in allowed:
        calls.append(
            {
                "id": call_id(request_id, at),
                "type": "function",
                "function": {"name": named[0], "arguments": scanned.arguments_so_far(at) if begun else ""},
            }
        )
    return calls


def _completed_calls(spec: dict, text: str) -> list[dict]:
    """The calls a cut answer finished, in order: each a whole, valid item of its list."""
    return _calls_read(spec, text)[0]


def _calls_read(spec: dict, text: str) -> tuple[list[dict], bool]:
    """(the calls a cut answer finished, whether the reading stopped at a whole item that is
    not a valid call or past the most calls allowed, rather than where the text was cut)."""
    from marketplace.lifecycle.structured import schema_validator

    opening = text.find("[", text.find(f'"{CALLS}"'))
    if text.find(f'"{CALLS}"') < 0 or opening < 0:
        return [], False
    calls_schema_ = spec["schema"]["properties"][CALLS]
    valid = schema_validator(calls_schema_["items"])
    decoder, at, done = json.JSONDecoder(), opening + 1, list[dict]()
    while len(done) < calls_schema_["maxItems"]:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return done, False
        if not valid.is_valid(item):
            return done, True
        done.append(item)
    return done, True


def call_id(request_id: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


@dataclass
class ScannedCall:
    """Where one call of the answer stands: its name once read whole, its arguments' span."""

    name: str | None = None
    start: int | None = None  # the arguments' first character
    end: int | None = None  # just past their last, once they are whole


@dataclass
class _Container:
    kind: str  # "object" or "array"
    path: tuple  # the keys and indexes that lead to it from the answer's root
    state: str  # what it expects next: "key", "key_or_end", "colon", "value", "value_or_end", "comma"
    key: str | None = None
    index: int = 0


LITERAL = frozenset("0123456789+-.eEtrufalsn")


class CallScanner:
    """Follows an answer in the call shape (`{"tool_calls": [{"name": ..., "arguments": ...}]}`)
    character by character as it arrives, each character read once: which calls have begun,
    each one's name once it is whole, and where its arguments start and end in the text. That
    is what lets the arguments be relayed as they are generated, before the answer is whole.

    It follows JSON's grammar only as far as locating these takes; a character JSON does not
    allow where it stands stops it (`broken`), and whether the answer is a valid call is still
    decided on the whole answer (`tool_calls_in`)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ScannedCall] = []
        self.broken = False
        self._containers: list[_Container] = []
        self._string: tuple[int, tuple | None] | None = None  # (where the string opened, its path; None: a key)
        self._escaped = False
        self._literal: tuple[int, tuple] | None = None  # a number, true, false or null being read: (start, path)
        self._root_read = False

    def feed(self, text: str) -> None:
        at = len(self.text)
        self.text += text
        for offset, char in enumerate(text, start=at):
            if self.broken:
                return
            self._step(offset, char)

    def arguments(self, index: int) -> str | None:
        """Call `index`'s arguments as written, once they are whole."""
        call = self.calls[index] if index < len(self.calls) else None
        if call is None or call.start is None or call.end is None:
            return None
        return self.text[call.start : call.end]

    def arguments_so_far(self, index: int) -> str:
        """As much of call `index`'s arguments as has arrived."""
        call = self.calls[index]
        if call.start is None:
            return ""
        return self.text[call.start : len(self.text) if call.end is None else call.end]

    def name_so_far(self, index: int) -> str | None:
        """Call `index`'s name: whole, or as much as has arrived while it is being written (""
        before it starts); None when what arrived cannot be read as plain letters."""
        call = self.calls[index]
        if call.name is not None:
            return call.name
        if self._string is not None and self._string[1] == (CALLS, index, "name"):
            partial = self.text[self._string[0] + 1 :]
            return None if "\\" in partial else partial
        return ""

    def _step(self, at: int, char: str) -> None:
        if self._string is not None:
            self._in_string(at, char)
            return
        if self._literal is not None:
            if char in LITERAL:
                return
            start, path = self._literal
            self._literal = None
            self._ended(path, start, at)
        if char in " \t\r\n":
            return
        top = self._containers[-1] if self._containers else None
        if top is None:
            if self._root_read:
                self.broken = True  # something after the answer's one value
            else:
                self._root_read = True
                self._value(at, char, ())
            return
        if top.state in ("key", "key_or_end") and char == '"':
            self._string = (at, None)
        elif top.state == "colon" and char == ":":
            top.state = "value"
        elif top.state in ("value", "value_or_end") and not (top.state == "value_or_end" and char == "]"):
            path = (*top.path, top.key if top.kind == "object" else top.index)
            top.state = "comma"
            self._value(at, char, path)
        elif top.state == "comma" and char == ",":
            top.state = "key" if top.kind == "object" else "value"
            if top.kind == "array":
                top.index += 1
        elif char == ("}" if top.kind == "object" else "]") and top.state in ("comma", "key_or_end", "value_or_end"):
            self._containers.pop()
            self._ended(top.path, None, at + 1)
        else:
            self.broken = True

    def _in_string(self, at: int, char: str) -> None:
        if self._escaped:
            self._escaped = False
            return
        if char == "\\":
            self._escaped = True
            return
        if char != '"':
            return
        assert self._string is not None
        start, path = self._string
        self._string = None
        if path is None:  # a key: the container's value goes under it
            top = self._containers[-1]
            try:
                top.key = json.loads(self.text[start : at + 1])
            except ValueError:
                self.broken = True
            top.state = "colon"
            return
        self._ended(path, start, at + 1)

    def _value(self, at: int, char: str, path: tuple) -> None:
        """A value starts at `at` with `char`, at `path`."""
        if _is_call(path):
            if path[1] != len(self.calls):
                self.broken = True  # a second list of calls: which is meant is the whole answer's to say
                return
            self.calls.append(ScannedCall())
        elif _is_arguments(path):
            call = self.calls[path[1]]
            if call.start is not None:
                self.broken = True  # "arguments" twice: which is meant is the whole answer's to say
                return
            call.start = at
        if char in "{[":
            self._containers.append(
                _Container("object" if char == "{" else "array", path, "key_or_end" if char == "{" else "value_or_end")
            )
        elif char == '"':
            self._string = (at, path)
        elif char in LITERAL:
            self._literal = (at, path)
        else:
            self.broken = True

    def _ended(self, path: tuple, start: int | None, end: int) -> None:
        """The value at `path` ends just before `end` (`start`: where a string began)."""
        if _is_arguments(path):
            self.calls[path[1]].end = end
        elif len(path) == 3 and _is_call(path[:2]) and path[2] == "name" and start is not None:
            try:
                name = json.loads(self.text[start:end])
            except ValueError:
                return
            self.calls[path[1]].name = name if isinstance(name, str) else None


def _is_call(path: tuple) -> bool:
    return len(path) == 2 and path[0] == CALLS and isinstance(path[1], int)


def _is_arguments(path: tuple) -> bool:
    return len(path) == 3 and _is_call(path[:2]) and path[2] == "arguments"


class CallStream:
    """Splits a streamed answer into content, relayed as it comes, and calls, relayed as
    OpenAI streams them: per call, a first delta with its id, type and name, then its
    arguments piece by piece as they are generated.

    When a call is required (`tool_choice` "required" or a named function) the host samples
    under the call's grammar, so the answer is a call from its first character and its
    arguments go out as they arrive (`CallScanner` finds them). Under "auto" the first visible
    character decides: "{" holds the answer to the end, because only the whole answer says
    whether it is a valid call (no grammar held the model to one); then the calls go out
    whole, or the held text goes out as content after all."""

    def __init__(self, spec: dict, *, request_id: str) -> None:
        self.spec, self.request_id = spec, request_id
        self.streams_calls = spec["choice"] != "auto"
        self.calling: bool | None = True if self.streams_calls else None  # None: undecided
        self.scanner = CallScanner()
        self.held: list[str] = []
        self.held_logprobs: list[dict] = []  # (held with their text)
        self._named = 0  # calls whose first delta went out
        self._sent: list[int] = []  # per call: characters of its arguments that went out

    def feed(self, text: str, logprobs: list[dict] | None = None) -> tuple[str, list[dict], list[dict]]:
        """(the content to relay now, its log-probability entries, the call deltas to send now)."""
        if self.calling is False:
            return text, logprobs or [], []
        self.held.append(text)
        self.held_logprobs += logprobs or []
        if self.calling is None:
            joined = "".join(self.held)
            if not joined.strip():
                return "", [], []
            self.calling = joined.lstrip().startswith("{")
            if not self.calling:
                entries, self.held, self.held_logprobs = self.held_logprobs, [], []
                return joined, entries, []
        if not self.streams_calls:
            return "", [], []
        self.scanner.feed(text)
        return "", [], self._deltas()

    def prime(self, text: str) -> None:
        """Read `text`, the start of the answer a resumed stream's customer already has, sending
        nothing for it: the stream goes on from its end."""
        self.feed(text)
        self.held_logprobs = []

    def finish(self, *, cut: bool = False) -> tuple[str, list[dict], list[dict], list[dict] | None]:
        """At the end: (content still to relay, its entries, the call deltas still to send, the
        calls or None); `cut`: by max_tokens. A required call cut before its name was written
        whole goes out now, named by what the grammar allowed (`cut_calls`); its text is never
        content."""
        text = "".join(self.held)
        calls = tool_calls_in(self.spec, text, request_id=self.request_id, cut=cut)
        if self.streams_calls and (calls or self._named or cut):
            deltas = self._deltas()
            for index, call in enumerate(calls or []):
                if index >= self._named:
                    deltas += (
                        call_deltas(index, call)
                        if call["function"]["arguments"]
                        else [_named_delta(index, call["id"], call["function"]["name"])]
                    )
            return "", [], deltas, calls
        if calls:
            return "", [], [delta for index, call in enumerate(calls) for delta in call_deltas(index, call)], calls
        return text, self.held_logprobs, [], None

    def _deltas(self) -> list[dict]:
        """The deltas the answer so far allows that have not gone out: calls in order, each
        named before any of its arguments."""
        out: list[dict] = []
        for index, call in enumerate(self.scanner.calls):
            if index == self._named:
                if call.name is None:
                    break
                out.append(_named_delta(index, call_id(self.request_id, index), call.name))
                self._named += 1
                self._sent.append(0)
            written = self.scanner.arguments_so_far(index)
            if len(written) > self._sent[index]:
                out.append(_arguments_delta(index, written[self._sent[index] :]))
                self._sent[index] = len(written)
        return out


def _named_delta(index: int, identifier: str, name: str) -> dict:
    return {"index": index, "id": identifier, "type": "function", "function": {"name": name, "arguments": ""}}


def _arguments_delta(index: int, piece: str) -> dict:
    return {"index": index, "function": {"arguments": piece}}


def call_deltas(index: int, call: dict) -> list[dict]:
    """A whole call as OpenAI streams one: its id and name, then its arguments."""
    return [
        _named_delta(index, call["id"], call["function"]["name"]),
        _arguments_delta(index, call["function"]["arguments"]),
    ]
