"""The shipped models' chat formats, and a GGUF file's own, for tests and benchmarks that build
a host's jobs by hand (the gateway renders every job it sends: `protocol.jobs.job_payload_build`)."""

from __future__ import annotations

from pathlib import Path

from catalog.gguf_file import gguf_facts
from catalog.seed import SHIPPED_MODELS
from protocol.jobs import job_fragments
from protocol.rendering import ChatFormat, chat_format_read, chat_stops

_GEMMA = SHIPPED_MODELS[0]
GEMMA = ChatFormat(
    template=_GEMMA["chat_template"],
    bos_token=_GEMMA["bos_text"],
    eos_token=_GEMMA["eos_text"],
    adds_bos=_GEMMA["adds_bos"],
    controls=tuple(_GEMMA["control_tokens"]),
    end_of_turn=tuple(_GEMMA["end_of_turn"]),
)
# A byte-vocabulary model (the MoE test models): the catalog's default template, no control tokens.
BYTES = ChatFormat(template=_GEMMA["chat_template"])


def file_format(path: Path, *, adds_bos: bool) -> ChatFormat:
    """The chat format a catalog entry of the file would have: the file's own template, BOS, EOS
    and control tokens (`adds_bos`: whether its vocabulary starts prompts with BOS)."""
    facts = gguf_facts(path)
    return chat_format_read(
        template=facts.chat_template,
        bos_token=facts.bos_text,
        eos_token=facts.eos_text,
        adds_bos=adds_bos,
        vocabulary_controls=facts.controls,
    )


def rendered(job: dict, fmt: ChatFormat = GEMMA) -> dict:
    """`job` with its prompt rendered in `fmt`, as the gateway sends it to a host."""
    stops = chat_stops(fmt) if job.get("kind") == "chat" else []
    return {**job, "fragments": [list(fragment) for fragment in job_fragments(fmt, job)], "end_of_turn": stops}
