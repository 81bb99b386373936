"""A job rendered as its model is fed it: the model's own chat template, and which text is markup.

One rendering for every catalog model. The gateway renders a job to count its prompt and sends
the result in the job's payload; a host turns that result into token ids with
`fragments_tokens`, the one tokenization both sides share, so billing and generation agree for
every model.

A chat is rendered by the model's own Jinja template, in a bounded sandbox
(`protocol.template_sandbox`: a template from a file is untrusted), with the semantics of
Hugging Face's `apply_chat_template` (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`, `tojson`, `strftime_now`). A chat that ends with an assistant message is
*continued*: the rendering stops at that message's exact last character, mid-word included (the
semantics of `continue_final_message`), which is how a second host finishes a dead host's answer.

What the template writes is markup, where the model's control tokens stand (`<|im_start|>`,
`<end_of_turn>`); what customers wrote — message text, and the delivered text a continuation
carries — is content, and content never becomes a control token, whatever it looks like. The
rendering is therefore *fragments*: runs of plain text between control tokens. A tokenizer
tokenizes each run as text and each control token as itself, which is how llama.cpp splits a
prompt, except that it never looks for control tokens in what a customer wrote. Where the
vocabulary says a control token strips the spaces beside it (llama.cpp's `lstrip` / `rstrip`
attributes, Hugging Face's added tokens' flags: every Phi-3 marker takes the newline after it),
those spaces are taken from the runs beside it, as llama.cpp takes them from a whole rendering.

How content is told apart from markup: the template is rendered once with each text replaced by
a sentinel and once as it is. The sentinel rendering's markup, laid over the true rendering,
gives what each text became in it (a template may trim a message, or drop an old answer's
reasoning); where the two cannot be laid over each other, the exact texts go where the sentinels
stood. No Django here, and Jinja2 is imported only by the sandbox's workers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, cast

from protocol.template_sandbox import TemplateRefused, render_bounded  # (TemplateRefused: imported from here too)

Fragment = tuple[str, bool]  # (text, is_control): a control fragment is exactly one control token's text
SPACES = " \t\n\v\f\r"  # what a control token's lstrip / rstrip takes away beside it (C's isspace, as llama.cpp)


@dataclass(frozen=True)
class ChatFormat:
    """How one model is fed a job: read from its own file when it entered the catalog."""

    template: str  # the model's Jinja chat template
    bos_token: str = ""  # its BOS token's text, given to the template as `bos_token`
    eos_token: str = ""
    adds_bos: bool = False  # its vocabulary starts every prompt with BOS (llama.cpp's add_bos)
    controls: tuple[str, ...] = ()  # the control tokens the template's markup may hold
    end_of_turn: tuple[str, ...] = ()  # where the model ends its turn: a chat's stop strings
    lstrip: tuple[str, ...] = ()  # control tokens that take the spaces before them (their vocabulary says so)
    rstrip: tuple[str, ...] = ()  # control tokens that take the spaces after them (Phi-3's `<|user|>`: its newline)


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


def chat_fragments(fmt: ChatFormat, messages: list[dict], *, now: datetime | None = None) -> list[Fragment]:
    """A chat rendered by the model's template, ready for the model to write its turn, or, when
    the last message is the assistant's, ready to continue that message from its last character.

    `now` is the instant the template is told it is (`strftime_now`, `date_string`): a job's
    is fixed when it is admitted, so that its every rendering (counted, sent, audited) is the
    same text. Raises TemplateRefused (`protocol.template_sandbox`)."""
    if not messages:
        raise TemplateRefused("a chat needs at least one message")
    texts = [content_text(message.get("content")) for message in messages]
    continuing = messages[-1].get("role") == "assistant"
    variables = {"bos_token": fmt.bos_token, "eos_token": fmt.eos_token, "add_generation_prompt": not continuing}
    marked, true = render_bounded(
        fmt.template,
        [
            {
                "messages": [{"role": m.get("role"), "content": _sentinel(i)} for i, m in enumerate(messages)],
                "variables": variables,
            },
            {
                "messages": [{"role": m.get("role"), "content": text} for m, text in zip(messages, texts, strict=True)],
                "variables": variables,
            },
        ],
        now=now,
    )
    pieces = _pieces(marked)
    if continuing:
        pieces = _cut_after_last(pieces, len(messages) - 1)
    segments = _segments(pieces, texts, true, continuing=continuing)
    fragments = _stripped(
        _fragments(segments, _control_pattern(fmt.controls)),
        lstrip=fmt.lstrip,
        rstrip=fmt.rstrip,
        kept_end=texts[-1] if continuing else "",
    )
    return _with_bos(fmt, fragments)


def chat_format_read(
    *,
    template: str,
    bos_token: str,
    eos_token: str,
    adds_bos: bool,
    vocabulary_controls: Sequence[str],
) -> ChatFormat:
    """A model's format from its file's facts: of its vocabulary's control tokens, those its
    template writes (and BOS and EOS); its end of turn, the first control token the template
    writes after an assistant's message. Raises TemplateRefused for a template that does not
    render a plain two-turn chat, within the sandbox's bounds (`protocol.template_sandbox`).
    Which control tokens strip the spaces beside them is the vocabulary's to say: the caller
    adds it (`dataclasses.replace(fmt, lstrip=..., rstrip=...)`)."""
    variables = {"bos_token": bos_token, "eos_token": eos_token, "add_generation_prompt": False}
    chat = [{"role": "user", "content": _sentinel(0)}, {"role": "assistant", "content": _sentinel(1)}]
    marked, asking = render_bounded(
        template,
        [
            {"messages": chat, "variables": variables},
            {"messages": chat[:1], "variables": {**variables, "add_generation_prompt": True}},
        ],
    )
    written = template + marked + asking  # (a template may build a marker: '<|' + role + '|>')
    controls = tuple(
        text for text in vocabulary_controls if text and (text in written or text in (bos_token, eos_token))
    )
    pieces = _pieces(marked)
    if 1 not in pieces:
        raise TemplateRefused("the chat template does not write an assistant's message")
    after = str(pieces[pieces.index(1) + 1])
    pattern = _control_pattern(controls)
    found = pattern.search(after) if pattern is not None else None
    return ChatFormat(
        template=template,
        bos_token=bos_token,
        eos_token=eos_token,
        adds_bos=adds_bos,
        controls=controls,
        end_of_turn=(found.group(),) if found else (),
    )


def fragments_text(fragments: Sequence[Fragment]) -> str:
    """The rendered text, markup and content together (what a model without control tokens reads)."""
    return "".join(text for text, _ in fragments)


def template_check(template: str) -> None:
    """Raise TemplateRefused when a template does not compile (in the sandbox, within its bounds)."""
    render_bounded(template, [])


def fragments_tokens(
    fragments: Sequence[Sequence],
    *,
    tokenize: Callable[[str], list[int]],
    control: Callable[[str], int],
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
        pieces += [marked[position : match.start()], int(match.group(1))]
        position = match.end()
    pieces.append(marked[position:])
    if any(isinstance(piece, str) and (_OPEN in piece or _CLOSE in piece) for piece in pieces):
        raise TemplateRefused("this model's chat template cuts message text apart; it cannot be rendered safely")
    return pieces


def _cut_after_last(pieces: list[str | int], index: int) -> list[str | int]:
    """The pieces up to the last place message `index` stands: the open turn a continuation ends on."""
    where = max((at for at, piece in enumerate(pieces) if piece == index), default=None)
    if where is None:
        raise TemplateRefused(
            "this model's chat template does not show a final assistant message, so it cannot continue one"
        )
    return pieces[: where + 1]


def _segments(pieces: list[str | int], texts: list[str], true: str, *, continuing: bool) -> list[tuple[str, bool]]:
    """(text, is_content) segments: the markup, and what each message's text became in the true
    rendering. A continuation's final text is its exact text, whatever the template does to it."""
    slots = cast(list[int], pieces[1::2])  # (the pieces alternate: markup, a message's index, markup, ...)
    markup = cast(list[str], pieces[0::2])
    exact = [texts[index] for index in slots]
    fixed_last = continuing
    became = _laid_over(markup, exact, true, fixed_last=fixed_last) or exact
    segments: list[tuple[str, bool]] = []
    for at, text in enumerate(became):
        segments += [(markup[at], False), (text, True)]
    if not continuing:
        segments.append((markup[-1], False))
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
        found = next(
            (
                form
                for form in (text, text.strip(), text.lstrip(), text.rstrip(), text.strip("\n"))
                if _fits(true, position, form + following, ends=last)
            ),
            None,
        )
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
            run.append(text[position : match.start()])
            flush()
            fragments.append((match.group(), True))
            position = match.end()
        run.append(text[position:])
    flush()
    return fragments


