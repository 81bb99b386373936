"""A job rendered as its model is fed it: the model's own chat template, and which text is markup.

One rendering for every catalog model. The gateway renders a job to count its prompt and sends
the result in the job's payload; a host turns that result into token ids with
`fragments_tokens`, the one tokenization both sides share, so billing and generation agree for
every model.

A chat is rendered by the model's own Jinja template, in a sandbox, with the semantics of
Hugging Face's `apply_chat_template` (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`, `tojson`). A chat that ends with an assistant message is
*continued*: the rendering stops at that message's exact last character, mid-word included (the
semantics of `continue_final_message`), which is how a second host finishes a dead host's answer.

What the template writes is markup, where the model's control tokens stand (`<|im_start|>`,
`<end_of_turn>`); what customers wrote — message text, and the delivered text a continuation
carries — is content, and content never becomes a control token, whatever it looks like. The
rendering is therefore *fragments*: runs of plain text between control tokens. A tokenizer
tokenizes each run as text and each control token as itself, which is how llama.cpp splits a
prompt, except that it never looks for control tokens in what a customer wrote.

How content is told apart from markup: the template is rendered once with each text replaced by
a sentinel and once as it is. The sentinel rendering's markup, laid over the true rendering,
gives what each text became in it (a template may trim a message, or drop an old answer's
reasoning); where the two cannot be laid over each other, the exact texts go where the sentinels
stood. No Django here, and Jinja2 is imported only by a gateway that renders.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

Fragment = tuple[str, bool]  # (text, is_control): a control fragment is exactly one control token's text


class TemplateRefused(ValueError):
    """The model's template cannot render this conversation (it raised, or it is broken); the
    message says why in words a customer can act on."""


@dataclass(frozen=True)
class ChatFormat:
    """How one model is fed a job: read from its own file when it entered the catalog."""

    template: str  # the model's Jinja chat template
    bos_token: str = ""  # its BOS token's text, given to the template as `bos_token`
    eos_token: str = ""
    adds_bos: bool = False  # its vocabulary starts every prompt with BOS (llama.cpp's add_bos)
    controls: tuple[str, ...] = ()  # the control tokens the template's markup may hold
    end_of_turn: tuple[str, ...] = ()  # where the model ends its turn: a chat's stop strings


def content_text(content: Any) -> str:
    """The text of an OpenAI message content: a string, or a list of parts whose `text` parts
    are joined with nothing between them, as OpenAI does. `None` (an assistant turn with no
    text) is ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    raise ValueError(f"unsupported message content: {type(content).__name__}")


def completion_fragments(fmt: ChatFormat, prompt: str) -> list[Fragment]:
    """A plain completion: the prompt as the customer wrote it (plain text), after BOS."""
    return _with_bos(fmt, [(prompt, False)] if prompt else [])


def chat_fragments(fmt: ChatFormat, messages: list[dict]) -> list[Fragment]:
    """A chat rendered by the model's template, ready for the model to write its turn, or, when
    the last message is the assistant's, ready to continue that message from its last character."""
    if not messages:
        raise TemplateRefused("a chat needs at least one message")
    texts = [content_text(message.get("content")) for message in messages]
    continuing = messages[-1].get("role") == "assistant"
    variables = {"bos_token": fmt.bos_token, "eos_token": fmt.eos_token, "add_generation_prompt": not continuing}
    template = _compiled(fmt.template)
    marked = _render(template, [{"role": m.get("role"), "content": _sentinel(i)} for i, m in enumerate(messages)],
                     variables)
    true = _render(template, [{"role": m.get("role"), "content": text} for m, text in zip(messages, texts, strict=True)], variables)
    pieces = _pieces(marked)
    if continuing:
        pieces = _cut_after_last(pieces, len(messages) - 1)
    segments = _segments(pieces, texts, true, continuing=continuing)
    return _with_bos(fmt, _fragments(segments, _control_pattern(fmt.controls)))


