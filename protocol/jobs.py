"""The job a host claims: its shape, shared by the gateway (which builds it) and mahout
(which runs it). Pure and dependency-free: a host installs it without the gateway.

A job carries the work and nothing about the customer. A continuation (the second
attempt after a host died mid-answer) carries the original prompt plus the exact text
already delivered — as an unfinished assistant turn for a chat, appended to the prompt
for a completion — and only the output budget that is left. Under structured output the
delivered text travels apart (`rewrite`): the host's grammar must read it from the start.

The gateway renders the prompt for the model (`protocol.rendering`) and sends it as
`fragments`, with the model's own end of turn: what a host feeds its model is exactly what
the gateway counted and billed.

An **audit** (kind `"audit"`, `AuditPayload`) is work only a trusted host claims, for a model
whose weights the gateway lacks: re-read another host's delivered answer under the model in
one prefill pass (`scorer.verify.Verifier`) and say whether every token is the seed's draw.
It carries the audited job as that host received it (`job`, a `JobPayload` without its id),
the token ids it reported (`tokens`), the text the customer received (`text`), its
`finish_reason` and the gateway's `seed`; its `id` numbers the audit, not a job, and nothing
in it names the audited host. The scorer answers `POST /hosts/api/audits/{id}/verdict` with
`AuditVerdict`: `passed` or `failed` with the counts (tokens `checked`, `uncertain`, `misses`)
and the `reason` of a failure, or `declined` (it cannot score it here: another scorer is
asked). It is paid a fee for the prefill when the audit is decided (`marketplace.trust.audits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypedDict

from protocol.rendering import ChatFormat, Fragment, chat_fragments, chat_stops, completion_fragments

CHAT = "chat"
COMPLETION = "completion"
EMBEDDINGS = "embeddings"
AUDIT = "audit"  # a trusted host scores another host's answer (AuditPayload)
AUDIT_VERDICTS = ("passed", "failed", "declined")
# How a decline's reason starts when the answer cannot be audited anywhere (the verifier's
# `Unauditable`: a grammar or a context it cannot read), not for want of this scorer's means.
# The gateway counts a scorer's declines per model and per cause (`marketplace.trust.audits`).
AUDIT_DECLINED_UNAUDITABLE = "not auditable here"
RING_CHECK = "ring_check"  # a trusted host finds which of a ring's hosts made its audit fail (RingCheckPayload)
RING_CHECK_VERDICTS = ("blamed", "declined")

SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "stop", "seed", "response_format", "logprobs")
# "logprobs": None, or report each token's log-probability with that many alternatives (0 to MAX_TOP_LOGPROBS)
MAX_TOP_LOGPROBS = 20


class JobPayload(TypedDict, total=False):
    id: int
    model: str
    kind: str  # CHAT, COMPLETION or EMBEDDINGS
    messages: list[dict[str, Any]] | None  # chat
    prompt: str | None  # completion
    input: list[str] | None  # embeddings: the texts to embed
    params: dict[str, Any]  # SAMPLING_PARAMS
    continuation: bool
    rewrite: str  # a continuation under a grammar: the text to write again first (see below)
    fragments: list[list]  # the rendered prompt: [text, is_control] pairs (`protocol.rendering`)
    end_of_turn: list[str]  # a chat's stops besides the customer's: where the model ends its turn
    cache_key: str  # opaque: a host reuses a held prompt's KV only for a job with the same key (one account)


class AuditPayload(TypedDict):
    id: int  # the audit's (`POST /hosts/api/audits/{id}/verdict`), not a job's
    model: str
    kind: str  # AUDIT
    job: JobPayload  # the audited job as its host received it, without its id
    tokens: list[int]  # the token ids that host reported
    text: str  # the text the customer received
    finish_reason: str  # "stop" or "length"
    seed: int  # the gateway's sampling seed for that job
    logprobs: list[dict] | None  # the log-probability entries reported with the text, when the job asked for them
    draw: int | None  # check this many tokens drawn at random; None (or absent: an older gateway): every token


class RingCheckStage(TypedDict):
    index: int
    start: int  # its layers [start, end)
    end: int
    parts: int  # the parts of its evidence (`GET /hosts/api/ring-inquiries/{id}/evidence`); 0: it kept nothing


class RingCheckPayload(TypedDict):
    """A ring's failed audit to look into (`marketplace.trust.ring_inquiries`, `mahout.ring.blame`):
    the job as the ring's bridge received it (without its id), the answer's tokens as audited
    (its end of generation included) and, per stage, its layers and how many parts of evidence
    it handed over."""

    id: int  # the inquiry's (`POST /hosts/api/ring-inquiries/{id}/verdict`)
    kind: str  # RING_CHECK
    model: str
    job: JobPayload
    tokens: list[int]
    stages: list[RingCheckStage]
    shared_output: bool  # the head and the tail share the output head (both pick)


class AuditVerdict(TypedDict, total=False):
    verdict: str  # one of AUDIT_VERDICTS
    reason: str  # why it failed (with the evidence), or why it was declined
    checked: int
    uncertain: int
    misses: int


def rewrites_delivered(params: dict) -> bool:
    """Whether a continuation with these parameters carries its delivered text apart, to be
    written again under the grammar (`rewrite`) rather than read as prompt: a grammar starts at
    the start of the answer."""
    return bool(params.get("response_format"))


def job_payload_build(
    *,
    job_id: int,
    model: str,
    kind: str,
    messages: list | None,
    prompt: str | None,
    inputs: list[str] | None,
    params: dict,
    fmt: ChatFormat | None = None,
    continuation: bool = False,
    delivered: str = "",
    delivered_tokens: int = 0,
    now: datetime | None = None,
    cache_key: str = "",
) -> JobPayload:
    """The payload of a first attempt, or of a continuation of `delivered`, rendered in the
    model's format `fmt` (required but for embeddings) at the instant `now` the job's request
    fixed (what its template is told the time is: `protocol.rendering.chat_fragments`).

    Embeddings are all or nothing: a second attempt starts over, so it is never a
    continuation. `delivered_tokens` is the gateway's count of `delivered`. `cache_key`: the
    claiming host's key for reusing held prompts (`JobPayload.cache_key`; none: no reuse across jobs).
    """
    if kind == EMBEDDINGS:
        return {"id": job_id, "model": model, "kind": kind, "input": inputs, "continuation": False}
    assert fmt is not None, "a chat or completion job is rendered in its model's format"
    sampling: dict[str, Any] = {key: params.get(key) for key in SAMPLING_PARAMS}
    rewrite = ""
    if continuation:
        sampling["max_tokens"] = max(1, sampling["max_tokens"] - delivered_tokens)
        if rewrites_delivered(sampling):
            # the host writes the delivered text again under the grammar (constrained to
            # exactly that text, and not streamed), then goes on
            rewrite = delivered
        elif kind == CHAT:
            messages = [*(messages or []), {"role": "assistant", "content": delivered}]
        else:
            prompt = (prompt or "") + delivered
    payload: JobPayload = {
        "id": job_id,
        "model": model,
        "kind": kind,
        "messages": messages,
        "prompt": prompt,
        "params": sampling,
        "continuation": continuation,
        "fragments": [
            list(fragment)
            for fragment in job_fragments(fmt, {"kind": kind, "messages": messages, "prompt": prompt}, now=now)
        ],
        "end_of_turn": chat_stops(fmt) if kind == CHAT else [],
    }
    if rewrite:
        payload["rewrite"] = rewrite
    if cache_key:
        payload["cache_key"] = cache_key
    return payload


def job_fragments(fmt: ChatFormat, job: dict, *, now: datetime | None = None) -> list[Fragment]:
    """A job's prompt (`kind` chat or completion) rendered for its model (`protocol.rendering`),
    its template told it is `now` (default: this instant)."""
    kind = job.get("kind")
    if kind == CHAT:
        return chat_fragments(fmt, job.get("messages") or [], now=now)
    if kind == COMPLETION:
        return completion_fragments(fmt, job.get("prompt") or "")
    raise ValueError(f"unsupported job kind: {kind!r}")


def job_stop_strings(job: Mapping[str, Any]) -> list[str]:
    """A job's stop strings: the customer's, then (for a chat) where its model ends a turn. What a
    host stops at, and what the gateway's canary references stopped at."""
    stop = list((job.get("params") or {}).get("stop") or [])
    return stop + [text for text in job.get("end_of_turn") or [] if text not in stop]