def _stripped(
    fragments: list[Fragment], *, lstrip: tuple[str, ...], rstrip: tuple[str, ...], kept_end: str = ""
) -> list[Fragment]:
    """The spaces beside a control token that strips them taken away, as llama.cpp and Hugging
    Face's tokenizers take them when they find the token in a text (an `rstrip` token's newline
    is part of it: the model never saw it). Text beside it goes whether markup or content wrote
    it, as it goes from the whole rendering; content never becomes a control token for it. Except
    `kept_end`, the text of an assistant turn being continued: the model goes on from its exact
    last character, so it is kept whole (an answer that began with newlines, cut by a host's
    death, is continued after those newlines, as the customer received them)."""
    if not lstrip and not rstrip:
        return fragments
    kept: list[Fragment] = []
    for at, (text, control) in enumerate(fragments):
        if not control:
            if at > 0 and fragments[at - 1][1] and fragments[at - 1][0] in rstrip:
                last = at == len(fragments) - 1 and kept_end and text.endswith(kept_end)
                text = text[: len(text) - len(kept_end)].lstrip(SPACES) + kept_end if last else text.lstrip(SPACES)
            if at + 1 < len(fragments) and fragments[at + 1][1] and fragments[at + 1][0] in lstrip:
                text = text.rstrip(SPACES)
        if text:
            kept.append((text, control))
    return kept


def _with_bos(fmt: ChatFormat, fragments: list[Fragment]) -> list[Fragment]:
    """BOS first, once, when the vocabulary wants it and the template did not write it."""
    if fmt.adds_bos and fmt.bos_token and (not fragments or fragments[0] != (fmt.bos_token, True)):
        return [(fmt.bos_token, True), *fragments]
    return fragments