def chat_format_read(
    *, template: str, bos_token: str, eos_token: str, adds_bos: bool, vocabulary_controls: Sequence[str],
) -> ChatFormat:
    """A model's format from its file's facts: of its vocabulary's control tokens, those its
    template writes (and BOS and EOS); its end of turn, the first control token the template
    writes after an assistant's message. Raises TemplateRefused for a template that does not
    render a plain two-turn chat."""
    controls = tuple(text for text in vocabulary_controls if text in template or text in (bos_token, eos_token) and text)
    variables = {"bos_token": bos_token, "eos_token": eos_token, "add_generation_prompt": False}
    chat = [{"role": "user", "content": _sentinel(0)}, {"role": "assistant", "content": _sentinel(1)}]
    pieces = _pieces(_render(_compiled(template), chat, variables))
    _render(_compiled(template), chat[:1], {**variables, "add_generation_prompt": True})
    if 1 not in pieces:
        raise TemplateRefused("the chat template does not write an assistant's message")
    after = str(pieces[pieces.index(1) + 1])
    pattern = _control_pattern(controls)
    found = pattern.search(after) if pattern is not None else None
    return ChatFormat(template=template, bos_token=bos_token, eos_token=eos_token, adds_bos=adds_bos, controls=controls,
                      end_of_turn=(found.group(),) if found else ())


def fragments_text(fragments: Sequence[Fragment]) -> str:
    """The rendered text, markup and content together (what a model without control tokens reads)."""
    return "".join(text for text, _ in fragments)


def fragments_tokens(
    fragments: Sequence[Sequence], *, tokenize: Callable[[str], list[int]], control: Callable[[str], int],
) -> list[int]:
    """Token ids: each run of text tokenized as plain text (never parsing control tokens), each
    control token as its one id. The gateway counts with this; a host runs what it returns."""
    tokens: list[int] = []
    for text, is_control in fragments:
        tokens.extend([control(text)] if is_control else tokenize(text))
    return tokens


def chat_stops(fmt: ChatFormat) -> list[str]:
    """Where the model ends its turn, for a chat job: the template's end of turn, else EOS."""
    return list(fmt.end_of_turn) or ([fmt.eos_token] if fmt.eos_token else [])


# -- the sandbox ------------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise TemplateRefused(str(message))


