"""A catalog model's rendering: its `protocol.rendering.ChatFormat`, read from its entry, and the
gateway's count of a rendered prompt (with the model's own vocabulary, as its hosts count).

An entry with no template of its own (a byte-vocabulary test model, an entry made before
templates were stored) is rendered with the catalog's default template, the turn format the
shipped Gemma model is sold with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from catalog.models import CatalogModel
from catalog.tokenizer import tokenizer_for
from protocol.jobs import job_fragments
from protocol.rendering import ChatFormat, Fragment

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
DEFAULT_TEMPLATE = TEMPLATES / "gemma-turns.jinja"
FORMAT_SECONDS = 30.0  # a claim reads a model's format from this cache: an admin's edit is seen within it

_FIELDS = ("chat_template", "bos_text", "eos_text", "adds_bos", "control_tokens", "end_of_turn", "tokenizer")
_FORMATS: dict[int, tuple[float, ChatFormat]] = {}
_FORMATS_LOCK = threading.Lock()


@cache
def default_template() -> str:
    return DEFAULT_TEMPLATE.read_text(encoding="utf-8")


def chat_format(model: CatalogModel) -> ChatFormat:
    """The format of a loaded entry (and this process' cache of it refreshed). Which of its
    control tokens strip the spaces beside them is its vocabulary's answer (llama.cpp's
    attributes, read from the copy the gateway counts with), so entries made before it was
    asked are rendered as their hosts' llama.cpp reads them too."""
    controls = tuple(model.control_tokens or ())
    lstrip, rstrip = tokenizer_for(model.tokenizer).control_strips(controls) if controls else ((), ())
    found = ChatFormat(
        template=model.chat_template or default_template(),
        bos_token=model.bos_text,
        eos_token=model.eos_text,
        adds_bos=model.adds_bos,
        controls=controls,
        end_of_turn=tuple(model.end_of_turn or ()),
        lstrip=lstrip,
        rstrip=rstrip,
    )
    if model.pk is not None:
        with _FORMATS_LOCK:
            _FORMATS[model.pk] = (time.monotonic() + FORMAT_SECONDS, found)
    return found


def chat_format_of(model_id: int) -> ChatFormat:
    """The format of the entry with that id, from the cache when fresh (a claim's stub model
    carries only its id, name and tokenizer)."""
    with _FORMATS_LOCK:
        cached = _FORMATS.get(model_id)
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    return chat_format(CatalogModel.objects.only("pk", *_FIELDS).get(pk=model_id))


def prompt_fragments(
    model: CatalogModel,
    *,
    kind: str,
    messages: list | None,
    prompt: str | None,
    now: datetime | None = None,
) -> list[Fragment]:
    """A request's prompt rendered for its model, as a host will be fed it, its template told
    it is `now` (the request's `rendered_at`). Raises `protocol.rendering.TemplateRefused` when
    the model's template refuses the conversation or passes its sandbox's bounds."""
    return job_fragments(chat_format(model), {"kind": kind, "messages": messages, "prompt": prompt}, now=now)


RENDERED_AT = "rendered_at"  # a request's params: the instant (Unix seconds) its template is told it is


def render_instant(params: dict | None) -> datetime | None:
    """The instant a request's prompt is rendered at, every time (`RENDERED_AT` in its params,
    fixed at admission); None for a request admitted before it was kept (rendered at the time)."""
    stamp = (params or {}).get(RENDERED_AT)
    return datetime.fromtimestamp(stamp, UTC) if isinstance(stamp, int | float) else None


def render_instant_fixed(params: dict) -> tuple[dict, datetime]:
    """`params` with this instant fixed as the one its prompt is rendered at, whole seconds (a
    template may write the time), and that instant."""
    stamp = int(time.time())
    return {**params, RENDERED_AT: stamp}, datetime.fromtimestamp(stamp, UTC)


def prompt_count(model: CatalogModel, fragments: Sequence[Fragment]) -> int:
    """The prompt's tokens, counted by the gateway with the model's vocabulary."""
    return tokenizer_for(model.tokenizer).count_fragments(fragments)


def prompt_token_ids(model: CatalogModel, fragments: Sequence[Fragment]) -> list[int]:
    """The prompt's token ids (`prompt_count` of them), as the model's vocabulary reads it."""
    return tokenizer_for(model.tokenizer).fragments_token_ids(fragments)
