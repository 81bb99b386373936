"""Render jobs into the exact text the shipped Gemma 3 model is fed.

Pure and dependency-free on purpose: the gateway imports this module to count prompt
tokens with the same rendering the host uses, so billing and generation agree.

Gemma 3 has no system role and the shipped base model has no chat template, so the turn
format is written here by hand. No ``<bos>`` is emitted: the tokenizer adds it.
"""
from __future__ import annotations

from typing import Any

from protocol.jobs import CHAT, COMPLETION

START = "<start_of_turn>"
END = "<end_of_turn>"
STOP_STRINGS = [END]

_ROLE_NAMES = {"user": "user", "assistant": "model", "model": "model"}


def content_text(content: Any) -> str:
    """Return the text of an OpenAI message content: a string, or a list of parts.

    Only ``{"type": "text"}`` parts carry text; they are joined with nothing between them,
    as OpenAI concatenates them. ``None`` (an assistant turn with no text) is "".
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    raise ValueError(f"unsupported message content: {type(content).__name__}")


def _turns(messages: list[dict]) -> list[tuple[str, str]]:
    """Map messages to ``(gemma_role, text)`` turns, folding system text into the first user turn.

    System messages have no Gemma role; their texts (joined with a blank line) are
    prepended to the first user turn, or become a user turn of their own if none exists.
    """
    system = [content_text(m.get("content")) for m in messages if m.get("role") == "system"]
    turns: list[tuple[str, str]] = []
    for message in messages:
        role = message.get("role")
        if role == "system":
            continue
        if role not in _ROLE_NAMES:
            raise ValueError(f"unsupported message role: {role!r}")
        turns.append((_ROLE_NAMES[role], content_text(message.get("content"))))
    if system:
        preamble = "\n\n".join(system)
        first_user = next((i for i, (role, _) in enumerate(turns) if role == "user"), None)
        if first_user is None:
            turns.insert(0, ("user", preamble))
        else:
            turns[first_user] = ("user", preamble + "\n\n" + turns[first_user][1])
    return turns


def render_chat(messages: list[dict]) -> str:
    """Render a chat in Gemma 3 turn format, ready for the model to write its turn.

    If the last message is from the assistant, its turn is left open (no ``<end_of_turn>``,
    nothing after it) so the model continues from that exact character, even mid-word: this
    is how a continuation job resumes a stream another host started.
    """
    if not messages:
        raise ValueError("a chat needs at least one message")
    turns = _turns(messages)
    continuing = messages[-1].get("role") == "assistant"
    closed, open_turn = (turns[:-1], turns[-1]) if continuing else (turns, None)
    text = "".join(f"{START}{role}\n{body}{END}\n" for role, body in closed)
    if open_turn is not None:
        return text + f"{START}model\n{open_turn[1]}"
    return text + f"{START}model\n"


def render_completion(prompt: str) -> str:
    """Return the raw prompt: a plain completion is fed to the model unchanged."""
    return prompt


def render_job(job: dict) -> str:
    """Render a claimed job (``kind`` "chat" or "completion") into model input text."""
    kind = job.get("kind")
    if kind == CHAT:
        return render_chat(job.get("messages") or [])
    if kind == COMPLETION:
        return render_completion(job.get("prompt") or "")
    raise ValueError(f"unsupported job kind: {kind!r}")


def job_stop_strings(job: dict) -> list[str]:
    """A job's stop strings, plus Gemma's end of turn for chats: what a host stops at (and
    what the gateway's canary references stopped at)."""
    stop = list((job.get("params") or {}).get("stop") or [])
    if job.get("kind") == CHAT:
        stop += [s for s in STOP_STRINGS if s not in stop]
    return stop