def _tojson(value: Any, indent: int | None = None, separators: tuple | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson`: JSON as written, non-ASCII kept, with its indent and separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=64)
def _compiled(template: str):  # -> jinja2.Template
    """A template compiled once per process in an immutable sandbox (HF's environment: blocks
    trimmed, `loopcontrols`)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    try:
        return environment.from_string(template)
    except TemplateError as error:
        raise TemplateRefused(f"this model's chat template does not compile: {error}") from None


def template_check(template: str) -> None:
    """Raise TemplateRefused when a template does not compile (what `catalog_add` checks first)."""
    _compiled(template)


def _render(template: Any, messages: list[dict], variables: dict) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    try:
        return template.render(messages=messages, **variables)
    except TemplateRefused as refused:
        raise TemplateRefused(f"this model's chat template refuses the conversation: {refused}") from None
    except (TemplateError, SecurityError, TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
        raise TemplateRefused(f"this model's chat template cannot render the conversation: {error}") from None


# -- telling content from markup ----------------------------------------------------------------

_OPEN, _CLOSE = "\ue000", "\ue001"  # Unicode private use: in no template, and never in a sentinel rendering's markup
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def _sentinel(index: int) -> str:
    return f"{_OPEN}{index}{_CLOSE}"


def _pieces(marked: str) -> list[str | int]:
    """The sentinel rendering as alternating markup (str) and message indexes (int): m0 i0 m1 … mk."""
    pieces: list[str | int] = []
    position = 0
    for match in _SENTINEL.finditer(marked):
        pieces += [marked[position:match.start()], int(match.group(1))]
        position = match.end()
    pieces.append(marked[position:])
    if any(isinstance(piece, str) and (_OPEN in piece or _CLOSE in piece) for piece in pieces):
        raise TemplateRefused("this model's chat template cuts message text apart; it cannot be rendered safely")
    return pieces


def _cut_after_last(pieces: list[str | int], index: int) -> list[str | int]:
    """The pieces up to the last place message `index` stands: the open turn a continuation ends on."""
    where = max((at for at, piece in enumerate(pieces) if piece == index), default=None)
    if where is None:
        raise TemplateRefused("this model's chat template does not show a final assistant message, so it cannot continue one")
    return pieces[:where + 1]


def _segments(pieces: list[str | int], texts: list[str], true: str, *, continuing: bool) -> list[tuple[str, bool]]:
    """(text, is_content) segments: the markup, and what each message's text became in the true
    rendering. A continuation's final text is its exact text, whatever the template does to it."""
    slots = [index for index in pieces[1::2]]  # type: ignore[misc]
    markup = [piece for piece in pieces[0::2]]  # type: ignore[misc]
    exact = [texts[index] for index in slots]  # type: ignore[index]
    fixed_last = continuing
    became = _laid_over(markup, exact, true, fixed_last=fixed_last) or exact
    segments: list[tuple[str, bool]] = []
    for at, text in enumerate(became):
        segments += [(markup[at], False), (text, True)]  # type: ignore[list-item]
    if not continuing:
        segments.append((markup[-1], False))  # type: ignore[arg-type]
    return [segment for segment in segments if segment[0]]


def _laid_over(markup: list[str], exact: list[str], true: str, *, fixed_last: bool) -> list[str] | None:
    """What each text became in `true`, found by laying the markup over it left to right: the
    exact text first, then its trimmed forms, then whatever stands before the next markup. None
    when the markup does not fit (the template branched on a text's content)."""
    became: list[str] = []
    position = 0
    for at, text in enumerate(exact):
        if not true.startswith(markup[at], position):
            return None
        position += len(markup[at])
        if fixed_last and at == len(exact) - 1:
            return [*became, text]
        following = markup[at + 1]
        last = at == len(exact) - 1
        found = next((form for form in (text, text.strip(), text.lstrip(), text.rstrip(), text.strip("\n"))
                      if _fits(true, position, form + following, ends=last)), None)
        if found is None and following:
            end = true.find(following, position) if not last else true.rfind(following, position)
            found = true[position:end] if end >= 0 else None
        if found is None:
            return None
        became.append(found)
        position += len(found)
    if not exact:
        return [] if true == markup[0] else None
    return became if fixed_last or position + len(markup[-1]) == len(true) else None


def _fits(true: str, position: int, expected: str, *, ends: bool) -> bool:
    """Whether `expected` stands at `position` in `true` (and ends it, for the last text)."""
    return true[position:] == expected if ends else true.startswith(expected, position)


# -- fragments --------------------------------------------------------------------------------

@lru_cache(maxsize=256)
def _control_pattern(controls: tuple[str, ...]) -> re.Pattern[str] | None:
    """One pattern for a model's control tokens, longest first (as llama.cpp matches them)."""
    if not controls:
        return None
    return re.compile("|".join(re.escape(text) for text in sorted(set(controls), key=len, reverse=True)))


def _fragments(segments: list[tuple[str, bool]], pattern: re.Pattern[str] | None) -> list[Fragment]:
    """Runs of plain text between control tokens: control tokens are looked for in markup only,
    and text on both sides of a markup/content boundary is one run (as one string would be)."""
    fragments: list[Fragment] = []
    run: list[str] = []

    def flush() -> None:
        if text := "".join(run):
            fragments.append((text, False))
        run.clear()

    for text, is_content in segments:
        if is_content or pattern is None:
            run.append(text)
            continue
        position = 0
        for match in pattern.finditer(text):
            run.append(text[position:match.start()])
            flush()
            fragments.append((match.group(), True))
            position = match.end()
        run.append(text[position:])
    flush()
    return fragments


def _with_bos(fmt: ChatFormat, fragments: list[Fragment]) -> list[Fragment]:
    """BOS first, once, when the vocabulary wants it and the template did not write it."""
    if fmt.adds_bos and fmt.bos_token and (not fragments or fragments[0] != (fmt.bos_token, True)):
        return [(fmt.bos_token, True), *fragments]
    return fragments
